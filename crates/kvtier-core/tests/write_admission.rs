//! Writes below DRAM (`write_admission`, the write budgets): which stored blocks reach NVMe, what a
//! restart keeps, and that a budget refuses writes without ever refusing a store.

mod common;
use common::*;
use kvtier_core::{EngineChoice, Reservation, SharedConfig, Store, StoreConfig, WriteAdmission};

const OBJECT_BYTES: usize = 64 * 1024;
const SLOT_BYTES: u64 = OBJECT_BYTES as u64 + 4096;

fn reuse_config(dir: &std::path::Path) -> StoreConfig {
    let mut c = config(dir, EngineChoice::Psync, OBJECT_BYTES);
    c.write_admission = WriteAdmission::Reuse;
    c
}

/// Fills the 16-slot DRAM pool with blocks nobody uses again, evicting everything else.
fn flood(store: &Store, from: u64) {
    let ids: Vec<u64> = (from..from + 40).collect();
    assert!(put(store, &ids).iter().all(|&stored| stored), "a flood is stored whatever is written below");
}

#[test]
fn reuse_writes_only_the_blocks_used_again_and_drops_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(reuse_config(dir.path())).unwrap();
    assert!(put(&store, &[0, 1, 2, 3, 4, 5, 6, 7]).iter().all(|&b| b));
    store.flush().unwrap();
    let s = store.stats().counters;
    assert_eq!((s.writes_awaiting_reuse, s.bytes_written_nvme), (8, 0), "nothing is written on first sight");
    assert_eq!(get_checked(&store, &[0, 1, 2, 3]), vec![true; 4], "served from DRAM");
    store.flush().unwrap();
    let s = store.stats().counters;
    assert_eq!(s.writes_admitted_on_reuse, 4);
    assert_eq!(s.bytes_written_nvme, 4 * SLOT_BYTES, "the four reused blocks, once each");
    flood(&store, 100);
    let s = store.stats().counters;
    assert!(s.dropped_without_evidence >= 24, "unused blocks left DRAM unwritten: {s:?}");
    store.check_invariants();
    store.close().unwrap();
    let store = Store::open(reuse_config(dir.path())).unwrap();
    assert_eq!(get_checked(&store, &[0, 1, 2, 3, 4, 5, 6, 7]), [[true; 4], [false; 4]].concat());
    assert_eq!(store.stats().counters.nvme_hits, 4, "the reused blocks came back from NVMe");
}

#[test]
fn blocks_a_caller_says_will_come_back_are_written_at_first_sight_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::open(reuse_config(dir.path())).unwrap();
        store.note_retained(&[key(0), key(1), key(2)]); // before the put: evidence at its store
        put(&store, &[0, 1, 2, 3, 4, 5]);
        store.flush().unwrap();
        let s = store.stats().counters;
        assert_eq!((s.retained_by_hint, s.bytes_written_nvme), (3, 3 * SLOT_BYTES), "the hinted three only");
        store.note_retained(&[key(4)]); // after the put: the block kept awaiting reuse goes down now
        store.flush().unwrap();
        assert_eq!(store.stats().counters.bytes_written_nvme, 4 * SLOT_BYTES);
        flood(&store, 100);
        store.close().unwrap();
    }
    let store = Store::open(reuse_config(dir.path())).unwrap();
    let back = get_checked(&store, &[0, 1, 2, 3, 4, 5]);
    assert_eq!(back, vec![true, true, true, false, true, false], "hinted blocks kept, unhinted ones dropped unused");
}

#[test]
fn a_block_stored_again_after_it_left_dram_is_written_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::open(reuse_config(dir.path())).unwrap();
        put(&store, &[0, 1, 2]);
        flood(&store, 100);
        assert_eq!(get_checked(&store, &[0]), vec![false], "seen once, evicted: gone");
        put(&store, &[0, 1, 2]); // computed again: the second sighting is the evidence
        store.flush().unwrap();
        assert_eq!(store.stats().counters.bytes_written_nvme, 3 * SLOT_BYTES);
        store.close().unwrap();
    }
    let store = Store::open(reuse_config(dir.path())).unwrap();
    assert_eq!(get_checked(&store, &[0, 1, 2, 100]), vec![true, true, true, false], "admitted and synced: kept");
    assert_eq!(store.stats().counters.nvme_hits, 3);
}

#[test]
fn a_pin_is_evidence_of_reuse() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(reuse_config(dir.path())).unwrap();
    put(&store, &[0, 1, 2, 3]);
    let pinned = store.pin_prefix(&[key(0), key(1)]);
    assert_eq!(pinned, vec![true, true]);
    store.unpin(&[key(0), key(1)]);
    store.flush().unwrap();
    let s = store.stats().counters;
    assert_eq!((s.writes_admitted_on_reuse, s.bytes_written_nvme), (2, 2 * SLOT_BYTES));
    store.check_invariants();
}

#[test]
fn policy_all_writes_every_block_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = reuse_config(dir.path());
    c.write_admission = WriteAdmission::All;
    let store = Store::open(c).unwrap();
    put(&store, &[0, 1, 2, 3, 4]);
    store.flush().unwrap();
    let s = store.stats().counters;
    assert_eq!((s.bytes_written_nvme, s.writes_awaiting_reuse), (5 * SLOT_BYTES, 0));
}

#[test]
fn an_nvme_budget_refuses_writes_past_it_and_never_a_store() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = reuse_config(dir.path());
    c.write_admission = WriteAdmission::All;
    // Three slots per minute with a one-minute burst: three writes now, the next one in 20 s.
    c.write_budget_burst_s = 60;
    c.write_budget_nvme_bytes_per_day = 3 * SLOT_BYTES * 24 * 60;
    let store = Store::open(c).unwrap();
    let ids: Vec<u64> = (0..10).collect();
    assert_eq!(put(&store, &ids), vec![true; 10], "every store is taken into DRAM");
    store.flush().unwrap();
    let stats = store.stats();
    let s = &stats.counters;
    // Blocks without evidence of reuse leave half the burst to those with (admission.rs).
    assert_eq!((s.bytes_written_nvme, s.nvme_write_budget_refusals), (2 * SLOT_BYTES, 8));
    assert_eq!(stats.gauges.nvme_write_budget_bytes_per_day, 3 * SLOT_BYTES * 24 * 60);
    assert!(stats.gauges.nvme_write_budget_left_bytes < 2 * SLOT_BYTES, "{:?}", stats.gauges);
    assert_eq!(get_checked(&store, &ids), vec![true; 10], "refused blocks are still served from DRAM");
    store.flush().unwrap();
    let s = store.stats().counters;
    assert_eq!(s.bytes_written_nvme, 3 * SLOT_BYTES, "the reads were evidence: the budget's rest went to them");
    assert_eq!(s.writes_admitted_on_reuse, 8, "every refused block was used again, within the budget or not");
    store.check_invariants();
}

#[test]
fn under_all_a_spent_budget_writes_the_blocks_used_again_not_the_one_off_flood() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = reuse_config(dir.path());
    c.write_admission = WriteAdmission::All;
    // Eight slots per day with a one-day burst: four for any block, four kept for evidence.
    c.write_budget_burst_s = 86_400;
    c.write_budget_nvme_bytes_per_day = 8 * SLOT_BYTES;
    let store = Store::open(c.clone()).unwrap();
    put(&store, &[0, 1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(get_checked(&store, &[6, 7]), vec![true; 2], "two of the blocks are used again");
    flood(&store, 100);
    put(&store, &[5]); // computed again after it left DRAM: a second sighting is evidence too
    store.flush().unwrap();
    let s = store.stats().counters;
    assert_eq!(s.bytes_written_nvme, 7 * SLOT_BYTES, "four at once, then the three used again: {s:?}");
    assert!(s.dropped_without_evidence >= 24, "the flood left DRAM unwritten: {s:?}");
    store.check_invariants();
    store.close().unwrap();
    let store = Store::open(c).unwrap();
    let kept = get_checked(&store, &[0, 1, 2, 3, 5, 6, 7, 100]);
    assert_eq!(kept, [[true; 7].as_slice(), &[false]].concat(), "what was written survives a restart");
}

#[test]
fn the_default_nvme_budget_is_one_drive_write_a_day_of_the_filesystem() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(config(dir.path(), EngineChoice::Psync, OBJECT_BYTES)).unwrap();
    let g = store.stats().gauges;
    let fs = rustix::fs::statvfs(dir.path()).unwrap();
    assert_eq!(g.nvme_write_budget_bytes_per_day, fs.f_blocks * fs.f_frsize);
    assert!(g.nvme_write_budget_left_bytes > 0);
}

/// A store on `dir/local` with the shared-filesystem tier on `dir/shared`, NVMe by `nvme`, the
/// remote tiers by `remote`.
fn tiered(dir: &std::path::Path, nvme: WriteAdmission, remote: WriteAdmission) -> Store {
    let mut c = reuse_config(&dir.join("local"));
    c.write_admission = nvme;
    c.remote_write_admission = Some(remote);
    let mut shared = SharedConfig::new(dir.join("shared"));
    shared.file_target_bytes = 256 << 10;
    shared.publish_delay_ms = 20;
    c.shared = Some(shared);
    Store::open(c).unwrap()
}

#[test]
fn nvme_by_reuse_while_the_shared_tier_takes_every_block() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiered(dir.path(), WriteAdmission::Reuse, WriteAdmission::All);
    put(&store, &[0, 1, 2, 3]);
    store.flush().unwrap();
    let s = store.stats().counters;
    assert_eq!(s.bytes_written_nvme, 0, "the local drive waits for evidence");
    assert!(s.shared_bytes_written >= 4 * OBJECT_BYTES as u64, "published for the other hosts: {s:?}");
}

#[test]
fn the_shared_tier_by_reuse_is_offered_a_block_once_it_is_used() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiered(dir.path(), WriteAdmission::All, WriteAdmission::Reuse);
    put(&store, &[0, 1, 2, 3]);
    store.flush().unwrap();
    let s = store.stats().counters;
    assert_eq!((s.bytes_written_nvme, s.shared_bytes_written), (4 * SLOT_BYTES, 0));
    assert_eq!(get_checked(&store, &[0, 1]), vec![true; 2]);
    store.flush().unwrap();
    let s = store.stats().counters;
    assert_eq!(s.writes_admitted_on_reuse, 2);
    assert_eq!(s.bytes_written_nvme, 4 * SLOT_BYTES, "NVMe took them at once, and only once");
    assert!(s.shared_bytes_written >= 2 * OBJECT_BYTES as u64, "the two used blocks published: {s:?}");
    assert!(s.shared_bytes_written < 4 * OBJECT_BYTES as u64, "and only those: {s:?}");
}

#[test]
fn the_shared_tier_by_reuse_publishes_the_blocks_a_caller_says_come_back_at_their_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiered(dir.path(), WriteAdmission::Reuse, WriteAdmission::Reuse);
    store.note_retained(&[key(0), key(1)]);
    put(&store, &[0, 1, 2, 3]);
    store.flush().unwrap();
    let s = store.stats().counters;
    assert_eq!(s.bytes_written_nvme, 2 * SLOT_BYTES, "the two hinted blocks, at once");
    assert!(s.shared_bytes_written >= 2 * OBJECT_BYTES as u64, "published for the other hosts: {s:?}");
    assert!(s.shared_bytes_written < 3 * OBJECT_BYTES as u64, "and nothing else: {s:?}");
}

/// Reused blocks whose NVMe writes the write backlog cannot take now (a slow disk: one write in
/// flight at a time here) wait for their next use, which writes them; the budget pays only for
/// writes made. Before, each refusal took its bytes from the budget and dropped the write for good.
#[test]
fn a_reuse_the_full_write_backlog_refuses_is_written_at_a_later_use_and_costs_no_budget_meanwhile() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = reuse_config(dir.path());
    c.max_dirty_bytes = c.slot_bytes();
    c.write_budget_burst_s = 86_400;
    c.write_budget_nvme_bytes_per_day = 8 * SLOT_BYTES;
    let plan = kvtier_core::testing::FaultPlan { delay_ms: 200, ..Default::default() };
    c.fault_plan = Some(std::sync::Arc::new(plan));
    let store = Store::open(c).unwrap();
    put(&store, &[0, 1, 2, 3]);
    assert_eq!(get_checked(&store, &[0, 1, 2, 3]), vec![true; 4], "each used once, while one write is in flight");
    let left = store.stats().gauges.nvme_write_budget_left_bytes;
    assert!(left >= 7 * SLOT_BYTES, "the budget paid for writes the backlog refused: {left} bytes left");
    for _ in 0..4 {
        store.flush().unwrap();
        assert_eq!(get_checked(&store, &[0, 1, 2, 3]), vec![true; 4]);
    }
    store.flush().unwrap();
    let stats = store.stats();
    assert_eq!(stats.counters.bytes_written_nvme, 4 * SLOT_BYTES, "every reused block reached NVMe: {stats:?}");
    assert!(stats.gauges.nvme_write_budget_left_bytes >= 4 * SLOT_BYTES, "{:?}", stats.gauges);
    store.check_invariants();
}

/// Reused blocks the full write backlog held in DRAM only and evicted before a later use counted
/// as `dropped_without_evidence`, as if the admission policy had judged them one-off: they had
/// evidence, the disk was slow. They count apart.
#[test]
fn a_reused_block_the_backlog_held_back_and_dram_evicted_counts_apart_from_the_unused() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = reuse_config(dir.path());
    c.max_dirty_bytes = c.slot_bytes();
    let plan = kvtier_core::testing::FaultPlan { delay_ms: 50, ..Default::default() };
    c.fault_plan = Some(std::sync::Arc::new(plan));
    let store = Store::open(c).unwrap();
    let first: Vec<u64> = (0..16).collect();
    put(&store, &first);
    assert_eq!(get_checked(&store, &first), vec![true; 16], "each used once, one write in flight at a time");
    for i in 100..140 {
        // Used blocks push the first ones out of DRAM (one-off blocks would not: S3-FIFO keeps the
        // used ones); each is written once the write before it ends.
        put(&store, &[i]);
        assert_eq!(get_checked(&store, &[i]), vec![true]);
    }
    let s = store.stats().counters;
    assert!(s.dropped_behind_backlog > 0, "no reused block was evicted behind the backlog: {s:?}");
    assert_eq!(s.dropped_without_evidence, 0, "every block was used again: none lacked evidence: {s:?}");
    store.check_invariants();
}

/// A block kept from the shared tier for want of a use that is first used after DRAM evicted it
/// (its copy on NVMe only) is published once a load brings it back to DRAM. Before, a load of the
/// NVMe copy was no use at all, and a pin took the block's evidence and lost it: the block was
/// never published, however often it was read.
#[test]
fn a_block_first_used_from_nvme_is_published_to_the_shared_tier_by_reuse() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiered(dir.path(), WriteAdmission::All, WriteAdmission::Reuse);
    put(&store, &[0, 1, 2, 3]);
    flood(&store, 100);
    store.flush().unwrap();
    let s = store.stats().counters;
    let flooded = s.shared_bytes_written;
    assert_eq!(get_checked(&store, &[0, 1]), vec![true; 2], "read back from NVMe");
    assert_eq!(store.pin_prefix(&[key(2), key(3)]), vec![true; 2], "pinned on NVMe");
    assert_eq!(get_checked(&store, &[2, 3]), vec![true; 2]);
    store.unpin(&[key(2), key(3)]);
    store.flush().unwrap();
    let s = store.stats().counters;
    assert!(s.nvme_hits >= 4, "the four came from NVMe: {s:?}");
    assert_eq!(s.writes_admitted_on_reuse, 4, "{s:?}");
    let published = s.shared_bytes_written - flooded;
    assert!(published >= 4 * OBJECT_BYTES as u64, "the four used blocks published: {s:?}");
    store.check_invariants();
}

/// The NVMe budget pays for writes made: one a load cancelled while it queued (the load took its
/// slot: `cancelled_writes`) gives its bytes back. Before, every cancelled write's bytes stayed
/// spent, so loads on a busy disk drained the budget with nothing written.
#[test]
fn a_write_a_load_cancelled_gives_its_budget_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), EngineChoice::Psync, OBJECT_BYTES);
    let per_day = 1000 * SLOT_BYTES;
    c.write_budget_nvme_bytes_per_day = per_day;
    c.max_write_inflight_bytes = c.slot_bytes();
    c.max_dirty_bytes = 16 * c.slot_bytes();
    let plan = kvtier_core::testing::FaultPlan { delay_ms: 40, ..Default::default() };
    c.fault_plan = Some(std::sync::Arc::new(plan));
    let store = Store::open(c).unwrap();
    put(&store, &[0, 1, 2, 3]);
    store.flush().unwrap();
    // Fresh blocks whose writes queue behind the slow disk take every DRAM slot; the load of the
    // first four (NVMe only now) takes the slots of queued writes.
    let fresh: Vec<u64> = (100..116).collect();
    put(&store, &fresh);
    let wanted: Vec<_> = (0..4).map(key).collect();
    assert!(store.acquire(&wanted).unwrap().iter().all(Option::is_some));
    store.release(&wanted);
    let cancelled = store.stats().counters.cancelled_writes;
    assert!(cancelled > 0, "no load took a queued write's slot");
    store.flush().unwrap();
    let stats = store.stats();
    let (written, left) = (stats.counters.bytes_written_nvme, stats.gauges.nvme_write_budget_left_bytes);
    assert!(
        written + left + SLOT_BYTES / 2 >= per_day,
        "the budget paid for {cancelled} cancelled writes: {written} written, {left} left of {per_day}"
    );
    store.check_invariants();
}

/// A store in `local` writing every block, with the shared tier in `dir/shared` and a budget of six
/// slots a day for it.
fn six_shared_slots_a_day(local: &std::path::Path, dir: &std::path::Path) -> StoreConfig {
    let mut c = reuse_config(local);
    c.write_admission = WriteAdmission::All;
    let mut shared = SharedConfig::new(dir.join("shared"));
    shared.file_target_bytes = 256 << 10;
    shared.publish_delay_ms = 20;
    c.shared = Some(shared);
    c.write_budget_shared_bytes_per_day = 6 * SLOT_BYTES;
    c
}

/// A shared tier's write budget pays for blocks written: a block the tier already holds (another
/// host published it) costs nothing. Before, each such offer took a block's bytes and wrote
/// nothing, so fresh blocks were refused with the budget unspent.
#[test]
fn a_block_the_shared_tier_holds_already_costs_its_budget_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let node = |name: &str| Store::open(six_shared_slots_a_day(&dir.path().join(name), dir.path())).unwrap();
    let a = node("a");
    put(&a, &[0, 1, 2, 3]);
    a.flush().unwrap();
    let b = node("b");
    let known: Vec<_> = (0..4).map(key).collect();
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while b.lookup_prefix(&known) < 4 && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(b.lookup_prefix(&known), 4, "node B sees what node A published");
    put(&b, &[0, 1, 2, 3]); // computed on B too: already in the shared tier
    put(&b, &[10, 11, 12, 13]);
    b.flush().unwrap();
    let s = b.stats().counters;
    assert_eq!(s.remote_write_budget_refusals, 0, "{s:?}");
    assert!(s.shared_bytes_written >= 4 * OBJECT_BYTES as u64, "B published its four new blocks: {s:?}");
}

/// Two stores of one block at once (two engines computed the same prefix): the second finds the
/// first one's fill and has nothing to copy, but it is a second sighting, and under `reuse` the
/// block goes to NVMe when the fill commits. Before, the fill had no evidence yet to take, and the
/// block waited for a third.
#[test]
fn a_block_stored_twice_at_once_has_evidence_of_reuse() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(reuse_config(dir.path())).unwrap();
    let keys = [key(7)];
    let Reservation::Fill { slot, sequence } = store.try_reserve_puts(&keys).unwrap()[0] else {
        panic!("a new block is a fill")
    };
    assert_eq!(store.try_reserve_puts(&keys).unwrap(), vec![Reservation::Present]);
    store.commit_puts(&[(keys[0], slot, sequence)]).unwrap();
    store.flush().unwrap();
    let s = store.stats().counters;
    assert_eq!(s.bytes_written_nvme, SLOT_BYTES, "{s:?}");
    store.check_invariants();
}

/// Two directories of the NVMe tier on one filesystem are one drive: its writes a day count once.
/// Before, each directory added the filesystem's whole size, doubling the default budget.
#[test]
fn two_nvme_directories_on_one_filesystem_have_one_drives_budget() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(&dir.path().join("a"), EngineChoice::Psync, OBJECT_BYTES);
    c.paths.push(dir.path().join("b"));
    let store = Store::open(c).unwrap();
    let fs = rustix::fs::statvfs(dir.path()).unwrap();
    assert_eq!(store.stats().gauges.nvme_write_budget_bytes_per_day, fs.f_blocks * fs.f_frsize);
}

/// Eight slots a day with a one-day burst, every block admitted: four writes for blocks without
/// evidence of reuse, four kept for those with.
fn eight_slots_a_day(dir: &std::path::Path) -> StoreConfig {
    let mut c = reuse_config(dir);
    c.write_admission = WriteAdmission::All;
    c.write_budget_burst_s = 86_400;
    c.write_budget_nvme_bytes_per_day = 8 * SLOT_BYTES;
    c
}

#[test]
fn a_restart_resumes_the_nvme_write_budget_rather_than_starting_a_full_one() {
    use kvtier_core::format::budget::{encode, SavedBudgets};
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(eight_slots_a_day(dir.path())).unwrap();
    put(&store, &[0, 1, 2, 3, 4, 5]);
    store.flush().unwrap();
    assert_eq!(
        store.stats().counters.bytes_written_nvme,
        4 * SLOT_BYTES,
        "half the burst, for blocks without evidence"
    );
    let budget_file = dir.path().join(store.namespace().hex()).join("WRITE_BUDGET");
    drop(store); // closes it: its drive's budget goes with the last store holding it
    let store = Store::open(eight_slots_a_day(dir.path())).unwrap();
    let left = store.stats().gauges.nvme_write_budget_left_bytes;
    assert!((4 * SLOT_BYTES..5 * SLOT_BYTES).contains(&left), "a fresh budget after the restart: {left} bytes left");
    put(&store, &[10, 11, 12]);
    store.flush().unwrap();
    assert_eq!(store.stats().counters.bytes_written_nvme, 0, "what is left is kept for blocks with evidence");
    drop(store); // closes it: its drive's budget goes with the last store holding it
                 // Saved half a day ago with nothing left: half a day's refill, four slots.
    let half_a_day_ago =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64 - 43_200_000;
    let nvme = 2; // its code on the wire
    std::fs::write(&budget_file, encode(&SavedBudgets { saved_unix_ms: half_a_day_ago, entries: vec![(nvme, 0)] }))
        .unwrap();
    let store = Store::open(eight_slots_a_day(dir.path())).unwrap();
    let left = store.stats().gauges.nvme_write_budget_left_bytes;
    assert!((4 * SLOT_BYTES - 64..=4 * SLOT_BYTES + 64).contains(&left), "refilled since the save: {left} bytes");
    drop(store); // closes it: its drive's budget goes with the last store holding it
                 // A damaged file is ignored (logged): the budget starts full, as at a first open.
    std::fs::write(&budget_file, b"KVTBUDG\0 not a budget file").unwrap();
    let store = Store::open(eight_slots_a_day(dir.path())).unwrap();
    assert_eq!(store.stats().gauges.nvme_write_budget_left_bytes, 8 * SLOT_BYTES);
    drop(store); // closes it: its drive's budget goes with the last store holding it
                 // Saved with nothing left by a clock a day ahead (set right since): ignored (logged),
                 // not resumed to nothing at every open until that day comes.
    let a_day_ahead = half_a_day_ago + 3 * 43_200_000;
    std::fs::write(&budget_file, encode(&SavedBudgets { saved_unix_ms: a_day_ahead, entries: vec![(nvme, 0)] }))
        .unwrap();
    let store = Store::open(eight_slots_a_day(dir.path())).unwrap();
    assert_eq!(store.stats().gauges.nvme_write_budget_left_bytes, 8 * SLOT_BYTES, "a future save held the budget");
}

#[test]
fn two_namespaces_on_one_drive_take_from_one_budget() {
    let dir = tempfile::tempdir().unwrap();
    let first = Store::open(eight_slots_a_day(dir.path())).unwrap();
    let mut other_model = eight_slots_a_day(dir.path());
    other_model.namespace = b"another-model/bf16/128".to_vec();
    let second = Store::open(other_model.clone()).unwrap();
    put(&first, &[0, 1, 2, 3, 4, 5]);
    first.flush().unwrap();
    assert_eq!(first.stats().counters.bytes_written_nvme, 4 * SLOT_BYTES);
    let left = second.stats().gauges.nvme_write_budget_left_bytes;
    assert!(left < 5 * SLOT_BYTES, "the other model's writes spent this drive's budget too: {left} bytes left");
    put(&second, &[10, 11, 12]);
    second.flush().unwrap();
    assert_eq!(second.stats().counters.bytes_written_nvme, 0, "what is left is kept for blocks with evidence");
    // Once both are closed the drive's budget goes with them; the next open resumes it from the
    // files, a model's that never wrote included.
    drop((first, second));
    let mut third_model = other_model;
    third_model.namespace = b"a-third-model/bf16/128".to_vec();
    let third = Store::open(third_model).unwrap();
    assert!(third.stats().gauges.nvme_write_budget_left_bytes < 5 * SLOT_BYTES);
}

#[test]
fn two_namespaces_of_one_store_share_the_shared_tiers_budget() {
    let dir = tempfile::tempdir().unwrap();
    let model = |namespace: &[u8]| {
        let mut c = six_shared_slots_a_day(&dir.path().join("local"), dir.path());
        c.namespace = namespace.to_vec();
        Store::open(c).unwrap()
    };
    let (one, two) = (model(b"model-one"), model(b"model-two"));
    put(&one, &[0, 1, 2, 3]);
    one.flush().unwrap();
    assert_eq!(one.stats().counters.remote_write_budget_refusals, 0);
    put(&two, &[10, 11, 12, 13]);
    two.flush().unwrap();
    let s = two.stats().counters;
    assert!(s.remote_write_budget_refusals >= 2, "the host's budget, not one per model: {s:?}");
}

#[test]
fn a_budget_that_spent_a_step_of_its_burst_is_saved_before_any_flush() {
    use kvtier_core::format::budget::decode;
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(eight_slots_a_day(dir.path())).unwrap();
    let budget_file = dir.path().join(store.namespace().hex()).join("WRITE_BUDGET");
    store.save_budgets_if_due().unwrap();
    assert!(!budget_file.exists(), "nothing spent, nothing to save");
    put(&store, &[0, 1, 2, 3]);
    store.save_budgets_if_due().unwrap(); // what the host service does every half second
    let saved = decode(&std::fs::read(&budget_file).unwrap()).unwrap();
    let nvme = 2; // its code on the wire
    let left = saved.entries.iter().find(|(tier, _)| *tier == nvme).unwrap().1;
    assert!(left < 5 * SLOT_BYTES, "a crash now resumes the budget as spent: {left} bytes left");
}
