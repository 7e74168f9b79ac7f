//! The store: opens the tiers, wires the catalog (control plane) to the mover (data plane) and the
//! device queues, and offers the blocking and asynchronous APIs.
//!
//! Directory layout: `<path>/<namespace hex>/` holds `LOCK` (an exclusive flock held while the store
//! is open, in every path) and `nvme.kvt` (one device file per path).

use crate::admission::{Admission, WriteBudget};
use crate::catalog::{Catalog, Gauges, MetaWrite, SlotLayout};
use crate::config::StoreConfig;
use crate::error::{Error, Result};
use crate::format::encrypted::ValueCipher;
use crate::format::superblock::{Superblock, SUPERBLOCK_BYTES};
use crate::io::buffer::AlignedBuf;
use crate::io::device::DeviceQueue;
use crate::io::faults::FaultyEngine;
use crate::io::psync::PsyncEngine;
use crate::io::uring::UringEngine;
use crate::io::{EngineChoice, IoCompletion, IoEngine, IoRequest, OpKind, RegisteredRange};
use crate::key::{BlockKey, Namespace};
use crate::mover::{
    abort_puts, commit_puts, execute_get, execute_get_pinned, execute_put, execute_read_ahead, persist_reused,
    reserve_puts, submit_meta, wait_for_put_room, BlockBuffer, Reservation,
};
use crate::remote_tiers::RemoteTiers;
use crate::shared_state::{NvmeHealth, ReadAhead, Shared};
use crate::stats::{Stats, StatsSnapshot};
use crate::tiers::dram::Arena;
use crate::tiers::eviction::S3Fifo;
use crate::tiers::nvme::{self, DeviceFile, Geometry, RecoveredRegion};
use crate::tiers::remote::key::{load_key_bytes, KeySource};
use crossbeam_channel::{bounded, unbounded, Sender, TrySendError};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a store job yields to loads in progress before it runs anyway.
const STORE_YIELD_LIMIT: Duration = Duration::from_millis(100);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobKind {
    Get,
    Put,
}

/// An asynchronous job. The memory behind `buffers` must stay valid until the job is reported.
pub struct Job {
    pub id: u64,
    pub kind: JobKind,
    pub keys: Vec<BlockKey>,
    pub buffers: Vec<BlockBuffer>,
}

/// A shared DRAM pool as other processes map it: slot `i`'s value starts at
/// `i * slot_bytes + value_offset` of the file.
#[derive(Debug, Clone)]
pub struct PoolLayout {
    pub path: std::path::PathBuf,
    pub pool_bytes: usize,
    pub slot_bytes: usize,
    pub slot_count: usize,
    pub value_offset: usize,
}

/// Counters plus gauges, as `Store::stats` returns them.
#[derive(Debug, Clone)]
pub struct StoreStats {
    pub counters: StatsSnapshot,
    pub gauges: Gauges,
    pub io_engine: &'static str,
    pub direct_io: bool,
    pub buffers_registered: bool,
    /// The DRAM pool is backed by huge pages (MAP_HUGETLB); else transparent huge pages were asked for.
    pub huge_pages: bool,
    pub namespace_hex: String,
}

/// Names the encryption key file when `encryption_key_file` is unset.
pub const ENCRYPTION_KEY_FILE_ENV: &str = "KVTIER_ENCRYPTION_KEY_FILE";

pub struct Store {
    shared: Arc<Shared>,
    load_tx: Mutex<Option<Sender<Job>>>,
    store_tx: Mutex<Option<Sender<Job>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    closed: AtomicBool,
    io_engine: &'static str,
    buffers_registered: bool,
    direct_io: bool,
    /// The directory locks (one per path); released by `close`.
    locks: Mutex<Vec<File>>,
}

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
        let geometry = nvme_geometry(&config, &dirs, slot_bytes)?;
        let mut catalog = new_catalog(&config, &arena, geometry, dirs.len(), &stats);
        let cipher = open_value_cipher(&config)?;
        let (device_files, startup_meta) = match &geometry {
            Some(geometry) => {
                open_and_recover_devices(&config, &dirs, namespace, geometry, &mut catalog, cipher.as_deref())?
            }
            None => (Vec::new(), Vec::new()),
        };
        let remote = RemoteTiers::open(&config, namespace, &stats, cipher.as_ref())?;
        let (engine_name, buffers_registered, devices) =
            start_devices(&config, &device_files, &arena.registration_ranges(), &stats)?;
        let direct_io = device_files.iter().all(|d| d.direct) && !device_files.is_empty();
        let read_ahead = ReadAhead::new(arena.slot_count());
        let admission = open_admission(&config, &dirs, geometry.is_some());
        let nvme_health = NvmeHealth::new(config.tier_health, Arc::clone(&stats));
        let shared = Arc::new(Shared {
            geometry,
            namespace,
            catalog: Mutex::new(catalog),
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
        submit_meta(&shared, startup_meta);
        set_publishers_refetch(&shared);
        let JobThreads { load_tx, store_tx, threads } = start_job_threads(&shared)?;
        log_store_open(&shared, &dirs[0], engine_name);
        Ok(Store {
            shared,
            load_tx: Mutex::new(Some(load_tx)),
            store_tx: Mutex::new(Some(store_tx)),
            threads: Mutex::new(threads),
            closed: AtomicBool::new(false),
            io_engine: engine_name,
            buffers_registered,
            direct_io,
            locks: Mutex::new(locks),
        })
    }

    /// The store's internals, for `maintenance` (verify, trim, inspect).
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    pub(crate) fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    pub fn object_bytes(&self) -> usize {
        self.shared.config.object_bytes
    }

    pub fn namespace(&self) -> Namespace {
        self.shared.namespace
    }

    fn check_buffers(&self, keys: usize, buffers: &[BlockBuffer]) -> Result<()> {
        if keys != buffers.len() {
            return Err(Error::config(
                "buffers",
                format!("{keys} keys but {} buffers; pass one buffer per key", buffers.len()),
            ));
        }
        let want = self.object_bytes();
        if let Some(b) = buffers.iter().find(|b| b.total_bytes() != want) {
            return Err(Error::config(
                "buffers",
                format!(
                    "a buffer holds {} bytes but object_bytes is {want}; pass buffers of exactly object_bytes",
                    b.total_bytes()
                ),
            ));
        }
        Ok(())
    }

    /// Stores blocks; `true` per block stored or already present, `false` if dropped.
    pub fn put_many(&self, keys: &[BlockKey], values: &[&[u8]]) -> Result<Vec<bool>> {
        let buffers: Vec<_> = values.iter().map(|v| BlockBuffer::single(v.as_ptr() as *mut u8, v.len())).collect();
        // SAFETY: the slices outlive this blocking call and are only read.
        unsafe { self.put_raw(keys, &buffers) }
    }

    /// Fills `out`; `true` per block found and verified.
    pub fn get_many(&self, keys: &[BlockKey], out: &mut [&mut [u8]]) -> Result<Vec<bool>> {
        let buffers: Vec<_> = out.iter_mut().map(|v| BlockBuffer::single(v.as_mut_ptr(), v.len())).collect();
        // SAFETY: the slices outlive this blocking call and are exclusively borrowed.
        unsafe { self.get_raw(keys, &buffers) }
    }

    /// # Safety
    /// Every segment must be valid for reading for the duration of the call.
    pub unsafe fn put_raw(&self, keys: &[BlockKey], buffers: &[BlockBuffer]) -> Result<Vec<bool>> {
        self.check_open()?;
        self.check_buffers(keys.len(), buffers)?;
        let stored = execute_put(&self.shared, keys, buffers);
        assert_eq!(stored.len(), keys.len(), "one answer per key, in the caller's order");
        Ok(stored)
    }

    /// # Safety
    /// Every segment must be valid for writing and not accessed by others for the duration of the call.
    pub unsafe fn get_raw(&self, keys: &[BlockKey], buffers: &[BlockBuffer]) -> Result<Vec<bool>> {
        self.check_open()?;
        self.check_buffers(keys.len(), buffers)?;
        let found = execute_get(&self.shared, keys, Some(buffers));
        assert_eq!(found.len(), keys.len(), "one answer per key, in the caller's order");
        Ok(found)
    }

    /// Queues a job; its result is reported by `poll` or `wait`. A store job that finds the store
    /// queue full is dropped at once (all `false`) and counted.
    ///
    /// # Safety
    /// The job's segments must stay valid (and, for loads, untouched) until the job is reported.
    pub unsafe fn submit(&self, job: Job) -> Result<()> {
        self.check_open()?;
        self.check_buffers(job.keys.len(), &job.buffers)?;
        match job.kind {
            JobKind::Get => {
                self.shared.loads_active.fetch_add(1, Ordering::AcqRel);
                let sent = self.load_tx.lock().as_ref().is_some_and(|tx| tx.send(job).is_ok());
                if !sent {
                    self.shared.job_done(&self.shared.loads_active);
                    return Err(Error::Closed);
                }
            }
            JobKind::Put => {
                self.shared.stores_active.fetch_add(1, Ordering::AcqRel);
                let tx = self.store_tx.lock();
                let Some(tx) = tx.as_ref() else {
                    self.shared.job_done(&self.shared.stores_active);
                    return Err(Error::Closed);
                };
                match tx.try_send(job) {
                    Ok(()) => {}
                    Err(TrySendError::Full(job)) => {
                        self.shared.job_done(&self.shared.stores_active);
                        Stats::add(&self.shared.stats.dropped_stores, job.keys.len() as u64);
                        finish_job(&self.shared, job.id, vec![false; job.keys.len()]);
                    }
                    Err(TrySendError::Disconnected(_)) => {
                        self.shared.job_done(&self.shared.stores_active);
                        return Err(Error::Closed);
                    }
                }
            }
        }
        Ok(())
    }

    /// Jobs finished since the last poll.
    pub fn poll(&self) -> Vec<(u64, Vec<bool>)> {
        self.shared.finished.lock().drain().collect()
    }

    /// Waits for one job; `None` timeout waits without limit.
    pub fn wait(&self, job_id: u64, timeout: Option<Duration>) -> Result<Vec<bool>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut finished = self.shared.finished.lock();
        loop {
            if let Some(r) = finished.remove(&job_id) {
                return Ok(r);
            }
            match deadline {
                Some(d) => {
                    if self.shared.finished_cv.wait_until(&mut finished, d).timed_out() {
                        if let Some(r) = finished.remove(&job_id) {
                            return Ok(r);
                        }
                        return Err(Error::Timeout {
                            what: format!("job {job_id}"),
                            timeout_ms: timeout.unwrap().as_millis() as u64,
                        });
                    }
                }
                None => self.shared.finished_cv.wait(&mut finished),
            }
        }
    }

    /// Leading keys present in DRAM, NVMe or the shared index (and offered: see `locate_many`).
    pub fn lookup_prefix(&self, keys: &[BlockKey]) -> usize {
        let cat = self.shared.catalog.lock();
        keys.iter().take_while(|k| self.offered_tier(&cat, k).is_some()).count()
    }

    pub fn contains_many(&self, keys: &[BlockKey]) -> Vec<bool> {
        let cat = self.shared.catalog.lock();
        keys.iter().map(|k| self.offered_tier(&cat, k).is_some()).collect()
    }

    /// The tier each block would be served from (memory only, no I/O). A block only a sick tier
    /// holds (NVMe or remote, in its back-off) is not offered: a counted miss the engine recomputes.
    pub fn locate_many(&self, keys: &[BlockKey]) -> Vec<Option<crate::catalog::Tier>> {
        let cat = self.shared.catalog.lock();
        keys.iter().map(|k| self.offered_tier(&cat, k)).collect()
    }

    /// Where `key` is served from, if offered: DRAM, NVMe unless it is sick, then a remote tier.
    fn offered_tier(&self, cat: &Catalog, key: &BlockKey) -> Option<crate::catalog::Tier> {
        use crate::catalog::Tier;
        match cat.locate(key) {
            Some(Tier::Nvme) if !self.shared.nvme_health.offered() => None,
            None if self.shared.remote.contains(key) => Some(Tier::Shared),
            tier => tier,
        }
    }

    /// Pins the leading present keys: one flag per present key, in order. `true`: a pin was taken
    /// (release it with `unpin`). `false`: the block is only in the shared tier, which cannot be
    /// pinned against another node's evictor (its load may be a clean miss); there is nothing to
    /// release, and unpinning it would take away a pin that another request holds.
    pub fn pin_prefix(&self, keys: &[BlockKey]) -> Vec<bool> {
        let mut cat = self.shared.catalog.lock();
        let mut pinned = Vec::with_capacity(keys.len());
        for key in keys {
            match self.offered_tier(&cat, key) {
                None => break,
                Some(crate::catalog::Tier::Shared) => pinned.push(false),
                Some(_) => {
                    let took = cat.pin_prefix(std::slice::from_ref(key));
                    assert_eq!(took, 1, "a block the catalog locates is visible, and a visible block pins");
                    pinned.push(true);
                }
            }
        }
        debug_assert!(pinned.len() <= keys.len(), "a flag per leading present key");
        drop(cat);
        persist_reused(&self.shared);
        pinned
    }

    pub fn unpin(&self, keys: &[BlockKey]) {
        self.shared.catalog.lock().unpin(keys);
        self.shared.changed.notify_all();
    }

    /// Releases the slots `acquire` handed out (their copies are done).
    pub fn release(&self, keys: &[BlockKey]) {
        self.shared.catalog.lock().release_readers(keys);
        self.shared.changed.notify_all();
    }

    /// Waits until every accepted store (queued jobs included) is on NVMe, then syncs the files.
    pub fn flush(&self) -> Result<()> {
        self.check_open()?;
        self.flush_inner()
    }

    fn flush_inner(&self) -> Result<()> {
        let sh = &self.shared;
        let limit = Duration::from_secs(120);
        let deadline = Instant::now() + limit;
        if !sh.wait_idle(&sh.stores_active, deadline) {
            return Err(Error::Timeout { what: "queued stores".into(), timeout_ms: limit.as_millis() as u64 });
        }
        let mut cat = sh.catalog.lock();
        while !cat.io_idle() {
            if sh.changed.wait_until(&mut cat, deadline).timed_out() && !cat.io_idle() {
                return Err(Error::Timeout { what: "NVMe writes".into(), timeout_ms: limit.as_millis() as u64 });
            }
        }
        drop(cat);
        for d in &sh.device_files {
            d.file.sync_data().map_err(|e| Error::io(format!("fdatasync {}", d.path.display()), e))?;
        }
        sh.remote.flush(limit)?;
        // Dates are a convenience: a directory that cannot take the file (removed, read-only) must
        // not fail a flush of blocks that did reach the disk.
        if let Err(e) = self.save_timeline() {
            log::warn!("kvtier: saving block dates failed: {e}; blocks stored since the last save will be dated by the next open");
        }
        Ok(())
    }

    /// Saves the timeline that dates this namespace's blocks, when it changed since the last save
    /// (stores with an NVMe tier: without one nothing survives a restart to be dated). `flush` and
    /// `close` call it; so does the host service, every few seconds.
    pub fn save_timeline(&self) -> Result<()> {
        let sh = &self.shared;
        let Some(dir) = sh.device_files.first().and_then(|d| d.path.parent()) else { return Ok(()) };
        let Some(points) = sh.catalog.lock().timeline.take_unsaved() else { return Ok(()) };
        crate::namespace_dir::write_timeline(dir, &points).inspect_err(|_| sh.catalog.lock().timeline.mark_unsaved())
    }

    /// Flushes, stops the threads and releases the directory. Idempotent.
    pub fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // One deadline for what the remote tiers still send, the last flush's included: a frozen
        // bucket must not hold a close (and the service's lock of its namespace) request by request.
        self.shared.remote.closing();
        self.load_tx.lock().take();
        self.store_tx.lock().take();
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
        let flushed = self.flush_inner();
        self.shared.remote.close();
        for d in &self.shared.devices {
            d.shutdown();
        }
        self.wait_for_given_up_reads();
        self.locks.lock().clear();
        flushed
    }

    /// Reads the loads gave up still write into DRAM slots until they finish: the shared tier's
    /// finished when its queue shut down; an object GET ends within its request timeout. One that
    /// outlives that leaves the pool mapped for good rather than let it write into other memory.
    fn wait_for_given_up_reads(&self) {
        let timeout_ms = self.shared.config.bucket.as_ref().map_or(0, |b| b.request_timeout_ms);
        let deadline = Instant::now() + Duration::from_millis(timeout_ms) + Duration::from_secs(1);
        if !self.shared.late_reads.wait_outstanding(deadline) {
            log::error!("kvtier: remote reads given up by loads still run at close; the DRAM pool stays mapped");
            self.shared.arena.keep_mapped();
        }
    }

    pub fn stats(&self) -> StoreStats {
        let mut gauges = self.shared.catalog.lock().gauges();
        if let Some((bytes_per_day, left_bytes)) = self.shared.admission.nvme_budget() {
            gauges.nvme_write_budget_bytes_per_day = bytes_per_day;
            gauges.nvme_write_budget_left_bytes = left_bytes;
        }
        StoreStats {
            counters: self.shared.stats.snapshot(),
            gauges,
            io_engine: self.io_engine,
            direct_io: self.direct_io,
            buffers_registered: self.buffers_registered,
            huge_pages: self.shared.arena.huge_pages(),
            namespace_hex: self.shared.namespace.hex(),
        }
    }

    // ---- Split puts and gets: slots filled and read by other processes through the shared pool ----

    /// Where the DRAM pool lives when it is shared (`pool_path`): the file and its slot geometry.
    pub fn pool(&self) -> Option<PoolLayout> {
        let arena = &self.shared.arena;
        arena.file().map(|path| PoolLayout {
            path: path.to_path_buf(),
            pool_bytes: arena.mapped_bytes(),
            slot_bytes: arena.slot_bytes(),
            slot_count: arena.slot_count(),
            value_offset: crate::format::descriptor::DESCRIPTOR_BYTES,
        })
    }

    /// Reserves a DRAM slot per block for writers in other processes. Never waits: a block with no
    /// slot to be had now is `Dropped`, and not counted (the caller may wait and retry; it counts
    /// its final drops with `count_dropped_stores`). Commit or abort every `Fill`.
    pub fn try_reserve_puts(&self, keys: &[BlockKey]) -> Result<Vec<Reservation>> {
        self.check_open()?;
        Ok(reserve_puts(&self.shared, keys))
    }

    /// Counts stores given up (`dropped_stores`).
    pub fn count_dropped_stores(&self, blocks: u64) {
        Stats::add(&self.shared.stats.dropped_stores, blocks);
    }

    /// How long a put may wait for room (`slot_wait_ms`).
    pub fn slot_wait_ms(&self) -> u64 {
        self.shared.config.slot_wait_ms
    }

    /// Waits until the NVMe write backlog admits a put; `false` if it did not by `deadline`. Call it
    /// before `try_reserve_puts` without holding anything the writers need.
    pub fn wait_for_put_room_until(&self, deadline: Instant) -> bool {
        wait_for_put_room(&self.shared, deadline)
    }

    /// The reserved slots' values are complete: (key, slot, sequence) of each `Fill`.
    pub fn commit_puts(&self, fills: &[(BlockKey, u32, u64)]) -> Result<()> {
        self.check_open()?;
        commit_puts(&self.shared, fills);
        Ok(())
    }

    /// Reserved slots that will not be filled (their writers gave up or died): (key, slot).
    pub fn abort_puts(&self, fills: &[(BlockKey, u32)]) {
        abort_puts(&self.shared, fills);
    }

    /// Reserved fills given up while their writers may still copy into the slots (counted as dropped
    /// stores): the blocks and their share of the write backlog go now, the slots stay out of use
    /// until `free_abandoned_slots`.
    pub fn abandon_puts(&self, fills: &[(BlockKey, u32)]) {
        let mut cat = self.shared.catalog.lock();
        for (key, slot) in fills {
            cat.abandon_put(key, *slot);
        }
        drop(cat);
        Stats::add(&self.shared.stats.dropped_stores, fills.len() as u64);
        self.shared.changed.notify_all();
    }

    /// Abandoned slots (`abandon_puts`) no writer can copy into any more.
    pub fn free_abandoned_slots(&self, slots: &[u32]) {
        let mut cat = self.shared.catalog.lock();
        for &slot in slots {
            cat.free_abandoned_slot(slot);
        }
        drop(cat);
        self.shared.changed.notify_all();
    }

    /// Reads blocks ahead of their load: those on NVMe, in the shared or the object tier are read into
    /// DRAM (verified) and stay there, unpinned; `true` per block resident afterwards. What an
    /// engine's scheduler asks at lookup, so that the load is a DRAM copy. A read counts as a hit of
    /// the tier it came from; the load that then serves the block counts `read_ahead_hits`, not a
    /// DRAM hit, and neither a block already in DRAM nor a missing one counts anything here: every
    /// block a load serves is one hit, of the tier it came from.
    pub fn read_ahead(&self, keys: &[BlockKey]) -> Result<Vec<bool>> {
        self.load_on_this_thread(keys, execute_read_ahead)
    }

    /// Makes blocks resident in DRAM (reading NVMe or the shared tier, verified) and pins them: per
    /// key the slot to copy the value out of, or `None` for a miss. Give each slot back with `release`.
    pub fn acquire(&self, keys: &[BlockKey]) -> Result<Vec<Option<u32>>> {
        self.load_on_this_thread(keys, execute_get_pinned)
    }

    /// Runs a load on the calling thread, counted in `loads_active` so that store jobs yield to it.
    fn load_on_this_thread<T>(
        &self,
        keys: &[BlockKey],
        load: impl FnOnce(&Arc<Shared>, &[BlockKey]) -> Vec<T>,
    ) -> Result<Vec<T>> {
        self.check_open()?;
        let sh = &self.shared;
        sh.loads_active.fetch_add(1, Ordering::AcqRel);
        let answers = load(sh, keys);
        sh.job_done(&sh.loads_active);
        assert_eq!(answers.len(), keys.len(), "one answer per key");
        Ok(answers)
    }

    /// Checks the catalog's internal invariants (for tests).
    pub fn check_invariants(&self) {
        self.shared.catalog.lock().check_invariants();
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            log::warn!("kvtier: closing the store: {e}");
        }
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

/// The NVMe geometry, `None` when the NVMe tier is off; fails if a device file still to be created
/// would not fit on its disk.
fn nvme_geometry(config: &StoreConfig, dirs: &[PathBuf], slot_bytes: usize) -> Result<Option<Geometry>> {
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
        if !dir.join(nvme::DEVICE_FILE_NAME).exists() {
            nvme::check_free_space(dir, geometry.file_bytes())?;
        }
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
        Box::new(S3Fifo::new(arena.slot_count())),
        geometry.map(|g| (g, device_count)),
        Arc::clone(stats),
    );
    catalog.set_loads_cancel_writes(config.loads_cancel_queued_writes);
    catalog
}

/// Opens (or creates) one device file per directory, device `i` in `dirs[i]`, and hands the blocks
/// recovered from existing ones to `catalog`: the device files, and the metadata writes that
/// adopting them needs once the device queues run.
/// The store's admission below DRAM, with the NVMe tier's write budget sized from the filesystems
/// holding its directories (a filesystem that cannot be measured counts nothing).
fn open_admission(config: &StoreConfig, dirs: &[PathBuf], nvme: bool) -> Admission {
    let filesystem_bytes: u64 = dirs
        .iter()
        .filter_map(|dir| rustix::fs::statvfs(dir).ok())
        .map(|fs| fs.f_blocks.saturating_mul(fs.f_frsize))
        .sum();
    let bytes_per_day = if nvme { config.nvme_write_budget_bytes_per_day(filesystem_bytes) } else { 0 };
    let budget = WriteBudget::new(bytes_per_day, config.write_budget_burst_s, Instant::now());
    let policies = (config.write_admission, config.remote_write_admission.unwrap_or(config.write_admission));
    Admission::new(policies, config.write_admission_memory_blocks, budget)
}

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
fn set_publishers_refetch(shared: &Arc<Shared>) {
    shared.remote.set_refetch(|| {
        // Weak: the publisher belongs to `shared`, and a strong reference would keep it alive.
        let weak = Arc::downgrade(shared);
        Box::new(move |key, out| weak.upgrade().is_some_and(|sh| crate::mover::copy_resident_block(&sh, key, out)))
    });
}

/// The load threads and the store thread, with the senders of their job queues.
struct JobThreads {
    load_tx: Sender<Job>,
    store_tx: Sender<Job>,
    threads: Vec<JoinHandle<()>>,
}

/// Starts the load threads and the store thread.
fn start_job_threads(shared: &Arc<Shared>) -> Result<JobThreads> {
    let (load_tx, load_rx) = unbounded::<Job>();
    let (store_tx, store_rx) = bounded::<Job>(shared.config.store_queue_jobs);
    let mut threads = Vec::new();
    for i in 0..shared.config.load_threads {
        let sh = Arc::clone(shared);
        let rx = load_rx.clone();
        threads.push(spawn(format!("kvtier-load-{i}"), move || {
            for job in rx.iter() {
                let results = execute_get(&sh, &job.keys, Some(&job.buffers));
                sh.job_done(&sh.loads_active);
                finish_job(&sh, job.id, results);
            }
        })?);
    }
    let sh = Arc::clone(shared);
    threads.push(spawn("kvtier-store".into(), move || {
        for job in store_rx.iter() {
            // Stores yield to loads: a store job waits (bounded) while loads are queued or running.
            sh.wait_idle(&sh.loads_active, Instant::now() + STORE_YIELD_LIMIT);
            let results = execute_put(&sh, &job.keys, &job.buffers);
            finish_job(&sh, job.id, results);
            sh.job_done(&sh.stores_active);
        }
    })?);
    Ok(JobThreads { load_tx, store_tx, threads })
}

fn log_store_open(shared: &Shared, first_dir: &Path, engine_name: &str) {
    log::info!(
        "kvtier: store open at {} (namespace {}), {} DRAM slots of {} bytes, NVMe {} bytes on {} device(s), engine {}",
        first_dir.display(),
        &shared.namespace.hex()[..16],
        shared.arena.slot_count(),
        shared.config.slot_bytes(),
        shared.config.nvme_bytes,
        shared.devices.len(),
        engine_name
    );
}

fn finish_job(sh: &Shared, id: u64, results: Vec<bool>) {
    sh.finished.lock().insert(id, results);
    sh.finished_cv.notify_all();
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

/// 64 random bits (the kernel's; the time and pid where it refuses).
pub(crate) fn random_u64() -> u64 {
    let mut buf = [0u8; 8];
    if rustix::rand::getrandom(&mut buf, rustix::rand::GetRandomFlags::empty()).is_err() {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        return t.as_nanos() as u64 ^ std::process::id() as u64;
    }
    u64::from_le_bytes(buf)
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
