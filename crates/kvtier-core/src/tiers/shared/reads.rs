//! The shared tier's read path: a batch of blocks read through the tier's device queue (every read in
//! flight at once, as the NVMe tier's are), each then judged: read whole, from an indexed file that
//! still exists, with the key, namespace, checksums and (with a deployment key) tag it must have.
//! What fails is a counted miss and, when the file itself is bad, quarantined; never bytes.
//!
//! A block is read in pieces of at most [`READ_PIECE_BYTES`], counted in `shared_bytes_received` as
//! each lands. On a slow mount a load's reads share its bandwidth, so whole-block reads would all end
//! together, late, and until then a load (the service's remote stall limit, the engine worker's
//! watchdog) could not tell a slow mount from a frozen one; landing pieces are the progress they see.

use super::files::OpenError;
use super::format::{unix_ms, BLOCK_TAG_AT, TAG_BYTES};
use super::index::{FileId, Location};
use super::{is_vanished, SharedTier, MAX_OPEN_DATA_FILES, SHORT_READ_SETTLE};
use crate::error::{Error, Result};
use crate::format::descriptor::{Descriptor, DESCRIPTOR_BYTES};
use crate::format::encrypted::open_slot;
use crate::format::{checksum, ALIGN_BYTES};
use crate::io::buffer::AlignedBuf;
#[cfg(any(test, feature = "testing"))]
use crate::io::device::Abandoned;
use crate::io::device::{is_abandoned, OnDone, Transfer};
use crate::io::OpKind;
use crate::key::BlockKey;
use crate::stats::Stats;
use crate::tiers::remote::ReadOutcome;
use parking_lot::Mutex;
use std::fs::File;
use std::io::ErrorKind;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// The most bytes one read of a block asks the mount for (a multiple of the page, as O_DIRECT needs):
/// small enough that a piece lands every quarter second at 1 MB/s, large enough to be one or two
/// requests of a network filesystem's client (FUSE reads 128 KiB at a time, NFS up to 1 MiB).
pub(crate) const READ_PIECE_BYTES: usize = 128 * 1024;
const _: () = assert!(READ_PIECE_BYTES.is_multiple_of(ALIGN_BYTES));

/// What a finished read of an indexed block proved (side effects already applied: a bad file is
/// quarantined, a vanished one forgotten).
enum Verdict {
    Good,
    /// The file is gone (evicted elsewhere): a clean miss.
    Gone,
    /// Read past the file's end; `true` once it stayed short long enough to be quarantined.
    Short(bool),
    Failed(std::io::Error),
    /// Verification failed and the file was quarantined.
    Bad(&'static str),
    /// Encrypted, and it does not decrypt here (another key, changed bytes, no key): counted in
    /// `remote_decrypt_failures`. The file is left alone: stores with the key read it.
    NotOpened,
}

/// What `SharedTier::locate_for_read` found for a key.
enum Located {
    File(Location, String, Arc<File>),
    /// Not indexed, or its file vanished (forgotten here).
    Absent,
    /// Something other than a regular file sits where its data file should be: counted in
    /// `shared_not_regular_files` and quarantined, never opened for reading.
    NotRegular,
    /// Its data file would not open (an I/O error, or a frozen filesystem: the open took over
    /// `OPEN_WAIT`, or another one is still held): a failure of the tier, not a clean miss.
    OpenFailed(Location, String, std::io::Error),
}

/// What `SharedTier::plan_read` made of a key.
enum Planned {
    Read(FileRead, Transfer),
    /// A counted miss: not indexed, gone, not a regular file.
    Miss,
    /// Its file would not open: the read fails at once (`Located::OpenFailed`).
    Failed(FileRead, std::io::Error),
}

/// A read of an indexed block, from `SharedTier::start_read` until `SharedTier::finish_started`
/// judges it: where the block is.
pub struct FileRead {
    key: BlockKey,
    loc: Location,
    name: String,
}

impl SharedTier {
    /// Reads each block into its slot (`slot_bytes` each: descriptor page then value) and verifies it.
    /// All reads are in flight together on the tier's device queue.
    ///
    /// # Safety
    /// Each pointer is 4096-aligned (an O_DIRECT read lands there), valid for `slot_bytes` bytes of
    /// writes and used by nothing else until this returns, and a slot whose outcome is `Abandoned`
    /// is never used again.
    #[cfg(any(test, feature = "testing"))]
    pub unsafe fn read_many(&self, reads: &[(BlockKey, *mut u8)]) -> Vec<ReadOutcome> {
        debug_assert!(reads.iter().all(|&(_, slot)| is_page_aligned(slot)), "a slot is not 4096-aligned");
        let mut outcomes = vec![ReadOutcome::Miss; reads.len()];
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut started = Vec::with_capacity(reads.len());
        for (index, &(key, slot)) in reads.iter().enumerate() {
            let tx = tx.clone();
            let on_done: OnDone = Box::new(move |result| {
                let _ = tx.send((index, result));
            });
            // SAFETY: forwarded contract; the slot is judged below once its read finished.
            if let Some(read) = unsafe { self.start_read(&key, slot, on_done) } {
                started.push((index, Some(read)));
            }
        }
        drop(tx);
        // Ends once every `on_done` has run or been dropped (a dead device thread: abandoned).
        let mut results: Vec<Option<std::io::Result<()>>> = (0..reads.len()).map(|_| None).collect();
        for (index, result) in rx.iter() {
            results[index] = Some(result);
        }
        for (index, read) in &mut started {
            let result = results[*index].take().unwrap_or_else(|| Err(std::io::Error::other(Abandoned)));
            let read = read.take().expect("each read judged once");
            // SAFETY: the caller's slot is ours for the call (contract above), and the read finished.
            outcomes[*index] = unsafe { self.finish_started(read, reads[*index].1, result) };
        }
        outcomes
    }

    /// Starts reading `key` into `slot` on the tier's device queue, so that a load can keep its other
    /// reads (NVMe's) in flight meanwhile: `on_done` gets the I/O result, to be handed with the
    /// returned read to `finish_started`. `None`: a counted miss (not indexed, its file gone or not
    /// a regular file), and `on_done` is dropped uncalled. A file that will not open is a read that
    /// failed at once (`on_done` gets the error before this returns), so that the tier's health
    /// counts it: a frozen filesystem fails its opens, and it must turn the tier sick.
    ///
    /// # Safety
    /// As `read_many` for `slot`, until `finish_started` has judged the read.
    pub unsafe fn start_read(&self, key: &BlockKey, slot: *mut u8, on_done: OnDone) -> Option<FileRead> {
        debug_assert!(is_page_aligned(slot), "slot {slot:?} is not 4096-aligned");
        match self.plan_read(key, slot) {
            Planned::Read(read, transfer) => {
                self.read_in_pieces(transfer, on_done);
                Some(read)
            }
            Planned::Failed(read, error) => {
                on_done(Err(error));
                Some(read)
            }
            Planned::Miss => None,
        }
    }

    /// Puts `transfer` on the tier's queue in pieces of at most [`READ_PIECE_BYTES`], each counted in
    /// `shared_bytes_received` as it lands. `on_done` runs once, after the last piece: with the first
    /// failure, an abandoned piece's before any other (the kernel may still write into that slot); it
    /// is dropped uncalled, as a whole read's would be, if a piece's is.
    fn read_in_pieces(&self, transfer: Transfer, on_done: OnDone) {
        assert!(transfer.iovecs.is_empty() && transfer.len > 0, "a block is read into one buffer");
        let pieces = transfer.len.div_ceil(READ_PIECE_BYTES);
        let joined = Arc::new(Mutex::new(Pieces { left: pieces, outcome: Ok(()), on_done: Some(on_done) }));
        for piece in 0..pieces {
            let at = piece * READ_PIECE_BYTES;
            let len = READ_PIECE_BYTES.min(transfer.len - at);
            let (joined, stats) = (Arc::clone(&joined), Arc::clone(&self.stats));
            let part = Transfer {
                kind: OpKind::Read,
                file: Arc::clone(&transfer.file),
                offset: transfer.offset + at as u64,
                // Inside the slot: `at < transfer.len`.
                buf: transfer.buf.wrapping_add(at),
                len,
                iovecs: Vec::new(),
            };
            self.io.read(part.into_op(Box::new(move |result| {
                if result.is_ok() {
                    Stats::add(&stats.shared_bytes_received, len as u64);
                }
                Pieces::landed(&joined, result);
            })));
        }
    }

    /// Where `key` is and the transfer that reads it into `slot` (`Planned`; a miss is counted).
    fn plan_read(&self, key: &BlockKey, slot: *mut u8) -> Planned {
        assert!((slot as usize).is_multiple_of(ALIGN_BYTES), "unaligned shared-tier slot");
        let (loc, name, file) = match self.locate_for_read(key) {
            Located::File(loc, name, file) => (loc, name, file),
            Located::Absent | Located::NotRegular => {
                Stats::add(&self.stats.shared_misses, 1);
                return Planned::Miss;
            }
            Located::OpenFailed(loc, name, error) => {
                let error = std::io::Error::new(error.kind(), format!("opening shared file {name}: {error}"));
                return Planned::Failed(FileRead { key: *key, loc, name }, error);
            }
        };
        let transfer = Transfer {
            kind: OpKind::Read,
            file,
            offset: loc.offset,
            buf: slot,
            len: self.slot_bytes,
            iovecs: Vec::new(),
        };
        Planned::Read(FileRead { key: *key, loc, name }, transfer)
    }

    /// Judges a finished read (`start_read` or `read_many`): counts it, quarantines a bad file, and
    /// makes a good slot resident-ready.
    ///
    /// # Safety
    /// `slot` is the read's own, the read has finished (its `on_done` ran), and a slot whose outcome
    /// is `Abandoned` is never used again.
    pub unsafe fn finish_started(&self, read: FileRead, slot: *mut u8, result: std::io::Result<()>) -> ReadOutcome {
        if result.as_ref().is_err_and(is_abandoned) {
            log::error!("kvtier: shared read of {:?} abandoned by a broken I/O engine; counted as a miss", read.key);
            Stats::add(&self.stats.io_errors, 1);
            Stats::add(&self.stats.shared_misses, 1);
            return ReadOutcome::Abandoned;
        }
        // SAFETY: the read into the caller's slot finished (contract above).
        let slot = unsafe { std::slice::from_raw_parts_mut(slot, self.slot_bytes) };
        self.finish_read(&read, result, slot)
    }

    /// Reads one block into `slot` (at least `slot_bytes` long) and verifies it. `Ok(false)`: a miss.
    #[cfg(any(test, feature = "testing"))]
    pub fn read_into(&self, key: &BlockKey, slot: &mut [u8]) -> Result<bool> {
        if slot.len() < self.slot_bytes {
            return Err(Error::config("slot", format!("{} bytes, need slot_bytes = {}", slot.len(), self.slot_bytes)));
        }
        let Some(landing) = self.read_owned(key) else { return Ok(false) };
        slot[..self.slot_bytes].copy_from_slice(landing.as_slice());
        Ok(true)
    }

    /// Reads and verifies a block, copying only the value into `out` (object_bytes long).
    #[cfg(any(test, feature = "testing"))]
    pub fn read_value(&self, key: &BlockKey, out: &mut [u8]) -> Result<bool> {
        let Some(landing) = self.read_owned(key) else { return Ok(false) };
        out[..self.object_bytes]
            .copy_from_slice(&landing.as_slice()[DESCRIPTOR_BYTES..DESCRIPTOR_BYTES + self.object_bytes]);
        Ok(true)
    }

    /// One verified block in a buffer of its own (never borrowed memory, so that an abandoned read,
    /// whose buffer is leaked, cannot land in the caller's).
    #[cfg(any(test, feature = "testing"))]
    fn read_owned(&self, key: &BlockKey) -> Option<AlignedBuf> {
        let landing = AlignedBuf::zeroed(self.slot_bytes);
        debug_assert_eq!(landing.len(), self.slot_bytes, "a shared slot is whole pages");
        // SAFETY: `landing` is ours and aligned; abandoned, it is leaked.
        match unsafe { self.read_many(&[(*key, landing.as_ptr())]) }[0] {
            ReadOutcome::Hit => Some(landing),
            ReadOutcome::Miss => None,
            ReadOutcome::Abandoned => {
                std::mem::forget(landing);
                None
            }
        }
    }

    /// The scrub's read (`kvtier verify`): reads and verifies one indexed block like `read_many`,
    /// without counting a hit or a miss and without recording an access (a scrub must not change
    /// what the evictor keeps). `Ok(None)`: good, or gone meanwhile (nothing to check);
    /// `Ok(Some(why))`: bad, and its file is quarantined as a load would.
    pub fn scrub_block(&self, key: &BlockKey) -> Result<Option<&'static str>> {
        let (loc, name, file) = match self.locate_for_read(key) {
            Located::File(loc, name, file) => (loc, name, file),
            Located::Absent => return Ok(None),
            Located::NotRegular => return Ok(Some("not a regular file")),
            Located::OpenFailed(_, name, e) => return Err(Error::io(format!("opening shared file {name}"), e)),
        };
        let mut landing = AlignedBuf::zeroed(self.slot_bytes);
        let read = Transfer {
            kind: OpKind::Read,
            file,
            offset: loc.offset,
            buf: landing.as_ptr(),
            len: self.slot_bytes,
            iovecs: Vec::new(),
        };
        let result = self.io.run_all(vec![read]).pop().expect("one result per transfer");
        if result.as_ref().is_err_and(is_abandoned) {
            std::mem::forget(landing);
            return Err(Error::io(format!("reading shared file {name}"), result.unwrap_err()));
        }
        match self.judge(key, loc, &name, result, landing.as_mut_slice()) {
            // Encrypted under a key this store does not hold: not its to judge, never quarantined.
            Verdict::Good | Verdict::Gone | Verdict::NotOpened => Ok(None),
            Verdict::Bad(why) => Ok(Some(why)),
            Verdict::Short(true) => Ok(Some("file truncated")),
            Verdict::Short(false) => Err(Error::io(
                format!(
                    "reading shared file {name}: read short (quarantined if still short {} s from now)",
                    SHORT_READ_SETTLE.as_secs()
                ),
                std::io::Error::from(ErrorKind::UnexpectedEof),
            )),
            Verdict::Failed(e) => Err(Error::io(format!("reading shared file {name}"), e)),
        }
    }

    /// Where an indexed block is, and an open handle on its file; an error: the file is there but
    /// cannot be opened.
    fn locate_for_read(&self, key: &BlockKey) -> Located {
        let Some((loc, name)) = self.index.read().get(key).map(|(loc, name)| (loc, name.to_string())) else {
            return Located::Absent;
        };
        match self.read_handle(loc.file, &name) {
            Ok(file) => Located::File(loc, name, file),
            Err(OpenError::Io(e)) if is_vanished(&e) => {
                self.forget_vanished(&name);
                Located::Absent
            }
            Err(OpenError::NotRegular(kind)) => {
                // Planted by someone who can write the root (a FIFO would have hung this load): the
                // file is bad as a whole, like one that fails verification.
                Stats::add(&self.stats.shared_not_regular_files, 1);
                self.quarantine(&name, &format!("a {kind} in place of the data file"));
                Located::NotRegular
            }
            Err(OpenError::Io(e)) => Located::OpenFailed(loc, name, e),
        }
    }

    /// Counts a load's read and makes a good one resident-ready (tag cleared, access recorded).
    fn finish_read(&self, p: &FileRead, result: std::io::Result<()>, slot: &mut [u8]) -> ReadOutcome {
        debug_assert!(slot.len() >= self.slot_bytes, "a landing of {} bytes", slot.len());
        match self.judge(&p.key, p.loc, &p.name, result, slot) {
            Verdict::Good => {}
            Verdict::Failed(e) => {
                log::warn!("kvtier: reading shared file {} at {} failed: {e}; counted as a miss", p.name, p.loc.offset);
                Stats::add(&self.stats.io_errors, 1);
                Stats::add(&self.stats.shared_misses, 1);
                return ReadOutcome::Miss;
            }
            Verdict::Gone | Verdict::Short(_) | Verdict::Bad(_) | Verdict::NotOpened => {
                Stats::add(&self.stats.shared_misses, 1);
                return ReadOutcome::Miss;
            }
        }
        {
            let mut short = self.short_reads.lock();
            if !short.is_empty() {
                short.remove(&p.name);
            }
        }
        // The tag belongs to the shared file: the DRAM slot's padding stays zero as elsewhere.
        slot[BLOCK_TAG_AT..BLOCK_TAG_AT + TAG_BYTES].fill(0);
        Stats::add(&self.stats.shared_hits, 1);
        Stats::add(&self.stats.shared_bytes_read, self.slot_bytes as u64);
        self.pending_access.lock().insert(p.name.clone(), unix_ms());
        ReadOutcome::Hit
    }

    /// Judges a finished read of `key` at `loc` in file `name`; quarantines a bad file.
    fn judge(
        &self,
        key: &BlockKey,
        loc: Location,
        name: &str,
        result: std::io::Result<()>,
        slot: &mut [u8],
    ) -> Verdict {
        match result {
            Ok(()) => {}
            Err(e) if is_vanished(&e) => {
                self.forget_vanished(name);
                return Verdict::Gone;
            }
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => {
                let settled = self.short_read_settled(loc.file, name);
                if settled {
                    self.quarantine(name, "truncated");
                }
                return Verdict::Short(settled);
            }
            Err(e) => return Verdict::Failed(e),
        }
        if !Descriptor::is_encrypted(&slot[..DESCRIPTOR_BYTES]) {
            return self.check_block(key, loc, name, slot).unwrap_or_else(|| self.check_tag(key, name, slot));
        }
        // The tag is over what was stored: checked before the value is decrypted in place.
        if let Verdict::Bad(why) = self.check_tag(key, name, slot) {
            return Verdict::Bad(why);
        }
        if let Err(e) = open_slot(self.cipher.get().map(|c| &**c), slot, self.object_bytes) {
            log::debug!("kvtier: shared block {key:?} in {name} {e}; a miss");
            Stats::add(&self.stats.remote_decrypt_failures, 1);
            return Verdict::NotOpened;
        }
        self.check_block(key, loc, name, slot).unwrap_or(Verdict::Good)
    }

    /// Checks the block in clear against the index; `Some(Bad)` (the file quarantined) if it fails.
    fn check_block(&self, key: &BlockKey, loc: Location, name: &str, slot: &[u8]) -> Option<Verdict> {
        let why = self.verify(key, loc.value_checksum, &slot[..self.slot_bytes]).err()?;
        Stats::add(&self.stats.checksum_failures, 1);
        self.quarantine(name, why);
        Some(Verdict::Bad(why))
    }

    /// The deployment key's tag over the value as stored (`shared_key_file`), if the tier has one.
    fn check_tag(&self, key: &BlockKey, name: &str, slot: &[u8]) -> Verdict {
        if let Some(auth) = &self.auth {
            let (page, value) = slot[..DESCRIPTOR_BYTES + self.object_bytes].split_at(DESCRIPTOR_BYTES);
            if !auth.verify_block(&self.namespace, key, page, value) {
                Stats::add(&self.stats.shared_auth_failures, 1);
                self.quarantine(name, "block tag does not verify: written without the deployment key or with another");
                return Verdict::Bad("block tag does not verify");
            }
        }
        Verdict::Good
    }

    fn verify(&self, key: &BlockKey, expected_checksum: u64, slot: &[u8]) -> std::result::Result<(), &'static str> {
        let desc = Descriptor::decode(&slot[..DESCRIPTOR_BYTES]).map_err(|_| "descriptor rejected")?;
        if desc.key != *key {
            return Err("key mismatch");
        }
        if desc.namespace != self.namespace {
            return Err("foreign namespace");
        }
        if desc.value_bytes as usize != self.object_bytes {
            return Err("value length mismatch");
        }
        if desc.value_checksum != expected_checksum {
            return Err("checksum differs from the index");
        }
        if checksum(&slot[DESCRIPTOR_BYTES..DESCRIPTOR_BYTES + self.object_bytes]) != desc.value_checksum {
            return Err("value checksum mismatch");
        }
        Ok(())
    }

    fn read_handle(&self, id: FileId, name: &str) -> std::result::Result<Arc<File>, OpenError> {
        if let Some(f) = self.read_handles.lock().get(&id) {
            return Ok(Arc::clone(f));
        }
        let direct = if self.direct { libc::O_DIRECT } else { 0 };
        let f = Arc::new(self.opener.open(&self.data_path(name), direct)?);
        let mut handles = self.read_handles.lock();
        if handles.len() >= MAX_OPEN_DATA_FILES {
            handles.clear();
        }
        handles.insert(id, Arc::clone(&f));
        Ok(f)
    }

    /// A read past the end of a published file (complete and immutable when its publish record was
    /// written). Truncation, or this mount's cached size is older than the file: GlusterFS with default
    /// client caching served such short reads of whole files (tests/test_shared_fs.py). The handle is
    /// dropped and the read is a miss counted in `io_errors`; the file is quarantined (returns true)
    /// only when reads are still short `SHORT_READ_SETTLE` after the first.
    fn short_read_settled(&self, id: FileId, name: &str) -> bool {
        self.read_handles.lock().remove(&id);
        let now = Instant::now();
        let mut short = self.short_reads.lock();
        if short.len() >= 10_000 {
            short.clear();
        }
        let first = *short.entry(name.to_string()).or_insert(now);
        if now.duration_since(first) >= SHORT_READ_SETTLE {
            short.remove(name);
            return true;
        }
        drop(short);
        Stats::add(&self.stats.io_errors, 1);
        self.short_reads_settling.fetch_add(1, Ordering::Relaxed);
        log::warn!(
            "kvtier: shared file {name} read short; a miss, quarantined if still short {} s from now (a mount \
             caching file sizes, e.g. GlusterFS without --attribute-timeout=0, or truncation)",
            SHORT_READ_SETTLE.as_secs()
        );
        false
    }

    /// The file was removed by another node's evictor: drop it here too (its doom record follows).
    pub(super) fn forget_vanished(&self, name: &str) {
        self.vanished_reads.fetch_add(1, Ordering::Relaxed);
        let mut index = self.index.write();
        if let Some(id) = index.file_id(name) {
            self.read_handles.lock().remove(&id);
        }
        index.remove_file(name);
    }
}

/// The pieces of one block's read (`SharedTier::read_in_pieces`) still in flight, and how they went.
struct Pieces {
    left: usize,
    outcome: std::io::Result<()>,
    on_done: Option<OnDone>,
}

impl Pieces {
    /// One piece finished: kept if it is the worst so far; the block's `on_done` runs after the last.
    fn landed(joined: &Mutex<Pieces>, result: std::io::Result<()>) {
        let mut pieces = joined.lock();
        debug_assert!(pieces.left > 0, "more pieces landed than were read");
        pieces.left -= 1;
        if let Err(e) = result {
            let worse = match &pieces.outcome {
                Ok(()) => true,
                Err(kept) => is_abandoned(&e) && !is_abandoned(kept),
            };
            if worse {
                pieces.outcome = Err(e);
            }
        }
        if pieces.left > 0 {
            return;
        }
        let outcome = std::mem::replace(&mut pieces.outcome, Ok(()));
        let on_done = pieces.on_done.take().expect("the last piece runs the block's on_done once");
        drop(pieces);
        on_done(outcome);
    }
}

/// Whether an O_DIRECT read may land at `slot` (non-null, 4096-aligned).
fn is_page_aligned(slot: *mut u8) -> bool {
    !slot.is_null() && (slot as usize).is_multiple_of(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a block's `on_done` got (`None`: not run yet).
    type Got = Arc<Mutex<Option<std::io::Result<()>>>>;

    /// The pieces of one block, and what its `on_done` got.
    fn pieces(left: usize) -> (Arc<Mutex<Pieces>>, Got) {
        let got = Arc::new(Mutex::new(None));
        let sink = Arc::clone(&got);
        let on_done: OnDone = Box::new(move |result| *sink.lock() = Some(result));
        (Arc::new(Mutex::new(Pieces { left, outcome: Ok(()), on_done: Some(on_done) })), got)
    }

    #[test]
    fn a_block_is_done_after_its_last_piece_with_its_worst_outcome() {
        let (joined, got) = pieces(3);
        Pieces::landed(&joined, Err(std::io::Error::other("EIO")));
        Pieces::landed(&joined, Ok(()));
        assert!(got.lock().is_none(), "two of three pieces landed");
        Pieces::landed(&joined, Err(std::io::Error::other(Abandoned)));
        let outcome = got.lock().take().expect("the block is done");
        assert!(outcome.is_err_and(|e| is_abandoned(&e)), "an abandoned piece outweighs a failed one");

        let (joined, got) = pieces(2);
        Pieces::landed(&joined, Ok(()));
        Pieces::landed(&joined, Ok(()));
        assert!(got.lock().take().expect("done").is_ok());
    }

    #[test]
    fn a_block_whose_piece_was_dropped_drops_its_on_done_uncalled() {
        let (joined, got) = pieces(2);
        Pieces::landed(&joined, Ok(()));
        let dropped = Arc::strong_count(&got);
        drop(joined); // the other piece's operation dropped by a dead device thread
        assert!(got.lock().is_none(), "never called");
        assert_eq!(Arc::strong_count(&got), dropped - 1, "the block's on_done was dropped with it");
    }
}
