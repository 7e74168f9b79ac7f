//! Hostile storage: another tenant (or a bug elsewhere) writes into the store directory. Every case
//! must end in a clear error at open or in counted misses: never wrong bytes, never a crash, never a
//! read or write outside the store's root.
//!
//! Geometry used here (see `small`): object 16 KiB, slot 20 KiB, region 1 MiB (51 entries, trailer of
//! 4 KiB at byte 1044480 of the region), 7 regions; 120 blocks fill regions 0 and 1 (sealed) and
//! leave 18 entries in the open region 2.

mod common;
use common::*;

use kvtier_core::format::descriptor::{Descriptor, DESCRIPTOR_BYTES};
use kvtier_core::format::superblock::SUPERBLOCK_BYTES;
use kvtier_core::format::trailer::{Trailer, TrailerEntry};
use kvtier_core::{BlockKey, EngineChoice, Error, Namespace, Store, StoreConfig};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

const OBJ: usize = 16 * 1024;
const SLOT: u64 = (OBJ + 4096) as u64;
const REGION: u64 = 1 << 20;
const MAX_ENTRIES: u64 = 51;
const DATA_BYTES: u64 = MAX_ENTRIES * SLOT;
const TRAILER_BYTES: usize = 4096;
const NS: &[u8] = b"test-model/bf16/128";

fn small(dir: &Path, engine: EngineChoice) -> StoreConfig {
    let mut c = config(dir, engine, OBJ);
    c.dram_bytes = 8 * SLOT as usize;
    c.nvme_bytes = 8 << 20;
    c.region_bytes = REGION;
    c
}

fn ns_dir(root: &Path, ns: &[u8]) -> PathBuf {
    root.join(Namespace::from_description(ns).hex())
}

fn device(root: &Path) -> PathBuf {
    ns_dir(root, NS).join("nvme.kvt")
}

fn region_offset(r: u64) -> u64 {
    SUPERBLOCK_BYTES as u64 + r * REGION
}

fn trailer_offset(r: u64) -> u64 {
    region_offset(r) + DATA_BYTES
}

fn read_at(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let f = std::fs::File::open(path).unwrap();
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, offset).unwrap();
    buf
}

fn write_at(path: &Path, offset: u64, bytes: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, offset).unwrap();
    f.sync_all().unwrap();
}

fn read_trailer(path: &Path, region: u64) -> Trailer {
    Trailer::decode(&read_at(path, trailer_offset(region), TRAILER_BYTES))
        .unwrap()
        .expect("sealed region has a trailer")
}

fn write_trailer(path: &Path, region: u64, t: &Trailer) {
    let mut buf = vec![0u8; TRAILER_BYTES];
    t.encode(&mut buf);
    write_at(path, trailer_offset(region), &buf);
}

/// A closed store holding blocks 0..120 (regions 0 and 1 sealed, region 2 open).
fn seeded(engine: EngineChoice) -> (tempfile::TempDir, Vec<u64>) {
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<u64> = (0..120).collect();
    let store = Store::open(small(dir.path(), engine)).unwrap();
    for chunk in ids.chunks(10) {
        assert!(put(&store, chunk).iter().all(|&b| b));
    }
    store.close().unwrap();
    (dir, ids)
}

/// Runs `f` on a thread and fails the test if it takes longer than `secs`.
fn watchdog<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::spawn(move || {
        let r = f();
        let _ = tx.send(());
        r
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(()) => handle.join().unwrap(),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match handle.join() {
            Ok(r) => r,
            Err(p) => std::panic::resume_unwind(p),
        },
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("{what}: no result after {secs} s (hang)"),
    }
}

#[test]
fn device_file_of_another_namespace_is_refused() {
    let engine = engines()[0];
    let (dir, _) = seeded(engine);
    let other = b"another-model/fp8/16";
    std::fs::create_dir_all(ns_dir(dir.path(), other)).unwrap();
    std::fs::copy(device(dir.path()), ns_dir(dir.path(), other).join("nvme.kvt")).unwrap();
    let mut cfg = small(dir.path(), engine);
    cfg.namespace = other.to_vec();
    match Store::open(cfg) {
        Err(Error::Namespace { expected, found, .. }) => {
            assert_eq!(expected, Namespace::from_description(other).hex());
            assert_eq!(found, Namespace::from_description(NS).hex());
        }
        other => panic!("expected Error::Namespace, got {:?}", other.map(|_| ())),
    }
}

/// A slot of another namespace (a valid descriptor and value) planted in our file, and listed by a forged
/// trailer entry under its key: a miss, never the foreign bytes.
#[test]
fn blocks_of_another_namespace_are_never_served() {
    for engine in engines() {
        let (dir, ids) = seeded(engine);
        let foreign_root = tempfile::tempdir().unwrap();
        let mut fcfg = small(foreign_root.path(), engine);
        fcfg.namespace = b"another-model/fp8/16".to_vec();
        {
            let s = Store::open(fcfg.clone()).unwrap();
            put(&s, &[5000]);
            s.close().unwrap();
        }
        let foreign_file = ns_dir(foreign_root.path(), b"another-model/fp8/16").join("nvme.kvt");
        let foreign_slot = read_at(&foreign_file, region_offset(0), SLOT as usize);
        let ours = device(dir.path());
        // Plant it over entry 3 of sealed region 0 and list it in region 0's trailer.
        let mut t = read_trailer(&ours, 0);
        let victim = t.entries[3];
        write_at(&ours, region_offset(0) + victim.offset, &foreign_slot);
        let d = Descriptor::decode(&foreign_slot[..DESCRIPTOR_BYTES]).unwrap();
        t.entries[3] = TrailerEntry {
            key: key(5000),
            sequence: d.sequence,
            offset: victim.offset,
            value_bytes: OBJ as u32,
            value_checksum: d.value_checksum,
        };
        write_trailer(&ours, 0, &t);
        // Plant it in the open region too, right after the last entry.
        write_at(&ours, region_offset(2) + 18 * SLOT, &foreign_slot);

        let store = Store::open(small(dir.path(), engine)).unwrap();
        assert_eq!(get_checked(&store, &[5000]), vec![false], "a block of another namespace was served");
        let hits = get_checked(&store, &ids);
        assert_eq!(hits.iter().filter(|&&h| !h).count(), 1, "only the overwritten block is lost: {hits:?}");
        assert!(store.stats().counters.checksum_failures >= 1);
        store.check_invariants();
    }
}

/// Forged trailer entries (valid checksums) claiming positions outside the region, past the end of the
/// file, near u64::MAX, misaligned, or huge lengths: dropped at recovery, never read.
#[test]
fn forged_trailer_offsets_and_lengths_are_never_used() {
    for engine in engines() {
        let (dir, ids) = seeded(engine);
        let path = device(dir.path());
        let mut t = read_trailer(&path, 0);
        let real = t.entries.clone();
        let forged: Vec<(u64, u64, u32)> = vec![
            (9001, DATA_BYTES, OBJ as u32),               // first byte of the trailer area
            (9002, REGION * 100, OBJ as u32),             // past the end of the file
            (9003, (u64::MAX / SLOT) * SLOT, OBJ as u32), // aligned, and offset + slot overflows
            (9004, u64::MAX, OBJ as u32),                 // the largest offset
            (9005, SLOT + 512, OBJ as u32),               // misaligned
            (9006, 0, u32::MAX),                          // huge length
            (9007, 2 * SLOT, 0),                          // zero length
        ];
        for (i, &(id, offset, value_bytes)) in forged.iter().enumerate() {
            t.entries[i] =
                TrailerEntry { key: key(id), sequence: 1_000_000 + i as u64, offset, value_bytes, value_checksum: 0 };
        }
        write_trailer(&path, 0, &t);
        let forged_ids: Vec<u64> = forged.iter().map(|f| f.0).collect();
        let store = watchdog(60, "open with forged trailer", move || {
            let store = Store::open(small(dir.path(), engine)).unwrap();
            (store, dir)
        });
        let (store, _dir) = store;
        let forged_keys: Vec<BlockKey> = forged_ids.iter().map(|&i| key(i)).collect();
        assert_eq!(store.contains_many(&forged_keys), vec![false; forged.len()], "forged entries were indexed");
        assert_eq!(get_checked(&store, &forged_ids), vec![false; forged.len()]);
        // The blocks whose trailer entries were replaced are no longer listed; every other block is served.
        let replaced: Vec<u64> =
            real[..forged.len()].iter().map(|e| u64::from_le_bytes(e.key.0[..8].try_into().unwrap())).collect();
        let hits = get_checked(&store, &ids);
        for (&id, &hit) in ids.iter().zip(&hits) {
            assert_eq!(hit, !replaced.contains(&id), "block {id}");
        }
        let c = store.stats().counters;
        assert_eq!(c.io_errors, 0, "a forged position was read: {c:?}");
        store.check_invariants();
    }
}

/// Forged trailers with extreme sequence numbers (u64::MAX): the store opens, serves, accepts new blocks
/// and reopens.
#[test]
fn forged_trailer_with_extreme_sequences_does_not_crash() {
    for engine in engines() {
        let (dir, ids) = seeded(engine);
        let path = device(dir.path());
        let mut t = read_trailer(&path, 0);
        t.region_seq = u64::MAX;
        t.entries[0].sequence = u64::MAX;
        write_trailer(&path, 0, &t);
        let root = dir.path().to_path_buf();
        watchdog(60, "open with extreme sequences", move || {
            let store = Store::open(small(&root, engine)).unwrap();
            let hits = get_checked(&store, &ids);
            // Entry 0's sequence no longer matches its descriptor: it must be a miss, the others hits.
            assert_eq!(hits.iter().filter(|&&h| !h).count(), 1, "{hits:?}");
            let fresh: Vec<u64> = (7000..7100).collect();
            for chunk in fresh.chunks(10) {
                assert!(put(&store, chunk).iter().all(|&b| b));
            }
            store.close().unwrap();
            drop(store);
            let store = Store::open(small(&root, engine)).unwrap();
            get_checked(&store, &fresh);
            store.check_invariants();
            drop(dir);
        });
    }
}

/// A trailer header with a valid checksum claiming u32::MAX entries: rejected without a giant
/// allocation, and the region is recovered by scanning its entries instead.
#[test]
fn forged_trailer_entry_count_is_rejected_and_region_scanned() {
    for engine in engines() {
        let (dir, ids) = seeded(engine);
        let path = device(dir.path());
        let mut header = read_at(&path, trailer_offset(0), 64);
        header[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64(&header[..56]);
        header[56..64].copy_from_slice(&sum.to_le_bytes());
        write_at(&path, trailer_offset(0), &header);
        let store = Store::open(small(dir.path(), engine)).unwrap();
        let hits = get_checked(&store, &ids);
        assert!(hits.iter().all(|&h| h), "region 0 should be recovered by its scan: {hits:?}");
    }
}

/// Descriptors with valid header checksums claiming a huge value length: in the open region the scan
/// skips that entry and keeps the ones after it (issue 24 item 9: it used to stop there and lose
/// them); in a sealed region the load is a counted miss. Never misread.
#[test]
fn forged_descriptor_lengths_are_misses() {
    for engine in engines() {
        let (dir, ids) = seeded(engine);
        let path = device(dir.path());
        let forge = |at: u64| {
            let page = read_at(&path, at, DESCRIPTOR_BYTES);
            let mut d = Descriptor::decode(&page).unwrap();
            d.value_bytes = u32::MAX;
            let mut out = vec![0u8; DESCRIPTOR_BYTES];
            d.encode(&mut out);
            write_at(&path, at, &out);
            u64::from_le_bytes(d.key.0[..8].try_into().unwrap())
        };
        let id_at = |at: u64| {
            let d = Descriptor::decode(&read_at(&path, at, DESCRIPTOR_BYTES)).unwrap();
            u64::from_le_bytes(d.key.0[..8].try_into().unwrap())
        };
        // The open region holds 18 entries; the scan skips the forged 11th and keeps 12..18.
        let lost_in_open: Vec<u64> = (10..11).map(|k| id_at(region_offset(2) + k * SLOT)).collect();
        let sealed_victim = forge(region_offset(1) + 7 * SLOT);
        forge(region_offset(2) + 10 * SLOT);
        let store = Store::open(small(dir.path(), engine)).unwrap();
        let hits = get_checked(&store, &ids);
        for (&id, &hit) in ids.iter().zip(&hits) {
            let expect = id != sealed_victim && !lost_in_open.contains(&id);
            assert_eq!(
                hit, expect,
                "block {id} (sealed victim {sealed_victim}, lost in the open region {lost_in_open:?})"
            );
        }
        assert_eq!(store.stats().counters.checksum_failures, 1);
    }
}

/// nvme.kvt replaced by a symlink: to a missing file outside the root (kvtier must not create it), to a
/// victim file (kvtier must not touch it), to another store's device file (kvtier must not serve it).
#[test]
fn symlinked_device_file_is_refused() {
    let engine = engines()[0];
    let outside = tempfile::tempdir().unwrap();

    // 1. Dangling symlink: open must not create (and preallocate) a file outside the root.
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(ns_dir(root.path(), NS)).unwrap();
    let target = outside.path().join("created-by-kvtier.kvt");
    std::os::unix::fs::symlink(&target, device(root.path())).unwrap();
    let r = Store::open(small(root.path(), engine));
    let created = target.exists();
    drop(r);
    assert!(!created, "kvtier followed a dangling symlink and created {}", target.display());

    // 2. Symlink to a victim file: refused, victim untouched.
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(ns_dir(root.path(), NS)).unwrap();
    let victim = outside.path().join("victim");
    std::fs::write(&victim, vec![0x42u8; 3 * 4096]).unwrap();
    std::os::unix::fs::symlink(&victim, device(root.path())).unwrap();
    assert!(Store::open(small(root.path(), engine)).is_err());
    assert_eq!(std::fs::read(&victim).unwrap(), vec![0x42u8; 3 * 4096], "victim file modified");

    // 3. Symlink to another store's device file (same namespace and geometry): refused.
    let (other, ids) = seeded(engine);
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(ns_dir(root.path(), NS)).unwrap();
    std::os::unix::fs::symlink(device(other.path()), device(root.path())).unwrap();
    match Store::open(small(root.path(), engine)) {
        Err(e) => println!("symlinked device file refused: {e}"),
        Ok(store) => {
            let served = get_checked(&store, &ids).iter().filter(|&&h| h).count();
            panic!("kvtier opened a device file outside its root through a symlink and served {served} blocks from it");
        }
    }
}

/// The namespace directory replaced by a symlink to a directory outside the root: refused, nothing
/// created out there.
#[test]
fn symlinked_namespace_directory_is_refused() {
    let engine = engines()[0];
    let outside = tempfile::tempdir().unwrap();
    let root = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), ns_dir(root.path(), NS)).unwrap();
    let r = Store::open(small(root.path(), engine));
    let written: Vec<_> = std::fs::read_dir(outside.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    let opened = r.is_ok();
    drop(r);
    assert!(!opened && written.is_empty(), "opened={opened}; files created outside the root: {written:?}");
}

#[test]
fn truncated_device_file_is_a_clear_error() {
    let engine = engines()[0];
    for keep in [REGION * 3, 100, 0] {
        let (dir, _) = seeded(engine);
        let path = device(dir.path());
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(keep).unwrap();
        match Store::open(small(dir.path(), engine)) {
            Ok(_) => panic!("a device file truncated to {keep} bytes was accepted"),
            Err(e) => {
                let msg = e.to_string();
                println!("truncated to {keep} bytes: {msg}");
                assert!(msg.contains("nvme.kvt"), "error does not name the file: {msg}");
                if keep >= SUPERBLOCK_BYTES as u64 {
                    assert!(matches!(e, Error::Format { .. }) && msg.contains("truncated"), "{msg}");
                }
            }
        }
        // Not repaired or grown behind the operator's back.
        assert_eq!(std::fs::metadata(&path).unwrap().len(), keep);
    }
}

/// The device file truncated by someone else while the store is open: loads past the new end are counted
/// I/O errors (misses), nothing hangs, and the store keeps serving.
#[test]
fn device_file_truncated_while_open_gives_counted_misses() {
    for engine in engines() {
        watchdog(90, "truncated while open", move || {
            let dir = tempfile::tempdir().unwrap();
            let store = Store::open(small(dir.path(), engine)).unwrap();
            let ids: Vec<u64> = (0..60).collect();
            for chunk in ids.chunks(10) {
                put(&store, chunk);
            }
            store.flush().unwrap();
            std::fs::OpenOptions::new()
                .write(true)
                .open(device(dir.path()))
                .unwrap()
                .set_len(SUPERBLOCK_BYTES as u64)
                .unwrap();
            let hits = get_checked(&store, &ids);
            let c = store.stats().counters;
            let misses = hits.iter().filter(|&&h| !h).count() as u64;
            assert!(misses >= 40, "{hits:?}");
            // Reads failing in a row make the NVMe tier step aside: the misses past them are skips.
            assert_eq!(
                misses,
                c.io_errors + c.checksum_failures + c.nvme_lookups_skipped,
                "every miss is counted: {c:?}"
            );
            assert_eq!((c.nvme_outages, c.nvme_sick), (1, 1), "{c:?}");
            // Still serving: new blocks are written (extending the file again) and read back, once
            // the first read after the tier's back-off (1 s) has probed it back.
            let fresh: Vec<u64> = (500..530).collect();
            for chunk in fresh.chunks(10) {
                assert!(put(&store, chunk).iter().all(|&b| b));
            }
            store.flush().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(1_200));
            get_checked(&store, &fresh[..1]);
            assert_eq!(store.stats().counters.nvme_sick, 0, "the probe found the disk answering");
            assert!(get_checked(&store, &fresh).iter().filter(|&&h| h).count() >= 20);
            store.check_invariants();
        });
    }
}

#[test]
fn future_format_versions_are_refused_or_misses() {
    for engine in engines() {
        // Superblock of version 2 (valid checksum): a clear error at open.
        let (dir, _) = seeded(engine);
        let path = device(dir.path());
        let mut sb = read_at(&path, 0, SUPERBLOCK_BYTES);
        sb[8..12].copy_from_slice(&2u32.to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64(&sb[..SUPERBLOCK_BYTES - 8]);
        sb[SUPERBLOCK_BYTES - 8..].copy_from_slice(&sum.to_le_bytes());
        write_at(&path, 0, &sb);
        match Store::open(small(dir.path(), engine)) {
            Err(e @ Error::Format { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("version 2"), "{msg}");
            }
            other => panic!("expected a format error, got {:?}", other.map(|_| ())),
        }

        // Trailer of version 2: the region is scanned instead. Descriptor of version 2: a miss.
        let (dir, ids) = seeded(engine);
        let path = device(dir.path());
        let mut header = read_at(&path, trailer_offset(1), 64);
        header[8..12].copy_from_slice(&2u32.to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64(&header[..56]);
        header[56..64].copy_from_slice(&sum.to_le_bytes());
        write_at(&path, trailer_offset(1), &header);
        let at = region_offset(0) + 4 * SLOT;
        let mut page = read_at(&path, at, 128);
        page[8..10].copy_from_slice(&2u16.to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64(&page[..120]);
        page[120..128].copy_from_slice(&sum.to_le_bytes());
        write_at(&path, at, &page);
        let store = Store::open(small(dir.path(), engine)).unwrap();
        let hits = get_checked(&store, &ids);
        assert_eq!(hits.iter().filter(|&&h| !h).count(), 1, "{hits:?}");
        assert_eq!(store.stats().counters.checksum_failures, 1);
    }
}

/// Files are private to the owner; directories are reported (and must not be group or world writable).
#[test]
fn created_files_are_private() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("fresh-root");
    let store = Store::open(small(&root, engines()[0])).unwrap();
    let ns = ns_dir(&root, NS);
    for (what, p) in [("root", root.clone()), ("namespace dir", ns.clone())] {
        let mode = std::fs::metadata(&p).unwrap().mode() & 0o7777;
        println!("{what} {}: mode {mode:04o}", p.display());
        assert_eq!(mode & 0o022, 0, "{what} is group/world writable ({mode:04o})");
    }
    for name in ["nvme.kvt", "LOCK"] {
        let mode = std::fs::metadata(ns.join(name)).unwrap().mode() & 0o7777;
        println!("{name}: mode {mode:04o}");
        assert_eq!(mode & 0o077, 0, "{name} is readable or writable by others ({mode:04o}); expected 0600");
    }
    drop(store);
}

fn striped(dirs: &[PathBuf]) -> StoreConfig {
    let mut c = small(&dirs[0], EngineChoice::Psync);
    c.paths = dirs.to_vec();
    c.nvme_bytes = 2 * dirs.len() as u64 * c.effective_region_bytes();
    c
}

#[test]
fn a_directory_another_open_store_stripes_over_is_locked() {
    let root = tempfile::tempdir().unwrap();
    let [a, b, shared] = ["a", "b", "shared"].map(|d| root.path().join(d));
    let first = Store::open(striped(&[a, shared.clone()])).unwrap();
    // Not the first directory of `first`, yet locked: before, only the first path was locked and a
    // second store would write `shared`'s device file at the same time.
    match Store::open(striped(&[b, shared])) {
        Err(Error::Locked { path }) => assert!(path.starts_with(root.path().join("shared")), "{path:?}"),
        other => panic!("expected Locked, got {:?}", other.map(|_| "an open store")),
    }
    first.close().unwrap();
}

#[test]
fn directories_of_two_stores_are_not_mixed() {
    let root = tempfile::tempdir().unwrap();
    let [a1, a2, b1, b2] = ["a1", "a2", "b1", "b2"].map(|d| root.path().join(d));
    Store::open(striped(&[a1.clone(), a2.clone()])).unwrap().close().unwrap();
    Store::open(striped(&[b1.clone(), b2.clone()])).unwrap().close().unwrap();
    match Store::open(striped(&[a1.clone(), b2])) {
        Err(Error::Format { message, .. }) => assert!(message.contains("belongs to another store"), "{message}"),
        other => panic!("expected a store id mismatch, got {:?}", other.map(|_| "an open store")),
    }
    // A store's own directories still open together, and a recreated device joins its store.
    Store::open(striped(&[a1.clone(), a2.clone()])).unwrap().close().unwrap();
    std::fs::remove_file(device(&a2)).unwrap();
    Store::open(striped(&[a1.clone(), a2.clone()])).unwrap().close().unwrap();
    Store::open(striped(&[a1, a2])).unwrap().close().unwrap();
}
