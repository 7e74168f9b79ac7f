//! The shared-filesystem tier split by tenant (`tenant_shares_shared_fs`, docs/tenants.md "Shares of
//! the remote tiers"): a tenant that floods the tier past its capacity loses its own files
//! to the evictor and leaves a quiet tenant's, which another node still reads; one least-recently-used
//! order for everyone loses them. The cap takes a tenant's files below the watermark too.

mod common;

use common::*;
use kvtier_core::{tenant_id, tenant_label, EngineChoice, SharedConfig, Store, StoreConfig, Tier};
use std::path::Path;
use std::time::{Duration, Instant};

const OBJ: usize = 64 * 1024;
/// The quiet tenant's blocks: three files, within its share of the tier.
const QUIET: u64 = 12;
/// The flood: about five times the tier's capacity.
const FLOOD: u64 = 300;

fn cfg(local: &Path, shared_root: &Path, split: bool) -> StoreConfig {
    let mut c = config(local, EngineChoice::Psync, OBJ);
    c.dram_bytes = 16 * (OBJ + 4096);
    c.nvme_bytes = 0;
    c.tenant_dram_share = 0.4;
    c.tenant_shares_shared_fs = split;
    let mut s = SharedConfig::new(shared_root);
    s.capacity_bytes = Some(4 << 20);
    s.file_target_bytes = 4 * (OBJ as u64 + 4096) + 8192;
    s.staleness_ms = 20;
    s.lease_ms = 500;
    s.grace_ms = 100;
    s.publish_delay_ms = 20;
    c.shared = Some(s);
    c
}

/// Stores the quiet tenant's blocks, then the flood's, each named for its tenant before the put (as
/// the engine's manager does), giving the evictor time to keep up.
fn store_quiet_then_flood(store: &Store) {
    let quiet: Vec<u64> = (0..QUIET).collect();
    store.assign_tenant(&quiet.iter().map(|&i| key(i)).collect::<Vec<_>>(), &tenant_id(b"quiet"));
    assert!(put(store, &quiet).iter().all(|&ok| ok));
    store.flush().unwrap();
    for chunk in (1000..1000 + FLOOD).collect::<Vec<_>>().chunks(4) {
        store.assign_tenant(&chunk.iter().map(|&i| key(i)).collect::<Vec<_>>(), &tenant_id(b"flood"));
        put(store, chunk);
        store.flush().unwrap();
        std::thread::sleep(Duration::from_millis(15));
    }
    std::thread::sleep(Duration::from_millis(300));
}

/// How many of the quiet tenant's blocks a fresh node on the same root finds in the shared tier and
/// reads back right.
fn quiet_blocks_on_another_node(dir: &Path, split: bool) -> usize {
    let other = Store::open(cfg(&dir.join("node-b"), &dir.join("shared"), split)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(2);
    while other.lookup_prefix(&[key(1000)]) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let quiet: Vec<u64> = (0..QUIET).collect();
    let tiers = other.locate_many(&quiet.iter().map(|&i| key(i)).collect::<Vec<_>>());
    let found = tiers.iter().filter(|t| **t == Some(Tier::Shared)).count();
    let served = get_checked(&other, &quiet).iter().filter(|&&hit| hit).count();
    assert_eq!(found, served, "every block found is read back right");
    other.close().unwrap();
    found
}

fn field(store: &Store, name: &str) -> Option<u64> {
    store.stats().tenant_fields.iter().find(|(n, _)| n == name).map(|&(_, v)| v)
}

#[test]
fn a_flood_leaves_the_quiet_tenants_files_on_the_shared_tier_when_it_is_split() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(cfg(&dir.path().join("node-a"), &dir.path().join("shared"), true)).unwrap();
    store_quiet_then_flood(&store);
    let counters = store.stats().counters;
    assert!(counters.shared_evicted_files > 20, "the flood filled the tier many times over: {counters:?}");
    let (quiet, flood) = (tenant_label(&tenant_id(b"quiet")), tenant_label(&tenant_id(b"flood")));
    let held = field(&store, &format!("tenant_shared_bytes:{quiet}")).expect("the quiet tenant's figure");
    assert!(held >= QUIET * OBJ as u64, "the quiet tenant holds {held} bytes of the tier");
    assert_eq!(field(&store, &format!("tenant_shared_evicted_files:{quiet}")), Some(0));
    let evicted = field(&store, &format!("tenant_shared_evicted_files:{flood}")).unwrap();
    assert!(evicted > 20, "the flood lost {evicted} files of its own");
    store.close().unwrap();
    assert_eq!(quiet_blocks_on_another_node(dir.path(), true), QUIET as usize, "the quiet tenant lost blocks");
}

#[test]
fn one_order_for_every_tenant_loses_the_quiet_tenants_files_to_the_flood() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(cfg(&dir.path().join("node-a"), &dir.path().join("shared"), false)).unwrap();
    store_quiet_then_flood(&store);
    let quiet = tenant_label(&tenant_id(b"quiet"));
    assert_eq!(field(&store, &format!("tenant_shared_bytes:{quiet}")), None, "no figures when not split");
    store.close().unwrap();
    assert_eq!(quiet_blocks_on_another_node(dir.path(), false), 0, "the oldest files went first");
}

#[test]
fn a_tenant_past_its_cap_loses_its_oldest_files_below_the_watermark() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = cfg(&dir.path().join("node-a"), &dir.path().join("shared"), true);
    (c.tenant_dram_share, c.tenant_dram_max_share) = (0.0, 0.25);
    c.shared.as_mut().unwrap().capacity_bytes = Some(16 << 20);
    let store = Store::open(c).unwrap();
    let blocks: Vec<u64> = (0..60).collect();
    for chunk in blocks.chunks(4) {
        store.assign_tenant(&chunk.iter().map(|&i| key(i)).collect::<Vec<_>>(), &tenant_id(b"big"));
        put(&store, chunk);
        store.flush().unwrap();
    }
    // The cap: a quarter of the room (0.8 of 16 MiB), 3.2 MiB; the tenant stored 60 blocks, 4.2 MB,
    // and the tier is a quarter full: below the watermark.
    let cap_bytes = (0.25 * 0.8 * (16u64 << 20) as f64) as u64;
    let big = tenant_label(&tenant_id(b"big"));
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut held = u64::MAX;
    while Instant::now() < deadline {
        held = field(&store, &format!("tenant_shared_bytes:{big}")).unwrap_or(u64::MAX);
        if held <= cap_bytes {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(held <= cap_bytes, "the tenant holds {held} bytes, past its cap of {cap_bytes}");
    assert!(held + 2 * (4 * (OBJ as u64 + 4096) + 8192) > cap_bytes, "no more than the cap asks: {held}");
    let doomed = field(&store, &format!("tenant_shared_evicted_files:{big}")).unwrap();
    assert!(doomed >= 3, "{doomed} files doomed for the cap");
    assert!(field(&store, "tenant_shared_evicted_files:default").is_none_or(|n| n == 0));
    store.close().unwrap();
}

/// The flood fills the tier to its hard ceiling with files too young to evict (a long grace period):
/// split, the quiet tenant, under its share, still publishes its blocks past the ceiling; in one
/// order for everyone its publishes are refused there with everyone else's.
#[test]
fn a_tenant_under_its_share_publishes_past_a_ceiling_the_flood_filled() {
    for split in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let mut c = cfg(&dir.path().join("node-a"), &dir.path().join("shared"), split);
        let shared = c.shared.as_mut().unwrap();
        // The ceiling at 0.85 of 4 MiB: room for the quiet tenant's two files between it and full.
        (shared.grace_ms, shared.high_watermark, shared.low_watermark) = (60_000, 0.7, 0.6);
        let store = Store::open(c).unwrap();
        for chunk in (1000..1000 + 100).collect::<Vec<_>>().chunks(4) {
            store.assign_tenant(&chunk.iter().map(|&i| key(i)).collect::<Vec<_>>(), &tenant_id(b"flood"));
            put(&store, chunk);
            store.flush().unwrap();
        }
        let refused_before = store.stats().counters.shared_publish_errors;
        assert!(refused_before > 0, "the flood reached the ceiling");
        let quiet: Vec<u64> = (0..8).collect();
        store.assign_tenant(&quiet.iter().map(|&i| key(i)).collect::<Vec<_>>(), &tenant_id(b"quiet"));
        put(&store, &quiet);
        store.flush().unwrap();
        let refused = store.stats().counters.shared_publish_errors - refused_before;
        let published = store.locate_many(&quiet.iter().map(|&i| key(i)).collect::<Vec<_>>());
        eprintln!("split {split}: {refused} of the quiet tenant's refused, {published:?}");
        if split {
            assert_eq!(refused, 0, "the quiet tenant was refused at the ceiling");
        } else {
            assert_eq!(refused, quiet.len() as u64, "one order: refused with everyone");
        }
        store.close().unwrap();
    }
}
