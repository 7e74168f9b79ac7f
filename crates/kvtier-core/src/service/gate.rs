//! `CopyGate`: lets one thread give up another thread's transfer without racing its copies.
//!
//! A worker's job thread may sit in a call to a frozen service for as long as the socket's timeout,
//! while the engine needs an answer now: a load it can recompute instead, or a store whose engine
//! blocks it must reuse. Returning to the engine is only safe once no copy of that transfer can touch
//! the engine's memory any more. The job thread opens the gate around each round's copy and a
//! canceller closes it between copies: once `cancel` returned true, no copy of this transfer runs
//! again, and a call that comes back late from the service gives its blocks back without copying.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

const IDLE: u8 = 0;
const COPYING: u8 = 1;
const CANCELLED: u8 = 2;

/// One transfer's gate (shared between the copying thread and a canceller).
#[derive(Debug, Default)]
pub struct CopyGate {
    state: AtomicU8,
    /// Rounds copied so far: a canceller tells a stalled transfer from a long one by it.
    rounds: AtomicU64,
}

impl CopyGate {
    pub fn new() -> Self {
        Self::default()
    }

    /// Before a round's copy: false when the transfer was given up (then copy nothing).
    pub fn enter(&self) -> bool {
        self.state.compare_exchange(IDLE, COPYING, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// After a round's copy (only after a successful `enter`).
    pub fn leave(&self) {
        let was = self.state.swap(IDLE, Ordering::AcqRel);
        assert_eq!(was, COPYING, "CopyGate::leave without enter");
        self.rounds.fetch_add(1, Ordering::Relaxed);
    }

    /// Gives the transfer up unless a copy runs now: true once no copy will run from now on (also
    /// when it was given up before); false while a copy runs (bounded: ask again).
    pub fn cancel(&self) -> bool {
        match self.state.compare_exchange(IDLE, CANCELLED, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => true,
            Err(state) => state == CANCELLED,
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.state.load(Ordering::Acquire) == CANCELLED
    }

    pub fn rounds(&self) -> u64 {
        self.rounds.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::CopyGate;

    #[test]
    fn a_cancel_waits_for_the_copy_in_progress_and_stops_every_later_one() {
        let gate = CopyGate::new();
        assert!(gate.enter());
        assert!(!gate.cancel(), "a copy runs: not yet");
        gate.leave();
        assert_eq!(gate.rounds(), 1);
        assert!(gate.cancel() && gate.cancel() && gate.is_cancelled());
        assert!(!gate.enter(), "no copy after a cancel");
    }
}
