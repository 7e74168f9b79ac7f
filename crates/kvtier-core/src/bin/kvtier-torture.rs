//! Crash torture: a writer process stores, flushes and reads blocks while the harness kills it with
//! SIGKILL at random moments; after every kill the harness reopens the store and checks every block
//! it returns against what was written.
//!
//! `kvtier-torture run --loops 300 --engine io_uring --dir /tmp/t` runs the harness and prints one
//! JSON line of figures: loops, blocks acknowledged (flushed before the kill), blocks lost (acked,
//! recent enough not to have been evicted, yet missing), blocks served wrong (must be 0).
//! `kvtier-torture writer ...` is the child it spawns.
//!
//! `--service`: the child runs the host service instead of a bare store, and two clients (ranks 0
//! and 1 of a TP=2 engine, in two threads) store each half of every block through the shared pool; the kill takes
//! the service down between acknowledged stores and their NVMe writes, and the harness restarts a
//! service on the same directory and loads every block through it.

use kvtier_core::service::{Client, Service, ServiceConfig};
use kvtier_core::{BlockBuffer, BlockKey, EngineChoice, Store, StoreConfig};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const OBJECT_BYTES: usize = 64 * 1024;
const NVME_BYTES: u64 = 32 << 20;
const REGION_BYTES: u64 = 1 << 20;

fn key(id: u64) -> BlockKey {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&id.to_le_bytes());
    k[8..16].copy_from_slice(&id.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
    k[16..24].copy_from_slice(b"torture!");
    BlockKey(k)
}

fn value(id: u64) -> Vec<u8> {
    let mut x = id.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    (0..OBJECT_BYTES)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn config(dir: &Path, args: &[String]) -> StoreConfig {
    let mut c = StoreConfig::new(dir, OBJECT_BYTES);
    c.namespace = b"kvtier-torture".to_vec();
    c.io_engine = engine_of(args);
    if let Some(ms) = arg(args, "--nvme-read-stall-ms") {
        c.nvme_read_stall_ms = ms.parse().expect("--nvme-read-stall-ms N");
    }
    c.dram_bytes = 12 * (OBJECT_BYTES + 4096);
    c.nvme_bytes = NVME_BYTES;
    c.region_bytes = REGION_BYTES;
    c
}

/// Blocks of the newest acknowledged ids that must survive: half the NVMe capacity, so that FIFO
/// region eviction cannot explain a miss among them.
fn survive_window() -> u64 {
    NVME_BYTES / 2 / (OBJECT_BYTES as u64 + 4096)
}

const SERVICE_NAMESPACE: &[u8] = b"kvtier-torture-service/tp2";
const SLICE_BYTES: usize = OBJECT_BYTES / 2;

/// A block stored or loaded through the host service by two ranks, each moving its half.
struct ServiceBlocks {
    _service: Service,
    ranks: [Client; 2],
}

impl ServiceBlocks {
    fn start(dir: &Path, args: &[String]) -> ServiceBlocks {
        let socket = dir.join("svc.sock");
        let mut config = ServiceConfig::new(&socket, config(dir, args));
        config.pool_dir = dir.to_path_buf();
        let service = Service::start(config).expect("service start");
        let rank = |r: u32| {
            let mut c = Client::connect(&socket, Duration::from_secs(60)).expect("connect");
            c.hello(SERVICE_NAMESPACE, 2, r, SLICE_BYTES).expect("hello");
            c
        };
        ServiceBlocks { ranks: [rank(0), rank(1)], _service: service }
    }

    /// Per block: both ranks' slices accepted. The ranks store in parallel, as TP workers do.
    fn put(&mut self, keys: &[BlockKey], values: &[Vec<u8>]) -> Vec<bool> {
        let [rank0, rank1] = &mut self.ranks;
        let store = |r: usize, client: &mut Client| {
            let halves: Vec<BlockBuffer> = values
                .iter()
                .map(|v| BlockBuffer::single(v[r * SLICE_BYTES..].as_ptr() as *mut u8, SLICE_BYTES))
                .collect();
            // SAFETY: the values outlive the call and are only read.
            unsafe { client.store_blocks(keys, &halves).expect("store") }
        };
        let (first, second) = std::thread::scope(|scope| {
            let other = scope.spawn(|| store(1, rank1));
            (store(0, rank0), other.join().expect("rank 1"))
        });
        self.ranks[0].flush().expect("flush");
        first.iter().zip(&second).map(|(&a, &b)| a && b).collect()
    }

    /// The block's bytes if both halves load.
    fn get(&mut self, key: BlockKey) -> Option<Vec<u8>> {
        let mut out = vec![0u8; OBJECT_BYTES];
        for (r, client) in self.ranks.iter_mut().enumerate() {
            let half = [BlockBuffer::single(out[r * SLICE_BYTES..].as_mut_ptr(), SLICE_BYTES)];
            // SAFETY: `out` outlives the call and nothing else touches it.
            if !unsafe { client.load_blocks(&[key], &half).expect("load") }[0] {
                return None;
            }
        }
        Some(out)
    }
}

/// What the harness stores into and loads from: a bare store, or the host service.
enum Blocks {
    Store(Store),
    Service(Box<ServiceBlocks>),
}

impl Blocks {
    fn open(args: &[String], dir: &Path) -> Result<Blocks, kvtier_core::Error> {
        if args.iter().any(|a| a == "--service") {
            return Ok(Blocks::Service(Box::new(ServiceBlocks::start(dir, args))));
        }
        Store::open(config(dir, args)).map(Blocks::Store)
    }

    /// Stores and flushes; per block, whether it was accepted (a store may be dropped: a cache).
    fn put(&mut self, keys: &[BlockKey], values: &[Vec<u8>]) -> Vec<bool> {
        match self {
            Blocks::Store(store) => {
                let refs: Vec<&[u8]> = values.iter().map(|v| v.as_slice()).collect();
                let accepted = store.put_many(keys, &refs).unwrap();
                store.flush().unwrap();
                accepted
            }
            Blocks::Service(service) => service.put(keys, values),
        }
    }

    /// The NVMe tier's refusals so far: lookups it was skipped in while sick, and reads given up
    /// on it (`nvme_read_stall_ms`). A miss that raised them is the tier stepping aside, not a loss.
    fn nvme_refusals(&mut self) -> u64 {
        let pairs: Vec<(String, u64)> = match self {
            Blocks::Store(store) => {
                let counters = store.stats().counters.fields();
                counters.into_iter().map(|(name, value)| (name.to_string(), value)).collect()
            }
            Blocks::Service(service) => service.ranks[0].stats().expect("stats"),
        };
        let value = |name: &str| pairs.iter().find(|(n, _)| n == name).map_or(0, |(_, v)| *v);
        value("nvme_lookups_skipped") + value("nvme_reads_given_up")
    }

    /// The block, read again while the NVMe tier steps aside for it (a slow disk past the stall
    /// limit: a counted miss a user's engine recomputes; the tier comes back when the disk answers,
    /// or its probe does). What misses with the tier answering was lost.
    fn get_once_nvme_answers(&mut self, key: BlockKey, f: &mut Figures) -> Option<Vec<u8>> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut stepped_aside = false;
        loop {
            let refusals = self.nvme_refusals();
            let got = self.get(key);
            if got.is_some() || self.nvme_refusals() == refusals || Instant::now() > deadline {
                f.nvme_stepped_aside += u64::from(stepped_aside);
                return got;
            }
            stepped_aside = true;
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn get(&mut self, key: BlockKey) -> Option<Vec<u8>> {
        match self {
            Blocks::Store(store) => {
                let mut buf = vec![0u8; OBJECT_BYTES];
                let mut out = [&mut buf[..]];
                store.get_many(&[key], &mut out).unwrap()[0].then_some(buf)
            }
            Blocks::Service(service) => service.get(key),
        }
    }
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn engine_of(args: &[String]) -> EngineChoice {
    match arg(args, "--engine").as_deref() {
        Some("psync") => EngineChoice::Psync,
        Some("io_uring") => EngineChoice::IoUring,
        _ => EngineChoice::Auto,
    }
}

fn read_acks(path: &Path) -> Vec<u64> {
    let bytes = std::fs::read(path).unwrap_or_default();
    bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect()
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// The child: put, flush, record the flushed ids, read some back; forever, until killed.
fn writer(args: &[String]) -> ! {
    let dir = PathBuf::from(arg(args, "--dir").expect("--dir"));
    let acks_path = dir.join("acks.bin");
    let mut next = read_acks(&acks_path).into_iter().max().map_or(0, |m| m + 1);
    let mut rng = next.wrapping_mul(77) | 1;
    let mut blocks = match Blocks::open(args, &dir) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("writer: open failed: {e}");
            std::process::exit(2);
        }
    };
    let mut acks = std::fs::OpenOptions::new().create(true).append(true).open(&acks_path).unwrap();
    loop {
        let batch = 1 + xorshift(&mut rng) % 12;
        let ids: Vec<u64> = (next..next + batch).collect();
        let keys: Vec<_> = ids.iter().map(|&i| key(i)).collect();
        let values: Vec<_> = ids.iter().map(|&i| value(i)).collect();
        let accepted = blocks.put(&keys, &values);
        let mut record = Vec::with_capacity(ids.len() * 8);
        // Only what was accepted and then flushed is acknowledged: a dropped store is a miss.
        for (id, _) in ids.iter().zip(&accepted).filter(|(_, &ok)| ok) {
            record.extend_from_slice(&id.to_le_bytes());
        }
        acks.write_all(&record).unwrap();
        next += batch;
        // Read a few recent blocks back; a wrong byte is fatal even before any crash.
        for _ in 0..2 {
            let id = next.saturating_sub(1 + xorshift(&mut rng) % 64);
            if blocks.get(key(id)).is_some_and(|got| got != value(id)) {
                eprintln!("writer: block {id} served wrong bytes");
                std::process::exit(3);
            }
        }
    }
}

struct Figures {
    loops: u64,
    acked: u64,
    checked_recent: u64,
    lost: u64,
    served_wrong: u64,
    misses_old: u64,
    /// Recent blocks read again because the NVMe tier stepped aside for their first read.
    nvme_stepped_aside: u64,
}

fn run(args: &[String]) {
    let loops: u64 = arg(args, "--loops").map_or(50, |s| s.parse().expect("--loops N"));
    let engine = arg(args, "--engine").unwrap_or_else(|| "auto".into());
    let tmp;
    let dir = match arg(args, "--dir") {
        Some(d) => PathBuf::from(d),
        None => {
            tmp = std::env::temp_dir().join(format!("kvtier-torture-{}", std::process::id()));
            tmp.clone()
        }
    };
    std::fs::create_dir_all(&dir).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut rng = 0x1234_5678_9abc_def1u64 ^ std::process::id() as u64;
    let mut f = Figures {
        loops: 0,
        acked: 0,
        checked_recent: 0,
        lost: 0,
        served_wrong: 0,
        misses_old: 0,
        nvme_stepped_aside: 0,
    };
    let started = Instant::now();
    let service = args.iter().any(|a| a == "--service");
    let stall = arg(args, "--nvme-read-stall-ms");
    for _ in 0..loops {
        let mut child = Command::new(&exe)
            .args(["writer", "--dir", dir.to_str().unwrap(), "--engine", &engine])
            .args(service.then_some("--service"))
            .args(stall.iter().flat_map(|ms| ["--nvme-read-stall-ms", ms.as_str()]))
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn writer");
        std::thread::sleep(Duration::from_millis(30 + xorshift(&mut rng) % 400));
        let _ = child.kill(); // SIGKILL
        let status = child.wait().unwrap();
        if status.code() == Some(3) {
            f.served_wrong += 1;
        }
        f.loops += 1;
        check_acknowledged_blocks(args, &dir, &mut f);
    }
    println!(
        "{{\"engine\": \"{engine}\", \"service\": {service}, \"loops\": {}, \"blocks_acknowledged\": {}, \"recent_block_checks\": {}, \
         \"blocks_lost\": {}, \"blocks_served_wrong\": {}, \"old_block_misses_summed_over_loops\": {}, \"reads_again_after_nvme_stepped_aside\": {}, \"seconds\": {:.1}}}",
        f.loops,
        f.acked,
        f.checked_recent,
        f.lost,
        f.served_wrong,
        f.misses_old,
        f.nvme_stepped_aside,
        started.elapsed().as_secs_f64()
    );
    if arg(args, "--dir").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    if f.served_wrong > 0 || f.lost > 0 {
        std::process::exit(1);
    }
}

/// Reopens the store the killed writer left in `dir` and reads back every block it acknowledged:
/// the recent ones must all be there, and no block may be served with wrong bytes.
fn check_acknowledged_blocks(args: &[String], dir: &Path, f: &mut Figures) {
    let acks = read_acks(&dir.join("acks.bin"));
    f.acked = acks.len() as u64;
    let newest = acks.iter().copied().max().unwrap_or(0);
    let mut blocks = Blocks::open(args, dir).expect("reopen after kill");
    for &id in &acks {
        let recent = newest - id < survive_window();
        let got = if recent { blocks.get_once_nvme_answers(key(id), f) } else { blocks.get(key(id)) };
        let hit = got.is_some();
        if got.is_some_and(|bytes| bytes != value(id)) {
            f.served_wrong += 1;
            eprintln!("block {id} served wrong after a crash");
        }
        if recent {
            f.checked_recent += 1;
            if !hit {
                f.lost += 1;
                eprintln!("block {id} acknowledged (flushed) but lost after a crash");
            }
        } else if !hit {
            f.misses_old += 1;
        }
    }
    if let Blocks::Store(store) = blocks {
        store.close().unwrap();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("writer") => writer(&args),
        Some("run") => run(&args),
        _ => {
            eprintln!("usage: kvtier-torture run [--loops N] [--engine auto|io_uring|psync] [--dir DIR] [--service] [--nvme-read-stall-ms N]");
            std::process::exit(64);
        }
    }
}
