//! The fault matrix through the host service: storage faults injected under the service's store
//! (`StoreConfig::fault_plan`, the same seam as `tests/faults.rs`) while a TP=2 engine's ranks store
//! and load their slices over the socket. For every fault kind:
//! - no rank is ever handed wrong bytes: every slice a load returns is the one its rank stored;
//! - a faulty block is a miss for both ranks, counted (`io_errors` for EIO, `checksum_failures` for
//!   bit flips and torn writes), and every miss is a counted fault;
//! - nothing hangs (every scenario under a watchdog), and the service keeps serving afterwards.

mod common;
use common::*;

use kvtier_core::service::{Client, Service, ServiceConfig};
use kvtier_core::testing::FaultPlan;
use kvtier_core::{BlockBuffer, BlockKey, StoreConfig};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const SLICE: usize = 8192;
const TP: u32 = 2;
const BLOCKS: u64 = 60;
const WATCHDOG: Duration = Duration::from_secs(120);
/// A pool of 16 blocks: most blocks live on NVMe only, so loads read the (faulty) disk.
const SMALL_POOL: usize = 16;
/// A pool that holds every block: storing the clean copies never meets backpressure (these tests
/// run in parallel on two cores, where NVMe writes can fall behind a small pool).
const WHOLE_POOL: usize = 2 * BLOCKS as usize;

/// A service on `dir` with a pool of `slots` blocks.
fn start(dir: &Path, slots: usize, plan: Option<Arc<FaultPlan>>) -> (Service, std::path::PathBuf) {
    let mut store = StoreConfig::new(dir.join("store"), 1);
    store.dram_bytes = slots * (TP as usize * SLICE + 4096);
    store.nvme_bytes = 8 << 20;
    store.region_bytes = 1 << 20;
    store.slot_wait_ms = 2000;
    store.fault_plan = plan;
    let socket = dir.join("run").join("kvtier.sock");
    let mut config = ServiceConfig::new(&socket, store);
    config.pool_dir = dir.to_path_buf();
    config.fill_timeout_ms = 5_000;
    (Service::start(config).unwrap(), socket)
}

fn rank_client(socket: &Path, rank: u32) -> Client {
    let mut c = Client::connect(socket, Duration::from_secs(30)).unwrap();
    c.hello(b"service-faults/model", TP, rank, SLICE).unwrap();
    c
}

/// Rank `rank`'s slice of block `i`.
fn slice(i: u64, rank: u32) -> Vec<u8> {
    value(i * u64::from(TP) + u64::from(rank), SLICE)
}

fn keys(ids: &[u64]) -> Vec<BlockKey> {
    ids.iter().map(|&i| key(i)).collect()
}

/// Both ranks store `ids` at once, as an engine's ranks do; returns each rank's accepted flags.
fn store_all(socket: &Path, ids: &[u64]) -> Vec<Vec<bool>> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..TP)
            .map(|rank| {
                scope.spawn(move || {
                    let mut c = rank_client(socket, rank);
                    let values: Vec<Vec<u8>> = ids.iter().map(|&i| slice(i, rank)).collect();
                    let bufs: Vec<BlockBuffer> =
                        values.iter().map(|v| BlockBuffer::single(v.as_ptr() as *mut u8, v.len())).collect();
                    // SAFETY: `values` outlives the call.
                    unsafe { c.store_blocks(&keys(ids), &bufs).unwrap() }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Both ranks load `ids` at once; each returned slice is checked byte for byte against what its
/// rank stored. Returns per block whether both ranks got it.
fn load_all_checked(socket: &Path, ids: &[u64]) -> Vec<bool> {
    let per_rank: Vec<Vec<bool>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..TP)
            .map(|rank| {
                scope.spawn(move || {
                    let mut c = rank_client(socket, rank);
                    let mut out: Vec<Vec<u8>> = ids.iter().map(|_| vec![0xEE; SLICE]).collect();
                    let bufs: Vec<BlockBuffer> =
                        out.iter_mut().map(|v| BlockBuffer::single(v.as_mut_ptr(), v.len())).collect();
                    // SAFETY: `out` outlives the call and nothing else touches it.
                    let found = unsafe { c.load_blocks(&keys(ids), &bufs).unwrap() };
                    for ((&i, &hit), got) in ids.iter().zip(&found).zip(&out) {
                        if hit {
                            assert!(got == &slice(i, rank), "rank {rank} was handed wrong bytes for block {i}");
                        }
                    }
                    found
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    (0..ids.len()).map(|b| per_rank.iter().all(|found| found[b])).collect()
}

fn stats(socket: &Path) -> HashMap<String, u64> {
    rank_client(socket, 0).stats().unwrap().into_iter().collect()
}

fn watchdog<T: Send + 'static>(what: &'static str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::spawn(move || {
        let r = f();
        let _ = tx.send(());
        r
    });
    match rx.recv_timeout(WATCHDOG) {
        Ok(()) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match handle.join() {
            Ok(r) => r,
            Err(p) => std::panic::resume_unwind(p),
        },
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("{what}: no result after {WATCHDOG:?} (hang)"),
    }
}

/// New blocks still go in and come back whole after the faults: without faults every block both
/// ranks stored is served (a store may be refused by backpressure; these tests share two cores);
/// with read faults firing, some are. `first_id` must be new to the store: a block that an earlier
/// faulty phase wrote torn is "present" (its copy is checked when read, then missed), so reusing
/// its id would count that correct miss as a lost store.
fn still_serving(socket: &Path, faults_active: bool, first_id: u64) {
    let fresh: Vec<u64> = (first_id..first_id + 20).collect();
    let accepted = store_all(socket, &fresh);
    rank_client(socket, 0).flush().unwrap();
    let hits = load_all_checked(socket, &fresh);
    let stored: Vec<bool> = (0..fresh.len()).map(|b| accepted.iter().all(|flags| flags[b])).collect();
    assert!(stored.iter().any(|&s| s), "the service refused every new block");
    if faults_active {
        assert!(hits.iter().any(|&h| h), "no fresh block served after the faults");
    } else {
        assert!(stored.iter().zip(&hits).all(|(&s, &h)| !s || h), "stored {stored:?}, served {hits:?}");
    }
}

/// Blocks stored cleanly, then loaded by both ranks through a service whose reads are faulty.
fn read_faults(kind: &'static str, plan: FaultPlan) {
    watchdog(kind, move || {
        let dir = tempfile::tempdir().unwrap();
        let ids: Vec<u64> = (0..BLOCKS).collect();
        let (mut service, socket) = start(dir.path(), WHOLE_POOL, None);
        assert!(store_all(&socket, &ids).iter().flatten().all(|&ok| ok));
        rank_client(&socket, 0).flush().unwrap();
        service.stop().unwrap();

        let plan = Arc::new(plan);
        let (mut service, socket) = start(dir.path(), SMALL_POOL, Some(Arc::clone(&plan)));
        let hits = load_all_checked(&socket, &ids);
        let s = stats(&socket);
        let missed = hits.iter().filter(|&&h| !h).count() as u64;
        eprintln!("{kind}: {missed} of {BLOCKS} blocks missed, {s:?}");
        assert!(plan.injected.load(std::sync::atomic::Ordering::Relaxed) > 0, "{kind}: no fault fired");
        // A miss is a block whose NVMe read failed: counted, once (the other rank joined that read
        // or found the block gone).
        assert_eq!(missed, s["io_errors"] + s["checksum_failures"], "{kind}: uncounted misses");
        if kind == "short transfers" {
            assert_eq!(missed, 0, "a short transfer is resubmitted for the rest, never a miss");
        } else {
            assert!(missed > 0, "{kind}: faults fired but nothing missed");
        }
        still_serving(&socket, true, 10_000);
        service.stop().unwrap();

        // Read faults leave the disk intact: a clean service serves every block.
        let (mut service, socket) = start(dir.path(), SMALL_POOL, None);
        assert!(load_all_checked(&socket, &ids).iter().all(|&h| h), "{kind}: a read fault lost data on disk");
        service.stop().unwrap();
    });
}

/// Blocks stored through a service whose writes are faulty, then loaded after a clean restart.
fn write_faults(kind: &'static str, plan: FaultPlan) {
    watchdog(kind, move || {
        let dir = tempfile::tempdir().unwrap();
        let ids: Vec<u64> = (0..BLOCKS).collect();
        let plan = Arc::new(plan);
        let (mut service, socket) = start(dir.path(), SMALL_POOL, Some(Arc::clone(&plan)));
        store_all(&socket, &ids);
        let _ = rank_client(&socket, 0).flush();
        assert!(plan.injected.load(std::sync::atomic::Ordering::Relaxed) > 0, "{kind}: no fault fired");
        load_all_checked(&socket, &ids);
        still_serving(&socket, true, 10_000);
        service.stop().unwrap();

        // What the faulty writes left on disk is served whole or missed, never wrong.
        let (mut service, socket) = start(dir.path(), SMALL_POOL, None);
        let hits = load_all_checked(&socket, &ids);
        let s = stats(&socket);
        eprintln!(
            "{kind}: after a clean restart {} of {BLOCKS} blocks served, {s:?}",
            hits.iter().filter(|&&h| h).count()
        );
        assert!(hits.iter().any(|&h| h), "{kind}: nothing survived");
        still_serving(&socket, false, 20_000);
        service.stop().unwrap();
    });
}

#[test]
fn read_eio_through_the_service_is_a_counted_miss_for_both_ranks() {
    read_faults("read EIO", FaultPlan { read_eio_every: 7, ..FaultPlan::default() });
}

#[test]
fn read_bit_flips_through_the_service_are_checksum_misses() {
    read_faults("read bit flips", FaultPlan { read_bitflip_every: 5, ..FaultPlan::default() });
}

#[test]
fn short_transfers_through_the_service_are_completed() {
    read_faults("short transfers", FaultPlan { short_every: 3, ..FaultPlan::default() });
}

#[test]
fn write_eio_through_the_service_never_serves_wrong_bytes() {
    write_faults("write EIO", FaultPlan { write_eio_every: 6, ..FaultPlan::default() });
}

#[test]
fn torn_writes_through_the_service_never_serve_wrong_bytes() {
    write_faults("torn writes", FaultPlan { torn_write_every: 5, ..FaultPlan::default() });
}

/// A flush waits for the service's writes, not for a reply on an engine's path: one slower than the
/// connection's timeout (every NVMe write submission here delayed 250 ms, the connection's timeout
/// 100 ms) succeeds, and the connection stays usable. Before `FLUSH_REPLY_TIMEOUT` the flush failed
/// with EAGAIN and dropped the connection: an engine took a busy, healthy service for hung.
#[test]
fn a_flush_slower_than_the_connections_timeout_succeeds_and_keeps_the_connection() {
    watchdog("slow flush", || {
        let dir = tempfile::tempdir().unwrap();
        let plan = Arc::new(FaultPlan { delay_ms: 250, ..FaultPlan::default() });
        let (mut service, socket) = start(dir.path(), WHOLE_POOL, Some(Arc::clone(&plan)));
        let ids: Vec<u64> = (0..8).collect();
        assert!(store_all(&socket, &ids).iter().flatten().all(|&ok| ok));
        let timeout = Duration::from_millis(100);
        let mut client = Client::connect(&socket, timeout).unwrap();
        client.hello(b"service-faults/model", TP, 0, SLICE).unwrap();
        let started = std::time::Instant::now();
        client.flush().unwrap();
        assert!(started.elapsed() > timeout, "the flush did not wait on a delayed write: nothing tested");
        assert!(client.is_connected(), "a slow flush dropped the connection");
        assert!(client.stats().is_ok(), "the connection answers after the flush");
        assert!(plan.writes_seen.load(std::sync::atomic::Ordering::Relaxed) > 0);
        service.stop().unwrap();
    });
}
