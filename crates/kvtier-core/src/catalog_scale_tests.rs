//! Lock hold times of the catalog's whole-index calls with millions of blocks (issue 24, item 10).
//! A measurement, not a timed test: `cargo test -p kvtier-core --release catalog_scale -- --ignored
//! --nocapture` prints the figures docs/reliability.md quotes. The non-ignored test checks that a
//! scrub walk over a recovered catalog visits every visible block once, in sequence order.

use super::*;
use crate::format::trailer::TrailerEntry;
use crate::tiers::eviction::Lru;
use crate::tiers::nvme::{Geometry, RecoveredRegion};
use std::time::Instant;

const SLOT_BYTES: u64 = 4096;
const ENTRIES_PER_REGION: u64 = 4096;

fn key_of(i: u64) -> BlockKey {
    let mut key = [0u8; crate::key::KEY_BYTES];
    key[..8].copy_from_slice(&i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
    key[8..16].copy_from_slice(&i.to_le_bytes());
    BlockKey(key)
}

/// A catalog that recovered `blocks` NVMe entries (sequences 1..=blocks) and has a small DRAM pool.
fn recovered_catalog(blocks: u64) -> Catalog {
    let regions = blocks.div_ceil(ENTRIES_PER_REGION) + 2;
    let region_bytes =
        ENTRIES_PER_REGION * SLOT_BYTES + crate::format::trailer::trailer_bytes(ENTRIES_PER_REGION as usize) as u64;
    let geometry = Geometry::new(SLOT_BYTES, region_bytes, regions);
    let layout = SlotLayout { slot_count: 1024, slot_bytes: SLOT_BYTES, object_bytes: 1000, max_dirty_bytes: 1 << 20 };
    let mut catalog = Catalog::new(layout, Box::new(Lru::new(1024)), Some((geometry, 1)), Arc::new(Stats::default()));
    let recovered = (0..blocks.div_ceil(ENTRIES_PER_REGION))
        .map(|region| {
            let first = region * ENTRIES_PER_REGION;
            let entries = (first..(first + ENTRIES_PER_REGION).min(blocks))
                .map(|i| TrailerEntry {
                    key: key_of(i),
                    sequence: i + 1,
                    offset: (i - first) * SLOT_BYTES,
                    value_bytes: 1000,
                    value_checksum: i,
                })
                .collect();
            RecoveredRegion { region: region as u32, region_seq: region + 1, entries, sealed: true }
        })
        .collect();
    catalog.adopt_recovered(0, recovered);
    catalog
}

fn micros(f: impl FnOnce()) -> f64 {
    let started = Instant::now();
    f();
    started.elapsed().as_secs_f64() * 1e6
}

#[test]
fn a_scrub_walk_visits_every_visible_block_once_in_sequence_order() {
    let catalog = recovered_catalog(10_000);
    let (mut after, mut seen) = (0, Vec::new());
    loop {
        let batch = catalog.scrub_batch(after, 64);
        if batch.is_empty() {
            break;
        }
        assert!(batch.windows(2).all(|w| w[0].0 < w[1].0));
        after = batch.last().unwrap().0;
        seen.extend(batch.into_iter().map(|(sequence, _)| sequence));
    }
    assert_eq!(seen, (1..=10_000).collect::<Vec<_>>());
    assert_eq!(catalog.visible_blocks(), 10_000);
    assert_eq!(catalog.gauges().blocks_nvme, 10_000);
    catalog.check_invariants();
}

#[test]
#[ignore = "measurement: run with --ignored --nocapture in release"]
fn catalog_scale_lock_hold_times() {
    for millions in [1u64, 2, 4] {
        let catalog = recovered_catalog(millions * 1_000_000);
        let mid = millions * 500_000;
        let scrub_first = micros(|| {
            std::hint::black_box(catalog.scrub_batch(0, 64));
        });
        let scrub_mid = micros(|| {
            std::hint::black_box(catalog.scrub_batch(mid, 64));
        });
        let gauges = micros(|| {
            std::hint::black_box(catalog.gauges());
        });
        let visible = micros(|| {
            std::hint::black_box(catalog.visible_blocks());
        });
        let sequences = micros(|| {
            std::hint::black_box(catalog.sequence_range());
        });
        let by_sequence_mib = catalog.index.by_sequence.len() * 48 / (1 << 20);
        println!(
            "{millions}M blocks: scrub_batch(64) {scrub_first:.0} us (start) {scrub_mid:.0} us (middle); \
             gauges {gauges:.0} us; visible_blocks {visible:.0} us; sequence_range {sequences:.0} us; \
             by_sequence about {by_sequence_mib} MiB"
        );
    }
}
