//! The fill protocol's bookkeeping, apart from sockets and stores: a block that an engine's ranks
//! store together is one `Fill` of one reserved slot, joined by each rank, complete when every rank
//! committed its slice, given back when one gave up and nobody holds it any more, and abandoned
//! (its slot kept out of use until its last holder lets go) when a holder overstayed
//! `reservation_timeout_ms` (the reasons are in `server`'s module comment). The server calls these
//! under the namespace's fills lock and makes the store calls they lead to after releasing it.

use super::protocol::{ReserveKind, NO_SLOT};
use crate::key::BlockKey;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Blocks given up recently, so that every rank gives them up (bounded; entries expire).
#[derive(Default)]
pub(super) struct DroppedKeys {
    since: HashMap<BlockKey, Instant>,
}

impl DroppedKeys {
    const MAX_KEYS: usize = 1 << 16;
    const EXPIRY: Duration = Duration::from_secs(60);

    pub(super) fn contains(&self, key: &BlockKey) -> bool {
        self.since.get(key).is_some_and(|at| at.elapsed() < Self::EXPIRY)
    }

    pub(super) fn insert(&mut self, key: BlockKey) {
        if self.since.len() >= Self::MAX_KEYS {
            self.since.retain(|_, at| at.elapsed() < Self::EXPIRY);
            if self.since.len() >= Self::MAX_KEYS {
                self.since.clear();
            }
        }
        self.since.insert(key, Instant::now());
        debug_assert!(self.since.len() <= Self::MAX_KEYS);
    }
}

/// A slot reserved for one block, filled by every rank of the engine that reserved it first.
pub(super) struct Fill {
    pub(super) slot: u32,
    pub(super) sequence: u64,
    /// The tensor-parallel size of the engine filling it: engines of another size that share the
    /// namespace (a rank-independent object layout) leave the block to it.
    tp_size: u32,
    reserved_ranks: u64,
    committed_ranks: u64,
    /// Connections that reserved it and have neither committed nor aborted.
    holders: u32,
    aborted: bool,
    since: Instant,
}

impl Fill {
    pub(super) fn new(slot: u32, sequence: u64, tp_size: u32, now: Instant) -> Fill {
        assert!((1..=64).contains(&tp_size), "a fill records its ranks in a 64-bit mask");
        Fill { slot, sequence, tp_size, reserved_ranks: 0, committed_ranks: 0, holders: 0, aborted: false, since: now }
    }

    fn all_ranks(&self) -> u64 {
        let all = if self.tp_size == 64 { u64::MAX } else { (1u64 << self.tp_size) - 1 };
        debug_assert_eq!(all.count_ones(), self.tp_size);
        all
    }
}

struct Abandoned {
    slot: u32,
    holders: u32,
}

/// What a holder letting go of a fill leaves for the store to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// Other ranks still hold or owe it.
    Pending,
    /// Every rank committed: the block becomes visible.
    Complete { slot: u32, sequence: u64 },
    /// Given up, and nobody can still copy into the slot.
    GiveBack { slot: u32 },
    /// The last holder of an abandoned fill let go: its slot may be used again.
    FreeAbandoned { slot: u32 },
    /// Nothing left (the namespace closed while the connection still held it).
    Gone,
}

/// A rank's answer for a key another rank (or this one) is filling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Joined {
    /// This rank fills its slice of `slot`; it holds `(key, sequence)` until it lets go.
    Fill { slot: u32, sequence: u64 },
    /// Present for this rank: an engine of another TP size is storing it.
    Present,
    /// A repeated reserve by one rank, or a fill being given up.
    Dropped,
}

impl Joined {
    pub(super) fn reply(self) -> (ReserveKind, u32) {
        match self {
            Joined::Fill { slot, .. } => (ReserveKind::Fill, slot),
            Joined::Present => (ReserveKind::Present, NO_SLOT),
            Joined::Dropped => (ReserveKind::Dropped, NO_SLOT),
        }
    }
}

/// What the janitor's pass over the fills found (each with its key and slot).
#[derive(Default)]
pub(super) struct Expired {
    /// Nobody held them and a rank never came within `fill_timeout_ms`: give back.
    pub(super) stale: Vec<(BlockKey, u32)>,
    /// Held past `reservation_timeout_ms`: abandoned, their slots out of use until let go.
    pub(super) abandoned: Vec<(BlockKey, u32)>,
}

/// The namespace's fills in progress (one lock).
#[derive(Default)]
pub(super) struct Fills {
    /// The fill a rank reserving the key joins.
    open: HashMap<BlockKey, Fill>,
    /// Fills abandoned while connections still held them, by sequence.
    abandoned: HashMap<u64, Abandoned>,
}

impl Fills {
    pub(super) fn is_open(&self, key: &BlockKey) -> bool {
        self.open.contains_key(key)
    }

    /// (fills in progress, abandoned slots still held).
    pub(super) fn counts(&self) -> (u64, u64) {
        (self.open.len() as u64, self.abandoned.len() as u64)
    }

    /// A new fill of `slot`, which the store reserved for `key`; nobody holds it yet.
    pub(super) fn open(&mut self, key: BlockKey, fill: Fill) {
        let previous = self.open.insert(key, fill);
        assert!(previous.is_none(), "a key has one fill in progress");
    }

    /// Rank `rank` of an engine of `tp_size` ranks takes its share of the fill of `key`, if any.
    pub(super) fn join(&mut self, key: &BlockKey, rank: u32, tp_size: u32) -> Option<Joined> {
        assert!(rank < tp_size && tp_size <= 64, "rank {rank} of {tp_size}");
        let bit = 1u64 << rank;
        let fill = self.open.get_mut(key)?;
        if fill.tp_size != tp_size {
            // If that engine gives up, the block is a later miss, never wrong bytes.
            return Some(Joined::Present);
        }
        if fill.aborted || fill.reserved_ranks & bit != 0 {
            return Some(Joined::Dropped);
        }
        fill.reserved_ranks |= bit;
        fill.holders += 1;
        debug_assert!(fill.holders <= fill.reserved_ranks.count_ones(), "more holders than ranks that reserved");
        debug_assert_eq!(fill.reserved_ranks & !fill.all_ranks(), 0, "a rank past the fill's tp_size");
        Some(Joined::Fill { slot: fill.slot, sequence: fill.sequence })
    }

    /// A connection lets go of its reservation `(key, sequence)`, committing this rank's slice
    /// (`committed`: the rank's bit) or not. Whether the commit counts, and what follows.
    pub(super) fn let_go(&mut self, key: &BlockKey, sequence: u64, committed: Option<u64>) -> (bool, Outcome) {
        if let Some(fill) = self.open.get_mut(key).filter(|fill| fill.sequence == sequence) {
            assert!(fill.holders > 0, "a reservation held by a connection counts it as a holder");
            fill.holders -= 1;
            match committed {
                Some(bit) => fill.committed_ranks |= bit,
                None => fill.aborted = true,
            }
            debug_assert_eq!(fill.committed_ranks & !fill.reserved_ranks, 0, "a commit by a rank that never reserved");
            let (accepted, slot) = (committed.is_some() && !fill.aborted, fill.slot);
            let outcome = if fill.aborted && fill.holders == 0 {
                Outcome::GiveBack { slot }
            } else if !fill.aborted && fill.committed_ranks == fill.all_ranks() {
                Outcome::Complete { slot, sequence }
            } else {
                return (accepted, Outcome::Pending);
            };
            self.open.remove(key);
            return (accepted, outcome);
        }
        let Some(gone) = self.abandoned.get_mut(&sequence) else { return (false, Outcome::Gone) };
        assert!(gone.holders > 0, "an abandoned fill is kept only while someone holds it");
        gone.holders -= 1;
        if gone.holders > 0 {
            return (false, Outcome::Pending);
        }
        let slot = gone.slot;
        self.abandoned.remove(&sequence);
        (false, Outcome::FreeAbandoned { slot })
    }

    /// Rank `rank` gives up `key` without holding it (it got no room): another rank's fill it will
    /// now never complete is given up, at once (its slot, to give back) or when its holders let go.
    /// `false`: no such fill, the store was this rank's alone to drop.
    pub(super) fn give_up_unheld(&mut self, key: &BlockKey, rank: u32, tp_size: u32) -> (bool, Option<u32>) {
        assert!(rank < tp_size && tp_size <= 64, "rank {rank} of {tp_size}");
        let bit = 1u64 << rank;
        match self.open.get_mut(key) {
            Some(fill) if fill.tp_size == tp_size && fill.reserved_ranks & bit == 0 => {
                fill.aborted = true;
                if fill.holders > 0 {
                    return (true, None);
                }
                let slot = fill.slot;
                self.open.remove(key);
                (true, Some(slot))
            }
            _ => (false, None),
        }
    }

    /// Ends fills that waited too long at `now`: unheld past `unheld_limit` (given back), held past
    /// `held_limit` (abandoned).
    pub(super) fn expire(&mut self, now: Instant, unheld_limit: Duration, held_limit: Option<Duration>) -> Expired {
        let mut found = Expired::default();
        let abandoned = &mut self.abandoned;
        self.open.retain(|key, fill| {
            let age = now.saturating_duration_since(fill.since);
            if fill.holders == 0 && age >= unheld_limit {
                found.stale.push((*key, fill.slot));
                return false;
            }
            if fill.holders > 0 && held_limit.is_some_and(|limit| age >= limit) {
                let before = abandoned.insert(fill.sequence, Abandoned { slot: fill.slot, holders: fill.holders });
                debug_assert!(before.is_none(), "two fills of sequence {}", fill.sequence);
                found.abandoned.push((*key, fill.slot));
                return false;
            }
            true
        });
        found
    }

    /// Every fill in progress, for a namespace that closes (abandoned slots go with its store).
    pub(super) fn drain(&mut self) -> Vec<(BlockKey, u32)> {
        self.abandoned.clear();
        self.open.drain().map(|(key, fill)| (key, fill.slot)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    const KEYS: u8 = 3;
    const TP: u32 = 2;

    #[derive(Debug, Clone)]
    enum Step {
        /// Rank `rank` reserves key `key` (opening a fill when none is open).
        Reserve { key: u8, rank: u32 },
        /// Connection `rank` lets go of its oldest hold of key `key`, committing or not.
        LetGo { key: u8, rank: u32, commit: bool },
        /// Rank `rank` gives up key `key` without holding it.
        GiveUp { key: u8, rank: u32 },
        /// The janitor runs `advance_ms` later (limits 10 ms unheld, 20 ms held).
        Expire { advance_ms: u64 },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0..KEYS, 0..TP).prop_map(|(key, rank)| Step::Reserve { key, rank }),
            (0..KEYS, 0..TP, any::<bool>()).prop_map(|(key, rank, commit)| Step::LetGo { key, rank, commit }),
            (0..KEYS, 0..TP).prop_map(|(key, rank)| Step::GiveUp { key, rank }),
            (0..30u64).prop_map(|advance_ms| Step::Expire { advance_ms }),
        ]
    }

    /// What the store would see: slots reserved, and how each one ended.
    #[derive(Default)]
    struct Ledger {
        next_slot: u32,
        /// Slots reserved and not yet ended, with (key, sequence).
        live: HashMap<u32, (BlockKey, u64)>,
        /// Slots abandoned: kept out of use until `FreeAbandoned`.
        out_of_use: HashSet<u32>,
        /// Per live slot, the ranks whose commit counted.
        committed: HashMap<u32, u64>,
    }

    impl Ledger {
        fn end(&mut self, slot: u32) -> (BlockKey, u64) {
            self.committed.remove(&slot);
            self.live.remove(&slot).expect("a slot ends once, and only one that was reserved")
        }

        fn apply(&mut self, outcome: Outcome) {
            match outcome {
                Outcome::Complete { slot, sequence } => {
                    let committed = self.committed.get(&slot).copied().unwrap_or(0);
                    assert_eq!(committed, (1 << TP) - 1, "complete only when every rank's commit counted");
                    assert_eq!(self.end(slot).1, sequence, "the fill's own sequence");
                }
                Outcome::GiveBack { slot } => {
                    self.end(slot);
                }
                Outcome::FreeAbandoned { slot } => {
                    assert!(self.out_of_use.remove(&slot), "only an abandoned slot is freed this way, once");
                }
                Outcome::Pending | Outcome::Gone => {}
            }
        }
    }

    fn key(k: u8) -> BlockKey {
        BlockKey([k; 32])
    }

    proptest! {
        #[test]
        fn every_slot_ends_once_and_completes_only_when_every_rank_committed(
            steps in proptest::collection::vec(step(), 1..80)
        ) {
            let start = Instant::now();
            let mut now = start;
            let mut fills = Fills::default();
            let mut ledger = Ledger::default();
            let mut held: Vec<Vec<(BlockKey, u64, u32)>> = vec![Vec::new(); TP as usize];
            for step in steps {
                match step {
                    Step::Reserve { key: k, rank } => {
                        if !fills.is_open(&key(k)) {
                            let slot = ledger.next_slot;
                            ledger.next_slot += 1;
                            let sequence = u64::from(slot) + 1;
                            fills.open(key(k), Fill::new(slot, sequence, TP, now));
                            ledger.live.insert(slot, (key(k), sequence));
                        }
                        if let Some(Joined::Fill { slot, sequence }) = fills.join(&key(k), rank, TP) {
                            prop_assert!(!held[rank as usize].iter().any(|h| h.0 == key(k) && h.1 == sequence));
                            held[rank as usize].push((key(k), sequence, slot));
                        }
                    }
                    Step::LetGo { key: k, rank, commit } => {
                        let holds = &mut held[rank as usize];
                        let Some(at) = holds.iter().position(|h| h.0 == key(k)) else { continue };
                        let (held_key, sequence, slot) = holds.remove(at);
                        let (counted, outcome) = fills.let_go(&held_key, sequence, commit.then_some(1 << rank));
                        prop_assert!(!counted || commit, "an abort never counts as a commit");
                        if counted {
                            prop_assert!(ledger.live.contains_key(&slot), "a commit counts only for a live fill");
                            *ledger.committed.entry(slot).or_default() |= 1 << rank;
                        }
                        ledger.apply(outcome);
                    }
                    Step::GiveUp { key: k, rank } => {
                        if let (_, Some(slot)) = fills.give_up_unheld(&key(k), rank, TP) {
                            ledger.end(slot);
                        }
                    }
                    Step::Expire { advance_ms } => {
                        now += Duration::from_millis(advance_ms);
                        let found = fills.expire(now, Duration::from_millis(10), Some(Duration::from_millis(20)));
                        for (_, slot) in found.stale {
                            ledger.end(slot);
                        }
                        for (_, slot) in found.abandoned {
                            ledger.end(slot);
                            ledger.out_of_use.insert(slot);
                        }
                    }
                }
                let (open, abandoned) = fills.counts();
                prop_assert_eq!(open as usize, ledger.live.len(), "every live slot is an open fill");
                prop_assert_eq!(abandoned as usize, ledger.out_of_use.len(), "every abandoned slot is held");
            }
            // Every connection closes: whatever it still held is let go, uncommitted.
            for (k, sequence, _) in held.into_iter().flatten() {
                let (counted, outcome) = fills.let_go(&k, sequence, None);
                prop_assert!(!counted);
                ledger.apply(outcome);
            }
            prop_assert!(ledger.out_of_use.is_empty(), "the last holder frees every abandoned slot");
            let orphans = fills.drain();
            prop_assert_eq!(orphans.len(), ledger.live.len(), "only fills nobody holds are left for the close");
        }
    }

    #[test]
    fn an_engine_of_another_tp_size_sees_the_block_present_and_a_repeat_reserve_is_dropped() {
        let mut fills = Fills::default();
        fills.open(key(1), Fill::new(5, 9, 2, Instant::now()));
        assert_eq!(fills.join(&key(1), 0, 4), Some(Joined::Present));
        assert_eq!(fills.join(&key(1), 0, 2), Some(Joined::Fill { slot: 5, sequence: 9 }));
        assert_eq!(fills.join(&key(1), 0, 2), Some(Joined::Dropped), "one share per rank");
        assert_eq!(fills.join(&key(2), 0, 2), None, "no fill: the store decides");
        assert_eq!(fills.let_go(&key(1), 9, Some(1)), (true, Outcome::Pending), "rank 1 still owes its slice");
        assert_eq!(fills.let_go(&key(1), 8, Some(1)), (false, Outcome::Gone), "another sequence: not this fill");
    }
}
