//! A remote tier's heartbeat (issue 36): each remote tier's maintenance thread refreshes its index
//! (the shared filesystem's manifests, the bucket's LIST) every second or so, whether or not an
//! engine reads. A refresh that does not answer is the first sign that the tier stopped answering
//! (a frozen gateway, a FUSE daemon or NFS server that hangs). The store's prober watches it
//! (`RemoteTiers::watch_heartbeats`) and makes such a tier sick before a request's load meets it:
//! without it the first request after a freeze waited its whole stall limit, and at capacity that
//! wait moved its last prefill chunk into the next request's step (docs/benchmarks.md, "At
//! capacity"). Only the refresh is timed: it reads a few small objects, so a slow link's long PUTs
//! and GETs do not look like a frozen tier. Time is passed in, so that tests drive the clock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A refresh is stalled once it went unanswered this many times the tier's recent refreshes (a
/// large bucket lists for longer) and at least the store's stall limit.
const STALL_REFRESH_TIMES: u32 = 4;

/// One tier's refreshes: the one in flight, the last that finished, and how long they take.
#[derive(Debug)]
pub struct Heartbeat {
    base: Instant,
    /// The refresh in flight: its start as a `stamp`; 0 when none is.
    in_flight: AtomicU64,
    /// The last refresh `stalled` reported (its `stamp`): one verdict per refresh.
    reported: AtomicU64,
    /// The start of the last refresh that finished (its `stamp`); 0 when none did.
    answered: AtomicU64,
    /// Recent refreshes' duration (an exponentially weighted mean, microseconds; 0: none yet).
    recent_us: AtomicU64,
}

impl Heartbeat {
    pub fn new(now: Instant) -> Heartbeat {
        let zero = || AtomicU64::new(0);
        Heartbeat { base: now, in_flight: zero(), reported: zero(), answered: zero(), recent_us: zero() }
    }

    /// Runs one refresh of the tier's index, timed. A refresh that overlaps one already timed (a
    /// test or a tool driving `maintain` beside the maintenance thread) runs untimed: the one in
    /// flight stands for both.
    pub fn refresh<T>(&self, refresh: impl FnOnce() -> T) -> T {
        let timed = self.begin(Instant::now());
        let result = refresh();
        if timed {
            self.end(Instant::now());
        }
        result
    }

    /// How long the refresh in flight has gone unanswered, once that is longer than `floor` and
    /// `STALL_REFRESH_TIMES` its recent ones; `None` otherwise, and for a refresh reported before.
    pub fn stalled(&self, floor: Duration, now: Instant) -> Option<Duration> {
        let started = self.in_flight.load(Ordering::Acquire);
        if started == 0 {
            return None;
        }
        let waited = now.saturating_duration_since(self.instant(started));
        let recent = Duration::from_micros(self.recent_us.load(Ordering::Relaxed));
        if waited < floor.max(recent * STALL_REFRESH_TIMES) {
            return None;
        }
        let previous = self.reported.swap(started, Ordering::AcqRel);
        (previous != started).then_some(waited)
    }

    /// Whether the refresh `stalled` last reported has finished since (the tier answers again):
    /// true once per such refresh.
    pub fn take_thaw(&self) -> bool {
        let reported = self.reported.load(Ordering::Acquire);
        let answered = self.answered.load(Ordering::Acquire);
        reported != 0
            && answered >= reported
            && self.reported.compare_exchange(reported, 0, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Whether a refresh that started at or after `since` has finished: the tier answered since.
    pub fn answered_since(&self, since: Instant) -> bool {
        let answered = self.answered.load(Ordering::Acquire);
        answered != 0 && self.instant(answered) >= since
    }

    /// Starts timing a refresh; false when one is timed already.
    fn begin(&self, now: Instant) -> bool {
        let stamp = self.stamp(now);
        self.in_flight.compare_exchange(0, stamp, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Ends the timed refresh (the one `begin` answered true for).
    fn end(&self, now: Instant) {
        let started = self.in_flight.swap(0, Ordering::AcqRel);
        assert_ne!(started, 0, "only the timed refresh ends its timing");
        self.answered.store(started, Ordering::Release);
        let took_us = (now.saturating_duration_since(self.instant(started)).as_micros() as u64).max(1);
        let old = self.recent_us.load(Ordering::Relaxed);
        let new = if old == 0 { took_us } else { (old * 4 + took_us) / 5 };
        self.recent_us.store(new, Ordering::Relaxed);
    }

    /// `now` as microseconds since `base`, plus one: never 0, which means "none".
    fn stamp(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.base).as_micros() as u64 + 1
    }

    fn instant(&self, stamp: u64) -> Instant {
        self.base + Duration::from_micros(stamp - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_refresh_unanswered_past_the_floor_is_stalled_once() {
        let t0 = Instant::now();
        let h = Heartbeat::new(t0);
        assert_eq!(h.stalled(S, t0 + 10 * S), None, "no refresh in flight");
        assert!(h.begin(t0));
        assert_eq!(h.stalled(S, t0 + S / 2), None, "within the floor");
        assert_eq!(h.stalled(S, t0 + S), Some(S));
        assert_eq!(h.stalled(S, t0 + 2 * S), None, "the same refresh is reported once");
        assert!(!h.answered_since(t0));
        h.end(t0 + 3 * S);
        assert!(h.answered_since(t0) && !h.answered_since(t0 + S), "answered: the refresh that began at t0");
        assert!(h.take_thaw() && !h.take_thaw(), "the stalled refresh finished: once");
        assert!(h.begin(t0 + 4 * S));
        assert_eq!(h.stalled(S, t0 + 16 * S), Some(12 * S), "the next refresh is judged on its own");
    }

    #[test]
    fn no_thaw_without_a_stalled_refresh_finishing() {
        let t0 = Instant::now();
        let h = Heartbeat::new(t0);
        assert!(h.begin(t0));
        h.end(t0 + S / 10);
        assert!(!h.take_thaw(), "nothing was reported stalled");
        assert!(h.begin(t0 + S));
        assert_eq!(h.stalled(S, t0 + 3 * S), Some(2 * S));
        assert!(!h.take_thaw(), "the stalled refresh is still in flight");
        h.end(t0 + 4 * S);
        assert!(h.take_thaw());
    }

    #[test]
    fn a_tier_whose_refreshes_take_long_is_given_longer() {
        let t0 = Instant::now();
        let h = Heartbeat::new(t0);
        assert!(h.begin(t0));
        h.end(t0 + 2 * S); // a large bucket: its LIST takes 2 s
        assert!(h.begin(t0 + 3 * S));
        assert_eq!(h.stalled(S, t0 + 10 * S), None, "7 s: within 4x its recent refreshes");
        assert_eq!(h.stalled(S, t0 + 11 * S), Some(8 * S));
    }

    #[test]
    fn a_refresh_beside_the_timed_one_runs_untimed() {
        let t0 = Instant::now();
        let h = Heartbeat::new(t0);
        assert!(h.begin(t0));
        assert_eq!(h.refresh(|| 7), 7, "runs, untimed");
        assert_eq!(h.stalled(S, t0 + 2 * S), Some(2 * S), "the first is still in flight");
        h.end(t0 + 3 * S);
        assert_eq!(h.in_flight.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn refresh_times_what_it_runs() {
        let h = Heartbeat::new(Instant::now());
        assert_eq!(h.refresh(|| 7), 7);
        assert_eq!(h.in_flight.load(Ordering::Relaxed), 0);
        assert!(h.answered_since(h.base) && h.recent_us.load(Ordering::Relaxed) >= 1);
    }
}
