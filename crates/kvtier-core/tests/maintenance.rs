//! Operator maintenance on a real store: the scrub finds a block corrupted on disk, quarantines it
//! (a later load is a miss, and it stays gone after a reopen), and trim removes only what nobody uses.

use kvtier_core::{BlockKey, Store, StoreConfig, TrimRequest};
use std::os::unix::fs::FileExt;
use std::time::Duration;

const OBJECT: usize = 16 << 10;
const SLOT: usize = 4096 + OBJECT;

fn config(dir: &std::path::Path) -> StoreConfig {
    let mut c = StoreConfig::new(dir, OBJECT);
    c.namespace = br#"{"model":"test-model","dtype":"bfloat16"}"#.to_vec();
    c.dram_bytes = 16 * SLOT;
    c.staging_slots = 8;
    c.region_bytes = (8 * SLOT + 4096 * 4) as u64;
    c.nvme_bytes = c.region_bytes * 16;
    c
}

fn key(i: u32) -> BlockKey {
    let mut k = [0u8; 32];
    k[..4].copy_from_slice(&i.to_le_bytes());
    k[31] = 0xAB;
    BlockKey(k)
}

fn value(i: u32) -> Vec<u8> {
    (0..OBJECT).map(|j| (i as usize * 7 + j) as u8).collect()
}

fn put_all(store: &Store, n: u32) {
    for i in 0..n {
        let v = value(i);
        assert_eq!(store.put_many(&[key(i)], &[&v]).unwrap(), vec![true]);
    }
    store.flush().unwrap();
}

/// Offset in the device file of the value of `key`'s entry (found by its descriptor).
fn value_offset_on_disk(device: &std::path::Path, key: &BlockKey) -> u64 {
    let bytes = std::fs::read(device).unwrap();
    let mut at = 4096;
    while at + 4096 <= bytes.len() {
        if &bytes[at..at + 8] == b"KVTRENT\0" && bytes[at + 16..at + 48] == key.0 {
            return (at + 4096) as u64;
        }
        at += 4096;
    }
    panic!("no descriptor of the key on disk");
}

fn scrub(store: &Store) -> kvtier_core::VerifyBatch {
    let mut total = kvtier_core::VerifyBatch::default();
    let mut after = 0;
    loop {
        let b = store.verify_batch(after, 7, 0).unwrap();
        total.checked_dram += b.checked_dram;
        total.checked_nvme += b.checked_nvme;
        total.bad_dram += b.bad_dram;
        total.bad_nvme += b.bad_nvme;
        total.bad.extend(b.bad);
        after = b.next_after;
        if b.done {
            return total;
        }
    }
}

#[test]
fn verify_finds_quarantines_and_a_load_misses() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(config(dir.path())).unwrap();
    put_all(&store, 60);
    let ns_dir = dir.path().join(store.namespace().hex());
    assert_eq!(
        std::fs::read(ns_dir.join(kvtier_core::DESCRIPTION_FILE_NAME)).unwrap(),
        br#"{"model":"test-model","dtype":"bfloat16"}"#
    );
    let clean = scrub(&store);
    assert_eq!((clean.bad_dram, clean.bad_nvme), (0, 0), "{:?}", clean.bad);
    assert!(clean.checked_nvme >= 60 && clean.checked_dram > 0, "{clean:?}");

    // Block 3 lives on NVMe only (DRAM holds 16 slots): flip bytes of its value in the device file.
    assert_eq!(store.locate_many(&[key(3)])[0], Some(kvtier_core::Tier::Nvme));
    let device = ns_dir.join("nvme.kvt");
    let at = value_offset_on_disk(&device, &key(3)) + 100;
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&device).unwrap();
    let mut byte = [0u8; 4];
    file.read_exact_at(&mut byte, at).unwrap();
    for b in &mut byte {
        *b ^= 0xFF;
    }
    file.write_all_at(&byte, at).unwrap();
    file.sync_all().unwrap();

    let found = scrub(&store);
    assert_eq!((found.bad_dram, found.bad_nvme), (0, 1), "{:?}", found.bad);
    assert_eq!(found.bad[0].key, key(3));
    assert!(found.bad[0].quarantined);
    assert!(found.bad[0].reason.contains("checksum"), "{}", found.bad[0].reason);
    let mut out = vec![0u8; OBJECT];
    assert_eq!(store.get_many(&[key(3)], &mut [&mut out]).unwrap(), vec![false], "a quarantined block is a miss");
    for i in [0u32, 4, 59] {
        assert_eq!(store.get_many(&[key(i)], &mut [&mut out]).unwrap(), vec![true]);
        assert_eq!(out, value(i));
    }
    assert_eq!(scrub(&store).bad_nvme, 0, "quarantined: the next scrub does not meet it");
    store.close().unwrap();
    drop(store);

    // The rewritten trailer keeps it out after a reopen (recovery).
    let store = Store::open(config(dir.path())).unwrap();
    assert!(!store.contains_many(&[key(3)])[0]);
    assert!(store.contains_many(&[key(2)])[0]);
    let again = scrub(&store);
    assert_eq!(again.bad_nvme + again.bad_dram, 0, "{:?}", again.bad);
    store.check_invariants();
}

#[test]
fn verify_finds_a_corrupt_dram_copy() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path());
    c.nvme_bytes = 0;
    c.pool_path = Some(dir.path().join("pool"));
    let store = Store::open(c).unwrap();
    put_all(&store, 10);
    // Corrupt block 5's value in the pool file (a stray write into shared memory).
    let pool = std::fs::read(dir.path().join("pool")).unwrap();
    let slot = (0..pool.len() / SLOT).find(|s| pool[s * SLOT + 16..s * SLOT + 48] == key(5).0).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(dir.path().join("pool")).unwrap();
    file.write_all_at(&[0x5A; 8], (slot * SLOT + 4096 + 8) as u64).unwrap();
    let found = scrub(&store);
    assert_eq!((found.bad_dram, found.bad_nvme), (1, 0));
    let mut out = vec![0u8; OBJECT];
    assert_eq!(store.get_many(&[key(5)], &mut [&mut out]).unwrap(), vec![false]);
    assert_eq!(store.get_many(&[key(6)], &mut [&mut out]).unwrap(), vec![true]);
    store.check_invariants();
}

#[test]
fn verify_is_paced() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(config(dir.path())).unwrap();
    put_all(&store, 20);
    let started = std::time::Instant::now();
    let b = store.verify_batch(0, 1000, 2 << 20).unwrap();
    let elapsed = started.elapsed().as_secs_f64();
    let floor = b.bytes_read as f64 / (2u64 << 20) as f64;
    assert!(b.done && b.bytes_read > 0);
    assert!(elapsed >= floor * 0.95, "{} bytes in {elapsed:.3} s at 2 MiB/s", b.bytes_read);
}

/// Runs `verify_batch(after, max_blocks, rate)` on another thread and waits at most `limit` for it.
fn verify_within(
    store: &std::sync::Arc<Store>,
    max_blocks: usize,
    rate: u64,
    limit: Duration,
) -> kvtier_core::Result<kvtier_core::VerifyBatch> {
    let (tx, rx) = std::sync::mpsc::channel();
    let store = std::sync::Arc::clone(store);
    std::thread::spawn(move || tx.send(store.verify_batch(0, max_blocks, rate)));
    rx.recv_timeout(limit).unwrap_or_else(|_| panic!("a verify step at {rate} bytes/s took over {limit:?}"))
}

/// Issue 37, item 4: a pace of a byte a second used to sleep for hours per block inside one step
/// (holding the namespace in the service). It is refused at once, naming the slowest pace taken.
#[test]
fn a_verify_slower_than_the_slowest_pace_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = std::sync::Arc::new(Store::open(config(dir.path())).unwrap());
    put_all(&store, 4);
    let err = verify_within(&store, 1000, 1, Duration::from_secs(5)).expect_err("1 byte/s is refused");
    assert!(err.to_string().contains("max_bytes_per_s") && err.to_string().contains("1 MB/s"), "{err}");
    assert!(store.verify_batch(0, 1000, 1_000_000).is_ok(), "1 MB/s is the slowest pace taken");
}

/// A step sleeps at most about 2 s for its pace: past that it ends early, not done, and names the
/// rest of the wait for the caller (who holds nothing meanwhile). The scrub still checks every
/// block, at the pace asked overall.
#[test]
fn a_paced_verify_step_is_bounded_and_hands_the_rest_of_its_wait_to_the_caller() {
    let dir = tempfile::tempdir().unwrap();
    let store = std::sync::Arc::new(Store::open(config(dir.path())).unwrap());
    put_all(&store, 120);
    let started = std::time::Instant::now();
    let first = verify_within(&store, 1000, 1_000_000, Duration::from_secs(10)).unwrap();
    let step = started.elapsed();
    assert!(step < Duration::from_millis(2_700), "one step took {step:?}");
    assert!(!first.done && first.pace_wait_ms > 0, "done {} pace_wait_ms {}", first.done, first.pace_wait_ms);
    let (mut checked, mut after, mut bytes) = (first.checked_nvme, first.next_after, first.bytes_read);
    std::thread::sleep(Duration::from_millis(first.pace_wait_ms));
    loop {
        let b = store.verify_batch(after, 1000, 1_000_000).unwrap();
        (checked, after, bytes) = (checked + b.checked_nvme, b.next_after, bytes + b.bytes_read);
        if b.done {
            break;
        }
        std::thread::sleep(Duration::from_millis(b.pace_wait_ms));
    }
    assert_eq!(checked, 120, "every NVMe copy checked once");
    let floor = bytes as f64 / 1e6;
    assert!(started.elapsed().as_secs_f64() >= floor * 0.95, "{bytes} bytes in {:?} at 1 MB/s", started.elapsed());
}

#[test]
fn trim_keeps_what_is_pinned_and_frees_regions() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(config(dir.path())).unwrap();
    put_all(&store, 100);
    let used = |s: &Store| s.stats().gauges.nvme_used_bytes;
    let before = used(&store);
    let region = config(dir.path()).region_bytes;
    assert!(before >= 10 * region, "{before}");

    // To a byte target: oldest whole regions go; the newest blocks stay.
    let counts = store.trim(TrimRequest::NvmeTo(4 * region)).unwrap();
    assert!(counts.regions_freed > 0 && used(&store) <= 4 * region, "{counts:?}");
    assert!(!store.contains_many(&[key(0)])[0]);
    assert!(store.contains_many(&[key(99)])[0]);

    // Older than: nothing is that old yet.
    let none = store.trim(TrimRequest::OlderThan(Duration::from_secs(3600))).unwrap();
    assert_eq!(none.dram_blocks + none.nvme_blocks, 0, "{none:?}");

    // Everything, while a request holds pins on two blocks: those two stay and still load right.
    let pinned = [key(98), key(99)];
    assert_eq!(store.pin_prefix(&pinned), vec![true, true]);
    let all = store.trim(TrimRequest::All).unwrap();
    assert!(all.skipped_in_use >= 2 && all.dram_blocks > 0, "{all:?}");
    assert_eq!(store.contains_many(&pinned), vec![true, true]);
    assert!(!store.contains_many(&[key(50)])[0]);
    let mut out = vec![0u8; OBJECT];
    assert_eq!(store.get_many(&[key(99)], &mut [&mut out]).unwrap(), vec![true]);
    assert_eq!(out, value(99));
    store.unpin(&pinned);
    store.check_invariants();

    // Freed space is reused, and a trimmed block can be stored again.
    put_all(&store, 40);
    assert_eq!(store.get_many(&[key(10)], &mut [&mut out]).unwrap(), vec![true]);
    assert_eq!(out, value(10));
    store.close().unwrap();
    drop(store);
    let store = Store::open(config(dir.path())).unwrap();
    assert!(!store.contains_many(&[key(50)])[0], "trimmed regions stay trimmed after a reopen");
    assert!(store.contains_many(&[key(10)])[0]);
    let facts = store.namespace_facts();
    assert!(facts.visible_blocks > 0 && !facts.oldest_before_open, "dated by the saved timeline: {facts:?}");
    assert!(facts.oldest_unix_ms <= facts.opened_unix_ms);
}

/// Block dates survive a restart: `trim --older-than` after a reopen tells blocks stored seconds
/// apart before it, and a damaged timeline file costs only the dates, never the open.
#[test]
fn block_dates_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(config(dir.path())).unwrap();
    let first: Vec<BlockKey> = (0..3).map(key).collect();
    for i in 0..3 {
        assert_eq!(store.put_many(&[key(i)], &[&value(i)]).unwrap(), vec![true]);
    }
    std::thread::sleep(Duration::from_millis(2500));
    for i in 3..6 {
        assert_eq!(store.put_many(&[key(i)], &[&value(i)]).unwrap(), vec![true]);
    }
    store.close().unwrap();
    drop(store);

    let store = Store::open(config(dir.path())).unwrap();
    let facts = store.namespace_facts();
    assert!(!facts.oldest_before_open && !facts.newest_before_open, "{facts:?}");
    assert!(facts.newest_unix_ms >= facts.oldest_unix_ms + 2000, "{facts:?}");
    // The open sealed the region the blocks were recovered from (its trailer write in flight holds
    // the region out of a trim until it lands).
    store.flush().unwrap();
    // Older than 1.5 s: the first three (about 2.5 s old), not the last three (just stored).
    let counts = store.trim(TrimRequest::OlderThan(Duration::from_millis(1500))).unwrap();
    assert_eq!(counts.dram_blocks + counts.nvme_blocks, 3, "{counts:?}");
    assert_eq!(store.contains_many(&first), vec![false; 3]);
    assert_eq!(store.contains_many(&[key(3), key(4), key(5)]), vec![true; 3]);
    store.close().unwrap();
    drop(store);

    let timeline = dir.path().join(store_dir_name(dir.path())).join("TIMELINE");
    std::fs::write(&timeline, b"not a timeline").unwrap();
    let store = Store::open(config(dir.path())).unwrap();
    let facts = store.namespace_facts();
    assert!(facts.oldest_before_open, "a damaged timeline dates blocks by the open: {facts:?}");
    assert_eq!(store.contains_many(&[key(3), key(4), key(5)]), vec![true; 3]);
}

/// The namespace directory's name under the store path.
fn store_dir_name(path: &std::path::Path) -> std::ffi::OsString {
    let entries: Vec<_> = std::fs::read_dir(path).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
    entries.into_iter().next().unwrap()
}

#[test]
fn scrub_and_trim_beside_puts_and_gets_serve_no_wrong_byte_and_raise_no_false_alarm() {
    use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(config(dir.path())).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let stored = Arc::new(AtomicU32::new(0));
    let (hits, wrong) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let writer = {
        let (store, stop, stored) = (Arc::clone(&store), Arc::clone(&stop), Arc::clone(&stored));
        std::thread::spawn(move || {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let v = value(i);
                store.put_many(&[key(i)], &[&v]).unwrap();
                i += 1;
                stored.store(i, Ordering::Relaxed);
            }
        })
    };
    let readers: Vec<_> = (0..2)
        .map(|seed| {
            let (store, stop, stored) = (Arc::clone(&store), Arc::clone(&stop), Arc::clone(&stored));
            let (hits, wrong) = (Arc::clone(&hits), Arc::clone(&wrong));
            std::thread::spawn(move || {
                let mut x = 0x9E37_79B9u32.wrapping_mul(seed + 1);
                let mut out = vec![0u8; OBJECT];
                while !stop.load(Ordering::Relaxed) {
                    let n = stored.load(Ordering::Relaxed);
                    if n == 0 {
                        continue;
                    }
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    let i = x % n;
                    if store.get_many(&[key(i)], &mut [&mut out]).unwrap()[0] {
                        hits.fetch_add(1, Ordering::Relaxed);
                        if out != value(i) {
                            wrong.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    let started = std::time::Instant::now();
    let mut scrubs = 0;
    // At least 3 s and 3 scrubs: a scrub's length grows with the store, and a loaded machine may
    // take more than a second per scrub.
    while started.elapsed() < Duration::from_secs(3) || scrubs < 3 {
        let found = scrub(&store);
        assert_eq!(found.bad_dram + found.bad_nvme, 0, "false alarm: {:?}", found.bad);
        scrubs += 1;
        store.trim(TrimRequest::NvmeTo(3 * config(dir.path()).region_bytes)).unwrap();
        store.trim(TrimRequest::OlderThan(Duration::from_millis(1500))).unwrap();
        if scrubs % 3 == 0 {
            store.trim(TrimRequest::All).unwrap();
        }
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    for r in readers {
        r.join().unwrap();
    }
    assert!(hits.load(Ordering::Relaxed) > 100, "{scrubs} scrubs, {hits:?} hits");
    assert_eq!(wrong.load(Ordering::Relaxed), 0, "wrong bytes served");
    assert_eq!(store.stats().counters.checksum_failures, 0);
    store.check_invariants();
    store.flush().unwrap();
}
