//! I/O engines: how bytes move between memory and device files.
//!
//! One trait ([`IoEngine`]) with two engines: io_uring (one ring per device thread, registered
//! buffers and files when the kernel and memlock allow, one `io_uring_enter` per batch) and a
//! pread/pwrite thread pool. [`device::DeviceQueue`] owns one engine per device file and schedules:
//! reads before writes, bounded writes in flight, strict completion handling (short transfers
//! resubmitted, EINTR/EAGAIN retried with a cap, EINVAL reported as an alignment bug).
//! `faults` wraps any engine to inject faults in tests (built with the `testing` feature only).

pub mod bounded;
pub mod buffer;
pub mod device;
#[cfg(any(test, feature = "testing"))]
pub mod faults;
pub mod progress;
pub mod psync;
pub mod uring;

use std::os::fd::RawFd;

/// Which engine to use; `Auto` runs the io_uring self-test and falls back to the thread pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineChoice {
    Auto,
    IoUring,
    Psync,
}

/// Whether device files are opened with O_DIRECT (the NVMe tier's and the shared tier's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectIo {
    /// O_DIRECT when the filesystem supports it, buffered I/O (logged) otherwise.
    Auto,
    /// O_DIRECT or fail at open.
    On,
    /// Buffered I/O through the page cache.
    Off,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Read,
    Write,
}

/// One request handed to an engine. The memory behind `buf` must stay valid until its completion
/// is reaped; the device queue guarantees that by owning the op until then.
#[derive(Debug, Clone, Copy)]
pub struct IoRequest {
    pub token: u64,
    pub kind: OpKind,
    pub fd: RawFd,
    pub offset: u64,
    pub buf: *mut u8,
    pub len: usize,
    /// Vectored read: `iov_count` iovecs at `iov` (then `buf` is unused and `len` is their total).
    pub iov: *const libc::iovec,
    pub iov_count: usize,
}

// SAFETY: the pointer is only dereferenced by the kernel or an engine thread while the owning op is
// in flight; the device queue keeps the op (and its buffer owner) alive until completion.
unsafe impl Send for IoRequest {}

/// A finished request: bytes transferred, or a negative errno.
#[derive(Debug, Clone, Copy)]
pub struct IoCompletion {
    pub token: u64,
    pub result: i64,
}

/// A batch the engine did not take whole. The first `accepted` requests are the engine's: the kernel
/// or an engine thread may still use their buffers, and each one's completion will be reaped as
/// usual. The rest were never seen and may be failed (and their buffers released) at once.
#[derive(Debug)]
pub struct SubmitError {
    pub accepted: usize,
    pub error: std::io::Error,
}

/// An I/O engine: submits batches, reaps completions. Owned by one device thread.
///
/// Ownership rule: once a request is accepted, its buffer belongs to the engine until its completion
/// is returned by `wait`. Nothing else (an error from `wait`, a failed submit of a later batch) ends
/// that ownership, so a caller never frees memory the kernel may still write into.
pub trait IoEngine: Send {
    fn name(&self) -> &'static str;
    /// Queues and submits a batch (one system call per batch where the engine allows).
    fn submit(&mut self, requests: &[IoRequest]) -> Result<(), SubmitError>;
    /// Blocks until at least `min_complete` completions are available, then appends all of them.
    /// An error leaves every accepted request in flight.
    fn wait(&mut self, min_complete: usize, out: &mut Vec<IoCompletion>) -> std::io::Result<()>;
    /// Asks the engine to cancel these accepted requests (best effort): each one still completes
    /// through `wait`, with `-ECANCELED` or its real result.
    fn cancel(&mut self, _tokens: &[u64]) {}
}

/// Memory ranges the engine may register with the kernel (the DRAM arena).
#[derive(Debug, Clone, Copy)]
pub struct RegisteredRange {
    pub base: *mut u8,
    pub len: usize,
}
unsafe impl Send for RegisteredRange {}
unsafe impl Sync for RegisteredRange {}

/// How a tier's device queues run: engine depth, the write budget, and (tests only) injected faults.
#[derive(Debug, Clone)]
pub struct IoSetup {
    pub depth: usize,
    pub max_write_inflight_bytes: usize,
    #[cfg(any(test, feature = "testing"))]
    pub fault_plan: Option<std::sync::Arc<faults::FaultPlan>>,
}

impl Default for IoSetup {
    fn default() -> Self {
        IoSetup {
            depth: 8,
            max_write_inflight_bytes: 64 << 20,
            #[cfg(any(test, feature = "testing"))]
            fault_plan: None,
        }
    }
}

/// Pread/pwrite threads for files named per operation: the shared tier's. io_uring would add nothing
/// there: network and FUSE filesystems complete no read asynchronously, so the kernel hands each one
/// to a worker thread of its own, which is what these threads already are.
pub fn start_file_queue(name: &str, setup: &IoSetup) -> std::io::Result<device::DeviceQueue> {
    #[cfg_attr(not(any(test, feature = "testing")), allow(unused_mut))]
    let mut engine: Box<dyn IoEngine> = Box::new(psync::PsyncEngine::new(setup.depth.clamp(1, 16), name)?);
    #[cfg(any(test, feature = "testing"))]
    if let Some(plan) = &setup.fault_plan {
        engine = Box::new(faults::FaultyEngine::new(engine, std::sync::Arc::clone(plan)));
    }
    device::DeviceQueue::start(name, -1, engine, setup.depth, setup.max_write_inflight_bytes, None)
}
