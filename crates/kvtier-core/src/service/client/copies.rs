//! The copying transfers: a rank's slices of blocks copied between the caller's buffers and the
//! mapped pool (`store_blocks`, `load_blocks`), and `prefetch`, which makes blocks resident without
//! copying them.

use super::{service_error, Attached, Client, ReserveReply};
use crate::error::{Error, Result};
use crate::key::BlockKey;
use crate::mover::BlockBuffer;
use crate::service::gate::CopyGate;
use crate::service::placement::Placement;
use crate::service::protocol::Op;

/// The most a load round asks for: a worker tells a stalled load from a long one by its rounds
/// (`CopyGate::rounds`), so a round must end well within the engine's deadline even on a large pool.
const MAX_LOAD_ROUND_BYTES: usize = 256 << 20;
/// Below this many bytes a load is copied by the calling thread alone: starting threads costs more.
const PARALLEL_COPY_MIN_BYTES: usize = 32 << 20;
/// Most threads one load copies with; a copy is bound by memory bandwidth well before this.
pub const MAX_COPY_THREADS: usize = 8;

/// One block's copy out of the pool: its object there and the caller's segments.
struct SliceCopy<'a> {
    from: *mut u8,
    to: &'a [(*mut u8, usize)],
}

// SAFETY: the pointers cross into scoped copy threads that end before `load_blocks` returns; the
// caller guarantees the destinations are untouched by others during the call, and the pins keep
// the pool slices unchanged.
unsafe impl Send for SliceCopy<'_> {}

impl Client {
    fn check_buffers(&self, keys: &[BlockKey], buffers: &[BlockBuffer]) -> Result<&Attached> {
        let attached = self.attached.as_ref().ok_or_else(|| service_error(&self.socket_path, "say hello first"))?;
        if keys.len() != buffers.len() {
            return Err(Error::config("buffers", format!("{} keys but {} buffers", keys.len(), buffers.len())));
        }
        if let Some(b) = buffers.iter().find(|b| b.total_bytes() != attached.slice_bytes) {
            return Err(Error::config(
                "buffers",
                format!("a buffer holds {} bytes, this rank's slice is {}", b.total_bytes(), attached.slice_bytes),
            ));
        }
        Ok(attached)
    }

    /// Stores this rank's slice of each block: reserve slots, copy into the pool, commit; blocks the
    /// service had no room for yet are reserved again once the others are committed. `true` per
    /// block accepted or already stored. A block is visible once every rank committed its slice.
    ///
    /// # Safety
    /// Every source segment must be valid for reading for the duration of the call.
    pub unsafe fn store_blocks(&mut self, keys: &[BlockKey], sources: &[BlockBuffer]) -> Result<Vec<bool>> {
        self.store_blocks_gated(keys, sources, &CopyGate::new())
    }

    /// `store_blocks` that another thread may give up through `gate` (`CopyGate::cancel`): no copy
    /// from `sources` starts after that, and the slots reserved but not filled are given back.
    ///
    /// # Safety
    /// As `store_blocks`, until the call returns or `gate.cancel()` returned true.
    pub unsafe fn store_blocks_gated(
        &mut self,
        keys: &[BlockKey],
        sources: &[BlockBuffer],
        gate: &CopyGate,
    ) -> Result<Vec<bool>> {
        self.check_buffers(keys, sources)?;
        let mut results = vec![false; keys.len()];
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        // Each round commits at least one block or ends: bounded by the number of blocks.
        while !pending.is_empty() {
            let round: Vec<BlockKey> = pending.iter().map(|&i| keys[i]).collect();
            let retry = self.store_round(&round, &pending, sources, &mut results, gate)?;
            if gate.is_cancelled() {
                break;
            }
            if retry.len() == pending.len() {
                // No progress: the service keeps saying "no room now". Told, it counts the stores
                // as dropped and every rank gives them up (no peer fills a slot this rank won't).
                let given_up: Vec<BlockKey> = retry.iter().map(|&i| keys[i]).collect();
                self.abort(&given_up)?;
                break;
            }
            pending = retry;
        }
        Ok(results)
    }

    /// One reserve / copy / commit round over `indices`; returns the indices to reserve again.
    unsafe fn store_round(
        &mut self,
        keys: &[BlockKey],
        indices: &[usize],
        sources: &[BlockBuffer],
        results: &mut [bool],
        gate: &CopyGate,
    ) -> Result<Vec<usize>> {
        let reservations = self.reserve(keys)?;
        let (mut fills, mut retry) = (Vec::new(), Vec::new()); // fills: (index, key, object offset)
        for ((&key, &i), reservation) in keys.iter().zip(indices).zip(reservations) {
            match reservation {
                ReserveReply::Fill { object_offset } => fills.push((i, key, object_offset)),
                ReserveReply::Present => results[i] = true,
                ReserveReply::Retry => retry.push(i),
                ReserveReply::Dropped => {}
            }
        }
        if fills.is_empty() {
            return Ok(retry);
        }
        let filled: Vec<BlockKey> = fills.iter().map(|&(_, key, _)| key).collect();
        if !gate.enter() {
            // Given up while the reserve was in flight: the engine may reuse the sources already.
            self.abort(&filled)?;
            return Ok(Vec::new());
        }
        let attached = self.attached.as_ref().expect("checked by check_buffers");
        let pool = self.pool.as_ref().expect("mapped at hello");
        for &(i, _, object_offset) in &fills {
            attached.placement.copy(pool.base.add(object_offset), &sources[i].segments, true);
        }
        gate.leave();
        for (&(i, _, _), ok) in fills.iter().zip(self.commit(&filled)?) {
            results[i] = ok;
        }
        Ok(retry)
    }

    /// Loads this rank's slice of each block out of the pool (the service first makes each block
    /// resident and verified, and pins it while this copies). `true` per block loaded.
    ///
    /// Asks for at most a quarter of the pool per round, so that the blocks one round reads from
    /// NVMe are not evicted by its own later reads before they are pinned and copied, and for at
    /// most `MAX_LOAD_ROUND_BYTES`.
    ///
    /// # Safety
    /// Every destination segment must be valid for writing and untouched by others during the call.
    pub unsafe fn load_blocks(&mut self, keys: &[BlockKey], dests: &[BlockBuffer]) -> Result<Vec<bool>> {
        self.load_blocks_gated(keys, dests, &CopyGate::new())
    }

    /// `load_blocks` that another thread may give up through `gate` (`CopyGate::cancel`): no copy
    /// into `dests` starts after that; blocks not copied by then answer `false`.
    ///
    /// # Safety
    /// As `load_blocks`, until the call returns or `gate.cancel()` returned true.
    pub unsafe fn load_blocks_gated(
        &mut self,
        keys: &[BlockKey],
        dests: &[BlockBuffer],
        gate: &CopyGate,
    ) -> Result<Vec<bool>> {
        let attached = self.check_buffers(keys, dests)?.clone();
        let round_blocks = (attached.slot_count / 4).min(MAX_LOAD_ROUND_BYTES / attached.slot_bytes).max(1);
        let mut results = Vec::with_capacity(keys.len());
        for (round_keys, round_dests) in keys.chunks(round_blocks).zip(dests.chunks(round_blocks)) {
            if gate.is_cancelled() {
                break;
            }
            results.extend(self.load_round(&attached, round_keys, round_dests, gate)?);
        }
        results.resize(keys.len(), false);
        Ok(results)
    }

    /// Makes blocks resident in the pool without copying them anywhere: the service reads the ones
    /// on NVMe or in a remote tier into DRAM (verified), then they are released at once. `true`
    /// per block resident afterwards. What an engine's scheduler calls at lookup, so that the
    /// later load is a DRAM copy; in rounds of a quarter of the pool, as `load_blocks`.
    ///
    /// Only the first half pool of `keys` is read (the rest answer `false`, and their load reads
    /// them): a longer prefetch would evict its own first blocks before the load could copy them,
    /// and every block would be read twice.
    pub fn prefetch(&mut self, keys: &[BlockKey]) -> Result<Vec<bool>> {
        let slot_count =
            self.attached.as_ref().ok_or_else(|| service_error(&self.socket_path, "say hello first"))?.slot_count;
        let readable = keys.len().min((slot_count / 2).max(1));
        let mut results = Vec::with_capacity(keys.len());
        for round in keys[..readable].chunks((slot_count / 4).max(1)) {
            results.extend(self.read_ahead_round(round)?);
        }
        results.resize(keys.len(), false);
        Ok(results)
    }

    /// One round of `prefetch`: `Op::ReadAhead`, or on a service without it (an older version 2)
    /// an Acquire and Release of the round, which counts each block as a load of its own.
    fn read_ahead_round(&mut self, round: &[BlockKey]) -> Result<Vec<bool>> {
        let answer = self.call_if_known(Op::ReadAhead, |w| {
            w.keys(round);
        })?;
        match answer {
            Some(body) if body.len() == round.len() => return Ok(body.iter().map(|&b| b != 0).collect()),
            Some(_) => {
                self.stream = None;
                return Err(service_error(&self.socket_path, "short read-ahead reply"));
            }
            None => {}
        }
        let offsets = self.acquire(round)?;
        let acquired: Vec<BlockKey> =
            round.iter().zip(&offsets).filter(|(_, at)| at.is_some()).map(|(key, _)| *key).collect();
        if !acquired.is_empty() {
            self.release(&acquired)?;
        }
        Ok(offsets.iter().map(Option::is_some).collect())
    }

    unsafe fn load_round(
        &mut self,
        attached: &Attached,
        keys: &[BlockKey],
        dests: &[BlockBuffer],
        gate: &CopyGate,
    ) -> Result<Vec<bool>> {
        let offsets = self.acquire(keys)?;
        let pool = self.pool.as_ref().expect("mapped at hello");
        let mut acquired = Vec::new();
        let mut copies = Vec::new();
        for (i, at) in offsets.iter().enumerate() {
            if let Some(at) = *at {
                acquired.push(keys[i]);
                copies.push(SliceCopy { from: pool.base.add(at), to: &dests[i].segments });
            }
        }
        // Given up while the acquire was in flight: the engine may be recomputing into `dests`.
        let copying = copies.is_empty() || gate.enter();
        if copying && !copies.is_empty() {
            copy_slices(copies, &attached.placement, attached.slice_bytes, self.copy_threads);
            gate.leave();
        }
        if !acquired.is_empty() {
            // The copies are done and were pinned while they ran. If the release fails the connection
            // is dropped, and its closing releases the pins in the service.
            let _ = self.release(&acquired);
        }
        Ok(offsets.iter().map(|at| copying && at.is_some()).collect())
    }
}

/// Copies each block's slice out of the pool, on up to `threads` threads (contiguous shares of the
/// blocks, so that each thread streams through its own part of the pool).
///
/// # Safety
/// As `Client::load_blocks`: the destinations are writable and untouched, the sources pinned.
unsafe fn copy_slices(copies: Vec<SliceCopy<'_>>, placement: &Placement, slice_bytes: usize, threads: usize) {
    let copy_one = |copy: &SliceCopy<'_>| placement.copy(copy.from, copy.to, false);
    let threads = if copies.len() * slice_bytes < PARALLEL_COPY_MIN_BYTES { 1 } else { threads.min(copies.len()) };
    if threads <= 1 {
        copies.iter().for_each(copy_one);
        return;
    }
    let share = copies.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let mut shares = copies.chunks(share);
        let mine = shares.next();
        for part in shares {
            let part = SendShare(part);
            scope.spawn(move || part.into_inner().iter().for_each(copy_one));
        }
        mine.into_iter().flatten().for_each(copy_one);
    });
}

/// A share of the copies, handed to a scoped thread.
struct SendShare<'s, 'a>(&'s [SliceCopy<'a>]);

impl<'s, 'a> SendShare<'s, 'a> {
    /// Taken whole by the thread's closure (a closure that named the field would capture only the
    /// field, which is not `Send`).
    fn into_inner(self) -> &'s [SliceCopy<'a>] {
        self.0
    }
}

// SAFETY: see `SliceCopy`.
unsafe impl Send for SendShare<'_, '_> {}
