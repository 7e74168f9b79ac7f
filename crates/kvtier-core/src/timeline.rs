//! When a namespace's sequences were handed out: the catalog dates blocks by it (`kvtier trim
//! --older-than`, `kvtier inspect`). Kept in memory here, saved in the namespace's directory by
//! `namespace_dir`, encoded by `format::timeline`. Low in the stack so that the catalog can hold one
//! without depending on the operator tools (`maintenance`) that read it.

use crate::format::timeline;
use std::time::{SystemTime, UNIX_EPOCH};

pub(crate) fn now_unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// When sequences were handed out, as upper bounds at about one-second resolution: a point
/// `(end, unix_ms)` says every sequence below `end` was handed out at or before `unix_ms`
/// (`format::timeline`). Saved beside the namespace's files and restored at open, plus one point
/// for the open itself (every recovered block is older than it), so dates survive restarts. A crash
/// loses the points since the last save, and halving drops every other point: both only date blocks
/// later than they are, so `trim --older-than` never removes a block younger than asked.
#[derive(Debug)]
pub struct Timeline {
    points: Vec<(u64, u64)>,
    opened_unix_ms: u64,
    /// Sequences below this were handed out before the open (0 for a new store).
    open_end: u64,
    /// Points changed since the last save.
    unsaved: bool,
}

impl Default for Timeline {
    fn default() -> Self {
        Timeline { points: Vec::new(), opened_unix_ms: now_unix_ms(), open_end: 0, unsaved: false }
    }
}

impl Timeline {
    /// The timeline of a reopened store: the saved points, then the open (`next_sequence`: the first
    /// sequence after every recovered block). Returns it with the sequence to hand out next, which
    /// is past every saved point so that no new block falls in a range dated before the open.
    pub fn restored(mut points: Vec<(u64, u64)>, next_sequence: u64) -> (Timeline, u64) {
        let opened_unix_ms = now_unix_ms();
        let saved_end = points.last().map_or(0, |&(end, _)| end);
        let next_sequence = next_sequence.max(saved_end);
        if points.len() >= timeline::MAX_POINTS {
            halve(&mut points);
        }
        let at = points.last().map_or(opened_unix_ms, |&(_, ms)| ms.max(opened_unix_ms));
        points.push((next_sequence, at));
        (Timeline { points, opened_unix_ms, open_end: next_sequence, unsaved: true }, next_sequence)
    }

    pub fn record(&mut self, sequence: u64) {
        let now = now_unix_ms();
        self.unsaved = true;
        if let Some(last) = self.points.last_mut() {
            if now / 1000 <= last.1 / 1000 {
                // The same second (or a clock that went back): widen the last point.
                last.0 = last.0.max(sequence + 1);
                last.1 = last.1.max(now);
                return;
            }
        }
        if self.points.len() >= timeline::MAX_POINTS {
            halve(&mut self.points);
        }
        self.points.push((sequence + 1, now));
    }

    /// The latest time `sequence` can have been handed out; `None` if no point covers it.
    pub fn time_of(&self, sequence: u64) -> Option<u64> {
        let at = self.points.partition_point(|&(end, _)| end <= sequence);
        self.points.get(at).map(|&(_, ms)| ms)
    }

    /// A block recovered at open whose only known date is the open.
    pub fn undated_before_open(&self, sequence: u64) -> bool {
        sequence < self.open_end && self.time_of(sequence).is_none_or(|ms| ms >= self.opened_unix_ms)
    }

    /// A sequence below which every block was handed out before `unix_ms`.
    pub fn cutoff(&self, unix_ms: u64) -> u64 {
        let at = self.points.partition_point(|&(_, ms)| ms < unix_ms);
        if at == 0 {
            0
        } else {
            self.points[at - 1].0
        }
    }

    pub fn opened_unix_ms(&self) -> u64 {
        self.opened_unix_ms
    }

    /// The points to save, when they changed since the last call.
    pub fn take_unsaved(&mut self) -> Option<Vec<(u64, u64)>> {
        std::mem::take(&mut self.unsaved).then(|| self.points.clone())
    }

    /// A save failed: the next call to `take_unsaved` tries again.
    pub fn mark_unsaved(&mut self) {
        self.unsaved = true;
    }
}

/// Keeps every other point, the newest included (dropping a point only loosens bounds).
fn halve(points: &mut Vec<(u64, u64)>) {
    let keep_parity = (points.len() - 1) % 2;
    let mut i = 0;
    points.retain(|_| {
        i += 1;
        (i - 1) % 2 == keep_parity
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeline_dates_sequences_and_cuts_conservatively() {
        let t = Timeline {
            points: vec![(11, 5_000), (21, 6_000), (31, 8_000)],
            opened_unix_ms: 4_000,
            open_end: 0,
            unsaved: false,
        };
        assert_eq!(t.time_of(5), Some(5_000), "stored by the first point");
        assert_eq!(t.time_of(10), Some(5_000));
        assert_eq!(t.time_of(11), Some(6_000));
        assert_eq!(t.time_of(25), Some(8_000));
        assert_eq!(t.time_of(31), None, "not handed out yet");
        assert_eq!(t.cutoff(5_000), 0, "nothing provably before 5 s");
        assert_eq!(t.cutoff(5_001), 11);
        assert_eq!(t.cutoff(7_000), 21);
        assert_eq!(t.cutoff(9_000), 31);
    }

    #[test]
    fn a_restored_timeline_dates_recovered_blocks_and_never_reuses_dated_sequences() {
        let saved = vec![(11, 5_000), (21, 6_000)];
        // Blocks 21.. were stored after the last save and lost: the next sequence skips past the
        // saved points.
        let (t, next) = Timeline::restored(saved.clone(), 15);
        assert_eq!(next, 21);
        assert_eq!(t.time_of(3), Some(5_000), "dated by the saved timeline");
        assert!(!t.undated_before_open(3));
        let (t, next) = Timeline::restored(saved, 40);
        assert_eq!(next, 40);
        assert_eq!(t.time_of(30), Some(t.opened_unix_ms()), "stored after the last save: dated by the open");
        assert!(t.undated_before_open(30));
        assert_eq!(t.cutoff(5_500), 11);
        assert_eq!(t.cutoff(t.opened_unix_ms() + 1), 40, "every recovered block is older than the open");
        let (fresh, next) = Timeline::restored(Vec::new(), 7);
        assert_eq!(next, 7);
        assert!(fresh.undated_before_open(6) && !fresh.undated_before_open(7));
    }

    #[test]
    fn halving_keeps_the_newest_point_and_only_loosens_bounds() {
        let mut points: Vec<(u64, u64)> = (1..=6).map(|i| (i * 10, i * 1_000)).collect();
        halve(&mut points);
        assert_eq!(points, vec![(20, 2_000), (40, 4_000), (60, 6_000)]);
        let mut odd: Vec<(u64, u64)> = (1..=5).map(|i| (i * 10, i * 1_000)).collect();
        halve(&mut odd);
        assert_eq!(odd, vec![(10, 1_000), (30, 3_000), (50, 5_000)]);
    }

    #[test]
    fn record_widens_the_current_second_and_saves_only_changes() {
        let mut t = Timeline::default();
        t.record(1);
        t.record(2);
        assert_eq!(t.points.len(), 1, "one point per second");
        assert_eq!(t.points[0].0, 3);
        assert!(t.take_unsaved().is_some());
        assert!(t.take_unsaved().is_none());
        t.record(3);
        assert_eq!(t.take_unsaved().unwrap().last().unwrap().0, 4);
    }
}
