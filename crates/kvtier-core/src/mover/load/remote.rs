//! A load's remote reads (shared filesystem, object store): their start, the judging of a finished
//! one, and giving up the reads that stall (whose slots are freed once they finish after all,
//! `late.rs`).

use super::landing::{copy_value_out, Landing};
use super::late::GivenUpRead;
use super::{Completion, Judged, Load, PendingRead, RemoteVerdict};
use crate::catalog::NO_SLOT;
use crate::format::descriptor::{Descriptor, DESCRIPTOR_BYTES};
use crate::mover::slot_ref;
use crate::stats::Stats;
use crate::store_state::LateRead;
use crate::tiers::remote::ReadOutcome;
use std::sync::Arc;

impl Load<'_> {
    /// Starts the round's remote reads, each on the tier that reads its key (a tier reads adjacent
    /// blocks of its own together). Returns the reads that did not start (misses the tier counted;
    /// their slots are still ours).
    pub(super) fn submit_remote_reads(&mut self, reads: Vec<(usize, u32)>) -> Vec<(usize, u32)> {
        let sh = self.sh;
        let mut requests = Vec::with_capacity(reads.len());
        for &(i, slot) in &reads {
            requests.push((self.keys[i], sh.arena.slot_ptr(slot), self.sender(i, Landing::Slot)));
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
            table.insert(i, GivenUpRead { slot, read: LateRead::Remote(read) });
        }
        drop(cat);
        for i in &stalled_keys {
            let LateRead::Remote(read) = &table[i].read else { unreachable!("a remote read given up") };
            sh.remote.give_up(read, stalled);
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
