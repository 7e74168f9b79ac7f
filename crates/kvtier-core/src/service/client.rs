//! The engine side: one connection to the host service, and the namespace's DRAM pool mapped into
//! this process. A worker copies its own slice of each block between its KV cache and the pool
//! (`store_blocks`, `load_blocks`); KV bytes never travel over the socket.
//!
//! Every call is bounded by the connection's timeout. A call that fails or times out leaves the
//! connection unusable (a late reply could be taken for the next one's), so the client drops it and
//! every later call fails at once: the caller reconnects.

mod copies;
mod pool;

use super::placement::{Placement, PlacementRun};
use super::protocol::*;
use crate::error::{Error, Result};
use crate::key::BlockKey;
use copies::MAX_COPY_THREADS;
use pool::PoolMap;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What `hello` attached to: the namespace's pool and this engine's slice of each block.
#[derive(Debug, Clone)]
pub struct Attached {
    pub pool_path: PathBuf,
    pub pool_bytes: usize,
    pub slot_bytes: usize,
    pub slot_count: usize,
    pub value_offset: usize,
    pub object_bytes: usize,
    pub tp_size: u32,
    pub rank: u32,
    pub slice_bytes: usize,
    /// Where this rank's slice lies in each block object (`Client::set_placement`).
    pub placement: Placement,
}

impl Attached {
    /// Offset in the pool of the object of the block in `slot`.
    fn object_offset(&self, slot: u32) -> Option<usize> {
        let at = (slot as usize).checked_mul(self.slot_bytes)? + self.value_offset;
        (at + self.object_bytes <= self.pool_bytes && (slot as usize) < self.slot_count).then_some(at)
    }
}

/// One engine's per-engine counters (`Client::engines`): its label and `(name, value)` pairs.
pub type EngineEntry = (String, Vec<(String, u64)>);

/// The service's answer to `Client::reserve` for one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReserveReply {
    /// Copy this rank's slice into the block's object, at this offset in the mapped pool
    /// (`Client::pool_span`), then `commit` it, or `abort` it if the copy failed.
    Fill { object_offset: usize },
    /// Stored already, or being filled by an engine of another TP size: nothing to copy.
    Present,
    /// The service will not take the block now (a dropped store, counted by the service).
    Dropped,
    /// No room now: commit what was handed out, then reserve this one again.
    Retry,
}

/// How long a flush's reply may take. A flush waits for the service's writes (NVMe, and the
/// remote tiers' publishes, each PUT bounded by its own request timeout), not on any request's
/// path: under the connection's timeout (`service_timeout_ms`, 2 s by default) a flush of a large
/// backlog would take a busy, healthy service for hung and drop the connection, and the engine
/// would serve misses and drop stores until it reattached. Past this, it is taken for hung.
pub const FLUSH_REPLY_TIMEOUT: Duration = Duration::from_secs(300);

/// How long a hello's reply may take. The first hello of a namespace opens its store (NVMe
/// recovery, a pool faulted in, a remote tier listed): seconds to minutes on a large or slow store.
/// Under the connection's timeout (`service_timeout_ms`, 2 s) a scheduler took a healthy service
/// opening its store for hung, logged so, and asked again every second, each hello left waiting
/// on a service thread behind the open. A hello waits in a connect attempt of its own (the engine
/// serves misses meanwhile), never on a request's path; the service's own bound on it
/// (`ServiceConfig::open_wait_ms`) is longer, so the engine gives up first.
pub const HELLO_REPLY_TIMEOUT: Duration = Duration::from_secs(120);

pub struct Client {
    socket_path: PathBuf,
    stream: Option<UnixStream>,
    pool: Option<PoolMap>,
    attached: Option<Attached>,
    /// The namespace description of the hello that mapped `pool`.
    description: Option<Vec<u8>>,
    copy_threads: usize,
    /// The ops (one bit per op code) the service answered with `unknown request opcode`: a service
    /// of an older kvtier (version 2 without them), not asked them again (`call_if_known`).
    unknown_ops: u32,
}

fn service_error(socket: &Path, what: impl std::fmt::Display) -> Error {
    Error::Service { message: format!("kvtier service at {}: {what}", socket.display()) }
}

impl Client {
    /// Connects; every later call waits at most `timeout` for each read and write.
    pub fn connect(socket_path: &Path, timeout: Duration) -> Result<Client> {
        let stream = UnixStream::connect(socket_path).map_err(|e| {
            service_error(
                socket_path,
                format!("cannot connect ({e}); start it with `kvtier serve` or let the engine start it"),
            )
        })?;
        stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .map_err(|e| service_error(socket_path, format!("setting socket timeouts: {e}")))?;
        // The pool it hands out will hold this engine's KV: only a service of our own user is trusted.
        let peer = rustix::net::sockopt::socket_peercred(std::os::fd::AsFd::as_fd(&stream))
            .map_err(|e| service_error(socket_path, format!("no peer credentials ({e})")))?;
        let me = rustix::process::geteuid();
        if peer.uid != me {
            return Err(service_error(
                socket_path,
                format!("is served by uid {}, not by this user (uid {}); refusing it", peer.uid.as_raw(), me.as_raw()),
            ));
        }
        Ok(Client {
            socket_path: socket_path.to_path_buf(),
            stream: Some(stream),
            pool: None,
            attached: None,
            description: None,
            copy_threads: 1,
            unknown_ops: 0,
        })
    }

    /// Threads a large load copies with (1 to `MAX_COPY_THREADS`). More than one only pays when the
    /// engine has idle cores: the worker raises it while no forward pass runs.
    pub fn set_copy_threads(&mut self, threads: usize) {
        self.copy_threads = threads.clamp(1, MAX_COPY_THREADS);
    }

    pub fn attached(&self) -> Option<&Attached> {
        self.attached.as_ref()
    }

    /// Whether the connection is still usable (no call has failed on it).
    pub fn is_connected(&self) -> bool {
        self.stream.is_some()
    }

    /// Whether the service hung up on this idle connection (it died: the kernel closed its end), found
    /// without a call and without waiting. The service never writes unasked, so between calls a
    /// readable socket means end of file. An idle engine learns of a killed service only so: until
    /// it unmaps the dead service's pool, a service started again cannot take that pool over.
    pub fn peer_hung_up(&self) -> bool {
        use rustix::event::{poll, PollFd, PollFlags};
        let Some(stream) = &self.stream else { return true };
        let mut fds = [PollFd::new(stream, PollFlags::IN | PollFlags::RDHUP)];
        match poll(&mut fds, Some(&rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 })) {
            Ok(0) => false,
            Ok(_) => !fds[0].revents().is_empty(),
            Err(_) => false, // EINTR: ask again next time
        }
    }

    /// `call` for an op a service of an older kvtier may not know: `Ok(None)` from such a service,
    /// now and from then on (it is not asked again).
    fn call_if_known(&mut self, op: Op, build: impl FnOnce(&mut Writer)) -> Result<Option<Vec<u8>>> {
        let bit = 1u32 << (op as u8);
        debug_assert!((op as u8) < 32, "one bit per op code in `unknown_ops`");
        if self.unknown_ops & bit != 0 {
            return Ok(None);
        }
        match self.call(op, build) {
            Err(Error::Service { message }) if message.contains("unknown request opcode") => {
                self.unknown_ops |= bit;
                Ok(None)
            }
            other => other.map(Some),
        }
    }

    fn call(&mut self, op: Op, build: impl FnOnce(&mut Writer)) -> Result<Vec<u8>> {
        let stream =
            self.stream.as_mut().ok_or_else(|| service_error(&self.socket_path, "connection lost; reconnect"))?;
        let mut w = Writer::new(op as u8);
        build(&mut w);
        let exchanged = write_frame(stream, &w.0).and_then(|()| read_frame(stream));
        let body = match exchanged {
            Ok(Some(body)) => body,
            Ok(None) => {
                self.stream = None;
                return Err(service_error(&self.socket_path, "closed the connection (did it stop?)"));
            }
            Err(e) => {
                let waited = stream.read_timeout().ok().flatten().unwrap_or_default();
                self.stream = None;
                let what = match e.kind() {
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                        "no reply to {op:?} within {} ms (the connection's timeout: service_timeout_ms, \
                         job_timeout_ms for a worker's): taken for hung",
                        waited.as_millis()
                    ),
                    _ => format!("{op:?} failed: {e}"),
                };
                return Err(service_error(&self.socket_path, what));
            }
        };
        match body[0] {
            STATUS_OK => Ok(body[1..].to_vec()),
            _ => Err(service_error(&self.socket_path, String::from_utf8_lossy(&body[1..]))),
        }
    }

    fn parse<T>(
        &mut self,
        body: &[u8],
        parse: impl FnOnce(&mut Reader<'_>) -> std::result::Result<T, ProtocolError>,
    ) -> Result<T> {
        parse(&mut Reader::new(body)).map_err(|e| {
            self.stream = None;
            service_error(&self.socket_path, e)
        })
    }

    /// Attaches to the namespace `description` as `rank` of `tp_size`, each moving `slice_bytes` of
    /// every block; maps its pool.
    ///
    /// Once per client: the caller may hold views of the mapped pool (`pool_span`, a GPU's
    /// registration of it), and another namespace's hello would have to unmap it under them. A
    /// second hello of the same namespace is accepted while the service still has the same pool
    /// file at the same size (the mapping is kept); anything else is refused: open a new client.
    pub fn hello(&mut self, description: &[u8], tp_size: u32, rank: u32, slice_bytes: usize) -> Result<&Attached> {
        if self.description.as_deref().is_some_and(|said| said != description) {
            return Err(service_error(
                &self.socket_path,
                "this client already said hello to another namespace, and its pool may still be in use: open a \
                 new connection (Client::connect) for this one",
            ));
        }
        let body = self.with_reply_timeout(HELLO_REPLY_TIMEOUT, |c| {
            c.call(Op::Hello, |w| {
                w.u16(PROTOCOL_VERSION).u32(tp_size).u32(rank).u64(slice_bytes as u64).bytes(description);
            })
        })?;
        let attached = self.parse(&body, |r| {
            let (slot_bytes, slot_count, value_offset, pool_bytes, object_bytes) =
                (r.u64()?, r.u64()?, r.u64()?, r.u64()?, r.u64()?);
            let path = std::str::from_utf8(r.bytes()?).map_err(|_| ProtocolError("pool path is not UTF-8"))?;
            Ok(Attached {
                pool_path: PathBuf::from(path),
                pool_bytes: pool_bytes as usize,
                slot_bytes: slot_bytes as usize,
                slot_count: slot_count as usize,
                value_offset: value_offset as usize,
                object_bytes: object_bytes as usize,
                tp_size,
                rank,
                slice_bytes,
                placement: Placement::contiguous(rank, slice_bytes),
            })
        })?;
        if slice_bytes.checked_mul(tp_size as usize) != Some(attached.object_bytes) {
            self.stream = None;
            return Err(service_error(&self.socket_path, "object size does not match slices * tp_size"));
        }
        match &self.pool {
            Some(pool) if pool.is(&attached.pool_path, attached.pool_bytes) => {}
            Some(_) => {
                // The service attached this connection to a pool other than the one mapped here (the
                // namespace was closed and reopened): the mapping stays for the views of it, and the
                // connection, now attached elsewhere, goes.
                self.stream = None;
                return Err(service_error(
                    &self.socket_path,
                    "has another pool for this namespace than the one this client mapped at its first hello \
                     (it was closed and reopened): open a new connection (Client::connect)",
                ));
            }
            None => self.pool = Some(PoolMap::map(&attached.pool_path, attached.pool_bytes)?),
        }
        self.description = Some(description.to_vec());
        Ok(self.attached.insert(attached))
    }

    /// Places this rank's slice in each block object by `runs` instead of one contiguous range (a
    /// rank-independent object layout; see `placement`). Every engine sharing the namespace must
    /// place its slices by the same rule, which its namespace description names.
    pub fn set_placement(&mut self, runs: Vec<PlacementRun>) -> Result<()> {
        let attached = self.attached.as_mut().ok_or_else(|| service_error(&self.socket_path, "say hello first"))?;
        attached.placement = Placement::new(runs, attached.slice_bytes, attached.object_bytes)?;
        Ok(())
    }

    /// Per key, the tier that holds it (`Tier::wire_code`): 0 absent, 1 DRAM, 2 NVMe, 3 shared filesystem,
    /// 4 bucket.
    pub fn locate(&mut self, keys: &[BlockKey]) -> Result<Vec<u8>> {
        let body = self.call(Op::Locate, |w| {
            w.keys(keys);
        })?;
        if body.len() != keys.len() {
            self.stream = None;
            return Err(service_error(&self.socket_path, "short locate reply"));
        }
        Ok(body)
    }

    /// Pins the leading present keys: a flag per present key (`false`: a remote tier only, no pin).
    pub fn pin(&mut self, keys: &[BlockKey]) -> Result<Vec<bool>> {
        let body = self.call(Op::Pin, |w| {
            w.keys(keys);
        })?;
        self.parse(&body, |r| {
            let n = r.u32()? as usize;
            (0..n).map(|_| r.u8().map(|b| b != 0)).collect()
        })
    }

    /// The blocks are `tenant`'s (`Op::Tenant`). A service without the op (an older version 2)
    /// keeps no tenants: nothing to tell it.
    pub fn assign_tenant(&mut self, keys: &[BlockKey], tenant: &crate::tenant::TenantId) -> Result<()> {
        self.call_if_known(Op::Tenant, |w| {
            w.keys(keys).raw(tenant);
        })
        .map(drop)
    }

    /// The blocks will be read again, says the caller (`Op::Retain`, `Store::note_retained`). A
    /// service without the op (an older version 2) admits by its own evidence: nothing to tell it.
    pub fn note_retained(&mut self, keys: &[BlockKey]) -> Result<()> {
        self.call_if_known(Op::Retain, |w| {
            w.keys(keys);
        })
        .map(drop)
    }

    pub fn unpin(&mut self, keys: &[BlockKey]) -> Result<()> {
        self.call(Op::Unpin, |w| {
            w.keys(keys);
        })
        .map(drop)
    }

    pub fn stats(&mut self) -> Result<Vec<(String, u64)>> {
        let body = self.call(Op::Stats, |_| {})?;
        self.parse(&body, |r| {
            let n = r.u32()?;
            (0..n)
                .map(|_| {
                    let len = r.u16()? as usize;
                    let mut name = Vec::with_capacity(len);
                    for _ in 0..len {
                        name.push(r.u8()?);
                    }
                    Ok((String::from_utf8_lossy(&name).into_owned(), r.u64()?))
                })
                .collect()
        })
    }

    /// The change log of this connection's namespace from `cursor` (after `hello`; `Op::Changes`):
    /// at most `max` changes, and whether the cursor was reset (then they are the current state).
    pub fn changes(&mut self, cursor: u64, max: u32) -> Result<super::changes::ChangesReply> {
        let body = self.operator_call(Op::Changes, |w| {
            w.u64(cursor).u32(max);
        })?;
        self.parse(&body, |r| {
            let reset = r.u8()? != 0;
            let next = r.u64()?;
            let n = r.u32()?;
            let mut changes = Vec::with_capacity(n.min(1 << 16) as usize);
            for _ in 0..n {
                let key = BlockKey(r.array32()?);
                let tier = r.u8()?;
                let removed = r.u8()? != 0;
                changes.push(super::changes::Change { key, tier, removed });
            }
            Ok(super::changes::ChangesReply { reset, next, changes })
        })
    }

    /// An operator op (protocol version 2); a version-1 service does not know it.
    fn operator_call(&mut self, op: Op, build: impl FnOnce(&mut Writer)) -> Result<Vec<u8>> {
        self.call(op, build).map_err(|e| match e {
            Error::Service { message } if message.contains("unknown request opcode") => Error::Service {
                message: format!(
                    "{message}: this service speaks protocol version 1, without {op:?}; restart it with this \
                     kvtier (stop it, then `kvtier serve PATH`, or let an engine start it)"
                ),
            },
            other => other,
        })
    }

    /// Every namespace the service has open, with its counters, gauges and latency histograms.
    pub fn namespaces(&mut self) -> Result<(u16, Vec<NamespaceInfo>)> {
        let body = self.operator_call(Op::Namespaces, |_| {})?;
        self.parse(&body, |r| {
            let version = r.u16()?;
            let n = r.u32()?;
            let mut out = Vec::new();
            for _ in 0..n {
                out.push(NamespaceInfo {
                    digest: r.array32()?,
                    description: r.bytes()?.to_vec(),
                    tp_size: r.u32()?,
                    slice_bytes: r.u64()?,
                    object_bytes: r.u64()?,
                    values: r.pairs()?,
                });
            }
            Ok((version, out))
        })
    }

    /// One step of a scrub of the namespace `digest` (see `Store::verify_batch`; `shared_tier`:
    /// `Store::verify_shared_batch`).
    pub fn verify_batch(
        &mut self,
        digest: &[u8; 32],
        after: u64,
        max_blocks: u32,
        max_bytes_per_s: u64,
        shared_tier: bool,
    ) -> Result<RemoteVerifyBatch> {
        let body = self.operator_call(Op::Verify, |w| {
            w.raw(digest).u64(after).u32(max_blocks).u64(max_bytes_per_s);
            if shared_tier {
                w.u8(1);
            }
        })?;
        self.parse(&body, |r| {
            let next_after = r.u64()?;
            let done = r.u8()? != 0;
            let values = r.pairs()?;
            let n = r.u32()?;
            let mut bad = Vec::new();
            for _ in 0..n {
                bad.push(RemoteBadBlock {
                    key: BlockKey(r.array32()?),
                    tier: r.u8()?,
                    quarantined: r.u8()? != 0,
                    reason: String::from_utf8_lossy(r.bytes()?).into_owned(),
                });
            }
            Ok(RemoteVerifyBatch { next_after, done, values, bad })
        })
    }

    /// Trims the namespace `digest`: `mode` 0 all, 1 older than `value` ms, 2 NVMe to `value` bytes.
    pub fn trim(&mut self, digest: &[u8; 32], mode: u8, value: u64) -> Result<Vec<(String, u64)>> {
        let body = self.operator_call(Op::Trim, |w| {
            w.raw(digest).u8(mode).u64(value);
        })?;
        self.parse(&body, |r| r.pairs())
    }

    /// Names the engine this connection works for, in the service's per-engine counters (after
    /// `hello`; every connection of one engine gives the same label).
    pub fn set_label(&mut self, label: &str) -> Result<()> {
        self.operator_call(Op::Label, |w| {
            w.bytes(label.as_bytes());
        })
        .map(drop)
    }

    /// Adds what the engine counted itself since its last report to its per-engine counters (after
    /// `set_label`; `ENGINE_REPORTED` names the counts). A service of an older kvtier keeps none of
    /// them: nothing is sent to it again.
    pub fn report(&mut self, counts: &[(String, u64)]) -> Result<()> {
        self.call_if_known(Op::Report, |w| {
            w.pairs(counts);
        })
        .map(drop)
    }

    /// The namespace's per-engine counters: `(label, [(name, value)])`, sorted by label.
    pub fn engines(&mut self, digest: &[u8; 32]) -> Result<Vec<EngineEntry>> {
        let body = self.operator_call(Op::Engines, |w| {
            w.raw(digest);
        })?;
        self.parse(&body, |r| {
            let n = r.u32()?;
            (0..n).map(|_| Ok((String::from_utf8_lossy(r.bytes()?).into_owned(), r.pairs()?))).collect()
        })
    }

    /// Waits until the service has written every store it accepted and queued for NVMe (the write
    /// backlog empty, trailers written, the device files synced) and flushed the remote tiers. A
    /// block whose NVMe write was dropped (no region free, `nvme_dropped_writes`) stays in DRAM only.
    /// Its reply may take up to `FLUSH_REPLY_TIMEOUT`, whatever the connection's timeout.
    pub fn flush(&mut self) -> Result<()> {
        self.with_reply_timeout(FLUSH_REPLY_TIMEOUT, |c| c.call(Op::Flush, |_| {}).map(drop))
    }

    /// Runs `f` with the connection's read timeout raised to `timeout` (never lowered), then puts the
    /// connection's own back.
    fn with_reply_timeout<T>(&mut self, timeout: Duration, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let own = self.stream.as_ref().and_then(|s| s.read_timeout().ok().flatten());
        let raise = own.is_some_and(|own| own < timeout);
        if let (Some(stream), true) = (&self.stream, raise) {
            stream.set_read_timeout(Some(timeout)).map_err(|e| service_error(&self.socket_path, e))?;
        }
        let result = f(self);
        if let (Some(stream), true) = (&self.stream, raise) {
            if stream.set_read_timeout(own).is_err() {
                self.stream = None; // a connection whose timeout cannot be put back would wait too long
            }
        }
        result
    }

    // ---- the two-phase transfers, for a caller that copies itself (a GPU's DMA engine) ----

    /// Reserves a slot per block for this rank's slice. For every `Fill`, copy the slice into the
    /// pool at its object offset by this rank's placement (`placement_runs`), then `commit` or
    /// `abort` the key. A fill neither committed nor aborted is reclaimed when this connection
    /// closes, or after the service's fill timeout.
    pub fn reserve(&mut self, keys: &[BlockKey]) -> Result<Vec<ReserveReply>> {
        let body = self.call(Op::Reserve, |w| {
            w.keys(keys);
        })?;
        let decided = self.parse(&body, |r| {
            (0..keys.len()).map(|_| Ok((r.u8()?, r.u32()?))).collect::<std::result::Result<Vec<_>, _>>()
        })?;
        let attached = self.attached.as_ref().ok_or_else(|| service_error(&self.socket_path, "say hello first"))?;
        let mut out = Vec::with_capacity(keys.len());
        let mut outside = Vec::new();
        for (&key, (kind, slot)) in keys.iter().zip(decided) {
            out.push(match ReserveKind::from_u8(kind) {
                Some(ReserveKind::Fill) => match attached.object_offset(slot) {
                    Some(object_offset) => ReserveReply::Fill { object_offset },
                    None => {
                        outside.push(key);
                        ReserveReply::Dropped
                    }
                },
                Some(ReserveKind::Present) => ReserveReply::Present,
                Some(ReserveKind::Retry) => ReserveReply::Retry,
                // A kind this client does not know takes no slot: nothing is copied.
                Some(ReserveKind::Dropped) | None => ReserveReply::Dropped,
            });
        }
        if !outside.is_empty() {
            let _ = self.abort(&outside);
            self.stream = None;
            return Err(service_error(&self.socket_path, "handed out a slot outside its pool; reconnect"));
        }
        Ok(out)
    }

    /// Makes this rank's copies of reserved blocks count: `true` per block whose slice the service
    /// accepted (the block becomes visible once every rank committed).
    pub fn commit(&mut self, keys: &[BlockKey]) -> Result<Vec<bool>> {
        let body = self.call(Op::Commit, |w| {
            w.keys(keys);
        })?;
        if body.len() != keys.len() {
            self.stream = None;
            return Err(service_error(&self.socket_path, "short commit reply"));
        }
        Ok(body.iter().map(|&ok| ok != 0).collect())
    }

    /// Gives reserved slots back without storing (the copy into them failed). A key this connection
    /// did not reserve is a store it gives up (no room came): the service counts it as dropped, and
    /// every rank gives the block up.
    pub fn abort(&mut self, keys: &[BlockKey]) -> Result<()> {
        self.call(Op::Abort, |w| {
            w.keys(keys);
        })
        .map(drop)
    }

    /// Makes each block resident and verified in the pool and pins it for this connection: the
    /// offset of its object in the mapped pool, `None` for a miss. Copy this rank's slice out by
    /// its placement, then `release` the keys; the pins end when the connection closes otherwise.
    /// Ask for at most a quarter of the pool at once (see `load_blocks`).
    pub fn acquire(&mut self, keys: &[BlockKey]) -> Result<Vec<Option<usize>>> {
        let body = self.call(Op::Acquire, |w| {
            w.keys(keys);
        })?;
        let slots =
            self.parse(&body, |r| (0..keys.len()).map(|_| r.u32()).collect::<std::result::Result<Vec<_>, _>>())?;
        let attached = self.attached.as_ref().ok_or_else(|| service_error(&self.socket_path, "say hello first"))?;
        let offsets: Vec<Option<usize>> =
            slots.iter().map(|&slot| if slot == NO_SLOT { None } else { attached.object_offset(slot) }).collect();
        if slots.iter().zip(&offsets).any(|(&slot, at)| slot != NO_SLOT && at.is_none()) {
            self.stream = None;
            return Err(service_error(&self.socket_path, "handed out a slot outside its pool; reconnect"));
        }
        Ok(offsets)
    }

    /// Unpins blocks `acquire` pinned for this connection.
    pub fn release(&mut self, keys: &[BlockKey]) -> Result<()> {
        self.call(Op::Release, |w| {
            w.keys(keys);
        })
        .map(drop)
    }

    /// Faults the whole mapped pool in now (its page tables filled), so that this connection's
    /// copies take no page fault per 4 KiB: for a connection that copies (an engine's worker), at
    /// attach. One that only asks (an engine's scheduler side, operator commands) never calls it,
    /// and the pool then costs its process neither the time nor the page tables. Idempotent.
    pub fn populate_pool(&mut self) -> Result<()> {
        let pool = self.pool.as_mut().ok_or_else(|| service_error(&self.socket_path, "say hello first"))?;
        pool.populate();
        Ok(())
    }

    /// The pool as mapped in this process: its address and length. A caller registers it for
    /// DMA (cudaHostRegister) and copies at `address + object_offset`; valid until the client is
    /// dropped (a second hello keeps it, or is refused).
    pub fn pool_span(&self) -> Option<(usize, usize)> {
        self.pool.as_ref().map(|p| (p.base as usize, p.len))
    }
}

/// A namespace the service has open (`Client::namespaces`).
#[derive(Debug, Clone)]
pub struct NamespaceInfo {
    pub digest: [u8; 32],
    pub description: Vec<u8>,
    pub tp_size: u32,
    pub slice_bytes: u64,
    pub object_bytes: u64,
    /// Counters, gauges, dates and latency histogram buckets, by name (docs/service.md).
    pub values: Vec<(String, u64)>,
}

/// A bad copy a remote scrub found: `tier` 1 DRAM, 2 NVMe, 3 shared.
#[derive(Debug, Clone)]
pub struct RemoteBadBlock {
    pub key: BlockKey,
    pub tier: u8,
    pub quarantined: bool,
    pub reason: String,
}

#[derive(Debug, Clone)]
pub struct RemoteVerifyBatch {
    pub next_after: u64,
    pub done: bool,
    pub values: Vec<(String, u64)>,
    pub bad: Vec<RemoteBadBlock>,
}
