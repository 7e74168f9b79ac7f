//! Waiting a bounded time for work that may block in the kernel for as long as a filesystem does
//! not answer: a file written, synced or closed on a frozen FUSE or network mount, or on a hung
//! disk, waits for it (closing a FUSE file waits uninterruptibly, even for a process that exits).
//! The work runs on a thread of its own; past the limit the caller goes on, and the thread finishes
//! whenever the filesystem answers. The work must own what it touches.

use std::time::Duration;

/// Why [`finish_within`] returned without the work's result.
#[derive(Debug)]
pub(crate) enum Overdue {
    /// Still running at the limit; its thread is left to finish.
    Late,
    /// No thread could be started for it (the work did not run).
    NoThread(std::io::Error),
}

/// Runs `work` on a thread named `name` and waits for it up to `limit`.
pub(crate) fn finish_within<T: Send + 'static>(
    name: &str,
    limit: Duration,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Overdue> {
    let (done_tx, done_rx) = crossbeam_channel::bounded(1);
    let run = move || drop(done_tx.send(work()));
    std::thread::Builder::new().name(name.into()).spawn(run).map_err(Overdue::NoThread)?;
    done_rx.recv_timeout(limit).map_err(|_| Overdue::Late)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn work_that_finishes_in_time_gives_its_result() {
        assert_eq!(finish_within("kvtier-test", Duration::from_secs(10), || 7).unwrap(), 7);
    }

    #[test]
    fn work_past_the_limit_is_left_running_and_the_caller_goes_on() {
        let (release_tx, release_rx) = crossbeam_channel::bounded::<()>(0);
        let (ended_tx, ended_rx) = crossbeam_channel::bounded(1);
        let started = Instant::now();
        let late = finish_within("kvtier-test", Duration::from_millis(50), move || {
            let _ = release_rx.recv();
            let _ = ended_tx.send(());
        });
        assert!(matches!(late, Err(Overdue::Late)));
        assert!(started.elapsed() < Duration::from_secs(5));
        release_tx.send(()).unwrap();
        ended_rx.recv_timeout(Duration::from_secs(5)).expect("the work left behind finishes once released");
    }
}
