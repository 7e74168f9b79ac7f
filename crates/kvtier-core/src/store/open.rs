//! Opening a store, in phases: the locked namespace directories, the DRAM pool, the NVMe devices
//! (with crash recovery of the blocks already on them), the value cipher, the remote tiers, the
//! device queues (with the I/O engine's self-test), then the job threads.

use super::{finish_job, random_u64, Job, Store, ENCRYPTION_KEY_FILE_ENV};
use crate::admission::{Admission, WriteBudget};
use crate::catalog::{Catalog, CatalogLock, MetaWrite, SlotLayout, Tier};
use crate::config::{NvmeWithoutSpace, StoreConfig};
use crate::error::{Error, Result};
use crate::format::encrypted::ValueCipher;
use crate::format::superblock::{Superblock, SUPERBLOCK_BYTES};
use crate::io::buffer::AlignedBuf;
use crate::io::device::DeviceQueue;
#[cfg(any(test, feature = "testing"))]
use crate::io::faults::FaultyEngine;
use crate::io::psync::PsyncEngine;
use crate::io::uring::UringEngine;
use crate::io::{EngineChoice, IoCompletion, IoEngine, IoRequest, OpKind, RegisteredRange};
use crate::key::{BlockKey, Namespace};
use crate::mover::{execute_get, execute_put, probe_sick_tiers, submit_meta};
use crate::remote_tiers::RemoteTiers;
use crate::stats::Stats;
use crate::store_state::{NvmeHealth, ReadAhead, StoreState};
use crate::tiers::dram::Arena;
use crate::tiers::eviction::S3Fifo;
use crate::tiers::nvme::{self, DeviceFile, Geometry, RecoveredRegion};
use crate::tiers::remote::key::{load_key_bytes, KeySource};
use crossbeam_channel::{bounded, unbounded, Sender};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a store job yields to loads in progress before it runs anyway.
const STORE_YIELD_LIMIT: Duration = Duration::from_millis(100);

impl Store {
    /// Opens (creating what is missing) the store that `config` describes, in phases: the locked
    /// namespace directories, the DRAM pool, the NVMe devices (with crash recovery of blocks already
    /// on them), the remote tiers, the device queues, then the job threads.
    pub fn open(config: StoreConfig) -> Result<Store> {
        config.validate()?;
        let namespace = Namespace::from_description(&config.namespace);
        let (dirs, locks) = prepare_namespace_dirs(&config, namespace)?;
        let slot_bytes = config.slot_bytes();
        let arena = Arena::map(slot_bytes, config.slot_count(), config.pool_path.as_deref())?;
        let stats = Arc::new(Stats::default());
        let geometry = nvme_geometry(&config, &dirs, slot_bytes, &stats)?;
        let mut catalog = new_catalog(&config, &arena, geometry, dirs.len(), &stats);
        let cipher = open_value_cipher(&config)?;
        if cipher.is_some() {
            catalog.name_tenants();
        }
        let (device_files, startup_meta) = match &geometry {
            Some(geometry) => {
                open_and_recover_devices(&config, &dirs, namespace, geometry, &mut catalog, cipher.as_deref())?
            }
            None => (Vec::new(), Vec::new()),
        };
        let dram_only = super::takeover::keep_taken_over_blocks(&arena, &mut catalog, namespace, config.object_bytes);
        let remote = RemoteTiers::open(&config, namespace, &stats, cipher.as_ref())?;
        let (engine_name, buffers_registered, devices) =
            start_devices(&config, &device_files, &arena.registration_ranges(), &stats)?;
        let direct_io = device_files.iter().all(|d| d.direct) && !device_files.is_empty();
        let read_ahead = ReadAhead::new(arena.slot_count());
        let admission = open_admission(&config, &dirs, geometry.is_some());
        let nvme_health = NvmeHealth::new(config.tier_health, Arc::clone(&stats));
        let state = Arc::new(StoreState {
            geometry,
            namespace,
            catalog: CatalogLock::new(catalog),
            changed: Condvar::new(),
            arena,
            devices,
            device_files,
            stats,
            remote,
            finished: Mutex::new(HashMap::new()),
            finished_cv: Condvar::new(),
            loads_active: AtomicUsize::new(0),
            stores_active: AtomicUsize::new(0),
            activity: Mutex::new(()),
            activity_cv: Condvar::new(),
            read_ahead,
            late_reads: Arc::default(),
            nvme_health,
            value_cipher: cipher,
            write_buffers: Mutex::new(Vec::new()),
            admission,
            config,
        });
        settle_opened(&state, &dirs[0], startup_meta, &dram_only);
        let JobThreads { load_tx, store_tx, probe_stop, threads } = start_job_threads(&state)?;
        log_store_open(&state, &dirs[0], engine_name);
        Ok(Store {
            state,
            load_tx: Mutex::new(Some(load_tx)),
            store_tx: Mutex::new(Some(store_tx)),
            probe_stop: Mutex::new(Some(probe_stop)),
            threads: Mutex::new(threads),
            closed: AtomicBool::new(false),
            io_engine: engine_name,
            buffers_registered,
            direct_io,
            locks: Mutex::new(locks),
            dates_saving: Arc::new(AtomicBool::new(false)),
            budgets_saved_changes: Arc::new(AtomicU64::new(0)),
        })
    }
}

/// Creates the namespace directory under every path (private, never a symbolic link), locks each,
/// and writes its description: the directories with their locks, in the order of `config.paths`.
fn prepare_namespace_dirs(config: &StoreConfig, namespace: Namespace) -> Result<(Vec<PathBuf>, Vec<File>)> {
    let dirs: Vec<_> = config.paths.iter().map(|p| p.join(namespace.hex())).collect();
    for dir in &dirs {
        // The namespace directory is private (0700): its listing names the models cached here.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| Error::io(format!("creating {} (give kvtier a writable directory)", dir.display()), e))?;
        if std::fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(Error::format(
                dir,
                "is a symbolic link; kvtier does not follow links out of its directory: remove it",
            ));
        }
    }
    // Every directory is locked: two stores must never write one device file.
    let locks = dirs.iter().map(|dir| take_lock(dir)).collect::<Result<Vec<_>>>()?;
    for dir in &dirs {
        crate::namespace_dir::write_description(dir, &config.namespace)?;
    }
    assert_eq!(locks.len(), dirs.len(), "one lock per namespace directory");
    Ok((dirs, locks))
}

/// The NVMe geometry, `None` when the NVMe tier is off: `nvme_bytes` is 0, or a device file still to
/// be created would not fit on its disk and `nvme_without_space` says to open without it (else that
/// fails the open).
fn nvme_geometry(config: &StoreConfig, dirs: &[PathBuf], slot_bytes: usize, stats: &Stats) -> Result<Option<Geometry>> {
    if config.nvme_bytes == 0 {
        return Ok(None);
    }
    let geometry = Geometry::from_capacity(
        slot_bytes as u64,
        config.effective_region_bytes(),
        config.nvme_bytes / config.paths.len() as u64,
    );
    // Before any bookkeeping is sized from the request: a capacity the disk cannot hold is a
    // start-up error, not an allocation failure.
    for dir in dirs {
        if dir.join(nvme::DEVICE_FILE_NAME).exists() {
            continue;
        }
        let Err(error) = nvme::check_free_space(dir, geometry.file_bytes()) else { continue };
        if config.nvme_without_space == NvmeWithoutSpace::Refuse {
            return Err(error);
        }
        // Device files already made stay as they are (their blocks are recovered at the next open
        // with room); none is created, so nothing of this open fills the disk further.
        log::warn!(
            "kvtier: {error}; the store runs without its NVMe tier (DRAM only) until it is opened again with room \
             (nvme_without_space = \"dram_only\")"
        );
        Stats::add(&stats.nvme_off_no_space, 1);
        return Ok(None);
    }
    Ok(Some(geometry))
}

fn new_catalog(
    config: &StoreConfig,
    arena: &Arena,
    geometry: Option<Geometry>,
    device_count: usize,
    stats: &Arc<Stats>,
) -> Catalog {
    let layout = SlotLayout {
        slot_count: arena.slot_count(),
        slot_bytes: config.slot_bytes() as u64,
        object_bytes: config.object_bytes as u32,
        max_dirty_bytes: config.effective_max_dirty_bytes(),
    };
    let mut catalog = Catalog::new(
        layout,
        Box::new(|slots| Box::new(S3Fifo::new(slots))),
        geometry.map(|g| (g, device_count)),
        Arc::clone(stats),
    );
    catalog.set_loads_cancel_writes(config.loads_cancel_queued_writes);
    catalog.set_tenant_shares(config.tenant_shares().expect("validated with the config"));
    if config.tenant_shares_nvme {
        catalog.split_nvme_by_tenant();
    }
    catalog
}

/// The store's admission below DRAM, with the NVMe tier's write budget sized from the filesystems
/// holding its directories.
fn open_admission(config: &StoreConfig, dirs: &[PathBuf], nvme: bool) -> Admission {
    let bytes_per_day = if nvme { config.nvme_write_budget_bytes_per_day(filesystems_bytes(dirs)) } else { 0 };
    if nvme && bytes_per_day == 0 && config.write_budget_nvme_dwpd > 0.0 && config.write_budget_nvme_bytes_per_day == 0
    {
        log::warn!(
            "kvtier: the size of the filesystems under {dirs:?} is unknown, so write_budget_nvme_dwpd has nothing to \
             count: the NVMe tier's writes are unbounded; set write_budget_nvme_bytes_per_day to bound them"
        );
    }
    let budget =
        WriteBudget::of_store(Tier::Nvme.name().into(), &config.paths, bytes_per_day, config.write_budget_burst_s);
    let policies = (config.write_admission, config.remote_write_admission.unwrap_or(config.write_admission));
    Admission::new(policies, config.write_admission_memory_blocks, budget)
}

/// The size of the filesystems holding `dirs`, each counted once (two directories on one disk are
/// one drive's writes a day); one that cannot be measured counts nothing.
fn filesystems_bytes(dirs: &[PathBuf]) -> u64 {
    let mut seen = std::collections::HashSet::new();
    dirs.iter()
        .filter(|dir| rustix::fs::stat(dir.as_path()).map_or(true, |st| seen.insert(st.st_dev)))
        .filter_map(|dir| rustix::fs::statvfs(dir.as_path()).ok())
        .map(|fs| fs.f_blocks.saturating_mul(fs.f_frsize))
        .sum()
}

/// Opens (or creates) one device file per directory, device `i` in `dirs[i]`, and hands the blocks
/// recovered from existing ones to `catalog`: the device files, and the metadata writes that
/// adopting them needs once the device queues run.
fn open_and_recover_devices(
    config: &StoreConfig,
    dirs: &[PathBuf],
    namespace: Namespace,
    geometry: &Geometry,
    catalog: &mut Catalog,
    cipher: Option<&ValueCipher>,
) -> Result<(Vec<DeviceFile>, Vec<MetaWrite>)> {
    let mut device_files = Vec::new();
    let mut startup_meta = Vec::new();
    let store_id = nvme::existing_store_id(dirs).unwrap_or_else(random_u64);
    for (i, dir) in dirs.iter().enumerate() {
        let template = Superblock {
            device_index: i as u32,
            device_count: dirs.len() as u32,
            namespace,
            region_bytes: geometry.region_bytes,
            region_count: geometry.region_count,
            slot_bytes: geometry.slot_bytes,
            object_bytes: config.object_bytes as u64,
            store_id,
        };
        let (device, created) = nvme::open_device(dir, &template, geometry, config.direct_io)?;
        if !created {
            let recovered = recover_device(&device, geometry, namespace, config.object_bytes as u64, cipher)?;
            startup_meta.extend(catalog.adopt_recovered(i, recovered));
        }
        device_files.push(device);
    }
    catalog.restore_timeline(crate::namespace_dir::read_timeline(&dirs[0]));
    assert_eq!(device_files.len(), dirs.len(), "one device file per namespace directory");
    Ok((device_files, startup_meta))
}

/// The NVMe tier's value cipher, from `encryption_key_file` (else the file `KVTIER_ENCRYPTION_KEY_FILE`
/// names); None: values are written in clear.
fn open_value_cipher(config: &StoreConfig) -> Result<Option<Arc<ValueCipher>>> {
    let source = KeySource {
        key_file: config.encryption_key_file.as_deref(),
        option: "encryption_key_file",
        env: ENCRYPTION_KEY_FILE_ENV,
        // Whoever can write the shared root must not read the key that keeps NVMe values from them.
        shared_root: config.shared.as_ref().map(|s| s.root.as_path()),
    };
    Ok(load_key_bytes(&source)?.map(|bytes| Arc::new(ValueCipher::new(&bytes))))
}

/// The regions of an existing device file with the blocks they hold, logged with the time taken.
fn recover_device(
    device: &DeviceFile,
    geometry: &Geometry,
    namespace: Namespace,
    object_bytes: u64,
    cipher: Option<&ValueCipher>,
) -> Result<Vec<RecoveredRegion>> {
    let started = Instant::now();
    let recovered = nvme::recover(device, geometry, &namespace, object_bytes, cipher)?;
    let blocks: usize = recovered.iter().map(|r| r.entries.len()).sum();
    log::info!(
        "kvtier: recovered {blocks} blocks from {} regions of {} in {:.0} ms",
        recovered.len(),
        device.path.display(),
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok(recovered)
}

/// Lets each publisher copy a block that is still resident when it comes to publish it.
/// The open's steps once its state exists, before its threads start: the write budgets resume
/// (before anything takes from them), recovery's metadata writes are queued, the blocks kept from a
/// pool taken over are persisted, and the publishers learn to fetch what DRAM let go.
fn settle_opened(state: &Arc<StoreState>, dir: &Path, startup_meta: Vec<MetaWrite>, dram_only: &[BlockKey]) {
    super::budgets::resume_from_dir(state, dir);
    submit_meta(state, startup_meta);
    super::takeover::persist_kept(state, dram_only);
    set_publishers_refetch(state);
}

fn set_publishers_refetch(state: &Arc<StoreState>) {
    state.remote.set_refetch(|| {
        // Weak: the publisher belongs to `state`, and a strong reference would keep it alive.
        let weak = Arc::downgrade(state);
        Box::new(move |key, out| weak.upgrade().is_some_and(|sh| crate::mover::copy_resident_block(&sh, key, out)))
    });
}

/// The load threads, the store thread and the remote tiers' prober, with the senders of their job
/// queues and the prober's stop (dropped: it stops).
struct JobThreads {
    load_tx: Sender<Job>,
    store_tx: Sender<Job>,
    probe_stop: Sender<()>,
    threads: Vec<JoinHandle<()>>,
}

/// Starts the load threads, the store thread and, with a remote tier, the prober of sick tiers.
fn start_job_threads(state: &Arc<StoreState>) -> Result<JobThreads> {
    let (load_tx, load_rx) = unbounded::<Job>();
    let (store_tx, store_rx) = bounded::<Job>(state.config.store_queue_jobs);
    let mut threads = Vec::new();
    for i in 0..state.config.load_threads {
        let sh = Arc::clone(state);
        let rx = load_rx.clone();
        threads.push(spawn(format!("kvtier-load-{i}"), move || {
            for job in rx.iter() {
                let results = execute_get(&sh, &job.keys, Some(&job.buffers));
                sh.job_done(&sh.loads_active);
                finish_job(&sh, job.id, results);
            }
        })?);
    }
    let sh = Arc::clone(state);
    threads.push(spawn("kvtier-store".into(), move || {
        for job in store_rx.iter() {
            // Stores yield to loads: a store job waits (bounded) while loads are queued or running.
            sh.wait_idle(&sh.loads_active, Instant::now() + STORE_YIELD_LIMIT);
            let results = execute_put(&sh, &job.keys, &job.buffers);
            finish_job(&sh, job.id, results);
            sh.job_done(&sh.stores_active);
        }
    })?);
    let (probe_stop, stop_rx) = bounded::<()>(0);
    // Also for NVMe alone: it settles NVMe reads given up on a hung disk, whose finishing brings the
    // tier back, while no load may come to settle them (lookups do not offer a sick tier).
    if state.remote.any() || state.geometry.is_some() {
        let sh = Arc::clone(state);
        threads.push(spawn("kvtier-probe".into(), move || probe_sick_tiers(&sh, &stop_rx))?);
    }
    Ok(JobThreads { load_tx, store_tx, probe_stop, threads })
}

fn log_store_open(state: &StoreState, first_dir: &Path, engine_name: &str) {
    log::info!(
        "kvtier: store open at {} (namespace {}), {} DRAM slots of {} bytes, NVMe {} bytes on {} device(s), engine {}",
        first_dir.display(),
        &state.namespace.hex()[..16],
        state.arena.slot_count(),
        state.config.slot_bytes(),
        state.config.nvme_bytes,
        state.devices.len(),
        engine_name
    );
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new().name(name).spawn(f).map_err(|e| Error::io("spawning a kvtier thread", e))
}

fn take_lock(dir: &std::path::Path) -> Result<File> {
    let path = dir.join("LOCK");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .map_err(|e| Error::io(format!("creating {} (is the directory writable?)", path.display()), e))?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(file),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(Error::Locked { path: dir.to_path_buf() }),
        Err(e) => Err(Error::io(format!("locking {}", path.display()), e.into())),
    }
}

/// Picks the I/O engine (self-test for `auto`) and starts one device queue per file.
fn start_devices(
    config: &StoreConfig,
    files: &[DeviceFile],
    ranges: &[RegisteredRange],
    stats: &Arc<Stats>,
) -> Result<(&'static str, bool, Vec<DeviceQueue>)> {
    if files.is_empty() {
        return Ok(("none", false, Vec::new()));
    }
    let use_uring = match config.io_engine {
        EngineChoice::Psync => {
            log::info!("kvtier: I/O engine psync (forced by io_engine=\"psync\")");
            false
        }
        EngineChoice::IoUring => match uring_self_test(&files[0]) {
            Ok(()) => true,
            Err(e) => {
                return Err(Error::config(
                    "io_engine",
                    format!("io_uring was forced but its self-test failed ({e}); enable io_uring (kernel.io_uring_disabled=0, container seccomp) or set io_engine=\"auto\""),
                ))
            }
        },
        EngineChoice::Auto => match uring_self_test(&files[0]) {
            Ok(()) => {
                log::info!("kvtier: I/O engine io_uring (self-test passed)");
                true
            }
            Err(e) => {
                log::warn!("kvtier: I/O engine psync: io_uring self-test failed ({e}); io_uring may be disabled here");
                false
            }
        },
    };
    let mut queues = Vec::new();
    let mut registered_all = use_uring;
    for file in files {
        let fd = file.file.as_raw_fd();
        let name = format!("{}", file.index);
        #[cfg_attr(not(any(test, feature = "testing")), allow(unused_mut))]
        let mut engine: Box<dyn IoEngine> = if use_uring {
            let e = UringEngine::new(config.io_depth as u32, fd, ranges, &file.path.display().to_string())
                .map_err(|e| Error::io("creating an io_uring", e))?;
            registered_all &= e.buffers_registered();
            Box::new(e)
        } else {
            Box::new(
                PsyncEngine::new(config.io_depth.min(8), &name).map_err(|e| Error::io("starting psync threads", e))?,
            )
        };
        #[cfg(any(test, feature = "testing"))]
        if let Some(plan) = &config.fault_plan {
            engine = Box::new(FaultyEngine::new(engine, Arc::clone(plan)));
        }
        queues.push(
            DeviceQueue::start(
                &name,
                fd,
                engine,
                config.io_depth,
                config.max_write_inflight_bytes,
                Some(Arc::clone(stats)),
            )
            .map_err(|e| Error::io("starting a device thread", e))?,
        );
    }
    let name = if use_uring { "io_uring" } else { "psync" };
    Ok((name, registered_all, queues))
}

/// Reads the superblock through a fresh ring and checks the bytes match a plain pread.
fn uring_self_test(file: &DeviceFile) -> std::io::Result<()> {
    let fd = file.file.as_raw_fd();
    let mut engine = UringEngine::new(8, fd, &[], "self-test")?;
    let buf = AlignedBuf::zeroed(SUPERBLOCK_BYTES);
    let request = IoRequest {
        token: 7,
        kind: OpKind::Read,
        fd,
        offset: 0,
        buf: buf.as_ptr(),
        len: SUPERBLOCK_BYTES,
        iov: std::ptr::null(),
        iov_count: 0,
    };
    if let Err(e) = engine.submit(&[request]) {
        if e.accepted > 0 {
            // The kernel took the read: its buffer must outlive whatever it still does.
            std::mem::forget(buf);
        }
        return Err(e.error);
    }
    let mut out: Vec<IoCompletion> = Vec::new();
    if let Err(e) = engine.wait(1, &mut out) {
        // The read may still be in flight: neither its buffer nor its ring may go away.
        std::mem::forget(buf);
        std::mem::forget(engine);
        return Err(e);
    }
    match out.first() {
        Some(c) if c.token == 7 && c.result == SUPERBLOCK_BYTES as i64 => {}
        Some(c) if c.result < 0 => return Err(std::io::Error::from_raw_os_error((-c.result) as i32)),
        other => return Err(std::io::Error::other(format!("unexpected completion {other:?}"))),
    }
    let mut expected = AlignedBuf::zeroed(SUPERBLOCK_BYTES);
    nvme::read_exact_at(file, expected.as_mut_slice(), 0).map_err(|e| std::io::Error::other(e.to_string()))?;
    if expected.as_slice() != buf.as_slice() {
        return Err(std::io::Error::other("io_uring read returned different bytes than pread"));
    }
    Ok(())
}
