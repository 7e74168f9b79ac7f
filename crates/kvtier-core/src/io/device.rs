//! The device queue: one thread per device file owning its I/O engine, scheduling reads before
//! writes and enforcing strict completion rules.
//!
//! Scheduling: every queued read is submitted before any write; a write is taken only when no read is
//! waiting and the bytes of writes in flight are under `max_write_inflight_bytes`, so a burst of
//! stores can delay a load by at most that much I/O. Completion: a short transfer is resubmitted for
//! the remainder, EINTR/EAGAIN are retried at most `MAX_RETRIES` times, a zero-byte transfer is an
//! error (truncated file or full device), EINVAL is logged as an alignment bug.

use super::*;
use crossbeam_channel::{never, select, unbounded, Receiver, Sender};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::thread::JoinHandle;

const MAX_RETRIES: u32 = 8;

/// Called once on the device thread when an operation finishes. Must be quick.
pub type OnDone = Box<dyn FnOnce(std::io::Result<()>) + Send>;

/// An operation owned by the device queue until completion.
pub struct IoOp {
    pub kind: OpKind,
    pub offset: u64,
    pub buf: *mut u8,
    pub len: usize,
    /// Vectored read targets (empty for a single buffer). A partial vectored transfer is retried
    /// whole rather than resumed mid-iovec.
    pub iovecs: Vec<libc::iovec>,
    pub on_done: OnDone,
}

// SAFETY: see IoRequest; the buffer owner keeps the memory alive until `on_done` runs.
unsafe impl Send for IoOp {}

pub struct DeviceQueue {
    name: String,
    reads: Mutex<Option<Sender<IoOp>>>,
    writes: Mutex<Option<Sender<IoOp>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl DeviceQueue {
    pub fn start(
        name: String,
        fd: RawFd,
        engine: Box<dyn IoEngine>,
        depth: usize,
        max_write_inflight_bytes: usize,
    ) -> std::io::Result<Self> {
        let (read_tx, read_rx) = unbounded();
        let (write_tx, write_rx) = unbounded();
        let thread_name = format!("kvtier-dev-{name}");
        let thread = std::thread::Builder::new().name(thread_name).spawn(move || {
            DeviceLoop {
                fd,
                engine,
                depth: depth.max(1),
                max_write_inflight_bytes,
                inflight: HashMap::new(),
                next_token: 1,
                write_inflight_bytes: 0,
                writes_inflight: 0,
                batch: Vec::new(),
            }
            .run(read_rx, write_rx)
        })?;
        Ok(DeviceQueue {
            name,
            reads: Mutex::new(Some(read_tx)),
            writes: Mutex::new(Some(write_tx)),
            thread: Mutex::new(Some(thread)),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Queues a read; if the queue is shut down the op fails at once.
    pub fn read(&self, op: IoOp) {
        Self::send(&self.reads, op)
    }

    pub fn write(&self, op: IoOp) {
        Self::send(&self.writes, op)
    }

    fn send(chan: &Mutex<Option<Sender<IoOp>>>, op: IoOp) {
        let guard = chan.lock();
        let Some(tx) = guard.as_ref() else {
            drop(guard);
            (op.on_done)(Err(std::io::Error::other("kvtier device queue is shut down")));
            return;
        };
        if let Err(e) = tx.send(op) {
            drop(guard);
            (e.into_inner().on_done)(Err(std::io::Error::other("kvtier device thread exited")));
        }
    }

    /// Finishes queued operations, then stops the thread.
    pub fn shutdown(&self) {
        self.reads.lock().take();
        self.writes.lock().take();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
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
    engine: Box<dyn IoEngine>,
    depth: usize,
    max_write_inflight_bytes: usize,
    inflight: HashMap<u64, InFlight>,
    next_token: u64,
    write_inflight_bytes: usize,
    writes_inflight: usize,
    batch: Vec<IoRequest>,
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
                let write_budget_left = self.writes_inflight == 0
                    || self.write_inflight_bytes < self.max_write_inflight_bytes;
                if !write_budget_left || !reads.is_empty() {
                    break;
                }
                match writes.try_recv() {
                    Ok(op) => self.stage(op),
                    Err(_) => break,
                }
            }
            self.flush_batch();
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
            if let Err(e) = self.engine.wait(1, &mut completions) {
                log::error!("kvtier: I/O engine {} failed while waiting: {e}; failing in-flight operations", self.engine.name());
                for (_, f) in self.inflight.drain() {
                    (f.op.on_done)(Err(std::io::Error::new(e.kind(), e.to_string())));
                }
                self.write_inflight_bytes = 0;
                self.writes_inflight = 0;
                continue;
            }
            for c in completions.drain(..) {
                self.complete(c);
            }
        }
    }

    fn stage(&mut self, op: IoOp) {
        let token = self.next_token;
        self.next_token += 1;
        if op.kind == OpKind::Write {
            self.write_inflight_bytes += op.len;
            self.writes_inflight += 1;
        }
        self.batch.push(IoRequest {
            token,
            kind: op.kind,
            fd: self.fd,
            offset: op.offset,
            buf: op.buf,
            len: op.len,
            iov: op.iovecs.as_ptr(),
            iov_count: op.iovecs.len(),
        });
        self.inflight.insert(token, InFlight { op, done_bytes: 0, retries: 0 });
    }

    fn flush_batch(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.batch);
        if let Err(e) = self.engine.submit(&batch) {
            for req in &batch {
                self.finish(req.token, Err(std::io::Error::new(e.kind(), e.to_string())));
            }
        }
        self.batch = batch;
        self.batch.clear();
    }

    fn finish(&mut self, token: u64, result: std::io::Result<()>) {
        if let Some(f) = self.inflight.remove(&token) {
            if f.op.kind == OpKind::Write {
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
                fd: self.fd,
                offset: f.op.offset,
                buf: std::ptr::null_mut(),
                len: f.op.len,
                iov: f.op.iovecs.as_ptr(),
                iov_count: f.op.iovecs.len(),
            });
            return;
        }
        // SAFETY: done_bytes < len, so the pointer stays inside the op's buffer.
        self.batch.push(IoRequest {
            token,
            kind: f.op.kind,
            fd: self.fd,
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
                    "kvtier: EINVAL from {} at offset {} len {}: an O_DIRECT alignment bug (please report)",
                    self.engine.name(), f.op.offset, f.op.len
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
                self.finish(c.token, Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "short vectored read")));
            }
            return;
        }
        f.done_bytes += c.result as usize;
        if f.done_bytes >= f.op.len {
            self.finish(c.token, Ok(()));
        } else {
            self.resubmit(c.token);
        }
    }
}
