//! The change log of one namespace: which blocks became or stopped being loadable in which tier.
//!
//! Engines turn it into vLLM's KV events, so that prefix-aware routers see what kvtier holds
//! (`Op::Changes`, docs/service.md). Only the service knows what every engine on the host stored
//! and what eviction, trim, quarantine or another node's eviction from a remote tier removed, so the log
//! is built here, by diffing the store's residency (DRAM, NVMe, the remote tiers) against what the log
//! last saw. The catalog's index records which keys' local tiers changed (its one choke point for
//! entry changes, `Catalog::residency_changes`), so a refresh looks up only those keys under the
//! catalog's lock; the whole index is walked on the first refresh and when more than
//! `LOG_CAPACITY` keys changed in between (then the followers get resets anyway). The remote
//! tiers' indexes are walked again only when they changed (`Store::residency_changes`). A refresh
//! happens only while some engine follows the log, at most once per `REFRESH_PERIOD`.
//!
//! Sequence numbers start at a random point of [1, 2^62): a follower's cursor from another log (a
//! restarted service, a namespace closed and reopened) falls inside the new one's window of kept
//! changes with a chance of about `LOG_CAPACITY` in 2^62, so it gets a reset, never a wrong
//! continuation. (They started at the log's birth time in microseconds, which a log that recorded
//! more changes than microseconds passed before its successor was born, or a clock set back,
//! defeated: a big store's first snapshot records millions of changes at once.)

use crate::catalog::ResidencyChanges;
use crate::key::BlockKey;
use crate::store_residency::RemoteGeneration;
use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

/// A log is rebuilt from the store at most this often, when a follower asks.
pub const REFRESH_PERIOD: Duration = Duration::from_millis(500);
/// Changes kept (a follower further behind gets a reset), and the most one reply carries.
pub const LOG_CAPACITY: usize = 1 << 16;

/// Tier bits of a block's residency and of a change (`Op::Changes`'s `u8 tier`).
pub const TIER_DRAM: u8 = 1;
pub const TIER_NVME: u8 = 2;
/// Either remote tier (shared filesystem or bucket): one bit for both, value 4 on the wire (called
/// "shared tier" in docs/service.md's Changes reply, as since protocol v2).
pub const TIER_REMOTE: u8 = 4;
const TIERS: [u8; 3] = [TIER_DRAM, TIER_NVME, TIER_REMOTE];

/// One block's change in one tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    pub key: BlockKey,
    pub tier: u8,
    pub removed: bool,
}

/// `ChangeLog::since`'s answer.
#[derive(Debug, PartialEq, Eq)]
pub struct ChangesReply {
    /// The cursor was not a position in this log (first call, fallen behind, another log): forget
    /// what you were told; `changes` is the current state, every block as added.
    pub reset: bool,
    /// The cursor to ask with next.
    pub next: u64,
    pub changes: Vec<Change>,
}

pub struct ChangeLog {
    /// When the residency was last read into the log (`None`: never, no follower yet).
    pub refreshed_at: Option<Instant>,
    /// What the remote tiers' indexes were when last read (`Store::residency_changes`'s cursor).
    pub remote_generation: Option<RemoteGeneration>,
    current: HashMap<BlockKey, u8>,
    /// The keys of `current` with `TIER_REMOTE` (held by either remote tier).
    remote: HashSet<BlockKey>,
    ring: VecDeque<Change>,
    /// Sequence of `ring[0]`; `first + ring.len()` is the next change's.
    first: u64,
    capacity: usize,
}

impl ChangeLog {
    /// A log keeping the latest `capacity` changes (a follower further behind gets a reset).
    pub fn new(capacity: usize) -> ChangeLog {
        assert!(capacity > 0);
        ChangeLog {
            refreshed_at: None,
            remote_generation: None,
            current: HashMap::new(),
            remote: HashSet::new(),
            ring: VecDeque::new(),
            first: (crate::store::random_u64() >> 2).max(1),
            capacity,
        }
    }

    fn next_sequence(&self) -> u64 {
        self.first + self.ring.len() as u64
    }

    /// Whether a follower asking now should see the store read again first.
    pub fn stale(&self) -> bool {
        self.refreshed_at.is_none_or(|at| at.elapsed() >= REFRESH_PERIOD)
    }

    /// Whether the next refresh must read the whole state (`Catalog::residency_changes`'s `full`).
    pub fn needs_full(&self) -> bool {
        self.refreshed_at.is_none()
    }

    /// Records what changed between the last snapshot and `now` (key -> tier bits).
    pub fn update(&mut self, now: HashMap<BlockKey, u8>) {
        self.refreshed_at = Some(Instant::now());
        let mut changes = Vec::new();
        for (key, &tiers) in &now {
            let before = self.current.get(key).copied().unwrap_or(0);
            push_diff(&mut changes, key, before, tiers);
        }
        for (key, &before) in &self.current {
            if !now.contains_key(key) {
                push_diff(&mut changes, key, before, 0);
            }
        }
        self.remote = now.iter().filter(|(_, &t)| t & TIER_REMOTE != 0).map(|(k, _)| *k).collect();
        self.current = now;
        self.record(changes);
    }

    /// Records what changed: the local tiers of the blocks in `local`, and the remote tiers' keys
    /// (`None`: their indexes did not change since the last refresh). Costs O(changes) when `local`
    /// lists keys, O(remote tiers' keys) when `remote` is given; the ring gets what `update`
    /// with a full snapshot would have given it.
    pub fn apply(&mut self, local: ResidencyChanges, remote: Option<Vec<BlockKey>>) {
        let changed = match local {
            ResidencyChanges::All(mut now) => {
                let remote: HashSet<BlockKey> = remote.map_or_else(|| self.remote.clone(), |k| k.into_iter().collect());
                for key in remote {
                    *now.entry(key).or_insert(0) |= TIER_REMOTE;
                }
                return self.update(now);
            }
            ResidencyChanges::Keys(changed) => changed,
        };
        self.refreshed_at = Some(Instant::now());
        let mut after: HashMap<BlockKey, u8> = HashMap::new();
        if let Some(keys) = remote {
            let mut now = HashSet::with_capacity(keys.len());
            now.extend(keys);
            let local_tiers = |key: &BlockKey| self.current.get(key).map_or(0, |t| t & !TIER_REMOTE);
            after.extend(self.remote.difference(&now).map(|k| (*k, local_tiers(k))));
            after.extend(now.difference(&self.remote).map(|k| (*k, local_tiers(k) | TIER_REMOTE)));
            self.remote = now;
        }
        for (key, local) in changed {
            after.insert(key, local | if self.remote.contains(&key) { TIER_REMOTE } else { 0 });
        }
        let mut changes = Vec::new();
        for (key, tiers) in after {
            let before = if tiers == 0 { self.current.remove(&key) } else { self.current.insert(key, tiers) };
            push_diff(&mut changes, &key, before.unwrap_or(0), tiers);
        }
        self.record(changes);
    }

    fn record(&mut self, mut changes: Vec<Change>) {
        // Removals first: a block that moved from DRAM to NVMe is never reported in neither.
        changes.sort_by_key(|c| !c.removed);
        for change in changes {
            if self.ring.len() == self.capacity {
                self.ring.pop_front();
                self.first += 1;
            }
            self.ring.push_back(change);
        }
    }

    /// The changes from `cursor` on, at most `max` of them; a reset's snapshot is cut at `max`
    /// too (the follower then learns the rest as those blocks change).
    pub fn since(&self, cursor: u64, max: usize) -> ChangesReply {
        let next = self.next_sequence();
        if cursor < self.first || cursor > next {
            let mut keys: Vec<(&BlockKey, &u8)> = self.current.iter().collect();
            keys.sort_unstable_by_key(|(k, _)| k.0);
            let mut changes = Vec::new();
            for (key, &tiers) in keys {
                push_diff(&mut changes, key, 0, tiers);
            }
            // A snapshot larger than `max` is cut: the follower's reset then knows only part of
            // the state until those blocks change again (bounded replies beat a frame too large).
            changes.truncate(max);
            return ChangesReply { reset: true, next, changes };
        }
        let skip = (cursor - self.first) as usize;
        let changes: Vec<Change> = self.ring.iter().skip(skip).take(max).copied().collect();
        ChangesReply { reset: false, next: cursor + changes.len() as u64, changes }
    }

    /// Blocks loadable now, in any tier.
    #[cfg(test)]
    fn blocks(&self) -> usize {
        self.current.len()
    }
}

fn push_diff(changes: &mut Vec<Change>, key: &BlockKey, before: u8, after: u8) {
    for tier in TIERS {
        match (before & tier != 0, after & tier != 0) {
            (false, true) => changes.push(Change { key: *key, tier, removed: false }),
            (true, false) => changes.push(Change { key: *key, tier, removed: true }),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> BlockKey {
        BlockKey([n; 32])
    }

    fn state(entries: &[(u8, u8)]) -> HashMap<BlockKey, u8> {
        entries.iter().map(|&(k, t)| (key(k), t)).collect()
    }

    #[test]
    fn a_follower_gets_the_snapshot_then_exactly_what_changed() {
        let mut log = ChangeLog::new(100);
        log.update(state(&[(1, TIER_DRAM), (2, TIER_DRAM | TIER_NVME)]));
        let first = log.since(0, 100);
        assert!(first.reset);
        assert_eq!(first.changes.len(), 3);
        // Block 1 goes to NVMe only (DRAM evicted), block 2 is trimmed, block 3 arrives.
        log.update(state(&[(1, TIER_NVME), (3, TIER_REMOTE)]));
        let next = log.since(first.next, 100);
        assert!(!next.reset);
        let expected = [
            Change { key: key(1), tier: TIER_DRAM, removed: true },
            Change { key: key(2), tier: TIER_DRAM, removed: true },
            Change { key: key(2), tier: TIER_NVME, removed: true },
            Change { key: key(1), tier: TIER_NVME, removed: false },
            Change { key: key(3), tier: TIER_REMOTE, removed: false },
        ];
        let mut got = next.changes.clone();
        got[..3].sort_by_key(|c| (c.key.0, c.tier));
        got[3..].sort_by_key(|c| (c.key.0, c.tier));
        assert_eq!(got, expected);
        assert_eq!(log.since(next.next, 100).changes, vec![], "nothing more");
    }

    #[test]
    fn a_follower_that_fell_behind_or_comes_from_another_log_gets_a_reset() {
        let mut log = ChangeLog::new(2);
        log.update(state(&[(1, TIER_DRAM)]));
        let cursor = log.since(0, 10).next;
        log.update(state(&[(1, TIER_DRAM), (2, TIER_DRAM), (3, TIER_DRAM), (4, TIER_DRAM)]));
        let behind = log.since(cursor, 10);
        assert!(behind.reset, "three changes happened in a log of two");
        assert_eq!(behind.changes.len(), 4);
        let reborn = ChangeLog::new(2);
        assert!(reborn.since(behind.next + 1_000_000_000, 10).reset, "a cursor past the end is another log's");
    }

    /// A log restarted (service restart, namespace reopened) soon after the last one recorded more
    /// changes than microseconds passed in between: the old cursor is still another log's.
    #[test]
    fn a_cursor_from_a_log_just_replaced_gets_a_reset() {
        let held: HashMap<BlockKey, u8> = (0..20_000u32)
            .map(|n| {
                let mut k = [0u8; 32];
                k[..4].copy_from_slice(&n.to_le_bytes());
                (BlockKey(k), TIER_DRAM | TIER_NVME)
            })
            .collect();
        let mut old = ChangeLog::new(LOG_CAPACITY);
        let mut new = ChangeLog::new(LOG_CAPACITY);
        old.update(held.clone());
        let cursor = old.since(0, 10).next;
        new.update(held);
        let reply = new.since(cursor, LOG_CAPACITY);
        assert!(reply.reset, "an old log's cursor read {} changes of the new log as its own", reply.changes.len());
    }

    /// A refresh from the catalog's tracked keys and the remote tiers' keys (given only when their
    /// indexes changed) keeps the other tiers' bits of a block and tells what a snapshot would.
    #[test]
    fn a_refresh_by_changed_keys_keeps_the_other_tiers() {
        let mut log = ChangeLog::new(100);
        let local = ResidencyChanges::All(state(&[(1, TIER_DRAM), (2, TIER_NVME)]));
        log.apply(local, Some(vec![key(2), key(3)]));
        let cursor = log.since(0, 100).next;
        // Block 1 leaves DRAM for NVMe; the remote tiers are unchanged (`None`): block 2 keeps its bit.
        log.apply(ResidencyChanges::Keys(vec![(key(1), TIER_NVME), (key(2), TIER_DRAM | TIER_NVME)]), None);
        let next = log.since(cursor, 100);
        let mut got = next.changes.clone();
        got.sort_by_key(|c| (!c.removed, c.key.0, c.tier));
        let expected = [
            Change { key: key(1), tier: TIER_DRAM, removed: true },
            Change { key: key(1), tier: TIER_NVME, removed: false },
            Change { key: key(2), tier: TIER_DRAM, removed: false },
        ];
        assert_eq!(got, expected);
        assert!(next.changes[0].removed, "the removal comes first");
        // The remote tiers drop block 3 and gain block 1; block 2 leaves every local tier.
        log.apply(ResidencyChanges::Keys(vec![(key(2), 0)]), Some(vec![key(1), key(2)]));
        let mut got = log.since(next.next, 100).changes;
        got.sort_by_key(|c| (!c.removed, c.key.0, c.tier));
        let expected = [
            Change { key: key(2), tier: TIER_DRAM, removed: true },
            Change { key: key(2), tier: TIER_NVME, removed: true },
            Change { key: key(3), tier: TIER_REMOTE, removed: true },
            Change { key: key(1), tier: TIER_REMOTE, removed: false },
        ];
        assert_eq!(got, expected);
        let mut snapshot = ChangeLog::new(100);
        snapshot.update(state(&[(1, TIER_NVME | TIER_REMOTE), (2, TIER_REMOTE)]));
        assert_eq!(log.since(0, 100).changes, snapshot.since(0, 100).changes);
        assert_eq!(log.blocks(), 2);
    }

    #[test]
    fn replies_are_bounded_and_pages_follow_on() {
        let mut log = ChangeLog::new(100);
        log.update(HashMap::new());
        let cursor = log.since(0, 10).next;
        log.update((0..10).map(|n| (key(n), TIER_DRAM)).collect());
        let page = log.since(cursor, 4);
        assert_eq!(page.changes.len(), 4);
        let rest = log.since(page.next, 100);
        assert_eq!(rest.changes.len(), 6);
        assert!(!rest.reset);
        assert_eq!(log.since(0, 3).changes.len(), 3, "a snapshot is cut at max too");
    }
}
