//! Lock hold times of the catalog's whole-index calls with millions of blocks (issue 24, item 10).
//! A measurement, not a timed test: `cargo test -p kvtier-core --release catalog_scale -- --ignored
//! --nocapture` prints the figures docs/reliability.md quotes. The non-ignored test checks that a
//! scrub walk over a recovered catalog visits every visible block once, in sequence order.
//! `residency_refresh_costs` (ignored too) measures a refresh of the service's change log (issue 26):
//! the whole-index walk it was, and the tracked keys it is now.

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
    let mut catalog =
        Catalog::new(layout, Box::new(|n| Box::new(Lru::new(n))), Some((geometry, 1)), Arc::new(Stats::default()));
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

/// Loads `keys` NVMe-only blocks into DRAM (the catalog's own path): each goes from NVMe to
/// DRAM+NVMe, a change of tiers. Returns the microseconds the loads' catalog calls took.
fn load_into_dram(catalog: &mut Catalog, keys: &[BlockKey]) -> f64 {
    micros(|| {
        for key in keys {
            let GetStep::Nvme(read) = catalog.plan_get(key, false) else { panic!("an NVMe read") };
            catalog.finish_get_nvme(key, &read, LoadOutcome::Ok);
        }
    })
}

#[test]
#[ignore = "measurement: run with --ignored --nocapture in release"]
fn residency_refresh_costs() {
    use crate::service::changes::{ChangeLog, LOG_CAPACITY};
    const CHANGED: u64 = 1000;
    for millions in [1u64, 2, 4] {
        let blocks = millions * 1_000_000;
        let mut catalog = recovered_catalog(blocks);
        // Before: every refresh walked the index under the lock and diffed a full snapshot.
        let mut snapshot = HashMap::new();
        let walk = micros(|| catalog.residency(&mut snapshot));
        let mut log = ChangeLog::new(LOG_CAPACITY);
        let first_update = micros(|| log.update(snapshot.clone()));
        let steady_update = micros(|| log.update(snapshot.clone()));
        let untracked = load_into_dram(&mut catalog, &(0..CHANGED).map(key_of).collect::<Vec<_>>());
        // After: the first refresh walks once; then a refresh looks up the keys that changed.
        let mut log = ChangeLog::new(LOG_CAPACITY);
        let first = catalog.residency_changes(true, LOG_CAPACITY);
        log.apply(first, Some(Vec::new()));
        let tracked = load_into_dram(&mut catalog, &(CHANGED..2 * CHANGED).map(key_of).collect::<Vec<_>>());
        let mut changes = None;
        let hold = micros(|| changes = Some(catalog.residency_changes(false, LOG_CAPACITY)));
        let Some(ResidencyChanges::Keys(keys)) = changes.take() else { panic!("tracked keys expected") };
        // The loads evict most of the first batch's DRAM copies: those keys changed too.
        let changed = keys.len();
        assert!(changed as u64 >= CHANGED);
        let apply = micros(|| log.apply(ResidencyChanges::Keys(keys), None));
        let idle = micros(|| changes = Some(catalog.residency_changes(false, LOG_CAPACITY)));
        assert_eq!(changes, Some(ResidencyChanges::Keys(Vec::new())));
        println!(
            "{millions}M blocks: before: residency walk {walk:.0} us under the lock, ChangeLog update {first_update:.0} \
             us (first) {steady_update:.0} us (nothing changed); after, {changed} changed: lock hold {hold:.0} us, \
             apply {apply:.0} us; nothing changed: lock hold {idle:.1} us; {CHANGED} loads' catalog calls \
             {untracked:.0} us untracked, {tracked:.0} us tracked"
        );
        drop(catalog);
        shared_index_walk(blocks);
    }
}

/// The shared tier's index walk a refresh makes (its `KeyIndex::cut`, at most `LOG_CAPACITY * 16`
/// keys: the first cut fills it, a later one keeps what it named) and the change log's diff of the
/// shared keys, with `blocks` keys.
fn shared_index_walk(blocks: u64) {
    use crate::format::shared::IndexEntry;
    use crate::service::changes::{ChangeLog, LOG_CAPACITY};
    let mut index = crate::tiers::shared::index::Index::default();
    for file in 0..blocks.div_ceil(1000) {
        let entries: Vec<IndexEntry> = (file * 1000..((file + 1) * 1000).min(blocks))
            .map(|i| IndexEntry { key: key_of(i), offset: i, value_checksum: i })
            .collect();
        index.insert_file(format!("f{file}"), 1 << 20, 0, &entries);
    }
    let (limit, mut keys) = (LOG_CAPACITY * 16, Vec::new());
    let first = micros(|| keys = index.cut(limit));
    let steady = micros(|| keys = index.cut(limit));
    let taken = micros(|| drop(index.keys().take(limit).copied().collect::<Vec<_>>()));
    let mut log = ChangeLog::new(LOG_CAPACITY);
    log.apply(ResidencyChanges::Keys(Vec::new()), Some(keys.clone()));
    let diff = micros(|| log.apply(ResidencyChanges::Keys(Vec::new()), Some(keys.clone())));
    println!(
        "  shared index of {}M keys: cut of {} keys (under its read lock) {first:.0} us first, {steady:.0} us after \
         (a cut in map order: {taken:.0} us), change log diff {diff:.0} us; skipped when its generation is unchanged",
        blocks / 1_000_000,
        keys.len()
    );
}
