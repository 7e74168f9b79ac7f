//! Upkeep under the catalog lock (`kvtier verify`, `kvtier trim`, `kvtier inspect`; the walks
//! themselves live in `maintenance.rs`): a scrub walks the index by sequence and pins what it checks,
//! quarantine drops the copies it found bad, and trim frees what a plan selects and nothing uses.

use super::regions::RegionState;
use super::slots::SlotState;
use super::{Catalog, MetaWrite, NvmeLoc};
use crate::key::BlockKey;

/// One block a scrub checks: where its copies are, and what they must hold.
#[derive(Debug, Clone, Copy)]
pub struct ScrubTarget {
    pub key: BlockKey,
    pub sequence: u64,
    pub value_checksum: u64,
    /// The DRAM slot holding it (resident, not being written to NVMe).
    pub dram: Option<u32>,
    pub nvme: Option<NvmeLoc>,
}

/// What `Catalog::trim` removes.
#[derive(Debug, Clone, Copy)]
pub enum TrimPlan {
    /// Everything not in use.
    All,
    /// Blocks with a sequence below this.
    OlderThan(u64),
    /// Oldest whole NVMe regions until the tier uses at most this many bytes.
    NvmeTo(u64),
}

impl TrimPlan {
    /// Whether the plan removes a block of this sequence wherever it is (`NvmeTo` picks regions,
    /// not blocks).
    fn selects(self, sequence: u64) -> bool {
        match self {
            TrimPlan::All => true,
            TrimPlan::OlderThan(cutoff) => sequence < cutoff,
            TrimPlan::NvmeTo(_) => false,
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct TrimCounts {
    pub dram_blocks: u64,
    pub dram_bytes: u64,
    pub nvme_blocks: u64,
    pub nvme_bytes: u64,
    pub regions_freed: u64,
    pub skipped_in_use: u64,
}

/// A region `trim` emptied, to be zeroed on disk, then handed back with `release_trimmed`.
#[derive(Debug, Clone, Copy)]
pub struct TrimmedRegion {
    pub device: usize,
    pub region: u32,
    pub region_seq: u64,
}

/// The copies of a region's blocks that still live there, as `trim` weighs them:
/// `(key, sequence, pinned)`.
type Living = Vec<(BlockKey, u64, bool)>;

/// Scrubs: a walk by sequence, one pinned block at a time.
impl Catalog {
    /// Up to `max` visible blocks with a sequence above `after`, lowest first: `(sequence, key)`.
    pub fn scrub_batch(&self, after: u64, max: usize) -> Vec<(u64, BlockKey)> {
        self.index
            .above_sequence(after)
            .filter(|(_, _, e)| e.visible())
            .map(|(sequence, key, _)| (sequence, *key))
            .take(max)
            .collect()
    }

    /// Pins one block for a scrub if it is still that version and visible (release with `unpin`).
    /// A DRAM copy is offered only when no NVMe write reads its slot (its descriptor page is
    /// stamped then).
    pub fn scrub_pin(&mut self, key: &BlockKey, sequence: u64) -> Option<ScrubTarget> {
        let e = self.index.get_mut(key).filter(|e| e.sequence == sequence && e.visible())?;
        e.pin_reader();
        let dram = match (e.dram_ready, e.dram) {
            (true, Some(slot)) if !self.slots.get(slot).writing => Some(slot),
            _ => None,
        };
        Some(ScrubTarget { key: *key, sequence, value_checksum: e.value_checksum, dram, nvme: e.nvme })
    }

    /// A scrub of one block is over: quarantines the bad copies (`(DRAM, NVMe)` quarantined) and
    /// releases the scrub's pin, if the entry is still the version it pinned.
    pub fn scrub_done(
        &mut self,
        key: &BlockKey,
        sequence: u64,
        bad_dram: Option<u32>,
        bad_nvme: Option<NvmeLoc>,
        meta: &mut Vec<MetaWrite>,
    ) -> (bool, bool) {
        let dram = bad_dram.is_some_and(|slot| self.quarantine_dram(key, slot));
        let nvme = bad_nvme.is_some_and(|loc| self.quarantine_nvme(key, loc, meta));
        if self.index.get(key).is_some_and(|e| e.sequence == sequence) {
            self.release_readers(std::slice::from_ref(key));
        }
        (dram, nvme)
    }

    /// The highest sequence handed out so far (0: none yet).
    pub fn newest_sequence(&self) -> u64 {
        debug_assert!(self.next_sequence >= 1, "sequences start at 1");
        self.next_sequence - 1
    }

    /// Visible blocks (for progress totals).
    pub fn visible_blocks(&self) -> usize {
        self.index.counted().visible as usize
    }

    /// Lowest and highest sequence of the visible blocks.
    pub fn sequence_range(&self) -> Option<(u64, u64)> {
        let visible = |&(sequence, key): &(u64, BlockKey)| self.index.by_key[&key].visible().then_some(sequence);
        let lowest = self.index.by_sequence.iter().find_map(visible)?;
        let highest = self.index.by_sequence.iter().rev().find_map(visible)?;
        debug_assert!(lowest <= highest);
        Some((lowest, highest))
    }
}

/// Quarantine: copies a scrub found bad are never served again.
impl Catalog {
    /// A scrub found the DRAM copy in `slot` bad: no load is served from it any more. The slot is
    /// freed now when the scrub's own pin is the only one; else (a reader is copying out of it) it
    /// stays allocated, invisible, until eviction takes it once its pins are gone.
    pub fn quarantine_dram(&mut self, key: &BlockKey, slot: u32) -> bool {
        let Some(e) = self.index.get_mut(key) else { return false };
        if e.dram != Some(slot) || !e.dram_ready || self.slots.get(slot).writing {
            return false;
        }
        e.dram_ready = false;
        if e.readers > 1 {
            self.slots.quarantine(slot);
            return true;
        }
        e.dram = None;
        let gone = e.nvme.is_none() && !e.write_pending && e.pins <= 1;
        if gone {
            self.index.remove(key);
        }
        debug_assert_eq!(self.slots.get(slot).state, SlotState::Resident, "a ready copy's slot {slot}");
        self.slots.free(slot);
        true
    }

    /// A scrub found the NVMe copy at `loc` bad: no load plans it again, and its region's trailer
    /// is rewritten without it (a sealed region: `meta`), so recovery does not adopt it either.
    pub fn quarantine_nvme(&mut self, key: &BlockKey, loc: NvmeLoc, meta: &mut Vec<MetaWrite>) -> bool {
        let Some(e) = self.index.get_mut(key) else { return false };
        if e.nvme != Some(loc) {
            return false;
        }
        e.nvme = None;
        let gone = !e.visible() && e.dram.is_none() && !e.write_pending && e.pins <= 1;
        if gone {
            self.index.remove(key);
        }
        self.forget_trailer_entry(key, loc, meta);
        true
    }

    /// Removes one entry from its region's trailer list; a sealed region's trailer is rewritten.
    fn forget_trailer_entry(&mut self, key: &BlockKey, loc: NvmeLoc, meta: &mut Vec<MetaWrite>) {
        let Some(nvme) = self.nvme.as_mut() else { return };
        meta.extend(nvme.forget_entry(key, loc));
    }
}

/// Trim: frees what a plan selects, DRAM copies first, then NVMe regions oldest first.
impl Catalog {
    /// Removes what `plan` selects and nothing in use (pinned, being filled, loaded or written).
    pub fn trim(&mut self, plan: TrimPlan, meta: &mut Vec<MetaWrite>, freed: &mut Vec<TrimmedRegion>) -> TrimCounts {
        let mut counts = TrimCounts::default();
        // Not for NvmeTo: the pool is preallocated, dropping blocks frees no memory.
        if !matches!(plan, TrimPlan::NvmeTo(_)) {
            self.trim_dram(plan, &mut counts);
        }
        let Some(nvme) = self.nvme.as_ref() else { return counts };
        let region_bytes = nvme.geometry().region_bytes;
        let regions = nvme.in_use_oldest_first();
        let mut used = regions.len() as u64 * region_bytes;
        for (device, region) in regions {
            if matches!(plan, TrimPlan::NvmeTo(target) if used <= target) {
                break;
            }
            if self.trim_region(plan, (device, region), &mut counts, meta, freed) {
                assert!(used >= region_bytes, "more regions freed than were in use");
                used -= region_bytes;
            }
        }
        counts
    }

    /// Frees the selected DRAM copies nothing uses.
    fn trim_dram(&mut self, plan: TrimPlan, counts: &mut TrimCounts) {
        for slot in 0..self.slots.len() as u32 {
            let s = self.slots.get(slot);
            let Some(key) = s.key else { continue };
            if s.state != SlotState::Resident {
                continue;
            }
            let Some(e) = self.index.get_mut(&key) else { continue };
            if e.dram != Some(slot) || !plan.selects(e.sequence) {
                continue;
            }
            if e.pins > 0 || s.writing || e.write_pending {
                counts.skipped_in_use += 1;
                continue;
            }
            debug_assert!(e.readers == 0, "an unpinned block with a reader");
            e.dram = None;
            e.dram_ready = false;
            if e.nvme.is_none() {
                self.index.remove(&key);
            }
            self.slots.free(slot);
            counts.dram_blocks += 1;
            counts.dram_bytes += self.slot_bytes;
        }
    }

    /// One region's part of a trim: the whole region when all of it is selected and nothing pins
    /// it, else (never for `NvmeTo`, which frees whole regions only) its selected entries one by
    /// one. Whether the whole region went.
    fn trim_region(
        &mut self,
        plan: TrimPlan,
        (device, region): (usize, u32),
        counts: &mut TrimCounts,
        meta: &mut Vec<MetaWrite>,
        freed: &mut Vec<TrimmedRegion>,
    ) -> bool {
        let r = self.nvme.as_ref().unwrap().region(device, region);
        let living: Living = r
            .entries
            .iter()
            .filter_map(|t| {
                let e = self.index.get(&t.key).filter(|e| e.lives_in(device, region))?;
                Some((t.key, e.sequence, e.pins > 0))
            })
            .collect();
        let all_selected =
            matches!(plan, TrimPlan::NvmeTo(_)) || living.iter().all(|&(_, sequence, _)| plan.selects(sequence));
        let pinned = r.entries.iter().any(|t| self.index.pins_region_entry(device, region, t));
        let state = r.state;
        if state == RegionState::Sealed && all_selected && !pinned {
            self.free_trimmed_region(device, region, counts, freed);
            return true;
        }
        if matches!(plan, TrimPlan::NvmeTo(_)) || state == RegionState::Sealing {
            // A region whose trailer is being written waits.
            counts.skipped_in_use += living.len() as u64;
            return false;
        }
        self.trim_entries(plan, living, counts, meta);
        false
    }

    /// The whole region goes: its blocks' copies there forgotten, the region held until the caller
    /// has zeroed its trailer and first entry on disk (`release_trimmed`).
    fn free_trimmed_region(
        &mut self,
        device: usize,
        region: u32,
        counts: &mut TrimCounts,
        freed: &mut Vec<TrimmedRegion>,
    ) {
        let nvme = self.nvme.as_mut().unwrap();
        let region_bytes = nvme.geometry().region_bytes;
        let (region_seq, entries) = nvme.hold_trimmed(device, region);
        counts.nvme_blocks += self.forget_region_copies(device, region, &entries);
        freed.push(TrimmedRegion { device, region, region_seq });
        counts.regions_freed += 1;
        counts.nvme_bytes += region_bytes;
    }

    /// Some entries of a region go, forgotten one by one (the region's space comes back when it is
    /// reused).
    fn trim_entries(&mut self, plan: TrimPlan, living: Living, counts: &mut TrimCounts, meta: &mut Vec<MetaWrite>) {
        for (key, sequence, pinned) in living {
            if !plan.selects(sequence) {
                continue;
            }
            let e = self.index.get_mut(&key).unwrap();
            if pinned || e.write_pending {
                counts.skipped_in_use += 1;
                continue;
            }
            let loc = e.nvme.unwrap();
            e.nvme = None;
            if e.dram.is_none() {
                self.index.remove(&key);
            }
            self.forget_trailer_entry(&key, loc, meta);
            counts.nvme_blocks += 1;
        }
    }

    /// The trimmed regions' trailers and first entries are zeroed on disk: they are free now.
    pub fn release_trimmed(&mut self, freed: &[TrimmedRegion]) {
        let Some(nvme) = self.nvme.as_mut() else { return };
        for f in freed {
            nvme.release_trimmed(f.device, f.region, f.region_seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::test_support::{dram_catalog, key, land, nvme_catalog, put, recovered_catalog};
    use crate::catalog::PutStep;

    fn trim(cat: &mut Catalog, plan: TrimPlan) -> (TrimCounts, Vec<TrimmedRegion>) {
        let (mut meta, mut freed) = (Vec::new(), Vec::new());
        let counts = cat.trim(plan, &mut meta, &mut freed);
        land(cat, meta);
        cat.check_invariants();
        (counts, freed)
    }

    #[test]
    fn a_scrub_walks_visible_blocks_by_sequence_and_pins_each_as_a_reader() {
        let mut cat = dram_catalog(4);
        for k in [3, 1, 2] {
            put(&mut cat, key(k));
        }
        let batch = cat.scrub_batch(0, 2);
        assert_eq!(batch, [(1, key(3)), (2, key(1))]);
        assert_eq!(cat.scrub_batch(2, 10), [(3, key(2))]);
        let target = cat.scrub_pin(&key(1), 2).expect("visible at that sequence");
        assert!(cat.scrub_pin(&key(1), 1).is_none(), "another version");
        assert_eq!((cat.index[&key(1)].pins, cat.index[&key(1)].readers), (1, 1));
        let mut meta = Vec::new();
        assert_eq!(cat.scrub_done(&key(1), 2, target.dram, None, &mut meta), (true, false));
        assert!(!cat.has_entry(&key(1)), "its only copy was bad");
        assert_eq!(cat.sequence_range(), Some((1, 3)));
        cat.check_invariants();
    }

    #[test]
    fn a_bad_dram_copy_under_a_second_reader_keeps_its_slot_until_eviction() {
        let mut cat = dram_catalog(1);
        let slot = put(&mut cat, key(0));
        let target = cat.scrub_pin(&key(0), 1).unwrap();
        assert_eq!(cat.pin_resident(&key(0)), Some(slot));
        let mut meta = Vec::new();
        assert_eq!(cat.scrub_done(&key(0), 1, target.dram, None, &mut meta), (true, false));
        assert!(!cat.contains(&key(0)) && cat.slots.get(slot).key == Some(key(0)), "the reader's slot stays");
        cat.release_readers(&[key(0)]);
        assert!(matches!(cat.plan_put(&key(1)), PutStep::Fill { slot: s, .. } if s == slot));
        cat.check_invariants();
    }

    #[test]
    fn trim_all_frees_everything_but_what_is_pinned() {
        let mut cat = nvme_catalog(5, 3, 2);
        for k in 0..5 {
            put(&mut cat, key(k));
        }
        // Regions 0 (keys 0 and 1) and 1 (2 and 3) are sealed, 2 (key 4) is open.
        assert_eq!(cat.pin_prefix(&[key(0)]), 1);
        let (counts, freed) = trim(&mut cat, TrimPlan::All);
        assert_eq!((counts.dram_blocks, counts.skipped_in_use), (4, 2), "key(0): its DRAM and NVMe copies");
        assert_eq!(counts.nvme_blocks, 4);
        assert_eq!(freed.iter().map(|f| f.region).collect::<Vec<_>>(), [1], "region 0 is pinned, 2 is open");
        assert!(cat.contains(&key(0)) && (1..5).all(|k| !cat.has_entry(&key(k))));
        cat.release_trimmed(&freed);
        cat.check_invariants();
    }

    #[test]
    fn trim_older_than_keeps_newer_blocks() {
        let mut cat = nvme_catalog(4, 4, 1);
        for k in 0..4 {
            put(&mut cat, key(k));
        }
        let (counts, freed) = trim(&mut cat, TrimPlan::OlderThan(3));
        assert_eq!((counts.dram_blocks, counts.nvme_blocks, counts.regions_freed), (2, 2, 2));
        assert!(!cat.has_entry(&key(0)) && !cat.has_entry(&key(1)));
        assert!(cat.contains(&key(2)) && cat.contains(&key(3)));
        assert_eq!(freed.iter().map(|f| f.region).collect::<Vec<_>>(), [0, 1]);
    }

    #[test]
    fn trim_nvme_to_frees_the_oldest_whole_regions_and_holds_them_until_released() {
        let mut cat = recovered_catalog(4);
        let region_bytes = cat.nvme.as_ref().unwrap().geometry().region_bytes;
        let (counts, freed) = trim(&mut cat, TrimPlan::NvmeTo(2 * region_bytes));
        assert_eq!((counts.regions_freed, counts.nvme_blocks, counts.dram_blocks), (2, 2, 0));
        assert_eq!(freed.iter().map(|f| f.region).collect::<Vec<_>>(), [0, 1], "oldest first");
        assert!(!cat.has_entry(&key(0)) && cat.contains(&key(2)));
        let full = cat.gauges().nvme_used_bytes;
        assert_eq!(full, 4 * region_bytes, "held, not free, until zeroed");
        cat.release_trimmed(&freed);
        assert_eq!(cat.gauges().nvme_used_bytes, 2 * region_bytes);
        cat.check_invariants();
    }
}
