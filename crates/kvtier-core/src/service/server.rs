//! The service side: accepts engine connections, opens one store per namespace (its DRAM pool a
//! shared-memory file the engines map), and answers the protocol's requests.
//!
//! This file holds the running service (`Service`, its `ServiceConfig` and shared `State`), the
//! accept loop and the janitor, and each connection's request dispatch (`Connection`). The
//! namespace table, with the host DRAM budget and the operator requests, is `namespaces.rs`; what
//! a connection holds and how it is given back (the lease protocol: reserve, commit, abort) is
//! `sessions.rs`.

use super::namespaces::{pool_file_prefix, Closing, Namespaced};
use super::protocol::*;
use super::sessions::{expire_fills, Session};
use super::socket_file;
use crate::config::StoreConfig;
use crate::error::{Error, Result};
use crate::key::Namespace;
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
/// How often a connection thread waiting for a request looks at what its session holds
/// (`pin_lease_ms`).
const REQUEST_POLL: Duration = Duration::from_secs(1);
const TIMELINE_SAVE_PERIOD: Duration = Duration::from_secs(10);
/// How often a running service removes what dead services left (`remove_leftovers`): a service
/// killed on another socket and never started again there, or a pool of this socket's predecessor
/// that no namespace took over, stays until then.
const LEFTOVER_SWEEP_PERIOD: Duration = Duration::from_secs(60);
/// A pool file of another socket's service younger than this is left alone: that service may be
/// between creating and locking it.
const FOREIGN_ORPHAN_MIN_AGE: Duration = Duration::from_secs(30);
/// The same for this socket's own pool files, at the janitor's sweeps: only this service creates
/// them now, and locks each at once.
const OWN_ORPHAN_MIN_AGE: Duration = Duration::from_secs(2);

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
    /// Pins a connection holds while it sends nothing for this long are let go (counted in
    /// `service_expired_pins`): an engine that froze holding them (SIGSTOP, a cgroup freezer) kept
    /// its pinned blocks unevictable, and every other engine's stores short of room, for as long as
    /// it stayed stopped. Longer than an engine's own pin lease (twice its `job_timeout_ms`, 240 s
    /// by default, 540 s at most), which a running engine keeps. 0: never. Default 600000.
    pub pin_lease_ms: u64,
    /// Fault injection for tests: a `Label` request naming this label panics in its connection
    /// thread, as a bug would. Only with the `testing` feature (not in production builds).
    #[cfg(any(test, feature = "testing"))]
    pub panic_on_label: Option<String>,
    /// Fault injection for tests: each new namespace's store opens this much later, as on a slow or
    /// frozen filesystem. Only with the `testing` feature.
    #[cfg(any(test, feature = "testing"))]
    pub open_delay: Duration,
    /// How long a hello waits while another connection opens the same namespace, before it is
    /// answered with a timeout. Longer than an engine's own wait for its hello
    /// (`client::HELLO_REPLY_TIMEOUT`, 120 s), so an engine gives up first; what it bounds is the
    /// service's side: on a frozen filesystem every reconnect's hello would wait for as long as
    /// the open, one connection thread each, until `max_connections` refuses every client.
    /// Default 150000.
    pub open_wait_ms: u64,
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
            pin_lease_ms: 600_000,
            #[cfg(any(test, feature = "testing"))]
            panic_on_label: None,
            #[cfg(any(test, feature = "testing"))]
            open_delay: Duration::ZERO,
            open_wait_ms: 150_000,
            host_dram_bytes: 0,
            idle_timeout_ms: 0,
        }
    }
}

pub(super) struct State {
    pub(super) config: ServiceConfig,
    /// The socket file this service bound: at stop it removes that file, not whatever another
    /// service may have put at the path since.
    pub(super) socket_id: socket_file::FileId,
    pub(super) namespaces: Mutex<HashMap<Namespace, Arc<Namespaced>>>,
    /// One lock per namespace being opened: `Store::open` (recovery, fallocate and faulting in the
    /// pool: seconds for a few GiB) runs outside `namespaces`' lock, so other clients' calls go on,
    /// and two hellos for one new namespace open it once.
    pub(super) opening: Mutex<HashMap<Namespace, Arc<Mutex<()>>>>,
    /// The DRAM granted under a host budget to namespaces still opening: each new pool is sized from
    /// what the open ones and these left, and a store that opens slowly (or on a frozen mount) holds
    /// no other namespace's open.
    pub(super) opening_pools: Mutex<HashMap<Namespace, u64>>,
    /// When the service last held a connection or a namespace (for `Service::idle_ms`).
    pub(super) busy_at: Mutex<Instant>,
    /// Held while a connection is accepted and counted, and while `Service::stop_if_idle` decides.
    pub(super) accepting: Mutex<()>,
    /// Clones of the live connections, to shut them down when the service stops.
    pub(super) connections: Mutex<HashMap<u64, UnixStream>>,
    pub(super) next_connection: AtomicU64,
    pub(super) stop: AtomicBool,
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
        remove_leftovers(&config, true);
        let state = Arc::new(State {
            config,
            socket_id,
            namespaces: Mutex::new(HashMap::new()),
            opening: Mutex::new(HashMap::new()),
            opening_pools: Mutex::new(HashMap::new()),
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

    /// Stops accepting, closes every connection, releases the socket, then flushes and closes every
    /// store, each on a thread of its own (`Closing`): a namespace whose filesystem is frozen holds
    /// neither the others nor the service's exit longer than its store's own limits. A connection
    /// still waiting on the filesystem (a new namespace's open) is not waited for. Idempotent.
    pub fn stop(&mut self) -> Result<()> {
        {
            // No connection is accepted after this (`accept_loop` looks under the same lock).
            let _accepting = self.state.accepting.lock();
            self.state.stop.store(true, Ordering::Release);
        }
        for (_, stream) in self.state.connections.lock().drain() {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        // First: an engine that reconnects now starts a new service rather than wait for this one.
        socket_file::release(&self.state.config.socket_path, self.state.socket_id);
        for thread in self.threads.drain(..) {
            thread.thread().unpark(); // the janitor sleeps in `park_timeout`
            let _ = thread.join();
        }
        let closing: Vec<Closing> =
            self.state.namespaces.lock().drain().map(|(digest, ns)| Closing::start(digest, ns)).collect();
        let mut result = Ok(());
        for namespace in closing {
            if let Err(e) = namespace.finish() {
                result = Err(e);
            }
        }
        // A predecessor's pool no namespace took over goes with this service (one that exits before
        // its first sweep would otherwise leave it to the next, which keeps it again at its start).
        remove_leftovers(&self.state.config, false);
        result
    }
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
/// reboot) and sockets nothing listens on, with their pid files. At start (`at_start`) the pools of
/// this socket's own dead predecessor stay: the namespace they held takes them over when its engines
/// attach again (`tiers::dram`'s adoption), which spares zeroing gigabytes beside a busy engine.
fn remove_leftovers(config: &ServiceConfig, at_start: bool) {
    use crate::tiers::dram::remove_orphan_pools;
    let own = pool_file_prefix(Some(&config.socket_path));
    let mut removed =
        remove_orphan_pools(&config.pool_dir, &pool_file_prefix(None), Some(&own), FOREIGN_ORPHAN_MIN_AGE);
    if !at_start {
        removed.extend(remove_orphan_pools(&config.pool_dir, &own, None, OWN_ORPHAN_MIN_AGE));
    }
    for path in removed {
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
        // Not busy yet: a held connection keeps the service from being idle (`holds_anything`), and
        // only one that made a request restarts the idle time when it ends (`ConnectionSlot`).
        if let Ok(clone) = stream.try_clone() {
            state.connections.lock().insert(id, clone);
        }
        drop(accepting);
        let conn_state = Arc::clone(state);
        let spawned = std::thread::Builder::new().name(format!("kvtier-svc-conn-{id}")).spawn(move || {
            // A panic outside a request's own catch counts as activity.
            let mut slot = ConnectionSlot { state: Arc::clone(&conn_state), id, made_requests: true };
            slot.made_requests = Connection { state: conn_state, session: None, hang_up: false }.serve(stream);
        });
        if spawned.is_err() {
            state.connections.lock().remove(&id);
        }
    }
}

/// A connection's place in `State::connections` (counted against `max_connections`), given back
/// when its thread ends, even by a panic. The end of a connection that made requests restarts the
/// idle time; one that made none is no activity: services sharing a socket directory probe each
/// other's sockets every `LEFTOVER_SWEEP_PERIOD` (connect, close), and two idle services whose
/// probes counted kept each other from their idle exit for ever.
struct ConnectionSlot {
    state: Arc<State>,
    id: u64,
    made_requests: bool,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.state.connections.lock().remove(&self.id);
        if self.made_requests {
            *self.state.busy_at.lock() = Instant::now();
        }
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
    let (mut timelines_saved, mut swept) = (Instant::now(), Instant::now());
    while !state.stop.load(Ordering::Acquire) {
        std::thread::park_timeout(JANITOR_PERIOD);
        if swept.elapsed() >= LEFTOVER_SWEEP_PERIOD {
            swept = Instant::now();
            remove_leftovers(&state.config, false);
        }
        let namespaces: Vec<Arc<Namespaced>> = state.namespaces.lock().values().cloned().collect();
        // A crash loses the block dates recorded since the last save (the blocks stay), and the
        // write budgets resume from the last save.
        let save_timelines = timelines_saved.elapsed() >= TIMELINE_SAVE_PERIOD;
        if save_timelines {
            timelines_saved = Instant::now();
        }
        for ns in namespaces {
            let saved = if save_timelines { ns.store.save_namespace_state() } else { ns.store.save_budgets_if_due() };
            if let Err(e) = saved {
                log::warn!("kvtier: saving block dates and write budgets failed: {e}");
            }
            expire_fills(&ns, &state.config);
        }
        state.close_idle_namespaces();
    }
}

struct Connection {
    state: Arc<State>,
    session: Option<Session>,
    /// Close the connection unanswered: its hello waited `open_wait_ms` for another connection's
    /// open of its namespace. The engine then takes the service for unreachable (it recomputes and
    /// reconnects later), as when its own wait runs out first; an error reply would fail its start.
    hang_up: bool,
}

impl Connection {
    /// Answers the connection's requests until it closes; whether it made any.
    fn serve(mut self, mut stream: UnixStream) -> bool {
        let mut made_requests = false;
        let mut silent_since = Instant::now();
        loop {
            if !self.wait_for_request(&stream, silent_since) {
                continue;
            }
            let body = match read_frame(&mut stream) {
                Ok(Some(body)) => body,
                Ok(None) => break,
                Err(e) => {
                    log::debug!("kvtier: service connection closed: {e}");
                    break;
                }
            };
            made_requests = true;
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
            if self.hang_up || write_frame(&mut stream, &reply).is_err() || close {
                break;
            }
            silent_since = Instant::now();
        }
        self.session = None;
        made_requests
    }

    /// Whether a request (or the peer's hang-up) is there to read, waited `REQUEST_POLL` at most.
    /// While none comes, pins the session has held through `pin_lease_ms` of silence go
    /// (`Session::expire_pins`).
    fn wait_for_request(&mut self, stream: &UnixStream, silent_since: Instant) -> bool {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let mut fds = [PollFd::new(stream, PollFlags::IN)];
        let timeout = Timespec { tv_sec: REQUEST_POLL.as_secs() as i64, tv_nsec: 0 };
        match poll(&mut fds, Some(&timeout)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => {}
            // Another error: `read_frame` says what the socket holds.
            Ok(_) | Err(_) => return true,
        }
        let lease_ms = self.state.config.pin_lease_ms;
        let lapsed = lease_ms > 0 && silent_since.elapsed() >= Duration::from_millis(lease_ms);
        if let Some(session) = self.session.as_mut().filter(|session| lapsed && !session.pins.is_empty()) {
            session.expire_pins(lease_ms);
        }
        false
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
            Op::Stats | Op::Flush | Op::Label | Op::Report => Vec::new(),
            _ => r.keys().map_err(|e| e.to_string())?,
        };
        let mut w = Writer::default();
        match op {
            Op::Hello | Op::Namespaces | Op::Verify | Op::Trim | Op::Engines | Op::Changes => {
                unreachable!("answered above")
            }
            Op::Label => session.label = Some(checked_label(&self.state.config, r)?),
            Op::Report => {
                let counts = r.pairs().map_err(|e| e.to_string())?;
                session.count(|c| c.add_reported(&counts));
            }
            Op::Locate => {
                let tiers = session.ns.store.locate_many(&keys);
                w.raw(&tiers.iter().map(|&tier| crate::catalog::Tier::wire_code(tier)).collect::<Vec<u8>>());
                session.count(|c| tiers.iter().for_each(|&tier| *c.lookup(tier) += 1));
            }
            Op::Pin => {
                let flags = session.pin(&keys);
                w.u32(flags.len() as u32);
                w.raw(&flags.iter().map(|&pinned| u8::from(pinned)).collect::<Vec<u8>>());
            }
            Op::ReadAhead => {
                let resident = session.ns.store.read_ahead(&keys).map_err(|e| e.to_string())?;
                w.raw(&resident.iter().map(|&found| u8::from(found)).collect::<Vec<u8>>());
            }
            Op::Unpin => session.unpin(&keys),
            Op::Retain => session.ns.store.note_retained(&keys),
            Op::Tenant => session.ns.store.assign_tenant(&keys, &r.array16().map_err(|e| e.to_string())?),
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
        use super::changes::{LOG_CAPACITY, TIER_REMOTE};
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
            debug_assert!(change.tier != 0 && change.tier <= TIER_REMOTE);
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
        let mut budgets_counted = Vec::new(); // a host service's models share each tier's: counted once
        for ns in namespaces {
            let mut stats = ns.store.stats();
            for (tier, budget) in ns.store.write_budget_ids() {
                if budgets_counted.contains(&budget) {
                    stats.gauges.set_write_budget(tier, 0, 0);
                } else {
                    budgets_counted.push(budget);
                }
            }
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
            add("service_expired_pins", ns.expired_pins.load(Ordering::Relaxed));
            add("service_capped_reserves", ns.capped_reserves.load(Ordering::Relaxed));
            add("service_held_pins", ns.held_pins.load(Ordering::Relaxed));
            add("service_held_load_slots", ns.held_reads.load(Ordering::Relaxed));
            add("service_refused_commits", ns.refused_commits.load(Ordering::Relaxed));
        }
        add("service_connections", self.state.connections.lock().len() as u64);
        add("service_namespaces", self.state.namespaces.lock().len() as u64);
        let mut pairs: Vec<(String, u64)> = totals.into_iter().map(|(name, value)| (name.to_string(), value)).collect();
        for ns in namespaces {
            add_tenant_fields(&mut pairs, ns.store.stats().tenant_fields);
        }
        let mut w = Writer::default();
        w.pairs(&pairs);
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
        let ns = self.state.namespace(&description, tp_size, slice_bytes).inspect_err(|e| {
            if let Error::Timeout { .. } = e {
                log::warn!(
                    "kvtier: {e}; the hello's connection is closed unanswered (its engine recomputes and reconnects)"
                );
                self.hang_up = true;
            }
        })?;
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
        self.session = Some(Session::new(ns, rank, tp_size));
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

/// `parse_label`, and the panic a test asks for with `ServiceConfig::panic_on_label` (`testing`
/// feature).
fn checked_label(
    #[cfg_attr(not(any(test, feature = "testing")), allow(unused_variables))] config: &ServiceConfig,
    r: &mut Reader<'_>,
) -> std::result::Result<String, String> {
    let label = parse_label(r)?;
    #[cfg(any(test, feature = "testing"))]
    if config.panic_on_label.as_ref() == Some(&label) {
        panic!("fault injection: a request labelled {label:?}");
    }
    Ok(label)
}

/// Adds per-tenant figures into `pairs`, summed by name (a tenant's figures over namespaces).
fn add_tenant_fields(pairs: &mut Vec<(String, u64)>, fields: Vec<(String, u64)>) {
    for (name, value) in fields {
        match pairs.iter_mut().find(|(n, _)| *n == name) {
            Some((_, total)) => *total += value,
            None => pairs.push((name, value)),
        }
    }
}

/// An engine label (`Op::Label`): UTF-8, 1 to `MAX_ENGINE_LABEL_BYTES` bytes.
fn parse_label(r: &mut Reader<'_>) -> std::result::Result<String, String> {
    let bytes = r.bytes().map_err(|e| e.to_string())?;
    if bytes.is_empty() || bytes.len() > MAX_ENGINE_LABEL_BYTES {
        return Err(format!("an engine label has 1 to {MAX_ENGINE_LABEL_BYTES} bytes, got {}", bytes.len()));
    }
    String::from_utf8(bytes.to_vec()).map_err(|_| "an engine label must be UTF-8".to_string())
}
