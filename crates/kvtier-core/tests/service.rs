//! The host service over a real Unix socket and a real shared pool file: engines (here, clients in
//! threads of this process, each with its own connection) store and load their slices, and what a
//! connection holds is given back when it closes.

mod common;
use common::*;

use kvtier_core::service::{Client, Service, ServiceConfig};
use kvtier_core::{BlockBuffer, BlockKey, StoreConfig};
use std::path::Path;
use std::time::Duration;

const SLICE: usize = 8192;

/// A service over `dir` with a pool of 53 slots of one `SLICE` block each (two-rank blocks: 32).
fn config(dir: &Path, nvme_bytes: u64) -> ServiceConfig {
    let mut store = StoreConfig::new(dir.join("store"), 1);
    store.dram_bytes = 32 * (2 * SLICE + 4096);
    store.nvme_bytes = nvme_bytes;
    store.region_bytes = 1 << 20;
    let mut config = ServiceConfig::new(dir.join("run").join("kvtier.sock"), store);
    config.pool_dir = dir.to_path_buf();
    config
}

fn start(dir: &Path, nvme_bytes: u64) -> (Service, std::path::PathBuf) {
    let mut config = config(dir, nvme_bytes);
    config.fill_timeout_ms = 300;
    let socket = config.socket_path.clone();
    (Service::start(config).unwrap(), socket)
}

fn client(socket: &Path, tp: u32, rank: u32) -> Client {
    let mut c = Client::connect(socket, Duration::from_secs(10)).unwrap();
    c.hello(b"service-test/model/tp", tp, rank, SLICE).unwrap();
    c
}

fn store(c: &mut Client, keys: &[BlockKey], values: &[Vec<u8>]) -> Vec<bool> {
    let bufs: Vec<BlockBuffer> = values.iter().map(|v| BlockBuffer::single(v.as_ptr() as *mut u8, v.len())).collect();
    // SAFETY: the values outlive the call.
    unsafe { c.store_blocks(keys, &bufs).unwrap() }
}

fn load(c: &mut Client, keys: &[BlockKey]) -> (Vec<bool>, Vec<Vec<u8>>) {
    let mut out: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; SLICE]).collect();
    let bufs: Vec<BlockBuffer> = out.iter_mut().map(|v| BlockBuffer::single(v.as_mut_ptr(), v.len())).collect();
    // SAFETY: `out` outlives the call and nothing else touches it.
    let found = unsafe { c.load_blocks(keys, &bufs).unwrap() };
    (found, out)
}

#[test]
fn one_engine_stores_and_another_loads_from_the_shared_pool() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 0);
    let keys: Vec<BlockKey> = (0..8).map(key).collect();
    let values: Vec<Vec<u8>> = (0..8).map(|i| value(i, SLICE)).collect();
    let mut a = client(&socket, 1, 0);
    assert_eq!(store(&mut a, &keys, &values), vec![true; 8]);
    // Another engine (its own connection, its own mapping of the pool) sees them in DRAM.
    let mut b = client(&socket, 1, 0);
    assert_eq!(b.locate(&keys).unwrap(), vec![1; 8]);
    let (found, out) = load(&mut b, &keys);
    assert_eq!(found, vec![true; 8]);
    assert_eq!(out, values);
    let stats: std::collections::HashMap<String, u64> = b.stats().unwrap().into_iter().collect();
    assert_eq!(stats["dram_hits"], 8);
    assert_eq!(stats["bytes_read_nvme"], 0, "a DRAM-only store served from the pool, no NVMe read");
    drop((a, b));
    service.stop().unwrap();
}

#[test]
fn a_block_of_two_ranks_is_visible_only_once_both_committed() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 4 << 20);
    let keys = vec![key(1)];
    let (r0, r1) = (vec![value(10, SLICE)], vec![value(11, SLICE)]);
    let mut rank0 = client(&socket, 2, 0);
    let mut rank1 = client(&socket, 2, 1);
    assert_eq!(store(&mut rank0, &keys, &r0), vec![true]);
    assert_eq!(rank0.locate(&keys).unwrap(), vec![0], "half a block is not a block");
    assert_eq!(store(&mut rank1, &keys, &r1), vec![true]);
    assert_eq!(rank0.locate(&keys).unwrap(), vec![1]);
    // Each rank reads back its own slice.
    assert_eq!(load(&mut rank0, &keys).1, r0);
    assert_eq!(load(&mut rank1, &keys).1, r1);
    // Through NVMe after a restart of the service: the slices stay together and verified.
    rank0.flush().unwrap();
    drop((rank0, rank1));
    service.stop().unwrap();
    let (mut service, socket) = start(dir.path(), 4 << 20);
    let mut rank1 = client(&socket, 2, 1);
    assert_eq!(rank1.locate(&keys).unwrap(), vec![2]);
    let (found, out) = load(&mut rank1, &keys);
    assert_eq!((found, out), (vec![true], r1));
    drop(rank1);
    service.stop().unwrap();
}

/// Both ranks of a TP=2 engine load the same NVMe-only blocks at once (each copies its slice of the
/// one object): every block is read from disk once, the second rank copying from the slot the first
/// one's read fills. Each rank used to read every block itself.
#[test]
fn the_ranks_of_one_engine_read_each_nvme_block_once() {
    const BLOCKS: u64 = 24;
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<BlockKey> = (0..BLOCKS).map(key).collect();
    let slices: [Vec<Vec<u8>>; 2] =
        [(0..BLOCKS).map(|i| value(2 * i, SLICE)).collect(), (0..BLOCKS).map(|i| value(2 * i + 1, SLICE)).collect()];
    let (mut service, socket) = start(dir.path(), 8 << 20);
    // The ranks store at once, as an engine's do (a block is complete when both committed).
    std::thread::scope(|scope| {
        for (rank, slices) in slices.iter().enumerate() {
            let (keys, socket) = (&keys, &socket);
            scope.spawn(move || {
                let mut c = client(socket, 2, rank as u32);
                assert_eq!(store(&mut c, keys, slices), vec![true; BLOCKS as usize]);
            });
        }
    });
    let mut c = client(&socket, 2, 0);
    c.flush().unwrap();
    assert_eq!(c.locate(&keys).unwrap(), vec![1; BLOCKS as usize], "every block stored whole");
    drop(c);
    service.stop().unwrap();

    let (mut service, socket) = start(dir.path(), 8 << 20);
    let barrier = std::sync::Barrier::new(2);
    let loaded: Vec<Vec<Vec<u8>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2u32)
            .map(|rank| {
                let (keys, socket, barrier) = (&keys, &socket, &barrier);
                scope.spawn(move || {
                    let mut c = client(socket, 2, rank);
                    barrier.wait();
                    let (found, out) = load(&mut c, keys);
                    assert!(found.iter().all(|&ok| ok), "rank {rank}: {found:?}");
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(loaded[0] == slices[0] && loaded[1] == slices[1], "each rank got its own slices");
    let mut c = client(&socket, 2, 0);
    let stats: std::collections::HashMap<String, u64> = c.stats().unwrap().into_iter().collect();
    assert_eq!(stats["nvme_hits"], BLOCKS, "each block read from NVMe once: {stats:?}");
    assert_eq!(stats["dram_hits"], BLOCKS, "the other rank copied from the pool");
    drop(c);
    service.stop().unwrap();
}

#[test]
fn a_rank_that_dies_mid_store_leaves_nothing_half_written() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 0);
    let keys = vec![key(5)];
    let mut rank0 = client(&socket, 2, 0);
    assert_eq!(store(&mut rank0, &keys, &[value(50, SLICE)]), vec![true]);
    // Rank 1 never comes: after the fill timeout the slot is given back and the block stays absent.
    std::thread::sleep(Duration::from_millis(1200));
    let stats: std::collections::HashMap<String, u64> = rank0.stats().unwrap().into_iter().collect();
    assert_eq!(stats["service_pending_fills"], 0);
    assert_eq!(rank0.locate(&keys).unwrap(), vec![0]);
    // A rank that reserved and then disconnected: its reservation ends with its connection, and a
    // new pair of ranks stores the block cleanly afterwards.
    {
        use kvtier_core::testing::wire::{read_frame, write_frame, Op, Writer, PROTOCOL_VERSION};
        let mut raw = std::os::unix::net::UnixStream::connect(&socket).unwrap();
        let mut hello = Writer::new(Op::Hello as u8);
        hello.u16(PROTOCOL_VERSION).u32(2).u32(1).u64(SLICE as u64).bytes(b"service-test/model/tp");
        write_frame(&mut raw, &hello.0).unwrap();
        assert_eq!(read_frame(&mut raw).unwrap().unwrap()[0], 0);
        let mut reserve = Writer::new(Op::Reserve as u8);
        reserve.keys(&keys);
        write_frame(&mut raw, &reserve.0).unwrap();
        let reply = read_frame(&mut raw).unwrap().unwrap();
        assert_eq!(reply[1], 0, "rank 1 got a slot to fill");
        // ... and dies before copying or committing.
    }
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(rank0.locate(&keys).unwrap(), vec![0]);
    let mut rank1 = client(&socket, 2, 1);
    assert_eq!(store(&mut rank0, &keys, &[value(50, SLICE)]), vec![true]);
    assert_eq!(store(&mut rank1, &keys, &[value(51, SLICE)]), vec![true]);
    assert_eq!(rank0.locate(&keys).unwrap(), vec![1]);
    drop((rank0, rank1));
    service.stop().unwrap();
}

#[test]
fn pins_end_with_the_connection_that_took_them() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 0);
    let pinned: Vec<BlockKey> = (100..104).map(key).collect();
    let mut a = client(&socket, 1, 0);
    let values: Vec<Vec<u8>> = (100..104).map(|i| value(i, SLICE)).collect();
    store(&mut a, &pinned, &values);
    let mut holder = client(&socket, 1, 0);
    assert_eq!(holder.pin(&pinned).unwrap(), vec![true; 4]);
    // A connection cannot release pins it does not hold.
    a.unpin(&pinned).unwrap();
    let fill = |c: &mut Client, from: u64| {
        let keys: Vec<BlockKey> = (from..from + 40).map(key).collect();
        let values: Vec<Vec<u8>> = (from..from + 40).map(|i| value(i, SLICE)).collect();
        store(c, &keys, &values);
    };
    fill(&mut a, 1000);
    assert_eq!(a.locate(&pinned).unwrap(), vec![1; 4], "pinned blocks survive a DRAM full of newer ones");
    drop(holder); // the engine dies: its pins go with its socket
    std::thread::sleep(Duration::from_millis(100));
    fill(&mut a, 2000);
    assert_eq!(a.locate(&pinned).unwrap(), vec![0; 4], "evictable once their holder is gone (DRAM only)");
    drop(a);
    service.stop().unwrap();
}

#[test]
fn a_second_service_on_a_live_socket_is_refused_and_a_stale_socket_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 0);
    let mut config = ServiceConfig::new(&socket, StoreConfig::new(dir.path().join("other"), 1));
    config.pool_dir = dir.path().to_path_buf();
    let err = Service::start(config.clone()).err().expect("a live service owns the socket");
    assert!(err.to_string().contains("already serves"), "{err}");
    service.stop().unwrap();
    std::os::unix::net::UnixListener::bind(&socket).unwrap(); // a stale socket nobody answers on
    let mut again = Service::start(config).unwrap();
    again.stop().unwrap();
}

#[test]
fn the_socket_its_directory_and_the_pool_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 0);
    let c = client(&socket, 1, 0);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&socket), 0o600);
    assert_eq!(mode(socket.parent().unwrap()), 0o700);
    let pool_path = c.attached().unwrap().pool_path.clone();
    assert_eq!(mode(&pool_path), 0o600);
    drop(c);
    service.stop().unwrap();
    assert!(!pool_path.exists(), "a stopped service leaves no pool holding tmpfs memory");
}

/// A pool that does not fit its tmpfs is refused when the namespace opens, with the fix named
/// (not a SIGBUS at the first page fault later). Needs a small tmpfs: skipped where mounting fails.
#[test]
fn a_pool_larger_than_its_tmpfs_is_refused_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let tmpfs = dir.path().join("small-shm");
    std::fs::create_dir(&tmpfs).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs", tmpfs.to_str().unwrap()])
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        eprintln!("skipped: cannot mount a tmpfs here (needs root)");
        return;
    }
    let mut store = StoreConfig::new(dir.path().join("store"), 1);
    store.dram_bytes = 8 << 20;
    store.nvme_bytes = 0;
    let socket = dir.path().join("run").join("kvtier.sock");
    let mut config = ServiceConfig::new(&socket, store);
    config.pool_dir = tmpfs.clone();
    let mut service = Service::start(config).unwrap();
    let mut c = Client::connect(&socket, Duration::from_secs(10)).unwrap();
    let err = c.hello(b"too-big", 1, 0, SLICE).expect_err("an 8 MiB pool does not fit 1 MiB");
    assert!(err.to_string().contains("--shm-size"), "{err}");
    drop(c);
    service.stop().unwrap();
    let _ = std::process::Command::new("umount").arg(&tmpfs).status();
}

#[test]
fn a_socket_directory_others_can_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let config = ServiceConfig::new(open.join("kvtier.sock"), StoreConfig::new(dir.path().join("store"), 1));
    let err = Service::start(config).err().expect("a world-writable socket directory");
    assert!(err.to_string().contains("closed to writes by others"), "{err}");
}

/// Rank 0 gives a block up for want of room in the NVMe backlog; rank 1, coming later when there
/// is room, must give it up too rather than fill a slot that rank 0 will never complete (such an
/// orphan held a slot and backlog room until the fill timeout, and starved the blocks after it).
#[test]
fn a_block_one_rank_gave_up_is_given_up_by_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let mut store_config = StoreConfig::new(dir.path().join("store"), 1);
    store_config.dram_bytes = 4 * (2 * SLICE + 4096); // 4 slots: room for 2 blocks in the NVMe backlog
    store_config.nvme_bytes = 4 << 20;
    store_config.region_bytes = 1 << 20;
    store_config.slot_wait_ms = 200;
    store_config.staging_slots = 2;
    let socket = dir.path().join("run").join("kvtier.sock");
    let mut config = ServiceConfig::new(&socket, store_config);
    config.pool_dir = dir.path().to_path_buf();
    let mut service = Service::start(config).unwrap();
    let keys: Vec<BlockKey> = (0..3).map(key).collect();
    let halves: Vec<Vec<u8>> = (0..3).map(|i| value(i, SLICE)).collect();
    let mut rank0 = client(&socket, 2, 0);
    let mut rank1 = client(&socket, 2, 1);
    // Rank 0 alone: two blocks wait for rank 1's slices and fill the backlog, the third is given up.
    assert_eq!(store(&mut rank0, &keys, &halves), vec![true, true, false]);
    assert_eq!(store(&mut rank1, &keys, &halves), vec![true, true, false]);
    let stats: std::collections::HashMap<String, u64> = rank0.stats().unwrap().into_iter().collect();
    assert_eq!(stats["service_pending_fills"], 0, "no slot left waiting for a rank that will never come");
    assert_eq!(rank0.locate(&keys).unwrap(), vec![1, 1, 0]);
    drop((rank0, rank1));
    service.stop().unwrap();
}

#[test]
fn stopping_with_half_committed_blocks_gives_their_slots_back_and_stops_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut store_config = StoreConfig::new(dir.path().join("store"), 1);
    store_config.nvme_bytes = 4 << 20;
    store_config.region_bytes = 1 << 20;
    let socket = dir.path().join("run").join("kvtier.sock");
    let mut config = ServiceConfig::new(&socket, store_config);
    config.pool_dir = dir.path().to_path_buf();
    config.fill_timeout_ms = 600_000; // the janitor must not be what gives the slot back
    let mut service = Service::start(config).unwrap();
    let mut rank0 = client(&socket, 2, 0);
    assert_eq!(store(&mut rank0, &[key(9)], &[value(9, SLICE)]), vec![true]); // rank 1 never comes
    drop(rank0);
    let started = std::time::Instant::now();
    service.stop().unwrap();
    assert!(started.elapsed() < Duration::from_secs(10), "stop waited {:?} on an unfilled slot", started.elapsed());
}

/// A load of more blocks than a quarter of the pool, read back from NVMe after a restart, copied by
/// several threads: every block arrives whole, in its own buffer (the client asks in rounds, so a
/// round's reads do not evict the blocks the same load read before).
#[test]
fn a_large_load_from_nvme_in_rounds_and_on_several_threads_is_exact() {
    const BIG_SLICE: usize = 1 << 20;
    const BLOCKS: u64 = 48;
    let dir = tempfile::tempdir().unwrap();
    let open = || {
        let mut store = StoreConfig::new(dir.path().join("store"), 1);
        store.dram_bytes = 64 * (BIG_SLICE + 4096); // 64 slots: the load needs 48 of them
        store.nvme_bytes = 128 << 20;
        store.region_bytes = 8 << 20;
        let mut config = ServiceConfig::new(dir.path().join("run").join("kvtier.sock"), store);
        config.pool_dir = dir.path().to_path_buf();
        Service::start(config).unwrap()
    };
    let socket = dir.path().join("run").join("kvtier.sock");
    let hello = |c: &mut Client| {
        c.hello(b"service-test/big", 1, 0, BIG_SLICE).unwrap();
    };
    let keys: Vec<BlockKey> = (0..BLOCKS).map(key).collect();
    let values: Vec<Vec<u8>> = (0..BLOCKS).map(|i| value(i, BIG_SLICE)).collect();
    let mut service = open();
    let mut writer = Client::connect(&socket, Duration::from_secs(30)).unwrap();
    hello(&mut writer);
    assert_eq!(store(&mut writer, &keys, &values), vec![true; BLOCKS as usize]);
    writer.flush().unwrap();
    drop(writer);
    service.stop().unwrap();

    let mut service = open();
    let mut reader = Client::connect(&socket, Duration::from_secs(30)).unwrap();
    hello(&mut reader);
    reader.set_copy_threads(4);
    assert_eq!(reader.locate(&keys).unwrap(), vec![2; BLOCKS as usize], "on NVMe only after the restart");
    let mut out: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; BIG_SLICE]).collect();
    // Each block in two segments, as a layer-major KV cache gives them.
    let bufs: Vec<BlockBuffer> = out
        .iter_mut()
        .map(|v| {
            let (a, b) = v.split_at_mut(BIG_SLICE / 2);
            BlockBuffer { segments: vec![(a.as_mut_ptr(), a.len()), (b.as_mut_ptr(), b.len())] }
        })
        .collect();
    // SAFETY: `out` outlives the call and nothing else touches it.
    let found = unsafe { reader.load_blocks(&keys, &bufs).unwrap() };
    assert_eq!(found, vec![true; BLOCKS as usize]);
    assert!(out == values, "every block loaded whole into its own buffer");
    drop(reader);
    service.stop().unwrap();
}

/// A prefetch brings NVMe blocks into the pool (verified): a later load is a DRAM hit, and an
/// absent key stays absent.
#[test]
fn a_prefetch_makes_nvme_blocks_resident_and_pins_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<BlockKey> = (0..6).map(key).collect();
    let values: Vec<Vec<u8>> = (0..6).map(|i| value(i, SLICE)).collect();
    let (mut service, socket) = start(dir.path(), 4 << 20);
    let mut writer = client(&socket, 1, 0);
    assert_eq!(store(&mut writer, &keys, &values), vec![true; 6]);
    writer.flush().unwrap();
    drop(writer);
    service.stop().unwrap();

    let (mut service, socket) = start(dir.path(), 4 << 20);
    let mut scheduler = client(&socket, 1, 0);
    assert_eq!(scheduler.locate(&keys).unwrap(), vec![2; 6]);
    let mut asked = keys[..4].to_vec();
    asked.push(key(99));
    assert_eq!(scheduler.prefetch(&asked).unwrap(), vec![true, true, true, true, false]);
    assert_eq!(scheduler.locate(&keys).unwrap(), vec![1, 1, 1, 1, 2, 2]);
    let stats: std::collections::HashMap<String, u64> = scheduler.stats().unwrap().into_iter().collect();
    assert_eq!(stats["nvme_hits"], 4);
    let mut worker = client(&socket, 1, 0);
    let (found, out) = load(&mut worker, &keys[..4]);
    assert_eq!((found, out), (vec![true; 4], values[..4].to_vec()));
    let stats: std::collections::HashMap<String, u64> = worker.stats().unwrap().into_iter().collect();
    // Each block the load served is one hit, of the tier it came from: the prefetch's NVMe reads.
    assert_eq!(
        (stats["dram_hits"], stats["nvme_hits"], stats["read_ahead_hits"], stats["misses"]),
        (0, 4, 4, 0),
        "the load after the prefetch is a DRAM copy, counted once, at NVMe: {stats:?}"
    );
    let (found, _) = load(&mut worker, &keys[..2]);
    assert_eq!(found, vec![true; 2]);
    let stats: std::collections::HashMap<String, u64> = worker.stats().unwrap().into_iter().collect();
    assert_eq!((stats["dram_hits"], stats["read_ahead_hits"]), (2, 4), "a second load of a block is a DRAM hit");
    drop((scheduler, worker));
    service.stop().unwrap();
}

/// A prefetch of more blocks than half the pool reads only the first half pool: a longer one would
/// evict its own first blocks before the load copies them. Prefetch and load then read each block
/// from NVMe exactly once.
#[test]
fn a_prefetch_longer_than_half_the_pool_reads_each_block_once() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 8 << 20);
    let mut writer = Client::connect(&socket, Duration::from_secs(10)).unwrap();
    let slot_count = writer.hello(b"service-test/model/tp", 1, 0, SLICE).unwrap().slot_count;
    let blocks = (slot_count * 3 / 2) as u64;
    let keys: Vec<BlockKey> = (0..blocks).map(key).collect();
    let values: Vec<Vec<u8>> = (0..blocks).map(|i| value(i, SLICE)).collect();
    assert!(store(&mut writer, &keys, &values).iter().all(|&ok| ok));
    writer.flush().unwrap();
    drop(writer);
    service.stop().unwrap();

    let (mut service, socket) = start(dir.path(), 8 << 20);
    let mut scheduler = client(&socket, 1, 0);
    let prefetched = scheduler.prefetch(&keys).unwrap();
    let half = slot_count / 2;
    assert!(prefetched[..half].iter().all(|&ok| ok) && !prefetched[half..].iter().any(|&ok| ok), "{prefetched:?}");
    let mut worker = client(&socket, 1, 0);
    let (found, out) = load(&mut worker, &keys);
    assert!(found.iter().all(|&ok| ok));
    assert!(out == values);
    let stats: std::collections::HashMap<String, u64> = worker.stats().unwrap().into_iter().collect();
    assert_eq!(stats["nvme_hits"], blocks, "each block read from NVMe once: {stats:?}");
    assert_eq!(stats["read_ahead_hits"], half as u64, "the prefetched half served from DRAM: {stats:?}");
    assert_eq!(stats["dram_hits"], 0, "every block served once, counted at NVMe: {stats:?}");
    drop((scheduler, worker));
    service.stop().unwrap();
}

/// Under a host DRAM budget, the first model's pool gets its dram_bytes, the next one what is left,
/// and one more, with nothing left, is refused with the option to raise.
#[test]
fn namespaces_share_the_host_dram_budget_and_one_too_many_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let slot = SLICE + 4096;
    let mut store = StoreConfig::new(dir.path().join("store"), 1);
    store.dram_bytes = 32 * slot;
    store.nvme_bytes = 0;
    let socket = dir.path().join("run").join("kvtier.sock");
    let mut config = ServiceConfig::new(&socket, store);
    config.pool_dir = dir.path().to_path_buf();
    config.host_dram_bytes = (52 * slot) as u64;
    let mut service = Service::start(config).unwrap();
    let hello = |model: &[u8]| {
        let mut c = Client::connect(&socket, Duration::from_secs(10)).unwrap();
        let slots = c.hello(model, 1, 0, SLICE).map(|attached| attached.slot_count);
        (c, slots)
    };
    let (first, first_slots) = hello(b"model-one");
    let (second, second_slots) = hello(b"model-two");
    assert_eq!(first_slots.unwrap(), 32, "the first model gets its dram_bytes");
    let second_slots = second_slots.unwrap();
    assert!((8..=20).contains(&second_slots), "the second gets what is left: {second_slots} slots");
    let (_, third) = hello(b"model-three");
    let message = third.expect_err("no budget left").to_string();
    assert!(message.contains("host_dram_bytes"), "{message}");
    // The first model's engines reattach to their own pool as before.
    let (again, again_slots) = hello(b"model-one");
    assert_eq!(again_slots.unwrap(), 32);
    drop((first, second, again));
    service.stop().unwrap();
}

#[test]
fn namespaces_on_one_drive_share_its_nvme_write_budget_and_the_totals_count_it_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path(), 8 << 20);
    config.store.write_budget_nvme_bytes_per_day = 1 << 30;
    let socket = config.socket_path.clone();
    let mut service = Service::start(config).unwrap();
    let hello = |model: &[u8]| {
        let mut c = Client::connect(&socket, Duration::from_secs(10)).unwrap();
        c.hello(model, 1, 0, SLICE).unwrap();
        c
    };
    let (mut one, mut two) = (hello(b"model-one"), hello(b"model-two"));
    let stats = |c: &mut Client| -> std::collections::HashMap<String, u64> { c.stats().unwrap().into_iter().collect() };
    let mut operator = Client::connect(&socket, Duration::from_secs(10)).unwrap();
    let host = stats(&mut operator);
    assert_eq!(host["service_namespaces"], 2);
    assert_eq!(host["nvme_write_budget_bytes_per_day"], 1 << 30, "one drive, one budget, counted once");
    assert_eq!(stats(&mut one)["nvme_write_budget_bytes_per_day"], 1 << 30);
    assert_eq!(stats(&mut two)["nvme_write_budget_bytes_per_day"], 1 << 30, "each model sees the drive's budget");
    drop((one, two, operator));
    service.stop().unwrap();
}

/// A hello for a namespace another connection is still opening waits `open_wait_ms` at most, then its
/// connection is closed unanswered (the engine takes the service for unreachable, as when its own
/// wait runs out). Before, it waited for as long as the open: on a frozen filesystem every
/// reconnect's hello held a service thread and a connection slot for as long as the freeze, until
/// `max_connections` refused every client, operators' included.
#[test]
fn a_hello_waiting_on_another_connections_open_is_let_go_within_open_wait() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path(), 0);
    config.open_delay = Duration::from_secs(3);
    config.open_wait_ms = 300;
    let socket = config.socket_path.clone();
    let mut service = Service::start(config).unwrap();
    let opener = std::thread::spawn({
        let socket = socket.clone();
        move || client(&socket, 1, 0)
    });
    std::thread::sleep(Duration::from_millis(300)); // the opener's hello is in the open by now
    let mut late = Client::connect(&socket, Duration::from_secs(10)).unwrap();
    let started = std::time::Instant::now();
    let refused = late.hello(b"service-test/model/tp", 1, 0, SLICE).map(|_| ()).expect_err("the open is not done");
    let waited = started.elapsed();
    assert!(!late.is_connected(), "the connection is closed unanswered: {refused}");
    assert!(waited < Duration::from_secs(2), "the hello waited {waited:?} for another connection's open");
    let opened = opener.join().unwrap();
    let again = client(&socket, 1, 0); // once open, the namespace is attached at once
    drop((opened, again, late));
    service.stop().unwrap();
}

/// Namespaces opening at once under a host DRAM budget each count what the others were granted while
/// they open (the opens no longer wait in line on one lock): together they never take more than the
/// budget, and the one for which too little is left is refused.
#[test]
fn namespaces_opening_at_once_never_take_more_than_the_host_dram_budget() {
    let dir = tempfile::tempdir().unwrap();
    let slot = SLICE + 4096;
    let mut store = StoreConfig::new(dir.path().join("store"), 1);
    store.dram_bytes = 32 * slot;
    store.nvme_bytes = 4 << 20;
    store.region_bytes = 1 << 20;
    let socket = dir.path().join("run").join("kvtier.sock");
    let mut config = ServiceConfig::new(&socket, store);
    config.pool_dir = dir.path().to_path_buf();
    config.host_dram_bytes = (52 * slot) as u64;
    let mut service = Service::start(config).unwrap();
    let start = std::sync::Barrier::new(3);
    let granted: Vec<Option<usize>> = std::thread::scope(|scope| {
        let opens: Vec<_> = (0..3)
            .map(|model| {
                let (socket, start) = (&socket, &start);
                scope.spawn(move || {
                    let mut c = Client::connect(socket, Duration::from_secs(10)).unwrap();
                    start.wait();
                    let slots =
                        c.hello(format!("budget-model-{model}").as_bytes(), 1, 0, SLICE).ok().map(|a| a.slot_count);
                    (c, slots)
                })
            })
            .collect();
        opens.into_iter().map(|open| open.join().unwrap().1).collect()
    });
    let total: usize = granted.iter().flatten().sum();
    assert!(total <= 52, "the pools together took {total} slots of a 52-slot budget: {granted:?}");
    assert_eq!(granted.iter().filter(|g| g.is_none()).count(), 1, "one model is refused: {granted:?}");
    service.stop().unwrap();
}

/// Engines of two TP sizes in one namespace (a rank-independent object layout): the TP=2 ranks place
/// their halves of each of two "layers" interleaved, as vLLM's canonical pages put each rank's heads.
/// A TP=1 engine reads the whole object in that order, stores one the ranks read back, and a block
/// TP=2 is still filling is "present" for TP=1 (it never writes into another engine's fill).
#[test]
fn engines_of_two_tp_sizes_share_blocks_placed_by_runs() {
    use kvtier_core::service::PlacementRun;
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 0);
    let half = SLICE / 2;
    let ranks: Vec<Client> = (0..2)
        .map(|rank| {
            let mut c = client(&socket, 2, rank);
            let runs = (0..2)
                .map(|layer| PlacementRun {
                    slice_offset: layer * half,
                    object_offset: layer * SLICE + rank as usize * half,
                    len: half,
                })
                .collect();
            c.set_placement(runs).unwrap();
            c
        })
        .collect();
    let mut ranks: [Client; 2] = ranks.try_into().ok().unwrap();
    let mut whole = Client::connect(&socket, Duration::from_secs(10)).unwrap();
    whole.hello(b"service-test/model/tp", 1, 0, 2 * SLICE).unwrap();
    assert!(
        Client::connect(&socket, Duration::from_secs(10))
            .unwrap()
            .hello(b"service-test/model/tp", 1, 0, SLICE)
            .is_err(),
        "another object size in the same namespace is refused"
    );
    // Rank r's slice: its half of layer 0, then of layer 1.
    let slice = |rank: usize, seed: u8| -> Vec<u8> { (0..SLICE).map(|i| seed ^ (rank * 7 + i / half) as u8).collect() };
    let keys = [key(40)];
    for (rank, c) in ranks.iter_mut().enumerate() {
        assert_eq!(store(c, &keys, &[slice(rank, 1)]), vec![true]);
    }
    let mut object = vec![0u8; 2 * SLICE];
    let bufs = [BlockBuffer::single(object.as_mut_ptr(), object.len())];
    // SAFETY: `object` outlives the call.
    assert_eq!(unsafe { whole.load_blocks(&keys, &bufs).unwrap() }, vec![true]);
    let (r0, r1) = (slice(0, 1), slice(1, 1));
    let expected = [&r0[..half], &r1[..half], &r0[half..], &r1[half..]].concat();
    assert_eq!(object, expected, "the object is layer-major, the ranks' halves inside each layer");
    // TP=1 stores a block; each TP=2 rank reads back its heads of it.
    let stored: Vec<u8> = (0..2 * SLICE).map(|i| (i * 31 % 251) as u8).collect();
    assert_eq!(store(&mut whole, &[key(41)], std::slice::from_ref(&stored)), vec![true]);
    for (rank, c) in ranks.iter_mut().enumerate() {
        let (found, out) = load(c, &[key(41)]);
        assert_eq!(found, vec![true]);
        let expected =
            [&stored[rank * half..(rank + 1) * half], &stored[SLICE + rank * half..SLICE + (rank + 1) * half]].concat();
        assert_eq!(out[0], expected, "rank {rank} read other bytes than its heads");
    }
    // A block rank 0 of TP=2 is filling: present for TP=1, and complete (TP=2's bytes) once rank 1 commits.
    assert_eq!(store(&mut ranks[0], &[key(42)], &[slice(0, 9)]), vec![true]);
    assert_eq!(store(&mut whole, &[key(42)], std::slice::from_ref(&stored)), vec![true]);
    assert_eq!(whole.locate(&[key(42)]).unwrap(), vec![0], "TP=1 wrote into TP=2's fill");
    assert_eq!(store(&mut ranks[1], &[key(42)], &[slice(1, 9)]), vec![true]);
    let bufs = [BlockBuffer::single(object.as_mut_ptr(), object.len())];
    // SAFETY: as above.
    assert_eq!(unsafe { whole.load_blocks(&[key(42)], &bufs).unwrap() }, vec![true]);
    let (r0, r1) = (slice(0, 9), slice(1, 9));
    assert_eq!(object, [&r0[..half], &r1[..half], &r0[half..], &r1[half..]].concat());
    drop((ranks, whole));
    service.stop().unwrap();
}

/// The two-phase transfers a GPU worker uses (it copies with its DMA engine, not with the client):
/// reserve, copy at `pool address + object offset`, commit; acquire, copy out, release. What one
/// rank writes this way is what `load_blocks` of another engine reads, an aborted fill leaves the
/// block absent and reservable again, and a released block holds no pin.
#[test]
fn a_caller_that_copies_itself_stores_and_loads_through_reserve_and_acquire() {
    use kvtier_core::service::ReserveReply;
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 0);
    let keys: Vec<BlockKey> = (0..6).map(key).collect();
    let values: Vec<Vec<u8>> = (0..6).map(|i| value(i, SLICE)).collect();
    let mut gpu = client(&socket, 1, 0);
    let (address, bytes) = gpu.pool_span().unwrap();
    let copy_in = |offset: usize, v: &[u8]| {
        assert!(offset + v.len() <= bytes);
        // SAFETY: inside the mapping (checked above), and reserved for this connection's fill.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), (address + offset) as *mut u8, v.len()) }
    };
    let replies = gpu.reserve(&keys).unwrap();
    let offsets: Vec<usize> = replies
        .iter()
        .map(|r| match r {
            ReserveReply::Fill { object_offset } => *object_offset,
            other => panic!("a new block is a fill, got {other:?}"),
        })
        .collect();
    for (i, &at) in offsets.iter().enumerate().take(4) {
        copy_in(at, &values[i]);
    }
    assert_eq!(gpu.commit(&keys[..4]).unwrap(), vec![true; 4]);
    gpu.abort(&keys[4..]).unwrap();
    assert_eq!(gpu.reserve(&keys[..1]).unwrap(), vec![ReserveReply::Present]);

    let mut cpu = client(&socket, 1, 0);
    let (found, out) = load(&mut cpu, &keys);
    assert_eq!(found, vec![true, true, true, true, false, false], "aborted fills are misses");
    assert_eq!(out[..4], values[..4]);
    let again = gpu.reserve(&keys[4..]).unwrap();
    assert!(again.iter().all(|r| matches!(r, ReserveReply::Fill { .. })), "{again:?}");
    gpu.abort(&keys[4..]).unwrap();

    let acquired = gpu.acquire(&keys).unwrap();
    assert_eq!(acquired.iter().filter(|at| at.is_some()).count(), 4);
    for (i, at) in acquired.iter().enumerate().take(4) {
        let at = at.unwrap();
        // SAFETY: pinned by the acquire, inside the mapping.
        let got = unsafe { std::slice::from_raw_parts((address + at) as *const u8, SLICE) };
        assert_eq!(got, &values[i][..]);
    }
    // Held: a trim of everything skips all four as in use.
    let (_, namespaces) = cpu.namespaces().unwrap();
    let digest = namespaces[0].digest;
    let trimmed: std::collections::HashMap<String, u64> = cpu.trim(&digest, 0, 0).unwrap().into_iter().collect();
    assert_eq!(trimmed["skipped_in_use"], 4, "{trimmed:?}");
    gpu.release(&keys[..4]).unwrap();
    let trimmed: std::collections::HashMap<String, u64> = cpu.trim(&digest, 0, 0).unwrap().into_iter().collect();
    assert_eq!(trimmed["skipped_in_use"], 0, "released: {trimmed:?}");
    assert_eq!(cpu.locate(&keys[..4]).unwrap(), vec![0; 4], "trimmed once released");
    drop((gpu, cpu));
    service.stop().unwrap();
}

/// Per-engine counters: each connection names its engine (`set_label`); the namespace's `engines`
/// list what each engine looked up, loaded and stored, and what it reported of itself; unlabelled
/// connections stay out of it.
#[test]
fn labelled_connections_count_per_engine() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 0);
    let keys: Vec<BlockKey> = (0..4).map(key).collect();
    let mut a = client(&socket, 1, 0);
    a.set_label("engine-a").unwrap();
    let mut b = client(&socket, 1, 0);
    b.set_label("engine-b").unwrap();
    let mut anonymous = client(&socket, 1, 0);
    let values: Vec<Vec<u8>> = (0..3).map(|i| value(i, SLICE)).collect();
    assert_eq!(store(&mut a, &keys[..3], &values), vec![true; 3]);
    assert_eq!(a.locate(&keys).unwrap().iter().filter(|&&tier| tier == 0).count(), 1);
    let (found, _) = load(&mut b, &keys);
    assert_eq!(found, vec![true, true, true, false]);
    let (found, _) = load(&mut anonymous, &keys[..1]);
    assert_eq!(found, vec![true]);
    // What an engine counted itself while the service did not answer, reported afterwards.
    let report = |pairs: &[(&str, u64)]| pairs.iter().map(|(n, v)| (n.to_string(), *v)).collect::<Vec<_>>();
    a.report(&report(&[("failed_calls", 2), ("outages", 1), ("a_newer_count", 7)])).unwrap();
    a.report(&report(&[("failed_calls", 1), ("given_up_loads", 4)])).unwrap();
    anonymous.report(&report(&[("failed_calls", 100)])).unwrap();
    let (_, namespaces) = anonymous.namespaces().unwrap();
    let engines = anonymous.engines(&namespaces[0].digest).unwrap();
    let value = |label: &str, name: &str| -> u64 {
        let (_, pairs) = engines.iter().find(|(l, _)| l == label).expect("label listed");
        pairs.iter().find(|(n, _)| n == name).map(|(_, v)| *v).expect("counter listed")
    };
    assert_eq!(engines.iter().map(|(label, _)| label.as_str()).collect::<Vec<_>>(), vec!["engine-a", "engine-b"]);
    assert_eq!(value("engine-a", "stored_slices"), 3);
    assert_eq!(value("engine-a", "lookup_dram"), 3);
    assert_eq!(value("engine-a", "lookup_miss"), 1);
    assert_eq!(value("engine-a", "loaded_slices"), 0);
    assert_eq!(value("engine-b", "loaded_slices"), 3, "the anonymous load is not counted");
    assert_eq!(value("engine-b", "load_missed_slices"), 1);
    assert_eq!(value("engine-b", "stored_slices"), 0);
    assert_eq!((value("engine-a", "failed_calls"), value("engine-a", "outages")), (3, 1));
    assert_eq!((value("engine-a", "given_up_loads"), value("engine-a", "skipped_loads")), (4, 0));
    assert_eq!(value("engine-b", "failed_calls"), 0, "the anonymous report is not counted");
    let empty = a.set_label("").unwrap_err().to_string();
    assert!(empty.contains("1 to 128 bytes"), "{empty}");
    drop((a, b, anonymous));
    service.stop().unwrap();
}

fn start_idle(dir: &Path, nvme_bytes: u64, idle_timeout_ms: u64) -> (Service, std::path::PathBuf) {
    let mut config = config(dir, nvme_bytes);
    config.idle_timeout_ms = idle_timeout_ms;
    let socket = config.socket_path.clone();
    (Service::start(config).unwrap(), socket)
}

fn pool_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut found: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "pool"))
        .collect();
    found.sort();
    found
}

fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + limit;
    while std::time::Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    done()
}

#[test]
fn a_namespace_no_engine_holds_is_closed_after_the_idle_time_and_reopens_from_nvme() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start_idle(dir.path(), 4 << 20, 1_000);
    let keys: Vec<BlockKey> = (0..4).map(key).collect();
    let values: Vec<Vec<u8>> = (0..4).map(|i| value(i, SLICE)).collect();
    let mut a = client(&socket, 1, 0);
    assert_eq!(store(&mut a, &keys, &values), vec![true; 4]);
    a.flush().unwrap();
    std::thread::sleep(Duration::from_millis(1_500));
    assert_eq!(service.namespace_count(), 1, "an attached engine keeps its namespace open");
    assert_eq!(service.idle_ms(), 0);
    drop(a);
    assert!(wait_until(Duration::from_secs(10), || service.namespace_count() == 0), "the idle namespace stayed open");
    // The pool file goes once the namespace is closed (its store flushed), after it leaves the map.
    assert!(
        wait_until(Duration::from_secs(5), || pool_files(dir.path()).is_empty()),
        "the closed namespace's pool file was left: {:?}",
        pool_files(dir.path())
    );
    assert!(wait_until(Duration::from_secs(5), || service.idle_ms() >= 200));
    // The next engine reopens it; its blocks come back from NVMe.
    let mut b = client(&socket, 1, 0);
    assert_eq!(service.idle_ms(), 0);
    let (found, out) = load(&mut b, &keys);
    assert_eq!(found, vec![true; 4]);
    assert_eq!(out, values);
    drop(b);
    service.stop().unwrap();
    assert!(pool_files(dir.path()).is_empty());
}

#[test]
fn without_an_idle_time_a_namespace_stays_open_with_no_engine() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start_idle(dir.path(), 0, 0);
    drop(client(&socket, 1, 0));
    std::thread::sleep(Duration::from_millis(1_500));
    assert_eq!(service.namespace_count(), 1);
    assert_eq!(pool_files(dir.path()).len(), 1);
    assert_eq!(service.idle_ms(), 0, "a service holding a namespace is not idle");
    service.stop().unwrap();
}

#[test]
fn a_starting_service_removes_pool_files_and_sockets_of_dead_services_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let uid = rustix::process::geteuid().as_raw();
    // What a service killed with SIGKILL leaves: a pool file nobody holds, a socket nobody serves.
    let orphan = dir.path().join(format!("kvtier-{uid}-00000000000000aa-0123456789abcdef.pool"));
    std::fs::write(&orphan, vec![0u8; 4096]).unwrap();
    let an_hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
    std::fs::File::options().write(true).open(&orphan).unwrap().set_modified(an_hour_ago).unwrap();
    let foreign = dir.path().join("not-kvtier.pool");
    std::fs::write(&foreign, b"x").unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700)).unwrap();
    let dead_socket = run.join("dead.sock");
    drop(std::os::unix::net::UnixListener::bind(&dead_socket).unwrap());
    std::fs::write(run.join("dead.pid"), b"1\n").unwrap();
    // A live service of another store path, in the same directories: nothing of it is touched.
    let mut other_store = StoreConfig::new(dir.path().join("other-store"), 1);
    other_store.dram_bytes = 16 * (SLICE + 4096);
    let mut other_config = ServiceConfig::new(run.join("other.sock"), other_store);
    other_config.pool_dir = dir.path().to_path_buf();
    let mut other = Service::start(other_config).unwrap();
    let mut other_client = Client::connect(&run.join("other.sock"), Duration::from_secs(10)).unwrap();
    other_client.hello(b"another model", 1, 0, SLICE).unwrap();
    let live_pool = other_client.attached().unwrap().pool_path.clone();
    std::fs::File::options().write(true).open(&live_pool).unwrap().set_modified(an_hour_ago).unwrap();

    let (mut service, _socket) = start_idle(dir.path(), 0, 0);
    assert!(!orphan.exists(), "the orphan pool file is still there");
    assert!(!dead_socket.exists() && !run.join("dead.pid").exists(), "the dead service's socket is still there");
    assert!(foreign.exists(), "a file that is not a kvtier pool was removed");
    assert!(live_pool.exists(), "the pool of a live service was removed");
    assert!(run.join("other.sock").exists(), "the socket of a live service was removed");
    drop(other_client);
    other.stop().unwrap();
    service.stop().unwrap();
}

/// The socket, and the pool file name and size the test namespace gets there (a service started,
/// asked, and stopped again: no pool left).
fn namespace_pool(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf, usize) {
    let (mut service, socket) = start_idle(dir, 0, 0);
    let c = client(&socket, 1, 0);
    let attached = c.attached().unwrap();
    let (pool_path, pool_bytes) = (attached.pool_path.clone(), attached.pool_bytes);
    drop(c);
    service.stop().unwrap();
    (socket, pool_path, pool_bytes)
}

/// What a SIGKILL leaves of a service's pool: the file at its size, locked by nobody; named like the
/// namespace's pool `like` up to the random part.
fn leave_orphan_pool(like: &Path, pool_bytes: usize, random: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let name = like.file_name().unwrap().to_str().unwrap();
    let orphan = like.with_file_name(format!("{}{random}.pool", &name[..name.rfind('-').unwrap() + 1]));
    let file = std::fs::File::create(&orphan).unwrap();
    file.set_len(pool_bytes as u64).unwrap();
    file.set_permissions(std::fs::Permissions::from_mode(0o600)).unwrap();
    orphan
}

fn inode(path: &Path) -> u64 {
    std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(path).unwrap())
}

/// A client's mark on a pool it maps: an open-file-description read lock on byte 1 (docs/service.md).
fn mark_as_mapped(pool: &Path) -> std::fs::File {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::options().read(true).write(true).open(pool).unwrap();
    // SAFETY: all-zero is a valid flock; a valid fd.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    (lock.l_type, lock.l_whence, lock.l_start, lock.l_len) = (libc::F_RDLCK as i16, libc::SEEK_SET as i16, 1, 1);
    assert_eq!(unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &mut lock) }, 0);
    file
}

/// A service killed with SIGKILL and started again by its engines finds the pool its predecessor
/// left for the namespace: once no process holds it (no service, no client mapping it), the new
/// one takes it over (the same file, renamed) instead of allocating and zeroing another. While a
/// client of the dead service still maps it, a new pool is made and the old one left alone (a late
/// copy of that client's could land in it); the janitor's sweep or the stop removes it later.
#[test]
fn a_service_started_again_takes_over_its_predecessors_pool_once_no_client_maps_it() {
    let dir = tempfile::tempdir().unwrap();
    let (socket, like, pool_bytes) = namespace_pool(dir.path());

    let mapped = leave_orphan_pool(&like, pool_bytes, "00000000000000aa");
    let client_of_the_dead = mark_as_mapped(&mapped);
    let (mut service, _) = start_idle(dir.path(), 0, 0);
    let c = client(&socket, 1, 0);
    assert_ne!(inode(&c.attached().unwrap().pool_path), inode(&mapped), "a pool a client maps was taken over");
    drop(c);
    service.stop().unwrap();
    drop(client_of_the_dead);
    let _ = std::fs::remove_file(&mapped); // the stop's sweep removes it once 2 s old

    let orphan = leave_orphan_pool(&like, pool_bytes, "00000000000000bb");
    let orphan_inode = inode(&orphan);
    let (mut service, _) = start_idle(dir.path(), 0, 0);
    let c = client(&socket, 1, 0);
    let taken = c.attached().unwrap().pool_path.clone();
    assert_eq!(inode(&taken), orphan_inode, "the dead service's pool was not taken over");
    assert!(!orphan.exists(), "the pool taken over is still under its old name");
    assert_eq!(pool_files(dir.path()), vec![taken], "one pool, the one taken over");
    drop(c);
    service.stop().unwrap();
    assert!(pool_files(dir.path()).is_empty());
}

/// What a SIGKILL leaves of a running service's pool, with its blocks: the file's bytes as they are
/// now, in a file no process holds (named like the namespace's pool, as `leave_orphan_pool`).
fn leave_copy_of_pool(pool: &Path, random: &str) -> std::path::PathBuf {
    let bytes = std::fs::read(pool).unwrap();
    let orphan = leave_orphan_pool(pool, bytes.len(), random);
    std::fs::write(&orphan, &bytes).unwrap();
    orphan
}

/// The slot of `pool` (`slot_bytes` apart) whose descriptor names `key`.
fn slot_of(pool: &[u8], slot_bytes: usize, slot_count: usize, key: &BlockKey) -> usize {
    (0..slot_count).find(|&slot| pool[slot * slot_bytes + 16..slot * slot_bytes + 48] == key.0).unwrap()
}

/// A service SIGKILLed while engines had stored blocks in its pool, some of them promised to a
/// load (on vLLM's plain route a load that fails then stops the engine), is started again: it takes
/// the pool over and keeps what its resident marks and checksums vouch for, as DRAM hits. A slot
/// whose value changed (a copy under way at the kill) or that was not marked resident (a fill or
/// a read never finished, an evicted block) is free. Before: every slot was free, and each of these
/// loads missed.
#[test]
fn a_service_started_again_keeps_the_blocks_of_the_pool_it_took_over() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start_idle(dir.path(), 0, 0);
    let mut c = client(&socket, 1, 0);
    let keys: Vec<BlockKey> = (1..=6u8).map(|i| BlockKey([i; 32])).collect();
    let values: Vec<Vec<u8>> = (1..=6u8).map(|i| (0..SLICE).map(|at| (at as u8).wrapping_mul(i)).collect()).collect();
    assert!(store(&mut c, &keys, &values).iter().all(|&stored| stored));
    let attached = c.attached().unwrap().clone();
    let orphan = leave_copy_of_pool(&attached.pool_path, "00000000000000dd");
    let mut bytes = std::fs::read(&orphan).unwrap();
    let (slot_bytes, slot_count) = (attached.slot_bytes, attached.slot_count);
    let torn = slot_of(&bytes, slot_bytes, slot_count, &keys[4]) * slot_bytes + attached.value_offset + 100;
    bytes[torn] ^= 0xff;
    let unmarked = slot_count * slot_bytes + slot_of(&bytes, slot_bytes, slot_count, &keys[5]);
    assert_eq!(bytes[unmarked], 1, "a stored block's slot is not marked resident");
    bytes[unmarked] = 0;
    std::fs::write(&orphan, &bytes).unwrap();
    let orphan_inode = inode(&orphan);
    drop(c);
    service.stop().unwrap();

    let (mut service, _) = start_idle(dir.path(), 0, 0);
    let mut c = client(&socket, 1, 0);
    assert_eq!(inode(&c.attached().unwrap().pool_path), orphan_inode, "the pool was not taken over");
    let (found, out) = load(&mut c, &keys);
    assert_eq!(found, [true, true, true, true, false, false], "kept: the whole, marked blocks only");
    assert!(out[..4].iter().zip(&values).all(|(got, stored)| got == stored), "a kept block's bytes changed");
    let stats: std::collections::HashMap<String, u64> = c.stats().unwrap().into_iter().collect();
    assert_eq!((stats["recovered_dram_blocks"], stats["dram_hits"]), (4, 4));
    assert!(store(&mut c, &keys[4..], &values[4..]).iter().all(|&stored| stored), "the freed slots are not usable");
    assert_eq!(load(&mut c, &keys).0, [true; 6]);
    drop(c);
    service.stop().unwrap();
}

/// A block kept from a pool taken over that NVMe recovery did not find (accepted by the dead service,
/// its NVMe write not run yet) is written to NVMe as any put is under the default admission (`all`):
/// the next restart recovers it from there. Before, it waited for a reuse, and under `all` no reuse
/// ever wrote it: evicted from DRAM, it was gone.
#[test]
fn a_kept_pool_block_that_nvme_lacks_is_written_there() {
    kept_blocks_reach_nvme(0, 0);
}

/// The same with a write backlog of two blocks: two of the three kept blocks are written at the
/// open, the third waits for its first use, and is written then.
#[test]
fn a_kept_pool_block_past_the_write_backlog_is_written_at_its_first_use() {
    kept_blocks_reach_nvme(2, 0);
}

/// The same with slow writes, the blocks used at once, while the backlog is still full of the first
/// two: the third's write is refused again and it waits for its next use, which writes it. Before,
/// the refusal at its first use dropped its write for good.
#[test]
fn a_kept_pool_block_used_while_the_write_backlog_is_full_is_written_at_a_later_use() {
    kept_blocks_reach_nvme(2, 300);
}

/// Three blocks stored without NVMe, their pool taken over by a service with NVMe (a write backlog of
/// `backlog_blocks`, 0: the default; each NVMe operation delayed `write_delay_ms`, the blocks then
/// used once at once), each loaded once, then a restart: all three recovered from NVMe.
fn kept_blocks_reach_nvme(backlog_blocks: usize, write_delay_ms: u64) {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start_idle(dir.path(), 0, 0); // DRAM only: nothing reaches NVMe
    let mut c = client(&socket, 1, 0);
    let keys: Vec<BlockKey> = (1..=3u8).map(|i| BlockKey([i; 32])).collect();
    let values: Vec<Vec<u8>> = (1..=3u8).map(|i| vec![i; SLICE]).collect();
    assert!(store(&mut c, &keys, &values).iter().all(|&stored| stored));
    leave_copy_of_pool(&c.attached().unwrap().pool_path, "00000000000000ef");
    drop(c);
    service.stop().unwrap();

    let stats = |c: &mut Client| -> std::collections::HashMap<String, u64> { c.stats().unwrap().into_iter().collect() };
    let with_nvme = |write_delay_ms: u64| {
        let mut config = config(dir.path(), 4 << 20);
        config.store.max_dirty_bytes = backlog_blocks * (SLICE + 4096);
        if write_delay_ms > 0 {
            let plan = kvtier_core::testing::FaultPlan { delay_ms: write_delay_ms, ..Default::default() };
            config.store.fault_plan = Some(std::sync::Arc::new(plan));
        }
        Service::start(config).unwrap()
    };
    let mut service = with_nvme(write_delay_ms);
    let mut c = client(&socket, 1, 0);
    if write_delay_ms > 0 {
        assert_eq!(load(&mut c, &keys), (vec![true; 3], values.clone()), "used while the backlog is full");
    }
    c.flush().unwrap();
    let counts = ["recovered_blocks", "recovered_dram_blocks"].map(|name| stats(&mut c)[name]);
    assert_eq!(counts, [0, 3], "kept in DRAM, not on NVMe");
    let written_at_open = if backlog_blocks == 0 { 3 } else { backlog_blocks as u64 };
    assert!(stats(&mut c)["bytes_written_nvme"] >= written_at_open * SLICE as u64, "the kept blocks were not written");
    assert_eq!(load(&mut c, &keys), (vec![true; 3], values.clone()), "each block used once");
    c.flush().unwrap();
    drop(c);
    service.stop().unwrap();

    let mut service = with_nvme(0);
    let mut c = client(&socket, 1, 0);
    assert_eq!(stats(&mut c)["recovered_blocks"], 3, "the next start did not recover them from NVMe");
    assert_eq!(load(&mut c, &keys), (vec![true; 3], values));
    drop(c);
    service.stop().unwrap();
}

/// With an NVMe tier, a block kept from the pool taken over that NVMe recovery found too is the
/// same block in both tiers: its loads are DRAM hits again, not NVMe reads.
#[test]
fn a_kept_pool_block_that_nvme_recovered_too_is_a_dram_hit() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start_idle(dir.path(), 4 << 20, 0);
    let mut c = client(&socket, 1, 0);
    let keys: Vec<BlockKey> = (1..=3u8).map(|i| BlockKey([i; 32])).collect();
    let values: Vec<Vec<u8>> = (1..=3u8).map(|i| vec![i; SLICE]).collect();
    assert!(store(&mut c, &keys, &values).iter().all(|&stored| stored));
    c.flush().unwrap();
    leave_copy_of_pool(&c.attached().unwrap().pool_path, "00000000000000ee");
    drop(c);
    service.stop().unwrap();

    let (mut service, _) = start_idle(dir.path(), 4 << 20, 0);
    let mut c = client(&socket, 1, 0);
    let (found, out) = load(&mut c, &keys);
    assert_eq!((found, out), (vec![true; 3], values));
    let stats: std::collections::HashMap<String, u64> = c.stats().unwrap().into_iter().collect();
    let counts = ["recovered_blocks", "recovered_dram_blocks", "dram_hits", "nvme_hits"].map(|name| stats[name]);
    assert_eq!(counts, [3, 3, 3, 0], "recovered from NVMe, kept in DRAM, hit there");
    drop(c);
    service.stop().unwrap();
}

/// A predecessor's pool that no namespace took over (no engine of that model came back) goes when
/// the service stops: a service that exits before its first sweep would leave it to the next one,
/// which keeps it again at its start.
#[test]
fn a_stopping_service_removes_a_predecessors_pool_no_namespace_took_over() {
    let dir = tempfile::tempdir().unwrap();
    let (_, like, pool_bytes) = namespace_pool(dir.path());
    let orphan = leave_orphan_pool(&like, pool_bytes, "00000000000000cc");
    let three_s_ago = std::time::SystemTime::now() - Duration::from_secs(3);
    std::fs::File::options().write(true).open(&orphan).unwrap().set_modified(three_s_ago).unwrap();
    let (mut service, _) = start_idle(dir.path(), 0, 0);
    assert!(orphan.exists(), "the start removed a pool its namespace may take over");
    service.stop().unwrap();
    assert!(!orphan.exists(), "the predecessor's pool outlived the service that did not take it over");
}

#[test]
fn a_client_is_answered_while_another_namespace_opens() {
    // A pool large enough that opening it (fallocate, faulting it in) takes a while.
    let dir = tempfile::tempdir().unwrap();
    let pool_dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let mut store = StoreConfig::new(dir.path().join("store"), 1);
    store.dram_bytes = 1 << 30;
    let socket = dir.path().join("run").join("kvtier.sock");
    let mut config = ServiceConfig::new(&socket, store);
    config.pool_dir = pool_dir.path().to_path_buf();
    let mut service = Service::start(config).unwrap();
    let opener_socket = socket.clone();
    let opener = std::thread::spawn(move || {
        let started = std::time::Instant::now();
        let mut c = Client::connect(&opener_socket, Duration::from_secs(60)).unwrap();
        c.hello(b"a large pool", 1, 0, 1 << 20).unwrap();
        started.elapsed()
    });
    std::thread::sleep(Duration::from_millis(20));
    let (mut slowest, mut answered) = (Duration::ZERO, 0);
    while !opener.is_finished() {
        let started = std::time::Instant::now();
        let mut c = Client::connect(&socket, Duration::from_secs(60)).unwrap();
        c.stats().unwrap();
        slowest = slowest.max(started.elapsed());
        answered += 1;
        std::thread::sleep(Duration::from_millis(5));
    }
    let open_time = opener.join().unwrap();
    eprintln!("a namespace opened in {open_time:?}; {answered} Stats meanwhile, the slowest {slowest:?}");
    // Before: the first Stats waited for the whole open (the namespaces lock, and one populate call
    // holding the memory-map lock against the new connection thread's stack).
    assert!(
        answered >= 3 && slowest * 2 < open_time,
        "{answered} Stats answered, the slowest after {slowest:?}, while a namespace opened in {open_time:?}"
    );
    service.stop().unwrap();
}

// ---- issue 24: leases of live connections, panics, dropped keys, second hellos ----

/// A service whose store has 4 slots and room for 2 blocks in the NVMe write backlog.
/// A service whose pool holds `slots` blocks of TP=2 engines, over NVMe: a write backlog of half.
fn start_with_slots(dir: &Path, slot_wait_ms: u64, slots: usize) -> (Service, std::path::PathBuf) {
    let mut store = StoreConfig::new(dir.join("store"), 1);
    store.dram_bytes = slots * (2 * SLICE + 4096);
    store.nvme_bytes = 4 << 20;
    store.region_bytes = 1 << 20;
    store.slot_wait_ms = slot_wait_ms;
    store.staging_slots = 2;
    let socket = dir.join("run").join("kvtier.sock");
    let mut config = ServiceConfig::new(&socket, store);
    config.pool_dir = dir.to_path_buf();
    (Service::start(config).unwrap(), socket)
}

fn stats_of(c: &mut Client) -> std::collections::HashMap<String, u64> {
    c.stats().unwrap().into_iter().collect()
}

/// Copies `v` into the pool at `offset` as a worker's DMA would (the two-phase API).
fn copy_into_pool(c: &Client, offset: usize, v: &[u8]) {
    let (address, bytes) = c.pool_span().unwrap();
    assert!(offset + v.len() <= bytes);
    // SAFETY: inside the mapping (checked above).
    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), (address + offset) as *mut u8, v.len()) }
}

/// Issue 24 item 4. A TP rank reserves a backlog's worth of blocks and hangs (its connection stays
/// open). Past `reservation_timeout_ms` the fills are abandoned: the backlog is free again, so other
/// stores and a flush go on; when the hung rank wakes up, copies into its slots and commits, every
/// commit is refused and no block appears, and the blocks stored meanwhile are intact (the
/// abandoned slots were not reused under the late copies).
#[test]
fn a_hung_rank_s_reservations_expire_and_its_late_commit_is_refused() {
    use kvtier_core::service::ReserveReply;
    let dir = tempfile::tempdir().unwrap();
    let mut store_config = StoreConfig::new(dir.path().join("store"), 1);
    store_config.dram_bytes = 16 * (2 * SLICE + 4096); // 16 slots, a backlog of 8
    store_config.nvme_bytes = 4 << 20;
    store_config.region_bytes = 1 << 20;
    store_config.slot_wait_ms = 200;
    let socket = dir.path().join("run").join("kvtier.sock");
    let mut config = ServiceConfig::new(&socket, store_config);
    config.pool_dir = dir.path().to_path_buf();
    config.reservation_timeout_ms = 1_000;
    let mut service = Service::start(config).unwrap();
    let held: Vec<BlockKey> = (0..8).map(key).collect();
    // Two connections of the hung rank (as a GPU rank's store thread and its flush would be).
    let mut hung = [client(&socket, 2, 1), client(&socket, 2, 1)];
    let offsets: Vec<Vec<usize>> = hung
        .iter_mut()
        .zip(held.chunks(4))
        .map(|(c, keys)| {
            c.reserve(keys)
                .unwrap()
                .into_iter()
                .map(|r| match r {
                    ReserveReply::Fill { object_offset } => object_offset,
                    other => panic!("a fill, got {other:?}"),
                })
                .collect()
        })
        .collect();
    let (mut rank0, mut rank1) = (client(&socket, 2, 0), client(&socket, 2, 1));
    let fresh: Vec<BlockKey> = (100..104).map(key).collect();
    let halves: [Vec<Vec<u8>>; 2] =
        [(0..4).map(|i| value(200 + i, SLICE)).collect(), (0..4).map(|i| value(300 + i, SLICE)).collect()];
    let starved: Vec<BlockKey> = (90..92).map(key).collect();
    let starved_values = vec![value(90, SLICE); 2];
    assert_eq!(store(&mut rank0, &starved, &starved_values), vec![false; 2], "the hung rank holds the backlog");

    std::thread::sleep(Duration::from_millis(2_000)); // the deadline, and a janitor pass
    let stats = stats_of(&mut rank0);
    assert_eq!(stats["service_pending_fills"], 0, "{stats:?}");
    assert_eq!(stats["service_expired_fills"], 8);
    assert_eq!(stats["service_abandoned_slots"], 8, "kept out of use while the hung rank may copy");
    assert_eq!(rank0.reserve(&held).unwrap(), vec![ReserveReply::Dropped; 8], "given up by every rank");
    assert_eq!(store(&mut rank0, &fresh, &halves[0]), vec![true; 4], "the backlog is free again");
    assert_eq!(store(&mut rank1, &fresh, &halves[1]), vec![true; 4]);
    let started = std::time::Instant::now();
    rank0.flush().unwrap();
    assert!(started.elapsed() < Duration::from_secs(10), "flush waited {:?}", started.elapsed());

    // The hung rank wakes up: its copies land in its own (abandoned) slots, its commits are refused.
    for ((c, offsets), keys) in hung.iter_mut().zip(&offsets).zip(held.chunks(4)) {
        for &at in offsets {
            copy_into_pool(c, at, &vec![0xEE; SLICE]);
        }
        assert_eq!(c.commit(keys).unwrap(), vec![false; 4]);
    }
    assert_eq!(rank0.locate(&held).unwrap(), vec![0; 8], "no half-written block is visible");
    let stats = stats_of(&mut rank0);
    assert_eq!(stats["service_refused_commits"], 8);
    assert_eq!(stats["service_abandoned_slots"], 0, "freed once the last holder let go");
    assert_eq!(load(&mut rank0, &fresh), (vec![true; 4], halves[0].clone()));
    assert_eq!(load(&mut rank1, &fresh), (vec![true; 4], halves[1].clone()));
    drop((hung, rank0, rank1));
    service.stop().unwrap();
}

/// Issue 24 item 5. A request that panics in its connection thread is answered at once with an
/// error frame (not a timeout), and the pins, readers, reservations and connection slot the
/// connection held are given back. A Hello whose object size overflows is an error, not a panic.
#[test]
fn a_request_that_panics_is_answered_and_its_connection_s_holds_are_given_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut store_config = StoreConfig::new(dir.path().join("store"), 1);
    store_config.dram_bytes = 32 * (SLICE + 4096);
    store_config.nvme_bytes = 4 << 20;
    store_config.region_bytes = 1 << 20;
    let socket = dir.path().join("run").join("kvtier.sock");
    let mut config = ServiceConfig::new(&socket, store_config);
    config.pool_dir = dir.path().to_path_buf();
    config.panic_on_label = Some("boom".to_string());
    let mut service = Service::start(config).unwrap();
    let keys: Vec<BlockKey> = (0..4).map(key).collect();
    let values: Vec<Vec<u8>> = (0..4).map(|i| value(i, SLICE)).collect();
    let mut a = client(&socket, 1, 0);
    assert_eq!(store(&mut a, &keys, &values), vec![true; 4]);
    a.flush().unwrap();
    let mut victim = client(&socket, 1, 0);
    assert_eq!(victim.pin(&keys[..2]).unwrap(), vec![true; 2]);
    assert!(victim.acquire(&keys[2..]).unwrap().iter().all(Option::is_some));
    assert_eq!(victim.reserve(&[key(50), key(51)]).unwrap().len(), 2);
    let started = std::time::Instant::now();
    let err = victim.set_label("boom").unwrap_err().to_string();
    assert!(started.elapsed() < Duration::from_secs(5), "answered after {:?}", started.elapsed());
    assert!(err.contains("failed on this request") && err.contains("reconnect"), "{err}");
    assert!(victim.locate(&keys).is_err(), "the service closed the connection");

    let (_, namespaces) = a.namespaces().unwrap();
    let digest = namespaces[0].digest;
    let attached = |a: &mut Client| -> u64 {
        let (_, namespaces) = a.namespaces().unwrap();
        namespaces[0].values.iter().find(|(n, _)| n == "service_attached_connections").unwrap().1
    };
    assert!(wait_until(Duration::from_secs(5), || attached(&mut a) == 1), "the panicked connection detached");
    assert_eq!(stats_of(&mut a)["service_pending_fills"], 0, "its reservations were given back");
    let trimmed: std::collections::HashMap<String, u64> = a.trim(&digest, 0, 0).unwrap().into_iter().collect();
    assert_eq!(trimmed["skipped_in_use"], 0, "its pins and readers were given back: {trimmed:?}");
    let mut operator = Client::connect(&socket, Duration::from_secs(10)).unwrap();
    assert_eq!(stats_of(&mut operator)["service_connections"], 2, "its connection slot was given back");

    let mut huge = Client::connect(&socket, Duration::from_secs(10)).unwrap();
    let err = huge.hello(b"huge", 64, 0, 1 << 58).unwrap_err().to_string();
    assert!(err.contains("block object over"), "{err}");
    assert_eq!(store(&mut a, &[key(60)], &[value(60, SLICE)]), vec![true], "still serving");
    drop((a, victim, operator, huge));
    service.stop().unwrap();
}

/// Issue 24 item 6. With no time to wait for room (`slot_wait_ms` 0), rank 0 gets one block of a
/// batch and not the other; the one it could not take must be given up for every rank, so that
/// rank 1, finding room later, does not open a fill rank 0 will never commit.
#[test]
fn a_block_left_undecided_when_a_reserve_pass_times_out_is_given_up_by_every_rank() {
    use kvtier_core::service::ReserveReply;
    let dir = tempfile::tempdir().unwrap();
    // 16 slots, a backlog of 8.
    let (mut service, socket) = start_with_slots(dir.path(), 0, 16);
    let (a, b, x) = (key(1), key(2), key(3));
    let (mut other, mut another) = (client(&socket, 2, 0), client(&socket, 2, 0));
    let mut fills = other.reserve(&[x, key(4), key(5), key(6)]).unwrap();
    fills.extend(another.reserve(&[key(7), key(8), key(9)]).unwrap());
    assert!(fills.iter().all(|r| matches!(r, ReserveReply::Fill { .. })), "{fills:?}"); // all but one of the backlog
    let mut rank0 = client(&socket, 2, 0);
    let replies = rank0.reserve(&[a, b]).unwrap();
    assert!(matches!(replies[0], ReserveReply::Fill { .. }), "{replies:?}");
    assert_eq!(replies[1], ReserveReply::Dropped, "no room left for the second block");
    other.abort(&[x]).unwrap(); // room again
    let mut rank1 = client(&socket, 2, 1);
    let replies = rank1.reserve(&[a, b]).unwrap();
    assert!(matches!(replies[0], ReserveReply::Fill { .. }), "{replies:?}");
    assert_eq!(replies[1], ReserveReply::Dropped, "rank 0 gave it up: rank 1 must not open a fill of it");
    assert_eq!(rank0.commit(&[a]).unwrap(), vec![true]);
    assert_eq!(rank1.commit(&[a]).unwrap(), vec![true]);
    other.abort(&[key(4), key(5), key(6)]).unwrap();
    another.abort(&[key(7), key(8), key(9)]).unwrap();
    assert_eq!(stats_of(&mut rank0)["service_pending_fills"], 0, "no fill waits for a rank that never comes");
    assert_eq!(rank0.locate(&[a, b]).unwrap(), vec![1, 0]);
    drop((other, another, rank0, rank1));
    service.stop().unwrap();
}

/// Issue 24 item 7. A store the client gives up after a round with no progress (the service kept
/// answering "no room now") is counted as a dropped store, and given up by every rank.
#[test]
fn a_store_given_up_for_want_of_room_is_counted_and_given_up_by_every_rank() {
    use kvtier_core::service::ReserveReply;
    let dir = tempfile::tempdir().unwrap();
    // 16 slots, a backlog of 8.
    let (mut service, socket) = start_with_slots(dir.path(), 200, 16);
    let mut rank0 = client(&socket, 2, 0);
    let (mut other, mut another) = (client(&socket, 2, 0), client(&socket, 2, 0));
    assert!(matches!(rank0.reserve(&[key(9)]).unwrap()[0], ReserveReply::Fill { .. }));
    let mut fills = other.reserve(&[key(10), key(11), key(12), key(13)]).unwrap();
    fills.extend(another.reserve(&[key(14), key(15), key(16)]).unwrap());
    assert!(fills.iter().all(|r| matches!(r, ReserveReply::Fill { .. })), "{fills:?}"); // backlog full
    let (a, b) = (key(1), key(2));
    // Rank 0 holds a reservation, so the service answers "no room now" rather than waiting.
    assert_eq!(store(&mut rank0, &[a, b], &[value(1, SLICE), value(2, SLICE)]), vec![false, false]);
    let stats = stats_of(&mut rank0);
    assert_eq!(stats["dropped_stores"], 2, "the two stores given up are counted");
    assert_eq!(stats["service_capped_reserves"], 0, "the backlog said no room, not the connection's cap");
    other.abort(&[key(10)]).unwrap(); // room again
    let mut rank1 = client(&socket, 2, 1);
    assert_eq!(rank1.reserve(&[a, b]).unwrap(), vec![ReserveReply::Dropped; 2], "rank 0 gave them up");
    drop((rank0, other, another, rank1));
    service.stop().unwrap();
}

/// Issue 24 item 11. A second hello on one client used to map the new pool and unmap the old one
/// under the caller's views of it. Another namespace is refused (the mapping and the connection
/// stay); the same namespace keeps the mapping.
#[test]
fn a_second_hello_keeps_the_pool_mapped_or_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 0);
    let mut c = client(&socket, 1, 0);
    let span = c.pool_span().unwrap();
    let err = c.hello(b"another model", 1, 0, SLICE).unwrap_err().to_string();
    assert!(err.contains("open a new connection"), "{err}");
    assert_eq!(c.pool_span(), Some(span), "the first pool stays mapped");
    assert_eq!(store(&mut c, &[key(1)], &[value(1, SLICE)]), vec![true], "still attached to the first namespace");
    c.hello(b"service-test/model/tp", 1, 0, SLICE).unwrap();
    assert_eq!(c.pool_span(), Some(span), "the same pool is not mapped again");
    assert_eq!(load(&mut c, &[key(1)]), (vec![true], vec![value(1, SLICE)]));
    drop(c);
    service.stop().unwrap();
}

#[test]
fn the_change_log_reports_what_any_engine_stored_and_what_eviction_removed() {
    use kvtier_core::service::{TIER_DRAM, TIER_NVME};
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 0);
    let mut a = client(&socket, 1, 0);
    let mut follower = client(&socket, 1, 0);
    let first = follower.changes(0, 1000).unwrap();
    assert!(first.reset && first.changes.is_empty());
    let keys: Vec<BlockKey> = (0..4).map(key).collect();
    let values: Vec<Vec<u8>> = (0..4).map(|i| value(i, SLICE)).collect();
    assert_eq!(store(&mut a, &keys, &values), vec![true; 4]);
    std::thread::sleep(Duration::from_millis(600)); // the log is read from the store at most every 500 ms
    let added = follower.changes(first.next, 1000).unwrap();
    assert!(!added.reset);
    let mut stored: Vec<BlockKey> =
        added.changes.iter().filter(|c| !c.removed && c.tier == TIER_DRAM).map(|c| c.key).collect();
    stored.sort_by_key(|k| k.0);
    assert_eq!(stored, keys, "another engine's stores, as DRAM additions");
    assert!(added.changes.iter().all(|c| c.tier != TIER_NVME), "a DRAM-only store has no NVMe tier");
    // A pool of 53 slots: 80 more blocks evict some (DRAM only: gone); each one that went is a removal.
    let more: Vec<BlockKey> = (100..180).map(key).collect();
    let more_values: Vec<Vec<u8>> = (100..180).map(|i| value(i, SLICE)).collect();
    for (chunk, chunk_values) in more.chunks(8).zip(more_values.chunks(8)) {
        store(&mut a, chunk, chunk_values);
    }
    std::thread::sleep(Duration::from_millis(600));
    let later = follower.changes(added.next, 1000).unwrap();
    let all: Vec<BlockKey> = keys.iter().chain(&more).copied().collect();
    let here = a.locate(&all).unwrap();
    let mut reported: std::collections::HashSet<BlockKey> = stored.into_iter().collect();
    for change in &later.changes {
        assert_eq!(change.tier, TIER_DRAM);
        if change.removed {
            assert!(reported.remove(&change.key), "a removal of a block never reported");
        } else {
            assert!(reported.insert(change.key), "a block reported twice");
        }
    }
    let held: std::collections::HashSet<BlockKey> =
        all.iter().zip(&here).filter(|(_, &t)| t != 0).map(|(k, _)| *k).collect();
    assert!(held.len() < all.len(), "a 53-slot pool holds {} of {} blocks", held.len(), all.len());
    assert_eq!(reported, held, "the log's view and the store's agree");
    // A cursor from another log (a restarted service) is a reset to the current state.
    let again = follower.changes(1, 1000).unwrap();
    assert!(again.reset && again.changes.iter().all(|c| !c.removed));
    drop((a, follower));
    service.stop().unwrap();
}

#[test]
fn a_transfer_given_up_through_its_gate_copies_nothing_and_holds_nothing() {
    use kvtier_core::service::CopyGate;
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 0);
    let keys: Vec<BlockKey> = (0..4).map(key).collect();
    let values: Vec<Vec<u8>> = (0..4).map(|i| value(i, SLICE)).collect();
    let mut c = client(&socket, 1, 0);
    // A store given up before its copy: the reserved slots go back, nothing becomes visible.
    let cancelled = CopyGate::new();
    assert!(cancelled.cancel());
    let bufs: Vec<BlockBuffer> = values.iter().map(|v| BlockBuffer::single(v.as_ptr() as *mut u8, v.len())).collect();
    // SAFETY: the values outlive the call.
    let stored = unsafe { c.store_blocks_gated(&keys, &bufs, &cancelled).unwrap() };
    assert_eq!(stored, vec![false; 4]);
    assert_eq!(c.locate(&keys).unwrap(), vec![0; 4], "nothing of a given-up store is visible");
    assert_eq!(store(&mut c, &keys, &values), vec![true; 4], "its slots were given back: the same keys store");
    // A load given up: no byte lands in the destinations, and no pin stays behind.
    let mut out: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; SLICE]).collect();
    let dests: Vec<BlockBuffer> = out.iter_mut().map(|v| BlockBuffer::single(v.as_mut_ptr(), v.len())).collect();
    // SAFETY: `out` outlives the call and nothing else touches it.
    let found = unsafe { c.load_blocks_gated(&keys, &dests, &cancelled).unwrap() };
    assert_eq!(found, vec![false; 4]);
    assert!(out.iter().all(|v| v.iter().all(|&b| b == 0)));
    let gate = CopyGate::new();
    // SAFETY: as above.
    let found = unsafe { c.load_blocks_gated(&keys, &dests, &gate).unwrap() };
    assert_eq!((found, gate.rounds()), (vec![true; 4], 1));
    assert_eq!(out, values);
    // No pin stayed behind: a trim of every unpinned block takes them (DRAM only).
    let (_, namespaces) = c.namespaces().unwrap();
    c.trim(&namespaces[0].digest, 0, 0).unwrap();
    assert_eq!(c.locate(&keys).unwrap(), vec![0; 4]);
    drop(c);
    service.stop().unwrap();
}

#[test]
fn an_idle_client_sees_the_service_hang_up_without_a_call() {
    let dir = tempfile::tempdir().unwrap();
    let (mut service, socket) = start(dir.path(), 0);
    let mut idle = client(&socket, 1, 0);
    assert_eq!(idle.locate(&[key(1)]).unwrap(), vec![0]);
    assert!(!idle.peer_hung_up(), "a live service between calls");
    service.stop().unwrap();
    let started = std::time::Instant::now();
    while !idle.peer_hung_up() {
        assert!(started.elapsed() < Duration::from_secs(5), "the stopped service's hang-up was not seen");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(idle.is_connected(), "seeing the hang-up makes no call");
}
