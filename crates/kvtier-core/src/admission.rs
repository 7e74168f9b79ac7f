//! Which stored blocks go below DRAM (the NVMe tier and the remote tiers), and how fast
//! (docs/architecture.md, "Writes below DRAM").
//!
//! DRAM takes every block an engine stores: it is the cheap tier, and the source of cross-engine
//! hits. Most prompts are never seen again, and each byte written below DRAM costs flash endurance
//! or a billed PUT, so with `write_admission: "reuse"` a block goes on down only with evidence that
//! it is used again: it is stored a second time (an engine computed it again: the first copy had
//! left DRAM, or the engine never looked), or a lookup pins it, or a load reads it from DRAM. The
//! store is one per host and namespace, so that evidence comes from every engine on the host. A
//! block that leaves DRAM with no evidence is dropped, not written (`dropped_without_evidence`).
//! CacheLib's navy admits flash writes the same way ("reject first"), for the same reason.
//!
//! `SeenOnce` remembers the blocks stored once; `WriteBudget` is a rate of bytes per day for a tier
//! below DRAM: a write past it is refused (the block stays in DRAM only, counted), never waited for.
//! Under `all` with a bounded NVMe budget, evidence goes first once the budget runs short: a block
//! without evidence takes bytes only while the budget holds more than `EVIDENCE_RESERVE` of its
//! burst, and one it refuses waits in DRAM for evidence (as under `reuse`), so that a budget spent
//! by one-off prompts still has room for the blocks that come back (navy's dynamic admission lets
//! its probability follow the budget; here the budget's last part is kept for evidence).

use crate::key::BlockKey;
use parking_lot::Mutex;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;
use twox_hash::XxHash3_64;

/// Which stored blocks are written below DRAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteAdmission {
    /// Blocks with evidence of reuse (stored twice, pinned or loaded while in DRAM).
    Reuse,
    /// Every stored block, at once (restart persistence of everything; the most writes).
    All,
}

/// Fingerprints of the blocks stored once, direct-mapped: a later block whose fingerprint lands on
/// the same entry replaces it, so the table forgets the oldest evidence first, roughly, in O(1)
/// and in a fixed `8 * capacity` bytes. A forgotten block costs one more sighting before it is
/// written; a false "seen" needs two keys with the same 64-bit fingerprint.
pub(crate) struct SeenOnce {
    fingerprints: Vec<u64>,
}

impl SeenOnce {
    pub(crate) fn new(capacity: usize) -> Self {
        SeenOnce { fingerprints: vec![0; capacity.max(1)] }
    }

    /// Whether `key` was noted before; notes it either way.
    pub(crate) fn seen_before(&mut self, key: &BlockKey) -> bool {
        // Hashed rather than read from the key's bytes: keys are hashes in vLLM, but not every
        // caller's. Two seeds make the entry and the fingerprint independent; the low bit is set so
        // that a fingerprint is never the empty entry's 0.
        let at = (XxHash3_64::oneshot_with_seed(1, &key.0) % self.fingerprints.len() as u64) as usize;
        let fingerprint = XxHash3_64::oneshot_with_seed(2, &key.0) | 1;
        std::mem::replace(&mut self.fingerprints[at], fingerprint) == fingerprint
    }
}

/// A token bucket of bytes for a tier's writes: it refills at `bytes_per_day / 86400` per second up
/// to `burst_s` seconds of that rate, and starts full. Over any span of `t` seconds the tier takes
/// at most `(t + burst_s) * rate` bytes.
#[derive(Debug)]
pub(crate) struct WriteBudget {
    bytes_per_s: f64,
    burst_bytes: f64,
    tokens: f64,
    refilled_at: Instant,
    /// Takes and give-backs so far: the saved budgets are written again only after one
    /// (`Store::save_namespace_state`); a refill alone needs no save, the reader refills from the save's time.
    changes: u64,
    /// Bytes taken since its state was last read for a save: past `SAVE_STEP` of the burst the host
    /// service saves it at once (`Store::save_budgets_if_due`), so that a crash forgets little.
    unsaved_bytes: f64,
}

/// The part of its burst a budget spends before it is saved again, whatever the save period.
const SAVE_STEP: f64 = 1.0 / 64.0;

const SECONDS_PER_DAY: f64 = 86_400.0;

/// What a budget is for: where its tier writes (`of_store`), the store's directories (sorted), bytes
/// a day, burst seconds.
type BudgetKey = (String, Vec<PathBuf>, u64, u64);

/// The write budgets open in this process, by tier and store directories: the namespaces of one
/// store (a host service holds every model of its host) share each tier's, so that a drive, the
/// shared filesystem or the bucket takes its budget a day from the host whichever models write.
static STORE_BUDGETS: Mutex<Vec<(BudgetKey, Weak<Mutex<WriteBudget>>)>> = Mutex::new(Vec::new());

impl WriteBudget {
    /// `bytes_per_day == 0`: unbounded (`None`).
    pub(crate) fn new(bytes_per_day: u64, burst_s: u64, now: Instant) -> Option<Arc<Mutex<WriteBudget>>> {
        if bytes_per_day == 0 {
            return None;
        }
        let bytes_per_s = bytes_per_day as f64 / SECONDS_PER_DAY;
        let burst_bytes = bytes_per_s * burst_s.max(1) as f64;
        Some(Arc::new(Mutex::new(WriteBudget {
            bytes_per_s,
            burst_bytes,
            tokens: burst_bytes,
            refilled_at: now,
            changes: 0,
            unsaved_bytes: 0.0,
        })))
    }

    /// The budget of the tier writing to `place` ("nvme", the shared tier's root, the bucket's URL)
    /// for a store in the directories `paths`: the one another namespace of this process in them
    /// already has, else a new one; `None` when unbounded (0 bytes a day).
    pub(crate) fn of_store(
        place: String,
        paths: &[PathBuf],
        bytes_per_day: u64,
        burst_s: u64,
    ) -> Option<Arc<Mutex<WriteBudget>>> {
        let mut paths = paths.to_vec();
        paths.sort_unstable();
        let key = (place, paths, bytes_per_day, burst_s);
        let mut budgets = STORE_BUDGETS.lock();
        budgets.retain(|(_, budget)| budget.strong_count() > 0);
        if let Some(budget) = budgets.iter().find(|(open, _)| *open == key).and_then(|(_, budget)| budget.upgrade()) {
            return Some(budget);
        }
        let budget = WriteBudget::new(bytes_per_day, burst_s, Instant::now())?;
        budgets.push((key, Arc::downgrade(&budget)));
        Some(budget)
    }

    /// Resumes from a save `elapsed` ago (at open, the last run's `WRITE_BUDGET`): the bytes it had
    /// left then, refilled at the rate since, never more than it holds now (a fresh budget is full).
    pub(crate) fn resume(&mut self, saved_left_bytes: u64, elapsed: std::time::Duration, now: Instant) {
        self.refill(now);
        let resumed = saved_left_bytes as f64 + elapsed.as_secs_f64() * self.bytes_per_s;
        self.tokens = self.tokens.min(resumed).max(0.0);
        debug_assert!(self.tokens <= self.burst_bytes, "a budget holds at most its burst");
    }

    /// Takes and give-backs so far.
    pub(crate) fn changes(&self) -> u64 {
        self.changes
    }

    /// Whether it spent `SAVE_STEP` of its burst since its state was last read for a save.
    pub(crate) fn save_due(&self) -> bool {
        self.unsaved_bytes >= self.burst_bytes * SAVE_STEP
    }

    /// Bytes it would take now, read for a save (`store::budgets`).
    pub(crate) fn left_bytes_for_save(&mut self, now: Instant) -> u64 {
        self.unsaved_bytes = 0.0;
        self.left_bytes(now)
    }

    fn refill(&mut self, now: Instant) {
        let elapsed_s = now.saturating_duration_since(self.refilled_at).as_secs_f64();
        self.tokens = (self.tokens + elapsed_s * self.bytes_per_s).min(self.burst_bytes);
        // A `now` read before another thread's refill must not move the mark back (and refill twice).
        self.refilled_at = self.refilled_at.max(now);
    }

    /// Takes `bytes` if the budget has them now.
    pub(crate) fn try_take(&mut self, bytes: u64, now: Instant) -> bool {
        self.try_take_above(bytes, now, 0.0)
    }

    /// Takes `bytes` if the budget has them now and keeps `reserve` (a fraction of its burst) after.
    fn try_take_above(&mut self, bytes: u64, now: Instant, reserve: f64) -> bool {
        debug_assert!((0.0..1.0).contains(&reserve), "a reserve is part of the burst: {reserve}");
        self.refill(now);
        // A block larger than the whole burst could never pass: it passes when the bucket is full.
        let bytes = (bytes as f64).min(self.burst_bytes);
        if self.tokens + 1e-6 < bytes + reserve * (self.burst_bytes - bytes) {
            return false;
        }
        self.tokens -= bytes;
        self.changes += 1;
        self.unsaved_bytes += bytes;
        true
    }

    /// Gives back `bytes` taken for a write that was not made after all (up to the burst).
    pub(crate) fn give_back(&mut self, bytes: u64) {
        self.refill(Instant::now());
        self.tokens = (self.tokens + bytes as f64).min(self.burst_bytes);
        self.changes += 1;
    }

    /// Bytes the budget would take now.
    pub(crate) fn left_bytes(&mut self, now: Instant) -> u64 {
        self.refill(now);
        self.tokens as u64
    }

    pub(crate) fn bytes_per_day(&self) -> u64 {
        (self.bytes_per_s * SECONDS_PER_DAY).round() as u64
    }
}

/// The part of the NVMe budget's burst that only blocks with evidence of reuse may take, under
/// `all` (module docs).
pub(crate) const EVIDENCE_RESERVE: f64 = 0.5;

/// Which tiers below DRAM a block just stored goes to now, by evidence alone (budgets aside), and
/// whether it has evidence of reuse (stored before) for the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Verdict {
    pub nvme: bool,
    pub remote: bool,
    pub evidence: bool,
}

/// A store's admission below DRAM: the policies (the NVMe tier's, the remote tiers'), what they
/// remember, and the NVMe tier's budget (the remote tiers keep theirs beside their publishers,
/// `RemoteTiers`).
pub(crate) struct Admission {
    nvme: WriteAdmission,
    remote: WriteAdmission,
    seen: Mutex<SeenOnce>,
    /// Shared by every namespace of the process in the same store directories (`WriteBudget::of_store`).
    nvme_budget: Option<Arc<Mutex<WriteBudget>>>,
    /// Whether a block ever waited in DRAM for a use under a policy that otherwise writes at once:
    /// the NVMe budget refused one for want of evidence (`evidence_first`), or a block kept from a
    /// pool taken over could not be written at the open (`note_awaiting_use`). Until then the store
    /// path under `all` need not look for used blocks.
    some_await_use: AtomicBool,
}

impl Admission {
    pub(crate) fn new(
        (nvme, remote): (WriteAdmission, WriteAdmission),
        memory_blocks: usize,
        nvme_budget: Option<Arc<Mutex<WriteBudget>>>,
    ) -> Self {
        let some_await_use = AtomicBool::new(false);
        let mut admission = Admission { nvme, remote, seen: Mutex::new(SeenOnce::new(1)), nvme_budget, some_await_use };
        if admission.awaits_reuse() {
            admission.seen = Mutex::new(SeenOnce::new(memory_blocks));
        }
        admission
    }

    pub(crate) fn admits_store(&self, key: &BlockKey) -> Verdict {
        let (nvme, remote) = (self.nvme == WriteAdmission::All, self.remote == WriteAdmission::All);
        if !self.awaits_reuse() {
            return Verdict { nvme, remote, evidence: false };
        }
        let seen = self.seen.lock().seen_before(key);
        Verdict { nvme: nvme || seen, remote: remote || seen, evidence: seen }
    }

    /// A caller says `key`'s block will be read again (a request's retention hint): evidence of reuse
    /// for its next store, as a first sighting would be. `false` when nothing awaits reuse (every
    /// block is written anyway) and the hint is moot.
    pub(crate) fn note_retained(&self, key: &BlockKey) -> bool {
        if !self.awaits_reuse() {
            return false;
        }
        self.seen.lock().seen_before(key);
        true
    }

    /// Whether a block may wait in DRAM for evidence of reuse (a tier's policy is `reuse`, or NVMe's
    /// budget keeps its last part for evidence): without, no block ever awaits reuse and the store
    /// never looks for reused ones.
    pub(crate) fn awaits_reuse(&self) -> bool {
        self.nvme == WriteAdmission::Reuse || self.remote == WriteAdmission::Reuse || self.evidence_first()
    }

    /// Whether a block may be waiting in DRAM for a use now: a tier's policy is `reuse`, or one was
    /// left waiting under `all` (`some_await_use`).
    pub(crate) fn may_hold_awaiting(&self) -> bool {
        self.nvme == WriteAdmission::Reuse
            || self.remote == WriteAdmission::Reuse
            || self.some_await_use.load(Ordering::Relaxed)
    }

    /// Whether a block the NVMe budget refuses for want of evidence waits in DRAM for it (`all` with
    /// a bounded budget; under `reuse` every NVMe write has evidence).
    pub(crate) fn evidence_first(&self) -> bool {
        self.nvme == WriteAdmission::All && self.nvme_budget.is_some()
    }

    /// Takes one block's bytes from the NVMe tier's budget; `true` when it has them (or is
    /// unbounded). A block without evidence of reuse leaves the budget's reserve to those with.
    pub(crate) fn take_nvme_budget(&self, bytes: u64, evidence: bool) -> bool {
        let reserve = if evidence || !self.evidence_first() { 0.0 } else { EVIDENCE_RESERVE };
        let taken = self.nvme_budget.as_ref().is_none_or(|b| b.lock().try_take_above(bytes, Instant::now(), reserve));
        if !taken && reserve > 0.0 {
            self.some_await_use.store(true, Ordering::Relaxed);
        }
        taken
    }

    /// Gives the NVMe budget back the bytes of a write it paid for that was not made after all (its
    /// block left DRAM meanwhile, no NVMe region was free, or a load took its slot while it queued).
    pub(crate) fn return_nvme_budget(&self, bytes: u64) {
        if let Some(budget) = &self.nvme_budget {
            budget.lock().give_back(bytes);
        }
    }

    /// A block waits in DRAM for a use before its NVMe write although the policy would have written
    /// it (a block kept from a pool taken over that the write backlog or the budget could not take at
    /// the open): from now on the store path looks for used blocks.
    pub(crate) fn note_awaiting_use(&self) {
        self.some_await_use.store(true, Ordering::Relaxed);
    }

    /// The NVMe tier's budget itself; `None` when unbounded.
    pub(crate) fn nvme_write_budget(&self) -> Option<&Arc<Mutex<WriteBudget>>> {
        self.nvme_budget.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn key(i: u64) -> BlockKey {
        let mut k = [0u8; 32];
        k[8..16].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
        k[16..24].copy_from_slice(&(i.wrapping_mul(0xc2b2_ae3d_27d4_eb4f)).to_le_bytes());
        BlockKey(k)
    }

    #[test]
    fn a_block_is_seen_before_only_from_its_second_sighting() {
        let mut seen = SeenOnce::new(1 << 12);
        assert!(!seen.seen_before(&key(1)));
        assert!(!seen.seen_before(&key(2)));
        assert!(seen.seen_before(&key(1)));
        assert!(seen.seen_before(&key(1)), "evidence stays while nothing replaces it");
    }

    #[test]
    fn a_full_table_forgets_but_never_invents_evidence() {
        let mut seen = SeenOnce::new(64);
        let fresh_seen = (0..10_000).filter(|&i| seen.seen_before(&key(i))).count();
        assert_eq!(fresh_seen, 0, "no key seen once is taken for seen twice");
        let remembered = (9_936..10_000).filter(|&i| seen.seen_before(&key(i))).count();
        assert!(remembered > 20, "the newest keys are mostly remembered: {remembered} of 64");
    }

    #[test]
    fn a_budget_takes_its_burst_then_its_rate_and_never_more() {
        let start = Instant::now();
        // 86,400 bytes a day: 1 byte per second, a 100-second burst.
        let budget = WriteBudget::new(86_400, 100, start).unwrap();
        let mut b = budget.lock();
        assert!(b.try_take(60, start) && b.try_take(40, start));
        assert!(!b.try_take(1, start), "the burst is spent");
        assert!(!b.try_take(10, start + Duration::from_secs(9)));
        assert!(b.try_take(10, start + Duration::from_secs(10)), "ten seconds refill ten bytes");
        assert_eq!(b.left_bytes(start + Duration::from_secs(1_000)), 100, "the bucket holds its burst at most");
        assert_eq!(b.bytes_per_day(), 86_400);
    }

    #[test]
    fn a_block_larger_than_the_burst_passes_from_a_full_bucket() {
        let start = Instant::now();
        let budget = WriteBudget::new(86_400, 10, start).unwrap();
        assert!(budget.lock().try_take(1 << 20, start));
        assert!(!budget.lock().try_take(1 << 20, start + Duration::from_secs(5)));
        assert!(WriteBudget::new(0, 10, start).is_none(), "0 bytes a day: unbounded");
    }

    #[test]
    fn policy_all_admits_every_store_and_reuse_the_second_per_tier() {
        use WriteAdmission::{All, Reuse};
        let verdict = |nvme, remote, evidence| Verdict { nvme, remote, evidence };
        let all = Admission::new((All, All), 16, None);
        assert_eq!(all.admits_store(&key(3)), verdict(true, true, false));
        assert!(!all.awaits_reuse(), "unbounded `all` never looks for evidence");
        let reuse = Admission::new((Reuse, Reuse), 16, None);
        let (first, second) = (reuse.admits_store(&key(3)), reuse.admits_store(&key(3)));
        assert_eq!((first, second), (verdict(false, false, false), verdict(true, true, true)));
        assert!(reuse.take_nvme_budget(u64::MAX, false) && reuse.nvme_write_budget().is_none());
        let nvme_only = Admission::new((Reuse, All), 16, None);
        assert_eq!(nvme_only.admits_store(&key(4)), verdict(false, true, false));
        assert_eq!(nvme_only.admits_store(&key(4)), verdict(true, true, true));
    }

    #[test]
    fn a_retained_block_has_evidence_at_its_first_store() {
        use WriteAdmission::{All, Reuse};
        let reuse = Admission::new((Reuse, Reuse), 16, None);
        assert!(reuse.note_retained(&key(6)));
        let first = reuse.admits_store(&key(6));
        assert_eq!(first, Verdict { nvme: true, remote: true, evidence: true });
        assert!(!reuse.admits_store(&key(7)).evidence, "a block nobody said will come back has none");
        let all = Admission::new((All, All), 16, None);
        assert!(!all.note_retained(&key(6)), "under unbounded `all` every block is written: the hint is moot");
    }

    #[test]
    fn under_all_a_bounded_budget_keeps_its_last_part_for_blocks_with_evidence() {
        use WriteAdmission::All;
        // 100 bytes a day with a one-day burst: 100 bytes now, half of them kept for evidence.
        let budget = WriteBudget::new(100, 86_400, Instant::now());
        let all = Admission::new((All, All), 16, budget);
        assert!(all.evidence_first() && all.awaits_reuse());
        let (first, second) = (all.admits_store(&key(5)), all.admits_store(&key(5)));
        assert_eq!((first.evidence, second.evidence), (false, true), "a second store is evidence");
        assert!(!all.may_hold_awaiting(), "no block waits for a use before the budget refused one");
        let taken_without = (0..10).take_while(|_| all.take_nvme_budget(10, false)).count();
        assert_eq!(taken_without, 5, "blocks without evidence stop at the reserve");
        assert!(all.may_hold_awaiting(), "the refused one waits for a use");
        let taken_with = (0..10).take_while(|_| all.take_nvme_budget(10, true)).count();
        assert_eq!(taken_with, 5, "blocks with evidence take the rest");
        assert!(!all.take_nvme_budget(1, true), "and never more than the budget");
    }
}
