//! Reads a load stopped waiting for: remote reads stalled on a frozen gateway or mount, NVMe reads
//! on a hung disk. Each read's `on_done` goes to its load until the load gives it up, and to the
//! store's `LateReads` after; the next load (or the prober) then judges it and frees its slot. Until
//! then the slot, or the heap buffer its I/O operation owns, is kept out of use: the kernel may still
//! write into it.

use super::landing::Landing;
use super::{Completion, Judged, Load, PendingRead};
use crate::catalog::{LoadOutcome, NvmeRead, NO_SLOT};
use crate::io::device::{is_abandoned, OnDone};
use crate::store_state::{LateRead, StoreState};
use crate::tiers::remote::ReadOutcome;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How many stall limits a load waits for its own NVMe reads while the devices answer other
/// operations (other loads' reads ahead of its own on a slow disk, or writes while reads hang).
const NVME_WAIT_CAP: u32 = 10;

/// A read its load gave up, until it finishes.
pub(super) struct GivenUpRead {
    /// The DRAM slot it reads into; `NO_SLOT` for an NVMe read staged in a heap buffer.
    pub(super) slot: u32,
    pub(super) read: LateRead,
}

/// A load's reads it gave up, by key index, shared with their `on_done`s: a read that finishes
/// after its load gave it up goes to the store's `LateReads` instead of to the load. Locked by the
/// load while it gives reads up, so that every completion is either received by the load or finds
/// its read here.
pub(super) type GivenUpReads = Arc<Mutex<HashMap<usize, GivenUpRead>>>;

impl Load<'_> {
    /// The `on_done` of key `i`'s read, landing in `landing`: to the load, or, once the load gave it
    /// up, to the store's late reads (a heap buffer the kernel may still write into is never freed).
    pub(super) fn sender(&mut self, i: usize, landing: Landing) -> OnDone {
        let given_up = Arc::clone(self.given_up.get_or_insert_with(Default::default));
        let (tx, late_reads) = (self.done_tx.clone(), Arc::clone(&self.sh.late_reads));
        Box::new(move |io_result| {
            let mut given_up = given_up.lock();
            match given_up.remove(&i) {
                Some(late) => {
                    drop(given_up);
                    if io_result.as_ref().is_err_and(is_abandoned) {
                        landing.abandon();
                    }
                    late_reads.finished(late.slot, late.read, io_result);
                }
                // Sent under the lock: a load giving reads up receives it or finds the read in the table.
                None => {
                    let _ = tx.send(Completion { index: i, io_result, landing });
                }
            }
        })
    }

    /// Whether key `i`'s NVMe read lands in the caller's memory (`Landing::Direct`): such a read is
    /// never given up, since the disk could write into that memory after the caller reused it.
    pub(super) fn lands_direct(&self, i: usize, read: &NvmeRead) -> bool {
        read.slot == NO_SLOT && self.direct(i)
    }

    /// When the NVMe reads in flight are given up if none finishes first: once the devices answered
    /// nothing for `nvme_read_stall_ms`, or this load's reads nothing for `NVME_WAIT_CAP` times that
    /// (a disk that answers writes while its reads hang); `None` with none that may be given up in
    /// flight, or no limit.
    pub(super) fn nvme_stall_deadline(&self) -> Option<Instant> {
        let limit = Duration::from_millis(self.sh.config.nvme_read_stall_ms);
        (!limit.is_zero() && self.nvme_reads_in_flight > 0)
            .then(|| (self.nvme_device_progress + limit).min(self.nvme_progress + limit * NVME_WAIT_CAP))
    }

    /// Whether this load's NVMe reads went unanswered for the cap, whatever the devices answered.
    pub(super) fn nvme_waited_out(&self) -> bool {
        self.nvme_progress.elapsed() >= Duration::from_millis(self.sh.config.nvme_read_stall_ms) * NVME_WAIT_CAP
    }

    /// Whether the NVMe devices answered an operation (any load's, any write) since the last look;
    /// looked at once per stall limit, so a disk that answers nothing ends the wait.
    pub(super) fn nvme_devices_answered(&mut self) -> bool {
        let answers: u64 = self.sh.devices.iter().map(crate::io::device::DeviceQueue::answers).sum();
        let answered = answers != self.nvme_answers_seen;
        self.nvme_answers_seen = answers;
        answered
    }

    /// No NVMe read finished within `nvme_read_stall_ms` (a hung disk): every NVMe read in flight
    /// that does not land in the caller's memory is a counted miss now, its block kept on NVMe, its
    /// slot out of use until the read finishes, and the NVMe tier steps aside until one does.
    /// Reads that finished meanwhile are judged as usual.
    pub(super) fn give_up_nvme_reads(&mut self) {
        let (sh, stalled) = (self.sh, self.nvme_progress.elapsed());
        let table = Arc::clone(self.given_up.as_ref().expect("NVMe reads in flight have a table"));
        let mut table = table.lock();
        let arrived: Vec<Completion> = self.done_rx.try_iter().collect();
        let stalled_keys: Vec<usize> = (0..self.pending.len())
            .filter(|&i| matches!(&self.pending[i], Some(PendingRead::Nvme(read)) if !self.lands_direct(i, read)))
            .filter(|&i| !arrived.iter().any(|done| done.index == i))
            .collect();
        let mut given_up: Vec<(usize, NvmeRead)> = Vec::with_capacity(stalled_keys.len());
        let mut cat = sh.catalog.lock();
        for i in stalled_keys {
            let Some(PendingRead::Nvme(read)) = self.pending[i].take() else { unreachable!() };
            cat.give_up_get_nvme(&self.keys[i], &read);
            sh.late_reads.given_up();
            let probe = self.nvme_probe.take_if(|&mut probe| probe == i).is_some();
            table.insert(i, GivenUpRead { slot: read.slot, read: LateRead::Nvme { probe } });
            given_up.push((i, read));
        }
        drop(cat);
        if !given_up.is_empty() {
            // Before the table lets their `on_done`s go: one that finishes at once is then already
            // counted among the hung reads it ends.
            sh.nvme_health.gave_up(given_up.len(), stalled);
        }
        drop(table);
        sh.changed.notify_all();
        log::debug!("kvtier: gave up {} NVMe reads after {stalled:?} without any finishing", given_up.len());
        self.count_given_up_nvme(&given_up);
        for (i, read) in given_up {
            self.tally(i, Judged::Nvme(read, LoadOutcome::IoError));
        }
        self.judge_and_settle(arrived);
    }

    /// Takes given-up NVMe reads off the load's reads in flight.
    fn count_given_up_nvme(&mut self, given_up: &[(usize, NvmeRead)]) {
        let staged = given_up.iter().filter(|(_, read)| read.slot == NO_SLOT).count();
        assert!(given_up.len() <= self.nvme_reads_in_flight, "more NVMe reads given up than were in flight");
        assert!(staged <= self.staged_reads_in_flight, "more staged reads given up than were in flight");
        self.reads_in_flight -= given_up.len();
        self.nvme_reads_in_flight -= given_up.len();
        self.staged_reads_in_flight -= staged;
    }
}

/// Judges the reads that finished after their loads gave them up, and frees their slots.
pub(super) fn settle_late_reads(sh: &StoreState) {
    let late = sh.late_reads.take_finished();
    if late.is_empty() {
        return;
    }
    let mut freed = Vec::with_capacity(late.len());
    for (slot, read, io_result) in late {
        let abandoned = match read {
            LateRead::Remote(read) => {
                // SAFETY: the read into the slot finished; the slot is retired, used by nothing else.
                let outcome = unsafe { sh.remote.finish_late(read, sh.arena.slot_ptr(slot), io_result) };
                outcome == ReadOutcome::Abandoned
            }
            LateRead::Nvme { probe } => {
                sh.nvme_health.finished_late(probe, &io_result);
                io_result.as_ref().is_err_and(is_abandoned)
            }
        };
        if slot != NO_SLOT {
            freed.push((slot, abandoned));
        }
    }
    let mut cat = sh.catalog.lock();
    for (slot, abandoned) in freed {
        cat.finish_given_up_read(slot, abandoned);
    }
    drop(cat);
    sh.changed.notify_all();
}
