//! The shared pool file's life and the service socket's, against other actors (issue 37, items 4
//! and 5, and the suspects of item 12): an operator request that outlives its namespace, a local
//! user who plants a file where the pool would go, two services started on one socket at once, and
//! connections that never copy. Real services, real sockets, real files in real directories.

mod common;
use common::{key, value};

use kvtier_core::service::{Client, Service, ServiceConfig};
use kvtier_core::{BlockBuffer, BlockKey, Namespace, Store, StoreConfig};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const SLICE: usize = 8192;
const DESCRIPTION: &[u8] = b"service-pool-test/model";

fn config(dir: &Path, nvme_bytes: u64) -> ServiceConfig {
    let mut store = StoreConfig::new(dir.join("store"), 1);
    store.dram_bytes = 32 * (SLICE + 4096);
    store.nvme_bytes = nvme_bytes;
    store.region_bytes = 1 << 20;
    let mut config = ServiceConfig::new(dir.join("run").join("kvtier.sock"), store);
    config.pool_dir = dir.to_path_buf();
    config
}

fn client(socket: &Path) -> Client {
    let mut c = Client::connect(socket, Duration::from_secs(30)).unwrap();
    c.hello(DESCRIPTION, 1, 0, SLICE).unwrap();
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

fn pool_files(dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "pool"))
        .collect();
    found.sort();
    found
}

/// Item 4: a paced verify holds the namespace while its engine leaves and the idle time passes; an
/// engine attaches meanwhile. When the verify ends, the pool that engine (and every later one)
/// maps is still there. It used to be deleted by the verify's late drop of the old store (the
/// namespace was closed under it and reopened at the same file name), and every later hello failed.
#[test]
fn a_verify_that_outlives_an_idle_close_leaves_the_pool_engines_attach_to() {
    const BIG_SLICE: usize = 256 << 10;
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path(), 8 << 20);
    config.store.dram_bytes = 8 * (BIG_SLICE + 4096);
    config.store.region_bytes = 2 << 20;
    config.idle_timeout_ms = 300;
    let socket = config.socket_path.clone();
    let mut service = Service::start(config).unwrap();
    let hello = |socket: &Path| {
        let mut c = Client::connect(socket, Duration::from_secs(30)).unwrap();
        c.hello(DESCRIPTION, 1, 0, BIG_SLICE).unwrap();
        c
    };
    let keys: Vec<BlockKey> = (0..5).map(key).collect();
    let values: Vec<Vec<u8>> = (0..5).map(|i| value(i, BIG_SLICE)).collect();
    let mut a = hello(&socket);
    let bufs: Vec<BlockBuffer> = values.iter().map(|v| BlockBuffer::single(v.as_ptr() as *mut u8, v.len())).collect();
    // SAFETY: the values outlive the call.
    assert_eq!(unsafe { a.store_blocks(&keys, &bufs).unwrap() }, vec![true; 5]);
    a.flush().unwrap();
    drop(a);
    // One request: 5 blocks, a DRAM and an NVMe copy of 260 KiB each, 2.7 MB at 1 MB/s.
    let digest = Namespace::from_description(DESCRIPTION).0;
    let verify_socket = socket.clone();
    let verifier = std::thread::spawn(move || {
        let mut op = Client::connect(&verify_socket, Duration::from_secs(60)).unwrap();
        op.verify_batch(&digest, 0, 64, 1_000_000, false).unwrap()
    });
    std::thread::sleep(Duration::from_millis(1_200));
    let b = hello(&socket);
    let b_pool = b.attached().unwrap().pool_path.clone();
    let batch = verifier.join().unwrap();
    assert!(batch.values.iter().any(|(name, n)| name == "checked_nvme" && *n > 0), "{:?}", batch.values);
    assert!(b_pool.exists(), "the pool file engine B maps was deleted under it ({})", b_pool.display());
    let mut c = hello(&socket);
    let mut out: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; BIG_SLICE]).collect();
    let outs: Vec<BlockBuffer> = out.iter_mut().map(|v| BlockBuffer::single(v.as_mut_ptr(), v.len())).collect();
    // SAFETY: `out` outlives the call and nothing else touches it.
    assert_eq!(unsafe { c.load_blocks(&keys, &outs).unwrap() }, vec![true; 5]);
    assert_eq!(out, values);
    drop((b, c));
    service.stop().unwrap();
    assert!(pool_files(dir.path()).is_empty());
}

/// Item 4's mechanism: a store removes its pool file at its end only while the name still names
/// the file it created. A file put at that name since is another's (it was a reopened namespace's
/// pool, mapped by engines).
#[test]
fn a_store_removes_only_the_pool_file_it_created() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = StoreConfig::new(dir.path().join("store"), SLICE);
    c.namespace = DESCRIPTION.to_vec();
    c.dram_bytes = 8 * (SLICE + 4096);
    c.nvme_bytes = 0;
    let pool = dir.path().join("a.pool");
    c.pool_path = Some(pool.clone());
    let store = Store::open(c).unwrap();
    std::fs::rename(&pool, dir.path().join("moved")).unwrap();
    std::fs::write(&pool, b"another store's pool").unwrap();
    drop(store);
    assert_eq!(std::fs::read(&pool).unwrap(), b"another store's pool");
}

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// A sticky directory open to every user, like /dev/shm.
fn shared_tmpfs_like(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let shm = dir.join("shm");
    std::fs::create_dir(&shm).unwrap();
    std::fs::set_permissions(&shm, std::fs::Permissions::from_mode(0o1777)).unwrap();
    shm
}

/// A file of another user (uid 12345) at `path`, as that user would plant it.
fn plant(path: &Path, bytes: &[u8]) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, bytes).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).unwrap();
    std::os::unix::fs::chown(path, Some(12345), Some(12345)).unwrap();
}

/// Item 5: another local user creates a file at the name a namespace's pool would take (the names
/// used to be predictable: uid, socket hash, namespace). The namespace still opens, and the planted
/// file is neither used nor removed. Before, the service removed it when it could (as root) and
/// otherwise failed every Hello of that model with EEXIST (tests/test_service_life.py runs that
/// case as an unprivileged user).
#[test]
fn a_file_planted_at_a_pool_name_neither_stops_the_namespace_nor_is_touched() {
    if !is_root() {
        eprintln!("skipped: planting a file of another user needs root (chown)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path(), 0);
    config.pool_dir = shared_tmpfs_like(dir.path());
    let uid = rustix::process::geteuid().as_raw();
    let socket_hash = kvtier_core::format::checksum(config.socket_path.as_os_str().as_encoded_bytes());
    let namespace = Namespace::from_description(DESCRIPTION).hex();
    let predictable = config.pool_dir.join(format!("kvtier-{uid}-{socket_hash:016x}-{}.pool", &namespace[..16]));
    plant(&predictable, b"squatter");
    let socket = config.socket_path.clone();
    let mut service = Service::start(config).unwrap();
    let mut c = Client::connect(&socket, Duration::from_secs(10)).unwrap();
    let attached = c.hello(DESCRIPTION, 1, 0, SLICE).unwrap().clone();
    assert_ne!(attached.pool_path, predictable);
    assert_eq!(std::fs::read(&predictable).unwrap(), b"squatter", "the planted file was written or replaced");
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(&predictable).unwrap().uid(), 12345);
    drop(c);
    service.stop().unwrap();
    assert!(!attached.pool_path.exists() && predictable.exists());
}

/// Item 5: a store never opens, truncates or removes a file it did not create at its pool path; the
/// error names the owner and the fix. It used to remove whatever was there and create its own.
#[test]
fn a_store_refuses_a_pool_path_that_exists_and_leaves_it_alone() {
    if !is_root() {
        eprintln!("skipped: planting a file of another user needs root (chown)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let shm = shared_tmpfs_like(dir.path());
    let pool = shm.join("kvtier-planted.pool");
    plant(&pool, b"not yours");
    let mut c = StoreConfig::new(dir.path().join("store"), SLICE);
    c.namespace = DESCRIPTION.to_vec();
    c.dram_bytes = 8 * (SLICE + 4096);
    c.nvme_bytes = 0;
    c.pool_path = Some(pool.clone());
    let err = Store::open(c).err().expect("an existing pool file is refused");
    assert!(err.to_string().contains("owner uid 12345") && err.to_string().contains("--pool-dir"), "{err}");
    assert_eq!(std::fs::read(&pool).unwrap(), b"not yours");
}

/// Item 5, the engine's side: a pool path that is not a regular file of this user is refused before
/// it is mapped, whatever answered the Hello. Here a stand-in service (this user, so the peer check
/// passes) names a file of uid 12345 of the right size; the client used to map it and copy KV there.
#[test]
fn a_client_refuses_to_map_a_pool_file_of_another_user() {
    use kvtier_core::testing::wire::{read_frame, write_frame, Writer};
    if !is_root() {
        eprintln!("skipped: planting a file of another user needs root (chown)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let planted = shared_tmpfs_like(dir.path()).join("kvtier-planted.pool");
    plant(&planted, &vec![0u8; SLICE + 4096]);
    let socket = dir.path().join("fake.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let reply_path = planted.clone();
    let fake = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        read_frame(&mut stream).unwrap().expect("a hello");
        let mut w = Writer::new(0);
        w.u64((SLICE + 4096) as u64).u64(1).u64(4096).u64((SLICE + 4096) as u64).u64(SLICE as u64);
        w.bytes(reply_path.as_os_str().as_encoded_bytes());
        write_frame(&mut stream, &w.0).unwrap();
    });
    let mut c = Client::connect(&socket, Duration::from_secs(10)).unwrap();
    let err = c.hello(DESCRIPTION, 1, 0, SLICE).expect_err("a pool of another user is refused");
    assert!(err.to_string().contains("owner uid 12345"), "{err}");
    fake.join().unwrap();
}

/// Resident bytes of this process's mapping that starts at `base` (`Rss:` in /proc/self/smaps).
fn mapping_rss_bytes(base: usize) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut in_mapping = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ').filter(|(r, _)| r.contains('-') && !r.ends_with(':')) {
            let start = usize::from_str_radix(range.split('-').next().unwrap(), 16).unwrap_or(usize::MAX);
            in_mapping = start == base;
        } else if in_mapping && line.starts_with("Rss:") {
            return line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024;
        }
    }
    panic!("no mapping at {base:#x}")
}

/// Item 12, a suspect confirmed: every connection used to map the pool with MAP_POPULATE at Hello,
/// so an engine's scheduler side (its manager, prefetcher and event feed: three connections that
/// never copy a byte) and every `kvtier ls --blocks` faulted in the whole pool (page tables and
/// time per GiB, for each). A connection that never copies now leaves the pool unfaulted; one that
/// copies faults it in when it asks (`populate_pool`, the workers at attach).
#[test]
fn a_connection_that_never_copies_does_not_fault_in_the_pool() {
    const POOL_BYTES: usize = 1 << 30;
    let dir = tempfile::tempdir().unwrap();
    let pool_dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let mut config = config(dir.path(), 0);
    config.store.dram_bytes = POOL_BYTES;
    config.pool_dir = pool_dir.path().to_path_buf();
    let socket = config.socket_path.clone();
    let mut service = Service::start(config).unwrap();
    drop(client(&socket)); // the namespace opens (and the service faults its own mapping in)
    let started = Instant::now();
    let mut scheduler = client(&socket);
    let hello_ms = started.elapsed().as_secs_f64() * 1e3;
    assert_eq!(scheduler.locate(&[key(1)]).unwrap(), vec![0]);
    let (base, len) = scheduler.pool_span().unwrap();
    let rss = mapping_rss_bytes(base);
    eprintln!("hello of a {len}-byte pool: {hello_ms:.1} ms, {rss} bytes of it resident in this connection");
    assert!(rss < (len / 64) as u64, "a connection that never copied faulted in {rss} of {len} bytes");
    let mut worker = client(&socket);
    let started = Instant::now();
    worker.populate_pool().unwrap();
    let populate_ms = started.elapsed().as_secs_f64() * 1e3;
    let (worker_base, _) = worker.pool_span().unwrap();
    let worker_rss = mapping_rss_bytes(worker_base);
    eprintln!("populate_pool: {populate_ms:.1} ms, {worker_rss} bytes resident");
    assert!(worker_rss >= (len - len / 64) as u64, "populate_pool faulted in {worker_rss} of {len} bytes");
    let values = vec![value(1, SLICE)];
    assert_eq!(store(&mut worker, &[key(1)], &values), vec![true]);
    assert_eq!(load(&mut scheduler, &[key(1)]), (vec![true], values));
    drop((scheduler, worker));
    service.stop().unwrap();
}

/// Item 12, a suspect confirmed: services started at once on one socket (by hand, by systemd
/// and an engine: only engines coordinate through their lock file), with a dead service's socket
/// left there. Each found the old socket refusing, removed what was at the path and bound its own:
/// the later one removed the earlier one's live socket, which then served nobody until it exited,
/// and its stop removed the other's socket in turn. Now the look at the path, the old socket's
/// removal and the bind are done under a lock of the socket path, and a service removes only the
/// socket it bound: in every round exactly one of four starts, and it answers.
#[test]
fn services_started_at_once_on_one_socket_never_both_run() {
    const ROUNDS: usize = 30;
    const STARTERS: usize = 4;
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), 0);
    let socket = config.socket_path.clone();
    std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
    let mut both = 0;
    for _ in 0..ROUNDS {
        drop(std::os::unix::net::UnixListener::bind(&socket).unwrap()); // a dead service's socket
        let barrier = std::sync::Barrier::new(STARTERS);
        let started: Vec<Option<Service>> = std::thread::scope(|scope| {
            let starts: Vec<_> = (0..STARTERS)
                .map(|_| {
                    let (barrier, config) = (&barrier, config.clone());
                    scope.spawn(move || {
                        barrier.wait();
                        Service::start(config).ok()
                    })
                })
                .collect();
            starts.into_iter().map(|s| s.join().unwrap()).collect()
        });
        let mut running: Vec<Service> = started.into_iter().flatten().collect();
        both += usize::from(running.len() > 1);
        assert!(!running.is_empty(), "no service started");
        assert!(std::os::unix::net::UnixStream::connect(&socket).is_ok(), "the socket answers");
        for service in &mut running {
            service.stop().unwrap();
        }
        assert!(!socket.exists(), "a stopped service left its socket");
    }
    assert_eq!(both, 0, "in {both} of {ROUNDS} rounds more than one service started");
}

/// The other half of that race, made deterministic: A's socket file is removed (by a racing start,
/// or by hand) and B starts on the path and writes its pid file. A stops: it removes neither B's
/// socket nor B's pid file (it used to remove whatever was at its socket's path, so B then served
/// nobody; the pid file was removed by `kvtier serve` after the stop, whoever it named).
#[test]
fn a_stopping_service_removes_only_its_own_socket_and_pid_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), 0);
    let socket = config.socket_path.clone();
    let pid_file = socket.with_extension("pid");
    let mut a = Service::start(config.clone()).unwrap();
    std::fs::write(&pid_file, format!("{} 1\n", std::process::id())).unwrap();
    std::fs::remove_file(&socket).unwrap();
    std::fs::remove_file(&pid_file).unwrap();
    let mut b = Service::start(config).unwrap();
    std::fs::write(&pid_file, "1 1\n").unwrap(); // B's, as `kvtier serve` records it (another process)
    a.stop().unwrap();
    assert!(std::os::unix::net::UnixStream::connect(&socket).is_ok(), "B's socket was removed by A's stop");
    assert_eq!(std::fs::read_to_string(&pid_file).unwrap(), "1 1\n", "B's pid file was removed by A's stop");
    std::fs::write(&pid_file, format!("{} 1\n", std::process::id())).unwrap(); // now B's names this process
    b.stop().unwrap();
    assert!(!socket.exists() && !pid_file.exists(), "B's stop leaves its own socket or pid file");
    let left: Vec<_> = std::fs::read_dir(socket.parent().unwrap()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(left.iter().all(|name| !name.to_string_lossy().contains("lock")), "lock files left: {left:?}");
}

/// The idle exit's decision (`stop_if_idle`): never while a connection is held; once idle, it
/// stops accepting and removes the socket at once, so that an engine arriving next finds no
/// socket (and starts a service) instead of a service on its way out.
#[test]
fn the_idle_exit_is_decided_with_accepting_and_removes_the_socket_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let socket = config(dir.path(), 0).socket_path.clone();
    let mut service = Service::start(config(dir.path(), 0)).unwrap();
    let held = Client::connect(&socket, Duration::from_secs(10)).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert!(!service.stop_if_idle(0), "a service holding a connection decided to exit");
    drop(held);
    assert!(!service.stop_if_idle(60_000), "idle for less than the limit");
    std::thread::sleep(Duration::from_millis(100));
    assert!(service.stop_if_idle(50));
    assert!(!socket.exists(), "the socket stayed after the decision");
    assert!(Client::connect(&socket, Duration::from_secs(1)).is_err());
    service.stop().unwrap();
}

/// Services sharing a socket directory probe each other's sockets (`remove_dead_sockets`, every
/// minute: connect, then close). Two idle services started by engines never exited when each probe
/// restarted the other's idle time. A connection that makes no request is no activity; one that
/// makes a request is.
#[test]
fn a_connection_that_makes_no_request_does_not_restart_the_idle_time() {
    let dir = tempfile::tempdir().unwrap();
    let socket = config(dir.path(), 0).socket_path.clone();
    let mut service = Service::start(config(dir.path(), 0)).unwrap();
    std::thread::sleep(Duration::from_millis(400));
    for _ in 0..3 {
        drop(std::os::unix::net::UnixStream::connect(&socket).unwrap());
        std::thread::sleep(Duration::from_millis(10));
    }
    let drained = Instant::now() + Duration::from_secs(5);
    while service.idle_ms() == 0 && Instant::now() < drained {
        std::thread::sleep(Duration::from_millis(5)); // the probes' connection threads ending
    }
    let idle_ms = service.idle_ms();
    assert!(idle_ms >= 400, "a probe restarted the idle time: idle for {idle_ms} ms");
    let mut operator = Client::connect(&socket, Duration::from_secs(10)).unwrap();
    assert!(!operator.stats().unwrap().is_empty());
    drop(operator);
    let drained = Instant::now() + Duration::from_secs(5);
    while service.idle_ms() == 0 && Instant::now() < drained {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(service.idle_ms() < 400, "a request did not restart the idle time");
    assert!(!service.stop_if_idle(400));
    service.stop().unwrap();
}
