//! One engine connection's session and the lease protocol it follows (reserve, commit, abort).
//!
//! Leases: everything a connection takes (pins, reserved slots) is recorded with the connection and
//! given back when it closes, however it closed: an engine killed with SIGKILL loses its socket, and
//! the kernel closing it is the lease expiring; a connection thread that panics gives it back too
//! (`Session`'s `Drop`). A reserved slot is freed only once no connection holds it any more, so an
//! aborted fill can never be reused while a live writer still copies in.
//!
//! A live connection's reservations also have a deadline (`reservation_timeout_ms`): a rank hung in
//! a collective, or on an event that never fires, must not keep its slots' share of the write
//! backlog and starve every other engine's stores and flushes. Past the deadline the fill is
//! abandoned: the block and its backlog share are given back at once, and every rank's commit of
//! it is refused, so a half-written block is never visible. The slot itself is not: the hung
//! writer may wake up and copy into it later (its copy was queued behind an event, or its process
//! was stopped), and the service cannot take a mapping back. Reused for another block, that slot
//! would serve the late bytes under the other block's key, and a DRAM hit is not verified again.
//! So the slot stays out of use, keyless, until every connection that held the fill has let go of
//! it (commit, abort or close), which is the existing rule for a slot's last writer. A late commit
//! is matched by the fill's sequence, never by its key alone: the key may be filled again by then.
//!
//! Apart from the dispatch (`server.rs`) and the namespace table (`namespaces.rs`): these rules
//! are the service's correctness argument, and read best together.

use super::engines::EngineCounters;
use super::fills::{DroppedKeys, Expired, Fill, Fills, Joined, Outcome};
use super::namespaces::Namespaced;
use super::protocol::*;
use super::server::ServiceConfig;
use crate::error::Result;
use crate::key::BlockKey;
use crate::mover::Reservation;
use crate::store::Store;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The store calls that connections letting go of fills lead to, made outside the fills lock.
#[derive(Default)]
struct StoreSteps {
    complete: Vec<(BlockKey, u32, u64)>,
    give_back: Vec<(BlockKey, u32)>,
    free_abandoned: Vec<u32>,
}

impl StoreSteps {
    fn add(&mut self, key: BlockKey, outcome: Outcome) {
        match outcome {
            Outcome::Complete { slot, sequence } => self.complete.push((key, slot, sequence)),
            Outcome::GiveBack { slot } => self.give_back.push((key, slot)),
            Outcome::FreeAbandoned { slot } => self.free_abandoned.push(slot),
            Outcome::Pending | Outcome::Gone => {}
        }
    }

    fn apply(self, store: &Store) -> Result<()> {
        if !self.give_back.is_empty() {
            store.abort_puts(&self.give_back);
        }
        if !self.free_abandoned.is_empty() {
            store.free_abandoned_slots(&self.free_abandoned);
        }
        if !self.complete.is_empty() {
            store.commit_puts(&self.complete)?;
        }
        Ok(())
    }
}

/// One engine connection's state: the namespace it said hello to and what it holds.
pub(super) struct Session {
    pub(super) ns: Arc<Namespaced>,
    rank: u32,
    tp_size: u32,
    /// Pins taken by `Pin`, per key (the block stays loadable).
    pub(super) pins: HashMap<BlockKey, u32>,
    /// Pins `expire_pins` let go of, per key: the engine still believes it holds them, and its
    /// unpin of one must not take a pin taken since (another request's on the same block).
    expired_pins: HashMap<BlockKey, u32>,
    /// Slots handed out by `Acquire`, per key (the slot stays until `Release`).
    readers: HashMap<BlockKey, u32>,
    /// Fills this connection reserved and has not committed or aborted: `(key, sequence)`.
    reserved: Vec<(BlockKey, u64)>,
    /// The engine this connection works for (`Op::Label`), for the per-engine counters.
    pub(super) label: Option<String>,
}

impl Session {
    /// A connection's session on `ns` after its hello, holding nothing yet.
    pub(super) fn new(ns: Arc<Namespaced>, rank: u32, tp_size: u32) -> Session {
        assert!(rank < tp_size && tp_size <= 64, "hello checked rank {rank} of {tp_size}");
        Session {
            ns,
            rank,
            tp_size,
            pins: HashMap::new(),
            expired_pins: HashMap::new(),
            readers: HashMap::new(),
            reserved: Vec::new(),
            label: None,
        }
    }

    /// `Op::Acquire`: pins each block found for this connection until `Release`, and answers its slot.
    pub(super) fn acquire(&mut self, keys: &[BlockKey], w: &mut Writer) -> std::result::Result<(), String> {
        let slots = self.ns.store.acquire(keys).map_err(|e| e.to_string())?;
        debug_assert_eq!(slots.len(), keys.len(), "one slot or none per key");
        let mut loaded = 0;
        for (key, slot) in keys.iter().zip(slots) {
            if slot.is_some() {
                *self.readers.entry(*key).or_default() += 1;
                loaded += 1;
            }
            w.u32(slot.unwrap_or(NO_SLOT));
        }
        debug_assert!(loaded <= keys.len() as u64);
        self.ns.held_reads.fetch_add(loaded, Ordering::Relaxed);
        self.count(|c| {
            c.loaded_slices += loaded;
            c.load_missed_slices += keys.len() as u64 - loaded;
        });
        Ok(())
    }

    /// `Op::Pin`: pins the leading present blocks of `keys` for this connection until `Unpin`
    /// (`Store::pin_prefix`: one flag per present key, `false` for a remote-only one).
    pub(super) fn pin(&mut self, keys: &[BlockKey]) -> Vec<bool> {
        let flags = self.ns.store.pin_prefix(keys);
        for (key, _) in keys.iter().zip(&flags).filter(|(_, &pinned)| pinned) {
            *self.pins.entry(*key).or_default() += 1;
        }
        let pinned = flags.iter().filter(|&&pinned| pinned).count() as u64;
        self.ns.held_pins.fetch_add(pinned, Ordering::Relaxed);
        flags
    }

    /// Lets go of every pin this connection holds: it has sent nothing for `lease_ms`, longer than
    /// a running engine holds one (an engine that froze holding them). Its blocks may be evicted
    /// again; a later load of one that went is a miss.
    pub(super) fn expire_pins(&mut self, lease_ms: u64) {
        let pinned = drain_held(&mut self.pins);
        if pinned.is_empty() {
            return;
        }
        self.unpin_held(&pinned);
        for key in &pinned {
            *self.expired_pins.entry(*key).or_default() += 1;
        }
        self.ns.expired_pins.fetch_add(pinned.len() as u64, Ordering::Relaxed);
        log::warn!(
            "kvtier: a connection{} held {} pin(s) and sent nothing for pin_lease_ms={lease_ms} (its engine \
             frozen or stuck?); let go, so that other engines' stores may evict those blocks again",
            self.label.as_deref().map(|label| format!(" of engine {label}")).unwrap_or_default(),
            pinned.len()
        );
    }

    pub(super) fn unpin(&mut self, keys: &[BlockKey]) {
        let live: Vec<BlockKey> = if self.expired_pins.is_empty() {
            keys.to_vec()
        } else {
            // An unpin of a key whose pin expired ends that pin (already let go).
            keys.iter()
                .filter(|key| take_held(&mut self.expired_pins, std::slice::from_ref(*key)).is_empty())
                .copied()
                .collect()
        };
        let held = take_held(&mut self.pins, &live);
        self.unpin_held(&held);
    }

    /// Unpins holds already taken off `pins`.
    fn unpin_held(&self, held: &[BlockKey]) {
        if !held.is_empty() {
            // Off the gauge first: the holds are off the map already, whatever the store does.
            let before = self.ns.held_pins.fetch_sub(held.len() as u64, Ordering::Relaxed);
            debug_assert!(before >= held.len() as u64, "more pins let go than held");
            self.ns.store.unpin(held);
        }
    }

    /// Releases load slots already taken off `readers`.
    fn release_held(&self, held: &[BlockKey]) {
        if !held.is_empty() {
            // Off the gauge first: the holds are off the map already, whatever the store does.
            let before = self.ns.held_reads.fetch_sub(held.len() as u64, Ordering::Relaxed);
            debug_assert!(before >= held.len() as u64, "more load slots released than held");
            self.ns.store.release(held);
        }
    }

    /// Adds to this connection's engine's counters (nothing for an unlabelled connection).
    pub(super) fn count(&self, update: impl FnOnce(&mut EngineCounters)) {
        if let Some(label) = &self.label {
            self.ns.engines.lock().record(label, update);
        }
    }

    pub(super) fn release_readers(&mut self, keys: &[BlockKey]) {
        let held = take_held(&mut self.readers, keys);
        self.release_held(&held);
    }

    /// Per key `(kind, slot)` (`ReserveKind`): fill this slot, present, dropped, or no room now:
    /// fill and commit what you got, then reserve these again.
    ///
    /// A block another rank reserved is taken at once (its slot exists). A new block needs room in
    /// the NVMe write backlog. When there is none, a connection that holds reservations it has not
    /// committed gets "no room now" (its own commits are what frees room: waiting would deadlock on
    /// itself); one that holds none waits like a local put (at most `slot_wait_ms`) for other ranks'
    /// commits or for NVMe writes to drain, without holding the fills lock. New fills past the
    /// connection's `reservation_cap` get "no room now" too (`within_cap`). A block one rank gave
    /// up is given up by every rank (`dropped`), so no rank fills a slot the others will never
    /// complete.
    pub(super) fn reserve(&mut self, keys: &[BlockKey]) -> Result<Vec<(ReserveKind, u32)>> {
        let ns = Arc::clone(&self.ns);
        let deadline = Instant::now() + Duration::from_millis(ns.store.slot_wait_ms());
        let mut out: Vec<Option<(ReserveKind, u32)>> = vec![None; keys.len()];
        loop {
            let mut fills = ns.fills.lock();
            let mut dropped = ns.dropped.lock();
            let fresh = self.fresh_keys(keys, &mut out, &fills, &dropped);
            let fresh = self.within_cap(keys, fresh, &mut out);
            let mut reserved: HashMap<BlockKey, Reservation> =
                fresh.iter().copied().zip(ns.store.try_reserve_puts(&fresh)?).collect();
            let mut short_of_room = false;
            for (key, decided) in keys.iter().zip(out.iter_mut()) {
                if decided.is_some() {
                    continue;
                }
                match reserved.remove(key) {
                    Some(Reservation::Fill { slot, sequence }) => {
                        fills.open(*key, Fill::new(slot, sequence, self.tp_size, Instant::now()));
                    }
                    Some(Reservation::Present) => {
                        *decided = Some((ReserveKind::Present, NO_SLOT));
                        continue;
                    }
                    Some(Reservation::Dropped) => {
                        short_of_room = true;
                        continue;
                    }
                    None => {}
                }
                *decided = self.join(&mut fills, key);
            }
            // On a hung disk no NVMe write finishes to make room: given up now, not at the deadline.
            let out_of_time = Instant::now() >= deadline || ns.store.nvme_hung();
            if short_of_room && out_of_time {
                give_up(keys, &mut out, &fills, &mut dropped);
            }
            drop((fills, dropped));
            if !short_of_room || out_of_time {
                break;
            }
            if !self.reserved.is_empty() {
                // Its own commits free room: the client fills and commits, then asks again.
                for decided in out.iter_mut().filter(|d| d.is_none()) {
                    *decided = Some((ReserveKind::Retry, NO_SLOT));
                }
                break;
            }
            // Whether or not room came, one more pass decides (joins a fill another rank made).
            ns.store.wait_for_put_room_until(deadline);
        }
        let out: Vec<(ReserveKind, u32)> =
            out.into_iter().map(|d| d.unwrap_or((ReserveKind::Dropped, NO_SLOT))).collect();
        debug_assert_eq!(out.len(), keys.len(), "one reply per key");
        debug_assert!(out.iter().all(|&(kind, slot)| (kind == ReserveKind::Fill) == (slot != NO_SLOT)));
        let dropped = out.iter().filter(|(kind, _)| *kind == ReserveKind::Dropped).count();
        ns.store.count_dropped_stores(dropped as u64);
        if out.iter().any(|(kind, _)| *kind == ReserveKind::Present) {
            ns.store.write_reused(); // a store of a held block is a use
        }
        Ok(out)
    }

    /// The keys of this pass that need a new fill: not decided, not being filled, not repeated;
    /// a key given up recently is decided dropped here.
    fn fresh_keys(
        &self,
        keys: &[BlockKey],
        out: &mut [Option<(ReserveKind, u32)>],
        fills: &Fills,
        dropped: &DroppedKeys,
    ) -> Vec<BlockKey> {
        let mut seen = std::collections::HashSet::new();
        let mut fresh = Vec::new();
        for (key, decided) in keys.iter().zip(out.iter_mut()) {
            if decided.is_some() || fills.is_open(key) || !seen.insert(*key) {
                continue;
            }
            if dropped.contains(key) {
                *decided = Some((ReserveKind::Dropped, NO_SLOT));
            } else {
                fresh.push(*key);
            }
        }
        fresh
    }

    /// Keeps what this connection holds within `Namespaced::reservation_cap`: the undecided keys
    /// (new fills, and other ranks' fills to join) past its room, in order, are answered "no room
    /// now", to be asked for again once it committed; the rest of `fresh` is returned. Joins count:
    /// a rank that lags behind its peers would otherwise join every fill they opened meanwhile.
    fn within_cap(
        &self,
        keys: &[BlockKey],
        fresh: Vec<BlockKey>,
        out: &mut [Option<(ReserveKind, u32)>],
    ) -> Vec<BlockKey> {
        let mut room = self.ns.reservation_cap.saturating_sub(self.reserved.len());
        // Counted with repeats, the undecided keys are at least the distinct ones: within the room,
        // none is over it (the common call: no set to build).
        if out.iter().filter(|decided| decided.is_none()).count() <= room {
            return fresh;
        }
        let (mut seen, mut over) = (std::collections::HashSet::new(), std::collections::HashSet::new());
        for (key, decided) in keys.iter().zip(out.iter()) {
            if decided.is_some() || !seen.insert(*key) {
                continue;
            }
            if room == 0 {
                over.insert(*key);
            } else {
                room -= 1;
            }
        }
        if over.is_empty() {
            return fresh;
        }
        for (key, decided) in keys.iter().zip(out.iter_mut()) {
            if decided.is_none() && over.contains(key) {
                *decided = Some((ReserveKind::Retry, NO_SLOT));
            }
        }
        self.ns.capped_reserves.fetch_add(over.len() as u64, Ordering::Relaxed);
        fresh.into_iter().filter(|key| !over.contains(key)).collect()
    }

    /// This rank's share of an existing fill, if it may take one.
    fn join(&mut self, fills: &mut Fills, key: &BlockKey) -> Option<(ReserveKind, u32)> {
        let joined = fills.join(key, self.rank, self.tp_size)?;
        if let Joined::Fill { sequence, .. } = joined {
            debug_assert!(!self.reserved.contains(&(*key, sequence)), "a fill joined twice by one connection");
            self.reserved.push((*key, sequence));
        }
        Some(joined.reply())
    }

    /// This rank's slices of `keys` are in their slots: per key, whether the commit counts. A key
    /// whose fill was given up meanwhile (another rank aborted it, or it expired) is refused.
    pub(super) fn commit(&mut self, keys: &[BlockKey]) -> Result<Vec<bool>> {
        let accepted = self.let_go(keys, true)?;
        let refused = accepted.iter().filter(|&&ok| !ok).count() as u64;
        self.ns.refused_commits.fetch_add(refused, Ordering::Relaxed);
        Ok(accepted)
    }

    /// Gives up `keys`: the fills this connection holds, and the stores of the others (a rank that
    /// found no room for them), for every rank.
    pub(super) fn abort(&mut self, keys: &[BlockKey]) {
        let held: std::collections::HashSet<BlockKey> = self.reserved.iter().map(|(key, _)| *key).collect();
        let unheld: Vec<BlockKey> = keys.iter().filter(|key| !held.contains(key)).copied().collect();
        // Aborts only give back: no store call that can fail.
        let _ = self.let_go(keys, false);
        if !unheld.is_empty() {
            self.give_up(&unheld);
        }
    }

    /// Ends every reservation this connection holds of each of `keys`, committing this rank's slice
    /// or not; per key, whether a commit counted.
    fn let_go(&mut self, keys: &[BlockKey], commit: bool) -> Result<Vec<bool>> {
        let committed = commit.then_some(1u64 << self.rank);
        let mut steps = StoreSteps::default();
        let mut accepted = Vec::with_capacity(keys.len());
        {
            let mut fills = self.ns.fills.lock();
            for key in keys {
                let mut counted = false;
                self.reserved.retain(|(held, sequence)| {
                    if held != key {
                        return true;
                    }
                    let (ok, outcome) = fills.let_go(key, *sequence, committed);
                    counted |= ok;
                    steps.add(*key, outcome);
                    false
                });
                accepted.push(counted);
            }
        }
        debug_assert_eq!(accepted.len(), keys.len());
        steps.apply(&self.ns.store)?;
        Ok(accepted)
    }

    /// Stores this rank gives up without holding them (a client that got no room): counted as
    /// dropped, and given up by every rank, as `reserve` does when it runs out of time.
    fn give_up(&mut self, keys: &[BlockKey]) {
        let (mut give_back, mut counted) = (Vec::new(), 0u64);
        {
            let mut fills = self.ns.fills.lock();
            let mut dropped = self.ns.dropped.lock();
            for key in keys {
                dropped.insert(*key);
                match fills.give_up_unheld(key, self.rank, self.tp_size) {
                    (true, Some(slot)) => give_back.push((*key, slot)),
                    (true, None) => {}
                    (false, _) => counted += 1,
                }
            }
        }
        self.ns.store.count_dropped_stores(counted);
        if !give_back.is_empty() {
            self.ns.store.abort_puts(&give_back);
        }
        self.count(|c| c.dropped_slices += keys.len() as u64);
    }
}

/// A connection's holds end with it, however it ended: closed, said hello again, or its thread
/// panicked (the unwinding drops the session).
impl Drop for Session {
    fn drop(&mut self) {
        let reserved: Vec<BlockKey> = self.reserved.iter().map(|(key, _)| *key).collect();
        // Gives back only: `let_go` without commits makes no store call that can fail.
        let _ = self.let_go(&reserved, false);
        let pinned = drain_held(&mut self.pins);
        self.unpin_held(&pinned);
        let read = drain_held(&mut self.readers);
        self.release_held(&read);
        // The date first: the janitor reads `attached` before it, and must not see a stale date.
        *self.ns.detached_at.lock() = Instant::now();
        let before = self.ns.attached.fetch_sub(1, Ordering::Relaxed);
        debug_assert!(before > 0, "a session left a namespace it was not counted in");
    }
}

/// The wait for room ran out: the undecided keys are given up, for every rank (a rank that comes
/// later drops them at once). Also when this pass reserved others of the batch: a key reported
/// dropped but left out of `dropped` lets a peer rank open a fill this rank never commits. A new
/// block the cap held back would find no room either: asked again, it would wait `slot_wait_ms`
/// once more, a round at a time. Joins it held back take no room and stay "no room now".
fn give_up(keys: &[BlockKey], out: &mut [Option<(ReserveKind, u32)>], fills: &Fills, dropped: &mut DroppedKeys) {
    debug_assert_eq!(keys.len(), out.len(), "one answer per key");
    for (key, decided) in keys.iter().zip(out.iter_mut()) {
        let capped_new = *decided == Some((ReserveKind::Retry, NO_SLOT)) && !fills.is_open(key);
        if decided.is_none() || capped_new {
            dropped.insert(*key);
            *decided = Some((ReserveKind::Dropped, NO_SLOT));
        }
    }
}

/// The keys of `keys` this connection holds in `held`, each taken off once (a key it does not hold
/// is ignored: releasing it would take away another connection's hold).
fn take_held(held: &mut HashMap<BlockKey, u32>, keys: &[BlockKey]) -> Vec<BlockKey> {
    let mut taken = Vec::new();
    for key in keys {
        if let Some(count) = held.get_mut(key) {
            assert!(*count > 0, "a held key's count is removed at zero");
            *count -= 1;
            if *count == 0 {
                held.remove(key);
            }
            taken.push(*key);
        }
    }
    taken
}

/// Every hold in `held`, once per count (the connection closed).
fn drain_held(held: &mut HashMap<BlockKey, u32>) -> Vec<BlockKey> {
    held.drain().flat_map(|(key, count)| std::iter::repeat_n(key, count as usize)).collect()
}

/// Gives back the fills no connection holds that waited `fill_timeout_ms` for a rank that never
/// came, and abandons those live connections have held past `reservation_timeout_ms`.
pub(super) fn expire_fills(ns: &Namespaced, config: &ServiceConfig) {
    let unheld_limit = Duration::from_millis(config.fill_timeout_ms);
    let held_limit = (config.reservation_timeout_ms > 0).then(|| Duration::from_millis(config.reservation_timeout_ms));
    let Expired { stale, abandoned: expired } = {
        let found = ns.fills.lock().expire(Instant::now(), unheld_limit, held_limit);
        // A rank that reserves the block later gives it up too, rather than open a new fill that
        // the hung rank will not complete either.
        let mut dropped = ns.dropped.lock();
        for (key, _) in &found.abandoned {
            dropped.insert(*key);
        }
        found
    };
    if !stale.is_empty() {
        log::warn!("kvtier: {} stores waited {unheld_limit:?} for a rank that never came; dropped", stale.len());
        ns.store.abort_puts(&stale);
    }
    if !expired.is_empty() {
        log::warn!(
            "kvtier: {} stores were not committed by every rank within reservation_timeout_ms={} (a rank hung \
             between reserving and committing); dropped, their slots kept out of use until the rank lets go",
            expired.len(),
            config.reservation_timeout_ms
        );
        ns.expired_fills.fetch_add(expired.len() as u64, Ordering::Relaxed);
        ns.store.abandon_puts(&expired);
    }
}
