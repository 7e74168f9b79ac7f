//! Small catalogs and a store path for the unit tests of the catalog's parts.

use super::{Catalog, MetaWrite, Persist, PutStep, SlotLayout, WriteOutcome};
use crate::format::trailer::TrailerEntry;
use crate::key::BlockKey;
use crate::stats::Stats;
use crate::tiers::eviction::Lru;
use crate::tiers::nvme::{Geometry, RecoveredRegion};
use std::sync::Arc;

pub(super) const SLOT_BYTES: u64 = 4096;

pub(super) fn key(k: u8) -> BlockKey {
    let mut bytes = [0u8; crate::key::KEY_BYTES];
    bytes[0] = k;
    bytes[31] = 0x5a;
    BlockKey(bytes)
}

fn checksum_of(key: &BlockKey) -> u64 {
    100 + u64::from(key.0[0])
}

fn catalog(slots: usize, geometry: Option<Geometry>) -> Catalog {
    let layout = SlotLayout {
        slot_count: slots,
        slot_bytes: SLOT_BYTES,
        object_bytes: 1000,
        max_dirty_bytes: slots * SLOT_BYTES as usize,
    };
    Catalog::new(layout, Box::new(|n| Box::new(Lru::new(n))), geometry.map(|g| (g, 1)), Arc::new(Stats::default()))
}

pub(super) fn dram_catalog(slots: usize) -> Catalog {
    catalog(slots, None)
}

/// One device of `regions` regions of `entries` entries each.
pub(super) fn nvme_catalog(slots: usize, regions: u64, entries: u64) -> Catalog {
    let region_bytes = entries * SLOT_BYTES + crate::format::trailer::trailer_bytes(entries as usize) as u64;
    let geometry = Geometry::new(SLOT_BYTES, region_bytes, regions);
    assert_eq!(geometry.max_entries, entries);
    catalog(slots, Some(geometry))
}

/// 2 DRAM slots and one device of `regions` one-entry regions, all sealed as recovery adopts them:
/// region `i` holds `key(i)` at sequence `i + 1`, on NVMe only.
pub(super) fn recovered_catalog(regions: u32) -> Catalog {
    let mut cat = nvme_catalog(2, u64::from(regions), 1);
    let found = (0..regions)
        .map(|r| {
            let key = key(r as u8);
            let entry = TrailerEntry {
                key,
                sequence: u64::from(r) + 1,
                offset: 0,
                value_bytes: 1000,
                value_checksum: checksum_of(&key),
            };
            RecoveredRegion { region: r, region_seq: u64::from(r) + 1, entries: vec![entry], sealed: true }
        })
        .collect();
    assert!(cat.adopt_recovered(0, found).is_empty());
    cat
}

/// Stores `key` as the data plane does: reserved, filled, and with an NVMe tier written, its trailers
/// landing. Its DRAM slot.
pub(super) fn put(cat: &mut Catalog, key: BlockKey) -> u32 {
    let PutStep::Fill { slot, .. } = cat.plan_put(&key) else { panic!("no slot for {key:?}") };
    let mut meta = Vec::new();
    if let Some(plan) = cat.finish_put(&key, slot, checksum_of(&key), Persist::Now, &mut meta) {
        cat.write_queued(&key, &plan);
        assert!(cat.start_write(&plan));
        meta.extend(cat.complete_write(&key, &plan, WriteOutcome::Written));
    }
    land(cat, meta);
    slot
}

/// Completes metadata writes as landed.
pub(super) fn land(cat: &mut Catalog, meta: Vec<MetaWrite>) {
    for write in meta {
        assert!(cat.complete_meta(&write, true).is_none());
    }
}
