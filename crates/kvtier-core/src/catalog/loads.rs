//! Loads, as the catalog sees them: a DRAM hit, an NVMe read into a slot it hands out (or straight
//! into the caller's memory), a read from a remote tier (shared filesystem or bucket) into a slot,
//! each finished (made resident, or dropped) once the mover has read and verified it.

use super::slots::SlotState;
use super::{Catalog, GetStep, LoadOutcome, NvmeRead, NO_SLOT};
use crate::key::BlockKey;
use std::collections::HashSet;

impl Catalog {
    /// `direct`: the caller's buffer can take an O_DIRECT read itself, so an NVMe-only block is read
    /// there without a DRAM slot (and is not promoted to DRAM).
    pub fn plan_get(&mut self, key: &BlockKey, direct: bool) -> GetStep {
        self.plan_get_with(key, direct, None)
    }

    /// `plan_get` of a load that found no slot and cannot stage its read elsewhere: it may take the
    /// slot of a queued write (see `alloc_slot_for_load`) of a block outside `spare`.
    pub fn plan_get_taking_queued_write(&mut self, key: &BlockKey, spare: &HashSet<BlockKey>) -> GetStep {
        self.plan_get_with(key, false, Some(spare))
    }

    fn plan_get_with(&mut self, key: &BlockKey, direct: bool, take_queued: Option<&HashSet<BlockKey>>) -> GetStep {
        let Some(e) = self.index.get_mut(key) else { return GetStep::Miss };
        if e.dram_ready {
            let slot = e.dram.expect("ready entry has a slot");
            debug_assert_eq!(self.slots.get(slot).state, SlotState::Resident, "a ready entry's slot {slot}");
            e.pin_reader();
            self.slots.touch(slot);
            self.note_reuse(key);
            return GetStep::Dram { slot };
        }
        if e.loading {
            return GetStep::Pending;
        }
        let Some(loc) = e.nvme else { return GetStep::Miss };
        if direct {
            e.pin();
            return GetStep::Nvme(NvmeRead {
                slot: NO_SLOT,
                loc,
                sequence: e.sequence,
                value_checksum: e.value_checksum,
            });
        }
        let account = self.tenant_hints.account_of(key);
        let Some(slot) = self.alloc_slot_for_load(take_queued, account) else { return GetStep::NoSlot };
        // Eviction and stealing only drop entries without an NVMe copy, so this one is still here.
        let e = self.index.get_mut(key).expect("entry with an NVMe copy survives eviction");
        e.pin();
        e.loading = true;
        let read = NvmeRead { slot, loc, sequence: e.sequence, value_checksum: e.value_checksum };
        self.tenant_hints.take(key);
        self.slots.claim(slot, *key, SlotState::Loading, account);
        GetStep::Nvme(read)
    }

    pub fn finish_get_dram(&mut self, key: &BlockKey) {
        if let Some(e) = self.index.get_mut(key) {
            e.release_reader();
        }
    }

    pub fn finish_get_nvme(&mut self, key: &BlockKey, read: &NvmeRead, outcome: LoadOutcome) {
        debug_assert!(
            read.slot == NO_SLOT || self.slots.get(read.slot).state == SlotState::Loading,
            "an NVMe read finished into slot {} that is not loading",
            read.slot
        );
        let Some(e) = self.index.get_mut(key) else {
            if read.slot != NO_SLOT {
                self.slots.free(read.slot);
            }
            return;
        };
        e.unpin();
        if !matches!(outcome, LoadOutcome::Ok) && e.nvme == Some(read.loc) {
            e.nvme = None;
        }
        if read.slot != NO_SLOT {
            e.loading = false;
            match outcome {
                LoadOutcome::Ok if e.dram.is_none() => {
                    e.dram = Some(read.slot);
                    e.dram_ready = true;
                    self.slots.promote(read.slot, key);
                    self.note_reuse(key); // a load is a use, and its block is in DRAM to be copied now
                }
                LoadOutcome::Abandoned => self.retire_slot(read.slot),
                _ => self.slots.free(read.slot),
            }
        }
        // Still pinned (by the engine, or another load): an entry left with no copy stays and goes with
        // its last pin; removed now, those pins would later be taken off a new entry of the same key,
        // which could then be evicted under a reader.
        self.forget_if_copyless(key);
    }

    /// An NVMe read its load stopped waiting for (`nvme_read_stall_ms`, a hung disk): the block is
    /// a miss for this load but keeps its NVMe copy (the disk may answer again); the load's pin goes,
    /// and its slot stays out of use, keyless, until the read finishes (`finish_given_up_read`).
    pub fn give_up_get_nvme(&mut self, key: &BlockKey, read: &NvmeRead) {
        let e = self.index.get_mut(key).expect("a pinned entry stays while its read is in flight");
        e.unpin();
        if read.slot != NO_SLOT {
            debug_assert!(e.loading, "a given-up NVMe read into slot {} that is not loading", read.slot);
            e.loading = false;
            debug_assert_eq!(self.slots.get(read.slot).state, SlotState::Loading, "a given-up load's slot");
            self.slots.retire(read.slot);
        }
        self.forget_if_copyless(key);
    }
}

/// Loads from a remote tier (the shared filesystem, `tiers::shared`, or the bucket, `tiers::object`):
/// for a block the catalog does not hold, it hands out a DRAM slot to read into and, once the mover
/// has read and verified it, makes the block resident (mirroring `plan_get` / `finish_get_nvme`). Pins
/// cannot protect a remote-only block from another node's evictor; a read that loses that race is a
/// clean miss.
impl Catalog {
    /// A slot in `Loading` state for `key`, or `None` when the catalog already has an entry for it (a
    /// put or another load in flight) or no slot can be freed.
    pub fn plan_get_remote(&mut self, key: &BlockKey) -> Option<u32> {
        self.plan_get_remote_with(key, None)
    }

    /// `plan_get_remote` that may take the slot of a queued write of a block outside `spare` (see
    /// `alloc_slot_for_load`).
    pub fn plan_get_remote_taking_queued_write(&mut self, key: &BlockKey, spare: &HashSet<BlockKey>) -> Option<u32> {
        self.plan_get_remote_with(key, Some(spare))
    }

    fn plan_get_remote_with(&mut self, key: &BlockKey, take_queued: Option<&HashSet<BlockKey>>) -> Option<u32> {
        if self.index.contains_key(key) {
            return None;
        }
        let account = self.tenant_hints.account_of(key);
        let slot = self.alloc_slot_for_load(take_queued, account)?;
        self.claim_slot(key, slot, SlotState::Loading, 1, account);
        Some(slot)
    }

    /// A remote-tier read into `slot` that the I/O engine gave up: the kernel may still write into
    /// the slot, so it is retired rather than freed.
    pub fn abandon_get_remote(&mut self, key: &BlockKey, slot: u32) {
        if self.index.get(key).is_some_and(|e| e.dram == Some(slot)) {
            self.index.remove(key);
        }
        self.retire_slot(slot);
    }

    /// A remote-tier read into `slot` its load stopped waiting for (`remote_read_stall_ms`): the
    /// block is a miss now and its entry goes, so that other loads plan it afresh; the slot stays
    /// out of use, keyless, until the read finishes (`free_given_up_slot`).
    pub fn give_up_get_remote(&mut self, key: &BlockKey, slot: u32) {
        let ours = self.index.get(key).is_some_and(|e| e.dram == Some(slot) && e.loading);
        assert!(ours, "give_up_get_remote of a slot that is not this key's load");
        self.index.remove(key);
        debug_assert_eq!(self.slots.get(slot).state, SlotState::Loading, "a given-up load's slot {slot}");
        self.slots.retire(slot);
    }

    /// The read a load gave up (`give_up_get_remote`) finished: its slot is free again, or retired
    /// for good when the I/O engine gave the read up (the kernel may still write into it).
    pub fn finish_given_up_read(&mut self, slot: u32, abandoned: bool) {
        if abandoned {
            self.retire_slot(slot);
        } else {
            self.slots.free_retired(slot);
        }
    }

    /// The remote read into `slot` finished: `Some(checksum)` makes the block resident, `None` (a miss)
    /// drops the entry and frees the slot.
    pub fn finish_get_remote(&mut self, key: &BlockKey, slot: u32, value_checksum: Option<u64>) {
        let ours = self.index.get(key).is_some_and(|e| e.dram == Some(slot));
        match value_checksum {
            Some(sum) if ours => {
                let e = self.index.get_mut(key).unwrap();
                debug_assert!(e.loading && e.pins > 0 && !e.dram_ready, "a remote read into a slot not loading");
                e.unpin();
                e.value_checksum = sum;
                e.dram_ready = true;
                e.loading = false;
                self.slots.promote(slot, key);
            }
            _ => {
                if ours {
                    self.index.remove(key);
                }
                self.slots.free(slot);
            }
        }
    }
}
