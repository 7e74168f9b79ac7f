//! A dead service's pool taken over: the blocks its resident slots still hold, indexed again
//! (`Store::open` finds them: `store/takeover.rs`), so that what engines were promised before the
//! kill can still be loaded.

use super::index::{AwaitingReuse, Entry};
use super::slots::SlotState;
use super::Catalog;
use crate::key::BlockKey;
use crate::stats::Stats;
use crate::tenant::TenantId;
use crate::tiers::dram::ResidentMarks;

/// A block found whole in a slot of a pool taken over (its descriptor and value checked).
#[derive(Debug, Clone, Copy)]
pub struct PoolBlock {
    pub slot: u32,
    pub key: BlockKey,
    pub sequence: u64,
    pub value_checksum: u64,
    pub tenant: TenantId,
}

impl Catalog {
    /// Keeps a shared pool's resident marks in step with the slots from now on; before any use.
    pub fn set_resident_marks(&mut self, marks: ResidentMarks) {
        self.slots.set_resident_marks(marks);
    }

    /// Indexes `found` in their slots, after NVMe recovery and before any use: a block recovered
    /// from NVMe too gets its DRAM copy when both are the same put (same sequence and checksum); a
    /// block in DRAM only is kept there, its NVMe write waiting for a reuse. Returns how many were kept.
    pub fn keep_pool_blocks(&mut self, found: &[PoolBlock]) -> usize {
        assert_eq!(self.slots.resident_count(), 0, "pool blocks kept into a catalog in use");
        // As in `adopt_recovered`: no store reaches 2^62 puts; larger sequences are forged.
        const SEQ_LIMIT: u64 = 1 << 62;
        let slot_count = self.slots.len();
        let mut kept = Vec::with_capacity(found.len());
        for block in found.iter().filter(|b| b.sequence < SEQ_LIMIT && (b.slot as usize) < slot_count) {
            if self.slots.get(block.slot).state == SlotState::Free && self.keep_pool_block(block) {
                kept.push(block.slot);
            }
        }
        self.slots.unlist(&kept);
        Stats::add(&self.stats.recovered_dram_blocks, kept.len() as u64);
        kept.len()
    }

    fn keep_pool_block(&mut self, block: &PoolBlock) -> bool {
        let awaiting_reuse = AwaitingReuse { nvme: self.nvme.is_some(), remote: false };
        match self.index.get_mut(&block.key) {
            Some(e) if e.sequence == block.sequence && e.value_checksum == block.value_checksum && e.dram.is_none() => {
                e.dram = Some(block.slot);
                e.dram_ready = true;
            }
            Some(_) => return false, // another put of the key (or its copy in another slot) stands
            None => self.index.insert(
                block.key,
                Entry {
                    sequence: block.sequence,
                    value_checksum: block.value_checksum,
                    dram: Some(block.slot),
                    dram_ready: true,
                    nvme: None,
                    write_pending: false,
                    pins: 0,
                    readers: 0,
                    loading: false,
                    awaiting_reuse,
                },
            ),
        }
        self.next_sequence = self.next_sequence.max(block.sequence + 1);
        let account = self.slots.account_for(&block.tenant);
        self.slots.claim(block.slot, block.key, SlotState::Loading, account);
        self.slots.admit(block.slot, &block.key);
        true
    }
}
