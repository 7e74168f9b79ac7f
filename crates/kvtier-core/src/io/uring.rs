//! The io_uring engine: one ring per device thread, the device file registered as a fixed file and the
//! DRAM arena as fixed buffers when the kernel and RLIMIT_MEMLOCK allow (else plain ops, logged once),
//! one `io_uring_enter` per batch.

use super::*;
use io_uring::{opcode, squeue, types, IoUring};

pub struct UringEngine {
    ring: IoUring,
    fixed_fd: Option<RawFd>,
    /// Registered buffers, index = position.
    registered: Vec<RegisteredRange>,
}

/// `user_data` of cancellation requests; device tokens start at 1, so it never names an operation.
const CANCEL_USER_DATA: u64 = 0;

unsafe impl Send for UringEngine {}

impl UringEngine {
    pub fn new(depth: u32, fd: RawFd, ranges: &[RegisteredRange], device_name: &str) -> std::io::Result<Self> {
        let ring = IoUring::builder().build(depth.next_power_of_two().max(8))?;
        let fixed_fd = match ring.submitter().register_files(&[fd]) {
            Ok(()) => Some(fd),
            Err(e) => {
                log::info!("kvtier: {device_name}: io_uring file registration refused ({e}); using plain fds");
                None
            }
        };
        let iovecs: Vec<libc::iovec> =
            ranges.iter().map(|r| libc::iovec { iov_base: r.base.cast(), iov_len: r.len }).collect();
        let registered = if iovecs.is_empty() {
            Vec::new()
        } else {
            // SAFETY: the arena outlives every device thread (the store joins them before unmapping).
            match unsafe { ring.submitter().register_buffers(&iovecs) } {
                Ok(()) => ranges.to_vec(),
                Err(e) => {
                    log::warn!(
                        "kvtier: {device_name}: io_uring buffer registration refused ({e}); \
                         raise RLIMIT_MEMLOCK (ulimit -l) to register the DRAM pool; using unregistered buffers"
                    );
                    Vec::new()
                }
            }
        };
        Ok(UringEngine { ring, fixed_fd, registered })
    }

    pub fn buffers_registered(&self) -> bool {
        !self.registered.is_empty()
    }

    fn registered_index(&self, buf: *mut u8, len: usize) -> Option<u16> {
        let start = buf as usize;
        self.registered
            .iter()
            .position(|r| {
                let base = r.base as usize;
                start >= base && start + len <= base + r.len
            })
            .map(|i| {
                debug_assert!(i <= u16::MAX as usize, "more registered ranges than io_uring indexes");
                i as u16
            })
    }

    fn entry(&self, req: &IoRequest) -> squeue::Entry {
        debug_assert!(req.iov_count <= u32::MAX as usize);
        debug_assert!(req.iov_count > 0 || !req.buf.is_null(), "a plain transfer without a buffer");
        let len = req.len as u32;
        let fixed_buf = self.registered_index(req.buf, req.len);
        macro_rules! build {
            ($target:expr) => {
                match (req.kind, fixed_buf) {
                    (OpKind::Read, _) if req.iov_count > 0 => {
                        opcode::Readv::new($target, req.iov, req.iov_count as u32).offset(req.offset).build()
                    }
                    (OpKind::Read, Some(i)) => {
                        opcode::ReadFixed::new($target, req.buf, len, i).offset(req.offset).build()
                    }
                    (OpKind::Read, None) => opcode::Read::new($target, req.buf, len).offset(req.offset).build(),
                    (OpKind::Write, _) if req.iov_count > 0 => {
                        opcode::Writev::new($target, req.iov, req.iov_count as u32).offset(req.offset).build()
                    }
                    (OpKind::Write, Some(i)) => {
                        opcode::WriteFixed::new($target, req.buf, len, i).offset(req.offset).build()
                    }
                    (OpKind::Write, None) => opcode::Write::new($target, req.buf, len).offset(req.offset).build(),
                }
            };
        }
        let entry = match self.fixed_fd {
            Some(fd) if fd == req.fd => build!(types::Fixed(0)),
            _ => build!(types::Fd(req.fd)),
        };
        entry.user_data(req.token)
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn submit(&mut self, requests: &[IoRequest]) -> Result<(), SubmitError> {
        // An entry pushed to the submission ring is the kernel's from then on, even if the
        // `io_uring_enter` that would submit it fails: the next enter (in `wait`) submits it.
        for (pushed, req) in requests.iter().enumerate() {
            debug_assert!(req.len <= u32::MAX as usize);
            debug_assert_ne!(req.token, CANCEL_USER_DATA);
            let entry = self.entry(req);
            // SAFETY: buffers stay valid until completion (device queue contract).
            while unsafe { self.ring.submission().push(&entry) }.is_err() {
                self.ring.submit().map_err(|error| SubmitError { accepted: pushed, error })?;
            }
        }
        self.ring.submit().map_err(|error| SubmitError { accepted: requests.len(), error })?;
        Ok(())
    }

    fn wait(&mut self, min_complete: usize, out: &mut Vec<IoCompletion>) -> std::io::Result<()> {
        loop {
            match self.ring.submit_and_wait(min_complete) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
        }
        for cqe in self.ring.completion() {
            if cqe.user_data() == CANCEL_USER_DATA {
                continue;
            }
            out.push(IoCompletion { token: cqe.user_data(), result: cqe.result() as i64 });
        }
        Ok(())
    }

    fn cancel(&mut self, tokens: &[u64]) {
        for &token in tokens {
            let entry = opcode::AsyncCancel::new(token).build().user_data(CANCEL_USER_DATA);
            // SAFETY: a cancellation carries no buffer.
            while unsafe { self.ring.submission().push(&entry) }.is_err() {
                if self.ring.submit().is_err() {
                    return;
                }
            }
        }
        if let Err(e) = self.ring.submit() {
            log::warn!("kvtier: io_uring cancellation not submitted: {e}");
        }
    }
}
