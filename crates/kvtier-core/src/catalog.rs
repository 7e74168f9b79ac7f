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

use crate::format::trailer::TrailerEntry;
use crate::key::BlockKey;
use crate::stats::Stats;
use crate::tiers::eviction::EvictionPolicy;
use crate::tiers::nvme::{Geometry, RecoveredRegion};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

mod index;

pub use index::ResidencyChanges;
use index::{Entry, Index};

/// Where a block is served from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Dram,
    Nvme,
    Shared,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Tier::Dram => "dram",
            Tier::Nvme => "nvme",
            Tier::Shared => "shared",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvmeLoc {
    pub device: u16,
    pub region: u32,
    /// Byte offset of the entry inside its region.
    pub offset: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    Filling,
    Loading,
    Resident,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    key: Option<BlockKey>,
    state: SlotState,
    writing: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RegionState {
    Free,
    Open,
    Sealing,
    Sealed,
}

#[derive(Debug)]
struct Region {
    state: RegionState,
    region_seq: u64,
    cursor: u64,
    entries: Vec<TrailerEntry>,
    pending_writes: u32,
}

struct DeviceRegions {
    regions: Vec<Region>,
    open: Option<u32>,
}

struct NvmeState {
    geometry: Geometry,
    devices: Vec<DeviceRegions>,
    next_device: usize,
    next_region_seq: u64,
}

impl NvmeState {
    /// Whether dropping the write planned at `loc` leaves every open region without a hole: it is the
    /// last entry planned in its device's open region, or its region is sealing.
    fn cancel_leaves_no_hole(&self, loc: NvmeLoc) -> bool {
        let device = &self.devices[loc.device as usize];
        let region = &device.regions[loc.region as usize];
        match device.open {
            Some(open) if open == loc.region => loc.offset + self.geometry.slot_bytes == region.cursor,
            _ => region.state == RegionState::Sealing,
        }
    }

    /// The write planned at `loc` is dropped: if it was its open region's last entry, the next
    /// entry takes its place.
    fn rewind_if_last(&mut self, loc: NvmeLoc) {
        let slot_bytes = self.geometry.slot_bytes;
        let device = &mut self.devices[loc.device as usize];
        let region = &mut device.regions[loc.region as usize];
        if device.open == Some(loc.region) && loc.offset + slot_bytes == region.cursor {
            region.cursor = loc.offset;
        }
    }
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

const MAX_TRAILER_ATTEMPTS: u32 = 4;

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
    Fill { slot: u32, sequence: u64 },
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
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    policy: Box<dyn EvictionPolicy>,
    nvme: Option<NvmeState>,
    next_sequence: u64,
    dirty_bytes: usize,
    max_dirty_bytes: usize,
    pending_meta_writes: usize,
    /// Loads waiting for a DRAM slot. While any waits, puts get no slot: a slot freed by a finished
    /// write or an unpin goes to the load, never to another store.
    loads_waiting: usize,
    /// NVMe entry writes handed to a device queue and not yet submitted to the kernel, by sequence:
    /// (key, slot). A load short of slots may take one of these slots (`steal_queued_write`).
    queued_writes: BTreeMap<u64, (BlockKey, u32, NvmeLoc)>,
    /// Whether loads may take the slots of queued writes (`loads_cancel_queued_writes`).
    loads_cancel_writes: bool,
    stats: Arc<Stats>,
    /// When sequences were handed out (for `kvtier trim --older-than` and `kvtier inspect`).
    pub timeline: crate::timeline::Timeline,
}

fn key_hash(key: &BlockKey) -> u64 {
    u64::from_le_bytes(key.0[..8].try_into().unwrap())
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
        policy: Box<dyn EvictionPolicy>,
        geometry: Option<(Geometry, usize)>,
        stats: Arc<Stats>,
    ) -> Self {
        let SlotLayout { slot_count, slot_bytes, object_bytes, max_dirty_bytes } = layout;
        let nvme = geometry.map(|(geometry, device_count)| NvmeState {
            geometry,
            devices: (0..device_count)
                .map(|_| DeviceRegions {
                    regions: (0..geometry.region_count)
                        .map(|_| Region {
                            state: RegionState::Free,
                            region_seq: 0,
                            cursor: 0,
                            entries: Vec::new(),
                            pending_writes: 0,
                        })
                        .collect(),
                    open: None,
                })
                .collect(),
            next_device: 0,
            next_region_seq: 1,
        });
        Catalog {
            slot_bytes,
            object_bytes,
            index: Index::default(),
            slots: vec![Slot { key: None, state: SlotState::Free, writing: false }; slot_count],
            free_slots: (0..slot_count as u32).rev().collect(),
            policy,
            nvme,
            next_sequence: 1,
            dirty_bytes: 0,
            max_dirty_bytes,
            pending_meta_writes: 0,
            loads_waiting: 0,
            queued_writes: BTreeMap::new(),
            loads_cancel_writes: true,
            stats,
            timeline: crate::timeline::Timeline::default(),
        }
    }

    /// Loads what recovery found on one device; returns trailers to write for scanned regions.
    pub fn adopt_recovered(&mut self, device: usize, recovered: Vec<RecoveredRegion>) -> Vec<MetaWrite> {
        let mut meta = Vec::new();
        let Some(nvme) = self.nvme.as_mut() else { return meta };
        // No store reaches 2^62 puts or regions: larger values are forged or corrupt, and would overflow
        // the counters below. Such entries are dropped and such region generations clamped.
        const SEQ_LIMIT: u64 = 1 << 62;
        for mut r in recovered {
            r.region_seq = r.region_seq.min(SEQ_LIMIT);
            r.entries.retain(|e| e.sequence < SEQ_LIMIT);
            let region = &mut nvme.devices[device].regions[r.region as usize];
            region.region_seq = r.region_seq;
            region.cursor = nvme.geometry.data_bytes();
            nvme.next_region_seq = nvme.next_region_seq.max(r.region_seq + 1);
            for e in &r.entries {
                self.next_sequence = self.next_sequence.max(e.sequence + 1);
                let loc = NvmeLoc { device: device as u16, region: r.region, offset: e.offset };
                let newer = self.index.get(&e.key).is_none_or(|old| old.sequence < e.sequence);
                if newer {
                    self.index.insert(
                        e.key,
                        Entry {
                            sequence: e.sequence,
                            value_checksum: e.value_checksum,
                            dram: None,
                            dram_ready: false,
                            nvme: Some(loc),
                            write_pending: false,
                            pins: 0,
                            readers: 0,
                            loading: false,
                        },
                    );
                }
            }
            Stats::add(&self.stats.recovered_blocks, r.entries.len() as u64);
            region.entries = r.entries;
            if r.sealed {
                region.state = RegionState::Sealed;
            } else {
                region.state = RegionState::Sealing;
                self.pending_meta_writes += 1;
                meta.push(MetaWrite {
                    device,
                    region: r.region,
                    region_seq: region.region_seq,
                    entries: Some(region.entries.clone()),
                    attempt: 0,
                });
            }
        }
        meta
    }

    // ---- lookups and pins (scheduler side) ----

    /// Dates the recovered blocks by the namespace's saved timeline (after every device's
    /// `adopt_recovered`); new sequences start past every saved point.
    pub fn restore_timeline(&mut self, saved: Vec<(u64, u64)>) {
        let (timeline, next_sequence) = crate::timeline::Timeline::restored(saved, self.next_sequence);
        self.timeline = timeline;
        self.next_sequence = next_sequence;
    }

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

    /// Pins the leading visible keys; returns how many were pinned.
    pub fn pin_prefix(&mut self, keys: &[BlockKey]) -> usize {
        let mut pinned = 0;
        for key in keys {
            match self.index.get_mut(key) {
                Some(e) if e.visible() => {
                    e.pins += 1;
                    pinned += 1;
                }
                _ => break,
            }
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
        e.pins += 1;
        e.readers += 1;
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
                e.pins = e.pins.saturating_sub(1);
                // A copy quarantined or failed while pinned leaves an entry with no copy: it goes
                // with the last pin.
                self.forget_if_copyless(key);
            }
        }
    }

    // ---- DRAM slots ----

    /// A free slot, else a victim. `for_load`: a block pinned by a pending load (the engine's pin
    /// between prepare_load and complete_load) may go when it has an NVMe copy, so that a request
    /// larger than the pool's free part can still be loaded through it, round by round. A store
    /// never evicts such a block: loads go first, and its load would have to read it again.
    fn alloc_slot(&mut self, for_load: bool) -> Option<u32> {
        if let Some(slot) = self.free_slots.pop() {
            return Some(slot);
        }
        let Catalog { policy, slots, index, .. } = self;
        let victim = policy.victim(&mut |slot| {
            let s = &slots[slot as usize];
            s.state == SlotState::Resident
                && !s.writing
                && s.key
                    .and_then(|k| index.get(&k))
                    .is_none_or(|e| e.readers == 0 && (e.pins == 0 || (for_load && e.nvme.is_some())))
        })?;
        self.evict_slot(victim);
        Some(victim)
    }

    /// A slot for a load: a free slot or a victim, else, with `take_queued` (and if the store
    /// allows it), the slot of the newest stored block outside `take_queued`'s set whose NVMe write
    /// waits in a device queue. Loads go first: dropping a store that has not reached the disk costs
    /// a later miss of that block, while waiting for the write backlog to drain stalls a request
    /// that is being served now. The set names the blocks the load itself still needs.
    fn alloc_slot_for_load(&mut self, take_queued: Option<&HashSet<BlockKey>>) -> Option<u32> {
        self.alloc_slot(true).or_else(|| self.steal_queued_write(take_queued?))
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
        self.index.remove(&key);
        self.nvme.as_mut().unwrap().rewind_if_last(loc);
        self.policy.remove(slot);
        self.slots[slot as usize] = Slot { key: None, state: SlotState::Free, writing: false };
        Stats::add(&self.stats.cancelled_writes, 1);
        Some(slot)
    }

    /// Whether loads may take the slots of queued NVMe writes (default on).
    pub fn set_loads_cancel_writes(&mut self, on: bool) {
        self.loads_cancel_writes = on;
    }

    fn evict_slot(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        let key = s.key.take();
        s.state = SlotState::Free;
        Stats::add(&self.stats.dram_evictions, 1);
        if let Some(key) = key {
            if let Some(e) = self.index.get_mut(&key) {
                if e.dram == Some(slot) {
                    e.dram = None;
                    e.dram_ready = false;
                }
                if e.dram.is_none() && e.nvme.is_none() && !e.write_pending {
                    self.index.remove(&key);
                }
            }
        }
    }

    /// Takes a slot out of use for good: neither free nor a victim (it stays `Loading`, keyless).
    fn retire_slot(&mut self, slot: u32) {
        self.policy.remove(slot);
        self.slots[slot as usize] = Slot { key: None, state: SlotState::Loading, writing: false };
        Stats::add(&self.stats.retired_slots, 1);
    }

    fn free_slot(&mut self, slot: u32) {
        self.policy.remove(slot);
        self.slots[slot as usize] = Slot { key: None, state: SlotState::Free, writing: false };
        self.free_slots.push(slot);
    }

    /// A new entry for `key` whose only copy is `slot`, not yet visible; returns its sequence.
    fn claim_slot(&mut self, key: &BlockKey, slot: u32, state: SlotState, pins: u32) -> u64 {
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        self.timeline.record(sequence);
        self.slots[slot as usize] = Slot { key: Some(*key), state, writing: false };
        self.index.insert(
            *key,
            Entry {
                sequence,
                value_checksum: 0,
                dram: Some(slot),
                dram_ready: false,
                nvme: None,
                write_pending: false,
                pins,
                readers: 0,
                loading: state == SlotState::Loading,
            },
        );
        sequence
    }

    // ---- loads ----

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
            e.pins += 1;
            e.readers += 1;
            self.policy.touch(slot);
            return GetStep::Dram { slot };
        }
        if e.loading {
            return GetStep::Pending;
        }
        let Some(loc) = e.nvme else { return GetStep::Miss };
        if direct {
            e.pins += 1;
            return GetStep::Nvme(NvmeRead {
                slot: NO_SLOT,
                loc,
                sequence: e.sequence,
                value_checksum: e.value_checksum,
            });
        }
        let Some(slot) = self.alloc_slot_for_load(take_queued) else { return GetStep::NoSlot };
        // Eviction and stealing only drop entries without an NVMe copy, so this one is still here.
        let e = self.index.get_mut(key).expect("entry with an NVMe copy survives eviction");
        e.pins += 1;
        e.loading = true;
        self.slots[slot as usize] = Slot { key: Some(*key), state: SlotState::Loading, writing: false };
        GetStep::Nvme(NvmeRead { slot, loc, sequence: e.sequence, value_checksum: e.value_checksum })
    }

    pub fn finish_get_dram(&mut self, key: &BlockKey) {
        if let Some(e) = self.index.get_mut(key) {
            e.pins = e.pins.saturating_sub(1);
            e.readers = e.readers.saturating_sub(1);
        }
    }

    pub fn finish_get_nvme(&mut self, key: &BlockKey, read: &NvmeRead, outcome: LoadOutcome) {
        let Some(e) = self.index.get_mut(key) else {
            if read.slot != NO_SLOT {
                self.free_slot(read.slot);
            }
            return;
        };
        e.pins = e.pins.saturating_sub(1);
        if !matches!(outcome, LoadOutcome::Ok) && e.nvme == Some(read.loc) {
            e.nvme = None;
        }
        if read.slot != NO_SLOT {
            e.loading = false;
            match outcome {
                LoadOutcome::Ok if e.dram.is_none() => {
                    e.dram = Some(read.slot);
                    e.dram_ready = true;
                    self.slots[read.slot as usize].state = SlotState::Resident;
                    self.promote(read.slot, key);
                }
                LoadOutcome::Abandoned => self.retire_slot(read.slot),
                _ => self.free_slot(read.slot),
            }
        }
        // Still pinned (by the engine, or another load): an entry left with no copy stays and goes with
        // its last pin; removed now, those pins would later be taken off a new entry of the same key,
        // which could then be evicted under a reader.
        self.forget_if_copyless(key);
    }

    /// A block read up from NVMe or the shared tier enters the eviction policy as one already used
    /// once: it was read because it was hit. As a newcomer (S3-FIFO's small queue) it would be the
    /// first victim of the next promotion, so a prefetch of a long prefix would evict its own
    /// earlier blocks before the load that follows could copy them (each block read twice).
    fn promote(&mut self, slot: u32, key: &BlockKey) {
        self.policy.insert(slot, key_hash(key));
        self.policy.touch(slot);
    }

    /// Drops an entry left with no copy once nothing pins, fills or writes it, so that the block can
    /// be stored again.
    fn forget_if_copyless(&mut self, key: &BlockKey) {
        let copyless = |e: &Entry| e.pins == 0 && !e.visible() && e.dram.is_none() && !e.write_pending;
        if self.index.get(key).is_some_and(copyless) {
            self.index.remove(key);
        }
    }

    // ---- stores ----

    pub fn plan_put(&mut self, key: &BlockKey) -> PutStep {
        if let Some(e) = self.index.get(key) {
            if let (true, Some(slot)) = (e.dram_ready, e.dram) {
                self.policy.touch(slot);
            }
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
        let Some(slot) = self.alloc_slot(false) else { return PutStep::NoSlot };
        if needs_write {
            self.dirty_bytes += self.slot_bytes as usize;
        }
        let sequence = self.claim_slot(key, slot, SlotState::Filling, 0);
        PutStep::Fill { slot, sequence }
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
        let ours = self.index.get(key).is_some_and(|e| e.dram == Some(slot) && !e.dram_ready);
        assert!(ours, "abort_put of a slot that is not a reserved fill of this key");
        assert_eq!(self.slots[slot as usize].state, SlotState::Filling);
        self.index.remove(key);
        if self.nvme.is_some() {
            self.dirty_bytes -= self.slot_bytes as usize;
        }
        self.free_slot(slot);
    }

    /// A reserved put given up while a writer may still copy into its slot (the host service's
    /// connection that holds it is alive but hung): forgets the entry and gives back its share of
    /// the write backlog now, but keeps the slot out of use, keyless and never allocated or evicted,
    /// until `free_abandoned_slot`: a late copy then lands in a slot no block uses.
    pub fn abandon_put(&mut self, key: &BlockKey, slot: u32) {
        let ours = self.index.get(key).is_some_and(|e| e.dram == Some(slot) && !e.dram_ready);
        assert!(ours, "abandon_put of a slot that is not a reserved fill of this key");
        assert_eq!(self.slots[slot as usize].state, SlotState::Filling);
        self.index.remove(key);
        if self.nvme.is_some() {
            self.dirty_bytes -= self.slot_bytes as usize;
        }
        self.slots[slot as usize] = Slot { key: None, state: SlotState::Filling, writing: false };
    }

    /// The last writer of an abandoned slot let go: the slot is free again.
    pub fn free_abandoned_slot(&mut self, slot: u32) {
        let s = &self.slots[slot as usize];
        assert!(s.state == SlotState::Filling && s.key.is_none(), "slot {slot} was not abandoned");
        self.free_slot(slot);
    }

    /// The slot now holds the whole value; makes it visible and plans its NVMe write.
    pub fn finish_put(
        &mut self,
        key: &BlockKey,
        slot: u32,
        value_checksum: u64,
        meta: &mut Vec<MetaWrite>,
    ) -> Option<WritePlan> {
        let e = self.index.get_mut(key).expect("filled entry exists");
        e.value_checksum = value_checksum;
        e.dram_ready = true;
        self.slots[slot as usize].state = SlotState::Resident;
        self.policy.insert(slot, key_hash(key));
        Stats::add(&self.stats.puts, 1);
        self.nvme.as_ref()?;
        let Some((loc, region_seq)) = self.alloc_nvme(meta) else {
            // Every region is open, sealing or pinned: the block stays in DRAM only.
            self.dirty_bytes -= self.slot_bytes as usize;
            Stats::add(&self.stats.nvme_dropped_writes, 1);
            return None;
        };
        self.slots[slot as usize].writing = true;
        let e = self.index.get_mut(key).unwrap();
        e.write_pending = true;
        Some(WritePlan { slot, loc, region_seq, sequence: e.sequence })
    }

    fn alloc_nvme(&mut self, meta: &mut Vec<MetaWrite>) -> Option<(NvmeLoc, u64)> {
        let device_count = self.nvme.as_ref()?.devices.len();
        for _ in 0..device_count {
            let nvme = self.nvme.as_mut().unwrap();
            let device = nvme.next_device;
            nvme.next_device = (device + 1) % device_count;
            if let Some(region) = self.open_region(device, meta) {
                let nvme = self.nvme.as_mut().unwrap();
                let r = &mut nvme.devices[device].regions[region as usize];
                let loc = NvmeLoc { device: device as u16, region, offset: r.cursor };
                r.cursor += nvme.geometry.slot_bytes;
                r.pending_writes += 1;
                return Some((loc, r.region_seq));
            }
        }
        None
    }

    /// The device's open region with room for one more entry, opening (and if needed reclaiming) one.
    fn open_region(&mut self, device: usize, meta: &mut Vec<MetaWrite>) -> Option<u32> {
        let nvme = self.nvme.as_mut().unwrap();
        let geometry = nvme.geometry;
        if let Some(open) = nvme.devices[device].open {
            if nvme.devices[device].regions[open as usize].cursor + geometry.slot_bytes <= geometry.data_bytes() {
                return Some(open);
            }
            self.seal(device, open, meta);
        }
        let nvme = self.nvme.as_mut().unwrap();
        let free = nvme.devices[device].regions.iter().position(|r| r.state == RegionState::Free);
        let (region, reclaimed) = match free {
            Some(r) => (r as u32, false),
            None => (self.reclaim_oldest(device)?, true),
        };
        let nvme = self.nvme.as_mut().unwrap();
        let region_seq = nvme.next_region_seq;
        nvme.next_region_seq += 1;
        let r = &mut nvme.devices[device].regions[region as usize];
        *r = Region { state: RegionState::Open, region_seq, cursor: 0, entries: Vec::new(), pending_writes: 0 };
        nvme.devices[device].open = Some(region);
        if reclaimed {
            self.pending_meta_writes += 1;
            meta.push(MetaWrite { device, region, region_seq, entries: None, attempt: 0 });
        }
        Some(region)
    }

    fn seal(&mut self, device: usize, region: u32, meta: &mut Vec<MetaWrite>) {
        let nvme = self.nvme.as_mut().unwrap();
        nvme.devices[device].open = None;
        let r = &mut nvme.devices[device].regions[region as usize];
        r.state = RegionState::Sealing;
        if r.pending_writes == 0 {
            self.pending_meta_writes += 1;
            meta.push(MetaWrite {
                device,
                region,
                region_seq: r.region_seq,
                entries: Some(r.entries.clone()),
                attempt: 0,
            });
        }
    }

    /// Evicts the oldest sealed region of `device` with no pinned entry; returns it.
    fn reclaim_oldest(&mut self, device: usize) -> Option<u32> {
        let nvme = self.nvme.as_ref().unwrap();
        let mut candidates: Vec<(u64, u32)> = nvme.devices[device]
            .regions
            .iter()
            .enumerate()
            .filter(|(_, r)| r.state == RegionState::Sealed)
            .map(|(i, r)| (r.region_seq, i as u32))
            .collect();
        candidates.sort_unstable();
        let lives_here =
            |e: &Entry, region: u32| e.nvme.is_some_and(|l| l.device as usize == device && l.region == region);
        // A pinned entry whose copy here a failed read dropped (same sequence) may still have a read
        // of this location in flight: the region waits for its pins too.
        let victim = candidates.into_iter().map(|(_, r)| r).find(|&region| {
            nvme.devices[device].regions[region as usize].entries.iter().all(|t| {
                self.index
                    .get(&t.key)
                    .is_none_or(|e| e.pins == 0 || !(lives_here(e, region) || e.sequence == t.sequence))
            })
        })?;
        let entries = std::mem::take(&mut self.nvme.as_mut().unwrap().devices[device].regions[victim as usize].entries);
        for t in &entries {
            if let Some(e) = self.index.get_mut(&t.key) {
                if lives_here(e, victim) {
                    e.nvme = None;
                    if e.dram.is_none() && !e.write_pending {
                        self.index.remove(&t.key);
                    }
                }
            }
        }
        Stats::add(&self.stats.nvme_region_evictions, 1);
        Some(victim)
    }

    /// The data plane handed `plan`'s write to its device queue (its descriptor page is stamped):
    /// from now until `start_write`, a load short of slots may take the slot.
    pub fn write_queued(&mut self, key: &BlockKey, plan: &WritePlan) {
        if self.index.get(key).is_some_and(|e| e.sequence == plan.sequence && e.dram == Some(plan.slot)) {
            self.queued_writes.insert(plan.sequence, (*key, plan.slot, plan.loc));
        }
    }

    /// The device queue is about to submit `plan`'s write: `false` if a load took its slot (the
    /// write must not be submitted; complete it as `Cancelled`).
    pub fn start_write(&mut self, plan: &WritePlan) -> bool {
        self.queued_writes.remove(&plan.sequence).is_some()
    }

    /// An entry write finished; returns a trailer to write if its region is now complete.
    pub fn complete_write(&mut self, key: &BlockKey, plan: &WritePlan, outcome: WriteOutcome) -> Option<MetaWrite> {
        let ok = outcome == WriteOutcome::Written;
        self.queued_writes.remove(&plan.sequence);
        // A cancelled write stays in the backlog until the queue reaches it, so that `flush` (which
        // waits for an empty backlog) also waits for the trailer of a sealing region it completes.
        self.dirty_bytes -= self.slot_bytes as usize;
        if outcome != WriteOutcome::Cancelled {
            // A cancelled write's slot belongs to the load that took it.
            self.slots[plan.slot as usize].writing = false;
        }
        let slot_bytes = self.slot_bytes;
        let object_bytes = self.object_bytes;
        let e = self.index.get_mut(key).filter(|e| e.sequence == plan.sequence);
        let nvme = self.nvme.as_mut().unwrap();
        let r = &mut nvme.devices[plan.loc.device as usize].regions[plan.loc.region as usize];
        r.pending_writes -= 1;
        if let Some(e) = e {
            e.write_pending = false;
            if ok {
                e.nvme = Some(plan.loc);
                r.entries.push(TrailerEntry {
                    key: *key,
                    sequence: e.sequence,
                    offset: plan.loc.offset,
                    value_bytes: object_bytes,
                    value_checksum: e.value_checksum,
                });
                Stats::add(&self.stats.bytes_written_nvme, slot_bytes);
            }
        }
        if outcome == WriteOutcome::Failed {
            Stats::add(&self.stats.io_errors, 1);
        }
        if r.state == RegionState::Sealing && r.pending_writes == 0 {
            self.pending_meta_writes += 1;
            return Some(MetaWrite {
                device: plan.loc.device as usize,
                region: plan.loc.region,
                region_seq: r.region_seq,
                entries: Some(r.entries.clone()),
                attempt: 0,
            });
        }
        None
    }

    /// A metadata write finished; returns the write to retry if a trailer write failed.
    pub fn complete_meta(&mut self, write: &MetaWrite, ok: bool) -> Option<MetaWrite> {
        self.pending_meta_writes -= 1;
        if !ok {
            Stats::add(&self.stats.io_errors, 1);
            if write.entries.is_some() && write.attempt + 1 < MAX_TRAILER_ATTEMPTS {
                self.pending_meta_writes += 1;
                return Some(MetaWrite {
                    device: write.device,
                    region: write.region,
                    region_seq: write.region_seq,
                    entries: write.entries.clone(),
                    attempt: write.attempt + 1,
                });
            }
        }
        if write.entries.is_some() {
            if let Some(nvme) = self.nvme.as_mut() {
                let r = &mut nvme.devices[write.device].regions[write.region as usize];
                if r.state == RegionState::Sealing && r.region_seq == write.region_seq {
                    r.state = RegionState::Sealed;
                }
            }
        }
        None
    }

    /// Nothing accepted is waiting to reach NVMe.
    pub fn io_idle(&self) -> bool {
        self.dirty_bytes == 0 && self.pending_meta_writes == 0
    }

    pub fn gauges(&self) -> Gauges {
        let resident = self.slots.iter().filter(|s| s.state == SlotState::Resident).count();
        let (used_regions, total_regions, region_bytes) = match &self.nvme {
            Some(n) => {
                let all = n.devices.iter().flat_map(|d| d.regions.iter());
                let used = all.clone().filter(|r| r.state != RegionState::Free).count();
                (used as u64, all.count() as u64, n.geometry.region_bytes)
            }
            None => (0, 0, 0),
        };
        Gauges {
            dram_used_bytes: resident as u64 * self.slot_bytes,
            dram_capacity_bytes: self.slots.len() as u64 * self.slot_bytes,
            nvme_used_bytes: used_regions * region_bytes,
            nvme_capacity_bytes: total_regions * region_bytes,
            blocks_dram: self.index.counted().dram,
            blocks_nvme: self.index.counted().nvme,
        }
    }

    /// Checks the catalog's invariants (tests and debug builds).
    pub fn check_invariants(&self) {
        self.index.check();
        let loading: HashSet<BlockKey> =
            self.slots.iter().filter(|s| s.state == SlotState::Loading).filter_map(|s| s.key).collect();
        for (key, e) in &self.index {
            assert!(e.readers <= e.pins, "{key:?}: more readers than pins");
            assert_eq!(e.loading, loading.contains(key), "{key:?}: loading flag disagrees with the slots");
            if let Some(slot) = e.dram {
                let s = &self.slots[slot as usize];
                assert_eq!(s.key, Some(*key), "slot {slot} does not point back to its entry");
                if e.dram_ready {
                    assert_eq!(s.state, SlotState::Resident);
                }
            }
        }
        let free = self.slots.iter().filter(|s| s.state == SlotState::Free).count();
        assert!(self.free_slots.len() <= free);
        for (&sequence, &(key, slot, _)) in &self.queued_writes {
            let s = &self.slots[slot as usize];
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
}

/// Loads from the shared-filesystem tier (`tiers::shared`): for a block the catalog does not hold, it
/// hands out a DRAM slot to read into and, once the mover has read and verified it, makes the block
/// resident (mirroring `plan_get` / `finish_get_nvme`). Pins cannot protect a shared-only block from
/// another node's evictor; a read that loses that race is a clean miss.
impl Catalog {
    /// A slot in `Loading` state for `key`, or `None` when the catalog already has an entry for it (a
    /// put or another load in flight) or no slot can be freed.
    pub fn plan_get_shared(&mut self, key: &BlockKey) -> Option<u32> {
        self.plan_get_shared_with(key, None)
    }

    /// `plan_get_shared` that may take the slot of a queued write of a block outside `spare` (see
    /// `alloc_slot_for_load`).
    pub fn plan_get_shared_taking_queued_write(&mut self, key: &BlockKey, spare: &HashSet<BlockKey>) -> Option<u32> {
        self.plan_get_shared_with(key, Some(spare))
    }

    fn plan_get_shared_with(&mut self, key: &BlockKey, take_queued: Option<&HashSet<BlockKey>>) -> Option<u32> {
        if self.index.contains_key(key) {
            return None;
        }
        let slot = self.alloc_slot_for_load(take_queued)?;
        self.claim_slot(key, slot, SlotState::Loading, 1);
        Some(slot)
    }

    /// The shared read into `slot` finished: `Some(checksum)` makes the block resident, `None` (a miss)
    /// drops the entry and frees the slot.
    /// A shared-tier read into `slot` that the I/O engine gave up: the kernel may still write into
    /// the slot, so it is retired rather than freed.
    pub fn abandon_get_shared(&mut self, key: &BlockKey, slot: u32) {
        if self.index.get(key).is_some_and(|e| e.dram == Some(slot)) {
            self.index.remove(key);
        }
        self.retire_slot(slot);
    }

    pub fn finish_get_shared(&mut self, key: &BlockKey, slot: u32, value_checksum: Option<u64>) {
        let ours = self.index.get(key).is_some_and(|e| e.dram == Some(slot));
        match value_checksum {
            Some(sum) if ours => {
                let e = self.index.get_mut(key).unwrap();
                e.pins = e.pins.saturating_sub(1);
                e.value_checksum = sum;
                e.dram_ready = true;
                e.loading = false;
                self.slots[slot as usize].state = SlotState::Resident;
                self.promote(slot, key);
            }
            _ => {
                if ours {
                    self.index.remove(key);
                }
                self.free_slot(slot);
            }
        }
    }
}

/// Maintenance (`kvtier verify`, `kvtier trim`, `kvtier inspect`; the logic lives in `maintenance.rs`):
/// walks the index by sequence, pins what it checks, drops bad copies and frees what is not in use.
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
        e.pins += 1;
        e.readers += 1;
        let dram = match (e.dram_ready, e.dram) {
            (true, Some(slot)) if !self.slots[slot as usize].writing => Some(slot),
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

    /// Every visible block with the local tiers it is loadable from: bit 0 DRAM, bit 1 NVMe (the
    /// service's change log for KV events, `service::changes`).
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

    /// The highest sequence handed out so far (0: none yet).
    pub fn newest_sequence(&self) -> u64 {
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
        Some((lowest, highest))
    }

    /// Bytes accepted into DRAM and not yet on NVMe (the NVMe write backlog).
    pub fn write_backlog_bytes(&self) -> usize {
        self.dirty_bytes
    }

    /// A scrub found the DRAM copy in `slot` bad: no load is served from it any more. The slot is
    /// freed now when the scrub's own pin is the only one; else (a reader is copying out of it) it
    /// stays allocated, invisible, until eviction takes it once its pins are gone.
    pub fn quarantine_dram(&mut self, key: &BlockKey, slot: u32) -> bool {
        let Some(e) = self.index.get_mut(key) else { return false };
        if e.dram != Some(slot) || !e.dram_ready || self.slots[slot as usize].writing {
            return false;
        }
        e.dram_ready = false;
        if e.readers > 1 {
            return true;
        }
        e.dram = None;
        let gone = e.nvme.is_none() && !e.write_pending && e.pins <= 1;
        if gone {
            self.index.remove(key);
        }
        self.free_slot(slot);
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
        let r = &mut nvme.devices[loc.device as usize].regions[loc.region as usize];
        let before = r.entries.len();
        r.entries.retain(|t| !(t.key == *key && t.offset == loc.offset));
        if r.entries.len() != before && r.state == RegionState::Sealed {
            // Sealing until the rewrite lands: reclaim takes only sealed regions.
            r.state = RegionState::Sealing;
            self.pending_meta_writes += 1;
            meta.push(MetaWrite {
                device: loc.device as usize,
                region: loc.region,
                region_seq: r.region_seq,
                entries: Some(r.entries.clone()),
                attempt: 0,
            });
        }
    }

    /// Removes what `plan` selects and nothing in use (pinned, being filled, loaded or written).
    pub fn trim(&mut self, plan: TrimPlan, meta: &mut Vec<MetaWrite>, freed: &mut Vec<TrimmedRegion>) -> TrimCounts {
        let mut counts = TrimCounts::default();
        let old = |seq: u64| match plan {
            TrimPlan::All => true,
            TrimPlan::OlderThan(cutoff) => seq < cutoff,
            TrimPlan::NvmeTo(_) => false,
        };
        // DRAM copies (not for NvmeTo: the pool is preallocated, dropping blocks frees no memory).
        if !matches!(plan, TrimPlan::NvmeTo(_)) {
            for slot in 0..self.slots.len() as u32 {
                let s = self.slots[slot as usize];
                let Some(key) = s.key else { continue };
                if s.state != SlotState::Resident {
                    continue;
                }
                let Some(e) = self.index.get_mut(&key) else { continue };
                if e.dram != Some(slot) || !old(e.sequence) {
                    continue;
                }
                if e.pins > 0 || s.writing || e.write_pending {
                    counts.skipped_in_use += 1;
                    continue;
                }
                e.dram = None;
                e.dram_ready = false;
                if e.nvme.is_none() {
                    self.index.remove(&key);
                }
                self.free_slot(slot);
                counts.dram_blocks += 1;
                counts.dram_bytes += self.slot_bytes;
            }
        }
        let Some(nvme) = self.nvme.as_ref() else { return counts };
        let region_bytes = nvme.geometry.region_bytes;
        let mut regions: Vec<(u64, usize, u32)> = nvme
            .devices
            .iter()
            .enumerate()
            .flat_map(|(d, dev)| {
                dev.regions
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| r.state != RegionState::Free)
                    .map(move |(i, r)| (r.region_seq, d, i as u32))
            })
            .collect();
        regions.sort_unstable();
        let mut used = regions.len() as u64 * region_bytes;
        for (_, device, region) in regions {
            if let TrimPlan::NvmeTo(target) = plan {
                if used <= target {
                    break;
                }
            }
            let nvme = self.nvme.as_ref().unwrap();
            let r = &nvme.devices[device].regions[region as usize];
            let lives_here = |e: &Entry| e.nvme.is_some_and(|l| l.device as usize == device && l.region == region);
            let living: Vec<(BlockKey, u64, bool)> = r
                .entries
                .iter()
                .filter_map(|t| {
                    self.index.get(&t.key).filter(|e| lives_here(e)).map(|e| (t.key, e.sequence, e.pins > 0))
                })
                .collect();
            let all_old = living.iter().all(|&(_, seq, _)| old(seq)) || matches!(plan, TrimPlan::NvmeTo(_));
            // Also a pinned entry whose copy here a failed read dropped: a read of it may be in flight.
            let any_pinned = living.iter().any(|&(_, _, pinned)| pinned)
                || r.entries
                    .iter()
                    .any(|t| self.index.get(&t.key).is_some_and(|e| e.pins > 0 && e.sequence == t.sequence));
            if r.state == RegionState::Sealed && all_old && !any_pinned {
                // The whole region goes: entries forgotten, region free, its trailer zeroed on disk.
                let entries =
                    std::mem::take(&mut self.nvme.as_mut().unwrap().devices[device].regions[region as usize].entries);
                for t in &entries {
                    if let Some(e) = self.index.get_mut(&t.key) {
                        if lives_here(e) {
                            e.nvme = None;
                            counts.nvme_blocks += 1;
                            if e.dram.is_none() && !e.write_pending {
                                self.index.remove(&t.key);
                            }
                        }
                    }
                }
                // Held out of use (Sealing: neither reclaimed nor opened) until the caller has
                // zeroed its trailer and first entry on disk, so recovery cannot find them again.
                let nvme = self.nvme.as_mut().unwrap();
                let r = &mut nvme.devices[device].regions[region as usize];
                r.state = RegionState::Sealing;
                freed.push(TrimmedRegion { device, region, region_seq: r.region_seq });
                counts.regions_freed += 1;
                counts.nvme_bytes += region_bytes;
                used -= region_bytes;
                continue;
            }
            if matches!(plan, TrimPlan::NvmeTo(_)) || r.state == RegionState::Sealing {
                // NvmeTo frees whole regions only; a region whose trailer is being written waits.
                counts.skipped_in_use += living.len() as u64;
                continue;
            }
            // Some entries go: forgotten one by one (the region's space comes back when it is reused).
            for (key, seq, pinned) in living {
                if !old(seq) {
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
        counts
    }
}

/// A region `trim` emptied, to be zeroed on disk, then handed back with `release_trimmed`.
#[derive(Debug, Clone, Copy)]
pub struct TrimmedRegion {
    pub device: usize,
    pub region: u32,
    pub region_seq: u64,
}

impl Catalog {
    /// The trimmed regions' trailers and first entries are zeroed on disk: they are free now.
    pub fn release_trimmed(&mut self, freed: &[TrimmedRegion]) {
        let Some(nvme) = self.nvme.as_mut() else { return };
        for f in freed {
            let r = &mut nvme.devices[f.device].regions[f.region as usize];
            if r.state == RegionState::Sealing && r.region_seq == f.region_seq && r.entries.is_empty() {
                r.state = RegionState::Free;
                r.cursor = 0;
            }
        }
    }
}

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

#[derive(Debug, Clone, Copy, Default)]
pub struct TrimCounts {
    pub dram_blocks: u64,
    pub dram_bytes: u64,
    pub nvme_blocks: u64,
    pub nvme_bytes: u64,
    pub regions_freed: u64,
    pub skipped_in_use: u64,
}

#[cfg(test)]
#[path = "catalog_model_tests.rs"]
mod model_tests;

#[cfg(test)]
#[path = "catalog_scale_tests.rs"]
mod catalog_scale_tests;
