//! The service side: accepts engine connections, opens one store per namespace (its DRAM pool a
//! shared-memory file the engines map), and answers the protocol's requests.
//!
//! Leases: everything a connection takes (pins, reserved slots) is recorded with the connection and
//! given back when it closes, however it closed: an engine killed with SIGKILL loses its socket, and
//! the kernel closing it is the lease expiring; a connection thread that panics gives it back too
//! (`Session`'s `Drop`). A reserved slot is freed only once no connection holds it any more, so an
//! aborted fill can never be reused while a live writer still copies in.
//!
//! A live connection's reservations also have a deadline (`reservation_timeout_ms`): a rank hung in
//! a collective, or on an event that never fires, must not keep its slots' share of the write
//! backlog and starve every other engine's stores and flushes. Past the deadline the fill is
//! abandoned: the block and its backlog share are given back at once, and every rank's commit of
//! it is refused, so a half-written block is never visible. The slot itself is not: the hung
//! writer may wake up and copy into it later (its copy was queued behind an event, or its process
//! was stopped), and the service cannot take a mapping back. Reused for another block, that slot
//! would serve the late bytes under the other block's key, and a DRAM hit is not verified again.
//! So the slot stays out of use, keyless, until every connection that held the fill has let go of
//! it (commit, abort or close), which is the existing rule for a slot's last writer. A late commit
//! is matched by the fill's sequence, never by its key alone: the key may be filled again by then.

use super::engines::{EngineCounters, EngineTable};
use super::fills::{DroppedKeys, Expired, Fill, Fills, Joined, Outcome};
use super::protocol::*;
use super::socket_file;
use crate::config::StoreConfig;
use crate::error::{Error, Result};
use crate::key::{BlockKey, Namespace};
use crate::mover::Reservation;
use crate::store::Store;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Ranks per namespace: a fill records its ranks in a 64-bit mask.
pub const MAX_TP_SIZE: u32 = 64;
/// The largest block object a store takes (`StoreConfig::validate`'s bound), checked at Hello before
/// any size is computed from it.
const MAX_OBJECT_BYTES: u64 = 1 << 30;
const ACCEPT_POLL_MS: i32 = 200;
const JANITOR_PERIOD: Duration = Duration::from_millis(500);
const TIMELINE_SAVE_PERIOD: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// The Unix socket engines connect to (created 0600 in a 0700 directory).
    pub socket_path: PathBuf,
    /// Template of every namespace's store: its directories and options. `namespace`,
    /// `object_bytes` and `pool_path` are set per namespace from the engines' `Hello`.
    pub store: StoreConfig,
    /// Directory of the shared-memory pool files (a tmpfs: /dev/shm, or a hugetlbfs mount).
    pub pool_dir: PathBuf,
    /// Connections served at once; more are refused (closed at once). Default 1024.
    pub max_connections: usize,
    /// A reserved fill that no connection holds any more, and that not every rank committed, is
    /// given back after this long (a rank that never came). Default 10000.
    pub fill_timeout_ms: u64,
    /// A fill that live connections still hold, and that not every rank committed this long after
    /// its first reservation, is abandoned (a rank hung between reserving and committing): its
    /// block and share of the write backlog are given back, the holders' commits refused. Longer
    /// than an engine's job timeout (vLLM's `job_timeout_ms`, 120 s by default), so that a slow
    /// but live job is not cut off. 0: never. Default 180000.
    pub reservation_timeout_ms: u64,
    /// Fault injection for tests: a `Label` request naming this label panics in its connection
    /// thread, as a bug would. `None` outside tests.
    #[doc(hidden)]
    pub panic_on_label: Option<String>,
    /// The most DRAM the pools of all namespaces may take together (0: no host cap, every namespace
    /// gets `store.dram_bytes`). Each namespace's pool is `store.dram_bytes`, or what is left of this
    /// budget when less; a namespace for which less than `MIN_POOL_SLOTS` slots are left is refused.
    pub host_dram_bytes: u64,
    /// A namespace no connection has been attached to for this long is closed: its stores flushed,
    /// its DRAM pool (and the pool file) freed. The next engine to attach reopens it (recovering its
    /// NVMe tier). 0 keeps every namespace open until the service stops. Default 0.
    pub idle_timeout_ms: u64,
}

/// The smallest pool a namespace is opened with under a host budget: fewer slots than this could
/// not hold one request's blocks while others are being written.
pub const MIN_POOL_SLOTS: u64 = 8;

impl ServiceConfig {
    pub fn new(socket_path: impl Into<PathBuf>, store: StoreConfig) -> Self {
        ServiceConfig {
            socket_path: socket_path.into(),
            store,
            pool_dir: PathBuf::from("/dev/shm"),
            max_connections: 1024,
            fill_timeout_ms: 10_000,
            reservation_timeout_ms: 180_000,
            panic_on_label: None,
            host_dram_bytes: 0,
            idle_timeout_ms: 0,
        }
    }
}

/// The store calls that connections letting go of fills lead to, made outside the fills lock.
#[derive(Default)]
struct StoreSteps {
    complete: Vec<(BlockKey, u32, u64)>,
    give_back: Vec<(BlockKey, u32)>,
    free_abandoned: Vec<u32>,
}

impl StoreSteps {
    fn add(&mut self, key: BlockKey, outcome: Outcome) {
        match outcome {
            Outcome::Complete { slot, sequence } => self.complete.push((key, slot, sequence)),
            Outcome::GiveBack { slot } => self.give_back.push((key, slot)),
            Outcome::FreeAbandoned { slot } => self.free_abandoned.push(slot),
            Outcome::Pending | Outcome::Gone => {}
        }
    }

    fn apply(self, store: &Store) -> Result<()> {
        if !self.give_back.is_empty() {
            store.abort_puts(&self.give_back);
        }
        if !self.free_abandoned.is_empty() {
            store.free_abandoned_slots(&self.free_abandoned);
        }
        if !self.complete.is_empty() {
            store.commit_puts(&self.complete)?;
        }
        Ok(())
    }
}

struct Namespaced {
    store: Store,
    /// The engines' description (its SHA-256 is the namespace).
    description: Vec<u8>,
    /// The layout of the engine that opened it (engines of other TP sizes may attach when the
    /// description allows it: same object size, see `State::namespace`).
    tp_size: u32,
    slice_bytes: u64,
    /// Service-side latency of the ops on this namespace.
    latency: super::latency::OpLatencies,
    /// Connections attached (said hello) to it now; changed under `State::namespaces`' lock, so the
    /// janitor never closes a namespace a hello is attaching to.
    attached: AtomicU64,
    /// When the last attached connection left (or the namespace opened).
    detached_at: Mutex<Instant>,
    /// Operator requests (Verify, Trim, Engines) working on it now (`OperatorHold`); changed
    /// under `State::namespaces`' lock like `attached`. Not engines: they leave `detached_at` alone.
    operator_holds: AtomicU64,
    fills: Mutex<Fills>,
    /// Blocks a rank gave up for want of room; locked after `fills`.
    dropped: Mutex<DroppedKeys>,
    /// Fills abandoned past `reservation_timeout_ms`, and commits refused because of it.
    expired_fills: AtomicU64,
    refused_commits: AtomicU64,
    /// What each labelled engine did here; locked alone.
    engines: Mutex<EngineTable>,
    /// Which blocks became or stopped being loadable, for the engines' KV events (`Op::Changes`);
    /// read from the store only while someone asks.
    changes: Mutex<super::changes::ChangeLog>,
}

struct State {
    config: ServiceConfig,
    /// The socket file this service bound: at stop it removes that file, not whatever another
    /// service may have put at the path since.
    socket_id: socket_file::FileId,
    namespaces: Mutex<HashMap<Namespace, Arc<Namespaced>>>,
    /// One lock per namespace being opened: `Store::open` (recovery, fallocate and faulting in the
    /// pool: seconds for a few GiB) runs outside `namespaces`' lock, so other clients' calls go on,
    /// and two hellos for one new namespace open it once.
    opening: Mutex<HashMap<Namespace, Arc<Mutex<()>>>>,
    /// Serializes the opening of namespaces under a host DRAM budget (each new pool is sized from
    /// what the others left).
    budget: Mutex<()>,
    /// When the service last held a connection or a namespace (for `Service::idle_ms`).
    busy_at: Mutex<Instant>,
    /// Held while a connection is accepted and counted, and while `Service::stop_if_idle` decides.
    accepting: Mutex<()>,
    /// Clones of the live connections, to shut them down when the service stops.
    connections: Mutex<HashMap<u64, UnixStream>>,
    next_connection: AtomicU64,
    stop: AtomicBool,
}

/// A running service. `stop` (or drop) closes the connections, flushes and closes every store.
pub struct Service {
    state: Arc<State>,
    threads: Vec<JoinHandle<()>>,
}

impl Service {
    /// Binds the socket and starts serving. Fails if another service answers on the socket.
    pub fn start(config: ServiceConfig) -> Result<Service> {
        let (listener, socket_id) = socket_file::bind(&config.socket_path)?;
        remove_leftovers(&config);
        let state = Arc::new(State {
            config,
            socket_id,
            namespaces: Mutex::new(HashMap::new()),
            opening: Mutex::new(HashMap::new()),
            budget: Mutex::new(()),
            busy_at: Mutex::new(Instant::now()),
            accepting: Mutex::new(()),
            connections: Mutex::new(HashMap::new()),
            next_connection: AtomicU64::new(1),
            stop: AtomicBool::new(false),
        });
        let accept_state = Arc::clone(&state);
        let janitor_state = Arc::clone(&state);
        let threads = vec![
            spawn("kvtier-svc-accept", move || accept_loop(&accept_state, listener))?,
            spawn("kvtier-svc-janitor", move || janitor_loop(&janitor_state))?,
        ];
        log::info!("kvtier: service listening on {}", state.config.socket_path.display());
        Ok(Service { state, threads })
    }

    /// Namespaces open now.
    pub fn namespace_count(&self) -> usize {
        self.state.namespaces.lock().len()
    }

    /// How long the service has held no connection and no namespace (0 while it holds either): a
    /// service started on demand exits once this passes its idle timeout.
    pub fn idle_ms(&self) -> u64 {
        self.state.idle_ms()
    }

    /// Stops accepting and removes the socket (and pid file) if the service has held no connection
    /// and no namespace for `limit_ms`, in one step with accepting: `true` if it did; `stop` then
    /// closes the rest. A client that connected before the decision was accepted, so the service
    /// was not idle; one that connects after it finds no socket and starts a new service; one
    /// queued at the decision is reset unanswered (the service it reached is leaving). Deciding
    /// from `idle_ms` and stopping after left a moment in which an engine found the socket and a
    /// service that then went away.
    pub fn stop_if_idle(&self, limit_ms: u64) -> bool {
        let _accepting = self.state.accepting.lock();
        if self.state.holds_anything() || self.state.idle_ms() < limit_ms {
            return false;
        }
        self.state.stop.store(true, Ordering::Release);
        socket_file::release(&self.state.config.socket_path, self.state.socket_id);
        true
    }

    /// Stops accepting, closes every connection, then flushes and closes every store. Idempotent.
    pub fn stop(&mut self) -> Result<()> {
        self.state.stop.store(true, Ordering::Release);
        for (_, stream) in self.state.connections.lock().drain() {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        for thread in self.threads.drain(..) {
            thread.thread().unpark(); // the janitor sleeps in `park_timeout`
            let _ = thread.join();
        }
        socket_file::release(&self.state.config.socket_path, self.state.socket_id);
        let mut result = Ok(());
        for (_, ns) in self.state.namespaces.lock().drain() {
            if let Err(e) = close_namespace(&ns) {
                result = Err(e);
            }
        }
        result
    }
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

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new().name(name.into()).spawn(f).map_err(|e| Error::io("spawning a service thread", e))
}

/// Removes what dead services of this user left: pool files no process holds (tmpfs memory until
/// reboot) and sockets nothing listens on, with their pid files.
fn remove_leftovers(config: &ServiceConfig) {
    let prefix = format!("{POOL_FILE_PREFIX}{}-", rustix::process::geteuid().as_raw());
    for path in crate::tiers::dram::remove_orphan_pools(&config.pool_dir, &prefix) {
        log::info!("kvtier: removed the pool file {} of a service that is gone", path.display());
    }
    if let Some(dir) = config.socket_path.parent() {
        socket_file::remove_dead_sockets(dir, &config.socket_path);
    }
}

fn accept_loop(state: &Arc<State>, listener: UnixListener) {
    use rustix::event::{poll, PollFd, PollFlags};
    while !state.stop.load(Ordering::Acquire) {
        // Waits for a connection or the stop flag's period, whichever comes first.
        let mut fds = [PollFd::new(&listener, PollFlags::IN)];
        let timeout = rustix::event::Timespec { tv_sec: 0, tv_nsec: i64::from(ACCEPT_POLL_MS) * 1_000_000 };
        if poll(&mut fds, Some(&timeout)).unwrap_or(0) == 0 {
            continue;
        }
        // Accepting and the idle exit's decision exclude each other (`Service::stop_if_idle`): a
        // connection is either counted before the decision, or never accepted (the listener's
        // queue is reset when this thread ends).
        let accepting = state.accepting.lock();
        if state.stop.load(Ordering::Acquire) {
            break;
        }
        let Ok((stream, _)) = listener.accept() else { continue };
        if let Err(why) = admit(state, &stream) {
            log::warn!("kvtier: service refused a connection: {why}");
            continue;
        }
        let id = state.next_connection.fetch_add(1, Ordering::Relaxed);
        *state.busy_at.lock() = Instant::now();
        if let Ok(clone) = stream.try_clone() {
            state.connections.lock().insert(id, clone);
        }
        drop(accepting);
        let conn_state = Arc::clone(state);
        let spawned = std::thread::Builder::new().name(format!("kvtier-svc-conn-{id}")).spawn(move || {
            let _slot = ConnectionSlot { state: Arc::clone(&conn_state), id };
            Connection { state: conn_state, session: None }.serve(stream);
        });
        if spawned.is_err() {
            state.connections.lock().remove(&id);
        }
    }
}

/// A connection's place in `State::connections` (counted against `max_connections`), given back
/// when its thread ends, even by a panic.
struct ConnectionSlot {
    state: Arc<State>,
    id: u64,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.state.connections.lock().remove(&self.id);
        *self.state.busy_at.lock() = Instant::now();
    }
}

/// Only the service's own user may connect (the pool holds every engine's KV), and only so many.
fn admit(state: &State, stream: &UnixStream) -> std::result::Result<(), String> {
    let peer =
        rustix::net::sockopt::socket_peercred(stream.as_fd()).map_err(|e| format!("no peer credentials: {e}"))?;
    let me = rustix::process::geteuid();
    if peer.uid != me {
        return Err(format!("peer uid {} is not the service's uid {}", peer.uid.as_raw(), me.as_raw()));
    }
    if state.connections.lock().len() >= state.config.max_connections {
        return Err(format!("{} connections already", state.config.max_connections));
    }
    Ok(())
}

fn janitor_loop(state: &Arc<State>) {
    let mut timelines_saved = Instant::now();
    while !state.stop.load(Ordering::Acquire) {
        std::thread::park_timeout(JANITOR_PERIOD);
        let namespaces: Vec<Arc<Namespaced>> = state.namespaces.lock().values().cloned().collect();
        // A crash loses the block dates recorded since the last save (the blocks stay).
        let save_timelines = timelines_saved.elapsed() >= TIMELINE_SAVE_PERIOD;
        if save_timelines {
            timelines_saved = Instant::now();
        }
        for ns in namespaces {
            if save_timelines {
                if let Err(e) = ns.store.save_timeline() {
                    log::warn!("kvtier: saving block dates failed: {e}");
                }
            }
            expire_fills(&ns, &state.config);
        }
        state.close_idle_namespaces();
    }
}

/// Gives back the fills no connection holds that waited `fill_timeout_ms` for a rank that never
/// came, and abandons those live connections have held past `reservation_timeout_ms`.
fn expire_fills(ns: &Namespaced, config: &ServiceConfig) {
    let unheld_limit = Duration::from_millis(config.fill_timeout_ms);
    let held_limit = (config.reservation_timeout_ms > 0).then(|| Duration::from_millis(config.reservation_timeout_ms));
    let Expired { stale, abandoned: expired } = {
        let found = ns.fills.lock().expire(Instant::now(), unheld_limit, held_limit);
        // A rank that reserves the block later gives it up too, rather than open a new fill that
        // the hung rank will not complete either.
        let mut dropped = ns.dropped.lock();
        for (key, _) in &found.abandoned {
            dropped.insert(*key);
        }
        found
    };
    if !stale.is_empty() {
        log::warn!("kvtier: {} stores waited {unheld_limit:?} for a rank that never came; dropped", stale.len());
        ns.store.abort_puts(&stale);
    }
    if !expired.is_empty() {
        log::warn!(
            "kvtier: {} stores were not committed by every rank within reservation_timeout_ms={} (a rank hung \
             between reserving and committing); dropped, their slots kept out of use until the rank lets go",
            expired.len(),
            config.reservation_timeout_ms
        );
        ns.expired_fills.fetch_add(expired.len() as u64, Ordering::Relaxed);
        ns.store.abandon_puts(&expired);
    }
}

/// One engine connection's state: the namespace it said hello to and what it holds.
struct Session {
    ns: Arc<Namespaced>,
    rank: u32,
    tp_size: u32,
    /// Pins taken by `Pin`, per key (the block stays loadable).
    pins: HashMap<BlockKey, u32>,
    /// Slots handed out by `Acquire`, per key (the slot stays until `Release`).
    readers: HashMap<BlockKey, u32>,
    /// Fills this connection reserved and has not committed or aborted: `(key, sequence)`.
    reserved: Vec<(BlockKey, u64)>,
    /// The engine this connection works for (`Op::Label`), for the per-engine counters.
    label: Option<String>,
}

struct Connection {
    state: Arc<State>,
    session: Option<Session>,
}

impl Connection {
    fn serve(mut self, mut stream: UnixStream) {
        loop {
            let body = match read_frame(&mut stream) {
                Ok(Some(body)) => body,
                Ok(None) => break,
                Err(e) => {
                    log::debug!("kvtier: service connection closed: {e}");
                    break;
                }
            };
            // A panic is a bug; what the connection held is given back (`Session`'s `Drop`) and the
            // client hears why at once instead of waiting out its timeout.
            let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.handle(&body)));
            let (reply, close) = match handled {
                Ok(Ok(payload)) => (reply_frame(STATUS_OK, &payload), false),
                Ok(Err(message)) => (reply_frame(STATUS_ERROR, message.as_bytes()), false),
                Err(panic) => {
                    let what = panic_message(panic.as_ref());
                    log::error!("kvtier: a service request panicked ({what}); its connection is closed");
                    let message = format!(
                        "the kvtier service failed on this request (a bug: {what}); the connection is closed and \
                         what it held given back: reconnect, and report it with the service log"
                    );
                    (reply_frame(STATUS_ERROR, message.as_bytes()), true)
                }
            };
            if write_frame(&mut stream, &reply).is_err() || close {
                break;
            }
        }
        self.session = None;
    }

    fn handle(&mut self, body: &[u8]) -> std::result::Result<Vec<u8>, String> {
        let mut r = Reader::new(body);
        let op = Op::from_u8(r.u8().map_err(|e| e.to_string())?).ok_or("unknown request opcode")?;
        if op == Op::Hello {
            return self.hello(&mut r).map_err(|e| e.to_string());
        }
        if op == Op::Stats && self.session.is_none() {
            return Ok(self.service_stats());
        }
        match op {
            Op::Namespaces => return Ok(self.state.describe_namespaces()),
            Op::Engines => return self.state.describe_engines(&mut r),
            Op::Verify => return self.state.verify(&mut r),
            Op::Trim => return self.state.trim(&mut r),
            Op::Changes => return self.changes(&mut r),
            _ => {}
        }
        let class = match op {
            Op::Locate | Op::Pin => Some(0),
            Op::Acquire => Some(1),
            Op::Reserve => Some(2),
            Op::Commit => Some(3),
            _ => None,
        };
        let started = Instant::now();
        let reply = self.handle_session_op(op, &mut r);
        if let (Some(class), Some(session)) = (class, &self.session) {
            session.ns.latency.by_class[class].observe(started.elapsed());
        }
        reply
    }

    fn handle_session_op(&mut self, op: Op, r: &mut Reader<'_>) -> std::result::Result<Vec<u8>, String> {
        let session = self.session.as_mut().ok_or("say hello first (the namespace of this connection)")?;
        let keys = match op {
            Op::Stats | Op::Flush | Op::Label => Vec::new(),
            _ => r.keys().map_err(|e| e.to_string())?,
        };
        let mut w = Writer::default();
        match op {
            Op::Hello | Op::Namespaces | Op::Verify | Op::Trim | Op::Engines | Op::Changes => {
                unreachable!("answered above")
            }
            Op::Label => session.label = Some(checked_label(&self.state.config, r)?),
            Op::Locate => {
                let tiers = session.ns.store.locate_many(&keys);
                w.raw(&tiers.iter().map(|&tier| TierCode::from(tier) as u8).collect::<Vec<u8>>());
                session.count(|c| tiers.iter().for_each(|&tier| *c.lookup(tier) += 1));
            }
            Op::Pin => {
                let flags = session.ns.store.pin_prefix(&keys);
                w.u32(flags.len() as u32);
                for (key, &pinned) in keys.iter().zip(&flags) {
                    if pinned {
                        *session.pins.entry(*key).or_default() += 1;
                    }
                    w.u8(u8::from(pinned));
                }
            }
            Op::ReadAhead => {
                let resident = session.ns.store.read_ahead(&keys).map_err(|e| e.to_string())?;
                w.raw(&resident.iter().map(|&found| u8::from(found)).collect::<Vec<u8>>());
            }
            Op::Unpin => session.unpin(&keys),
            Op::Release => session.release_readers(&keys),
            Op::Acquire => session.acquire(&keys, &mut w)?,
            Op::Reserve => {
                let mut dropped = 0;
                for (kind, slot) in session.reserve(&keys).map_err(|e| e.to_string())? {
                    dropped += u64::from(kind == ReserveKind::Dropped);
                    w.u8(kind as u8).u32(slot);
                }
                session.count(|c| c.dropped_slices += dropped);
            }
            Op::Commit => {
                let accepted = session.commit(&keys).map_err(|e| e.to_string())?;
                let stored = accepted.iter().filter(|&&ok| ok).count() as u64;
                w.raw(&accepted.iter().map(|&ok| u8::from(ok)).collect::<Vec<u8>>());
                session.count(|c| {
                    c.stored_slices += stored;
                    c.dropped_slices += keys.len() as u64 - stored;
                });
            }
            Op::Abort => session.abort(&keys),
            Op::Stats => {
                let ns = Arc::clone(&session.ns);
                return Ok(self.encode_stats(&[ns]));
            }
            Op::Flush => session.ns.store.flush().map_err(|e| e.to_string())?,
        }
        Ok(w.0)
    }

    /// `Op::Changes`: the connection's namespace's change log from a cursor. The store's residency
    /// is read again first when the log is older than `REFRESH_PERIOD` (the keys that changed since,
    /// on this connection's thread: engines follow on connections of their own).
    fn changes(&mut self, r: &mut Reader<'_>) -> std::result::Result<Vec<u8>, String> {
        use super::changes::{LOG_CAPACITY, TIER_SHARED};
        let session = self.session.as_ref().ok_or("say hello first (the namespace of this connection)")?;
        let cursor = r.u64().map_err(|e| e.to_string())?;
        let max = (r.u32().map_err(|e| e.to_string())? as usize).clamp(1, LOG_CAPACITY);
        let mut log = session.ns.changes.lock();
        if log.stale() {
            let store = &session.ns.store;
            let update =
                store.residency_changes(log.needs_full(), LOG_CAPACITY, LOG_CAPACITY * 16, log.remote_generation);
            log.remote_generation = update.remote_generation;
            log.apply(update.local, update.remote);
        }
        let reply = log.since(cursor, max);
        drop(log);
        let mut w = Writer::default();
        w.u8(u8::from(reply.reset)).u64(reply.next).u32(reply.changes.len() as u32);
        for change in &reply.changes {
            debug_assert!(change.tier != 0 && change.tier <= TIER_SHARED);
            w.raw(&change.key.0).u8(change.tier).u8(u8::from(change.removed));
        }
        Ok(w.0)
    }

    /// Stats of every namespace, summed (a connection that has not said hello: an operator's view).
    fn service_stats(&self) -> Vec<u8> {
        let namespaces: Vec<Arc<Namespaced>> = self.state.namespaces.lock().values().cloned().collect();
        self.encode_stats(&namespaces)
    }

    fn encode_stats(&self, namespaces: &[Arc<Namespaced>]) -> Vec<u8> {
        let mut totals: Vec<(&'static str, u64)> = Vec::new();
        let mut add = |name: &'static str, value: u64| match totals.iter_mut().find(|(n, _)| *n == name) {
            Some((_, total)) => *total += value,
            None => totals.push((name, value)),
        };
        for ns in namespaces {
            let stats = ns.store.stats();
            for (name, value) in stats.counters.fields() {
                add(name, value);
            }
            for (name, value) in stats.gauges.fields() {
                add(name, value);
            }
            let (pending_fills, abandoned_slots) = ns.fills.lock().counts();
            add("service_pending_fills", pending_fills);
            add("service_abandoned_slots", abandoned_slots);
            add("service_expired_fills", ns.expired_fills.load(Ordering::Relaxed));
            add("service_refused_commits", ns.refused_commits.load(Ordering::Relaxed));
        }
        add("service_connections", self.state.connections.lock().len() as u64);
        add("service_namespaces", self.state.namespaces.lock().len() as u64);
        let mut w = Writer::default();
        w.u32(totals.len() as u32);
        for (name, value) in totals {
            w.u16(name.len() as u16);
            w.0.extend_from_slice(name.as_bytes());
            w.u64(value);
        }
        w.0
    }

    fn hello(&mut self, r: &mut Reader<'_>) -> Result<Vec<u8>> {
        let bad = |what: &str| Error::config("hello", what.to_string());
        let version = r.u16().map_err(|e| bad(&e.to_string()))?;
        if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) {
            return Err(bad(&format!(
                "protocol version {version}, the service speaks {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}: run the \
                 same kvtier in the engines and the service (restart the service after upgrading)"
            )));
        }
        let tp_size = r.u32().map_err(|e| bad(&e.to_string()))?;
        let rank = r.u32().map_err(|e| bad(&e.to_string()))?;
        let slice_bytes = r.u64().map_err(|e| bad(&e.to_string()))?;
        let description = r.bytes().map_err(|e| bad(&e.to_string()))?.to_vec();
        if tp_size == 0 || tp_size > MAX_TP_SIZE || rank >= tp_size {
            return Err(bad(&format!("rank {rank} of {tp_size}: give 0 <= rank < tp_size <= {MAX_TP_SIZE}")));
        }
        if slice_bytes == 0 || description.is_empty() {
            return Err(bad("slice_bytes and the namespace description must not be empty"));
        }
        if slice_bytes.checked_mul(u64::from(tp_size)).is_none_or(|bytes| bytes > MAX_OBJECT_BYTES) {
            return Err(bad(&format!(
                "{tp_size} slices of {slice_bytes} bytes make a block object over {MAX_OBJECT_BYTES} bytes: \
                 store smaller blocks (a smaller block_size in the engine)"
            )));
        }
        // Given back first: a connection holds one namespace at a time.
        self.session = None;
        let ns = self.state.namespace(&description, tp_size, slice_bytes)?;
        let Some(pool) = ns.store.pool() else {
            return Err(Error::config("hello", "the namespace's store has no shared pool (a bug; report it)"));
        };
        let mut w = Writer::default();
        w.u64(pool.slot_bytes as u64)
            .u64(pool.slot_count as u64)
            .u64(pool.value_offset as u64)
            .u64(pool.pool_bytes as u64)
            .u64(ns.store.object_bytes() as u64)
            .bytes(pool.path.as_os_str().as_encoded_bytes());
        self.session = Some(Session {
            ns,
            rank,
            tp_size,
            pins: HashMap::new(),
            readers: HashMap::new(),
            reserved: Vec::new(),
            label: None,
        });
        Ok(w.0)
    }
}

/// A reply frame's body: `status`, then `payload`.
fn reply_frame(status: u8, payload: &[u8]) -> Vec<u8> {
    let mut w = Writer::new(status);
    w.raw(payload);
    w.0
}

/// What a caught panic said (its payload is a `&str` or a `String` for `panic!` with a message).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    match (payload.downcast_ref::<&str>(), payload.downcast_ref::<String>()) {
        (Some(s), _) => (*s).to_string(),
        (_, Some(s)) => s.clone(),
        _ => "a panic without a message".to_string(),
    }
}

impl State {
    /// The namespace's store, opened on first use with the engines' layout, with this connection
    /// counted as attached to it.
    fn namespace(&self, description: &[u8], tp_size: u32, slice_bytes: u64) -> Result<Arc<Namespaced>> {
        let namespace = Namespace::from_description(description);
        if let Some(ns) = self.attach_open(&namespace, tp_size, slice_bytes)? {
            return Ok(ns);
        }
        let opening = Arc::clone(self.opening.lock().entry(namespace).or_default());
        let _opening = opening.lock();
        if let Some(ns) = self.attach_open(&namespace, tp_size, slice_bytes)? {
            return Ok(ns);
        }
        let _budget = (self.config.host_dram_bytes > 0).then(|| self.budget.lock());
        let ns = Arc::new(self.open_store(&namespace, description, tp_size, slice_bytes)?);
        let mut namespaces = self.namespaces.lock();
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

    /// Opens a new namespace's store (outside the namespaces' lock: this takes seconds).
    fn open_store(
        &self,
        namespace: &Namespace,
        description: &[u8],
        tp_size: u32,
        slice_bytes: u64,
    ) -> Result<Namespaced> {
        let mut config = self.config.store.clone();
        config.namespace = description.to_vec();
        config.object_bytes = slice_bytes
            .checked_mul(u64::from(tp_size))
            .and_then(|bytes| usize::try_from(bytes).ok())
            .ok_or_else(|| Error::config("object_bytes", "slices too large"))?;
        if self.config.host_dram_bytes > 0 {
            config.dram_bytes = self.pool_within_host_budget(&self.namespaces.lock(), &config)?;
        }
        config.pool_path = Some(self.config.pool_dir.join(pool_file_name(&self.config.socket_path, namespace)?));
        let store = Store::open(config)?;
        Ok(Namespaced {
            store,
            description: description.to_vec(),
            latency: super::latency::OpLatencies::default(),
            attached: AtomicU64::new(0),
            detached_at: Mutex::new(Instant::now()),
            operator_holds: AtomicU64::new(0),
            tp_size,
            slice_bytes,
            fills: Mutex::new(Fills::default()),
            dropped: Mutex::new(DroppedKeys::default()),
            expired_fills: AtomicU64::new(0),
            refused_commits: AtomicU64::new(0),
            engines: Mutex::new(EngineTable::default()),
            changes: Mutex::new(super::changes::ChangeLog::new(super::changes::LOG_CAPACITY)),
        })
    }

    /// Closes the namespaces no connection has been attached to for `idle_timeout_ms`.
    fn close_idle_namespaces(&self) {
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
                let _ = close_namespace(&ns);
                *self.busy_at.lock() = Instant::now();
            }
        }
    }

    fn idle_ms(&self) -> u64 {
        if self.holds_anything() {
            return 0;
        }
        u64::try_from(self.busy_at.lock().elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn holds_anything(&self) -> bool {
        !self.connections.lock().is_empty() || !self.namespaces.lock().is_empty()
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
        self.0.operator_holds.fetch_sub(1, Ordering::Relaxed);
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
        "{POOL_FILE_PREFIX}{}-{:016x}-{}-{:016x}.pool",
        rustix::process::geteuid().as_raw(),
        socket_hash(socket_path),
        &namespace.hex()[..16],
        u64::from_le_bytes(random)
    ))
}

const POOL_FILE_PREFIX: &str = "kvtier-";

impl State {
    /// The DRAM a new namespace may take under `host_dram_bytes`: its `dram_bytes`, or what the open
    /// namespaces left of the budget.
    fn pool_within_host_budget(
        &self,
        namespaces: &HashMap<Namespace, Arc<Namespaced>>,
        config: &StoreConfig,
    ) -> Result<usize> {
        let host = self.config.host_dram_bytes;
        let taken: u64 = namespaces.values().filter_map(|ns| ns.store.pool()).map(|pool| pool.pool_bytes as u64).sum();
        let left = host.saturating_sub(taken);
        let slot_bytes = config.slot_bytes() as u64;
        if left < MIN_POOL_SLOTS * slot_bytes {
            return Err(Error::config(
                "host_dram_bytes",
                format!(
                    "the host's DRAM budget ({host} bytes) is taken by {} open namespace(s) ({taken} bytes); a new one \
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

/// `parse_label`, and the panic a test asks for with `ServiceConfig::panic_on_label`.
fn checked_label(config: &ServiceConfig, r: &mut Reader<'_>) -> std::result::Result<String, String> {
    let label = parse_label(r)?;
    if config.panic_on_label.as_ref() == Some(&label) {
        panic!("fault injection: a request labelled {label:?}");
    }
    Ok(label)
}

/// An engine label (`Op::Label`): UTF-8, 1 to `MAX_ENGINE_LABEL_BYTES` bytes.
fn parse_label(r: &mut Reader<'_>) -> std::result::Result<String, String> {
    let bytes = r.bytes().map_err(|e| e.to_string())?;
    if bytes.is_empty() || bytes.len() > MAX_ENGINE_LABEL_BYTES {
        return Err(format!("an engine label has 1 to {MAX_ENGINE_LABEL_BYTES} bytes, got {}", bytes.len()));
    }
    String::from_utf8(bytes.to_vec()).map_err(|_| "an engine label must be UTF-8".to_string())
}

/// The operator ops (protocol version 2): they name a namespace by its digest and need no Hello.
impl State {
    fn describe_engines(&self, r: &mut Reader<'_>) -> std::result::Result<Vec<u8>, String> {
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

    fn describe_namespaces(&self) -> Vec<u8> {
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

    fn verify(&self, r: &mut Reader<'_>) -> std::result::Result<Vec<u8>, String> {
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
            let tier = TierCode::from(Some(bad.tier)) as u8;
            w.raw(&bad.key.0).u8(tier).u8(u8::from(bad.quarantined)).bytes(bad.reason.as_bytes());
        }
        Ok(w.0)
    }

    fn trim(&self, r: &mut Reader<'_>) -> std::result::Result<Vec<u8>, String> {
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

impl Session {
    /// `Op::Acquire`: pins each block found for this connection until `Release`, and answers its slot.
    fn acquire(&mut self, keys: &[BlockKey], w: &mut Writer) -> std::result::Result<(), String> {
        let slots = self.ns.store.acquire(keys).map_err(|e| e.to_string())?;
        let mut loaded = 0;
        for (key, slot) in keys.iter().zip(slots) {
            if slot.is_some() {
                *self.readers.entry(*key).or_default() += 1;
                loaded += 1;
            }
            w.u32(slot.unwrap_or(NO_SLOT));
        }
        self.count(|c| {
            c.loaded_slices += loaded;
            c.load_missed_slices += keys.len() as u64 - loaded;
        });
        Ok(())
    }

    fn unpin(&mut self, keys: &[BlockKey]) {
        let held = take_held(&mut self.pins, keys);
        if !held.is_empty() {
            self.ns.store.unpin(&held);
        }
    }

    /// Adds to this connection's engine's counters (nothing for an unlabelled connection).
    fn count(&self, update: impl FnOnce(&mut EngineCounters)) {
        if let Some(label) = &self.label {
            self.ns.engines.lock().record(label, update);
        }
    }

    fn release_readers(&mut self, keys: &[BlockKey]) {
        let held = take_held(&mut self.readers, keys);
        if !held.is_empty() {
            self.ns.store.release(&held);
        }
    }

    /// Per key `(kind, slot)` (`ReserveKind`): fill this slot, present, dropped, or no room now:
    /// fill and commit what you got, then reserve these again.
    ///
    /// A block another rank reserved is taken at once (its slot exists). A new block needs room in
    /// the NVMe write backlog. When there is none, a connection that holds reservations it has not
    /// committed gets "no room now" (its own commits are what frees room: waiting would deadlock on
    /// itself); one that holds none waits like a local put (at most `slot_wait_ms`) for other ranks'
    /// commits or for NVMe writes to drain, without holding the fills lock. A block one rank gave
    /// up is given up by every rank (`dropped`), so no rank fills a slot the others will never
    /// complete.
    fn reserve(&mut self, keys: &[BlockKey]) -> Result<Vec<(ReserveKind, u32)>> {
        let ns = Arc::clone(&self.ns);
        let deadline = Instant::now() + Duration::from_millis(ns.store.slot_wait_ms());
        let mut out: Vec<Option<(ReserveKind, u32)>> = vec![None; keys.len()];
        loop {
            let mut fills = ns.fills.lock();
            let mut dropped = ns.dropped.lock();
            let fresh = self.fresh_keys(keys, &mut out, &fills, &dropped);
            let mut reserved: HashMap<BlockKey, Reservation> =
                fresh.iter().copied().zip(ns.store.try_reserve_puts(&fresh)?).collect();
            let mut short_of_room = false;
            for (key, decided) in keys.iter().zip(out.iter_mut()) {
                if decided.is_some() {
                    continue;
                }
                match reserved.remove(key) {
                    Some(Reservation::Fill { slot, sequence }) => {
                        fills.open(*key, Fill::new(slot, sequence, self.tp_size, Instant::now()));
                    }
                    Some(Reservation::Present) => {
                        *decided = Some((ReserveKind::Present, NO_SLOT));
                        continue;
                    }
                    Some(Reservation::Dropped) => {
                        short_of_room = true;
                        continue;
                    }
                    None => {}
                }
                *decided = self.join(&mut fills, key);
            }
            let out_of_time = Instant::now() >= deadline;
            if short_of_room && out_of_time {
                // Given up, for every rank: a rank that comes later drops it at once. Also when this
                // pass reserved others of the batch: a key reported dropped but left out of `dropped`
                // lets a peer rank open a fill this rank never commits.
                for (key, decided) in keys.iter().zip(out.iter_mut()).filter(|(_, d)| d.is_none()) {
                    dropped.insert(*key);
                    *decided = Some((ReserveKind::Dropped, NO_SLOT));
                }
            }
            drop((fills, dropped));
            if !short_of_room || out_of_time {
                break;
            }
            if !self.reserved.is_empty() {
                // Its own commits free room: the client fills and commits, then asks again.
                for decided in out.iter_mut().filter(|d| d.is_none()) {
                    *decided = Some((ReserveKind::Retry, NO_SLOT));
                }
                break;
            }
            // Whether or not room came, one more pass decides (joins a fill another rank made).
            ns.store.wait_for_put_room_until(deadline);
        }
        let out: Vec<(ReserveKind, u32)> =
            out.into_iter().map(|d| d.unwrap_or((ReserveKind::Dropped, NO_SLOT))).collect();
        let dropped = out.iter().filter(|(kind, _)| *kind == ReserveKind::Dropped).count();
        ns.store.count_dropped_stores(dropped as u64);
        Ok(out)
    }

    /// The keys of this pass that need a new fill: not decided, not being filled, not repeated;
    /// a key given up recently is decided dropped here.
    fn fresh_keys(
        &self,
        keys: &[BlockKey],
        out: &mut [Option<(ReserveKind, u32)>],
        fills: &Fills,
        dropped: &DroppedKeys,
    ) -> Vec<BlockKey> {
        let mut seen = std::collections::HashSet::new();
        let mut fresh = Vec::new();
        for (key, decided) in keys.iter().zip(out.iter_mut()) {
            if decided.is_some() || fills.is_open(key) || !seen.insert(*key) {
                continue;
            }
            if dropped.contains(key) {
                *decided = Some((ReserveKind::Dropped, NO_SLOT));
            } else {
                fresh.push(*key);
            }
        }
        fresh
    }

    /// This rank's share of an existing fill, if it may take one.
    fn join(&mut self, fills: &mut Fills, key: &BlockKey) -> Option<(ReserveKind, u32)> {
        let joined = fills.join(key, self.rank, self.tp_size)?;
        if let Joined::Fill { sequence, .. } = joined {
            self.reserved.push((*key, sequence));
        }
        Some(joined.reply())
    }

    /// This rank's slices of `keys` are in their slots: per key, whether the commit counts. A key
    /// whose fill was given up meanwhile (another rank aborted it, or it expired) is refused.
    fn commit(&mut self, keys: &[BlockKey]) -> Result<Vec<bool>> {
        let accepted = self.let_go(keys, true)?;
        let refused = accepted.iter().filter(|&&ok| !ok).count() as u64;
        self.ns.refused_commits.fetch_add(refused, Ordering::Relaxed);
        Ok(accepted)
    }

    /// Gives up `keys`: the fills this connection holds, and the stores of the others (a rank that
    /// found no room for them), for every rank.
    fn abort(&mut self, keys: &[BlockKey]) {
        let held: std::collections::HashSet<BlockKey> = self.reserved.iter().map(|(key, _)| *key).collect();
        let unheld: Vec<BlockKey> = keys.iter().filter(|key| !held.contains(key)).copied().collect();
        // Aborts only give back: no store call that can fail.
        let _ = self.let_go(keys, false);
        if !unheld.is_empty() {
            self.give_up(&unheld);
        }
    }

    /// Ends every reservation this connection holds of each of `keys`, committing this rank's slice
    /// or not; per key, whether a commit counted.
    fn let_go(&mut self, keys: &[BlockKey], commit: bool) -> Result<Vec<bool>> {
        let committed = commit.then_some(1u64 << self.rank);
        let mut steps = StoreSteps::default();
        let mut accepted = Vec::with_capacity(keys.len());
        {
            let mut fills = self.ns.fills.lock();
            for key in keys {
                let mut counted = false;
                self.reserved.retain(|(held, sequence)| {
                    if held != key {
                        return true;
                    }
                    let (ok, outcome) = fills.let_go(key, *sequence, committed);
                    counted |= ok;
                    steps.add(*key, outcome);
                    false
                });
                accepted.push(counted);
            }
        }
        steps.apply(&self.ns.store)?;
        Ok(accepted)
    }

    /// Stores this rank gives up without holding them (a client that got no room): counted as
    /// dropped, and given up by every rank, as `reserve` does when it runs out of time.
    fn give_up(&mut self, keys: &[BlockKey]) {
        let (mut give_back, mut counted) = (Vec::new(), 0u64);
        {
            let mut fills = self.ns.fills.lock();
            let mut dropped = self.ns.dropped.lock();
            for key in keys {
                dropped.insert(*key);
                match fills.give_up_unheld(key, self.rank, self.tp_size) {
                    (true, Some(slot)) => give_back.push((*key, slot)),
                    (true, None) => {}
                    (false, _) => counted += 1,
                }
            }
        }
        self.ns.store.count_dropped_stores(counted);
        if !give_back.is_empty() {
            self.ns.store.abort_puts(&give_back);
        }
        self.count(|c| c.dropped_slices += keys.len() as u64);
    }
}

/// A connection's holds end with it, however it ended: closed, said hello again, or its thread
/// panicked (the unwinding drops the session).
impl Drop for Session {
    fn drop(&mut self) {
        let reserved: Vec<BlockKey> = self.reserved.iter().map(|(key, _)| *key).collect();
        // Gives back only: `let_go` without commits makes no store call that can fail.
        let _ = self.let_go(&reserved, false);
        let pinned = drain_held(&mut self.pins);
        if !pinned.is_empty() {
            self.ns.store.unpin(&pinned);
        }
        let read = drain_held(&mut self.readers);
        if !read.is_empty() {
            self.ns.store.release(&read);
        }
        // The date first: the janitor reads `attached` before it, and must not see a stale date.
        *self.ns.detached_at.lock() = Instant::now();
        self.ns.attached.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The keys of `keys` this connection holds in `held`, each taken off once (a key it does not hold
/// is ignored: releasing it would take away another connection's hold).
fn take_held(held: &mut HashMap<BlockKey, u32>, keys: &[BlockKey]) -> Vec<BlockKey> {
    let mut taken = Vec::new();
    for key in keys {
        if let Some(count) = held.get_mut(key) {
            *count -= 1;
            if *count == 0 {
                held.remove(key);
            }
            taken.push(*key);
        }
    }
    taken
}

/// Every hold in `held`, once per count (the connection closed).
fn drain_held(held: &mut HashMap<BlockKey, u32>) -> Vec<BlockKey> {
    held.drain().flat_map(|(key, count)| std::iter::repeat_n(key, count as usize)).collect()
}
