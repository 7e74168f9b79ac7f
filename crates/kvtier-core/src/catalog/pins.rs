//! Pins: who needs a block to stay loadable. An entry's `pins` counts everyone (engine pins between
//! prepare_load and complete_load, loads in flight, scrubs, readers); `readers` counts the part that
//! copies out of its DRAM slot, which keeps the slot itself. Pins are taken and released here; what
//! they protect is decided where copies go: DRAM eviction (`Catalog::alloc_slot`), region reclaim
//! and trim (`Index::pins_region_entry`).

use super::index::{Entry, Index};
use super::{Catalog, ResidentBlock};
use crate::format::trailer::TrailerEntry;
use crate::key::BlockKey;

impl Entry {
    pub(super) fn pin(&mut self) {
        self.pins += 1;
    }

    /// A pin that copies out of the DRAM slot.
    pub(super) fn pin_reader(&mut self) {
        self.pins += 1;
        self.readers += 1;
        debug_assert!(self.readers <= self.pins, "more readers than pins");
    }

    // A release without a pin is a caller's bug, but a count wrapped below zero would pin the block
    // for good: releases saturate.
    pub(super) fn unpin(&mut self) {
        self.pins = self.pins.saturating_sub(1);
    }

    pub(super) fn release_reader(&mut self) {
        self.pins = self.pins.saturating_sub(1);
        self.readers = self.readers.saturating_sub(1);
    }

    /// Whether the block's NVMe copy is in `region` of `device`.
    pub(super) fn lives_in(&self, device: usize, region: u32) -> bool {
        self.nvme.is_some_and(|l| l.device as usize == device && l.region == region)
    }
}

impl Index {
    /// Whether a pin holds entry `t` of `region`'s trailer: its block is pinned and lives there, or is
    /// pinned at that sequence after a failed read dropped the copy (a read of the location may still
    /// be in flight). A region with such an entry is neither reclaimed nor trimmed.
    pub(super) fn pins_region_entry(&self, device: usize, region: u32, t: &TrailerEntry) -> bool {
        self.get(&t.key).is_some_and(|e| e.pins > 0 && (e.lives_in(device, region) || e.sequence == t.sequence))
    }
}

impl Catalog {
    /// Pins the leading visible keys (a use of each: `note_reuse`); returns how many were pinned.
    pub fn pin_prefix(&mut self, keys: &[BlockKey]) -> usize {
        let mut pinned = 0;
        for key in keys {
            match self.index.get_mut(key) {
                Some(e) if e.visible() => {
                    e.pin();
                    pinned += 1;
                }
                _ => break,
            }
            self.note_reuse(key);
        }
        pinned
    }

    /// Pins a block that is resident in DRAM as a reader and returns its slot (a worker copies out
    /// of it); released with `release_readers`.
    pub fn pin_resident(&mut self, key: &BlockKey) -> Option<u32> {
        let e = self.index.get_mut(key)?;
        if !e.dram_ready {
            return None;
        }
        assert!(e.dram.is_some(), "a ready entry without a slot");
        e.pin_reader();
        e.dram
    }

    /// `pin_resident` for a copy of the whole block: its slot, sequence and value checksum (what its
    /// descriptor records), without counting as a use for eviction. The shared publisher copies a
    /// backlogged block this way. Released with `release_readers`.
    pub fn pin_resident_for_copy(&mut self, key: &BlockKey) -> Option<ResidentBlock> {
        let e = self.index.get(key)?;
        let (sequence, value_checksum) = (e.sequence, e.value_checksum);
        let slot = self.pin_resident(key)?;
        Some(ResidentBlock { slot, sequence, value_checksum })
    }

    /// Releases reader pins taken by `pin_resident`.
    pub fn release_readers(&mut self, keys: &[BlockKey]) {
        for key in keys {
            if let Some(e) = self.index.get_mut(key) {
                debug_assert!(e.readers > 0, "a reader released twice");
                e.readers = e.readers.saturating_sub(1);
            }
        }
        self.unpin(keys);
    }

    pub fn unpin(&mut self, keys: &[BlockKey]) {
        for key in keys {
            if let Some(e) = self.index.get_mut(key) {
                e.unpin();
                // A copy quarantined or failed while pinned leaves an entry with no copy: it goes
                // with the last pin.
                self.forget_if_copyless(key);
            }
        }
    }

    /// Drops an entry left with no copy once nothing pins, fills or writes it, so that the block can
    /// be stored again.
    pub(super) fn forget_if_copyless(&mut self, key: &BlockKey) {
        let copyless = |e: &Entry| e.pins == 0 && !e.visible() && e.dram.is_none() && !e.write_pending;
        if self.index.get(key).is_some_and(copyless) {
            self.index.remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::test_support::{dram_catalog, key, nvme_catalog, put, recovered_catalog};
    use crate::catalog::{GetStep, LoadOutcome, PutStep};

    #[test]
    fn a_prefix_pin_stops_at_the_first_block_not_visible() {
        let mut cat = dram_catalog(4);
        put(&mut cat, key(0));
        put(&mut cat, key(2));
        assert_eq!(cat.pin_prefix(&[key(0), key(1), key(2)]), 1);
        assert_eq!((cat.index[&key(0)].pins, cat.index[&key(2)].pins), (1, 0));
        cat.unpin(&[key(0)]);
        assert_eq!(cat.index[&key(0)].pins, 0);
        cat.check_invariants();
    }

    #[test]
    fn a_reader_keeps_its_slot_from_eviction() {
        let mut cat = dram_catalog(2);
        put(&mut cat, key(0));
        put(&mut cat, key(1));
        let slot = cat.pin_resident(&key(0)).expect("resident");
        assert_eq!(cat.pin_resident(&key(7)), None);
        // key(0) is the least recently used: without its reader it would be the victim.
        let PutStep::Fill { slot: taken, .. } = cat.plan_put(&key(2)) else { panic!("key(1) can go") };
        assert_ne!(taken, slot);
        assert!(cat.contains(&key(0)) && !cat.contains(&key(1)));
        cat.release_readers(&[key(0)]);
        assert_eq!((cat.index[&key(0)].pins, cat.index[&key(0)].readers), (0, 0));
        cat.check_invariants();
    }

    #[test]
    fn a_pinned_entry_left_without_a_copy_goes_with_its_last_pin() {
        let mut cat = nvme_catalog(2, 2, 1);
        let k = key(0);
        let slot = put(&mut cat, k);
        assert_eq!(cat.pin_prefix(&[k, k]), 2);
        let mut meta = Vec::new();
        assert!(cat.quarantine_nvme(&k, cat.index[&k].nvme.expect("written"), &mut meta));
        assert!(cat.quarantine_dram(&k, slot), "no reader holds the slot");
        assert!(!cat.contains(&k) && cat.has_entry(&k), "copyless, but pinned");
        cat.unpin(&[k]);
        assert!(cat.has_entry(&k));
        cat.unpin(&[k]);
        assert!(!cat.has_entry(&k), "the last pin took the entry");
        cat.check_invariants();
    }

    #[test]
    fn a_pinned_entry_holds_its_region_even_after_a_failed_read() {
        let mut cat = recovered_catalog(2);
        let k = key(0);
        let e = &cat.index[&k];
        let loc = e.nvme.expect("recovered on NVMe");
        let t = TrailerEntry { key: k, sequence: e.sequence, offset: loc.offset, value_bytes: 0, value_checksum: 0 };
        let (device, region) = (loc.device as usize, loc.region);
        assert!(!cat.index.pins_region_entry(device, region, &t), "not pinned");
        let GetStep::Nvme(read) = cat.plan_get(&k, true) else { panic!("a direct NVMe read") };
        assert!(cat.index.pins_region_entry(device, region, &t));
        assert!(!cat.index.pins_region_entry(device, region + 1, &TrailerEntry { sequence: 0, ..t }));
        assert_eq!(cat.pin_prefix(&[k]), 1);
        cat.finish_get_nvme(&k, &read, LoadOutcome::IoError);
        assert!(cat.index[&k].nvme.is_none(), "the failed read dropped the copy");
        assert!(cat.index.pins_region_entry(device, region, &t), "the engine's pin still holds the region");
        cat.unpin(&[k]);
        assert!(!cat.has_entry(&k));
        cat.check_invariants();
    }
}
