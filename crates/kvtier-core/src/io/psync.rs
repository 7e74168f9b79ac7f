//! The portable engine: a small pool of threads issuing pread/pwrite. Used where io_uring is
//! disabled (many container runtimes) or forced by configuration.

use super::*;
use crossbeam_channel::{bounded, unbounded, Receiver, Sender};
use std::thread::JoinHandle;

pub struct PsyncEngine {
    requests: Option<Sender<IoRequest>>,
    completions: Receiver<IoCompletion>,
    threads: Vec<JoinHandle<()>>,
}

impl PsyncEngine {
    pub fn new(thread_count: usize, name: &str) -> std::io::Result<Self> {
        let (req_tx, req_rx) = bounded::<IoRequest>(1024);
        let (done_tx, done_rx) = unbounded();
        let threads = (0..thread_count.max(1))
            .map(|i| {
                let rx = req_rx.clone();
                let tx = done_tx.clone();
                std::thread::Builder::new().name(format!("kvtier-psync-{name}-{i}")).spawn(move || {
                    for req in rx.iter() {
                        let result = execute(&req);
                        if tx.send(IoCompletion { token: req.token, result }).is_err() {
                            break;
                        }
                    }
                })
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(PsyncEngine { requests: Some(req_tx), completions: done_rx, threads })
    }
}

/// One pread/pwrite; partial transfers are returned as such and resubmitted by the device queue.
fn execute(req: &IoRequest) -> i64 {
    debug_assert!(req.iov_count > 0 || !req.buf.is_null(), "a plain transfer without a buffer");
    debug_assert!(req.iov_count == 0 || !req.iov.is_null(), "a vectored transfer without iovecs");
    // SAFETY: the device queue guarantees the buffer is valid for `len` bytes until completion.
    let n = unsafe {
        match req.kind {
            OpKind::Read if req.iov_count > 0 => {
                libc::preadv(req.fd, req.iov, req.iov_count as libc::c_int, req.offset as libc::off_t)
            }
            OpKind::Read => libc::pread(req.fd, req.buf.cast(), req.len, req.offset as libc::off_t),
            OpKind::Write if req.iov_count > 0 => {
                libc::pwritev(req.fd, req.iov, req.iov_count as libc::c_int, req.offset as libc::off_t)
            }
            OpKind::Write => libc::pwrite(req.fd, req.buf.cast(), req.len, req.offset as libc::off_t),
        }
    };
    if n < 0 {
        -(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO) as i64)
    } else {
        n as i64
    }
}

impl IoEngine for PsyncEngine {
    fn name(&self) -> &'static str {
        "psync"
    }

    fn submit(&mut self, requests: &[IoRequest]) -> Result<(), SubmitError> {
        let tx = self.requests.as_ref().expect("engine alive");
        for (accepted, req) in requests.iter().enumerate() {
            tx.send(*req)
                .map_err(|_| SubmitError { accepted, error: std::io::Error::other("psync worker threads exited") })?;
        }
        Ok(())
    }

    fn wait(&mut self, min_complete: usize, out: &mut Vec<IoCompletion>) -> std::io::Result<()> {
        for _ in 0..min_complete {
            let c = self.completions.recv().map_err(|_| std::io::Error::other("psync worker threads exited"))?;
            out.push(c);
        }
        out.extend(self.completions.try_iter());
        Ok(())
    }
}

impl Drop for PsyncEngine {
    fn drop(&mut self) {
        self.requests.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
