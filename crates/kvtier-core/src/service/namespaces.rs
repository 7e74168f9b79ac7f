//! The namespace table: the open namespaces of a service (one store and one DRAM pool file each),
//! how a hello opens or attaches to one, how the janitor closes an idle one, how a new pool is
//! sized under the host DRAM budget, and the operator requests (Namespaces, Engines, Verify, Trim)
//! that name a namespace by its digest without a hello. Apart from the connections, so that the
//! lifetime of a namespace reads in one place.

use super::changes::ChangeLog;
use super::engines::EngineTable;
use super::fills::{DroppedKeys, Fills};
use super::latency::OpLatencies;
use super::protocol::*;
use super::server::{State, MIN_POOL_SLOTS};
use crate::config::StoreConfig;
use crate::error::{Error, Result};
use crate::key::Namespace;
use crate::store::Store;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An open namespace: its store and pool, and what the service keeps about it for its connections.
pub(super) struct Namespaced {
    pub(super) store: Store,
    /// The engines' description (its SHA-256 is the namespace).
    pub(super) description: Vec<u8>,
    /// The layout of the engine that opened it (engines of other TP sizes may attach when the
    /// description allows it: same object size, see `State::namespace`).
    pub(super) tp_size: u32,
    pub(super) slice_bytes: u64,
    /// Service-side latency of the ops on this namespace.
    pub(super) latency: OpLatencies,
    /// Connections attached (said hello) to it now; changed under `State::namespaces`' lock, so the
    /// janitor never closes a namespace a hello is attaching to.
    pub(super) attached: AtomicU64,
    /// When the last attached connection left (or the namespace opened).
    pub(super) detached_at: Mutex<Instant>,
    /// Operator requests (Verify, Trim, Engines) working on it now (`OperatorHold`); changed
    /// under `State::namespaces`' lock like `attached`. Not engines: they leave `detached_at` alone.
    pub(super) operator_holds: AtomicU64,
    pub(super) fills: Mutex<Fills>,
    /// Blocks a rank gave up for want of room; locked after `fills`.
    pub(super) dropped: Mutex<DroppedKeys>,
    /// Fills abandoned past `reservation_timeout_ms`, and commits refused because of it.
    pub(super) expired_fills: AtomicU64,
    pub(super) refused_commits: AtomicU64,
    /// Pins let go after `pin_lease_ms` of their connection's silence.
    pub(super) expired_pins: AtomicU64,
    /// The most new fills one connection may hold at once (`reservation_cap`).
    pub(super) reservation_cap: usize,
    /// Blocks a reserve answered "no room now" because its connection held `reservation_cap`.
    pub(super) capped_reserves: AtomicU64,
    /// Gauges: pins and load slots (`Acquire`) every connection holds now. A frozen engine's
    /// holds stay (a load's copy may still read its slots): these show what it keeps from the others.
    pub(super) held_pins: AtomicU64,
    pub(super) held_reads: AtomicU64,
    /// What each labelled engine did here; locked alone.
    pub(super) engines: Mutex<EngineTable>,
    /// Which blocks became or stopped being loadable, for the engines' KV events (`Op::Changes`);
    /// read from the store only while someone asks.
    pub(super) changes: Mutex<ChangeLog>,
}

/// The most new fills one connection may hold uncommitted: half the pool. A rank that froze
/// between reserving and committing keeps its fills' slots (until `reservation_timeout_ms`, and out
/// of use after it while it stays stopped, as a late copy may still land): without a cap one GPU
/// rank's store round could hold the whole pool, and every other engine's stores would drop. Past
/// the cap a reserve answers "no room now", and the client commits what it holds before it asks
/// again (the protocol's rule for a full backlog). Not less than half: the blocks of a store split
/// into rounds are newcomers to the eviction policy (S3-FIFO's small queue), and a later round
/// evicts an earlier one first, so a prompt stored in rounds of a quarter of the pool lost its head
/// to NVMe (`test_vllm_serve.py`'s shared pool, 12 blocks of 24). No byte bound as well: a GPU round
/// cut short loses the overlap of its commit with the next copies.
fn reservation_cap(slot_count: usize) -> usize {
    (slot_count / 2).max(1)
}

/// Flushes and closes a namespace's store and removes its pool file.
fn close_namespace(ns: &Namespaced) -> Result<()> {
    // Blocks some ranks committed and others never will: given back, so that the flush below does
    // not wait on slots nobody fills.
    // Abandoned slots go with the store; a connection that lets go of one later finds nothing.
    let orphans = ns.fills.lock().drain();
    if !orphans.is_empty() {
        ns.store.abort_puts(&orphans);
    }
    let pool_file = ns.store.pool().map(|pool| pool.path);
    let closed = ns.store.close();
    if let Err(e) = &closed {
        log::warn!("kvtier: closing a store: {e}");
    }
    // The pool is tmpfs memory: left behind, it would hold RAM until reboot. Engines that still map
    // it keep their mapping; the memory goes when the last one unmaps.
    if let Some(path) = pool_file {
        if let Err(e) = std::fs::remove_file(&path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                log::warn!("kvtier: removing the pool file {}: {e}", path.display());
            }
        }
    }
    closed
}

/// How long a namespace closed on a thread of its own (`Closing`) is waited for once its store has
/// closed: the rest is letting go of its files, which on a frozen mount waits for the mount.
const FILES_CLOSE_WAIT: Duration = Duration::from_secs(1);

/// A namespace being closed on a thread of its own: `close_namespace`, then the last of its store.
/// Closing a file on a frozen FUSE or network mount waits for the mount, uninterruptibly; the store's
/// close bounds its own waits (a hung disk's writes, its fdatasync, a frozen remote tier), not that.
pub(super) struct Closing {
    digest: Namespace,
    outcome: Outcome,
}

enum Outcome {
    OnThread {
        closed: crossbeam_channel::Receiver<Result<()>>,
        thread: std::thread::JoinHandle<()>,
    },
    /// No thread to be had: closed on the caller's, without a bound.
    Inline(Result<()>),
}

impl Closing {
    pub(super) fn start(digest: Namespace, ns: Arc<Namespaced>) -> Closing {
        let (closed_tx, closed) = crossbeam_channel::bounded(1);
        let mine = Arc::clone(&ns);
        let close = move || {
            let _ = closed_tx.send(close_namespace(&mine));
            drop(mine); // its files close here, the last holder gone
        };
        let outcome = match std::thread::Builder::new().name("kvtier-svc-close".into()).spawn(close) {
            Ok(thread) => Outcome::OnThread { closed, thread },
            Err(_) => Outcome::Inline(close_namespace(&ns)),
        };
        Closing { digest, outcome }
    }

    /// The close's result, once the store closed and its files did, or `FILES_CLOSE_WAIT` after it.
    pub(super) fn finish(self) -> Result<()> {
        let (closed, thread) = match self.outcome {
            Outcome::Inline(closed) => return closed,
            Outcome::OnThread { closed, thread } => (closed, thread),
        };
        let closed = closed.recv().unwrap_or(Err(Error::Closed)); // its thread panicked
        let deadline = Instant::now() + FILES_CLOSE_WAIT;
        while !thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if !thread.is_finished() {
            log::warn!(
                "kvtier: namespace {}'s files did not close within {FILES_CLOSE_WAIT:?} (a frozen mount?); \
                 they close when its filesystem answers",
                &self.digest.hex()[..16]
            );
        }
        closed
    }
}

impl State {
    /// The namespace's store, opened on first use with the engines' layout, with this connection
    /// counted as attached to it.
    pub(super) fn namespace(&self, description: &[u8], tp_size: u32, slice_bytes: u64) -> Result<Arc<Namespaced>> {
        let namespace = Namespace::from_description(description);
        if let Some(ns) = self.attach_open(&namespace, tp_size, slice_bytes)? {
            return Ok(ns);
        }
        let opening = Arc::clone(self.opening.lock().entry(namespace).or_default());
        let open_wait = Duration::from_millis(self.config.open_wait_ms);
        let Some(_opening) = opening.try_lock_for(open_wait) else {
            let what = format!(
                "namespace {}'s store, which another connection is opening (a slow or frozen filesystem under the store?)",
                &namespace.hex()[..16]
            );
            return Err(Error::Timeout { what, timeout_ms: self.config.open_wait_ms });
        };
        if let Some(ns) = self.attach_open(&namespace, tp_size, slice_bytes)? {
            return Ok(ns);
        }
        let (config, _grant) = self.store_config(&namespace, description, tp_size, slice_bytes)?;
        let ns = Arc::new(self.open_store(config, description, tp_size, slice_bytes)?);
        let mut namespaces = self.namespaces.lock(); // let go before `_grant`: its pool counts there now
        ns.attached.fetch_add(1, Ordering::Relaxed);
        namespaces.insert(namespace, Arc::clone(&ns));
        Ok(ns)
    }

    /// The namespace if it is open (counting one more attached connection), `None` if not.
    fn attach_open(&self, namespace: &Namespace, tp_size: u32, slice_bytes: u64) -> Result<Option<Arc<Namespaced>>> {
        let namespaces = self.namespaces.lock();
        let Some(ns) = namespaces.get(namespace) else { return Ok(None) };
        // Engines of different TP sizes share a namespace only when their description says the
        // object is rank-independent (it then leaves the TP size out); each rank places its slice
        // itself. All the service can check is that the objects are the same size.
        if slice_bytes.checked_mul(u64::from(tp_size)) != Some(ns.store.object_bytes() as u64) {
            return Err(Error::config(
                "hello",
                format!(
                    "namespace {} is open with tp_size={} and {}-byte slices, not {tp_size} and {slice_bytes}: \
                     the engines disagree on their layout",
                    &namespace.hex()[..16],
                    ns.tp_size,
                    ns.slice_bytes
                ),
            ));
        }
        ns.attached.fetch_add(1, Ordering::Relaxed);
        Ok(Some(Arc::clone(ns)))
    }

    /// A new namespace's store configuration: the template with the engines' layout, its pool file,
    /// and under a host DRAM budget its pool's size, granted (`PoolGrant`) until the store is open.
    fn store_config(
        &self,
        namespace: &Namespace,
        description: &[u8],
        tp_size: u32,
        slice_bytes: u64,
    ) -> Result<(StoreConfig, Option<PoolGrant<'_>>)> {
        let mut config = self.config.store.clone();
        config.namespace = description.to_vec();
        config.object_bytes = slice_bytes
            .checked_mul(u64::from(tp_size))
            .and_then(|bytes| usize::try_from(bytes).ok())
            .ok_or_else(|| Error::config("object_bytes", "slices too large"))?;
        let mut grant = None;
        if self.config.host_dram_bytes > 0 {
            let mut opening = self.opening_pools.lock();
            let pending: u64 = opening.values().sum();
            config.dram_bytes = self.pool_within_host_budget(&self.namespaces.lock(), pending, &config)?;
            opening.insert(*namespace, config.dram_bytes as u64);
            grant = Some(PoolGrant { state: self, namespace: *namespace });
        }
        config.pool_path = Some(self.config.pool_dir.join(pool_file_name(&self.config.socket_path, namespace)?));
        Ok((config, grant))
    }

    /// Opens a new namespace's store (outside the namespaces' lock: this takes seconds, and on a
    /// frozen mount as long as it stays frozen).
    fn open_store(
        &self,
        config: StoreConfig,
        description: &[u8],
        tp_size: u32,
        slice_bytes: u64,
    ) -> Result<Namespaced> {
        #[cfg(any(test, feature = "testing"))]
        std::thread::sleep(self.config.open_delay);
        let store = Store::open(config)?;
        // A service's store always maps a pool file; without one nothing would bound a connection.
        let reservation_cap = store.pool().map_or(usize::MAX, |pool| reservation_cap(pool.slot_count));
        Ok(Namespaced {
            store,
            description: description.to_vec(),
            latency: OpLatencies::default(),
            attached: AtomicU64::new(0),
            detached_at: Mutex::new(Instant::now()),
            operator_holds: AtomicU64::new(0),
            tp_size,
            slice_bytes,
            fills: Mutex::new(Fills::default()),
            dropped: Mutex::new(DroppedKeys::default()),
            expired_fills: AtomicU64::new(0),
            refused_commits: AtomicU64::new(0),
            expired_pins: AtomicU64::new(0),
            reservation_cap,
            capped_reserves: AtomicU64::new(0),
            held_pins: AtomicU64::new(0),
            held_reads: AtomicU64::new(0),
            engines: Mutex::new(EngineTable::default()),
            changes: Mutex::new(ChangeLog::new(super::changes::LOG_CAPACITY)),
        })
    }

    /// Closes the namespaces no connection has been attached to for `idle_timeout_ms`.
    pub(super) fn close_idle_namespaces(&self) {
        if self.config.idle_timeout_ms == 0 {
            return;
        }
        let idle = Duration::from_millis(self.config.idle_timeout_ms);
        let is_idle = |ns: &Namespaced| {
            ns.attached.load(Ordering::Relaxed) == 0
                && ns.operator_holds.load(Ordering::Relaxed) == 0
                && ns.detached_at.lock().elapsed() >= idle
        };
        let candidates: Vec<Namespace> =
            self.namespaces.lock().iter().filter(|(_, ns)| is_idle(ns)).map(|(digest, _)| *digest).collect();
        for digest in candidates {
            // Held while closing: a hello for this namespace waits, then reopens it (the store's
            // directory lock and its pool file name are free again by then).
            let opening = Arc::clone(self.opening.lock().entry(digest).or_default());
            let _opening = opening.lock();
            let ns = {
                let mut namespaces = self.namespaces.lock();
                match namespaces.get(&digest) {
                    Some(ns) if is_idle(ns) => namespaces.remove(&digest),
                    _ => None,
                }
            };
            if let Some(ns) = ns {
                log::info!("kvtier: closing namespace {} (no engine attached for {idle:?})", &digest.hex()[..16]);
                let _ = Closing::start(digest, ns).finish();
                *self.busy_at.lock() = Instant::now();
            }
        }
    }
}

/// The DRAM a namespace still opening was granted under the host budget (`State::opening_pools`),
/// counted until its store is in the namespace table, or its open failed.
struct PoolGrant<'a> {
    state: &'a State,
    namespace: Namespace,
}

impl Drop for PoolGrant<'_> {
    fn drop(&mut self) {
        self.state.opening_pools.lock().remove(&self.namespace);
    }
}

/// An operator request's hold on a namespace: the janitor does not close a namespace while one
/// runs. A closed namespace's store would go on with the request (a paced verify: seconds), and
/// the pool it still maps would outlive the namespace that engines reopen meanwhile. Unlike an
/// engine's attachment it does not restart the idle time: a metrics scrape or a periodic verify
/// must not keep a model's pool for ever.
struct OperatorHold(Arc<Namespaced>);

impl std::ops::Deref for OperatorHold {
    type Target = Namespaced;

    fn deref(&self) -> &Namespaced {
        &self.0
    }
}

impl Drop for OperatorHold {
    fn drop(&mut self) {
        let before = self.0.operator_holds.fetch_sub(1, Ordering::Relaxed);
        debug_assert!(before > 0, "an operator hold released that was never taken");
    }
}

/// `kvtier-<uid>-<socket hash>-<namespace>-<random>.pool`: the pool files of one service (two
/// services on one host serve different store paths), each open of a namespace its own. The random
/// part (64 bits from the kernel) is what no other local user can guess: a predictable name in a
/// shared /dev/shm could be taken first, and the namespace could then never open. Engines learn the
/// name from Hello; leftovers are found by the prefix (`remove_orphan_pools`).
fn pool_file_name(socket_path: &std::path::Path, namespace: &Namespace) -> Result<String> {
    let mut random = [0u8; 8];
    let filled = rustix::rand::getrandom(&mut random, rustix::rand::GetRandomFlags::empty())
        .map_err(|e| Error::io("drawing a random pool file name (getrandom)", e.into()))?;
    if filled != random.len() {
        return Err(Error::io("drawing a random pool file name (getrandom)", std::io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(format!(
        "{}{}-{:016x}.pool",
        pool_file_prefix(Some(socket_path)),
        &namespace.hex()[..16],
        u64::from_le_bytes(random)
    ))
}

/// The start of the pool files' names of this user (`kvtier-<uid>-`), or of the services on one
/// socket (`kvtier-<uid>-<socket hash>-`): only a service bound to that socket creates those.
pub(super) fn pool_file_prefix(socket_path: Option<&std::path::Path>) -> String {
    let uid = rustix::process::geteuid().as_raw();
    match socket_path {
        Some(path) => format!("kvtier-{uid}-{:016x}-", socket_hash(path)),
        None => format!("kvtier-{uid}-"),
    }
}

impl State {
    /// The DRAM a new namespace may take under `host_dram_bytes`: its `dram_bytes`, or what the open
    /// namespaces left of the budget.
    fn pool_within_host_budget(
        &self,
        namespaces: &HashMap<Namespace, Arc<Namespaced>>,
        opening_bytes: u64,
        config: &StoreConfig,
    ) -> Result<usize> {
        let host = self.config.host_dram_bytes;
        let open: u64 = namespaces.values().filter_map(|ns| ns.store.pool()).map(|pool| pool.pool_bytes as u64).sum();
        let taken = open + opening_bytes;
        let left = host.saturating_sub(taken);
        let slot_bytes = config.slot_bytes() as u64;
        if left < MIN_POOL_SLOTS * slot_bytes {
            return Err(Error::config(
                "host_dram_bytes",
                format!(
                    "the host's DRAM budget ({host} bytes) is taken by {} open namespace(s) and those opening ({taken} bytes); a new one \
                     needs at least {} bytes ({MIN_POOL_SLOTS} blocks). Raise host_dram_bytes, lower dram_bytes so \
                     models share it, or stop the engines of another model and restart the service",
                    namespaces.len(),
                    MIN_POOL_SLOTS * slot_bytes
                ),
            ));
        }
        let granted = config.dram_bytes.min(usize::try_from(left).unwrap_or(usize::MAX));
        if granted < config.dram_bytes {
            log::warn!(
                "kvtier: a new namespace gets {granted} bytes of DRAM, not dram_bytes={}: host_dram_bytes={host} \
                 and {taken} bytes are taken by the {} open namespace(s)",
                config.dram_bytes,
                namespaces.len()
            );
        }
        Ok(granted)
    }
}

/// The operator ops (protocol version 2): they name a namespace by its digest and need no Hello.
impl State {
    pub(super) fn describe_engines(&self, r: &mut Reader<'_>) -> std::result::Result<Vec<u8>, String> {
        let ns = self.open_namespace(r)?;
        let engines = ns.engines.lock().snapshot();
        let mut w = Writer::default();
        w.u32(engines.len() as u32);
        for (label, counters) in engines {
            w.bytes(label.as_bytes()).pairs(&counters.fields());
        }
        Ok(w.0)
    }

    /// The open namespace an operator request names, held open for the request (`OperatorHold`).
    fn open_namespace(&self, r: &mut Reader<'_>) -> std::result::Result<OperatorHold, String> {
        let digest = Namespace(r.array32().map_err(|e| e.to_string())?);
        let namespaces = self.namespaces.lock();
        let ns = namespaces.get(&digest).ok_or_else(|| {
            format!(
                "namespace {} is not open in this service (no engine attached to it since the service started): \
                 run the command without a service for it, or list the open ones with `kvtier ls PATH`",
                &digest.hex()[..16]
            )
        })?;
        ns.operator_holds.fetch_add(1, Ordering::Relaxed);
        Ok(OperatorHold(Arc::clone(ns)))
    }

    pub(super) fn describe_namespaces(&self) -> Vec<u8> {
        let mut namespaces: Vec<(Namespace, Arc<Namespaced>)> =
            self.namespaces.lock().iter().map(|(k, v)| (*k, Arc::clone(v))).collect();
        namespaces.sort_by_key(|(k, _)| k.0);
        let mut w = Writer::default();
        w.u16(PROTOCOL_VERSION).u32(namespaces.len() as u32);
        for (digest, ns) in namespaces {
            let stats = ns.store.stats();
            let mut pairs: Vec<(String, u64)> =
                stats.counters.fields().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            pairs.extend(stats.gauges.fields().into_iter().map(|(k, v)| (k.to_string(), v)));
            pairs.extend(stats.tenant_fields);
            let facts = ns.store.namespace_facts();
            let (pending_fills, abandoned_slots) = ns.fills.lock().counts();
            pairs.extend([
                ("blocks".to_string(), facts.visible_blocks),
                ("oldest_block_unix_ms".to_string(), facts.oldest_unix_ms),
                ("newest_block_unix_ms".to_string(), facts.newest_unix_ms),
                ("oldest_block_before_open".to_string(), u64::from(facts.oldest_before_open)),
                ("newest_block_before_open".to_string(), u64::from(facts.newest_before_open)),
                ("opened_unix_ms".to_string(), facts.opened_unix_ms),
                ("nvme_write_backlog_bytes".to_string(), facts.write_backlog_bytes),
                ("service_pending_fills".to_string(), pending_fills),
                ("service_abandoned_slots".to_string(), abandoned_slots),
                ("service_expired_fills".to_string(), ns.expired_fills.load(Ordering::Relaxed)),
                ("service_refused_commits".to_string(), ns.refused_commits.load(Ordering::Relaxed)),
                ("service_expired_pins".to_string(), ns.expired_pins.load(Ordering::Relaxed)),
                ("service_capped_reserves".to_string(), ns.capped_reserves.load(Ordering::Relaxed)),
                ("service_held_pins".to_string(), ns.held_pins.load(Ordering::Relaxed)),
                ("service_held_load_slots".to_string(), ns.held_reads.load(Ordering::Relaxed)),
                ("service_attached_connections".to_string(), ns.attached.load(Ordering::Relaxed)),
            ]);
            if let Some(age) = facts.shared_index_age_ms {
                pairs.push(("shared_index_age_ms".to_string(), age));
                pairs.push(("shared_used_bytes".to_string(), facts.shared_used_bytes));
                pairs.push(("shared_capacity_bytes".to_string(), facts.shared_capacity_bytes));
            }
            ns.latency.fields(&mut pairs);
            w.raw(&digest.0)
                .bytes(&ns.description)
                .u32(ns.tp_size)
                .u64(ns.slice_bytes)
                .u64(ns.store.object_bytes() as u64)
                .pairs(&pairs);
        }
        w.0
    }

    pub(super) fn verify(&self, r: &mut Reader<'_>) -> std::result::Result<Vec<u8>, String> {
        let ns = self.open_namespace(r)?;
        let after = r.u64().map_err(|e| e.to_string())?;
        let max_blocks = r.u32().map_err(|e| e.to_string())?;
        let max_bytes_per_s = r.u64().map_err(|e| e.to_string())?;
        // Optional `u8 scope` (0 DRAM and NVMe, 1 the shared tier); absent: 0.
        let scope = if r.rest().is_empty() { 0 } else { r.u8().map_err(|e| e.to_string())? };
        let batch = if scope == 1 {
            ns.store
                .verify_shared_batch(after, max_blocks.clamp(1, 1 << 16) as usize, max_bytes_per_s)
                .map_err(|e| e.to_string())?
        } else {
            ns.store
                .verify_batch(after, max_blocks.clamp(1, 1 << 16) as usize, max_bytes_per_s)
                .map_err(|e| e.to_string())?
        };
        let mut w = Writer::default();
        w.u64(batch.next_after).u8(u8::from(batch.done)).pairs(&[
            ("checked_dram", batch.checked_dram),
            ("checked_nvme", batch.checked_nvme),
            ("bad_dram", batch.bad_dram),
            ("bad_nvme", batch.bad_nvme),
            ("bytes_read", batch.bytes_read),
            ("skipped_busy", batch.skipped_busy),
            ("remaining_blocks", batch.remaining_blocks),
            ("newest_sequence", batch.newest_sequence),
            ("pace_wait_ms", batch.pace_wait_ms),
        ]);
        w.u32(batch.bad.len() as u32);
        for bad in &batch.bad {
            let tier = crate::catalog::Tier::wire_code(Some(bad.tier));
            w.raw(&bad.key.0).u8(tier).u8(u8::from(bad.quarantined)).bytes(bad.reason.as_bytes());
        }
        Ok(w.0)
    }

    pub(super) fn trim(&self, r: &mut Reader<'_>) -> std::result::Result<Vec<u8>, String> {
        let ns = self.open_namespace(r)?;
        let mode = r.u8().map_err(|e| e.to_string())?;
        let value = r.u64().map_err(|e| e.to_string())?;
        let request = match mode {
            0 => crate::maintenance::TrimRequest::All,
            1 => crate::maintenance::TrimRequest::OlderThan(Duration::from_millis(value)),
            2 => crate::maintenance::TrimRequest::NvmeTo(value),
            other => return Err(format!("trim mode {other} is unknown (0 all, 1 older than, 2 NVMe to bytes)")),
        };
        let c = ns.store.trim(request).map_err(|e| e.to_string())?;
        let mut w = Writer::default();
        w.pairs(&[
            ("dram_blocks", c.dram_blocks),
            ("dram_bytes", c.dram_bytes),
            ("nvme_blocks", c.nvme_blocks),
            ("nvme_bytes", c.nvme_bytes),
            ("regions_freed", c.regions_freed),
            ("skipped_in_use", c.skipped_in_use),
        ]);
        Ok(w.0)
    }
}

/// Names the pool files of one service (two services on one host serve different store paths).
fn socket_hash(path: &std::path::Path) -> u64 {
    crate::format::checksum(path.as_os_str().as_encoded_bytes())
}
