//! A tier's health below DRAM (issue 36): a tier whose reads failed `sick_after` times in a row is sick.
//! A sick tier is not offered in lookups for a back-off (its blocks are then misses the engine
//! recomputes, never a wait); once the back-off has passed, one read at a time is let through as the
//! probe. A probe that the tier answers (a hit, or a clean miss) makes it healthy again; a probe that
//! fails doubles the back-off, up to `max_backoff`. Knows no tier: `RemoteTiers` keeps one per
//! remote tier and the store one for NVMe (`StoreState::nvme_health`); each says how its reads ended,
//! and counts and logs the changes this returns. Time is passed in, so that tests drive the clock.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Consecutive failed reads that make a tier sick.
pub const SICK_AFTER_FAILURES: u32 = 3;
/// The first back-off of a sick tier; each failed probe doubles it.
pub const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// The longest back-off.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// When a tier is sick and for how long it steps aside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthPolicy {
    pub sick_after: u32,
    pub first_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        HealthPolicy { sick_after: SICK_AFTER_FAILURES, first_backoff: FIRST_BACKOFF, max_backoff: MAX_BACKOFF }
    }
}

/// How a read of the tier ended, as far as its health goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    /// A verified block.
    Hit,
    /// A miss the tier answered cleanly (not indexed, gone, refused by verification): no failure.
    CleanMiss,
    /// An I/O error, a timeout, or a read the I/O engine gave up: a failure of the tier.
    Failed(String),
}

/// Whether a read may start on the tier now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Healthy: any number of reads.
    Read,
    /// Sick, its back-off passed: this read is the one probe (hand `probe: true` to `record`, or
    /// `release_probe` if it does not start).
    Probe,
    /// Sick: no read now.
    Refused,
}

/// A change of state `record` made, for the caller to count and log once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    None,
    /// The tier turned sick: not offered for `backoff`; `last_error` made it so.
    Sick {
        backoff: Duration,
        last_error: String,
    },
    /// The probe failed: still sick, for the doubled `backoff`.
    ProbeFailed {
        backoff: Duration,
        last_error: String,
    },
    /// Sick before, healthy again.
    Healthy,
}

#[derive(Debug)]
struct State {
    failures: u32,
    backoff: Duration,
    /// While sick: when it turned so.
    since: Instant,
    /// While sick: when the next probe may go.
    until: Instant,
}

/// One remote tier's health.
#[derive(Debug)]
pub struct Health {
    policy: HealthPolicy,
    /// Read without the lock: a healthy tier's lookups cost one atomic load.
    sick: AtomicBool,
    /// A probe is in flight.
    probing: AtomicBool,
    state: Mutex<State>,
}

impl Health {
    pub fn new(policy: HealthPolicy, now: Instant) -> Health {
        let state = State { failures: 0, backoff: policy.first_backoff, since: now, until: now };
        Health { policy, sick: AtomicBool::new(false), probing: AtomicBool::new(false), state: Mutex::new(state) }
    }

    pub fn is_sick(&self) -> bool {
        self.sick.load(Ordering::Acquire)
    }

    /// Whether lookups are offered the tier's blocks: healthy, or sick with its back-off passed and
    /// no probe in flight (the lookup's read may then be the probe). `now` is asked only when sick.
    pub fn offered(&self, now: impl FnOnce() -> Instant) -> bool {
        if !self.is_sick() {
            return true;
        }
        !self.probing.load(Ordering::Acquire) && now() >= self.state.lock().until
    }

    /// Whether a sick tier is due its probe now: its back-off passed and no probe is in flight.
    /// For a tier probed off the requests' path (the remote tiers: `Store`'s prober), whose lookups
    /// offer it only while it is healthy; `admit` then takes the probe slot.
    pub fn due_probe(&self, now: impl FnOnce() -> Instant) -> bool {
        self.is_sick() && !self.probing.load(Ordering::Acquire) && now() >= self.state.lock().until
    }

    /// Ends a sick tier's back-off now: what made it sick is over (its stalled refresh finished), so
    /// its next probe need not wait out a back-off that failed probes during the outage doubled.
    pub fn end_backoff(&self, now: Instant) {
        let mut state = self.state.lock();
        if self.is_sick() {
            state.until = state.until.min(now);
        }
    }

    /// When the tier turned sick; `None` while it is healthy.
    pub fn sick_since(&self) -> Option<Instant> {
        let since = self.state.lock().since;
        self.is_sick().then_some(since)
    }

    /// Whether a read may start now; `Probe` takes the one probe slot.
    pub fn admit(&self, now: impl FnOnce() -> Instant) -> Admit {
        if !self.is_sick() {
            return Admit::Read;
        }
        if now() < self.state.lock().until {
            return Admit::Refused;
        }
        match self.probing.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Admit::Probe,
            Err(_) => Admit::Refused,
        }
    }

    /// Gives the probe slot back: the probe read did not start (nothing was learnt).
    pub fn release_probe(&self) {
        self.probing.store(false, Ordering::Release);
    }

    /// How a read ended (`probe`: it was admitted as the probe); the change it made.
    pub fn record(&self, probe: bool, observed: Observed, now: Instant) -> Change {
        let mut state = self.state.lock();
        let change = match observed {
            Observed::Hit => self.answered(&mut state),
            Observed::CleanMiss if probe => self.answered(&mut state),
            Observed::CleanMiss => Change::None,
            Observed::Failed(error) => self.failed(&mut state, probe, error, now),
        };
        if probe {
            self.probing.store(false, Ordering::Release);
        }
        change
    }

    /// The tier stopped answering: a load waited its whole stall limit without any read finishing.
    /// Unlike an error, which may be one bad block, that is the tier: sick at once (the one probe's
    /// own answer is recorded by `record` when it comes).
    pub fn stalled(&self, last_error: String, now: Instant) -> Change {
        let mut state = self.state.lock();
        if self.is_sick() {
            return Change::None;
        }
        self.turn_sick(&mut state, last_error, now)
    }

    /// Healthy to sick, for the first back-off.
    fn turn_sick(&self, state: &mut State, last_error: String, now: Instant) -> Change {
        state.failures = 0;
        state.backoff = self.policy.first_backoff;
        state.since = now;
        state.until = now + state.backoff;
        self.sick.store(true, Ordering::Release);
        Change::Sick { backoff: state.backoff, last_error }
    }

    /// The tier answered: no failures in a row; healthy again if it was sick.
    fn answered(&self, state: &mut State) -> Change {
        state.failures = 0;
        if !self.sick.swap(false, Ordering::AcqRel) {
            return Change::None;
        }
        state.backoff = self.policy.first_backoff;
        Change::Healthy
    }

    fn failed(&self, state: &mut State, probe: bool, last_error: String, now: Instant) -> Change {
        if self.is_sick() {
            if !probe {
                // A read started before the tier turned sick: the outage is already known.
                return Change::None;
            }
            state.backoff = (state.backoff * 2).min(self.policy.max_backoff);
            state.until = now + state.backoff;
            return Change::ProbeFailed { backoff: state.backoff, last_error };
        }
        state.failures += 1;
        if state.failures < self.policy.sick_after.max(1) {
            return Change::None;
        }
        self.turn_sick(state, last_error, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn policy() -> HealthPolicy {
        HealthPolicy { sick_after: 3, first_backoff: S, max_backoff: 4 * S }
    }

    fn fail(h: &Health, probe: bool, now: Instant) -> Change {
        h.record(probe, Observed::Failed("EIO".into()), now)
    }

    #[test]
    fn a_sick_tier_is_due_its_probe_once_its_back_off_passed_and_none_is_in_flight() {
        let t0 = Instant::now();
        let h = Health::new(policy(), t0);
        assert!(!h.due_probe(|| t0), "healthy: nothing to probe");
        h.stalled("frozen".into(), t0);
        assert!(!h.due_probe(|| t0 + S / 2), "in its back-off");
        assert!(h.due_probe(|| t0 + S));
        assert_eq!(h.admit(|| t0 + S), Admit::Probe);
        assert!(!h.due_probe(|| t0 + 2 * S), "its probe is in flight");
        assert_eq!(fail(&h, true, t0 + 2 * S), Change::ProbeFailed { backoff: 2 * S, last_error: "EIO".into() });
        assert!(!h.due_probe(|| t0 + 3 * S) && h.due_probe(|| t0 + 4 * S), "the doubled back-off");
    }

    #[test]
    fn a_back_off_ended_early_makes_the_tier_due_its_probe_now() {
        let t0 = Instant::now();
        let h = Health::new(policy(), t0);
        h.end_backoff(t0);
        assert!(!h.is_sick(), "a healthy tier stays so");
        h.stalled("frozen".into(), t0);
        assert!(!h.due_probe(|| t0 + S / 2));
        h.end_backoff(t0 + S / 2);
        assert!(h.due_probe(|| t0 + S / 2));
        assert_eq!(h.sick_since(), Some(t0));
    }

    #[test]
    fn a_stall_makes_a_tier_sick_at_once_and_a_probe_brings_it_back() {
        let t0 = Instant::now();
        let h = Health::new(policy(), t0);
        assert_eq!(
            h.stalled("no read finished".into(), t0),
            Change::Sick { backoff: S, last_error: "no read finished".into() }
        );
        assert_eq!(h.stalled("again".into(), t0), Change::None, "already sick");
        assert!(!h.offered(|| t0) && h.admit(|| t0 + S) == Admit::Probe);
        assert_eq!(h.record(true, Observed::Hit, t0 + S), Change::Healthy);
    }

    #[test]
    fn three_failures_in_a_row_make_a_tier_sick_for_the_back_off() {
        let t0 = Instant::now();
        let h = Health::new(policy(), t0);
        assert_eq!(fail(&h, false, t0), Change::None);
        assert_eq!(fail(&h, false, t0), Change::None);
        assert!(h.offered(|| t0) && h.admit(|| t0) == Admit::Read);
        assert_eq!(fail(&h, false, t0), Change::Sick { backoff: S, last_error: "EIO".into() });
        assert!(h.is_sick());
        assert!(!h.offered(|| t0 + S / 2));
        assert_eq!(h.admit(|| t0 + S / 2), Admit::Refused);
        // Reads started before the outage that fail later change nothing.
        assert_eq!(fail(&h, false, t0 + S / 2), Change::None);
        assert!(h.offered(|| t0 + S));
    }

    #[test]
    fn a_hit_resets_the_count_and_clean_misses_do_not_count() {
        let t0 = Instant::now();
        let h = Health::new(policy(), t0);
        fail(&h, false, t0);
        fail(&h, false, t0);
        assert_eq!(h.record(false, Observed::Hit, t0), Change::None);
        fail(&h, false, t0);
        fail(&h, false, t0);
        for _ in 0..10 {
            assert_eq!(h.record(false, Observed::CleanMiss, t0), Change::None);
        }
        assert!(!h.is_sick(), "two failures, a hit, two failures and clean misses: never three in a row");
        assert!(matches!(fail(&h, false, t0), Change::Sick { .. }));
    }

    #[test]
    fn one_probe_at_a_time_and_its_success_brings_the_tier_back() {
        let t0 = Instant::now();
        let h = Health::new(policy(), t0);
        (0..3).for_each(|_| drop(fail(&h, false, t0)));
        let later = t0 + S;
        assert_eq!(h.admit(|| later), Admit::Probe);
        assert_eq!(h.admit(|| later), Admit::Refused, "one probe at a time");
        assert!(!h.offered(|| later), "not offered while the probe is in flight");
        h.release_probe();
        assert!(h.offered(|| later));
        assert_eq!(h.admit(|| later), Admit::Probe);
        assert_eq!(h.record(true, Observed::Hit, later), Change::Healthy);
        assert!(!h.is_sick() && h.offered(|| later) && h.admit(|| later) == Admit::Read);
        // Healthy again means three fresh failures before the next outage, with the first back-off.
        fail(&h, false, later);
        fail(&h, false, later);
        assert_eq!(fail(&h, false, later), Change::Sick { backoff: S, last_error: "EIO".into() });
    }

    #[test]
    fn a_probe_answered_by_a_clean_miss_brings_the_tier_back() {
        let t0 = Instant::now();
        let h = Health::new(policy(), t0);
        (0..3).for_each(|_| drop(fail(&h, false, t0)));
        assert_eq!(h.admit(|| t0 + S), Admit::Probe);
        assert_eq!(h.record(true, Observed::CleanMiss, t0 + S), Change::Healthy);
    }

    #[test]
    fn a_failed_probe_doubles_the_back_off_up_to_the_cap() {
        let t0 = Instant::now();
        let h = Health::new(policy(), t0);
        (0..3).for_each(|_| drop(fail(&h, false, t0)));
        let mut now = t0 + S;
        for expected in [2 * S, 4 * S, 4 * S, 4 * S] {
            assert_eq!(h.admit(|| now), Admit::Probe);
            assert_eq!(fail(&h, true, now), Change::ProbeFailed { backoff: expected, last_error: "EIO".into() });
            assert!(!h.offered(|| now + expected - Duration::from_millis(1)));
            assert_eq!(h.admit(|| now + expected - Duration::from_millis(1)), Admit::Refused);
            now += expected;
            assert!(h.offered(|| now));
        }
        assert_eq!(h.admit(|| now), Admit::Probe);
        assert_eq!(h.record(true, Observed::Hit, now), Change::Healthy);
        // The next outage starts from the first back-off again.
        (0..3).for_each(|_| drop(fail(&h, false, now)));
        assert!(h.offered(|| now + S) && !h.offered(|| now + S / 2));
    }

    #[test]
    fn only_one_of_many_threads_gets_the_probe() {
        let t0 = Instant::now();
        let h = std::sync::Arc::new(Health::new(policy(), t0));
        (0..3).for_each(|_| drop(fail(&h, false, t0)));
        let probes: usize = (0..8)
            .map(|_| {
                let h = std::sync::Arc::clone(&h);
                std::thread::spawn(move || usize::from(h.admit(|| t0 + S) == Admit::Probe))
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .sum();
        assert_eq!(probes, 1);
    }
}
