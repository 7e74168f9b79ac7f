//! A dead service's pool taken over: the blocks its resident slots still hold, indexed again
//! (`Store::open` finds them: `store/takeover.rs`), so that what engines were promised before the
//! kill can still be loaded.

use super::index::{AwaitingReuse, Entry};
use super::slots::SlotState;
use super::{Catalog, MetaWrite, WritePlan};
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
    /// block in DRAM only is kept there, waiting for the store to write it to NVMe now or at a reuse
    /// (`plan_kept_write`). Returns how many were kept, and the keys of those in DRAM only.
    pub fn keep_pool_blocks(&mut self, found: &[PoolBlock]) -> (usize, Vec<BlockKey>) {
        assert_eq!(self.slots.resident_count(), 0, "pool blocks kept into a catalog in use");
        // As in `adopt_recovered`: no store reaches 2^62 puts; larger sequences are forged.
        const SEQ_LIMIT: u64 = 1 << 62;
        let slot_count = self.slots.len();
        let mut kept = Vec::with_capacity(found.len());
        let mut dram_only = Vec::new();
        for block in found.iter().filter(|b| b.sequence < SEQ_LIMIT && (b.slot as usize) < slot_count) {
            if self.slots.get(block.slot).state != SlotState::Free {
                continue;
            }
            match self.keep_pool_block(block) {
                Some(Kept::InDramOnly) => dram_only.push(block.key),
                Some(Kept::BesideNvme) => {}
                None => continue,
            }
            kept.push(block.slot);
        }
        self.slots.unlist(&kept);
        Stats::add(&self.stats.recovered_dram_blocks, kept.len() as u64);
        (kept.len(), dram_only)
    }

    /// Plans the NVMe write of a block kept in DRAM only (`keep_pool_blocks`) that the store's
    /// admission lets through now: once planned, it no longer waits for a reuse (one not planned,
    /// with no NVMe region free, still does).
    pub fn plan_kept_write(&mut self, key: &BlockKey, meta: &mut Vec<MetaWrite>) -> Option<WritePlan> {
        self.index.get(key).filter(|e| e.awaiting_reuse.nvme)?;
        let plan = self.plan_reused_write(key, meta)?;
        let awaiting = &mut self.index.get_mut(key).expect("a planned entry").awaiting_reuse;
        (awaiting.nvme, awaiting.behind_backlog) = (false, false);
        Some(plan)
    }

    fn keep_pool_block(&mut self, block: &PoolBlock) -> Option<Kept> {
        let kept = match self.index.get_mut(&block.key) {
            Some(e) if e.sequence == block.sequence && e.value_checksum == block.value_checksum && e.dram.is_none() => {
                e.dram = Some(block.slot);
                e.dram_ready = true;
                Kept::BesideNvme
            }
            Some(_) => return None, // another put of the key (or its copy in another slot) stands
            None => {
                let entry = Entry {
                    dram: Some(block.slot),
                    dram_ready: true,
                    awaiting_reuse: AwaitingReuse { nvme: self.nvme.is_some(), ..AwaitingReuse::default() },
                    ..Entry::new(block.sequence, block.value_checksum)
                };
                self.index.insert(block.key, entry);
                Kept::InDramOnly
            }
        };
        self.next_sequence = self.next_sequence.max(block.sequence + 1);
        let account = self.slots.account_for(&block.tenant);
        self.slots.claim(block.slot, block.key, SlotState::Loading, account);
        self.slots.admit(block.slot, &block.key);
        Some(kept)
    }
}

/// Where a block kept from a pool taken over has its other copy.
enum Kept {
    /// NVMe recovery found the same put.
    BesideNvme,
    InDramOnly,
}
