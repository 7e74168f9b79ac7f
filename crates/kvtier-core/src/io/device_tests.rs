//! The device queue's completion rules, against a scripted engine that holds buffers as the kernel
//! would.

use super::*;
use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

const CANARY: u8 = 0xA5;
const OP_BYTES: usize = 64;

/// Buffers an engine holds, as the kernel would: a buffer in here must not be released.
type Held = Arc<Mutex<HashSet<usize>>>;

/// An engine that keeps accepted requests like a kernel would, fails `wait` a scripted number of
/// times, and then finishes each request by writing a canary into its buffer.
struct ScriptedEngine {
    queued: Vec<IoRequest>,
    held: Held,
    wait_failures_left: u32,
    /// Requests accepted before a submit refuses the rest of its batch (then unlimited).
    accept_budget: usize,
    cancelled: Arc<AtomicUsize>,
}

impl ScriptedEngine {
    fn new(wait_failures: u32, accept_budget: usize) -> (Self, Held, Arc<AtomicUsize>) {
        let held = Held::default();
        let cancelled = Arc::new(AtomicUsize::new(0));
        let engine = ScriptedEngine {
            queued: Vec::new(),
            held: Arc::clone(&held),
            wait_failures_left: wait_failures,
            accept_budget,
            cancelled: Arc::clone(&cancelled),
        };
        (engine, held, cancelled)
    }
}

impl IoEngine for ScriptedEngine {
    fn name(&self) -> &'static str {
        "scripted"
    }

    fn submit(&mut self, requests: &[IoRequest]) -> Result<(), SubmitError> {
        let accepted = requests.len().min(self.accept_budget);
        self.accept_budget -= accepted;
        for req in &requests[..accepted] {
            self.held.lock().insert(req.buf as usize);
            self.queued.push(*req);
        }
        if accepted < requests.len() {
            self.accept_budget = usize::MAX;
            return Err(SubmitError { accepted, error: std::io::Error::from_raw_os_error(libc::EBUSY) });
        }
        Ok(())
    }

    fn wait(&mut self, _min_complete: usize, out: &mut Vec<IoCompletion>) -> std::io::Result<()> {
        if self.wait_failures_left > 0 {
            self.wait_failures_left -= 1;
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        for req in self.queued.drain(..) {
            // SAFETY: the op owns the buffer until its completion is reaped (the contract tested).
            unsafe { std::ptr::write_bytes(req.buf, CANARY, req.len) };
            self.held.lock().remove(&(req.buf as usize));
            out.push(IoCompletion { token: req.token, result: req.len as i64 });
        }
        Ok(())
    }

    fn cancel(&mut self, tokens: &[u64]) {
        self.cancelled.fetch_add(tokens.len(), Ordering::SeqCst);
    }
}

/// What `on_done` saw: the op's index, its result, and whether the engine still held its buffer
/// and whether the canary was in it when the op was released.
struct Released {
    index: usize,
    result: std::io::Result<()>,
    still_held: bool,
    canary: bool,
}

fn read_op(index: usize, buffer: &mut [u8], held: &Held, tx: &mpsc::Sender<Released>) -> IoOp {
    let (held, tx) = (Arc::clone(held), tx.clone());
    let (ptr, len) = (buffer.as_mut_ptr(), buffer.len());
    let address = ptr as usize;
    IoOp {
        kind: OpKind::Read,
        offset: 0,
        buf: ptr,
        len,
        iovecs: Vec::new(),
        file: None,
        gate: None,
        on_done: Box::new(move |result| {
            let ptr = address as *const u8;
            let still_held = held.lock().contains(&address);
            // SAFETY: the buffers outlive the queue in every test.
            let canary = unsafe { std::slice::from_raw_parts(ptr, len) }.iter().all(|&b| b == CANARY);
            let _ = tx.send(Released { index, result, still_held, canary });
        }),
    }
}

fn run_reads(engine: ScriptedEngine, held: &Held, count: usize) -> (Vec<Released>, Vec<Vec<u8>>) {
    let mut buffers = vec![vec![0u8; OP_BYTES]; count];
    let (tx, rx) = mpsc::channel();
    let queue = DeviceQueue::start("test", -1, Box::new(engine), 8, 1 << 20, None).unwrap();
    for (i, b) in buffers.iter_mut().enumerate() {
        queue.read(read_op(i, b, held, &tx));
    }
    let mut released: Vec<Released> = (0..count).map(|_| rx.recv_timeout(Duration::from_secs(20)).unwrap()).collect();
    queue.shutdown();
    released.sort_by_key(|r| r.index);
    (released, buffers)
}

#[test]
fn a_failed_wait_completes_nothing_until_the_engine_gives_each_buffer_back() {
    let (engine, held, cancelled) = ScriptedEngine::new(3, usize::MAX);
    let (released, buffers) = run_reads(engine, &held, 4);
    for r in &released {
        assert!(!r.still_held, "op {} released while the engine still held its buffer", r.index);
        assert!(r.result.is_ok(), "op {} failed: {:?}", r.index, r.result);
        assert!(r.canary, "op {} completed before the engine wrote its buffer", r.index);
    }
    assert!(buffers.iter().all(|b| b.iter().all(|&x| x == CANARY)));
    assert!(cancelled.load(Ordering::SeqCst) >= 1, "a failed wait cancels what is in flight");
}

#[test]
fn an_engine_that_stays_broken_abandons_its_operations_and_refuses_new_ones() {
    let (engine, held, _) = ScriptedEngine::new(u32::MAX, usize::MAX);
    let mut buffers = vec![vec![0u8; OP_BYTES]; 3];
    let (tx, rx) = mpsc::channel();
    let queue = DeviceQueue::start("test", -1, Box::new(engine), 8, 1 << 20, None).unwrap();
    for (i, b) in buffers.iter_mut().take(2).enumerate() {
        queue.read(read_op(i, b, &held, &tx));
    }
    for _ in 0..2 {
        let r = rx.recv_timeout(Duration::from_secs(20)).unwrap();
        let error = r.result.expect_err("a broken engine cannot complete an op");
        assert!(is_abandoned(&error), "op {} released with {error} while its buffer may be in use", r.index);
    }
    queue.read(read_op(2, &mut buffers[2], &held, &tx));
    let r = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    let error = r.result.expect_err("a device whose engine broke fails new I/O");
    assert!(!is_abandoned(&error) && !r.still_held, "never accepted, so its buffer is free to reuse");
    queue.shutdown();
}

/// A gate that says no (a load took the buffer back while the op was queued) keeps the op from the
/// engine: its buffer is never touched and its `on_done` gets `Cancelled`; a gate that says yes
/// submits as usual.
#[test]
fn a_closed_gate_cancels_the_op_before_the_engine_sees_it() {
    let (engine, held, _) = ScriptedEngine::new(0, usize::MAX);
    let mut buffers = vec![vec![0u8; OP_BYTES]; 4];
    let (tx, rx) = mpsc::channel();
    let asked = Arc::new(AtomicUsize::new(0));
    let queue = DeviceQueue::start("test", -1, Box::new(engine), 8, 1 << 20, None).unwrap();
    for (i, b) in buffers.iter_mut().enumerate() {
        let mut op = read_op(i, b, &held, &tx);
        op.kind = OpKind::Write;
        let asked = Arc::clone(&asked);
        op.gate = Some(Box::new(move || {
            asked.fetch_add(1, Ordering::SeqCst);
            i % 2 == 0
        }));
        queue.write(op);
    }
    let mut released: Vec<Released> = (0..4).map(|_| rx.recv_timeout(Duration::from_secs(20)).unwrap()).collect();
    queue.shutdown();
    released.sort_by_key(|r| r.index);
    assert_eq!(asked.load(Ordering::SeqCst), 4, "every gate is asked once");
    for r in &released {
        if r.index % 2 == 0 {
            assert!(r.result.is_ok() && r.canary, "op {} was let through but not performed", r.index);
        } else {
            let error = r.result.as_ref().expect_err("a closed gate cancels");
            assert!(is_cancelled(error) && !is_abandoned(error), "op {}: {error}", r.index);
            assert!(!r.canary && !r.still_held, "op {}'s buffer reached the engine", r.index);
        }
    }
    assert!(buffers[1].iter().all(|&b| b == 0) && buffers[3].iter().all(|&b| b == 0));
}

#[test]
fn a_partly_refused_batch_fails_only_what_the_engine_never_took() {
    let (engine, held, _) = ScriptedEngine::new(0, 2);
    let mut buffers = vec![vec![0u8; OP_BYTES]; 4];
    let (tx, rx) = mpsc::channel();
    let mut device = DeviceLoop {
        fd: -1,
        engine: Some(Box::new(engine)),
        wait_failures: 0,
        depth: 8,
        max_write_inflight_bytes: 1 << 20,
        inflight: HashMap::new(),
        next_token: 1,
        write_inflight_bytes: 0,
        writes_inflight: 0,
        batch: Vec::new(),
        pattern: None,
        next_offset: [None; 2],
    };
    for (i, b) in buffers.iter_mut().enumerate() {
        device.stage(read_op(i, b, &held, &tx));
    }
    device.flush_batch();
    let refused: Vec<Released> = rx.try_iter().collect();
    assert_eq!(refused.iter().map(|r| r.index).collect::<Vec<_>>(), vec![2, 3]);
    assert!(refused.iter().all(|r| r.result.is_err() && !r.still_held));
    assert_eq!(device.inflight.len(), 2, "the two accepted ops stay in flight");
    let mut completions = Vec::new();
    device.engine.as_mut().unwrap().wait(1, &mut completions).unwrap();
    for c in completions {
        device.complete(c);
    }
    let mut done: Vec<Released> = rx.try_iter().collect();
    done.sort_by_key(|r| r.index);
    assert_eq!(done.iter().map(|r| r.index).collect::<Vec<_>>(), vec![0, 1]);
    assert!(done.iter().all(|r| r.result.is_ok() && r.canary && !r.still_held));
}

/// Files named per operation: `run_all` hands each request its own file's descriptor, returns
/// results in order only once the engine gave every buffer back, and reports a broken engine's
/// operations as abandoned.
#[test]
fn run_all_uses_each_transfers_file_and_waits_for_every_buffer() {
    let files: Vec<Arc<File>> = (0..3).map(|_| Arc::new(tempfile::tempfile().unwrap())).collect();
    let seen_fds = Arc::new(Mutex::new(Vec::new()));
    let (engine, held, _) = ScriptedEngine::new(2, usize::MAX);
    let recording = FdRecorder { inner: engine, seen: Arc::clone(&seen_fds) };
    let queue = DeviceQueue::start("test", -1, Box::new(recording), 8, 1 << 20, None).unwrap();
    let mut buffers = vec![vec![0u8; OP_BYTES]; 3];
    let transfers = buffers
        .iter_mut()
        .zip(&files)
        .map(|(b, f)| Transfer {
            kind: OpKind::Read,
            file: Arc::clone(f),
            offset: 0,
            buf: b.as_mut_ptr(),
            len: b.len(),
            iovecs: Vec::new(),
        })
        .collect();
    let results = queue.run_all(transfers);
    assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
    assert!(held.lock().is_empty(), "run_all returned while the engine held a buffer");
    assert!(buffers.iter().all(|b| b.iter().all(|&x| x == CANARY)));
    let mut seen = seen_fds.lock().clone();
    seen.sort_unstable();
    let mut expected: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
    expected.sort_unstable();
    assert_eq!(seen, expected);
    queue.shutdown();

    let (engine, _, _) = ScriptedEngine::new(u32::MAX, usize::MAX);
    let queue = DeviceQueue::start("test", -1, Box::new(engine), 8, 1 << 20, None).unwrap();
    let transfer = Transfer {
        kind: OpKind::Read,
        file: Arc::clone(&files[0]),
        offset: 0,
        buf: buffers[0].as_mut_ptr(),
        len: OP_BYTES,
        iovecs: Vec::new(),
    };
    let results = queue.run_all(vec![transfer]);
    assert!(results[0].as_ref().is_err_and(is_abandoned), "{results:?}");
    queue.shutdown();
}

/// Passes requests through, recording the descriptor each one names.
struct FdRecorder {
    inner: ScriptedEngine,
    seen: Arc<Mutex<Vec<RawFd>>>,
}

impl IoEngine for FdRecorder {
    fn name(&self) -> &'static str {
        "fd-recorder"
    }

    fn submit(&mut self, requests: &[IoRequest]) -> Result<(), SubmitError> {
        self.seen.lock().extend(requests.iter().map(|r| r.fd));
        self.inner.submit(requests)
    }

    fn wait(&mut self, min_complete: usize, out: &mut Vec<IoCompletion>) -> std::io::Result<()> {
        self.inner.wait(min_complete, out)
    }
}
