//! Fault injection (test seam): wraps any engine and makes chosen operations fail the way real
//! storage does (EIO, ENOSPC, short transfers, torn writes, bit flips, slow I/O). The store takes a
//! [`FaultPlan`] through its configuration; production code never builds one.

use super::*;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// What to inject. Each `*_every` field fires on every n-th operation of its kind (0 = never).
#[derive(Debug, Default)]
pub struct FaultPlan {
    pub read_eio_every: u64,
    pub write_eio_every: u64,
    pub write_enospc_every: u64,
    /// Transfers only half of the request (the device queue must resubmit the rest).
    pub short_every: u64,
    /// Writes only the first half of the request but reports it whole, as a crash mid-write would leave it.
    pub torn_write_every: u64,
    /// Flips one bit in the data a read returns.
    pub read_bitflip_every: u64,
    /// Sleeps this long before submitting each operation.
    pub delay_ms: u64,
    /// While set, no batch is submitted: the engine's thread waits, as one waits on a hung disk, and
    /// nothing queued behind it completes (a test clears it to heal).
    pub hang: AtomicBool,
    /// While set, nothing is injected and nothing counted: operations pass through untouched (a
    /// test turns a fault on and off while the store runs).
    pub paused: AtomicBool,
    pub reads_seen: AtomicU64,
    pub writes_seen: AtomicU64,
    pub injected: AtomicU64,
}

impl FaultPlan {
    fn fires(every: u64, n: u64) -> bool {
        every != 0 && n.is_multiple_of(every)
    }
}

pub struct FaultyEngine {
    inner: Box<dyn IoEngine>,
    plan: Arc<FaultPlan>,
    /// Completions made up here rather than by the inner engine.
    synthetic: Vec<IoCompletion>,
    /// Requests whose completion must be altered: token -> (original length, buffer, action).
    altered: Mutex<HashMap<u64, (usize, *mut u8, Action)>>,
}

unsafe impl Send for FaultyEngine {}

#[derive(Clone, Copy)]
enum Action {
    ReportWhole,
    FlipBit,
}

impl FaultyEngine {
    pub fn new(inner: Box<dyn IoEngine>, plan: Arc<FaultPlan>) -> Self {
        FaultyEngine { inner, plan, synthetic: Vec::new(), altered: Mutex::new(HashMap::new()) }
    }

    /// Applies the plan to one read. `false`: it failed here (an EIO completion is made up);
    /// otherwise it goes on to the inner engine, maybe shortened or marked for a bit flip.
    fn fault_read(&mut self, req: &mut IoRequest) -> bool {
        let p = &self.plan;
        if p.paused.load(Ordering::Relaxed) {
            return true;
        }
        let n = p.reads_seen.fetch_add(1, Ordering::Relaxed) + 1;
        if FaultPlan::fires(p.read_eio_every, n) {
            p.injected.fetch_add(1, Ordering::Relaxed);
            self.synthetic.push(IoCompletion { token: req.token, result: -(libc::EIO as i64) });
            return false;
        }
        if req.iov_count > 0 {
            // Vectored reads land in caller memory: only errno faults apply to them.
        } else if FaultPlan::fires(p.read_bitflip_every, n) {
            p.injected.fetch_add(1, Ordering::Relaxed);
            self.altered.lock().insert(req.token, (req.len, req.buf, Action::FlipBit));
        } else if FaultPlan::fires(p.short_every, n) && req.len >= 2 * 4096 {
            p.injected.fetch_add(1, Ordering::Relaxed);
            req.len = (req.len / 2) / 4096 * 4096;
        }
        true
    }

    /// Applies the plan to one write. `false`: it failed here (an EIO or ENOSPC completion is made
    /// up); otherwise it goes on to the inner engine, maybe cut to its first half (short or torn).
    fn fault_write(&mut self, req: &mut IoRequest) -> bool {
        let p = &self.plan;
        if p.paused.load(Ordering::Relaxed) {
            return true;
        }
        let n = p.writes_seen.fetch_add(1, Ordering::Relaxed) + 1;
        if FaultPlan::fires(p.write_eio_every, n) || FaultPlan::fires(p.write_enospc_every, n) {
            p.injected.fetch_add(1, Ordering::Relaxed);
            let errno = if FaultPlan::fires(p.write_eio_every, n) { libc::EIO } else { libc::ENOSPC };
            self.synthetic.push(IoCompletion { token: req.token, result: -(errno as i64) });
            return false;
        }
        if req.iov_count >= 2 {
            // Vectored: the first half of the buffers, reported whole (torn) or as it is
            // (short, which the device queue then writes again whole).
            let torn = FaultPlan::fires(p.torn_write_every, n);
            if torn || FaultPlan::fires(p.short_every, n) {
                p.injected.fetch_add(1, Ordering::Relaxed);
                if torn {
                    self.altered.lock().insert(req.token, (req.len, req.buf, Action::ReportWhole));
                }
                req.iov_count /= 2;
            }
        } else if req.iov_count > 0 {
            // One vectored buffer: only errno faults apply.
        } else if FaultPlan::fires(p.torn_write_every, n) && req.len >= 2 * 4096 {
            p.injected.fetch_add(1, Ordering::Relaxed);
            self.altered.lock().insert(req.token, (req.len, req.buf, Action::ReportWhole));
            req.len = (req.len / 2) / 4096 * 4096;
        } else if FaultPlan::fires(p.short_every, n) && req.len >= 2 * 4096 {
            p.injected.fetch_add(1, Ordering::Relaxed);
            req.len = (req.len / 2) / 4096 * 4096;
        }
        true
    }
}

impl IoEngine for FaultyEngine {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn submit(&mut self, requests: &[IoRequest]) -> Result<(), SubmitError> {
        if self.plan.delay_ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(self.plan.delay_ms));
        }
        while self.plan.hang.load(Ordering::Acquire) {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let mut passed = Vec::with_capacity(requests.len());
        // Position in `requests` of each passed request, to map the inner engine's `accepted` back.
        let mut passed_at = Vec::with_capacity(requests.len());
        for (at, req) in requests.iter().enumerate() {
            let mut req = *req;
            let passes = match req.kind {
                OpKind::Read => self.fault_read(&mut req),
                OpKind::Write => self.fault_write(&mut req),
            };
            if passes {
                passed.push(req);
                passed_at.push(at);
            }
        }
        if passed.is_empty() {
            return Ok(());
        }
        let Err(SubmitError { accepted, error }) = self.inner.submit(&passed) else { return Ok(()) };
        // Requests from the first one the inner engine refused on were never taken: forget the
        // completions and alterations made up for them.
        let cut = passed_at.get(accepted).copied().unwrap_or(requests.len());
        let refused: std::collections::HashSet<u64> = requests[cut..].iter().map(|r| r.token).collect();
        self.synthetic.retain(|c| !refused.contains(&c.token));
        self.altered.lock().retain(|token, _| !refused.contains(token));
        Err(SubmitError { accepted: cut, error })
    }

    fn cancel(&mut self, tokens: &[u64]) {
        self.inner.cancel(tokens)
    }

    fn wait(&mut self, min_complete: usize, out: &mut Vec<IoCompletion>) -> std::io::Result<()> {
        let start = out.len();
        let have = self.synthetic.len();
        out.append(&mut self.synthetic);
        if have < min_complete {
            self.inner.wait(min_complete - have, out)?;
        }
        let mut altered = self.altered.lock();
        for c in &mut out[start..] {
            if let Some((len, buf, action)) = altered.remove(&c.token) {
                match action {
                    Action::ReportWhole if c.result >= 0 => c.result = len as i64,
                    Action::FlipBit if c.result > 4096 => {
                        // Flip a bit in the value part (past the descriptor page) of what was read.
                        // SAFETY: the read filled at least `result` bytes of the buffer.
                        unsafe { *buf.add(4096 + (c.result as usize - 4096) / 2) ^= 0x10 };
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }
}
