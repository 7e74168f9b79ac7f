//! The store: opens the tiers, wires the catalog (control plane) to the mover (data plane) and the
//! device queues, and offers the blocking and asynchronous APIs. Opening it, phase by phase, is
//! `open.rs`; here is the running store.
//!
//! Directory layout: `<path>/<namespace hex>/` holds `LOCK` (an exclusive flock held while the store
//! is open, in every path) and `nvme.kvt` (one device file per path).

use crate::catalog::{Catalog, Gauges};
use crate::error::{Error, Result};
use crate::io::bounded::{finish_within, Overdue};
use crate::key::{BlockKey, Namespace};
use crate::mover::{
    abort_puts, commit_puts, execute_get, execute_get_pinned, execute_put, execute_read_ahead, persist_reused,
    reserve_puts, wait_for_put_room, BlockBuffer, Reservation,
};
use crate::stats::{Stats, StatsSnapshot};
use crate::store_state::StoreState;
use crossbeam_channel::{Sender, TrySendError};
use parking_lot::Mutex;
use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod budgets;
mod open;
mod saves;
mod takeover;

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
    /// Per tenant of the DRAM pool (only when it is split, `tenant_dram_share`): `(name, value)`
    /// pairs named `<figure>:<tenant label>` (`tenant_fields`).
    pub tenant_fields: Vec<(String, u64)>,
}

/// Names the encryption key file when `encryption_key_file` is unset.
pub const ENCRYPTION_KEY_FILE_ENV: &str = "KVTIER_ENCRYPTION_KEY_FILE";

pub struct Store {
    state: Arc<StoreState>,
    load_tx: Mutex<Option<Sender<Job>>>,
    store_tx: Mutex<Option<Sender<Job>>>,
    /// Dropped at close: the prober of sick remote tiers stops (`mover::probe_sick_tiers`).
    probe_stop: Mutex<Option<Sender<()>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    closed: AtomicBool,
    io_engine: &'static str,
    buffers_registered: bool,
    direct_io: bool,
    /// The directory locks (one per path); released by `close`.
    locks: Mutex<Vec<File>>,
    /// A save of the block dates and budgets is running (`save_namespace_state`).
    dates_saving: Arc<AtomicBool>,
    /// The write budgets' changes the last saved `WRITE_BUDGET` counted (`budgets::to_save`).
    budgets_saved_changes: Arc<AtomicU64>,
}

impl Store {
    /// The store's internals, for `maintenance` (verify, trim, inspect).
    pub(crate) fn state(&self) -> &Arc<StoreState> {
        &self.state
    }

    pub(crate) fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    pub fn object_bytes(&self) -> usize {
        self.state.config.object_bytes
    }

    pub fn namespace(&self) -> Namespace {
        self.state.namespace
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
        let stored = execute_put(&self.state, keys, buffers);
        assert_eq!(stored.len(), keys.len(), "one answer per key, in the caller's order");
        Ok(stored)
    }

    /// # Safety
    /// Every segment must be valid for writing and not accessed by others for the duration of the call.
    pub unsafe fn get_raw(&self, keys: &[BlockKey], buffers: &[BlockBuffer]) -> Result<Vec<bool>> {
        self.check_open()?;
        self.check_buffers(keys.len(), buffers)?;
        let found = execute_get(&self.state, keys, Some(buffers));
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
                self.state.loads_active.fetch_add(1, Ordering::AcqRel);
                let sent = self.load_tx.lock().as_ref().is_some_and(|tx| tx.send(job).is_ok());
                if !sent {
                    self.state.job_done(&self.state.loads_active);
                    return Err(Error::Closed);
                }
            }
            JobKind::Put => {
                self.state.stores_active.fetch_add(1, Ordering::AcqRel);
                let tx = self.store_tx.lock();
                let Some(tx) = tx.as_ref() else {
                    self.state.job_done(&self.state.stores_active);
                    return Err(Error::Closed);
                };
                match tx.try_send(job) {
                    Ok(()) => {}
                    Err(TrySendError::Full(job)) => {
                        self.state.job_done(&self.state.stores_active);
                        Stats::add(&self.state.stats.dropped_stores, job.keys.len() as u64);
                        finish_job(&self.state, job.id, vec![false; job.keys.len()]);
                    }
                    Err(TrySendError::Disconnected(_)) => {
                        self.state.job_done(&self.state.stores_active);
                        return Err(Error::Closed);
                    }
                }
            }
        }
        Ok(())
    }

    /// Jobs finished since the last poll.
    pub fn poll(&self) -> Vec<(u64, Vec<bool>)> {
        self.state.finished.lock().drain().collect()
    }

    /// Waits for one job; `None` timeout waits without limit.
    pub fn wait(&self, job_id: u64, timeout: Option<Duration>) -> Result<Vec<bool>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut finished = self.state.finished.lock();
        loop {
            if let Some(r) = finished.remove(&job_id) {
                return Ok(r);
            }
            match deadline {
                Some(d) => {
                    if self.state.finished_cv.wait_until(&mut finished, d).timed_out() {
                        if let Some(r) = finished.remove(&job_id) {
                            return Ok(r);
                        }
                        return Err(Error::Timeout {
                            what: format!("job {job_id}"),
                            timeout_ms: timeout.unwrap().as_millis() as u64,
                        });
                    }
                }
                None => self.state.finished_cv.wait(&mut finished),
            }
        }
    }

    /// Leading keys present in DRAM, NVMe or the shared index (and offered: see `locate_many`).
    pub fn lookup_prefix(&self, keys: &[BlockKey]) -> usize {
        let cat = self.state.catalog.lock();
        keys.iter().take_while(|k| self.offered_tier(&cat, k).is_some()).count()
    }

    pub fn contains_many(&self, keys: &[BlockKey]) -> Vec<bool> {
        let cat = self.state.catalog.lock();
        let found: Vec<bool> = keys.iter().map(|k| self.offered_tier(&cat, k).is_some()).collect();
        debug_assert_eq!(found.len(), keys.len());
        found
    }

    /// The tier each block would be served from (memory only, no I/O). A block only a sick tier
    /// holds (NVMe or remote, in its back-off) is not offered: a counted miss the engine recomputes.
    pub fn locate_many(&self, keys: &[BlockKey]) -> Vec<Option<crate::catalog::Tier>> {
        let cat = self.state.catalog.lock();
        keys.iter().map(|k| self.offered_tier(&cat, k)).collect()
    }

    /// Where `key` is served from, if offered: DRAM, NVMe unless it is sick, then a remote tier.
    fn offered_tier(&self, cat: &Catalog, key: &BlockKey) -> Option<crate::catalog::Tier> {
        use crate::catalog::Tier;
        match cat.locate(key) {
            Some(Tier::Nvme) if !self.state.nvme_health.offered() => None,
            None => self.state.remote.locate(key),
            tier => tier,
        }
    }

    /// Pins the leading present keys: one flag per present key, in order. `true`: a pin was taken
    /// (release it with `unpin`). `false`: the block is only in a remote tier (the shared filesystem
    /// or the bucket), which cannot be pinned against another node's evictor (its load may be a clean miss); there is nothing to
    /// release, and unpinning it would take away a pin that another request holds.
    pub fn pin_prefix(&self, keys: &[BlockKey]) -> Vec<bool> {
        let mut cat = self.state.catalog.lock();
        let mut pinned = Vec::with_capacity(keys.len());
        for key in keys {
            match self.offered_tier(&cat, key) {
                None => break,
                Some(tier) if tier.is_remote() => pinned.push(false),
                Some(_) => {
                    let took = cat.pin_prefix(std::slice::from_ref(key));
                    assert_eq!(took, 1, "a block the catalog locates is visible, and a visible block pins");
                    pinned.push(true);
                }
            }
        }
        debug_assert!(pinned.len() <= keys.len(), "a flag per leading present key");
        drop(cat);
        persist_reused(&self.state);
        pinned
    }

    pub fn unpin(&self, keys: &[BlockKey]) {
        self.state.catalog.lock().unpin(keys);
        self.state.changed.notify_all();
    }

    /// Releases the slots `acquire` handed out (their copies are done).
    pub fn release(&self, keys: &[BlockKey]) {
        self.state.catalog.lock().release_readers(keys);
        self.state.changed.notify_all();
    }

    /// Waits until every accepted store (queued jobs included) is on NVMe, then syncs the files.
    pub fn flush(&self) -> Result<()> {
        self.check_open()?;
        self.flush_inner(true)
    }

    /// `remote`: also waits for the remote tiers' publishers to send what they hold (`close` does
    /// not: `close_remote_tiers` publishes it, within a bound a frozen mount cannot stretch).
    fn flush_inner(&self, remote: bool) -> Result<()> {
        let sh = &self.state;
        let deadline = Instant::now() + FLUSH_LIMIT;
        if !sh.wait_idle(&sh.stores_active, deadline) {
            return Err(Error::Timeout { what: "queued stores".into(), timeout_ms: FLUSH_LIMIT.as_millis() as u64 });
        }
        self.wait_for_nvme_writes(deadline)?;
        self.sync_device_files()?;
        if remote {
            sh.remote.flush(FLUSH_LIMIT)?;
        }
        // Dates and budgets are a convenience: a directory that cannot take the files (removed,
        // read-only) must not fail a flush of blocks that did reach the disk.
        if let Err(e) = self.save_namespace_state() {
            log::warn!(
                "kvtier: saving block dates and write budgets failed: {e}; blocks stored since the last save will be \
                 dated by the next open, and the budgets resume from the last save"
            );
        }
        Ok(())
    }

    /// Waits for the NVMe writes in flight, until `deadline`, or until the disk has answered none of
    /// its operations for `nvme_read_stall_ms` (a hung disk: they may never finish, and a flush or a
    /// close must not wait for them).
    fn wait_for_nvme_writes(&self, deadline: Instant) -> Result<()> {
        let sh = &self.state;
        let stall = Duration::from_millis(sh.config.nvme_read_stall_ms);
        let mut cat = sh.catalog.lock();
        while !cat.io_idle() {
            let look = if stall.is_zero() { deadline } else { deadline.min(Instant::now() + HUNG_DISK_LOOK) };
            cat.wait_until(&sh.changed, look);
            if cat.io_idle() {
                break;
            }
            if let Some(waited) = self.disk_hung_for(stall) {
                let what = "NVMe writes: the disk answered none of its operations (a hung disk, \
                            `nvme_read_stall_ms`); blocks not yet written are not on disk";
                return Err(Error::Timeout { what: what.into(), timeout_ms: waited.as_millis() as u64 });
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout { what: "NVMe writes".into(), timeout_ms: FLUSH_LIMIT.as_millis() as u64 });
            }
        }
        Ok(())
    }

    /// How long a device has had operations waiting with none finishing, once past `stall` (not 0).
    fn disk_hung_for(&self, stall: Duration) -> Option<Duration> {
        let now = Instant::now();
        let waited = self.state.devices.iter().filter_map(|d| d.stalled_for(now)).max();
        waited.filter(|&waited| !stall.is_zero() && waited >= stall)
    }

    /// fdatasync of every NVMe device file. With `nvme_read_stall_ms` set, each runs in a thread of
    /// its own and is given up after `SYNC_STALL_LIMITS` stall limits (a hung disk does not return
    /// from it); the thread then returns whenever the disk does.
    fn sync_device_files(&self) -> Result<()> {
        let stall = Duration::from_millis(self.state.config.nvme_read_stall_ms);
        for d in &self.state.device_files {
            let context = || format!("fdatasync {}", d.path.display());
            if stall.is_zero() {
                d.file.sync_data().map_err(|e| Error::io(context(), e))?;
                continue;
            }
            let file = d.file.try_clone().map_err(|e| Error::io(context(), e))?;
            let limit = stall * SYNC_STALL_LIMITS;
            match finish_within("kvtier-sync", limit, move || file.sync_data()) {
                Ok(synced) => synced.map_err(|e| Error::io(context(), e))?,
                Err(Overdue::NoThread(e)) => return Err(Error::io(context(), e)),
                Err(Overdue::Late) => {
                    let what = format!("{} (a hung disk?)", context());
                    return Err(Error::Timeout { what, timeout_ms: limit.as_millis() as u64 });
                }
            }
        }
        Ok(())
    }

    /// Flushes, stops the threads and releases the directory. Idempotent.
    pub fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // One deadline for what the remote tiers still send, the last flush's included: a frozen
        // bucket must not hold a close (and the service's lock of its namespace) request by request.
        self.state.remote.closing();
        self.load_tx.lock().take();
        self.store_tx.lock().take();
        self.probe_stop.lock().take();
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
        let flushed = self.flush_inner(false);
        if flushed.is_err() {
            // A flush that gave up (a slow disk) skipped the save: the budgets spent must not be lost.
            let _ = self.save_namespace_state();
        }
        let remote_closed = close_remote_tiers(&self.state);
        let stall = Duration::from_millis(self.state.config.nvme_read_stall_ms);
        // Every device is shut down, hung or not.
        let closed: Vec<bool> = self.state.devices.iter().map(|d| d.shutdown_within(stall)).collect();
        let devices_closed = closed.iter().all(|&c| c);
        self.wait_for_given_up_reads();
        if !remote_closed {
            // Its reads may still land in DRAM slots, and its thread holds the store's state.
            self.state.arena.keep_mapped();
        }
        if !remote_closed || !devices_closed {
            // A hung device's writes hold the store's state (and so its DRAM pool) until they finish:
            // its shared-memory file goes now, not whenever the disk answers, or never.
            self.state.arena.remove_file();
        }
        self.unlock_directories(stall, devices_closed);
        flushed
    }

    /// Lets go of the directory locks. Closing a file on a frozen FUSE or network filesystem waits
    /// for it (uninterruptibly): with a stall limit the files are closed on a thread of its own, waited
    /// for one limit, and not at all when a device hung (its thread may still write: the directory
    /// stays locked until the disk answers).
    fn unlock_directories(&self, stall: Duration, devices_closed: bool) {
        let locks = std::mem::take(&mut *self.locks.lock());
        if stall.is_zero() {
            return drop(locks);
        }
        let limit = if devices_closed { stall } else { Duration::ZERO };
        if let Err(Overdue::Late) = finish_within("kvtier-unlock", limit, move || drop(locks)) {
            if devices_closed {
                log::warn!("kvtier: the store's directory did not answer its unlock within {stall:?} (a frozen mount?); it is unlocked when it answers");
            }
        }
    }

    /// Reads the loads gave up still write into DRAM slots until they finish: the shared tier's
    /// finished when its queue shut down; an object GET ends within its request timeout. One that
    /// outlives that leaves the pool mapped for good rather than let it write into other memory.
    fn wait_for_given_up_reads(&self) {
        let timeout_ms = self.state.config.bucket.as_ref().map_or(0, |b| b.request_timeout_ms);
        let deadline = Instant::now() + Duration::from_millis(timeout_ms) + Duration::from_secs(1);
        if !self.state.late_reads.wait_outstanding(deadline) {
            log::error!("kvtier: reads given up by loads still run at close; the DRAM pool stays mapped");
            self.state.arena.keep_mapped();
        }
    }

    /// The write budgets the store takes from, by tier, each with what identifies it: namespaces in
    /// one store's directories share them (`WriteBudget::of_store`), which a sum over them counts once.
    pub(crate) fn write_budget_ids(&self) -> Vec<(crate::catalog::Tier, usize)> {
        budgets::by_tier(&self.state).into_iter().map(|(tier, budget)| (tier, budget as *const _ as usize)).collect()
    }

    pub fn stats(&self) -> StoreStats {
        let mut gauges = self.state.catalog.lock().gauges();
        for (tier, budget) in budgets::by_tier(&self.state) {
            let mut budget = budget.lock();
            gauges.set_write_budget(tier, budget.bytes_per_day(), budget.left_bytes(Instant::now()));
        }
        StoreStats {
            counters: self.state.stats.snapshot(),
            gauges,
            io_engine: self.io_engine,
            direct_io: self.direct_io,
            buffers_registered: self.buffers_registered,
            huge_pages: self.state.arena.huge_pages(),
            namespace_hex: self.state.namespace.hex(),
            tenant_fields: self.tenant_fields(),
        }
    }

    /// The DRAM pool by tenant: `tenant_dram_bytes`, `tenant_dram_guaranteed_bytes`,
    /// `tenant_dram_evictions`, with a cap `tenant_dram_cap_bytes` and, with the NVMe tier split too,
    /// `tenant_nvme_bytes` and `tenant_nvme_reclaimed_regions`, with the remote tiers split too
    /// `tenant_shared_bytes`, `tenant_shared_evicted_files`, `tenant_bucket_bytes` and
    /// `tenant_bucket_evicted_segments`, each `:<tenant label>`, and
    /// `untracked_tenant_blocks`; nothing when the pool is not split. `tenant_keys` (1) when blocks
    /// are encrypted under their tenant's key: either way stores are to be named by tenant.
    fn tenant_fields(&self) -> Vec<(String, u64)> {
        let cat = self.state.catalog.lock();
        let (gauges, untracked) = cat.tenant_gauges();
        drop(cat);
        let mut fields = Vec::new();
        if self.state.value_cipher.is_some() {
            fields.push(("tenant_keys".to_string(), 1));
        }
        if !self.state.config.tenant_shares().is_ok_and(|shares| shares.enabled()) {
            return fields;
        }
        let slot_bytes = self.state.arena.slot_bytes() as u64;
        fields.push(("untracked_tenant_blocks".to_string(), untracked));
        for g in gauges {
            fields.push((format!("tenant_dram_bytes:{}", g.label), g.resident_slots * slot_bytes));
            fields.push((format!("tenant_dram_guaranteed_bytes:{}", g.label), g.guaranteed_slots * slot_bytes));
            fields.push((format!("tenant_dram_evictions:{}", g.label), g.evicted_blocks));
            if let Some(cap_slots) = g.cap_slots {
                fields.push((format!("tenant_dram_cap_bytes:{}", g.label), cap_slots * slot_bytes));
            }
            if let Some(nvme) = g.nvme {
                fields.push((format!("tenant_nvme_bytes:{}", g.label), nvme.bytes));
                fields.push((format!("tenant_nvme_reclaimed_regions:{}", g.label), nvme.reclaimed_regions));
            }
        }
        fields.extend(self.state.remote.tenant_fields());
        fields
    }

    /// The blocks `keys` are `tenant`'s (a request's `cache_salt`, `crate::tenant`): charged to its
    /// share of the DRAM pool, now if resident, else when they arrive (`Catalog::assign_tenant`);
    /// with `encryption_key_file`, those not stored yet are sealed under its key when written below
    /// DRAM. Name them before the put: a block stored before it is named stays the default tenant's.
    pub fn assign_tenant(&self, keys: &[BlockKey], tenant: &crate::tenant::TenantId) {
        self.state.catalog.lock().assign_tenant(keys, tenant);
    }

    /// The caller says the blocks `keys` will be read again (a request's retention hint: vLLM's
    /// `kv_transfer_params`, docs/vllm.md): evidence of reuse for write admission below DRAM
    /// (`write_admission: "reuse"`, or `all` under a bounded NVMe budget). A block stored already and
    /// kept in DRAM for want of evidence is written on now; one not stored yet has evidence at its
    /// store, as a second sighting would. Under unbounded `all` every block is written (a no-op),
    /// but for blocks kept from a pool taken over that wait for a use (`store::takeover`).
    pub fn note_retained(&self, keys: &[BlockKey]) {
        let admission = &self.state.admission;
        if keys.is_empty() || !(admission.awaits_reuse() || admission.may_hold_awaiting()) {
            return;
        }
        for key in keys {
            admission.note_retained(key);
        }
        let mut cat = self.state.catalog.lock();
        keys.iter().for_each(|key| cat.note_retained(key));
        drop(cat);
        Stats::add(&self.state.stats.retained_by_hint, keys.len() as u64);
        persist_reused(&self.state);
    }

    // ---- Split puts and gets: slots filled and read by other processes through the shared pool ----

    /// Where the DRAM pool lives when it is shared (`pool_path`): the file and its slot geometry.
    pub fn pool(&self) -> Option<PoolLayout> {
        let arena = &self.state.arena;
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
        Ok(reserve_puts(&self.state, keys))
    }

    /// Writes the blocks used since they were kept from a tier for want of a use (a reservation
    /// that found a block held is one): after `try_reserve_puts`, outside the caller's own locks.
    pub fn write_reused(&self) {
        persist_reused(&self.state);
    }

    /// Counts stores given up (`dropped_stores`).
    pub fn count_dropped_stores(&self, blocks: u64) {
        Stats::add(&self.state.stats.dropped_stores, blocks);
    }

    /// How long a put may wait for room (`slot_wait_ms`).
    pub fn slot_wait_ms(&self) -> u64 {
        self.state.config.slot_wait_ms
    }

    /// Whether the NVMe tier is sick because its disk hangs (docs/reliability.md, "The NVMe tier"):
    /// a put short of write-backlog room is then dropped at once, since no write finishes to make room.
    pub fn nvme_hung(&self) -> bool {
        self.state.nvme_health.hung()
    }

    /// Waits until the NVMe write backlog admits a put; `false` if it did not by `deadline` (at once
    /// on a hung disk). Call it before `try_reserve_puts` without holding anything the writers need.
    pub fn wait_for_put_room_until(&self, deadline: Instant) -> bool {
        wait_for_put_room(&self.state, deadline)
    }

    /// The reserved slots' values are complete: (key, slot, sequence) of each `Fill`.
    pub fn commit_puts(&self, fills: &[(BlockKey, u32, u64)]) -> Result<()> {
        self.check_open()?;
        commit_puts(&self.state, fills);
        Ok(())
    }

    /// Reserved slots that will not be filled (their writers gave up or died): (key, slot).
    pub fn abort_puts(&self, fills: &[(BlockKey, u32)]) {
        abort_puts(&self.state, fills);
    }

    /// Reserved fills given up while their writers may still copy into the slots (counted as dropped
    /// stores): the blocks and their share of the write backlog go now, the slots stay out of use
    /// until `free_abandoned_slots`.
    pub fn abandon_puts(&self, fills: &[(BlockKey, u32)]) {
        let mut cat = self.state.catalog.lock();
        for (key, slot) in fills {
            cat.abandon_put(key, *slot);
        }
        drop(cat);
        Stats::add(&self.state.stats.dropped_stores, fills.len() as u64);
        self.state.changed.notify_all();
    }

    /// Abandoned slots (`abandon_puts`) no writer can copy into any more.
    pub fn free_abandoned_slots(&self, slots: &[u32]) {
        let mut cat = self.state.catalog.lock();
        for &slot in slots {
            cat.free_abandoned_slot(slot);
        }
        drop(cat);
        self.state.changed.notify_all();
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

    /// Makes blocks resident in DRAM (reading NVMe or a remote tier, verified) and pins them: per
    /// key the slot to copy the value out of, or `None` for a miss. Give each slot back with `release`.
    pub fn acquire(&self, keys: &[BlockKey]) -> Result<Vec<Option<u32>>> {
        self.load_on_this_thread(keys, execute_get_pinned)
    }

    /// Runs a load on the calling thread, counted in `loads_active` so that store jobs yield to it.
    fn load_on_this_thread<T>(
        &self,
        keys: &[BlockKey],
        load: impl FnOnce(&Arc<StoreState>, &[BlockKey]) -> Vec<T>,
    ) -> Result<Vec<T>> {
        self.check_open()?;
        let sh = &self.state;
        sh.loads_active.fetch_add(1, Ordering::AcqRel);
        let answers = load(sh, keys);
        sh.job_done(&sh.loads_active);
        assert_eq!(answers.len(), keys.len(), "one answer per key");
        Ok(answers)
    }

    /// Checks the catalog's internal invariants (for tests: the `testing` feature; debug builds check
    /// them on their own, `catalog::lock`).
    #[cfg(any(test, feature = "testing"))]
    pub fn check_invariants(&self) {
        self.state.catalog.lock().check_invariants();
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            log::warn!("kvtier: closing the store: {e}");
        }
    }
}

fn finish_job(sh: &StoreState, id: u64, results: Vec<bool>) {
    sh.finished.lock().insert(id, results);
    sh.finished_cv.notify_all();
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

/// How long a close waits for its remote tiers (their last publish, their threads and queues) at
/// least; a bucket's requests have their own deadline (`bucket_request_timeout_ms`), which it
/// outwaits by a second.
const REMOTE_CLOSE_WAIT: Duration = Duration::from_secs(5);
/// The longest a flush waits for queued stores and NVMe writes on a disk that answers.
const FLUSH_LIMIT: Duration = Duration::from_secs(120);
/// How often a flush waiting for NVMe writes looks whether the disk has hung.
const HUNG_DISK_LOOK: Duration = Duration::from_millis(50);
/// Stall limits an fdatasync may take before a flush gives it up: a busy disk's journal commit can
/// take seconds, a hung disk's never returns.
const SYNC_STALL_LIMITS: u32 = 10;

/// Closes the remote tiers on a thread of their own and waits for them a bounded time: whatever
/// touches a frozen mount (a FUSE daemon stopped, a hard NFS mount whose server is gone) blocks in
/// the kernel for as long as it stays frozen, the tier's last publish, its maintenance thread and
/// its queue's reads alike, and a user stopping the engine must not wait for the mount. `false`:
/// they did not close in time; that thread goes on alone (holding the store's state: the catalog and
/// the DRAM pool are never freed, as a read may still land in a slot), and what it had not published
/// is lost, as a cache may lose it.
fn close_remote_tiers(state: &Arc<StoreState>) -> bool {
    if !state.remote.any() {
        return true;
    }
    let bucket_timeout = state.config.bucket.as_ref().map_or(0, |b| b.request_timeout_ms);
    let limit = REMOTE_CLOSE_WAIT.max(Duration::from_millis(bucket_timeout) + Duration::from_secs(1));
    let closing = Arc::clone(state);
    let close = move || {
        closing.remote.close();
        // Let go of the store's state before saying so: once `close` returns, nothing of ours may
        // still hold it (its pool's file and mapping go when the store does).
        drop(closing);
    };
    match finish_within("kvtier-remote-close", limit, close) {
        Ok(()) => return true,
        Err(Overdue::NoThread(_)) => {
            state.remote.close(); // no thread to be had: wait, as before
            return true;
        }
        Err(Overdue::Late) => {}
    }
    log::error!(
        "kvtier: a remote tier did not close within {} ms (a frozen mount?); closing without it, \
         its unpublished blocks lost",
        limit.as_millis()
    );
    false
}
