//! The device queue: one thread per device file owning its I/O engine, scheduling reads before
//! writes and enforcing strict completion rules.
//!
//! Scheduling: every queued read is submitted before any write; a write is taken only when no read is
//! waiting and the bytes of writes in flight are under `max_write_inflight_bytes`, so a burst of
//! stores can delay a load by at most that much I/O. Completion: a short transfer is resubmitted for
//! the remainder, EINTR/EAGAIN are retried at most `MAX_RETRIES` times, a zero-byte transfer is an
//! error (truncated file or full device), EINVAL is logged as an alignment bug.
//!
//! Ownership: an operation is completed (its `on_done` run, which frees or reuses its buffer) only
//! when the engine reports it done, or when the engine never accepted it. A failed `wait` cancels
//! what is in flight and keeps reaping; an engine that stays broken has its operations abandoned:
//! `on_done` gets an [`Abandoned`] error and must keep the buffer forever, and the engine itself is
//! leaked so the kernel can still finish into it.
//!
//! A queue serves one device file (the NVMe tier) or many files (the shared tier's data files: each
//! operation names its file and keeps it open until it completes). [`DeviceQueue::run_all`] is the
//! blocking form for callers that wait for a batch anyway.

use super::*;
use crate::stats::Stats;
use crossbeam_channel::{never, select, unbounded, Receiver, Sender};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::thread::JoinHandle;

const MAX_RETRIES: u32 = 8;
/// Consecutive failed waits before the engine is declared broken (about 1.5 s with the backoff).
const MAX_WAIT_FAILURES: u32 = 16;
const MAX_WAIT_BACKOFF_MS: u64 = 128;

/// The error an abandoned operation completes with: the kernel may still write into its buffer, so
/// the owner must neither free nor reuse that memory.
#[derive(Debug, thiserror::Error)]
#[error("the I/O engine broke with this operation in flight; its buffer is retired")]
pub struct Abandoned;

/// Whether `on_done` got an [`Abandoned`] error (its buffer must be retired, never reused).
pub fn is_abandoned(error: &std::io::Error) -> bool {
    error.get_ref().is_some_and(|inner| inner.is::<Abandoned>())
}

/// The error an operation whose [`IoOp::gate`] said no completes with: it was never submitted, so
/// the kernel never touched its buffer.
#[derive(Debug, thiserror::Error)]
#[error("cancelled before submission")]
pub struct Cancelled;

/// Whether `on_done` got a [`Cancelled`] error (the operation never reached the kernel).
pub fn is_cancelled(error: &std::io::Error) -> bool {
    error.get_ref().is_some_and(|inner| inner.is::<Cancelled>())
}

/// The error an operation sent to a queue that was shut down completes with (a store closing; after
/// a hung close, the writes that finish late and the trailers they would start).
#[derive(Debug, thiserror::Error)]
#[error("kvtier device queue is shut down")]
pub struct ShutDown;

/// Whether `on_done` got a [`ShutDown`] error (the operation never reached the kernel).
pub fn is_shut_down(error: &std::io::Error) -> bool {
    error.get_ref().is_some_and(|inner| inner.is::<ShutDown>())
}

/// Called once on the device thread when an operation finishes. Must be quick.
pub type OnDone = Box<dyn FnOnce(std::io::Result<()>) + Send>;

/// Called once on the device thread right before an operation is submitted: `false` cancels it
/// (`on_done` gets [`Cancelled`]). Lets the owner take back a queued operation's buffer without a
/// race against its submission. Must be quick.
pub type Gate = Box<dyn FnOnce() -> bool + Send>;

/// An operation owned by the device queue until completion.
pub struct IoOp {
    pub kind: OpKind,
    pub offset: u64,
    pub buf: *mut u8,
    pub len: usize,
    /// Vectored targets or sources (empty for a single buffer; then `buf` is unused and `len` is
    /// their total). A partial vectored transfer is retried whole rather than resumed mid-iovec.
    pub iovecs: Vec<libc::iovec>,
    /// The file to transfer to or from instead of the queue's own; held until `on_done` has run, so
    /// that its descriptor cannot be closed (and reused) while the kernel still uses it.
    pub file: Option<Arc<File>>,
    /// Asked before submission; `None` always submits.
    pub gate: Option<Gate>,
    pub on_done: OnDone,
}

/// One transfer of [`DeviceQueue::run_all`]: `len` bytes at `buf`, or, when `iovecs` is not empty,
/// those buffers back to back (`len` is then their total).
pub struct Transfer {
    pub kind: OpKind,
    pub file: Arc<File>,
    pub offset: u64,
    pub buf: *mut u8,
    pub len: usize,
    pub iovecs: Vec<libc::iovec>,
}

impl Transfer {
    /// The operation that performs this transfer on its own file and then calls `on_done`.
    pub fn into_op(self, on_done: OnDone) -> IoOp {
        IoOp {
            kind: self.kind,
            offset: self.offset,
            buf: self.buf,
            len: self.len,
            iovecs: self.iovecs,
            file: Some(self.file),
            gate: None,
            on_done,
        }
    }
}

// SAFETY: see IoRequest; the buffer owner keeps the memory alive until `on_done` runs.
unsafe impl Send for IoOp {}

pub struct DeviceQueue {
    reads: Mutex<Option<Sender<IoOp>>>,
    writes: Mutex<Option<Sender<IoOp>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    progress: Arc<progress::Progress>,
}

impl DeviceQueue {
    /// `fd`: the file of operations that name none (-1 when every operation names its file).
    /// `pattern`: the stats that get the I/O pattern of what this queue submits (`Stats::record_io`,
    /// the NVMe tier's); `None` for a queue whose tier keeps its own counters.
    pub fn start(
        name: &str,
        fd: RawFd,
        engine: Box<dyn IoEngine>,
        depth: usize,
        max_write_inflight_bytes: usize,
        pattern: Option<Arc<Stats>>,
    ) -> std::io::Result<Self> {
        let (read_tx, read_rx) = unbounded();
        let (write_tx, write_rx) = unbounded();
        let thread_name = format!("kvtier-dev-{name}");
        let thread = std::thread::Builder::new().name(thread_name).spawn(move || {
            DeviceLoop {
                fd,
                engine: Some(engine),
                wait_failures: 0,
                depth: depth.max(1),
                max_write_inflight_bytes,
                inflight: HashMap::new(),
                next_token: 1,
                write_inflight_bytes: 0,
                writes_inflight: 0,
                batch: Vec::new(),
                pattern,
                next_offset: [None; 2],
            }
            .run(read_rx, write_rx)
        })?;
        Ok(DeviceQueue {
            reads: Mutex::new(Some(read_tx)),
            writes: Mutex::new(Some(write_tx)),
            thread: Mutex::new(Some(thread)),
            progress: Arc::default(),
        })
    }

    /// Queues a read; if the queue is shut down the op fails at once.
    pub fn read(&self, op: IoOp) {
        self.send(&self.reads, op)
    }

    pub fn write(&self, op: IoOp) {
        self.send(&self.writes, op)
    }

    /// How long operations have waited on this queue with none finishing (`None` while none waits).
    pub fn stalled_for(&self, now: std::time::Instant) -> Option<std::time::Duration> {
        self.progress.stalled_for(now)
    }

    /// Whether no operation waits on this queue.
    pub fn idle(&self) -> bool {
        self.progress.idle()
    }

    /// Operations this queue finished so far (done, failed, or cancelled).
    pub fn answers(&self) -> u64 {
        self.progress.answers()
    }

    fn send(&self, chan: &Mutex<Option<Sender<IoOp>>>, mut op: IoOp) {
        self.progress.started();
        let (progress, on_done) = (Arc::clone(&self.progress), op.on_done);
        op.on_done = Box::new(move |result| {
            progress.finished();
            on_done(result)
        });
        let guard = chan.lock();
        let Some(tx) = guard.as_ref() else {
            drop(guard);
            (op.on_done)(Err(std::io::Error::other(ShutDown)));
            return;
        };
        if let Err(e) = tx.send(op) {
            drop(guard);
            (e.into_inner().on_done)(Err(std::io::Error::other("kvtier device thread exited")));
        }
    }

    /// Runs `transfers` (each through the read or write queue, so reads still go first) and waits for
    /// every one: one result per transfer, in order. The buffers must stay valid for the call, and
    /// any whose result [`is_abandoned`] must never be freed or reused: the kernel may still use it.
    pub fn run_all(&self, transfers: Vec<Transfer>) -> Vec<std::io::Result<()>> {
        let count = transfers.len();
        let (tx, rx) = crossbeam_channel::bounded(count);
        for (i, t) in transfers.into_iter().enumerate() {
            let tx = tx.clone();
            let op = t.into_op(Box::new(move |r| {
                let _ = tx.send((i, r));
            }));
            match op.kind {
                OpKind::Read => self.read(op),
                OpKind::Write => self.write(op),
            }
        }
        drop(tx);
        let mut results: Vec<Option<std::io::Result<()>>> = (0..count).map(|_| None).collect();
        // Ends once every `on_done` has run or been dropped.
        for (i, r) in rx.iter() {
            results[i] = Some(r);
        }
        // Dropped without completing (the device thread died): the buffer's fate is unknown.
        results.into_iter().map(|r| r.unwrap_or_else(|| Err(std::io::Error::other(Abandoned)))).collect()
    }

    /// Finishes queued operations, then stops the thread.
    pub fn shutdown(&self) {
        self.reads.lock().take();
        self.writes.lock().take();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }

    /// `shutdown`, waiting for the thread only while the device answers: once its operations waited
    /// `stall` with none finishing (a hung disk), the thread is left to finish them whenever the
    /// disk answers, and this returns `false`. Their buffers (DRAM slots among them) must then stay
    /// valid for good. A zero `stall` waits as `shutdown` does.
    pub fn shutdown_within(&self, stall: std::time::Duration) -> bool {
        if stall.is_zero() {
            self.shutdown();
            return true;
        }
        self.reads.lock().take();
        self.writes.lock().take();
        let Some(thread) = self.thread.lock().take() else { return true };
        while !thread.is_finished() {
            if self.stalled_for(std::time::Instant::now()).is_some_and(|waited| waited >= stall) {
                log::error!(
                    "kvtier: an NVMe device answered nothing for {stall:?} at close; its I/O thread is left behind"
                );
                return false; // dropping the handle detaches the thread
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let _ = thread.join();
        true
    }
}

impl Drop for DeviceQueue {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct InFlight {
    op: IoOp,
    done_bytes: usize,
    retries: u32,
}

struct DeviceLoop {
    fd: RawFd,
    /// `None` once the engine broke (leaked with what it held); new operations then fail at once.
    engine: Option<Box<dyn IoEngine>>,
    wait_failures: u32,
    depth: usize,
    max_write_inflight_bytes: usize,
    inflight: HashMap<u64, InFlight>,
    next_token: u64,
    write_inflight_bytes: usize,
    writes_inflight: usize,
    batch: Vec<IoRequest>,
    pattern: Option<Arc<Stats>>,
    /// Where the last read ([0]) and write ([1]) submitted here ended: the next one starting there is
    /// sequential.
    next_offset: [Option<u64>; 2],
}

impl DeviceLoop {
    fn run(mut self, reads: Receiver<IoOp>, writes: Receiver<IoOp>) {
        let mut reads_open = true;
        let mut writes_open = true;
        let mut completions = Vec::new();
        let never_rx = never::<IoOp>();
        loop {
            // Reads first, then writes within their in-flight budget.
            while self.inflight.len() < self.depth {
                if let Ok(op) = reads.try_recv() {
                    self.stage(op);
                    continue;
                }
                let write_budget_left =
                    self.writes_inflight == 0 || self.write_inflight_bytes < self.max_write_inflight_bytes;
                if !write_budget_left || !reads.is_empty() {
                    break;
                }
                match writes.try_recv() {
                    Ok(op) => self.stage(op),
                    Err(_) => break,
                }
            }
            self.flush_batch();
            debug_assert!(self.batch.is_empty(), "a batch left unsubmitted");
            debug_assert!(self.inflight.len() <= self.depth, "more operations in flight than the queue depth");
            if self.inflight.is_empty() {
                if !reads_open && !writes_open {
                    return;
                }
                let read_rx = if reads_open { &reads } else { &never_rx };
                let write_rx = if writes_open { &writes } else { &never_rx };
                select! {
                    recv(read_rx) -> op => match op {
                        Ok(op) => self.stage(op),
                        Err(_) => reads_open = false,
                    },
                    recv(write_rx) -> op => match op {
                        Ok(op) => self.stage(op),
                        Err(_) => writes_open = false,
                    },
                }
                continue;
            }
            completions.clear();
            let Some(engine) = self.engine.as_mut() else { continue };
            match engine.wait(1, &mut completions) {
                Ok(()) => {
                    self.wait_failures = 0;
                    for c in completions.drain(..) {
                        self.complete(c);
                    }
                }
                Err(e) => self.wait_failed(e),
            }
        }
    }

    /// A failed wait completes nothing: the kernel may still be writing into every buffer in flight.
    /// Cancel them and keep reaping; past `MAX_WAIT_FAILURES` give the engine up.
    fn wait_failed(&mut self, error: std::io::Error) {
        let Some(engine) = self.engine.as_mut() else { return };
        self.wait_failures += 1;
        if self.wait_failures == 1 {
            log::error!(
                "kvtier: I/O engine {} failed while waiting: {error}; cancelling {} operations in flight and reaping them",
                engine.name(),
                self.inflight.len()
            );
            let tokens: Vec<u64> = self.inflight.keys().copied().collect();
            engine.cancel(&tokens);
        }
        if self.wait_failures < MAX_WAIT_FAILURES {
            let backoff_ms = (1u64 << self.wait_failures.min(10)).min(MAX_WAIT_BACKOFF_MS);
            std::thread::sleep(std::time::Duration::from_millis(backoff_ms));
            return;
        }
        log::error!(
            "kvtier: I/O engine {} still fails after {MAX_WAIT_FAILURES} waits ({error}); abandoning {} operations \
             (their buffers are retired) and failing this device's I/O until the store is reopened",
            engine.name(),
            self.inflight.len()
        );
        // Leaked on purpose: closing a ring with operations in flight would let the kernel finish them
        // into memory we no longer track.
        std::mem::forget(self.engine.take());
        for (_, f) in self.inflight.drain() {
            (f.op.on_done)(Err(std::io::Error::other(Abandoned)));
        }
        self.write_inflight_bytes = 0;
        self.writes_inflight = 0;
    }

    fn fd_of(&self, op: &IoOp) -> RawFd {
        op.file.as_ref().map_or(self.fd, |f| f.as_raw_fd())
    }

    fn stage(&mut self, mut op: IoOp) {
        if let Some(gate) = op.gate.take() {
            if !gate() {
                (op.on_done)(Err(std::io::Error::other(Cancelled)));
                return;
            }
        }
        let token = self.next_token;
        self.next_token += 1;
        let write = op.kind == OpKind::Write;
        let next_offset = &mut self.next_offset[usize::from(write)];
        if let Some(stats) = &self.pattern {
            stats.record_io(write, op.len, *next_offset == Some(op.offset));
        }
        *next_offset = Some(op.offset + op.len as u64);
        debug_assert!(
            op.iovecs.is_empty() || op.iovecs.iter().map(|v| v.iov_len).sum::<usize>() == op.len,
            "a vectored op's length is its iovecs' total"
        );
        debug_assert!(!op.iovecs.is_empty() || !op.buf.is_null(), "an op with neither a buffer nor iovecs");
        if op.kind == OpKind::Write {
            self.write_inflight_bytes += op.len;
            self.writes_inflight += 1;
        }
        self.batch.push(IoRequest {
            token,
            kind: op.kind,
            fd: self.fd_of(&op),
            offset: op.offset,
            buf: op.buf,
            len: op.len,
            iov: op.iovecs.as_ptr(),
            iov_count: op.iovecs.len(),
        });
        let before = self.inflight.insert(token, InFlight { op, done_bytes: 0, retries: 0 });
        assert!(before.is_none(), "token {token} handed out twice");
    }

    fn flush_batch(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.batch);
        let Some(engine) = self.engine.as_mut() else {
            for req in &batch {
                self.finish(
                    req.token,
                    Err(std::io::Error::other("kvtier: this device's I/O engine broke; reopen the store")),
                );
            }
            return;
        };
        if let Err(SubmitError { accepted, error }) = engine.submit(&batch) {
            // Only what the engine never took can fail now; the rest completes through `wait`.
            log::warn!("kvtier: I/O engine {} took {accepted} of {} operations: {error}", engine.name(), batch.len());
            for req in &batch[accepted..] {
                self.finish(req.token, Err(std::io::Error::new(error.kind(), error.to_string())));
            }
        }
        self.batch = batch;
        self.batch.clear();
    }

    fn finish(&mut self, token: u64, result: std::io::Result<()>) {
        if let Some(f) = self.inflight.remove(&token) {
            if f.op.kind == OpKind::Write {
                assert!(
                    self.write_inflight_bytes >= f.op.len && self.writes_inflight > 0,
                    "a write finished that was not counted in flight"
                );
                self.write_inflight_bytes -= f.op.len;
                self.writes_inflight -= 1;
            }
            (f.op.on_done)(result);
        }
    }

    fn resubmit(&mut self, token: u64) {
        let f = &self.inflight[&token];
        if !f.op.iovecs.is_empty() {
            self.batch.push(IoRequest {
                token,
                kind: f.op.kind,
                fd: self.fd_of(&f.op),
                offset: f.op.offset,
                buf: std::ptr::null_mut(),
                len: f.op.len,
                iov: f.op.iovecs.as_ptr(),
                iov_count: f.op.iovecs.len(),
            });
            return;
        }
        assert!(f.done_bytes <= f.op.len, "{} bytes done of a {}-byte op", f.done_bytes, f.op.len);
        debug_assert!(f.done_bytes < f.op.len || f.op.len == 0);
        // SAFETY: done_bytes < len, so the pointer stays inside the op's buffer.
        self.batch.push(IoRequest {
            token,
            kind: f.op.kind,
            fd: self.fd_of(&f.op),
            offset: f.op.offset + f.done_bytes as u64,
            buf: unsafe { f.op.buf.add(f.done_bytes) },
            len: f.op.len - f.done_bytes,
            iov: std::ptr::null(),
            iov_count: 0,
        });
    }

    fn complete(&mut self, c: IoCompletion) {
        let Some(f) = self.inflight.get_mut(&c.token) else {
            log::error!("kvtier: completion for unknown token {}", c.token);
            return;
        };
        if c.result < 0 {
            let errno = (-c.result) as i32;
            if (errno == libc::EINTR || errno == libc::EAGAIN) && f.retries < MAX_RETRIES {
                f.retries += 1;
                self.resubmit(c.token);
                return;
            }
            if errno == libc::EINVAL {
                log::error!(
                    "kvtier: EINVAL at offset {} len {}: an O_DIRECT alignment bug (please report)",
                    f.op.offset,
                    f.op.len
                );
            }
            self.finish(c.token, Err(std::io::Error::from_raw_os_error(errno)));
            return;
        }
        if c.result == 0 {
            let kind = if f.op.kind == OpKind::Read {
                std::io::ErrorKind::UnexpectedEof
            } else {
                std::io::ErrorKind::WriteZero
            };
            self.finish(c.token, Err(std::io::Error::new(kind, "zero-byte transfer (truncated file or full device)")));
            return;
        }
        if !f.op.iovecs.is_empty() && (c.result as usize) < f.op.len {
            if f.retries < MAX_RETRIES {
                f.retries += 1;
                self.resubmit(c.token);
            } else {
                self.finish(
                    c.token,
                    Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "short vectored read")),
                );
            }
            return;
        }
        f.done_bytes += c.result as usize;
        debug_assert!(f.op.iovecs.is_empty() || f.done_bytes >= f.op.len, "a short vectored transfer completed");
        if f.done_bytes >= f.op.len {
            self.finish(c.token, Ok(()));
        } else {
            self.resubmit(c.token);
        }
    }
}

#[cfg(test)]
#[path = "device_tests.rs"]
mod tests;
