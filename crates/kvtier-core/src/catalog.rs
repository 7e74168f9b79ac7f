//! The control plane: which blocks exist where, which DRAM slot or NVMe location a block goes to,
//! what to evict, and what is pinned. It never moves bytes; it hands locations to the data plane
//! (`mover`) and takes back completions. Everything here runs under one mutex, in short sections.
//!
//! Invariants:
//! - A block is visible (lookups, loads) once its DRAM copy is whole or its NVMe copy is written.
//! - A pinned entry (by a load in flight or by the engine between prepare_load and complete_load)
//!   stays loadable: its NVMe region is never reclaimed, and its DRAM copy is evicted only by a
//!   load, only when it has a written NVMe copy and no reader (a store never evicts it). A reader (a
//!   copy out of the DRAM slot in flight: a DRAM hit, `pin_resident`, a scrub) keeps the slot
//!   itself. Engine pins do not hold slots against loads, so that a request larger than the pool's
//!   free part can still be loaded through it, round by round.
//! - Loads go first: a load waiting for a slot keeps puts off the pool, and a load short of slots
//!   takes the slot of a block whose NVMe write has not started (that store is dropped).
//! - A DRAM slot being filled, loaded or written to NVMe is never a victim.
//! - Regions are reused oldest first (FIFO by region generation), whole.
//!
//! The parts, each with its own state and unit tests: `index` (entries by key and by sequence),
//! `slots` (the DRAM pool and its eviction policy), `regions` (the NVMe regions, after CacheLib
//! navy's `RegionManager`), `pins`, and `upkeep` (scrub, quarantine, trim). `Catalog` ties them
//! together under the one lock, its methods for each path in `loads` and `puts`; the reference model
//! (`catalog_model_tests.rs`) checks the whole.

use crate::format::trailer::TrailerEntry;
use crate::key::BlockKey;
use crate::stats::Stats;
use crate::tiers::nvme::{Geometry, RecoveredRegion};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

mod index;
mod loads;
mod lock;
mod pins;
mod puts;
mod regions;
mod slots;
mod takeover;
mod tenants;
#[cfg(test)]
mod test_support;
mod upkeep;

pub use index::{AwaitingReuse, ResidencyChanges};
use index::{Entry, Index};
pub use lock::{CatalogGuard, CatalogLock};
use regions::Regions;
use slots::{SlotState, Slots};
pub use takeover::PoolBlock;
use tenants::TenantHints;
pub use tenants::{NvmeTenantGauge, PolicyFactory, TenantGauge};
pub use upkeep::{ScrubTarget, TrimCounts, TrimPlan};

/// Where a block is served from. The catalog itself holds DRAM and NVMe; the remote tiers
/// (`RemoteTiers`) hold the shared-filesystem tier's and the object tier's (`bucket_url`) blocks.
/// A tier's names and kind are its row of [`TIER_ROWS`]; a new tier is a variant and a row, last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Tier {
    Dram,
    Nvme,
    Shared,
    Bucket,
}

/// One tier's row: what the code, the wire and the reports call it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierRow {
    pub tier: Tier,
    /// Its name in lookups, counters (`<name>_hits`), metrics' `tier` label and reports.
    pub name: &'static str,
    /// Its per-engine lookup counter (`service::EngineCounters`), a name on the wire.
    pub lookup_counter: &'static str,
    /// Whether no pin holds its blocks (another host's evictor may take one before its load).
    pub remote: bool,
}

/// Every tier, in the order of the enum, which is the load order (a block held by several is read
/// from the first). A row's position plus one is its code on the wire (`Op::Locate`, where 0 is
/// "absent"): rows are only ever added, last (docs/service.md).
pub const TIER_ROWS: [TierRow; 4] = [
    TierRow { tier: Tier::Dram, name: "dram", lookup_counter: "lookup_dram", remote: false },
    TierRow { tier: Tier::Nvme, name: "nvme", lookup_counter: "lookup_nvme", remote: false },
    TierRow { tier: Tier::Shared, name: "shared", lookup_counter: "lookup_shared", remote: true },
    // The object tier. Until it had a name of its own, its blocks were served (and counted) as `shared`.
    TierRow { tier: Tier::Bucket, name: "bucket", lookup_counter: "lookup_bucket", remote: true },
];

impl Tier {
    pub fn row(self) -> &'static TierRow {
        let row = &TIER_ROWS[self as usize];
        debug_assert_eq!(row.tier, self, "TIER_ROWS is out of the enum's order");
        row
    }

    pub fn name(self) -> &'static str {
        self.row().name
    }

    /// A tier that no pin holds a block in (another host's evictor may take it before its load).
    pub fn is_remote(self) -> bool {
        self.row().remote
    }

    /// The tier's code on the wire; 0 for none (a miss, an absent block).
    pub fn wire_code(tier: Option<Tier>) -> u8 {
        tier.map_or(0, |t| t as u8 + 1)
    }

    /// The tier of a wire code; `None` for 0 and for a code this build does not know (a newer peer's).
    pub fn from_wire_code(code: u8) -> Option<Tier> {
        TIER_ROWS.get(usize::from(code).checked_sub(1)?).map(|row| row.tier)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvmeLoc {
    pub device: u16,
    pub region: u32,
    /// Byte offset of the entry inside its region.
    pub offset: u64,
}

/// A DRAM-resident block pinned for a copy (`pin_resident_for_copy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResidentBlock {
    pub slot: u32,
    pub sequence: u64,
    pub value_checksum: u64,
}

/// A metadata write the data plane must issue: a region trailer, or (`entries == None`) zeroing a
/// stale trailer before a reclaimed region is rewritten.
#[derive(Debug)]
pub struct MetaWrite {
    pub device: usize,
    pub region: u32,
    pub region_seq: u64,
    pub entries: Option<Vec<TrailerEntry>>,
    /// Earlier failed attempts at this write (a failed trailer write is retried a bounded number of
    /// times: without its trailer a region is only recoverable by a scan that stops at the first hole).
    pub attempt: u32,
}

/// What a load must do for one key.
#[derive(Debug, Clone, Copy)]
pub enum GetStep {
    Miss,
    /// No DRAM slot is free for staging the read; try again when one frees.
    NoSlot,
    Dram {
        slot: u32,
    },
    Nvme(NvmeRead),
    /// Another load is reading the block into DRAM: plan it again when that read finishes (then a
    /// DRAM hit, or a miss if the read failed).
    Pending,
}

/// `NvmeRead::slot` of a direct read: the value lands in the caller's memory, no DRAM slot is used.
pub const NO_SLOT: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
pub struct NvmeRead {
    /// The DRAM slot the entry is read into, or `NO_SLOT` for a direct read into caller memory.
    pub slot: u32,
    pub loc: NvmeLoc,
    pub sequence: u64,
    pub value_checksum: u64,
}

#[derive(Debug, Clone, Copy)]
pub enum PutStep {
    Present,
    NoSlot,
    /// `tenant`: the one named for the key (`assign_tenant`), else the default tenant.
    Fill {
        slot: u32,
        sequence: u64,
        tenant: crate::tenant::TenantId,
    },
}

/// Where an accepted block is to be written on NVMe.
#[derive(Debug, Clone, Copy)]
pub struct WritePlan {
    pub slot: u32,
    pub loc: NvmeLoc,
    pub region_seq: u64,
    /// The block's sequence: names the write in `queued_writes` and tells its entry from a later
    /// entry of the same key.
    pub sequence: u64,
}

/// How an NVMe entry write ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    Written,
    Failed,
    /// Never submitted: a load took the block's slot while the write still waited in the device
    /// queue (`steal_queued_write`); the slot is no longer the write's.
    Cancelled,
}

/// What a stored block's put does below DRAM, as the store's admission decided (`admission.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Persist {
    /// Written to NVMe now (when the store has the tier).
    Now,
    /// Kept in DRAM only (the NVMe tier's write budget is spent).
    DramOnly,
    /// Kept in DRAM only until evidence of reuse (`note_reuse`) hands it back to the store.
    OnReuse,
}

#[derive(Debug, Clone, Copy)]
pub enum LoadOutcome {
    Ok,
    Corrupt,
    IoError,
    /// The I/O engine broke with the read in flight: the slot may still be written by the kernel.
    Abandoned,
}

pub struct Catalog {
    slot_bytes: u64,
    object_bytes: u32,
    index: Index,
    slots: Slots,
    /// Tenants named for blocks not in DRAM yet (`assign_tenant`), taken when a slot is claimed.
    tenant_hints: TenantHints,
    /// Whether stores are named by tenant although the pool is not split (`name_tenants`).
    names_tenants: bool,
    /// Whether the NVMe regions are split by the pool's tenant accounts (`split_nvme_by_tenant`).
    nvme_by_tenant: bool,
    nvme: Option<Regions>,
    next_sequence: u64,
    dirty_bytes: usize,
    max_dirty_bytes: usize,
    /// Loads waiting for a DRAM slot. While any waits, puts get no slot: a slot freed by a finished
    /// write or an unpin goes to the load, never to another store.
    loads_waiting: usize,
    /// NVMe entry writes handed to a device queue and not yet submitted to the kernel, by sequence:
    /// (key, slot, location). A load short of slots may take one of these slots (`steal_queued_write`).
    queued_writes: BTreeMap<u64, (BlockKey, u32, NvmeLoc)>,
    /// Whether loads may take the slots of queued writes (`loads_cancel_queued_writes`).
    loads_cancel_writes: bool,
    /// Blocks kept from a tier for want of evidence of reuse that have been reused since, with the
    /// tiers they were kept from and the entry's sequence, for the store to write there (`take_reused`).
    reused: Vec<(BlockKey, AwaitingReuse, u64)>,
    stats: Arc<Stats>,
    /// When sequences were handed out (for `kvtier trim --older-than` and `kvtier inspect`).
    pub timeline: crate::timeline::Timeline,
}

/// The DRAM pool's shape and budgets, as the catalog needs them.
#[derive(Debug, Clone, Copy)]
pub struct SlotLayout {
    pub slot_count: usize,
    pub slot_bytes: u64,
    pub object_bytes: u32,
    /// Bytes accepted into DRAM but not yet on NVMe; past it stores skip NVMe.
    pub max_dirty_bytes: usize,
}

impl Catalog {
    pub fn new(
        layout: SlotLayout,
        make_policy: PolicyFactory,
        geometry: Option<(Geometry, usize)>,
        stats: Arc<Stats>,
    ) -> Self {
        let SlotLayout { slot_count, slot_bytes, object_bytes, max_dirty_bytes } = layout;
        Catalog {
            slot_bytes,
            object_bytes,
            index: Index::default(),
            slots: Slots::new(slot_count, make_policy),
            tenant_hints: TenantHints::default(),
            names_tenants: false,
            nvme_by_tenant: false,
            nvme: geometry.map(|(geometry, device_count)| Regions::new(geometry, device_count)),
            next_sequence: 1,
            dirty_bytes: 0,
            max_dirty_bytes,
            loads_waiting: 0,
            queued_writes: BTreeMap::new(),
            loads_cancel_writes: true,
            reused: Vec::new(),
            stats,
            timeline: crate::timeline::Timeline::default(),
        }
    }

    /// Loads what recovery found on one device; returns trailers to write for scanned regions.
    pub fn adopt_recovered(&mut self, device: usize, recovered: Vec<RecoveredRegion>) -> Vec<MetaWrite> {
        let mut meta = Vec::new();
        if self.nvme.is_none() {
            return meta;
        }
        // No store reaches 2^62 puts or regions: larger values are forged or corrupt, and would overflow
        // the counters below. Such entries are dropped and such region generations clamped.
        const SEQ_LIMIT: u64 = 1 << 62;
        for mut found in recovered {
            found.region_seq = found.region_seq.min(SEQ_LIMIT);
            found.entries.retain(|e| e.sequence < SEQ_LIMIT);
            for e in &found.entries {
                self.adopt_entry(NvmeLoc { device: device as u16, region: found.region, offset: e.offset }, e);
            }
            Stats::add(&self.stats.recovered_blocks, found.entries.len() as u64);
            meta.extend(self.nvme.as_mut().unwrap().adopt(device, found));
        }
        meta
    }

    /// Indexes one recovered entry at `loc` unless the index holds a newer one of its key.
    fn adopt_entry(&mut self, loc: NvmeLoc, e: &TrailerEntry) {
        self.next_sequence = self.next_sequence.max(e.sequence + 1);
        if self.index.get(&e.key).is_some_and(|old| old.sequence >= e.sequence) {
            return;
        }
        self.index.insert(e.key, Entry { nvme: Some(loc), ..Entry::new(e.sequence, e.value_checksum) });
    }

    // ---- lookups (pins: `pins.rs`) ----

    /// Dates the recovered blocks by the namespace's saved timeline (after every device's
    /// `adopt_recovered`); new sequences start past every saved point.
    pub fn restore_timeline(&mut self, saved: Vec<(u64, u64)>) {
        let (timeline, next_sequence) = crate::timeline::Timeline::restored(saved, self.next_sequence);
        self.timeline = timeline;
        self.next_sequence = next_sequence;
    }

    /// Whether the block is loadable from DRAM or NVMe (tests; the store asks `locate`).
    #[cfg(test)]
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.index.get(key).is_some_and(Entry::visible)
    }

    /// Whether the catalog tracks the key at all (visible or in flight).
    pub fn has_entry(&self, key: &BlockKey) -> bool {
        self.index.contains_key(key)
    }

    /// The fastest local tier holding the block: DRAM, then NVMe.
    pub fn locate(&self, key: &BlockKey) -> Option<Tier> {
        let e = self.index.get(key)?;
        if e.dram_ready {
            Some(Tier::Dram)
        } else {
            e.nvme.map(|_| Tier::Nvme)
        }
    }

    // ---- DRAM slots (the pool itself: `slots.rs`) ----

    /// A free slot, else a victim. `for_load`: a block pinned by a pending load (the engine's pin
    /// between prepare_load and complete_load) may go when it has an NVMe copy, so that a request
    /// larger than the pool's free part can still be loaded through it, round by round. A store
    /// never evicts such a block: loads go first, and its load would have to read it again.
    ///
    /// A tenant at its cap (`tenant_dram_max_share`) makes room from its own blocks first, free slots
    /// or not; when none of them may go it is served as any other (a cap never makes a store wait).
    fn alloc_slot(&mut self, for_load: bool, asker: u8) -> Option<u32> {
        let index = &self.index;
        let may_evict = |key: Option<BlockKey>| {
            key.and_then(|k| index.get(&k))
                .is_none_or(|e| e.readers == 0 && (e.pins == 0 || (for_load && e.nvme.is_some())))
        };
        let own = if self.slots.past_cap(asker) { self.slots.evict(asker, true, may_evict) } else { None };
        let (victim, key) = match own {
            Some(evicted) => evicted,
            None => match self.slots.take_free() {
                Some(slot) => return Some(slot),
                None => self.slots.evict(asker, false, may_evict)?,
            },
        };
        debug_assert_eq!(self.slots.get(victim).state, SlotState::Free, "victim {victim} not emptied");
        Stats::add(&self.stats.dram_evictions, 1);
        if let Some(key) = key {
            self.forget_evicted_copy(&key, victim);
        }
        Some(victim)
    }

    /// Eviction took `slot` from `key`'s block: an entry left with no copy and no write goes.
    fn forget_evicted_copy(&mut self, key: &BlockKey, slot: u32) {
        let Some(e) = self.index.get_mut(key) else { return };
        if e.dram == Some(slot) {
            e.dram = None;
            e.dram_ready = false;
        }
        if e.dram.is_none() && e.nvme.is_none() && !e.write_pending {
            if e.awaiting_reuse.behind_backlog {
                Stats::add(&self.stats.dropped_behind_backlog, 1);
            } else if e.awaiting_reuse.any() {
                Stats::add(&self.stats.dropped_without_evidence, 1);
            }
            self.index.remove(key);
        }
    }

    /// A slot for a load: a free slot or a victim, else, with `take_queued` (and if the store
    /// allows it), the slot of the newest stored block outside `take_queued`'s set whose NVMe write
    /// waits in a device queue. Loads go first: dropping a store that has not reached the disk costs
    /// a later miss of that block, while waiting for the write backlog to drain stalls a request
    /// that is being served now. The set names the blocks the load itself still needs.
    fn alloc_slot_for_load(&mut self, take_queued: Option<&HashSet<BlockKey>>, asker: u8) -> Option<u32> {
        self.alloc_slot(true, asker).or_else(|| self.steal_queued_write(take_queued?))
    }

    /// Takes the slot of the newest queued write whose block nobody pins: the block is forgotten (a
    /// store dropped, counted in `cancelled_writes`), and its write, when the device queue reaches
    /// it, is not submitted (`start_write` answers false) and completes as `Cancelled`.
    ///
    /// Only a write that leaves no hole in an open region qualifies: the last entry of its device's
    /// open region (the cursor steps back over it, and the next put takes the place), or an entry of
    /// a sealing region (its trailer lists only what was written). Recovery scans an open region
    /// up to its first invalid entry, so a hole there would lose the written entries after it.
    fn steal_queued_write(&mut self, spare: &HashSet<BlockKey>) -> Option<u32> {
        if !self.loads_cancel_writes {
            return None;
        }
        let (index, nvme) = (&self.index, self.nvme.as_ref()?);
        let (sequence, key, slot, loc) =
            self.queued_writes.iter().rev().find_map(|(&sequence, &(key, slot, loc))| {
                let e = index.get(&key).filter(|_| !spare.contains(&key))?;
                let unpinned = e.sequence == sequence && e.pins == 0 && e.dram == Some(slot) && e.dram_ready;
                (unpinned && nvme.cancel_leaves_no_hole(loc)).then_some((sequence, key, slot, loc))
            })?;
        self.queued_writes.remove(&sequence);
        let s = self.slots.get(slot);
        debug_assert!(s.state == SlotState::Resident && s.writing, "a queued write's slot {slot} is {s:?}");
        self.index.remove(&key);
        self.nvme.as_mut().unwrap().rewind_if_last(loc);
        self.slots.take(slot);
        Stats::add(&self.stats.cancelled_writes, 1);
        Some(slot)
    }

    /// Whether loads may take the slots of queued NVMe writes (default on).
    pub fn set_loads_cancel_writes(&mut self, on: bool) {
        self.loads_cancel_writes = on;
    }

    /// Splits the DRAM pool by tenant (`tenant_dram_share`, `tenant_dram_shares`); before any use.
    pub fn set_tenant_shares(&mut self, shares: crate::tenant::TenantShares) {
        self.slots.set_tenant_shares(shares);
    }

    /// Splits the NVMe regions by the DRAM pool's tenant accounts, with the same shares and cap
    /// (`tenant_shares_nvme`, `regions.rs`); a no-op while the pool is not split. Before any write.
    pub fn split_nvme_by_tenant(&mut self) {
        self.nvme_by_tenant = true;
    }

    /// Names the tenant of every put (`PutStep::Fill`) even while the pool is not split: blocks
    /// encrypted at rest are sealed under their tenant's key (`encryption_key_file`).
    pub fn name_tenants(&mut self) {
        self.names_tenants = true;
    }

    /// Whether `assign_tenant` does anything: the pool is split by tenant, or stores are named.
    pub fn tracks_tenants(&self) -> bool {
        self.names_tenants || self.slots.tenancy_enabled()
    }

    /// The blocks `keys` are `tenant`'s: one in DRAM is charged to it now, one on its way (a put, a
    /// read from a lower tier) when it claims a slot (and a put is named for it, `PutStep::Fill`).
    /// A no-op while the pool is not split by tenant and stores are not named.
    pub fn assign_tenant(&mut self, keys: &[BlockKey], tenant: &crate::tenant::TenantId) {
        if !self.tracks_tenants() {
            return;
        }
        let split = self.slots.tenancy_enabled();
        let account = if split { self.slots.account_for(tenant) } else { 0 };
        for key in keys {
            match self.index.get(key).and_then(|e| e.dram) {
                Some(slot) if split => self.slots.charge(slot, account, key),
                // Stored already: its page names the tenant it was put for.
                Some(_) => {}
                None => self.tenant_hints.name(*key, account, *tenant),
            }
        }
    }

    /// Each tenant account of the DRAM pool (the default tenant's first), and the blocks charged to
    /// the default tenant for want of an account (`MAX_TENANTS`).
    pub fn tenant_gauges(&self) -> (Vec<TenantGauge>, u64) {
        let (mut gauges, untracked) = self.slots.tenant_gauges();
        if let Some(regions) = self.nvme.as_ref().filter(|_| self.nvme_by_tenant) {
            let region_bytes = regions.geometry().region_bytes;
            let by_account = regions.by_account();
            for (a, gauge) in gauges.iter_mut().enumerate() {
                let (held, reclaimed) = by_account.get(a).copied().unwrap_or_default();
                gauge.nvme = Some(NvmeTenantGauge { bytes: held * region_bytes, reclaimed_regions: reclaimed });
            }
        }
        (gauges, untracked)
    }

    /// Takes a slot out of use for good: neither free nor a victim (it stays `Loading`, keyless).
    fn retire_slot(&mut self, slot: u32) {
        self.slots.retire(slot);
        Stats::add(&self.stats.retired_slots, 1);
    }

    /// A new entry for `key` whose only copy is `slot` (charged to tenant `account`), not yet
    /// visible; returns its sequence.
    fn claim_slot(&mut self, key: &BlockKey, slot: u32, state: SlotState, pins: u32, account: u8) -> u64 {
        let sequence = self.next_sequence;
        debug_assert!(!self.index.contains_key(key), "a new entry for a key the index holds");
        self.next_sequence += 1;
        self.timeline.record(sequence);
        self.tenant_hints.take(key);
        self.slots.claim(slot, *key, state, account);
        self.index.insert(
            *key,
            Entry { dram: Some(slot), pins, loading: state == SlotState::Loading, ..Entry::new(sequence, 0) },
        );
        sequence
    }

    // ---- gauges and invariants ----

    pub fn gauges(&self) -> Gauges {
        let (used_regions, total_regions, region_bytes) = match &self.nvme {
            Some(n) => {
                let (used, total) = n.usage();
                (used, total, n.geometry().region_bytes)
            }
            None => (0, 0, 0),
        };
        Gauges {
            dram_used_bytes: self.slots.resident_count() as u64 * self.slot_bytes,
            dram_capacity_bytes: self.slots.len() as u64 * self.slot_bytes,
            nvme_used_bytes: used_regions * region_bytes,
            nvme_capacity_bytes: total_regions * region_bytes,
            blocks_dram: self.index.counted().dram,
            blocks_nvme: self.index.counted().nvme,
            nvme_write_budget_bytes_per_day: 0,
            nvme_write_budget_left_bytes: 0,
            shared_write_budget_bytes_per_day: 0,
            shared_write_budget_left_bytes: 0,
            bucket_write_budget_bytes_per_day: 0,
            bucket_write_budget_left_bytes: 0,
        }
    }

    /// Checks the catalog's invariants (tests and debug builds).
    pub fn check_invariants(&self) {
        self.index.check();
        self.slots.check();
        if let Some(nvme) = &self.nvme {
            nvme.check();
        }
        let loading: HashSet<BlockKey> =
            self.slots.iter().filter(|s| s.state == SlotState::Loading).filter_map(|s| s.key).collect();
        for (key, e) in &self.index {
            assert!(e.readers <= e.pins, "{key:?}: more readers than pins");
            assert_eq!(e.loading, loading.contains(key), "{key:?}: loading flag disagrees with the slots");
            if let Some(slot) = e.dram {
                let s = self.slots.get(slot);
                assert_eq!(s.key, Some(*key), "slot {slot} does not point back to its entry");
                if e.dram_ready {
                    assert_eq!(s.state, SlotState::Resident);
                }
            }
        }
        for (&sequence, &(key, slot, _)) in &self.queued_writes {
            let s = self.slots.get(slot);
            assert!(s.writing && s.key == Some(key), "queued write of {key:?} lost its slot {slot}");
            assert!(self.index.get(&key).is_some_and(|e| e.sequence == sequence && e.write_pending));
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Gauges {
    pub dram_used_bytes: u64,
    pub dram_capacity_bytes: u64,
    pub nvme_used_bytes: u64,
    pub nvme_capacity_bytes: u64,
    pub blocks_dram: u64,
    pub blocks_nvme: u64,
    /// Each tier's write budget below DRAM (`admission.rs`), set by the store (`set_write_budget`):
    /// bytes per day (0: unbounded) and the bytes it would take now.
    pub nvme_write_budget_bytes_per_day: u64,
    pub nvme_write_budget_left_bytes: u64,
    pub shared_write_budget_bytes_per_day: u64,
    pub shared_write_budget_left_bytes: u64,
    pub bucket_write_budget_bytes_per_day: u64,
    pub bucket_write_budget_left_bytes: u64,
}

impl Gauges {
    /// (name, value) pairs, for the Python dict, the service's replies and Prometheus.
    /// Sets `tier`'s write budget: bytes per day (0: unbounded, or counted elsewhere) and bytes left.
    pub fn set_write_budget(&mut self, tier: Tier, bytes_per_day: u64, left_bytes: u64) {
        let fields = match tier {
            Tier::Nvme => (&mut self.nvme_write_budget_bytes_per_day, &mut self.nvme_write_budget_left_bytes),
            Tier::Shared => (&mut self.shared_write_budget_bytes_per_day, &mut self.shared_write_budget_left_bytes),
            Tier::Bucket => (&mut self.bucket_write_budget_bytes_per_day, &mut self.bucket_write_budget_left_bytes),
            Tier::Dram => unreachable!("DRAM takes every block: it has no write budget"),
        };
        (*fields.0, *fields.1) = (bytes_per_day, left_bytes);
    }

    pub fn fields(&self) -> [(&'static str, u64); 12] {
        [
            ("dram_used_bytes", self.dram_used_bytes),
            ("dram_capacity_bytes", self.dram_capacity_bytes),
            ("nvme_used_bytes", self.nvme_used_bytes),
            ("nvme_capacity_bytes", self.nvme_capacity_bytes),
            ("blocks_dram", self.blocks_dram),
            ("blocks_nvme", self.blocks_nvme),
            ("nvme_write_budget_bytes_per_day", self.nvme_write_budget_bytes_per_day),
            ("nvme_write_budget_left_bytes", self.nvme_write_budget_left_bytes),
            ("shared_write_budget_bytes_per_day", self.shared_write_budget_bytes_per_day),
            ("shared_write_budget_left_bytes", self.shared_write_budget_left_bytes),
            ("bucket_write_budget_bytes_per_day", self.bucket_write_budget_bytes_per_day),
            ("bucket_write_budget_left_bytes", self.bucket_write_budget_left_bytes),
        ]
    }
}

/// The service's change log for KV events (`service::changes`): which local tiers each block is
/// loadable from.
impl Catalog {
    /// Every visible block with the local tiers it is loadable from: bit 0 DRAM, bit 1 NVMe.
    pub fn residency(&self, into: &mut HashMap<BlockKey, u8>) {
        for (key, e) in &self.index {
            let tiers = e.tiers();
            if tiers != 0 {
                into.insert(*key, tiers);
            }
        }
    }

    /// What changed in `residency()` since the last call: the keys whose tiers changed, looked up
    /// now (O(changes) under the lock). The first call, a call with `full` (a log that has not seen
    /// the state), and the first after more than `cap` keys changed walk the whole index instead.
    /// From the first call on, the index records the keys whose tiers change (`ResidencyTracker`).
    pub fn residency_changes(&mut self, full: bool, cap: usize) -> ResidencyChanges {
        let first = self.index.tracker.is_none();
        let tracker = self.index.track(cap);
        if first || full || tracker.overflowed {
            tracker.overflowed = false;
            tracker.keys.clear();
            let mut all = HashMap::new();
            self.residency(&mut all);
            return ResidencyChanges::All(all);
        }
        let keys: Vec<BlockKey> = tracker.keys.drain().collect();
        let index = &self.index;
        ResidencyChanges::Keys(keys.into_iter().map(|k| (k, index.get(&k).map_or(0, Entry::tiers))).collect())
    }
}

#[cfg(test)]
#[path = "catalog_model_tests.rs"]
mod model_tests;

#[cfg(test)]
#[path = "catalog_scale_tests.rs"]
mod catalog_scale_tests;

#[cfg(test)]
mod tier_rows_tests {
    use super::*;

    #[test]
    fn every_tier_has_its_row_and_its_wire_code_reads_back() {
        for (i, row) in TIER_ROWS.iter().enumerate() {
            assert_eq!(row.tier as usize, i, "{} is not in the enum's place", row.name);
            assert_eq!(row.tier.name(), row.name);
            assert_eq!(row.lookup_counter, format!("lookup_{}", row.name));
            assert_eq!(Tier::from_wire_code(Tier::wire_code(Some(row.tier))), Some(row.tier));
        }
        // The codes on the wire before the table: engines and tools of those builds read them so.
        let codes = [Tier::Dram, Tier::Nvme, Tier::Shared, Tier::Bucket].map(|t| Tier::wire_code(Some(t)));
        assert_eq!(codes, [1, 2, 3, 4]);
        assert_eq!((Tier::wire_code(None), Tier::from_wire_code(0)), (0, None));
        assert_eq!(Tier::from_wire_code(TIER_ROWS.len() as u8 + 1), None, "a newer peer's tier reads as none");
        let remote: Vec<_> = TIER_ROWS.iter().filter(|r| r.tier.is_remote()).map(|r| r.name).collect();
        assert_eq!(remote, ["shared", "bucket"]);
    }
}
