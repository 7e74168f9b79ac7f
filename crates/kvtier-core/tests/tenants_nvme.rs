//! The NVMe tier split by tenant (`tenant_shares_nvme`, docs/tenants.md "Shares of the NVMe tier"),
//! with both I/O engines: a tenant that floods the store rewrites its own regions and leaves a quiet
//! tenant's blocks on NVMe, where one log for everyone loses them; the per-tenant figures show it.

mod common;

use common::*;
use kvtier_core::{tenant_id, tenant_label, EngineChoice, Store, StoreConfig};
use std::path::Path;

const OBJ: usize = 256 * 1024;
/// The quiet tenant's blocks: four regions' worth, within its share of the device.
const QUIET: u64 = 12;
/// The flood: several times the whole NVMe tier.
const FLOOD: u64 = 300;

fn cfg(dir: &Path, engine: EngineChoice, split_nvme: bool) -> StoreConfig {
    let mut c = config(dir, engine, OBJ);
    c.dram_bytes = 16 * (OBJ + 4096);
    c.nvme_bytes = 16 << 20;
    c.region_bytes = 1 << 20;
    c.tenant_dram_share = 0.4;
    c.tenant_shares_nvme = split_nvme;
    c
}

/// Stores the quiet tenant's blocks, then the flood's, each named for its tenant before the put (as
/// the engine's manager does); returns how many of the quiet tenant's blocks are served afterwards.
fn quiet_hits_after_a_flood(store: &Store) -> usize {
    let quiet: Vec<u64> = (0..QUIET).collect();
    let flood: Vec<u64> = (1000..1000 + FLOOD).collect();
    store.assign_tenant(&quiet.iter().map(|&i| key(i)).collect::<Vec<_>>(), &tenant_id(b"quiet"));
    assert!(put(store, &quiet).iter().all(|&ok| ok));
    store.flush().unwrap();
    for chunk in flood.chunks(8) {
        store.assign_tenant(&chunk.iter().map(|&i| key(i)).collect::<Vec<_>>(), &tenant_id(b"flood"));
        put(store, chunk);
        store.flush().unwrap();
    }
    get_checked(store, &quiet).iter().filter(|&&hit| hit).count()
}

fn field(store: &Store, name: &str) -> Option<u64> {
    store.stats().tenant_fields.iter().find(|(n, _)| n == name).map(|&(_, v)| v)
}

#[test]
fn a_flood_leaves_the_quiet_tenants_blocks_on_nvme_when_the_tier_is_split() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(cfg(dir.path(), engine, true)).unwrap();
        assert_eq!(quiet_hits_after_a_flood(&store), QUIET as usize, "{engine:?}: the quiet tenant lost blocks");
        assert!(store.stats().counters.nvme_hits > 0, "{engine:?}: some came from NVMe, past its DRAM share");
        let quiet = tenant_label(&tenant_id(b"quiet"));
        let flood = tenant_label(&tenant_id(b"flood"));
        let held = field(&store, &format!("tenant_nvme_bytes:{quiet}")).expect("the quiet tenant's NVMe figure");
        assert!(held >= 4 << 20, "{engine:?}: the quiet tenant holds {held} bytes of NVMe");
        assert_eq!(field(&store, &format!("tenant_nvme_reclaimed_regions:{quiet}")), Some(0), "{engine:?}");
        let rewritten = field(&store, &format!("tenant_nvme_reclaimed_regions:{flood}")).unwrap();
        assert!(rewritten > 10, "{engine:?}: the flood rewrote {rewritten} regions of its own");
        store.close().unwrap();
    }
}

#[test]
fn one_log_for_every_tenant_loses_the_quiet_tenants_blocks_to_the_flood() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(cfg(dir.path(), EngineChoice::Psync, false)).unwrap();
    let hits = quiet_hits_after_a_flood(&store);
    assert!(hits < QUIET as usize, "the flood took nothing ({hits} of {QUIET} served)");
    assert_eq!(store.stats().counters.nvme_hits, 0, "only the DRAM share kept some ({hits} served)");
    let quiet = tenant_label(&tenant_id(b"quiet"));
    assert_eq!(field(&store, &format!("tenant_nvme_bytes:{quiet}")), None, "no NVMe figures when not split");
    store.close().unwrap();
}
