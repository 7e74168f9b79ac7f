//! A load's remote reads (shared filesystem, object store): their start and their `on_done`, the
//! judging of a finished one, and giving up the reads that stall, whose slots are freed once they
//! finish after all.

use super::landing::{copy_value_out, Landing};
use super::{Completion, Judged, Load, PendingRead, RemoteVerdict};
use crate::catalog::NO_SLOT;
use crate::format::descriptor::{Descriptor, DESCRIPTOR_BYTES};
use crate::io::device::OnDone;
use crate::mover::slot_ref;
use crate::remote_tiers::RemoteRead;
use crate::stats::Stats;
use crate::store_state::StoreState;
use crate::tiers::remote::ReadOutcome;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// A remote read its load gave up, until it finishes.
pub(super) struct GivenUpRead {
    slot: u32,
    read: RemoteRead,
}

/// A load's remote reads it gave up, by key index, shared with their `on_done`s: a read that
/// finishes after its load gave it up goes to the store's `LateReads` (judged by the next load,
/// `settle_late_reads`) instead of to the load. Locked by the load while it gives reads up, so that
/// every completion is either received by the load or finds its read here.
pub(super) type GivenUpReads = Arc<Mutex<HashMap<usize, GivenUpRead>>>;

impl Load<'_> {
    /// The `on_done` of key `i`'s remote read: to the load, or, once the load gave it up, to the
    /// store's late reads.
    fn remote_sender(&mut self, i: usize) -> OnDone {
        let given_up = Arc::clone(self.given_up.get_or_insert_with(Default::default));
        let (tx, late_reads) = (self.done_tx.clone(), Arc::clone(&self.sh.late_reads));
        Box::new(move |io_result| {
            let mut given_up = given_up.lock();
            match given_up.remove(&i) {
                Some(late) => {
                    drop(given_up);
                    late_reads.finished(late.slot, late.read, io_result);
                }
                // Sent under the lock: `give_up_remote_reads` receives it or finds the read in the table.
                None => {
                    let _ = tx.send(Completion { index: i, io_result, landing: Landing::Slot });
                }
            }
        })
    }

    /// Starts the round's remote reads, each on the tier that reads its key (a tier reads adjacent
    /// blocks of its own together). Returns the reads that did not start (misses the tier counted;
    /// their slots are still ours).
    pub(super) fn submit_remote_reads(&mut self, reads: Vec<(usize, u32)>) -> Vec<(usize, u32)> {
        let sh = self.sh;
        let mut requests = Vec::with_capacity(reads.len());
        for &(i, slot) in &reads {
            requests.push((self.keys[i], sh.arena.slot_ptr(slot), self.remote_sender(i)));
        }
        // SAFETY: each slot is ours (Loading) until its read is settled; an abandoned one is retired,
        // a given-up one freed once its read finished.
        let started = unsafe { sh.remote.start_reads(requests, self.probe) };
        let mut not_started = Vec::new();
        for ((i, slot), read) in reads.into_iter().zip(started) {
            match read {
                Some(read) => self.track(i, PendingRead::Remote { slot, read }),
                None => not_started.push((i, slot)),
            }
        }
        not_started
    }

    /// No remote read finished within the stall limit (a frozen gateway or FUSE daemon): every
    /// remote read still in flight is a counted miss now, its catalog entry gone and its slot kept
    /// out of use until the read finishes. Reads that finished meanwhile are judged as usual.
    pub(super) fn give_up_remote_reads(&mut self) {
        let (sh, stalled) = (self.sh, self.remote_progress.elapsed());
        let table = Arc::clone(self.given_up.as_ref().expect("remote reads in flight have a table"));
        let mut table = table.lock();
        let arrived: Vec<Completion> = self.done_rx.try_iter().collect();
        let stalled_keys: Vec<usize> = (0..self.pending.len())
            .filter(|&i| matches!(self.pending[i], Some(PendingRead::Remote { .. })))
            .filter(|&i| !arrived.iter().any(|done| done.index == i))
            .collect();
        let mut cat = sh.catalog.lock();
        for &i in &stalled_keys {
            let Some(PendingRead::Remote { slot, read }) = self.pending[i].take() else { unreachable!() };
            cat.give_up_get_remote(&self.keys[i], slot);
            sh.late_reads.given_up();
            table.insert(i, GivenUpRead { slot, read });
        }
        drop(cat);
        for i in &stalled_keys {
            sh.remote.give_up(&table[i].read, stalled);
        }
        drop(table);
        sh.changed.notify_all();
        log::debug!("kvtier: gave up {} remote reads after {stalled:?} without any finishing", stalled_keys.len());
        assert!(stalled_keys.len() <= self.remote_reads_in_flight, "more reads given up than were in flight");
        debug_assert!(self.remote_reads_in_flight <= self.reads_in_flight);
        self.reads_in_flight -= stalled_keys.len();
        self.remote_reads_in_flight -= stalled_keys.len();
        for i in stalled_keys {
            self.tally(i, Judged::Remote { slot: NO_SLOT, verdict: RemoteVerdict::GivenUp });
        }
        self.judge_and_settle(arrived);
    }

    /// A remote read the tier judged (it counted and quarantined): a hit is copied out.
    pub(super) fn judge_remote(&self, i: usize, slot: u32, outcome: ReadOutcome) -> RemoteVerdict {
        match outcome {
            ReadOutcome::Hit => {}
            ReadOutcome::Miss => return RemoteVerdict::Miss,
            ReadOutcome::Abandoned => return RemoteVerdict::Abandoned,
        }
        let (sh, key) = (self.sh, &self.keys[i]);
        // The tier verified the block; the checksum is taken before anything counts it a hit.
        // SAFETY: the read into our slot finished.
        let desc = match Descriptor::decode(&unsafe { slot_ref(sh, slot) }[..DESCRIPTOR_BYTES]) {
            Ok(desc) => desc,
            Err(e) => {
                log::error!(
                    "kvtier: remote block {key:?} passed verification but its descriptor does not decode ({e}); a miss"
                );
                Stats::add(&sh.stats.checksum_failures, 1);
                return RemoteVerdict::Miss;
            }
        };
        if let Some(bufs) = self.bufs {
            copy_value_out(sh, slot, &bufs[i]);
        }
        RemoteVerdict::Loaded { value_checksum: desc.value_checksum }
    }
}

/// Judges the remote reads that finished after their loads gave them up, and frees their slots.
pub(super) fn settle_late_reads(sh: &StoreState) {
    let late = sh.late_reads.take_finished();
    if late.is_empty() {
        return;
    }
    let mut freed = Vec::with_capacity(late.len());
    for (slot, read, io_result) in late {
        // SAFETY: the read into the slot finished; the slot is retired, used by nothing else.
        let outcome = unsafe { sh.remote.finish_late(read, sh.arena.slot_ptr(slot), io_result) };
        freed.push((slot, outcome == ReadOutcome::Abandoned));
    }
    let mut cat = sh.catalog.lock();
    for (slot, abandoned) in freed {
        cat.finish_given_up_read(slot, abandoned);
    }
    drop(cat);
    sh.changed.notify_all();
}
