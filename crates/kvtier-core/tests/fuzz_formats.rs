//! Fuzzing of every parser of stored bytes (slot descriptor, device superblock, region trailer) with
//! proptest, plus a recovery fuzz that corrupts a real device file and reopens it.
//!
//! Properties:
//! - `decode` never panics on arbitrary bytes (also arbitrary bytes behind a valid magic and version,
//!   and structurally valid headers with forged checksums, so that the code past the checks is reached);
//! - encode -> decode round-trips;
//! - any single bit flip in the checksummed part of an encoded structure is rejected (a trailer whose
//!   magic is flipped reads as "no trailer", which makes recovery scan the region instead);
//! - oversized entry counts never cause allocations larger than the input (a counting allocator
//!   measures the largest single allocation made while decoding);
//! - block ids from Python: the page of any id (edge-biased around the 64-bit wrap of `id * page`) is
//!   accepted exactly when it lies inside the layer buffer (`BlockBuffer::layer_page_offset`);
//! - recovery: a real store whose device file gets random byte ranges overwritten with garbage (or
//!   whole slots transplanted over others) reopens without panicking and every block it returns is
//!   byte-identical to what was written.
//!
//! Size: `PROPTEST_CASES` (default 256) cases per parser property; the recovery fuzz runs
//! `PROPTEST_CASES / 8` cases (at least 16), since each one copies and reopens a store.

mod common;
use common::*;

use kvtier_core::format::descriptor::{Descriptor, DESCRIPTOR_BYTES, DESCRIPTOR_MAGIC, DESCRIPTOR_USED_BYTES};
use kvtier_core::format::superblock::{Superblock, SUPERBLOCK_BYTES, SUPERBLOCK_MAGIC};
use kvtier_core::format::trailer::{trailer_bytes, Trailer, TrailerEntry, TRAILER_HEADER_BYTES, TRAILER_MAGIC};
use kvtier_core::format::ParseError;
use kvtier_core::{BlockKey, EngineChoice, Namespace, Store};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

// ---- a counting allocator: the largest single allocation made by this thread while tracking ----

struct Tracking;

thread_local! {
    static TRACK: Cell<bool> = const { Cell::new(false) };
    static MAX_ALLOC: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

fn note(size: usize) {
    let _ = TRACK.try_with(|t| {
        if t.get() {
            let _ = MAX_ALLOC.try_with(|m| m.set(m.get().max(size)));
        }
    });
}

#[global_allocator]
static GLOBAL: Tracking = Tracking;

/// Runs `f` and returns its result with the largest single allocation it made on this thread.
fn max_alloc_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    MAX_ALLOC.with(|m| m.set(0));
    TRACK.with(|t| t.set(true));
    let r = f();
    TRACK.with(|t| t.set(false));
    (r, MAX_ALLOC.with(|m| m.get()))
}

// ---- runner set-up ----

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() })
}

/// Runs a property and prints how many cases it executed.
fn check<S: Strategy>(name: &str, cases: u32, strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>)
where
    S::Value: std::fmt::Debug,
{
    let executed = AtomicU64::new(0);
    let mut r = runner(cases);
    let result = r.run(&strategy, |v| {
        executed.fetch_add(1, Ordering::Relaxed);
        test(v)
    });
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
    println!("FUZZ {name}: {} executions (incl. shrinking), 0 failures", executed.load(Ordering::Relaxed));
}

fn hash(b: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(b)
}

fn arb_key() -> impl Strategy<Value = BlockKey> {
    any::<[u8; 32]>().prop_map(BlockKey)
}

fn arb_descriptor() -> impl Strategy<Value = Descriptor> {
    (any::<u32>(), arb_key(), any::<[u8; 32]>(), any::<u64>(), any::<u64>(), any::<u64>()).prop_map(
        |(value_bytes, key, ns, sequence, region_seq, value_checksum)| Descriptor {
            value_bytes,
            key,
            namespace: Namespace(ns),
            sequence,
            region_seq,
            value_checksum,
        },
    )
}

/// u64 values biased to the edges a forger would pick: page multiples, zero, values near u64::MAX.
fn edgy_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        any::<u64>(),
        (0u64..1 << 20).prop_map(|x| x * 4096),
        (0u64..8192).prop_map(|x| u64::MAX - x),
        (0u64..8192).prop_map(|x| (u64::MAX / 4096 - x) * 4096),
        Just(0u64),
    ]
}

fn edgy_u32() -> impl Strategy<Value = u32> {
    prop_oneof![any::<u32>(), 0u32..8, (0u32..8).prop_map(|x| u32::MAX - x)]
}

fn arb_superblock_any() -> impl Strategy<Value = Superblock> {
    (edgy_u32(), edgy_u32(), any::<[u8; 32]>(), edgy_u64(), edgy_u64(), edgy_u64(), edgy_u64(), any::<u64>()).prop_map(
        |(device_index, device_count, ns, region_bytes, region_count, slot_bytes, object_bytes, store_id)| Superblock {
            device_index,
            device_count,
            namespace: Namespace(ns),
            region_bytes,
            region_count,
            slot_bytes,
            object_bytes,
            store_id,
        },
    )
}

/// Superblocks that satisfy every range rule of `Superblock::decode`.
fn arb_superblock_valid() -> impl Strategy<Value = Superblock> {
    (1u64..=1 << 20, any::<u64>(), any::<u64>(), 1u32..=64, any::<[u8; 32]>(), any::<u64>(), any::<u64>()).prop_map(
        |(region_pages, slot_pick, obj_pick, device_count, ns, region_count, store_id)| {
            let region_bytes = region_pages * 4096;
            let slot_pages = 1 + slot_pick % region_pages;
            let slot_bytes = slot_pages * 4096;
            let object_bytes = obj_pick % (slot_bytes - 4096 + 1);
            Superblock {
                device_index: (store_id % device_count as u64) as u32,
                device_count,
                namespace: Namespace(ns),
                region_bytes,
                region_count,
                slot_bytes,
                object_bytes,
                store_id,
            }
        },
    )
}

fn arb_entry() -> impl Strategy<Value = TrailerEntry> {
    (arb_key(), any::<u64>(), any::<u64>(), any::<u32>(), any::<u64>()).prop_map(
        |(key, sequence, offset, value_bytes, value_checksum)| TrailerEntry {
            key,
            sequence,
            offset,
            value_bytes,
            value_checksum,
        },
    )
}

/// (max_entries, trailer) with at most max_entries entries.
fn arb_trailer() -> impl Strategy<Value = (usize, Trailer)> {
    (0usize..200).prop_flat_map(|max| {
        (Just(max), proptest::collection::vec(arb_entry(), 0..=max), any::<u64>(), any::<u64>())
            .prop_map(|(max, entries, region_seq, region_index)| (max, Trailer { region_seq, region_index, entries }))
    })
}

/// Arbitrary bytes, some of them behind a valid magic and version so that the later checks are reached.
fn arb_bytes_with_prefix(magic: [u8; 8], version_bytes: Vec<u8>, max_len: usize) -> impl Strategy<Value = Vec<u8>> {
    (proptest::collection::vec(any::<u8>(), 0..max_len), 0u8..3).prop_map(move |(mut b, mode)| {
        if mode >= 1 && b.len() >= 8 {
            b[..8].copy_from_slice(&magic);
        }
        if mode == 2 && b.len() >= 8 + version_bytes.len() {
            b[8..8 + version_bytes.len()].copy_from_slice(&version_bytes);
        }
        b
    })
}

// ---- descriptor ----

#[test]
fn descriptor_decode_never_panics_on_arbitrary_bytes() {
    check(
        "descriptor_decode_arbitrary",
        cases(),
        arb_bytes_with_prefix(DESCRIPTOR_MAGIC, 1u16.to_le_bytes().to_vec(), 4200),
        |bytes| {
            let _ = Descriptor::decode(&bytes);
            Ok(())
        },
    );
}

#[test]
fn descriptor_roundtrip_and_bit_flips_rejected() {
    check("descriptor_roundtrip_bitflip", cases(), (arb_descriptor(), 0usize..DESCRIPTOR_BYTES * 8), |(d, bit)| {
        let mut page = vec![0u8; DESCRIPTOR_BYTES];
        d.encode(&mut page);
        prop_assert_eq!(Descriptor::decode(&page), Ok(d));
        page[bit / 8] ^= 1 << (bit % 8);
        let decoded = Descriptor::decode(&page);
        if bit / 8 < DESCRIPTOR_USED_BYTES {
            prop_assert!(decoded.is_err(), "flip of bit {} accepted: {:?}", bit, decoded);
        } else {
            // The zero padding after byte 128 is not covered by the header checksum: a flip there changes
            // nothing the store uses.
            prop_assert_eq!(decoded, Ok(d));
        }
        Ok(())
    });
}

// ---- superblock ----

#[test]
fn superblock_decode_never_panics_on_arbitrary_bytes() {
    check(
        "superblock_decode_arbitrary",
        cases(),
        arb_bytes_with_prefix(SUPERBLOCK_MAGIC, 1u32.to_le_bytes().to_vec(), 4200),
        |bytes| {
            let _ = Superblock::decode(&bytes);
            Ok(())
        },
    );
}

/// A superblock with a valid checksum but arbitrary field values (what a forger or a future writer could
/// produce): decode must not panic, and must return exactly what was encoded when it accepts it.
#[test]
fn superblock_with_valid_checksum_and_arbitrary_fields_never_panics() {
    check("superblock_forged_fields", cases(), arb_superblock_any(), |sb| {
        let mut page = vec![0u8; SUPERBLOCK_BYTES];
        sb.encode(&mut page);
        if let Ok(found) = Superblock::decode(&page) {
            prop_assert_eq!(found, sb);
        }
        Ok(())
    });
}

/// Regression (found by the property above): `object_bytes` near u64::MAX behind a valid checksum made
/// `Superblock::decode` overflow (`object_bytes + 4096`), a panic in debug builds.
#[test]
fn superblock_forged_object_bytes_near_max_is_rejected() {
    for object_bytes in [u64::MAX, u64::MAX - 4095, u64::MAX - 4096] {
        let sb = Superblock {
            device_index: 0,
            device_count: 1,
            namespace: Namespace([7; 32]),
            region_bytes: 1 << 20,
            region_count: 4,
            slot_bytes: 8192,
            object_bytes,
            store_id: 1,
        };
        let mut page = vec![0u8; SUPERBLOCK_BYTES];
        sb.encode(&mut page);
        assert_eq!(Superblock::decode(&page), Err(ParseError::OutOfRange("object_bytes")));
    }
}

#[test]
fn superblock_roundtrip_and_bit_flips_rejected() {
    check(
        "superblock_roundtrip_bitflip",
        cases(),
        (arb_superblock_valid(), 0usize..SUPERBLOCK_BYTES * 8),
        |(sb, bit)| {
            let mut page = vec![0u8; SUPERBLOCK_BYTES];
            sb.encode(&mut page);
            prop_assert_eq!(Superblock::decode(&page), Ok(sb));
            page[bit / 8] ^= 1 << (bit % 8);
            let decoded = Superblock::decode(&page);
            prop_assert!(decoded.is_err(), "flip of bit {} accepted: {:?}", bit, decoded);
            Ok(())
        },
    );
}

// ---- trailer ----

#[test]
fn trailer_decode_never_panics_on_arbitrary_bytes() {
    check(
        "trailer_decode_arbitrary",
        cases(),
        arb_bytes_with_prefix(TRAILER_MAGIC, 1u32.to_le_bytes().to_vec(), 16384),
        |bytes| {
            let (_, max) = max_alloc_during(|| {
                let _ = Trailer::decode(&bytes);
            });
            prop_assert!(max <= 2 * bytes.len() + 4096, "decode of {} bytes allocated {} bytes", bytes.len(), max);
            Ok(())
        },
    );
}

#[test]
fn trailer_roundtrip_and_bit_flips_rejected() {
    check("trailer_roundtrip_bitflip", cases(), (arb_trailer(), any::<prop::sample::Index>()), |((max, t), pick)| {
        let mut buf = vec![0u8; trailer_bytes(max)];
        t.encode(&mut buf);
        prop_assert_eq!(Trailer::decode(&buf), Ok(Some(t.clone())));
        let bit = pick.index(buf.len() * 8);
        buf[bit / 8] ^= 1 << (bit % 8);
        let covered = TRAILER_HEADER_BYTES + t.entries.len() * 64;
        match Trailer::decode(&buf) {
            Err(_) => {}
            // A flipped magic reads as "no trailer": recovery then scans the region entry by entry.
            Ok(None) => prop_assert!(bit / 8 < 8, "flip of bit {} made the trailer vanish", bit),
            Ok(Some(found)) => {
                prop_assert!(bit / 8 >= covered, "flip of bit {} (covered part) accepted", bit);
                prop_assert_eq!(found, t);
            }
        }
        Ok(())
    });
}

/// A header with a valid checksum claiming up to u32::MAX entries: rejected, with no allocation sized by
/// the claim.
#[test]
fn trailer_oversized_entry_count_is_rejected_without_giant_allocation() {
    check(
        "trailer_oversized_count",
        cases(),
        (any::<u32>(), 64usize..65536, any::<u64>(), any::<u64>(), any::<u64>()),
        |(count, len, region_seq, region_index, entries_sum)| {
            let mut buf = vec![0u8; len];
            buf[0..8].copy_from_slice(&TRAILER_MAGIC);
            buf[8..12].copy_from_slice(&1u32.to_le_bytes());
            buf[12..16].copy_from_slice(&count.to_le_bytes());
            buf[16..24].copy_from_slice(&region_seq.to_le_bytes());
            buf[24..32].copy_from_slice(&region_index.to_le_bytes());
            buf[32..40].copy_from_slice(&entries_sum.to_le_bytes());
            let sum = hash(&buf[..56]);
            buf[56..64].copy_from_slice(&sum.to_le_bytes());
            let (result, max) = max_alloc_during(|| Trailer::decode(&buf));
            let fits = TRAILER_HEADER_BYTES + count as usize * 64 <= len;
            if !fits {
                prop_assert_eq!(result, Err(ParseError::OutOfRange("entry_count")));
            }
            prop_assert!(max <= 2 * len + 4096, "count {} in {} bytes allocated {} bytes", count, len, max);
            Ok(())
        },
    );
}

// ---- block ids from Python (the binding's engine-layout calls) ----

/// Block ids biased to where `id * page (+ page)` wraps in 64 bits, around the end of the buffer, and
/// anywhere.
fn edgy_block_id(page: usize, layer_bytes: usize) -> impl Strategy<Value = usize> {
    let wrap = usize::MAX / page.max(1);
    let blocks = layer_bytes / page.max(1);
    prop_oneof![
        any::<usize>(),
        (0usize..8).prop_map(move |x| wrap.saturating_sub(x)),
        (0usize..8).prop_map(move |x| wrap.saturating_add(x)),
        (0usize..8).prop_map(move |x| blocks.saturating_sub(4).saturating_add(x)),
        (0usize..8).prop_map(move |x| usize::MAX - x),
    ]
}

/// `BlockBuffer::layer_page_offset`, which every block id from Python goes through before memory is
/// touched: `Some(start)` exactly when the whole page lies inside the layer (computed in u128, where
/// nothing wraps), and then `start` is `id * page`.
#[test]
fn layer_page_offset_matches_exact_arithmetic_for_any_block_id() {
    let pages = prop_oneof![1usize..=64, (1usize..=512).prop_map(|x| x * 4096), Just(4096), any::<usize>()];
    let layer_bytes = prop_oneof![any::<usize>(), 0usize..1 << 24, (0usize..8).prop_map(|x| usize::MAX - x)];
    let strategy = (pages, layer_bytes).prop_flat_map(|(page, len)| (Just(page), Just(len), edgy_block_id(page, len)));
    check("layer_page_offset", cases() * 4, strategy, |(page, len, id)| {
        let end = (id as u128) * (page as u128) + page as u128;
        let inside = end <= len as u128;
        let got = kvtier_core::BlockBuffer::layer_page_offset(id, page, len);
        prop_assert_eq!(got, inside.then(|| id * page), "id {} page {} len {}", id, page, len);
        Ok(())
    });
}

// ---- recovery fuzz on a real device file ----

const OBJ: usize = 16 * 1024;
const IDS: u64 = 160;

fn fuzz_config(dir: &Path, engine: EngineChoice) -> kvtier_core::StoreConfig {
    let mut c = config(dir, engine, OBJ);
    c.dram_bytes = 8 * (OBJ + 4096);
    c.nvme_bytes = 6 << 20;
    c.region_bytes = 1 << 20; // ~48 entries per region: several sealed regions plus an open one
    c.slot_wait_ms = 2000;
    c
}

fn device_path(root: &Path) -> PathBuf {
    root.join(Namespace::from_description(b"test-model/bf16/128").hex()).join("nvme.kvt")
}

fn copy_tree(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            std::fs::create_dir_all(&target).unwrap();
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

#[derive(Debug, Clone)]
enum Damage {
    /// Overwrite `len` bytes at `offset` with garbage.
    Garbage { offset: u64, len: usize, seed: u64 },
    /// Overwrite a slot-aligned range with a copy of another slot-aligned range (valid structures in
    /// the wrong place: descriptors of other keys, trailers of other regions).
    Transplant { from: u64, to: u64, len: usize },
}

fn arb_damage(file_len: u64) -> impl Strategy<Value = Damage> {
    let slot = (OBJ + 4096) as u64;
    prop_oneof![
        (0..file_len, 1usize..65536, any::<u64>()).prop_map(|(offset, len, seed)| Damage::Garbage {
            offset,
            len,
            seed
        }),
        // aimed at descriptors and trailers: page-aligned starts, short lengths
        (0..file_len / 4096, 1usize..256, any::<u64>()).prop_map(|(page, len, seed)| Damage::Garbage {
            offset: page * 4096,
            len,
            seed
        }),
        (0..file_len / slot, 0..file_len / slot, 1u64..3).prop_map(move |(a, b, n)| Damage::Transplant {
            from: 4096 + a * slot,
            to: 4096 + b * slot,
            len: (n * slot) as usize
        }),
    ]
}

fn apply(path: &Path, damage: &Damage) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let file_len = f.metadata().unwrap().len();
    match *damage {
        Damage::Garbage { offset, len, seed } => {
            let len = len.min((file_len - offset) as usize);
            let mut x = seed | 1;
            let garbage: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            f.write_all_at(&garbage, offset).unwrap();
        }
        Damage::Transplant { from, to, len } => {
            let len = len.min((file_len - from.max(to)) as usize);
            let mut buf = vec![0u8; len];
            f.read_exact_at(&mut buf, from).unwrap();
            f.write_all_at(&buf, to).unwrap();
        }
    }
}

#[test]
fn recovery_from_damaged_device_file_never_serves_wrong_bytes() {
    let cases = (cases() / 8).max(16);
    // One pristine store per engine, written once; every case damages a fresh copy.
    let base = tempfile::tempdir().unwrap();
    let ids: Vec<u64> = (0..IDS).collect();
    {
        let store = Store::open(fuzz_config(base.path(), engines()[0])).unwrap();
        for chunk in ids.chunks(16) {
            assert!(put(&store, chunk).iter().all(|&b| b));
        }
        store.close().unwrap();
    }
    let file_len = std::fs::metadata(device_path(base.path())).unwrap().len();
    let stats = std::sync::Mutex::new((0u64, 0u64, 0u64, 0u64, 0u64)); // cases, open errors, hits, misses, checksum failures
    let engine_list = engines();
    check(
        "recovery_damaged_device_file",
        cases,
        (proptest::collection::vec(arb_damage(file_len), 1..6), any::<prop::sample::Index>()),
        |(damages, engine_pick)| {
            let dir = tempfile::tempdir().unwrap();
            copy_tree(base.path(), dir.path());
            for d in &damages {
                apply(&device_path(dir.path()), d);
            }
            let engine = engine_list[engine_pick.index(engine_list.len())];
            let mut s = stats.lock().unwrap();
            s.0 += 1;
            match Store::open(fuzz_config(dir.path(), engine)) {
                // The superblock was hit: a clear error at open is the right outcome.
                Err(e) => {
                    let msg = e.to_string();
                    prop_assert!(msg.contains("nvme.kvt"), "open error does not name the file: {}", msg);
                    s.1 += 1;
                }
                Ok(store) => {
                    // get_checked asserts every returned block byte for byte (a panic fails the case).
                    let hits = get_checked(&store, &ids);
                    // A second pass (now partly from DRAM, after the failed entries were dropped) checks again.
                    get_checked(&store, &ids);
                    store.check_invariants();
                    let c = store.stats().counters;
                    s.2 += hits.iter().filter(|&&h| h).count() as u64;
                    s.3 += hits.iter().filter(|&&h| !h).count() as u64;
                    s.4 += c.checksum_failures;
                    // The store keeps serving: new blocks go in and come back.
                    let fresh: Vec<u64> = (10_000..10_008).collect();
                    prop_assert!(put(&store, &fresh).iter().all(|&b| b));
                    prop_assert!(get_checked(&store, &fresh).iter().all(|&b| b));
                    store.close().map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
            }
            Ok(())
        },
    );
    let s = stats.lock().unwrap();
    println!(
        "FUZZ recovery: {} damaged stores opened ({} refused at open with a clear error), {} blocks served byte-identical, \
         {} misses, {} checksum failures caught, 0 wrong bytes",
        s.0, s.1, s.2, s.3, s.4
    );
}
