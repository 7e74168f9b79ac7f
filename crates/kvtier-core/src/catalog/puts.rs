//! Stores, as the catalog sees them: a put's DRAM slot, the NVMe write that follows it (in a region
//! `regions.rs` hands out), the write backlog that bounds them, and admission below DRAM (blocks kept
//! from a tier until they are reused).

use super::index::{AwaitingReuse, Entry};
use super::slots::SlotState;
use super::{Catalog, MetaWrite, NvmeLoc, Persist, PutStep, WriteOutcome, WritePlan};
use crate::format::trailer::TrailerEntry;
use crate::key::BlockKey;
use crate::stats::Stats;

impl Catalog {
    pub fn plan_put(&mut self, key: &BlockKey) -> PutStep {
        if let Some(e) = self.index.get(key) {
            if let (true, Some(slot)) = (e.dram_ready, e.dram) {
                self.slots.touch(slot);
            }
            self.note_reuse(key);
            return PutStep::Present;
        }
        if self.loads_waiting > 0 {
            return PutStep::NoSlot;
        }
        // Bytes waiting for NVMe are bounded: past the budget a store waits for writes to finish.
        let needs_write = self.nvme.is_some();
        if needs_write && self.dirty_bytes + self.slot_bytes as usize > self.max_dirty_bytes {
            return PutStep::NoSlot;
        }
        let (account, tenant) = self.tenant_hints.named(key);
        let Some(slot) = self.alloc_slot(false, account) else { return PutStep::NoSlot };
        if needs_write {
            self.dirty_bytes += self.slot_bytes as usize;
            assert!(self.dirty_bytes <= self.max_dirty_bytes, "a put past the write backlog budget");
        }
        let sequence = self.claim_slot(key, slot, SlotState::Filling, 0, account);
        PutStep::Fill { slot, sequence, tenant }
    }

    /// Whether one more put would be admitted now by the NVMe write backlog budget (`max_dirty_bytes`)
    /// and by the loads (none waiting for a slot).
    pub fn has_put_room(&self) -> bool {
        self.loads_waiting == 0
            && (self.nvme.is_none() || self.dirty_bytes + self.slot_bytes as usize <= self.max_dirty_bytes)
    }

    /// A load starts (`true`) or stops (`false`) waiting for a DRAM slot.
    pub fn load_waits(&mut self, waiting: bool) {
        if waiting {
            self.loads_waiting += 1;
        } else {
            self.loads_waiting = self.loads_waiting.checked_sub(1).expect("a load stopped waiting that never started");
        }
    }

    /// A reserved put that will not be filled: forgets the entry and frees its slot.
    pub fn abort_put(&mut self, key: &BlockKey, slot: u32) {
        self.forget_reserved_put(key, slot, "abort_put");
        self.slots.free(slot);
    }

    /// A reserved put given up while a writer may still copy into its slot (the host service's
    /// connection that holds it is alive but hung): forgets the entry and gives back its share of
    /// the write backlog now, but keeps the slot out of use, keyless and never allocated or evicted,
    /// until `free_abandoned_slot`: a late copy then lands in a slot no block uses.
    pub fn abandon_put(&mut self, key: &BlockKey, slot: u32) {
        self.forget_reserved_put(key, slot, "abandon_put");
        self.slots.abandon(slot);
    }

    /// The entry of a put reserved in `slot` and not filled goes, with its share of the backlog.
    pub(super) fn forget_reserved_put(&mut self, key: &BlockKey, slot: u32, caller: &str) {
        let ours = self.index.get(key).is_some_and(|e| e.dram == Some(slot) && !e.dram_ready);
        assert!(ours, "{caller} of a slot that is not a reserved fill of this key");
        assert_eq!(self.slots.get(slot).state, SlotState::Filling);
        self.index.remove(key);
        if self.nvme.is_some() {
            assert!(self.dirty_bytes >= self.slot_bytes as usize, "a reserved put missing from the backlog");
            self.dirty_bytes -= self.slot_bytes as usize;
        }
    }

    /// The last writer of an abandoned slot let go: the slot is free again.
    pub fn free_abandoned_slot(&mut self, slot: u32) {
        self.slots.free_abandoned(slot);
    }

    /// The slot now holds the whole value; makes it visible and, with `Persist::Now`, plans its NVMe
    /// write.
    pub fn finish_put(
        &mut self,
        key: &BlockKey,
        slot: u32,
        value_checksum: u64,
        persist: Persist,
        meta: &mut Vec<MetaWrite>,
    ) -> Option<WritePlan> {
        let e = self.index.get_mut(key).expect("filled entry exists");
        debug_assert!(e.dram == Some(slot) && !e.dram_ready, "finish_put of a slot that is not this key's fill");
        debug_assert!(!e.write_pending && e.nvme.is_none(), "a fill with an NVMe copy or write already");
        e.value_checksum = value_checksum;
        e.dram_ready = true;
        e.awaiting_reuse.nvme = persist == Persist::OnReuse;
        self.slots.admit(slot, key);
        Stats::add(&self.stats.puts, 1);
        self.nvme.as_ref()?;
        if persist != Persist::Now {
            assert!(self.dirty_bytes >= self.slot_bytes as usize, "a put missing from the backlog");
            self.dirty_bytes -= self.slot_bytes as usize; // reserved by plan_put
            return None;
        }
        self.plan_write(key, slot, meta)
    }

    /// Plans the NVMe write of `key`'s block in `slot`, whose share of the write backlog is counted.
    pub(super) fn plan_write(&mut self, key: &BlockKey, slot: u32, meta: &mut Vec<MetaWrite>) -> Option<WritePlan> {
        let Some((loc, region_seq)) = self.alloc_nvme(meta, slot) else {
            // Every region is open, sealing or pinned: the block stays in DRAM only.
            assert!(self.dirty_bytes >= self.slot_bytes as usize, "a planned write missing from the backlog");
            self.dirty_bytes -= self.slot_bytes as usize;
            Stats::add(&self.stats.nvme_dropped_writes, 1);
            return None;
        };
        self.slots.set_writing(slot, true);
        let e = self.index.get_mut(key).unwrap();
        debug_assert!(!e.write_pending, "a second NVMe write planned for one entry");
        debug_assert_eq!(e.dram, Some(slot), "an NVMe write of a slot the entry does not hold");
        e.write_pending = true;
        Some(WritePlan { slot, loc, region_seq, sequence: e.sequence })
    }

    // ---- admission below DRAM (the store decides: `admission.rs`) ----

    /// A use of `key`'s block (a load, a pin, a second store): evidence of reuse for a block kept
    /// from a tier for want of it.
    pub(super) fn note_reuse(&mut self, key: &BlockKey) {
        if let Some(e) = self.index.get_mut(key).filter(|e| e.awaiting_reuse.any()) {
            self.reused.push((*key, std::mem::take(&mut e.awaiting_reuse), e.sequence));
        }
    }

    /// A caller says `key`'s block will be read again (`Store::note_retained`): a use, for a block
    /// kept from a tier for want of evidence.
    pub fn note_retained(&mut self, key: &BlockKey) {
        self.note_reuse(key);
    }

    /// The block just stored (`finish_put`) is kept from the remote tiers until evidence of reuse.
    pub fn await_remote_reuse(&mut self, key: &BlockKey) {
        if let Some(e) = self.index.get_mut(key).filter(|e| e.dram_ready) {
            e.awaiting_reuse.remote = true;
        }
    }

    /// The blocks reused since the last call that are still in DRAM, with the tiers they were kept
    /// from: the store writes them there now (`plan_reused_write` for NVMe). A reused block out of
    /// DRAM (used through its NVMe copy: a pin, a load on its way) keeps its evidence for when a load
    /// brings it back (`finish_get_nvme`): its bytes are copied from DRAM.
    pub fn take_reused(&mut self) -> Vec<(BlockKey, AwaitingReuse)> {
        let reused = std::mem::take(&mut self.reused);
        let index = &mut self.index;
        let mut ready = Vec::with_capacity(reused.len());
        for (key, awaiting, sequence) in reused {
            // The same block (a later put of the key is a new entry, a new sequence).
            match index.get_mut(&key).filter(|e| e.sequence == sequence) {
                Some(e) if e.dram_ready => ready.push((key, awaiting)),
                Some(e) => {
                    e.awaiting_reuse.nvme |= awaiting.nvme;
                    e.awaiting_reuse.remote |= awaiting.remote;
                    e.awaiting_reuse.behind_backlog |= awaiting.behind_backlog;
                }
                None => {}
            }
        }
        ready
    }

    /// Whether the NVMe write backlog (`max_dirty_bytes`) takes one more block now.
    pub fn write_backlog_has_room(&self) -> bool {
        self.dirty_bytes + self.slot_bytes as usize <= self.max_dirty_bytes
    }

    /// Whether `key`'s block is one an NVMe write would take now: in DRAM only, none pending.
    pub fn nvme_write_wanted(&self, key: &BlockKey) -> bool {
        self.nvme.is_some() && self.index.get(key).is_some_and(Entry::wants_nvme_write)
    }

    /// A block whose NVMe write the full write backlog could not take (a reuse's, `persist_reused`;
    /// one kept from a pool taken over, `persist_kept`) waits for its next use: the evidence is not
    /// lost with the write.
    pub fn await_nvme_reuse(&mut self, key: &BlockKey) {
        if let Some(e) = self.index.get_mut(key).filter(|e| e.wants_nvme_write()) {
            e.awaiting_reuse.nvme = true;
            e.awaiting_reuse.behind_backlog = true;
        }
    }

    /// Plans the NVMe write of a reused block still in DRAM only, when the write backlog has room
    /// (else it stays in DRAM only: a reuse never waits).
    pub fn plan_reused_write(&mut self, key: &BlockKey, meta: &mut Vec<MetaWrite>) -> Option<WritePlan> {
        self.nvme.as_ref()?;
        let e = self.index.get(key).filter(|e| e.wants_nvme_write())?;
        let slot = e.dram.expect("a resident entry has a slot");
        if !self.write_backlog_has_room() {
            Stats::add(&self.stats.nvme_dropped_writes, 1);
            return None;
        }
        self.dirty_bytes += self.slot_bytes as usize;
        assert!(self.dirty_bytes <= self.max_dirty_bytes, "a reused write past the write backlog budget");
        self.plan_write(key, slot, meta)
    }

    // ---- NVMe writes (the regions themselves: `regions.rs`) ----

    /// A place on NVMe for the block in `slot`: in a region of its tenant account's when the tier
    /// is split by tenant (`split_nvme_by_tenant`).
    pub(super) fn alloc_nvme(&mut self, meta: &mut Vec<MetaWrite>, slot: u32) -> Option<(NvmeLoc, u64)> {
        let regions = self.nvme.as_ref()?.geometry().region_count as usize;
        let quotas = if self.nvme_by_tenant { self.slots.region_quotas(regions) } else { Vec::new() };
        let account = if quotas.is_empty() { 0 } else { self.slots.get(slot).account };
        let index = &self.index;
        let pinned = |device: usize, region: u32, t: &TrailerEntry| index.pins_region_entry(device, region, t);
        let placement = self.nvme.as_mut()?.alloc(meta, &pinned, account, &quotas)?;
        if let Some(entries) = placement.reclaimed {
            self.forget_region_copies(placement.loc.device as usize, placement.loc.region, &entries);
            Stats::add(&self.stats.nvme_region_evictions, 1);
        }
        Some((placement.loc, placement.region_seq))
    }

    /// The NVMe copies in `region` of `device`, about to be reused or freed, are gone: an entry left
    /// with no copy and no write goes. Returns how many copies were there.
    pub(super) fn forget_region_copies(&mut self, device: usize, region: u32, entries: &[TrailerEntry]) -> u64 {
        let mut forgotten = 0;
        for t in entries {
            let Some(e) = self.index.get_mut(&t.key) else { continue };
            if !e.lives_in(device, region) {
                continue;
            }
            e.nvme = None;
            forgotten += 1;
            if e.dram.is_none() && !e.write_pending {
                self.index.remove(&t.key);
            }
        }
        forgotten
    }

    /// The data plane handed `plan`'s write to its device queue (its descriptor page is stamped):
    /// from now until `start_write`, a load short of slots may take the slot.
    pub fn write_queued(&mut self, key: &BlockKey, plan: &WritePlan) {
        if self.index.get(key).is_some_and(|e| e.sequence == plan.sequence && e.dram == Some(plan.slot)) {
            let before = self.queued_writes.insert(plan.sequence, (*key, plan.slot, plan.loc));
            debug_assert!(before.is_none(), "write {} queued twice", plan.sequence);
        }
    }

    /// The device queue is about to submit `plan`'s write: `false` if a load took its slot (the
    /// write must not be submitted; complete it as `Cancelled`).
    pub fn start_write(&mut self, plan: &WritePlan) -> bool {
        self.queued_writes.remove(&plan.sequence).is_some()
    }

    /// An entry write finished; returns a trailer to write if its region is now complete.
    pub fn complete_write(&mut self, key: &BlockKey, plan: &WritePlan, outcome: WriteOutcome) -> Option<MetaWrite> {
        self.queued_writes.remove(&plan.sequence);
        // A cancelled write stays in the backlog until the queue reaches it, so that `flush` (which
        // waits for an empty backlog) also waits for the trailer of a sealing region it completes.
        assert!(self.dirty_bytes >= self.slot_bytes as usize, "a write completed that was not in the backlog");
        self.dirty_bytes -= self.slot_bytes as usize;
        if outcome != WriteOutcome::Cancelled {
            // A cancelled write's slot belongs to the load that took it.
            self.slots.set_writing(plan.slot, false);
        }
        let object_bytes = self.object_bytes;
        let current = self.index.get_mut(key).filter(|e| e.sequence == plan.sequence);
        let listed = current.and_then(|e| {
            e.write_pending = false;
            (outcome == WriteOutcome::Written).then(|| {
                e.nvme = Some(plan.loc);
                TrailerEntry {
                    key: *key,
                    sequence: e.sequence,
                    offset: plan.loc.offset,
                    value_bytes: object_bytes,
                    value_checksum: e.value_checksum,
                }
            })
        });
        if listed.is_some() {
            Stats::add(&self.stats.bytes_written_nvme, self.slot_bytes);
        }
        if outcome == WriteOutcome::Failed {
            Stats::add(&self.stats.io_errors, 1);
        }
        self.nvme.as_mut().expect("an entry write without an NVMe tier").entry_done(plan.loc, listed)
    }

    /// A metadata write finished; returns the write to retry if a trailer write failed.
    pub fn complete_meta(&mut self, write: &MetaWrite, ok: bool) -> Option<MetaWrite> {
        if !ok {
            Stats::add(&self.stats.io_errors, 1);
        }
        self.nvme.as_mut().expect("a metadata write without an NVMe tier").complete_meta(write, ok)
    }

    /// Nothing accepted is waiting to reach NVMe.
    pub fn io_idle(&self) -> bool {
        self.dirty_bytes == 0 && self.nvme.as_ref().is_none_or(|n| n.pending_meta_writes() == 0)
    }

    /// Bytes accepted into DRAM and not yet on NVMe (the NVMe write backlog).
    pub fn write_backlog_bytes(&self) -> usize {
        self.dirty_bytes
    }
}
