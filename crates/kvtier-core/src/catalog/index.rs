//! The catalog's block index (`Index`): its entries by key and by sequence, the counts `gauges()`
//! reads, and the keys whose tiers changed for the service's change log. Entries change only through
//! `Index`, which keeps all of these in step.

use super::NvmeLoc;
use crate::key::BlockKey;
use std::collections::{BTreeSet, HashMap, HashSet};

#[derive(Debug)]
pub(super) struct Entry {
    pub(super) sequence: u64,
    pub(super) value_checksum: u64,
    pub(super) dram: Option<u32>,
    pub(super) dram_ready: bool,
    pub(super) nvme: Option<NvmeLoc>,
    pub(super) write_pending: bool,
    /// Everyone who needs the block to stay loadable (engine pins, loads, scrubs, readers).
    pub(super) pins: u32,
    /// The part of `pins` that copies out of the DRAM slot: the slot stays while any is held.
    pub(super) readers: u32,
    /// A read of the block into a DRAM slot (from NVMe or the shared tier) is in flight: another
    /// load waits for it (`GetStep::Pending`) instead of reading the same bytes again, as the ranks
    /// of one tensor-parallel engine, or engines sharing a prefix, would.
    pub(super) loading: bool,
    /// Kept from NVMe or the remote tiers for want of evidence of reuse (`admission.rs`): the first
    /// reuse (`Catalog::note_reuse`) hands it to the store to write there; eviction drops it.
    pub(super) awaiting_reuse: AwaitingReuse,
}

/// Where a block waits for evidence of reuse before it is written (`write_admission`, per tier).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AwaitingReuse {
    pub nvme: bool,
    pub remote: bool,
    /// Its NVMe write was wanted and the full write backlog held it back (`await_nvme_reuse`), not
    /// the admission policy: leaving DRAM unused it counts in `dropped_behind_backlog`.
    pub behind_backlog: bool,
}

impl AwaitingReuse {
    pub fn any(self) -> bool {
        self.nvme || self.remote
    }
}

impl Entry {
    /// Whether an NVMe write would take this block now: whole in DRAM, not on NVMe, none pending.
    pub(super) fn wants_nvme_write(&self) -> bool {
        self.dram_ready && self.nvme.is_none() && !self.write_pending
    }

    /// Put number `sequence` of a block whose value has `value_checksum`, with no copy yet: callers
    /// set where it lies (`Entry { dram: .., ..Entry::new(..) }`).
    pub(super) fn new(sequence: u64, value_checksum: u64) -> Entry {
        Entry {
            sequence,
            value_checksum,
            dram: None,
            dram_ready: false,
            nvme: None,
            write_pending: false,
            pins: 0,
            readers: 0,
            loading: false,
            awaiting_reuse: AwaitingReuse::default(),
        }
    }

    pub(super) fn visible(&self) -> bool {
        self.dram_ready || self.nvme.is_some()
    }

    /// The local tiers the block is loadable from: bit 0 DRAM, bit 1 NVMe (`service::changes`).
    pub(super) fn tiers(&self) -> u8 {
        self.counted().tiers()
    }

    pub(super) fn counted(&self) -> Counted {
        Counted {
            dram: u64::from(self.dram_ready),
            nvme: u64::from(self.nvme.is_some()),
            visible: u64::from(self.visible()),
        }
    }
}

/// How many entries are DRAM-ready, have an NVMe copy, are visible: kept up to date as entries change,
/// so that `gauges()` (every Stats call) and a scrub's progress never walk millions of entries under
/// the catalog lock (4M blocks: 174 ms for the walk).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Counted {
    pub(super) dram: u64,
    pub(super) nvme: u64,
    pub(super) visible: u64,
}

impl Counted {
    pub(super) fn add(&mut self, other: Counted) {
        self.dram += other.dram;
        self.nvme += other.nvme;
        self.visible += other.visible;
    }

    pub(super) fn sub(&mut self, other: Counted) {
        self.dram -= other.dram;
        self.nvme -= other.nvme;
        self.visible -= other.visible;
    }

    /// One entry's counts as its tier bits (`Entry::tiers`).
    pub(super) fn tiers(self) -> u8 {
        u8::from(self.dram > 0) | (u8::from(self.nvme > 0) << 1)
    }
}

/// The keys whose tier bits (`Entry::tiers`) changed since the change log last read them, so that
/// a refresh of the log looks up those keys instead of walking the index (4M blocks: a 2 s walk
/// under the lock, every 500 ms while an engine follows the log). Kept only once a change log asked
/// (`residency_changes`); past `cap` keys it gives up and forgets them (`overflowed`): the next
/// refresh walks the whole index, as it would have anyway, and a log nobody reads any more costs
/// no memory beyond the cap.
pub(super) struct ResidencyTracker {
    pub(super) keys: HashSet<BlockKey>,
    pub(super) cap: usize,
    pub(super) overflowed: bool,
}

impl ResidencyTracker {
    pub(super) fn note(&mut self, key: &BlockKey, before: u8, after: u8) {
        if before == after || self.overflowed || self.keys.contains(key) {
            return;
        }
        if self.keys.len() >= self.cap {
            self.overflowed = true;
            self.keys = HashSet::new();
            return;
        }
        self.keys.insert(*key);
    }
}

/// `Catalog::residency_changes`'s answer.
#[derive(Debug, PartialEq, Eq)]
pub enum ResidencyChanges {
    /// Every block with a local tier (the first refresh, or more than `cap` keys changed).
    All(HashMap<BlockKey, u8>),
    /// The keys whose tiers changed since the last call, with their tiers now (0: in none).
    Keys(Vec<(BlockKey, u8)>),
}

/// The block index: entries by key, their keys by sequence (a scrub walks that order without sorting
/// the index: with 4M blocks that sort took 440 ms under the lock per 64-block step), and the counts
/// of `Counted`. The entry last handed out by `get_mut` may have changed since: its counts are
/// settled at the next change of the index, and reads of the counts allow for it (`counted()`).
#[derive(Default)]
pub(super) struct Index {
    pub(super) by_key: HashMap<BlockKey, Entry>,
    /// By (sequence, key): sequences are unique in what a store writes, but recovery may adopt a forged
    /// entry that repeats one.
    pub(super) by_sequence: BTreeSet<(u64, BlockKey)>,
    /// The counts of every entry as it was when last settled.
    pub(super) settled: Counted,
    /// The entry `get_mut` handed out last, with its counts as they were then.
    pub(super) changing: Option<(BlockKey, Counted)>,
    /// Keys whose tier bits changed, while a change log follows (`None`: none ever asked).
    pub(super) tracker: Option<ResidencyTracker>,
}

impl Index {
    pub(super) fn get(&self, key: &BlockKey) -> Option<&Entry> {
        self.by_key.get(key)
    }

    pub(super) fn contains_key(&self, key: &BlockKey) -> bool {
        self.by_key.contains_key(key)
    }

    pub(super) fn get_mut(&mut self, key: &BlockKey) -> Option<&mut Entry> {
        self.settle();
        let entry = self.by_key.get_mut(key)?;
        self.changing = Some((*key, entry.counted()));
        Some(entry)
    }

    pub(super) fn insert(&mut self, key: BlockKey, entry: Entry) {
        self.settle();
        self.settled.add(entry.counted());
        self.by_sequence.insert((entry.sequence, key));
        let after = entry.tiers();
        let old = self.by_key.insert(key, entry);
        self.note(&key, old.as_ref().map_or(0, Entry::tiers), after);
        if let Some(old) = old {
            self.forget(&key, &old);
        }
    }

    pub(super) fn remove(&mut self, key: &BlockKey) -> Option<Entry> {
        self.settle();
        let old = self.by_key.remove(key)?;
        self.note(key, old.tiers(), 0);
        self.forget(key, &old);
        Some(old)
    }

    pub(super) fn note(&mut self, key: &BlockKey, before: u8, after: u8) {
        if let Some(tracker) = &mut self.tracker {
            tracker.note(key, before, after);
        }
    }

    pub(super) fn forget(&mut self, key: &BlockKey, old: &Entry) {
        self.settled.sub(old.counted());
        let removed = self.by_sequence.remove(&(old.sequence, *key));
        assert!(removed, "sequence {} of an indexed entry was not in by_sequence", old.sequence);
    }

    pub(super) fn settle(&mut self) {
        self.settled = self.counted();
        if let Some((key, before)) = self.changing.take() {
            let after = self.by_key[&key].tiers();
            self.note(&key, before.tiers(), after);
        }
    }

    /// Starts tracking the keys whose tiers change (again, after an overflow), empty.
    pub(super) fn track(&mut self, cap: usize) -> &mut ResidencyTracker {
        self.settle();
        let tracker =
            self.tracker.get_or_insert_with(|| ResidencyTracker { keys: HashSet::new(), cap, overflowed: false });
        tracker.cap = cap;
        tracker
    }

    /// The counts of every entry as it is now.
    pub(super) fn counted(&self) -> Counted {
        let mut now = self.settled;
        if let Some((key, before)) = &self.changing {
            now.sub(*before);
            // An entry's sequence never changes in place: by_sequence stays right.
            now.add(self.by_key[key].counted());
        }
        now
    }

    /// `(sequence, key, entry)` from the lowest sequence above `after` upward.
    pub(super) fn above_sequence(&self, after: u64) -> impl Iterator<Item = (u64, &BlockKey, &Entry)> {
        let start = (after.saturating_add(1), BlockKey([0; crate::key::KEY_BYTES]));
        self.by_sequence.range(start..).map(|(sequence, key)| (*sequence, key, &self.by_key[key]))
    }

    /// Checks the sequence map and the counts against the entries (tests and debug builds).
    pub(super) fn check(&self) {
        assert_eq!(self.by_key.len(), self.by_sequence.len(), "by_sequence out of step with the entries");
        let mut recount = Counted::default();
        for (key, e) in &self.by_key {
            assert!(self.by_sequence.contains(&(e.sequence, *key)), "{key:?}: by_sequence lost its sequence");
            recount.add(e.counted());
        }
        assert_eq!(recount, self.counted(), "the index's counts drifted from its entries");
    }
}

#[cfg(test)]
impl Index {
    pub(super) fn values(&self) -> impl Iterator<Item = &Entry> {
        self.by_key.values()
    }
}

impl std::ops::Index<&BlockKey> for Index {
    type Output = Entry;
    fn index(&self, key: &BlockKey) -> &Entry {
        &self.by_key[key]
    }
}

impl<'a> IntoIterator for &'a Index {
    type Item = (&'a BlockKey, &'a Entry);
    type IntoIter = std::collections::hash_map::Iter<'a, BlockKey, Entry>;
    fn into_iter(self) -> Self::IntoIter {
        self.by_key.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::test_support::key;

    fn entry(sequence: u64, dram_ready: bool, on_nvme: bool) -> Entry {
        Entry {
            dram: dram_ready.then_some(0),
            dram_ready,
            nvme: on_nvme.then_some(NvmeLoc { device: 0, region: 0, offset: 0 }),
            ..Entry::new(sequence, 0)
        }
    }

    #[test]
    fn counts_follow_a_change_made_through_get_mut_before_the_next_change() {
        let mut index = Index::default();
        index.insert(key(1), entry(1, true, false));
        index.insert(key(2), entry(2, false, true));
        assert_eq!(index.counted(), Counted { dram: 1, nvme: 1, visible: 2 });
        index.get_mut(&key(1)).unwrap().dram_ready = false;
        assert_eq!(index.counted(), Counted { dram: 0, nvme: 1, visible: 1 });
        index.remove(&key(2));
        assert_eq!(index.counted(), Counted::default());
        index.check();
    }

    #[test]
    fn a_walk_by_sequence_starts_past_after_and_a_replaced_entry_moves() {
        let mut index = Index::default();
        for (k, sequence) in [(1, 5), (2, 3), (3, 9)] {
            index.insert(key(k), entry(sequence, true, false));
        }
        let sequences: Vec<u64> = index.above_sequence(3).map(|(sequence, _, _)| sequence).collect();
        assert_eq!(sequences, [5, 9]);
        index.insert(key(2), entry(10, true, false));
        let order: Vec<(u64, BlockKey)> = index.above_sequence(0).map(|(sequence, k, _)| (sequence, *k)).collect();
        assert_eq!(order, [(5, key(1)), (9, key(3)), (10, key(2))]);
        index.check();
    }

    #[test]
    fn the_tracker_notes_tier_changes_only_and_gives_up_past_its_cap() {
        let mut index = Index::default();
        index.insert(key(1), entry(1, false, false));
        index.track(2);
        index.get_mut(&key(1)).unwrap().pins += 1;
        index.insert(key(2), entry(2, true, false));
        assert_eq!(index.tracker.as_ref().unwrap().keys, HashSet::from([key(2)]), "a pin is no tier change");
        index.get_mut(&key(1)).unwrap().dram_ready = true;
        index.settle();
        assert_eq!(index.tracker.as_ref().unwrap().keys, HashSet::from([key(1), key(2)]));
        index.insert(key(3), entry(3, false, true));
        let tracker = index.tracker.as_ref().unwrap();
        assert!(tracker.overflowed && tracker.keys.is_empty(), "past the cap the next refresh walks");
    }
}
