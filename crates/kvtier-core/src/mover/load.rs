//! The load path as a state machine of rounds, until every key is found or a counted miss:
//!
//! 1. **Plan** (under the catalog lock): each key becomes a DRAM hit, an NVMe read, a remote read
//!    (shared filesystem or object tier), a miss, or waits for another load's read of it.
//! 2. **Submit**: the reads go to their queues first, then the DRAM hits are copied out while the
//!    devices work.
//! 3. **Complete**: each finished read, from whichever tier, is one `PendingRead` judged in one step
//!    (verified, copied out, or a counted miss), then settled with the catalog in one critical
//!    section (made resident or dropped, its pin released, pinned for the caller if asked).

use super::{for_each_chunk, slot_mut, slot_ref, BlockBuffer};
use crate::catalog::{Catalog, GetStep, LoadOutcome, NvmeRead, Tier, NO_SLOT};
use crate::format::descriptor::{Descriptor, DESCRIPTOR_BYTES};
use crate::format::encrypted::{decrypt_in_place, DecryptError};
use crate::format::ALIGN_BYTES;
use crate::io::buffer::AlignedBuf;
use crate::io::device::{is_abandoned, IoOp, OnDone};
use crate::io::OpKind;
use crate::key::BlockKey;
use crate::remote_tiers::RemoteRead;
use crate::shared_state::Shared;
use crate::stats::Stats;
use crate::tiers::health::{Admit, Observed};
use crate::tiers::remote::ReadOutcome;
use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};
use parking_lot::{Mutex, MutexGuard};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Heap-staged loads in flight per call, when no DRAM slot can be had.
const MAX_STAGED_READS: usize = 4;

/// Loads blocks: into the caller's buffers (`Some`), or only into DRAM slots (`None`: promoting them
/// for engine workers that copy out of the shared pool themselves).
pub(crate) fn execute_get(sh: &Arc<Shared>, keys: &[BlockKey], bufs: Option<&[BlockBuffer]>) -> Vec<bool> {
    let found = Load::new(sh, keys, bufs, None).run();
    super::persist_reused(sh);
    found
}

/// Makes blocks resident in DRAM and pins each one found, in the same catalog critical section that
/// finishes its load (a store elsewhere could otherwise evict it in between): per key its pinned
/// slot, or `None` for a miss. The caller unpins each slot it got.
pub(crate) fn execute_get_pinned(sh: &Arc<Shared>, keys: &[BlockKey]) -> Vec<Option<u32>> {
    let mut pinned = vec![None; keys.len()];
    Load::new(sh, keys, None, Some(&mut pinned)).run();
    super::persist_reused(sh);
    pinned
}

/// Reads blocks into DRAM ahead of their load (`Store::read_ahead`): a read counts at its tier and is
/// recorded in `Shared::read_ahead`; a block already in DRAM, or missing, counts nothing. The blocks
/// are pinned while the call reads, as an acquire's are, so that its later reads cannot evict its
/// first blocks, and released before it returns.
pub(crate) fn execute_read_ahead(sh: &Arc<Shared>, keys: &[BlockKey]) -> Vec<bool> {
    let mut pinned = vec![None; keys.len()];
    Load { read_ahead: true, ..Load::new(sh, keys, None, Some(&mut pinned)) }.run();
    super::persist_reused(sh);
    let held: Vec<BlockKey> =
        keys.iter().zip(&pinned).filter(|(_, slot)| slot.is_some()).map(|(key, _)| *key).collect();
    if !held.is_empty() {
        sh.catalog.lock().release_readers(&held);
        sh.changed.notify_all();
    }
    pinned.iter().map(Option::is_some).collect()
}

/// Where an NVMe read's bytes land (a remote read always lands in its DRAM slot).
enum Landing {
    /// In its DRAM slot (promoted to the DRAM tier on success).
    Slot,
    /// Value in the caller's memory; the descriptor in this page.
    Direct(AlignedBuf),
    /// In a heap staging buffer, because every DRAM slot was pinned or busy.
    Staged(AlignedBuf),
}

impl Landing {
    /// The memory an NVMe read into this landing fills, as `IoOp` takes it: `(buf, len, iovecs)`,
    /// one buffer, or (direct) the descriptor page then the caller's segments.
    fn target(&self, sh: &Shared, read: &NvmeRead, buf: Option<&BlockBuffer>) -> (*mut u8, usize, Vec<libc::iovec>) {
        match self {
            Landing::Slot => (sh.arena.slot_ptr(read.slot), sh.arena.slot_bytes(), Vec::new()),
            Landing::Staged(staging) => (staging.as_ptr(), staging.len(), Vec::new()),
            Landing::Direct(page) => {
                let segments = &buf.expect("direct reads land in caller buffers").segments;
                let page = libc::iovec { iov_base: page.as_ptr().cast(), iov_len: DESCRIPTOR_BYTES };
                let values = segments.iter().map(|&(ptr, len)| libc::iovec { iov_base: ptr.cast(), iov_len: len });
                let iovecs = std::iter::once(page).chain(values).collect();
                (std::ptr::null_mut(), DESCRIPTOR_BYTES + sh.config.object_bytes, iovecs)
            }
        }
    }

    /// Decrypts an encrypted value where it landed (`encryption_key_file`); a value in clear is left
    /// as it is. A direct read only ever lands in clear (direct reads are off with a key).
    fn open(&mut self, sh: &Shared, read: &NvmeRead) -> Result<(), DecryptError> {
        let bytes = match self {
            Landing::Direct(page) if Descriptor::is_encrypted(page.as_slice()) => return Err(DecryptError::NoKey),
            Landing::Direct(_) => return Ok(()),
            Landing::Staged(staging) => staging.as_mut_slice(),
            // SAFETY: the read into the slot has completed and the slot is ours (Loading).
            Landing::Slot => unsafe { slot_mut(sh.arena.slot_ptr(read.slot), sh.arena.slot_bytes()) },
        };
        let (page, rest) = bytes.split_at_mut(DESCRIPTOR_BYTES);
        decrypt_in_place(sh.value_cipher.as_deref(), page, &mut rest[..sh.config.object_bytes]).map(|_| ())
    }

    /// Checks a finished NVMe read against what the index expects and copies its value out.
    fn verify_and_copy_out(&self, sh: &Shared, key: &BlockKey, read: &NvmeRead, buf: Option<&BlockBuffer>) -> bool {
        match self {
            Landing::Direct(page) => {
                verify_direct(sh, key, read, page, buf.expect("direct reads land in caller buffers"))
            }
            Landing::Staged(staging) => verify_and_copy_out(sh, key, read, staging.as_slice(), buf),
            // SAFETY: the read into the slot has completed and the slot is ours (Loading).
            Landing::Slot => verify_and_copy_out(sh, key, read, unsafe { slot_ref(sh, read.slot) }, buf),
        }
    }

    /// The I/O engine gave the read up: the kernel may still write into a heap buffer, so it is
    /// never freed (a slot is retired by the catalog instead).
    fn abandon(self) {
        match self {
            Landing::Direct(page) | Landing::Staged(page) => std::mem::forget(page),
            Landing::Slot => {}
        }
    }
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

/// A remote read its load gave up, until it finishes.
struct GivenUpRead {
    slot: u32,
    read: RemoteRead,
}

/// A load's remote reads it gave up, by key index, shared with their `on_done`s: a read that
/// finishes after its load gave it up goes to the store's `LateReads` (judged by the next load,
/// `settle_late_reads`) instead of to the load. Locked by the load while it gives reads up, so that
/// every completion is either received by the load or finds its read here.
type GivenUpReads = Arc<Mutex<HashMap<usize, GivenUpRead>>>;

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
    sh: &'a Arc<Shared>,
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
    /// The key whose NVMe read is the sick NVMe tier's probe (`NvmeHealth`), until it is judged.
    nvme_probe: Option<usize>,
    /// Remote reads in flight, and since when none of them finished (or the first started).
    remote_reads_in_flight: usize,
    remote_progress: Instant,
    /// Made with the first remote read (see `GivenUpReads`).
    given_up: Option<GivenUpReads>,
}

impl<'a> Load<'a> {
    fn new(
        sh: &'a Arc<Shared>,
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
            nvme_probe: None,
            remote_reads_in_flight: 0,
            remote_progress: Instant::now(),
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
        let probe = match cat.locate(key) {
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
        if !sh.remote.contains(key) || cat.has_entry(key) {
            return Ok(None);
        }
        let slot = cat.plan_get_shared(key).or_else(|| cat.plan_get_shared_taking_queued_write(key, self.spare()));
        slot.map(Some).ok_or(())
    }

    /// Out of slots, or every key left waits for another load's read: waits for the catalog to
    /// change; past `slot_wait_ms` of planning nothing, the keys left are counted misses.
    fn wait_for_change(&mut self, cat: &mut MutexGuard<'_, Catalog>) {
        let sh = self.sh;
        let slot_wait = Duration::from_millis(sh.config.slot_wait_ms);
        let until = *self.wait_deadline.get_or_insert_with(|| Instant::now() + slot_wait);
        // Only a load short of slots keeps puts off the pool; one waiting for another load's read
        // needs no slot.
        let starved = self.next < self.keys.len();
        if starved {
            cat.load_waits(true);
        }
        let timed_out = sh.changed.wait_until(cat, until).timed_out();
        if starved {
            cat.load_waits(false);
        }
        if timed_out && Instant::now() >= until {
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

    /// The `on_done` of key `i`'s read.
    fn sender(&self, i: usize, landing: Landing) -> OnDone {
        let tx = self.done_tx.clone();
        Box::new(move |io_result| {
            let _ = tx.send(Completion { index: i, io_result, landing });
        })
    }

    /// The `on_done` of key `i`'s remote read: to the load, or, once the load gave it up, to the
    /// store's late reads.
    fn remote_sender(&mut self, i: usize) -> OnDone {
        let given_up = Arc::clone(self.given_up.get_or_insert_with(Default::default));
        let (tx, late_reads) = (self.done_tx.clone(), Arc::clone(&self.sh.late_reads));
        Box::new(move |io_result| {
            let mut given_up = given_up.lock();
            match given_up.remove(&i) {
                Some(late) => {
                    drop(given_up);
                    late_reads.finished(late.slot, late.read, io_result);
                }
                // Sent under the lock: `give_up_remote_reads` receives it or finds the read in the table.
                None => {
                    let _ = tx.send(Completion { index: i, io_result, landing: Landing::Slot });
                }
            }
        })
    }

    fn track(&mut self, i: usize, read: PendingRead) {
        if matches!(read, PendingRead::Remote { .. }) {
            if self.remote_reads_in_flight == 0 {
                self.remote_progress = Instant::now();
            }
            self.remote_reads_in_flight += 1;
        }
        let earlier = self.pending[i].replace(read);
        assert!(earlier.is_none(), "key {i} already has a read in flight");
        self.reads_in_flight += 1;
    }

    fn submit_nvme_read(&mut self, i: usize, read: NvmeRead) {
        let sh = self.sh;
        let geometry = sh.geometry.expect("NVMe reads need the NVMe tier");
        let landing = self.landing(i, &read);
        let (buf, len, iovecs) = landing.target(sh, &read, self.bufs.map(|b| &b[i]));
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

    /// Starts the round's remote reads, each on the tier that reads its key (a tier reads adjacent
    /// blocks of its own together). Returns the reads that did not start (misses the tier counted;
    /// their slots are still ours).
    fn submit_remote_reads(&mut self, reads: Vec<(usize, u32)>) -> Vec<(usize, u32)> {
        let sh = self.sh;
        let mut requests = Vec::with_capacity(reads.len());
        for &(i, slot) in &reads {
            requests.push((self.keys[i], sh.arena.slot_ptr(slot), self.remote_sender(i)));
        }
        // SAFETY: each slot is ours (Loading) until its read is settled; an abandoned one is retired,
        // a given-up one freed once its read finished.
        let started = unsafe { sh.remote.start_reads(requests) };
        let mut not_started = Vec::new();
        for ((i, slot), read) in reads.into_iter().zip(started) {
            match read {
                Some(read) => self.track(i, PendingRead::Remote { slot, read }),
                None => not_started.push((i, slot)),
            }
        }
        not_started
    }

    // ---- complete ----

    /// Waits for a read to finish, judges it and every other finished one, and settles them. Remote
    /// reads that stall past `RemoteTiers::stall_limit` are given up instead.
    fn complete(&mut self) {
        let Some(first) = self.next_completion() else { return };
        let finished: Vec<Completion> = std::iter::once(first).chain(self.done_rx.try_iter()).collect();
        self.judge_and_settle(finished);
    }

    fn judge_and_settle(&mut self, finished: Vec<Completion>) {
        self.reads_in_flight -= finished.len();
        let judged = finished.into_iter().map(|done| self.judge(done)).collect();
        self.settle(judged);
    }

    /// The next finished read; `None` when the remote reads stalled and were given up.
    fn next_completion(&mut self) -> Option<Completion> {
        let limit = self.sh.remote.stall_limit().filter(|_| self.remote_reads_in_flight > 0);
        let Some(limit) = limit else { return Some(self.done_rx.recv().expect("the load holds a sender")) };
        match self.done_rx.recv_deadline(self.remote_progress + limit) {
            Ok(done) => Some(done),
            Err(RecvTimeoutError::Timeout) => {
                self.give_up_remote_reads();
                None
            }
            Err(RecvTimeoutError::Disconnected) => unreachable!("the load holds a sender"),
        }
    }

    /// No remote read finished within the stall limit (a frozen gateway or FUSE daemon): every
    /// remote read still in flight is a counted miss now, its catalog entry gone and its slot kept
    /// out of use until the read finishes. Reads that finished meanwhile are judged as usual.
    fn give_up_remote_reads(&mut self) {
        let (sh, stalled) = (self.sh, self.remote_progress.elapsed());
        let table = Arc::clone(self.given_up.as_ref().expect("remote reads in flight have a table"));
        let mut table = table.lock();
        let arrived: Vec<Completion> = self.done_rx.try_iter().collect();
        let stalled_keys: Vec<usize> = (0..self.pending.len())
            .filter(|&i| matches!(self.pending[i], Some(PendingRead::Remote { .. })))
            .filter(|&i| !arrived.iter().any(|done| done.index == i))
            .collect();
        let mut cat = sh.catalog.lock();
        for &i in &stalled_keys {
            let Some(PendingRead::Remote { slot, read }) = self.pending[i].take() else { unreachable!() };
            cat.give_up_get_shared(&self.keys[i], slot);
            sh.late_reads.given_up();
            table.insert(i, GivenUpRead { slot, read });
        }
        drop(cat);
        for i in &stalled_keys {
            sh.remote.give_up(&table[i].read, stalled);
        }
        drop(table);
        sh.changed.notify_all();
        log::debug!("kvtier: gave up {} remote reads after {stalled:?} without any finishing", stalled_keys.len());
        self.reads_in_flight -= stalled_keys.len();
        self.remote_reads_in_flight -= stalled_keys.len();
        for i in stalled_keys {
            self.tally(i, Judged::Remote { slot: NO_SLOT, verdict: RemoteVerdict::GivenUp });
        }
        self.judge_and_settle(arrived);
    }

    /// Judges a finished read, whichever tier it came from: verified and copied out, it is found;
    /// anything else is a counted miss.
    fn judge(&mut self, done: Completion) -> (usize, Judged) {
        let i = done.index;
        let judged = match self.pending[i].take().expect("a read in flight completes exactly once") {
            PendingRead::Nvme(read) => Judged::Nvme(read, self.judge_nvme(i, &read, done.io_result, done.landing)),
            PendingRead::Remote { slot, read } => {
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
            self.staged_reads_in_flight -= 1;
        }
        let probe = self.nvme_probe.take_if(|&mut probe| probe == i).is_some();
        let (outcome, observed) = judge_nvme_read(sh, key, read, io_result, landing, self.bufs.map(|b| &b[i]));
        sh.nvme_health.record(probe, observed);
        outcome
    }

    /// A remote read the tier judged (it counted and quarantined): a hit is copied out.
    fn judge_remote(&self, i: usize, slot: u32, outcome: ReadOutcome) -> RemoteVerdict {
        match outcome {
            ReadOutcome::Hit => {}
            ReadOutcome::Miss => return RemoteVerdict::Miss,
            ReadOutcome::Abandoned => return RemoteVerdict::Abandoned,
        }
        let (sh, key) = (self.sh, &self.keys[i]);
        // The tier verified the block; the checksum is taken before anything counts it a hit.
        // SAFETY: the read into our slot finished.
        let desc = match Descriptor::decode(&unsafe { slot_ref(sh, slot) }[..DESCRIPTOR_BYTES]) {
            Ok(desc) => desc,
            Err(e) => {
                log::error!(
                    "kvtier: shared block {key:?} passed verification but its descriptor does not decode ({e}); a miss"
                );
                Stats::add(&sh.stats.checksum_failures, 1);
                return RemoteVerdict::Miss;
            }
        };
        if let Some(bufs) = self.bufs {
            copy_value_out(sh, slot, &bufs[i]);
        }
        RemoteVerdict::Loaded { value_checksum: desc.value_checksum }
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
                Judged::Remote { slot, verdict: RemoteVerdict::Abandoned } => cat.abandon_get_shared(key, slot),
                Judged::Remote { slot, verdict: RemoteVerdict::Loaded { value_checksum } } => {
                    cat.finish_get_shared(key, slot, Some(value_checksum))
                }
                Judged::Remote { slot, verdict: RemoteVerdict::Miss } => cat.finish_get_shared(key, slot, None),
                Judged::Remote { verdict: RemoteVerdict::GivenUp, .. } => {
                    unreachable!("a given-up read is settled when given up")
                }
            }
            if let Some(pinned) = self.pinned.as_deref_mut().filter(|_| judged.loaded()) {
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

/// How an NVMe read ended, counted, and what it says of the tier's health (a block that fails
/// verification is bad, the disk is not).
fn judge_nvme_read(
    sh: &Shared,
    key: &BlockKey,
    read: &NvmeRead,
    io_result: std::io::Result<()>,
    mut landing: Landing,
    buf: Option<&BlockBuffer>,
) -> (LoadOutcome, Observed) {
    match io_result {
        Err(e) if is_abandoned(&e) => {
            log::error!("kvtier: read of block {key:?} abandoned by a broken I/O engine; counted as a miss");
            Stats::add(&sh.stats.io_errors, 1);
            landing.abandon();
            (LoadOutcome::Abandoned, Observed::Failed("the I/O engine gave the read up".to_string()))
        }
        Err(e) => {
            log::warn!("kvtier: read of block {key:?} failed: {e}; counted as a miss");
            Stats::add(&sh.stats.io_errors, 1);
            (LoadOutcome::IoError, Observed::Failed(e.to_string()))
        }
        Ok(()) if let Err(e) = landing.open(sh, read) => {
            log::warn!("kvtier: block {key:?} on NVMe is encrypted and {e}; counted as a miss");
            Stats::add(&sh.stats.nvme_auth_failures, 1);
            (LoadOutcome::Corrupt, Observed::CleanMiss)
        }
        Ok(()) if landing.verify_and_copy_out(sh, key, read, buf) => {
            Stats::add(&sh.stats.nvme_hits, 1);
            Stats::add(&sh.stats.bytes_read_nvme, sh.arena.slot_bytes() as u64);
            (LoadOutcome::Ok, Observed::Hit)
        }
        Ok(()) => {
            log::warn!("kvtier: block {key:?} failed verification on load; counted as a miss");
            Stats::add(&sh.stats.checksum_failures, 1);
            (LoadOutcome::Corrupt, Observed::CleanMiss)
        }
    }
}

/// Reads a round waits for: a remote tier's run of adjacent blocks (the object tier's
/// `bucket_get_max_bytes`), at most a quarter of the load's reads in flight so that NVMe reads
/// beside it keep their depth.
fn min_round(sh: &Shared, max_reads_in_flight: usize) -> usize {
    sh.remote.blocks_per_request().min(max_reads_in_flight / 4).max(1)
}

/// Judges the remote reads that finished after their loads gave them up, and frees their slots.
fn settle_late_reads(sh: &Shared) {
    let late = sh.late_reads.take_finished();
    if late.is_empty() {
        return;
    }
    let mut freed = Vec::with_capacity(late.len());
    for (slot, read, io_result) in late {
        // SAFETY: the read into the slot finished; the slot is retired, used by nothing else.
        let outcome = unsafe { sh.remote.finish_late(read, sh.arena.slot_ptr(slot), io_result) };
        freed.push((slot, outcome == ReadOutcome::Abandoned));
    }
    let mut cat = sh.catalog.lock();
    for (slot, abandoned) in freed {
        cat.finish_given_up_read(slot, abandoned);
    }
    drop(cat);
    sh.changed.notify_all();
}

/// Hashes the value a direct read left in the caller's memory.
fn checksum_segments(buf: &BlockBuffer) -> u64 {
    let mut hasher = crate::format::checksum_hasher();
    for &(ptr, len) in &buf.segments {
        // SAFETY: the read filled the segment; the caller keeps it alive (submission contract).
        std::hash::Hasher::write(&mut hasher, unsafe { std::slice::from_raw_parts(ptr, len) });
    }
    std::hash::Hasher::finish(&hasher)
}

/// Checks a direct read: the descriptor landed in `page`, the value in the caller's segments.
fn verify_direct(sh: &Shared, key: &BlockKey, read: &NvmeRead, page: &AlignedBuf, buf: &BlockBuffer) -> bool {
    let Ok(desc) = Descriptor::decode(page.as_slice()) else { return false };
    desc.key == *key
        && desc.namespace == sh.namespace
        && desc.value_bytes as usize == sh.config.object_bytes
        && desc.sequence == read.sequence
        && desc.value_checksum == read.value_checksum
        && checksum_segments(buf) == desc.value_checksum
}

/// Copies a slot's value out to the caller's segments (a DRAM hit).
///
/// SAFETY (callers): the slot is pinned and the caller's segments are valid for writing
/// (submission contract).
fn copy_value_out(sh: &Shared, slot: u32, buf: &BlockBuffer) {
    let mut value = unsafe { sh.arena.slot_ptr(slot).add(DESCRIPTOR_BYTES) };
    for &(segment, len) in &buf.segments {
        unsafe {
            std::ptr::copy_nonoverlapping(value, segment, len);
            value = value.add(len);
        }
    }
    Stats::add(&sh.stats.bytes_copied_out, sh.config.object_bytes as u64);
}

/// Checks a slot just read from NVMe against what the index expects and copies its value out.
/// The value is hashed and copied in cache-sized chunks (one pass over memory instead of two); if the
/// checksum then fails the caller's buffer holds unspecified bytes and the block is reported a miss.
fn verify_and_copy_out(sh: &Shared, key: &BlockKey, read: &NvmeRead, bytes: &[u8], buf: Option<&BlockBuffer>) -> bool {
    let Ok(desc) = Descriptor::decode(&bytes[..DESCRIPTOR_BYTES]) else { return false };
    let object_bytes = sh.config.object_bytes;
    let header_ok = desc.key == *key
        && desc.namespace == sh.namespace
        && desc.value_bytes as usize == object_bytes
        && desc.sequence == read.sequence
        && desc.value_checksum == read.value_checksum;
    if !header_ok {
        return false;
    }
    let value = &bytes[DESCRIPTOR_BYTES..DESCRIPTOR_BYTES + object_bytes];
    let Some(buf) = buf else { return crate::format::checksum(value) == desc.value_checksum };
    let mut hasher = crate::format::checksum_hasher();
    for_each_chunk(buf, |dst, at, n| {
        let chunk = &value[at..at + n];
        std::hash::Hasher::write(&mut hasher, chunk);
        // SAFETY: the caller's segment is valid for writing (submission contract).
        unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), dst, n) };
    });
    Stats::add(&sh.stats.bytes_copied_out, object_bytes as u64);
    std::hash::Hasher::finish(&hasher) == desc.value_checksum
}
