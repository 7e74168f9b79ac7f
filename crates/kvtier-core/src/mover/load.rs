//! The load path as a state machine of rounds, until every key is found or a counted miss:
//!
//! 1. **Plan** (under the catalog lock): each key becomes a DRAM hit, an NVMe read, a remote read
//!    (shared filesystem or object tier), a miss, or waits for another load's read of it.
//! 2. **Submit**: the reads go to their queues first, then the DRAM hits are copied out while the
//!    devices work.
//! 3. **Complete**: each finished read, from whichever tier, is one `PendingRead` judged in one step
//!    (verified, copied out, or a counted miss), then settled with the catalog in one critical
//!    section (made resident or dropped, its pin released, pinned for the caller if asked).
//!
//! The state machine is here; where an NVMe read lands and how it is verified is `landing.rs`, what
//! is particular to remote reads `remote.rs`, and what becomes of reads a load gave up (a hung
//! disk, a frozen gateway or mount) `late.rs`.

use super::BlockBuffer;
use crate::catalog::{Catalog, CatalogGuard, GetStep, LoadOutcome, NvmeRead, Tier, NO_SLOT};
use crate::format::descriptor::DESCRIPTOR_BYTES;
use crate::format::ALIGN_BYTES;
use crate::io::buffer::AlignedBuf;
use crate::io::device::{DeviceQueue, IoOp};
use crate::io::OpKind;
use crate::key::BlockKey;
use crate::remote_tiers::RemoteRead;
use crate::stats::Stats;
use crate::store_state::StoreState;
use crate::tiers::health::Admit;
use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod landing;
mod late;
mod remote;

use landing::{copy_value_out, judge_nvme_read, Landing};
use late::{settle_late_reads, GivenUpReads};

/// Heap-staged loads in flight per call, when no DRAM slot can be had.
const MAX_STAGED_READS: usize = 4;

/// Loads blocks: into the caller's buffers (`Some`), or only into DRAM slots (`None`: promoting them
/// for engine workers that copy out of the shared pool themselves).
pub(crate) fn execute_get(sh: &Arc<StoreState>, keys: &[BlockKey], bufs: Option<&[BlockBuffer]>) -> Vec<bool> {
    let found = Load::new(sh, keys, bufs, None).run();
    super::persist_reused(sh);
    found
}

/// How often the prober looks for a sick remote tier due its probe.
const PROBE_TICK: Duration = Duration::from_millis(200);

/// The store's prober, on a thread of its own until `stop` disconnects: watches the NVMe device
/// queues and the healthy remote tiers' heartbeats (a disk or a refresh that stalls makes its tier
/// sick before a load meets it), settles reads given up that finished since, and reads a block of each sick
/// remote tier whose back-off passed (`RemoteTiers::due_probes`) ahead into DRAM, which is the
/// tier's probe. Off every engine's path: lookups do not offer a sick tier, so no request waits on
/// the probe of a tier that is still down, and a probe that stalls costs nobody a deadline. A probe
/// its load gave up is judged when it finishes late: settled here too, since while the tier is sick
/// no engine's load may come to settle it (and the tier would wait for that answer for ever).
pub(crate) fn probe_sick_tiers(sh: &Arc<StoreState>, stop: &Receiver<()>) {
    while let Err(RecvTimeoutError::Timeout) = stop.recv_timeout(PROBE_TICK) {
        settle_late_reads(sh);
        watch_nvme_devices(sh);
        sh.remote.watch_heartbeats();
        let keys = sh.remote.due_probes(|key| sh.catalog.lock().locate(key).is_some());
        if !keys.is_empty() {
            read_ahead(sh, &keys, true);
        }
    }
}

/// The NVMe tier's heartbeat: a device queue whose operations waited `nvme_read_stall_ms` with none
/// finishing makes the tier sick before a request's read meets the hang, and puts waiting for
/// write-backlog room stop waiting (woken here); the queue moving again ends it.
fn watch_nvme_devices(sh: &StoreState) {
    let limit = Duration::from_millis(sh.config.nvme_read_stall_ms);
    if limit.is_zero() {
        return;
    }
    let now = Instant::now();
    let stalled = sh.devices.iter().filter_map(|device| device.stalled_for(now)).max().filter(|&s| s >= limit);
    let answers = sh.devices.iter().map(DeviceQueue::answers).sum();
    let idle = sh.devices.iter().all(DeviceQueue::idle);
    if sh.nvme_health.watch_devices(stalled, answers, idle) {
        sh.changed.notify_all();
    }
}

/// Makes blocks resident in DRAM and pins each one found, in the same catalog critical section that
/// finishes its load (a store elsewhere could otherwise evict it in between): per key its pinned
/// slot, or `None` for a miss. The caller unpins each slot it got.
pub(crate) fn execute_get_pinned(sh: &Arc<StoreState>, keys: &[BlockKey]) -> Vec<Option<u32>> {
    let mut pinned = vec![None; keys.len()];
    Load::new(sh, keys, None, Some(&mut pinned)).run();
    super::persist_reused(sh);
    pinned
}

/// Reads blocks into DRAM ahead of their load (`Store::read_ahead`): a read counts at its tier and is
/// recorded in `StoreState::read_ahead`; a block already in DRAM, or missing, counts nothing. The blocks
/// are pinned while the call reads, as an acquire's are, so that its later reads cannot evict its
/// first blocks, and released before it returns.
pub(crate) fn execute_read_ahead(sh: &Arc<StoreState>, keys: &[BlockKey]) -> Vec<bool> {
    read_ahead(sh, keys, false)
}

/// `execute_read_ahead`; `probe`: the prober's, which alone may read a sick remote tier.
fn read_ahead(sh: &Arc<StoreState>, keys: &[BlockKey], probe: bool) -> Vec<bool> {
    let mut pinned = vec![None; keys.len()];
    Load { read_ahead: true, probe, ..Load::new(sh, keys, None, Some(&mut pinned)) }.run();
    super::persist_reused(sh);
    let held: Vec<BlockKey> =
        keys.iter().zip(&pinned).filter(|(_, slot)| slot.is_some()).map(|(key, _)| *key).collect();
    if !held.is_empty() {
        sh.catalog.lock().release_readers(&held);
        sh.changed.notify_all();
    }
    pinned.iter().map(Option::is_some).collect()
}

/// A read in flight for one key, from its submission until it is judged. Kept in the load's table
/// by key index, not in the completion: a remote tier hands its read state back only after
/// submitting, and its `on_done` may already have run by then.
enum PendingRead {
    /// From NVMe, landing as its completion's `Landing` says.
    Nvme(NvmeRead),
    /// From a remote tier (shared filesystem, object store), into `slot` (Loading).
    Remote { slot: u32, read: RemoteRead },
}

/// What a read's `on_done` sends back. The landing travels with the I/O operation, not in the
/// load's table, so that a heap buffer the kernel still writes into outlives an unwinding load.
struct Completion {
    index: usize,
    io_result: std::io::Result<()>,
    landing: Landing,
}

/// How a remote read ended, once judged.
#[derive(Clone, Copy)]
enum RemoteVerdict {
    /// Verified by the tier and copied out: the checksum its descriptor records.
    Loaded { value_checksum: u64 },
    /// Counted; the tier quarantined what was bad.
    Miss,
    /// The kernel may still write into the slot: retired, never reused.
    Abandoned,
    /// The load stopped waiting for it (`remote_read_stall_ms`): a counted miss, settled with the
    /// catalog when given up; its slot is freed once the read finishes (`GivenUpReads`).
    GivenUp,
}

/// A judged key, for the catalog to settle.
#[derive(Clone, Copy)]
enum Judged {
    /// A DRAM hit, copied out.
    Dram,
    Nvme(NvmeRead, LoadOutcome),
    Remote {
        slot: u32,
        verdict: RemoteVerdict,
    },
}

impl Judged {
    fn loaded(&self) -> bool {
        match self {
            Judged::Dram => true,
            Judged::Nvme(_, outcome) => matches!(outcome, LoadOutcome::Ok),
            Judged::Remote { verdict, .. } => matches!(verdict, RemoteVerdict::Loaded { .. }),
        }
    }
}

/// What one round planned, by key index.
#[derive(Default)]
struct Round {
    dram_hits: Vec<(usize, u32)>,
    nvme_reads: Vec<(usize, NvmeRead)>,
    /// DRAM slots (Loading) for reads from a remote tier.
    remote_reads: Vec<(usize, u32)>,
}

impl Round {
    fn reads(&self) -> usize {
        self.nvme_reads.len() + self.remote_reads.len()
    }

    fn is_empty(&self) -> bool {
        self.dram_hits.is_empty() && self.reads() == 0
    }
}

/// One call's load, between rounds.
struct Load<'a> {
    sh: &'a Arc<StoreState>,
    keys: &'a [BlockKey],
    bufs: Option<&'a [BlockBuffer]>,
    /// Per key, the slot pinned for the caller (`execute_get_pinned`).
    pinned: Option<&'a mut [Option<u32>]>,
    found: Vec<bool>,
    /// Keys this load counted as misses: with `found`, every key once.
    missed: usize,
    /// The first key never planned.
    next: usize,
    /// Keys another load is reading into DRAM (`GetStep::Pending`): planned again once it is done.
    waiting: Vec<usize>,
    /// By key index: a key has one read at most, ever (a key waiting for another load reads nothing).
    pending: Vec<Option<PendingRead>>,
    reads_in_flight: usize,
    staged_reads_in_flight: usize,
    max_reads_in_flight: usize,
    /// A new round is planned once this many reads are done (or none is in flight): the object tier
    /// reads a round's adjacent blocks with one GET, and rounds of one block would each cost a GET.
    min_round: usize,
    /// Direct reads need O_DIRECT semantics end to end and values that fill whole pages.
    direct_io: bool,
    /// Set while the load can plan nothing: past it, the keys left are given up.
    wait_deadline: Option<Instant>,
    /// This load's keys, built when it first runs short of slots: queued writes it may take are
    /// other blocks' (`Catalog::plan_get_taking_queued_write`).
    spare: Option<HashSet<BlockKey>>,
    done_tx: Sender<Completion>,
    done_rx: Receiver<Completion>,
    /// A read-ahead, not a load: it serves nobody, so it counts no DRAM hit and no miss.
    read_ahead: bool,
    /// The prober's read-ahead (`probe_sick_tiers`): the one load that may read a sick remote tier.
    probe: bool,
    /// The key whose NVMe read is the sick NVMe tier's probe (`NvmeHealth`), until it is judged.
    nvme_probe: Option<usize>,
    /// Remote reads in flight, and since when none of them finished (or the first started).
    remote_reads_in_flight: usize,
    remote_progress: Instant,
    /// Remote bytes received when last looked at (`remote_bytes_arrived`): bytes arriving are
    /// progress too (a slow link or mount).
    remote_bytes_seen: u64,
    /// NVMe reads in flight that may be given up (all but those landing in the caller's memory),
    /// since when none finished (or the first started), and since when the devices answered nothing.
    nvme_reads_in_flight: usize,
    nvme_progress: Instant,
    nvme_device_progress: Instant,
    /// The NVMe devices' answers when last looked at (`nvme_devices_answered`): a slow disk
    /// answering other loads' reads ahead of this one's is not a hung one.
    nvme_answers_seen: u64,
    /// Made with the first read (see `GivenUpReads`).
    given_up: Option<GivenUpReads>,
}

impl<'a> Load<'a> {
    fn new(
        sh: &'a Arc<StoreState>,
        keys: &'a [BlockKey],
        bufs: Option<&'a [BlockBuffer]>,
        pinned: Option<&'a mut [Option<u32>]>,
    ) -> Self {
        assert!(bufs.is_none_or(|b| b.len() == keys.len()), "one caller buffer per key");
        assert!(pinned.as_ref().is_none_or(|p| p.len() == keys.len()), "one pin per key");
        let (done_tx, done_rx) = unbounded();
        // Bounded by the devices' queue depth; reads that need a DRAM slot are further bounded by
        // the slots the catalog can free (then heap-staged, see `MAX_STAGED_READS`).
        let max_reads_in_flight = (sh.config.io_depth * sh.devices.len().max(1)).max(1);
        Load {
            sh,
            keys,
            bufs,
            pinned,
            found: vec![false; keys.len()],
            missed: 0,
            next: 0,
            waiting: Vec::new(),
            pending: (0..keys.len()).map(|_| None).collect(),
            reads_in_flight: 0,
            staged_reads_in_flight: 0,
            max_reads_in_flight,
            min_round: min_round(sh, max_reads_in_flight),
            // An encrypted value is decrypted where it lands, never in the caller's memory.
            direct_io: sh.device_files.iter().all(|d| d.direct)
                && sh.config.object_bytes.is_multiple_of(ALIGN_BYTES)
                && sh.value_cipher.is_none(),
            wait_deadline: None,
            spare: None,
            done_tx,
            done_rx,
            read_ahead: false,
            probe: false,
            nvme_probe: None,
            remote_reads_in_flight: 0,
            remote_progress: Instant::now(),
            remote_bytes_seen: 0,
            nvme_reads_in_flight: 0,
            nvme_progress: Instant::now(),
            nvme_device_progress: Instant::now(),
            nvme_answers_seen: 0,
            given_up: None,
        }
    }

    fn run(mut self) -> Vec<bool> {
        settle_late_reads(self.sh);
        while self.has_unplanned() || self.reads_in_flight > 0 {
            let room = self.max_reads_in_flight.saturating_sub(self.reads_in_flight);
            if self.has_unplanned() && (room >= self.min_round || self.reads_in_flight == 0) {
                let Some(round) = self.plan() else { continue };
                self.submit(round);
            }
            if self.reads_in_flight > 0 {
                self.complete();
            }
        }
        self.finish()
    }

    fn has_unplanned(&self) -> bool {
        self.next < self.keys.len() || !self.waiting.is_empty()
    }

    /// Whether key `i`'s caller buffer can take an O_DIRECT read itself.
    fn direct(&self, i: usize) -> bool {
        self.direct_io && self.bufs.is_some_and(|b| b[i].direct_capable())
    }

    fn spare(&mut self) -> &HashSet<BlockKey> {
        let keys = self.keys;
        self.spare.get_or_insert_with(|| keys.iter().copied().collect())
    }

    fn count_misses(&mut self, keys: usize) {
        if !self.read_ahead {
            Stats::add(&self.sh.stats.misses, keys as u64);
        }
        self.missed += keys;
    }

    /// A load's DRAM hits count once each: those a read-ahead brought in were counted at their tier.
    fn count_dram_hits(&self, hits: &[(usize, u32)]) {
        if self.read_ahead || hits.is_empty() {
            return;
        }
        let brought_in = self.sh.read_ahead.take_served(hits.iter().map(|&(i, _)| &self.keys[i]));
        debug_assert!(brought_in <= hits.len(), "more read-ahead hits than hits");
        Stats::add(&self.sh.stats.read_ahead_hits, brought_in as u64);
        Stats::add(&self.sh.stats.dram_hits, (hits.len() - brought_in) as u64);
    }

    // ---- plan ----

    /// Plans keys, those waiting for other loads first, until the reads in flight would exceed the
    /// budget or a key finds no slot. `None`: nothing was planned and nothing is in flight, so it
    /// waited for the catalog to change (see `wait_for_change`) and the next round tries again.
    fn plan(&mut self) -> Option<Round> {
        let sh = self.sh;
        let mut cat = sh.catalog.lock();
        let mut round = Round::default();
        let mut retry = std::mem::take(&mut self.waiting).into_iter().peekable();
        while self.reads_in_flight + round.reads() < self.max_reads_in_flight {
            let unplanned = (self.next < self.keys.len()).then_some(self.next);
            let Some(i) = retry.peek().copied().or(unplanned) else { break };
            if !self.plan_key(&mut cat, i, &mut round) {
                break;
            }
            if retry.next_if_eq(&i).is_none() {
                self.next += 1;
            }
        }
        self.waiting.extend(retry);
        debug_assert!(self.reads_in_flight + round.reads() <= self.max_reads_in_flight, "a round past the read bound");
        debug_assert!(self.next <= self.keys.len());
        if round.is_empty() && self.reads_in_flight == 0 && self.has_unplanned() {
            self.wait_for_change(&mut cat);
            return None;
        }
        self.wait_deadline = None;
        Some(round)
    }

    /// Plans key `i` into `round`; `false` when it finds no slot now (the round ends there).
    fn plan_key(&mut self, cat: &mut Catalog, i: usize, round: &mut Round) -> bool {
        let keys = self.keys;
        let key = &keys[i];
        // A healthy NVMe tier admits every read: the block's tier is looked up only while it is sick.
        let nvme_sick = self.sh.nvme_health.is_sick();
        let probe = match nvme_sick.then(|| cat.locate(key)).flatten() {
            Some(Tier::Nvme) => match self.sh.nvme_health.admit() {
                Admit::Read => false,
                Admit::Probe => true,
                Admit::Refused => {
                    self.count_misses(1);
                    return true;
                }
            },
            _ => false,
        };
        let mut step = cat.plan_get(key, self.direct(i));
        let can_stage = self.bufs.is_some() && self.staged_reads_in_flight + round.nvme_reads.len() < MAX_STAGED_READS;
        if matches!(step, GetStep::NoSlot) && !can_stage {
            // Loads go first: rather than wait for the write backlog, take the slot of a queued write
            // (not of a block this load still needs).
            step = cat.plan_get_taking_queued_write(key, self.spare());
        }
        match step {
            GetStep::Dram { slot } => round.dram_hits.push((i, slot)),
            GetStep::Nvme(read) => round.nvme_reads.push((i, read)),
            GetStep::Pending => self.waiting.push(i),
            GetStep::Miss => match self.plan_remote_read(cat, key) {
                Ok(Some(slot)) => round.remote_reads.push((i, slot)),
                Ok(None) => self.count_misses(1),
                Err(()) => return false,
            },
            // Every slot is pinned or busy: stage the read in a heap buffer rather than wait
            // (bounded), so that pins held by the engine never stall a load.
            GetStep::NoSlot if can_stage => match cat.plan_get(key, true) {
                GetStep::Nvme(read) => round.nvme_reads.push((i, read)),
                GetStep::Pending => self.waiting.push(i),
                _ => self.count_misses(1),
            },
            GetStep::NoSlot => {
                if probe {
                    self.sh.nvme_health.release_probe();
                }
                return false;
            }
        }
        if probe {
            self.note_nvme_probe(i, round);
        }
        true
    }

    /// Key `i` was admitted as the sick NVMe tier's probe: it is, if its read was planned; else the
    /// probe slot goes back (nothing was learnt).
    fn note_nvme_probe(&mut self, i: usize, round: &Round) {
        if round.nvme_reads.last().is_some_and(|&(planned, _)| planned == i) {
            self.nvme_probe = Some(i);
        } else {
            self.sh.nvme_health.release_probe();
        }
    }

    /// A DRAM slot to load `key` from a remote tier, if one indexes it and the catalog does not. `Err(())`: indexed, but no DRAM slot is free right now (try again later).
    /// Short of slots, it takes the slot of a queued write of a block outside this load (loads first).
    fn plan_remote_read(&mut self, cat: &mut Catalog, key: &BlockKey) -> Result<Option<u32>, ()> {
        let sh = self.sh;
        if !sh.remote.readable(key, self.probe) || cat.has_entry(key) {
            return Ok(None);
        }
        let slot = cat.plan_get_remote(key).or_else(|| cat.plan_get_remote_taking_queued_write(key, self.spare()));
        slot.map(Some).ok_or(())
    }

    /// Out of slots, or every key left waits for another load's read: waits for the catalog to
    /// change; past `slot_wait_ms` of planning nothing, the keys left are counted misses.
    fn wait_for_change(&mut self, cat: &mut CatalogGuard<'_>) {
        let sh = self.sh;
        let slot_wait = Duration::from_millis(sh.config.slot_wait_ms);
        let until = *self.wait_deadline.get_or_insert_with(|| Instant::now() + slot_wait);
        // Only a load short of slots keeps puts off the pool; one waiting for another load's read
        // needs no slot.
        let starved = self.next < self.keys.len();
        if starved {
            cat.load_waits(true);
        }
        let timed_out = cat.wait_until(&sh.changed, until).timed_out();
        if starved {
            cat.load_waits(false);
        }
        if timed_out && Instant::now() >= until {
            debug_assert!(self.next <= self.keys.len());
            Stats::add(&sh.stats.slot_wait_timeouts, 1);
            self.count_misses(self.keys.len() - self.next + self.waiting.len());
            self.next = self.keys.len();
            self.waiting.clear();
        }
    }

    // ---- submit ----

    /// Starts the round's reads, then copies its DRAM hits out while the reads run, and settles
    /// what needed no I/O.
    fn submit(&mut self, round: Round) {
        for (i, read) in round.nvme_reads {
            self.submit_nvme_read(i, read);
        }
        let mut settled = Vec::with_capacity(round.dram_hits.len());
        // In flight beside the NVMe reads: a load of blocks from both tiers waits for the slower.
        for (i, slot) in self.submit_remote_reads(round.remote_reads) {
            settled.push((i, self.tally(i, Judged::Remote { slot, verdict: RemoteVerdict::Miss })));
        }
        self.count_dram_hits(&round.dram_hits);
        for (i, slot) in round.dram_hits {
            if let Some(bufs) = self.bufs {
                copy_value_out(self.sh, slot, &bufs[i]);
            }
            settled.push((i, self.tally(i, Judged::Dram)));
        }
        self.settle(settled);
    }

    fn track(&mut self, i: usize, read: PendingRead) {
        match &read {
            PendingRead::Remote { .. } => {
                if self.remote_reads_in_flight == 0 {
                    self.remote_progress = Instant::now();
                    self.remote_bytes_arrived();
                }
                self.remote_reads_in_flight += 1;
            }
            PendingRead::Nvme(nvme) if !self.lands_direct(i, nvme) => {
                if self.nvme_reads_in_flight == 0 {
                    (self.nvme_progress, self.nvme_device_progress) = (Instant::now(), Instant::now());
                    self.nvme_devices_answered();
                }
                self.nvme_reads_in_flight += 1;
            }
            PendingRead::Nvme(_) => {}
        }
        let earlier = self.pending[i].replace(read);
        assert!(earlier.is_none(), "key {i} already has a read in flight");
        self.reads_in_flight += 1;
        debug_assert!(self.remote_reads_in_flight <= self.reads_in_flight);
    }

    fn submit_nvme_read(&mut self, i: usize, read: NvmeRead) {
        let sh = self.sh;
        let geometry = sh.geometry.expect("NVMe reads need the NVMe tier");
        let landing = self.landing(i, &read);
        let (buf, len, iovecs) = landing.target(sh, &read, self.bufs.map(|b| &b[i]));
        debug_assert!(len as u64 <= geometry.slot_bytes, "a read of {len} bytes past its entry");
        debug_assert!(
            read.loc.offset.is_multiple_of(geometry.slot_bytes)
                && read.loc.offset + geometry.slot_bytes <= geometry.data_bytes(),
            "an NVMe read at {} outside its region's data",
            read.loc.offset
        );
        sh.devices[read.loc.device as usize].read(IoOp {
            kind: OpKind::Read,
            offset: geometry.region_offset(read.loc.region) + read.loc.offset,
            buf,
            len,
            iovecs,
            file: None,
            gate: None,
            on_done: self.sender(i, landing),
        });
        self.track(i, PendingRead::Nvme(read));
    }

    /// Where key `i`'s NVMe read lands: its DRAM slot; with none (`NO_SLOT`), the caller's memory
    /// when that takes an O_DIRECT read, else a heap staging buffer.
    fn landing(&mut self, i: usize, read: &NvmeRead) -> Landing {
        if read.slot != NO_SLOT {
            return Landing::Slot;
        }
        if self.direct(i) {
            return Landing::Direct(AlignedBuf::zeroed(DESCRIPTOR_BYTES));
        }
        self.staged_reads_in_flight += 1;
        Landing::Staged(AlignedBuf::zeroed(self.sh.arena.slot_bytes()))
    }

    // ---- complete ----

    /// Waits for a read to finish, judges it and every other finished one, and settles them. Remote
    /// reads that stall past `RemoteTiers::stall_limit`, and NVMe reads past `nvme_read_stall_ms`,
    /// are given up instead.
    fn complete(&mut self) {
        let Some(first) = self.next_completion() else { return };
        let finished: Vec<Completion> = std::iter::once(first).chain(self.done_rx.try_iter()).collect();
        self.judge_and_settle(finished);
    }

    fn judge_and_settle(&mut self, finished: Vec<Completion>) {
        assert!(finished.len() <= self.reads_in_flight, "more reads finished than were in flight");
        self.reads_in_flight -= finished.len();
        let judged = finished.into_iter().map(|done| self.judge(done)).collect();
        self.settle(judged);
    }

    /// The next finished read; `None` when the remote or the NVMe reads stalled and were given up.
    /// A ranged GET whose bytes still arrive is not stalled: on a slow link one finishes after
    /// seconds, and all of a load's GETs share the link, so none may finish for a while.
    fn next_completion(&mut self) -> Option<Completion> {
        loop {
            let limit = self.sh.remote.stall_limit().filter(|_| self.remote_reads_in_flight > 0);
            let remote_deadline = limit.map(|limit| self.remote_progress + limit);
            let nvme_deadline = self.nvme_stall_deadline();
            let Some(deadline) = remote_deadline.into_iter().chain(nvme_deadline).min() else {
                return Some(self.done_rx.recv().expect("the load holds a sender"));
            };
            match self.done_rx.recv_deadline(deadline) {
                Ok(done) => return Some(done),
                Err(RecvTimeoutError::Timeout) if nvme_deadline.is_some_and(|d| Instant::now() >= d) => {
                    if !self.nvme_waited_out() && self.nvme_devices_answered() {
                        self.nvme_device_progress = Instant::now();
                        continue;
                    }
                    self.give_up_nvme_reads();
                    return None;
                }
                Err(RecvTimeoutError::Timeout) if self.remote_bytes_arrived() => self.remote_progress = Instant::now(),
                Err(RecvTimeoutError::Timeout) => {
                    self.give_up_remote_reads();
                    return None;
                }
                Err(RecvTimeoutError::Disconnected) => unreachable!("the load holds a sender"),
            }
        }
    }

    /// Whether remote reads received bytes since the last look: ranged GETs' bodies, shared-tier
    /// reads' pieces (this store's, any load's: they share the link or the mount). Looked at once per
    /// stall limit, so a tier that delivers nothing ends the wait.
    fn remote_bytes_arrived(&mut self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let stats = &self.sh.stats;
        let received =
            stats.bucket_bytes_received.load(Relaxed).wrapping_add(stats.shared_bytes_received.load(Relaxed));
        let arrived = received != self.remote_bytes_seen;
        self.remote_bytes_seen = received;
        arrived
    }

    /// Judges a finished read, whichever tier it came from: verified and copied out, it is found;
    /// anything else is a counted miss.
    fn judge(&mut self, done: Completion) -> (usize, Judged) {
        let i = done.index;
        let judged = match self.pending[i].take().expect("a read in flight completes exactly once") {
            PendingRead::Nvme(read) => {
                (self.nvme_progress, self.nvme_device_progress) = (Instant::now(), Instant::now());
                if !matches!(done.landing, Landing::Direct(_)) {
                    assert!(self.nvme_reads_in_flight > 0, "an NVMe read finished that was not counted");
                    self.nvme_reads_in_flight -= 1;
                }
                Judged::Nvme(read, self.judge_nvme(i, &read, done.io_result, done.landing))
            }
            PendingRead::Remote { slot, read } => {
                assert!(self.remote_reads_in_flight > 0, "a remote read finished that was not counted");
                self.remote_reads_in_flight -= 1;
                self.remote_progress = Instant::now();
                // SAFETY: the read into our slot finished; an abandoned slot is retired when settled.
                let outcome = unsafe { self.sh.remote.finish_read(read, self.sh.arena.slot_ptr(slot), done.io_result) };
                Judged::Remote { slot, verdict: self.judge_remote(i, slot, outcome) }
            }
        };
        (i, self.tally(i, judged))
    }

    fn judge_nvme(
        &mut self,
        i: usize,
        read: &NvmeRead,
        io_result: std::io::Result<()>,
        landing: Landing,
    ) -> LoadOutcome {
        let (sh, key) = (self.sh, &self.keys[i]);
        if matches!(landing, Landing::Staged(_)) {
            assert!(self.staged_reads_in_flight > 0, "a staged read finished that was not counted");
            self.staged_reads_in_flight -= 1;
        }
        let probe = self.nvme_probe.take_if(|&mut probe| probe == i).is_some();
        let (outcome, observed) = judge_nvme_read(sh, key, read, io_result, landing, self.bufs.map(|b| &b[i]));
        sh.nvme_health.record(probe, observed);
        outcome
    }

    /// Records key `i` as found or a counted miss: every key passes here once, or is given up in
    /// `wait_for_change`.
    fn tally(&mut self, i: usize, judged: Judged) -> Judged {
        debug_assert!(!self.found[i], "key {i} judged twice");
        if judged.loaded() {
            self.found[i] = true;
            if !matches!(judged, Judged::Dram) {
                self.note_read(&self.keys[i]);
            }
        } else {
            self.count_misses(1);
        }
        judged
    }

    /// A block read from a lower tier: a read-ahead's is recorded for the load that serves it; a load's
    /// own read makes any earlier record of it stale.
    fn note_read(&self, key: &BlockKey) {
        if self.read_ahead {
            self.sh.read_ahead.brought_in(key);
        } else {
            self.sh.read_ahead.forget(key);
        }
    }

    /// Hands judged keys to the catalog in one critical section: each load's pin released, a loaded
    /// block made resident (and pinned for the caller right there, so that no store evicts it
    /// first), a failed one dropped.
    fn settle(&mut self, judged: Vec<(usize, Judged)>) {
        if judged.is_empty() {
            return;
        }
        let sh = self.sh;
        let mut cat = sh.catalog.lock();
        for (i, judged) in judged {
            let key = &self.keys[i];
            match judged {
                Judged::Dram => cat.finish_get_dram(key),
                Judged::Nvme(read, outcome) => cat.finish_get_nvme(key, &read, outcome),
                Judged::Remote { slot, verdict: RemoteVerdict::Abandoned } => cat.abandon_get_remote(key, slot),
                Judged::Remote { slot, verdict: RemoteVerdict::Loaded { value_checksum } } => {
                    cat.finish_get_remote(key, slot, Some(value_checksum))
                }
                Judged::Remote { slot, verdict: RemoteVerdict::Miss } => cat.finish_get_remote(key, slot, None),
                Judged::Remote { verdict: RemoteVerdict::GivenUp, .. } => {
                    unreachable!("a given-up read is settled when given up")
                }
            }
            if let Some(pinned) = self.pinned.as_deref_mut().filter(|_| judged.loaded()) {
                debug_assert!(pinned[i].is_none(), "key {i} pinned twice");
                pinned[i] = cat.pin_resident(key);
            }
        }
        drop(cat);
        sh.changed.notify_all();
    }

    fn finish(self) -> Vec<bool> {
        debug_assert!(self.pending.iter().all(Option::is_none), "every read started was judged");
        debug_assert_eq!((self.reads_in_flight, self.staged_reads_in_flight), (0, 0));
        let found = self.found.iter().filter(|&&f| f).count();
        debug_assert_eq!(found + self.missed, self.keys.len(), "every key is found or a counted miss, once");
        if let Some(pinned) = &self.pinned {
            debug_assert!(pinned.iter().zip(&self.found).all(|(pin, &f)| f || pin.is_none()), "a miss is never pinned");
        }
        self.found
    }
}

/// Reads a round waits for: a remote tier's run of adjacent blocks (the object tier's
/// `bucket_get_max_bytes`), at most a quarter of the load's reads in flight so that NVMe reads
/// beside it keep their depth.
fn min_round(sh: &StoreState, max_reads_in_flight: usize) -> usize {
    sh.remote.blocks_per_request().min(max_reads_in_flight / 4).max(1)
}
