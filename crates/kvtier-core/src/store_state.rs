//! `StoreState`, the state one store's threads share: catalog, arena, devices, counters, remote tiers, job bookkeeping.

use crate::admission::Admission;
use crate::catalog::CatalogLock;
use crate::config::StoreConfig;
use crate::format::encrypted::ValueCipher;
use crate::io::buffer::AlignedBuf;
use crate::io::device::DeviceQueue;
use crate::key::BlockKey;
use crate::key::Namespace;
use crate::remote_tiers::{RemoteRead, RemoteTiers};
use crate::stats::Stats;
use crate::tiers::dram::Arena;
use crate::tiers::health::{Admit, Change, Health, HealthPolicy, Observed};
use crate::tiers::nvme::{DeviceFile, Geometry};
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

pub(crate) struct StoreState {
    pub config: StoreConfig,
    pub namespace: Namespace,
    pub geometry: Option<Geometry>,
    pub catalog: CatalogLock,
    /// Signalled whenever slots, pins or pending writes change.
    pub changed: Condvar,
    pub arena: Arena,
    pub devices: Vec<DeviceQueue>,
    pub device_files: Vec<DeviceFile>,
    pub stats: Arc<Stats>,
    /// The remote tiers (`config.shared`, `config.bucket`) with their publishers. Lookups and the
    /// per-engine lookup counts name the tier a block is in ("shared" or "bucket"); the change log's
    /// `TIER_REMOTE` bit covers both.
    pub remote: RemoteTiers,
    /// Whether the NVMe tier is offered (its reads failing in a row make it step aside).
    pub nvme_health: NvmeHealth,
    /// Encryption at rest of NVMe values (`encryption_key_file`); None: written in clear.
    pub value_cipher: Option<Arc<ValueCipher>>,
    /// Buffers of encrypted NVMe writes whose I/O is done, kept for the next (no fresh pages to fault
    /// in and zero for every write); `mover::give_back_write_buffer` bounds them.
    pub(crate) write_buffers: Mutex<Vec<AlignedBuf>>,
    /// Which stored blocks go below DRAM, and the NVMe tier's write budget.
    pub admission: Admission,
    pub(crate) finished: Mutex<HashMap<u64, Vec<bool>>>,
    pub(crate) finished_cv: Condvar,
    pub(crate) loads_active: AtomicUsize,
    pub(crate) stores_active: AtomicUsize,
    /// Signalled (under `activity`) when `loads_active` or `stores_active` drops to zero.
    pub(crate) activity: Mutex<()>,
    pub(crate) activity_cv: Condvar,
    /// Blocks a read-ahead brought into DRAM that no load has served since (`ReadAhead`).
    pub(crate) read_ahead: ReadAhead,
    /// Remote reads that finished after their loads gave them up (`mover::load`).
    pub(crate) late_reads: Arc<LateReads>,
}

/// Reads their loads gave up (`remote_read_stall_ms`, `nvme_read_stall_ms`), until they finish and the next load
/// judges them and frees their slots (`mover::load`). Not judged on the thread that finished them:
/// that is the tier's own, and the store (`StoreState`) the judging needs must never be dropped there.
#[derive(Default)]
pub(crate) struct LateReads {
    /// Given up and not finished: each still writes into a slot of the DRAM pool, so the store
    /// waits for them before it unmaps the pool (`wait_outstanding`).
    outstanding: AtomicUsize,
    /// Finished, with their slots and results, for the next load to judge.
    finished: Mutex<Vec<(u32, LateRead, std::io::Result<()>)>>,
}

/// What a read its load gave up was reading, for its judging once it finishes.
pub(crate) enum LateRead {
    Remote(RemoteRead),
    /// From NVMe (a hung disk); `probe`: it was the sick NVMe tier's probe. Its slot is `NO_SLOT`
    /// when it landed in a heap buffer (which its I/O operation owns).
    Nvme {
        probe: bool,
    },
}

impl LateReads {
    /// A load gives up a read; called before its `on_done` can find it given up.
    pub(crate) fn given_up(&self) {
        self.outstanding.fetch_add(1, Ordering::AcqRel);
    }

    /// A given-up read finished (its `on_done`).
    pub(crate) fn finished(&self, slot: u32, read: LateRead, result: std::io::Result<()>) {
        self.finished.lock().push((slot, read, result));
        let before = self.outstanding.fetch_sub(1, Ordering::AcqRel);
        assert!(before > 0, "a read finished late that was never given up");
    }

    pub(crate) fn take_finished(&self) -> Vec<(u32, LateRead, std::io::Result<()>)> {
        std::mem::take(&mut *self.finished.lock())
    }

    /// Waits until every given-up read finished; `false` if some had not by `deadline`.
    pub(crate) fn wait_outstanding(&self, deadline: Instant) -> bool {
        while self.outstanding.load(Ordering::Acquire) > 0 {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        true
    }
}

/// The NVMe tier's health (`tiers::health`, the rules the remote tiers follow): I/O errors and reads
/// the I/O engine gave up, `sick_after` in a row, make it sick. While sick, a block only NVMe holds is
/// not offered in lookups nor read (a counted `nvme_lookups_skipped` miss the engine recomputes, never
/// a wait on a failing disk); after the back-off one read probes it. A block that fails verification
/// is no failure of the tier (the block is bad, not the disk). Writes are not judged: a failed write
/// leaves its block in DRAM only, which costs no request anything. A hung disk makes it sick at once:
/// a load that waited `nvme_read_stall_ms` with none of its reads finishing, or the prober seeing a
/// device queue whose operations waited that long with none finishing (`watch_devices`, before a
/// request meets it). While hung no read goes, not even a probe (it would hang too), and puts do not
/// wait for write-backlog room (it would not come): the device finishing an operation again, or a
/// given-up read finishing, tells whether the disk answers again.
pub(crate) struct NvmeHealth {
    health: Health,
    stats: Arc<Stats>,
    /// NVMe reads given up and not finished yet.
    hung_reads: AtomicUsize,
    /// The prober saw a device queue stalled past `nvme_read_stall_ms`, and it has not moved since.
    device_hung: AtomicBool,
    /// The devices' answers when the hang was seen: it ends with a new one.
    answers_at_hang: AtomicU64,
}

impl NvmeHealth {
    pub(crate) fn new(policy: HealthPolicy, stats: Arc<Stats>) -> Self {
        let (hung_reads, device_hung, answers_at_hang) =
            (AtomicUsize::new(0), AtomicBool::new(false), AtomicU64::new(0));
        NvmeHealth { health: Health::new(policy, Instant::now()), stats, hung_reads, device_hung, answers_at_hang }
    }

    /// Sick because the disk hangs (a given-up read still out, or a device queue that does not move):
    /// no read, not even a probe, and no wait for write-backlog room.
    pub(crate) fn hung(&self) -> bool {
        self.health.is_sick()
            && (self.hung_reads.load(Ordering::Acquire) > 0 || self.device_hung.load(Ordering::Acquire))
    }

    /// The prober's look at the NVMe device queues: `stalled`, the longest any has had operations
    /// waiting with none finishing, if past `nvme_read_stall_ms`; `answers`, the operations they
    /// answered so far; `idle`, whether none waits. A device answering again, or none of what waited
    /// still waiting, ends the hang (and the tier's sickness, unless a given-up read is still out: its
    /// finishing ends that); nothing else would, since a hung tier is not read. Returns whether the
    /// tier just turned hung.
    pub(crate) fn watch_devices(&self, stalled: Option<std::time::Duration>, answers: u64, idle: bool) -> bool {
        let answered_since = idle || answers > self.answers_at_hang.load(Ordering::Acquire);
        match stalled {
            Some(stalled) if !self.device_hung.load(Ordering::Acquire) => {
                self.answers_at_hang.store(answers, Ordering::Release);
                self.device_hung.store(true, Ordering::Release);
                self.note(self.health.stalled(format!("no NVMe operation finished in {stalled:?}"), Instant::now()));
                true
            }
            None if answered_since && self.device_hung.swap(false, Ordering::AcqRel) => {
                log::info!("kvtier: the NVMe device answers again");
                if self.hung_reads.load(Ordering::Acquire) == 0 {
                    self.record(false, Observed::Hit);
                }
                false
            }
            _ => false,
        }
    }

    /// Whether lookups are offered blocks only NVMe holds; counts the refusal when not.
    pub(crate) fn offered(&self) -> bool {
        let offered = self.health.offered(Instant::now) && !self.hung();
        if !offered {
            Stats::add(&self.stats.nvme_lookups_skipped, 1);
        }
        offered
    }

    /// Whether an NVMe read may start now (`Probe`: it is the one probe; hand `probe: true` to `record`
    /// or call `release_probe`). A refusal is counted.
    pub(crate) fn admit(&self) -> Admit {
        let admit = if self.hung() { Admit::Refused } else { self.health.admit(Instant::now) };
        if admit == Admit::Refused {
            Stats::add(&self.stats.nvme_lookups_skipped, 1);
        }
        admit
    }

    pub(crate) fn is_sick(&self) -> bool {
        self.health.is_sick()
    }

    pub(crate) fn release_probe(&self) {
        self.health.release_probe();
    }

    /// A load gave up `reads` NVMe reads after `stalled` without any finishing: the tier is sick
    /// until one of them finishes (`finished_late`).
    pub(crate) fn gave_up(&self, reads: usize, stalled: std::time::Duration) {
        Stats::add(&self.stats.nvme_reads_given_up, reads as u64);
        self.hung_reads.fetch_add(reads, Ordering::AcqRel);
        self.note(self.health.stalled(format!("no NVMe read finished in {stalled:?}"), Instant::now()));
    }

    /// A read given up (`gave_up`) finished: the disk answers again (its data is not used), or failed.
    pub(crate) fn finished_late(&self, probe: bool, result: &std::io::Result<()>) {
        let before = self.hung_reads.fetch_sub(1, Ordering::AcqRel);
        assert!(before > 0, "an NVMe read finished late that was never given up");
        let observed = match result {
            Ok(()) => Observed::Hit,
            Err(error) => Observed::Failed(error.to_string()),
        };
        self.record(probe, observed);
    }

    /// How an NVMe read ended; counts and logs a change of state once.
    pub(crate) fn record(&self, probe: bool, observed: Observed) {
        self.note(self.health.record(probe, observed, Instant::now()));
    }

    fn note(&self, change: Change) {
        match change {
            Change::None => {}
            Change::Sick { backoff, last_error } => {
                Stats::add(&self.stats.nvme_outages, 1);
                self.stats.nvme_sick.store(1, Ordering::Relaxed);
                log::warn!(
                    "kvtier: the NVMe tier is sick (last: {last_error}); blocks only it holds are misses \
                     until it answers again (first back-off {backoff:?})"
                );
            }
            Change::ProbeFailed { backoff, last_error } => {
                log::debug!("kvtier: the NVMe tier's probe failed ({last_error}); next in {backoff:?}");
            }
            Change::Healthy => {
                self.stats.nvme_sick.store(0, Ordering::Relaxed);
                log::info!("kvtier: the NVMe tier answers again; its blocks are offered again");
            }
        }
    }
}

/// The blocks a read-ahead (`Store::read_ahead`: an engine's scheduler making a lookup's hit resident
/// before the load) brought into DRAM from a lower tier and no load has served yet. The read counted
/// the hit at the tier it came from; the load that serves the block from DRAM then counts
/// `read_ahead_hits`, not `dram_hits`, so that each block a load serves is one hit, of its origin.
/// Bounded: a read-ahead beyond `max_blocks` unserved blocks is forgotten (its load then counts a
/// DRAM hit as well), and a forgotten or evicted entry costs at most one uncounted DRAM hit.
pub(crate) struct ReadAhead {
    unserved: Mutex<HashSet<BlockKey>>,
    max_blocks: usize,
}

impl ReadAhead {
    pub(crate) fn new(max_blocks: usize) -> Self {
        ReadAhead { unserved: Mutex::new(HashSet::new()), max_blocks: max_blocks.max(1) }
    }

    /// A read-ahead read `key` from a lower tier into DRAM.
    pub(crate) fn brought_in(&self, key: &BlockKey) {
        let mut unserved = self.unserved.lock();
        if unserved.len() < self.max_blocks {
            unserved.insert(*key);
        }
    }

    /// A load read `key` from a lower tier itself: any earlier read-ahead of it is stale.
    pub(crate) fn forget(&self, key: &BlockKey) {
        let mut unserved = self.unserved.lock();
        if !unserved.is_empty() {
            unserved.remove(key);
        }
    }

    /// A load serves `keys` from DRAM: how many of them a read-ahead brought in (each counted once).
    pub(crate) fn take_served<'a>(&self, keys: impl Iterator<Item = &'a BlockKey>) -> usize {
        let mut unserved = self.unserved.lock();
        if unserved.is_empty() {
            return 0;
        }
        keys.filter(|key| unserved.remove(*key)).count()
    }
}

impl StoreState {
    pub(crate) fn job_done(&self, counter: &AtomicUsize) {
        let before = counter.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(before > 0, "a job finished that was never counted");
        if before == 1 {
            let _guard = self.activity.lock();
            self.activity_cv.notify_all();
        }
    }

    /// Waits until `counter` is zero; `false` if `deadline` came first.
    pub(crate) fn wait_idle(&self, counter: &AtomicUsize, deadline: Instant) -> bool {
        let mut guard = self.activity.lock();
        while counter.load(Ordering::Acquire) > 0 {
            if self.activity_cv.wait_until(&mut guard, deadline).timed_out() {
                return counter.load(Ordering::Acquire) == 0;
            }
        }
        true
    }
}
