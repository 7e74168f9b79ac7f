//! Whether a device answers: how many operations wait on its queue, and when one last finished. A
//! disk with operations waiting and none finishing for a while has hung (a drive stuck in its
//! command timeouts, a frozen FUSE or network block device): the store's prober reads this to make
//! the NVMe tier step aside before, or however soon after, a request meets the hang.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub struct Progress {
    /// Operations queued or in flight.
    pending: AtomicUsize,
    /// Milliseconds since `origin` when an operation last finished, or when the queue last went from
    /// idle to busy.
    mark_ms: AtomicU64,
    /// Operations finished, ever: a hang ends with one, or with none waiting.
    answers: AtomicU64,
    origin: Instant,
}

impl Default for Progress {
    fn default() -> Self {
        let (pending, mark_ms, answers) = (AtomicUsize::new(0), AtomicU64::new(0), AtomicU64::new(0));
        Progress { pending, mark_ms, answers, origin: Instant::now() }
    }
}

impl Progress {
    /// An operation was queued. An idle queue's clock starts now, marked before the operation
    /// counts: the prober must never see it waiting against the mark of a finish long ago.
    pub fn started(&self) {
        if self.pending.load(Ordering::Acquire) == 0 {
            self.mark(Instant::now());
        }
        self.pending.fetch_add(1, Ordering::AcqRel);
    }

    /// An operation finished, answered by the device or not (cancelled by the queue, interrupted):
    /// either way the queue moves.
    pub fn finished(&self) {
        self.mark(Instant::now());
        self.answers.fetch_add(1, Ordering::AcqRel);
        let before = self.pending.fetch_sub(1, Ordering::AcqRel);
        assert!(before > 0, "an operation finished that was never started");
    }

    /// How long operations have waited with none finishing; `None` while none waits.
    pub fn stalled_for(&self, now: Instant) -> Option<Duration> {
        if self.pending.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mark = self.origin + Duration::from_millis(self.mark_ms.load(Ordering::Acquire));
        Some(now.saturating_duration_since(mark))
    }

    /// Whether no operation waits.
    pub fn idle(&self) -> bool {
        self.pending.load(Ordering::Acquire) == 0
    }

    /// Operations the device answered so far.
    pub fn answers(&self) -> u64 {
        self.answers.load(Ordering::Acquire)
    }

    fn mark(&self, now: Instant) {
        let ms = now.saturating_duration_since(self.origin).as_millis() as u64;
        self.mark_ms.fetch_max(ms, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_with_work_and_no_finish_stalls_and_a_finish_resets_it() {
        let progress = Progress::default();
        let later = |ms| Instant::now() + Duration::from_millis(ms);
        assert_eq!(progress.stalled_for(later(5_000)), None, "idle is not stalled");
        progress.started();
        progress.started();
        assert!(progress.stalled_for(later(2_000)).unwrap() >= Duration::from_millis(1_900));
        progress.finished();
        assert!(progress.stalled_for(Instant::now()).unwrap() < Duration::from_millis(100), "a finish is progress");
        progress.finished();
        assert_eq!(progress.stalled_for(later(5_000)), None);
    }
}
