//! End-to-end behaviour of the store on real files, with both I/O engines.

mod common;
use common::*;
use kvtier_core::{Error, Store};

#[test]
fn put_get_roundtrip_from_dram() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(config(dir.path(), engine, 64 * 1024)).unwrap();
        assert_eq!(put(&store, &[1, 2, 3]), vec![true; 3]);
        assert_eq!(get_checked(&store, &[1, 2, 3, 4]), vec![true, true, true, false]);
        let s = store.stats();
        assert_eq!(s.counters.dram_hits, 3);
        assert_eq!(s.counters.misses, 1);
        assert_eq!(store.lookup_prefix(&[key(1), key(2), key(9), key(3)]), 2);
        store.check_invariants();
    }
}

#[test]
fn dram_eviction_then_hit_from_nvme() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(config(dir.path(), engine, 64 * 1024)).unwrap();
        let ids: Vec<u64> = (0..100).collect();
        assert!(put(&store, &ids).iter().all(|&b| b));
        store.flush().unwrap();
        let hits = get_checked(&store, &ids);
        assert!(hits.iter().all(|&h| h), "engine {engine:?}: {hits:?}");
        let s = store.stats();
        assert!(s.counters.nvme_hits >= 80, "{s:?}");
        assert!(s.counters.dram_evictions > 0);
        assert_eq!(s.counters.checksum_failures, 0);
        store.check_invariants();
    }
}

#[test]
fn restart_recovers_from_trailers_and_open_region() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let ids: Vec<u64> = (0..150).collect();
        {
            let store = Store::open(config(dir.path(), engine, 64 * 1024)).unwrap();
            put(&store, &ids);
            store.close().unwrap();
        }
        let store = Store::open(config(dir.path(), engine, 64 * 1024)).unwrap();
        let s = store.stats();
        assert!(s.counters.recovered_blocks >= 150, "{s:?}");
        let hits = get_checked(&store, &ids);
        assert!(hits.iter().all(|&h| h), "{hits:?}");
    }
}

#[test]
fn region_reuse_keeps_newest_blocks_and_never_serves_wrong_bytes() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path(), engine, 64 * 1024);
        cfg.nvme_bytes = 16 << 20; // 4 regions of 4 MiB: forces whole-region eviction
        let store = Store::open(cfg.clone()).unwrap();
        let ids: Vec<u64> = (0..600).collect();
        for chunk in ids.chunks(50) {
            put(&store, chunk);
        }
        store.flush().unwrap();
        let s = store.stats();
        assert!(s.counters.nvme_region_evictions > 0, "{s:?}");
        let hits = get_checked(&store, &ids);
        let newest = hits[500..].iter().filter(|&&h| h).count();
        assert!(newest >= 40, "recent blocks should survive: {newest}");
        assert!(!hits[..100].iter().any(|&h| h), "oldest blocks should be evicted");
        store.close().unwrap();
        drop(store);
        let store = Store::open(cfg).unwrap();
        get_checked(&store, &ids);
        assert_eq!(store.stats().counters.checksum_failures, 0);
    }
}

#[test]
fn other_namespace_sees_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engines()[0];
    {
        let store = Store::open(config(dir.path(), engine, 64 * 1024)).unwrap();
        put(&store, &[1, 2]);
        store.close().unwrap();
    }
    let mut other = config(dir.path(), engine, 64 * 1024);
    other.namespace = b"another-model/bf16/128".to_vec();
    let store = Store::open(other).unwrap();
    assert_eq!(get_checked(&store, &[1, 2]), vec![false, false]);
}

#[test]
fn second_open_of_same_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engines()[0];
    let _a = Store::open(config(dir.path(), engine, 64 * 1024)).unwrap();
    match Store::open(config(dir.path(), engine, 64 * 1024)) {
        Err(Error::Locked { .. }) => {}
        other => panic!("expected Locked, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn different_geometry_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engines()[0];
    Store::open(config(dir.path(), engine, 64 * 1024)).unwrap().close().unwrap();
    let mut cfg = config(dir.path(), engine, 64 * 1024);
    cfg.nvme_bytes = 128 << 20;
    let err = Store::open(cfg).err().expect("geometry mismatch must fail");
    let msg = err.to_string();
    assert!(msg.contains("reopen with the same"), "{msg}");
}

#[test]
fn async_jobs_report_results() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(config(dir.path(), engine, 64 * 1024)).unwrap();
        let n = store.object_bytes();
        let values: Vec<Vec<u8>> = (0..8).map(|i| value(i, n)).collect();
        let keys: Vec<_> = (0..8).map(key).collect();
        let bufs = values.iter().map(|v| kvtier_core::BlockBuffer::single(v.as_ptr() as *mut u8, n)).collect();
        unsafe {
            store
                .submit(kvtier_core::Job { id: 1, kind: kvtier_core::JobKind::Put, keys: keys.clone(), buffers: bufs })
                .unwrap();
        }
        assert_eq!(store.wait(1, Some(std::time::Duration::from_secs(10))).unwrap(), vec![true; 8]);
        let mut out: Vec<Vec<u8>> = (0..8).map(|_| vec![0; n]).collect();
        let bufs = out.iter_mut().map(|v| kvtier_core::BlockBuffer::single(v.as_mut_ptr(), n)).collect();
        unsafe {
            store.submit(kvtier_core::Job { id: 2, kind: kvtier_core::JobKind::Get, keys, buffers: bufs }).unwrap();
        }
        assert_eq!(store.wait(2, None).unwrap(), vec![true; 8]);
        assert_eq!(out, values);
        assert!(store.poll().is_empty());
    }
}

#[test]
fn striped_over_two_directories() {
    for engine in engines() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let mut cfg = config(a.path(), engine, 64 * 1024);
        cfg.paths.push(b.path().to_path_buf());
        cfg.nvme_bytes = 64 << 20;
        let ids: Vec<u64> = (0..80).collect();
        {
            let store = Store::open(cfg.clone()).unwrap();
            put(&store, &ids);
            store.close().unwrap();
        }
        let store = Store::open(cfg).unwrap();
        assert!(get_checked(&store, &ids).iter().all(|&h| h));
        assert_eq!(store.stats().counters.nvme_hits, 80);
    }
}

#[test]
fn aligned_buffers_take_direct_reads_and_are_verified() {
    use kvtier_core::testing::AlignedBuf;
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let n = 64 * 1024;
        let ids: Vec<u64> = (0..60).collect();
        {
            let store = Store::open(config(dir.path(), engine, n)).unwrap();
            put(&store, &ids);
            store.close().unwrap();
        }
        let store = Store::open(config(dir.path(), engine, n)).unwrap();
        let keys: Vec<_> = ids.iter().map(|&i| key(i)).collect();
        // Two page-aligned segments per block, as an engine's per-layer pages would be.
        let mut bufs: Vec<(AlignedBuf, AlignedBuf)> =
            ids.iter().map(|_| (AlignedBuf::zeroed(n / 2), AlignedBuf::zeroed(n / 2))).collect();
        let blocks: Vec<kvtier_core::BlockBuffer> = bufs
            .iter_mut()
            .map(|(a, b)| kvtier_core::BlockBuffer { segments: vec![(a.as_ptr(), n / 2), (b.as_ptr(), n / 2)] })
            .collect();
        let hits = unsafe { store.get_raw(&keys, &blocks).unwrap() };
        assert!(hits.iter().all(|&h| h), "{hits:?}");
        for (&i, (a, b)) in ids.iter().zip(&bufs) {
            let want = value(i, n);
            assert!(a.as_slice() == &want[..n / 2] && b.as_slice() == &want[n / 2..], "block {i} wrong");
        }
        let s = store.stats();
        assert_eq!(s.counters.nvme_hits, 60);
        assert_eq!(s.counters.bytes_copied_out, 0, "direct reads must not copy");
        assert_eq!(s.gauges.blocks_dram, 0, "direct reads do not promote to DRAM");
    }
}

#[test]
fn loads_do_not_stall_when_every_dram_slot_is_pinned() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path(), engine, 64 * 1024);
        cfg.slot_wait_ms = 30_000;
        let store = Store::open(cfg).unwrap();
        let old: Vec<u64> = (0..40).collect();
        put(&store, &old);
        store.flush().unwrap();
        // Fill DRAM with fresh blocks and pin them all, as an engine does between prepare_load and
        // complete_load.
        let fresh: Vec<u64> = (100..116).collect();
        put(&store, &fresh);
        let fresh_keys: Vec<_> = fresh.iter().map(|&i| key(i)).collect();
        assert_eq!(store.pin_prefix(&fresh_keys), vec![true; 16]);
        let started = std::time::Instant::now();
        let hits = get_checked(&store, &old[..10]);
        assert!(hits.iter().all(|&h| h), "{hits:?}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "load stalled {:?}", started.elapsed());
        assert_eq!(store.stats().counters.slot_wait_timeouts, 0);
        store.unpin(&fresh_keys);
    }
}

/// A prefetch (`read_ahead`) of blocks that are only on NVMe must leave them in DRAM for the load
/// that follows: promoted blocks are hits, not one-time newcomers, so the eviction
/// policy must not push them out to make room for the next blocks the same prefetch promotes.
#[test]
fn blocks_prefetched_from_nvme_stay_in_dram_for_their_load() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(config(dir.path(), engine, 64 * 1024)).unwrap();
        // Three pools' worth: the first ones are on NVMe only afterwards.
        let ids: Vec<u64> = (0..48).collect();
        assert!(put(&store, &ids).iter().all(|&b| b));
        store.flush().unwrap();
        // The blocks in DRAM were hit once (an earlier request reused them): to S3-FIFO they are
        // no longer one-time newcomers.
        let resident: Vec<u64> = (32..48).collect();
        assert!(get_checked(&store, &resident).iter().all(|&h| h));
        let wanted: Vec<u64> = (0..12).collect();
        let keys: Vec<_> = wanted.iter().map(|&i| key(i)).collect();
        // In rounds of a quarter of the pool, as the service client's prefetch does.
        let before_read_ahead = store.stats().counters;
        for round in keys.chunks(4) {
            let resident = store.read_ahead(round).unwrap();
            assert!(resident.iter().all(|&r| r), "{resident:?}");
        }
        let before = store.stats().counters;
        assert_eq!(before.nvme_hits - before_read_ahead.nvme_hits, 12, "each block read ahead from NVMe once");
        assert_eq!(before.dram_hits, before_read_ahead.dram_hits, "a read-ahead serves nothing");
        assert!(get_checked(&store, &wanted).iter().all(|&h| h));
        let after = store.stats().counters;
        assert_eq!(after.nvme_hits - before.nvme_hits, 0, "engine {engine:?}: prefetched blocks were read again");
        assert_eq!(after.dram_hits - before.dram_hits, 0, "counted at NVMe by the read-ahead");
        assert_eq!(after.read_ahead_hits - before.read_ahead_hits, 12);
        // Blocks already in DRAM and absent ones: a read-ahead counts neither a hit nor a miss.
        let mut again = keys[..2].to_vec();
        again.push(key(1000));
        assert_eq!(store.read_ahead(&again).unwrap(), vec![true, true, false]);
        let last = store.stats().counters;
        let hits = |c: &kvtier_core::StatsSnapshot| (c.dram_hits, c.nvme_hits, c.misses, c.read_ahead_hits);
        assert_eq!(hits(&last), hits(&after), "engine {engine:?}");
        store.check_invariants();
    }
}

/// Loads go first: with every DRAM slot holding a stored block whose NVMe write waits in the device
/// queue (slow writes, one in flight), a load of NVMe-only blocks takes the slots of queued writes
/// instead of waiting for the backlog to drain. The stores it cancels are misses afterwards, counted
/// in `cancelled_writes`, before and after a restart; every block served is byte-exact. With
/// `loads_cancel_queued_writes` off the load waits and every store reaches NVMe.
#[test]
fn a_load_short_of_slots_takes_the_slots_of_queued_writes() {
    for engine in engines() {
        for cancel in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            let mut cfg = config(dir.path(), engine, 64 * 1024);
            cfg.max_write_inflight_bytes = cfg.slot_bytes();
            cfg.max_dirty_bytes = 16 * cfg.slot_bytes();
            cfg.slot_wait_ms = 30_000;
            cfg.loads_cancel_queued_writes = cancel;
            let mut slow = cfg.clone();
            slow.fault_plan =
                Some(std::sync::Arc::new(kvtier_core::testing::FaultPlan { delay_ms: 40, ..Default::default() }));
            let store = Store::open(slow).unwrap();
            let old: Vec<u64> = (0..8).collect();
            assert!(put(&store, &old).iter().all(|&b| b));
            store.flush().unwrap();
            // A pool of fresh blocks: the old ones leave DRAM, the fresh ones queue for NVMe.
            let fresh: Vec<u64> = (100..116).collect();
            assert!(put(&store, &fresh).iter().all(|&b| b));
            let wanted: Vec<_> = old[..4].iter().map(|&i| key(i)).collect();
            let slots = store.acquire(&wanted).unwrap();
            assert!(slots.iter().all(|s| s.is_some()), "{slots:?}");
            store.release(&wanted);
            let cancelled = store.stats().counters.cancelled_writes;
            if cancel {
                assert!((1..=4).contains(&cancelled), "engine {engine:?}: {cancelled} writes cancelled");
            } else {
                assert_eq!(cancelled, 0);
            }
            assert!(get_checked(&store, &old[..4]).iter().all(|&h| h));
            // Stored after the cancellations: their entries go where the cancelled ones were planned
            // (no hole in the open region, which a restart scans up to its first invalid entry).
            let later: Vec<u64> = (200..204).collect();
            assert!(put(&store, &later).iter().all(|&b| b));
            store.flush().unwrap();
            let missed = |hits: Vec<bool>| hits.iter().filter(|&&h| !h).count() as u64;
            assert_eq!(missed(get_checked(&store, &fresh)), cancelled, "engine {engine:?}");
            store.check_invariants();
            drop(store);
            // What reached NVMe is all a restart finds: the cancelled entries are holes in their region.
            let store = Store::open(cfg).unwrap();
            assert_eq!(missed(get_checked(&store, &fresh)), cancelled, "engine {engine:?}, after a restart");
            assert!(get_checked(&store, &old).iter().all(|&h| h));
            assert!(get_checked(&store, &later).iter().all(|&h| h), "engine {engine:?}: a flushed block was lost");
            store.check_invariants();
        }
    }
}

/// Blocks in DRAM that the engine has pinned for a pending load (prepare_load) stay there while new
/// stores arrive before the load: a store never evicts a block a pending load pinned (it takes an
/// unpinned victim, or waits for one, or is dropped and counted), so the load copies from DRAM
/// instead of reading NVMe again. A load may still evict such a block, which keeps long requests
/// loadable round by round.
#[test]
fn stores_do_not_evict_the_blocks_of_a_pending_load() {
    for engine in engines() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path(), engine, 64 * 1024);
        cfg.max_write_inflight_bytes = cfg.slot_bytes();
        cfg.slot_wait_ms = 30_000;
        cfg.fault_plan =
            Some(std::sync::Arc::new(kvtier_core::testing::FaultPlan { delay_ms: 20, ..Default::default() }));
        let store = Store::open(cfg).unwrap();
        let ids: Vec<u64> = (0..16).collect();
        assert!(put(&store, &ids).iter().all(|&b| b));
        store.flush().unwrap();
        let wanted: Vec<u64> = (0..8).collect();
        let keys: Vec<_> = wanted.iter().map(|&i| key(i)).collect();
        assert_eq!(store.pin_prefix(&keys), vec![true; 8], "the engine pins the request at prepare_load");
        // New blocks arrive before the load: the first 8 take the unpinned slots and wait for their
        // (slow) NVMe writes; the next 4 find only pinned blocks and blocks being written.
        let fresh: Vec<u64> = (100..112).collect();
        assert!(put(&store, &fresh).iter().all(|&b| b), "the stores wait for written victims");
        let before = store.stats().counters;
        assert!(get_checked(&store, &wanted).iter().all(|&h| h));
        let after = store.stats().counters;
        assert_eq!(after.nvme_hits - before.nvme_hits, 0, "engine {engine:?}: stores evicted the pinned blocks");
        assert_eq!(after.dram_hits - before.dram_hits, 8);
        store.unpin(&keys);
        store.check_invariants();
    }
}
