//! Operator maintenance of an open store: the scrub (`kvtier verify`), trim (`kvtier trim`) and the
//! facts `kvtier inspect` shows, as `impl Store` methods. The timeline that dates blocks lives in
//! `timeline` (the catalog holds one), the namespace directory's files in `namespace_dir`.
//!
//! Safety while engines run: every block a scrub reads is pinned for the read (no eviction, no region
//! reclaim); trim removes only what the catalog says nobody uses (no pin, no fill, no load, no write).
//! A bad copy is quarantined: dropped from the index (a later load of it is a miss) and, on NVMe,
//! from its region's trailer (recovery does not adopt it again).

use crate::catalog::{MetaWrite, NvmeLoc, ScrubTarget, Tier, TrimCounts, TrimPlan};
use crate::error::{Error, Result};
use crate::format::descriptor::{Descriptor, DESCRIPTOR_BYTES};
use crate::format::encrypted::decrypt_in_place;
use crate::io::buffer::AlignedBuf;
use crate::key::BlockKey;
use crate::stats::Stats;
use crate::store::Store;
use crate::tiers::nvme;
use crate::timeline::now_unix_ms;
use std::time::{Duration, Instant};

/// A bad copy a scrub found.
#[derive(Debug, Clone)]
pub struct BadBlock {
    pub key: BlockKey,
    pub tier: Tier,
    /// What did not match, e.g. "value checksum mismatch".
    pub reason: String,
    /// No load is served from this copy any more (NVMe: gone from index and trailer). `false`: the
    /// block changed under the scrub (stored again, evicted) and there was nothing to quarantine.
    pub quarantined: bool,
}

/// One step of a scrub: blocks with sequence in `(after, next_after]`.
#[derive(Debug, Clone, Default)]
pub struct VerifyBatch {
    /// Pass it as `after` to the next call.
    pub next_after: u64,
    /// No visible block is left above `next_after`.
    pub done: bool,
    pub checked_dram: u64,
    pub checked_nvme: u64,
    pub bad_dram: u64,
    pub bad_nvme: u64,
    pub bytes_read: u64,
    /// DRAM copies not read because an NVMe write was reading their slot (their NVMe copy is).
    pub skipped_busy: u64,
    /// Visible blocks at the start of the batch above `after` (progress).
    pub remaining_blocks: u64,
    /// The highest sequence handed out when the batch began (0 for the shared tier's scrub). A scrub
    /// ends once it passes the value of its first batch: blocks stored meanwhile are the next
    /// scrub's, or a scrub beside a busy engine would chase new blocks for ever.
    pub newest_sequence: u64,
    /// How long the caller should wait before the next batch to keep the pace. A batch sleeps at
    /// most `STEP_PACING_LIMIT` itself and ends early when its pace asks for more: the rest of the
    /// wait is taken between batches, where it holds nothing in the store or the service.
    pub pace_wait_ms: u64,
    pub bad: Vec<BadBlock>,
}

/// The slowest pace a scrub may be asked for: 1 MB/s (`kvtier verify --max-mbps 1`). At a byte a
/// second one block of a few MiB would take weeks.
pub const MIN_VERIFY_BYTES_PER_S: u64 = 1_000_000;

/// The longest one batch of a scrub sleeps to keep its pace. A batch holds its namespace open in
/// the service (and, unpaced, each block's pin), so its length is bounded whatever the pace.
const STEP_PACING_LIMIT: Duration = Duration::from_secs(2);

/// The pace of one scrub batch: `bytes_per_s` from `started` (0: unpaced).
struct Pace {
    bytes_per_s: u64,
    started: Instant,
}

impl Pace {
    fn new(bytes_per_s: u64) -> Result<Pace> {
        if bytes_per_s > 0 && bytes_per_s < MIN_VERIFY_BYTES_PER_S {
            return Err(Error::config(
                "max_bytes_per_s",
                format!(
                    "a scrub paced to {bytes_per_s} bytes/s would take days per GiB; give at least \
                     {MIN_VERIFY_BYTES_PER_S} (1 MB/s: `kvtier verify --max-mbps 1`), or 0 to read unpaced"
                ),
            ));
        }
        Ok(Pace { bytes_per_s, started: Instant::now() })
    }

    /// Sleeps until `bytes_read` are due at the pace, but not past `STEP_PACING_LIMIT` from the
    /// batch's start. `Some(rest)` when the pace asks for more: the batch ends after this block,
    /// and the caller waits `rest` before the next one.
    fn keep(&self, bytes_read: u64) -> Option<Duration> {
        if self.bytes_per_s == 0 {
            return None;
        }
        let due = Duration::from_secs_f64(bytes_read as f64 / self.bytes_per_s as f64);
        let elapsed = self.started.elapsed();
        let wait = due.checked_sub(elapsed)?;
        let allowed = STEP_PACING_LIMIT.saturating_sub(elapsed);
        std::thread::sleep(wait.min(allowed));
        (wait > allowed).then(|| wait - allowed)
    }
}

impl VerifyBatch {
    /// The batch ends at `next_after` because its pace asks for a wait of `rest` first; it is not
    /// `done` when `more_left` of its chosen blocks were not checked.
    fn end_early(&mut self, next_after: u64, more_left: bool, rest: Duration) {
        self.next_after = next_after;
        self.done &= !more_left;
        self.pace_wait_ms = u64::try_from(rest.as_millis()).unwrap_or(u64::MAX).max(1);
    }
}

/// What `Store::trim` removes.
#[derive(Debug, Clone, Copy)]
pub enum TrimRequest {
    /// Every block not in use.
    All,
    /// Blocks stored more than this long ago (blocks recovered at open count as stored at open).
    OlderThan(Duration),
    /// Oldest whole NVMe regions until the NVMe tier uses at most this many bytes.
    NvmeTo(u64),
}

/// Facts about the namespace for `kvtier inspect`.
#[derive(Debug, Clone, Default)]
pub struct NamespaceFacts {
    pub visible_blocks: u64,
    pub lowest_sequence: u64,
    pub highest_sequence: u64,
    /// Unix ms by which the oldest and the newest block had been stored (to about a second, from the
    /// timeline); 0 when unknown.
    pub oldest_unix_ms: u64,
    pub newest_unix_ms: u64,
    /// The oldest block was recovered at open and no saved timeline dates it: `oldest_unix_ms` is
    /// the open.
    pub oldest_before_open: bool,
    /// The same for the newest block (then no block was stored since the open).
    pub newest_before_open: bool,
    pub opened_unix_ms: u64,
    pub write_backlog_bytes: u64,
    /// With a shared tier: how stale its index may be, and its filesystem usage.
    pub shared_index_age_ms: Option<u64>,
    pub shared_used_bytes: u64,
    pub shared_capacity_bytes: u64,
}

/// Logged once per process: a verify without the key met encrypted NVMe copies.
static ENCRYPTED_SKIP_LOGGED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Decrypts an NVMe copy in place when its value is encrypted (`encryption_key_file`), so that
/// `check_copy` checks the plaintext, as a load does.
fn open_nvme_copy(store: &Store, bytes: &mut [u8]) -> std::result::Result<(), String> {
    let sh = store.state();
    let (page, rest) = bytes.split_at_mut(DESCRIPTOR_BYTES);
    decrypt_in_place(sh.value_cipher.as_deref(), page, &mut rest[..sh.config.object_bytes])
        .map(|_| ())
        .map_err(|e| format!("encrypted value {e}"))
}

/// Checks one copy (descriptor page + value) against what the index expects.
fn check_copy(store: &Store, target: &ScrubTarget, bytes: &[u8]) -> std::result::Result<(), String> {
    let sh = store.state();
    let desc = Descriptor::decode(&bytes[..DESCRIPTOR_BYTES]).map_err(|e| format!("descriptor: {e}"))?;
    let object_bytes = sh.config.object_bytes;
    if desc.key != target.key {
        return Err("descriptor names another block".into());
    }
    if desc.namespace != sh.namespace {
        return Err("descriptor names another namespace".into());
    }
    if desc.value_bytes as usize != object_bytes {
        return Err(format!("descriptor value size {} != object_bytes {object_bytes}", desc.value_bytes));
    }
    if desc.sequence != target.sequence || desc.value_checksum != target.value_checksum {
        return Err("descriptor is of another version of the block".into());
    }
    if crate::format::checksum(&bytes[DESCRIPTOR_BYTES..DESCRIPTOR_BYTES + object_bytes]) != desc.value_checksum {
        return Err("value checksum mismatch".into());
    }
    Ok(())
}

impl Store {
    /// Scrubs up to `max_blocks` blocks above sequence `after`: re-reads every copy (its DRAM slot,
    /// its NVMe entry), checks descriptor and checksum, and quarantines bad copies. Reads are paced
    /// to at most `max_bytes_per_s` (0: unpaced). Safe while the store serves.
    pub fn verify_batch(&self, after: u64, max_blocks: usize, max_bytes_per_s: u64) -> Result<VerifyBatch> {
        self.check_open()?;
        let pace = Pace::new(max_bytes_per_s)?;
        let sh = self.state();
        let (chosen, remaining, newest_sequence) = {
            let cat = sh.catalog.lock();
            (cat.scrub_batch(after, max_blocks.max(1)), cat.visible_blocks() as u64, cat.newest_sequence())
        };
        let mut batch = VerifyBatch {
            next_after: chosen.last().map_or(after, |&(sequence, _)| sequence),
            done: chosen.len() < max_blocks.max(1),
            remaining_blocks: remaining,
            newest_sequence,
            ..VerifyBatch::default()
        };
        let mut staging = AlignedBuf::zeroed(sh.arena.slot_bytes());
        let mut meta = Vec::new();
        for (index, (sequence, key)) in chosen.iter().enumerate() {
            // One block pinned at a time, and none while the scrub sleeps to keep its pace.
            if !self.verify_block(*sequence, key, &mut staging, &mut batch, &mut meta) {
                continue;
            }
            if let Some(rest) = pace.keep(batch.bytes_read) {
                batch.end_early(*sequence, index + 1 < chosen.len(), rest);
                break;
            }
        }
        crate::mover::submit_meta(sh, meta);
        Ok(batch)
    }

    /// Checks the copies of one block the scrub chose, quarantines the bad ones (their metadata
    /// writes go to `meta`) and counts into `batch`. `false` if the block changed or went since it
    /// was chosen: nothing was checked.
    fn verify_block(
        &self,
        sequence: u64,
        key: &BlockKey,
        staging: &mut AlignedBuf,
        batch: &mut VerifyBatch,
        meta: &mut Vec<MetaWrite>,
    ) -> bool {
        let sh = self.state();
        let Some(target) = sh.catalog.lock().scrub_pin(key, sequence) else { return false };
        let bad_dram = self.check_dram_copy(&target, batch);
        let bad_nvme = self.check_nvme_copy(&target, staging, batch);
        // Quarantine and the scrub's unpin in one critical section.
        let (dram_quarantined, nvme_quarantined) = sh.catalog.lock().scrub_done(
            key,
            sequence,
            bad_dram.as_ref().map(|(slot, _)| *slot),
            bad_nvme.as_ref().map(|(loc, _)| *loc),
            meta,
        );
        sh.changed.notify_all();
        for (tier, reason, quarantined) in [
            bad_dram.map(|(_, reason)| (Tier::Dram, reason, dram_quarantined)),
            bad_nvme.map(|(_, reason)| (Tier::Nvme, reason, nvme_quarantined)),
        ]
        .into_iter()
        .flatten()
        {
            if tier == Tier::Dram {
                batch.bad_dram += 1;
            } else {
                batch.bad_nvme += 1;
            }
            Stats::add(&sh.stats.checksum_failures, 1);
            log::warn!("kvtier verify: {} copy of {key:?} is bad ({reason}); quarantined: {quarantined}", tier.name());
            batch.bad.push(BadBlock { key: *key, tier, reason, quarantined });
        }
        true
    }

    /// Checks the pinned block's DRAM copy, if it has a resident one: its slot and what is wrong
    /// with it when it is bad.
    fn check_dram_copy(&self, target: &ScrubTarget, batch: &mut VerifyBatch) -> Option<(u32, String)> {
        let sh = self.state();
        let Some(slot) = target.dram else {
            if target.nvme.is_none() {
                batch.skipped_busy += 1;
            }
            return None;
        };
        let slot_bytes = sh.arena.slot_bytes();
        // SAFETY: the slot is resident, pinned by this scrub and not being written to NVMe:
        // nothing writes into it while the pin lasts.
        let bytes = unsafe { std::slice::from_raw_parts(sh.arena.slot_ptr(slot), slot_bytes) };
        batch.checked_dram += 1;
        batch.bytes_read += slot_bytes as u64;
        check_copy(self, target, bytes).err().map(|reason| (slot, reason))
    }

    /// Reads the pinned block's NVMe copy, if it has one, into `staging` and checks it: its location
    /// and what is wrong with it when it is bad (or unreadable).
    fn check_nvme_copy(
        &self,
        target: &ScrubTarget,
        staging: &mut AlignedBuf,
        batch: &mut VerifyBatch,
    ) -> Option<(NvmeLoc, String)> {
        let sh = self.state();
        let (Some(loc), Some(geometry)) = (target.nvme, sh.geometry) else { return None };
        let slot_bytes = sh.arena.slot_bytes();
        debug_assert_eq!(staging.as_slice().len(), slot_bytes, "the staging buffer holds one slot");
        let device = &sh.device_files[loc.device as usize];
        let offset = geometry.region_offset(loc.region) + loc.offset;
        let read = nvme::read_exact_at(device, staging.as_mut_slice(), offset);
        if read.is_ok() && sh.value_cipher.is_none() && Descriptor::is_encrypted(staging.as_slice()) {
            // Without the key nothing can tell an encrypted copy good from bad: it is not checked (and
            // never quarantined), rather than every block of a store opened without its key dropped.
            if !ENCRYPTED_SKIP_LOGGED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                log::warn!(
                    "kvtier verify: NVMe values are encrypted and no encryption_key_file is set \
                     (KVTIER_ENCRYPTION_KEY_FILE): their copies are not checked"
                );
            }
            return None;
        }
        let outcome = read
            .map_err(|e| format!("read failed: {e}"))
            .and_then(|()| open_nvme_copy(self, staging.as_mut_slice()))
            .and_then(|()| check_copy(self, target, staging.as_slice()));
        batch.checked_nvme += 1;
        batch.bytes_read += slot_bytes as u64;
        Stats::add(&sh.stats.bytes_read_nvme, slot_bytes as u64);
        outcome.err().map(|reason| (loc, reason))
    }

    /// Scrubs up to `max_blocks` blocks of the shared tier, from position `after` of its indexed
    /// keys in key order (a cursor over a set that changes: a block published meanwhile may be
    /// missed by this pass). A bad block's file is quarantined (every block in it becomes a miss,
    /// as at load). `VerifyBatch::checked_nvme`/`bad_nvme` count shared blocks here. No shared tier:
    /// an empty batch, done.
    pub fn verify_shared_batch(&self, after: u64, max_blocks: usize, max_bytes_per_s: u64) -> Result<VerifyBatch> {
        self.check_open()?;
        let pace = Pace::new(max_bytes_per_s)?;
        let sh = self.state();
        let Some(tier) = sh.remote.shared_fs() else {
            return Ok(VerifyBatch { next_after: after, done: true, ..VerifyBatch::default() });
        };
        let mut keys = tier.indexed_keys(usize::MAX);
        keys.sort_unstable_by_key(|k| k.0);
        let start = (after as usize).min(keys.len());
        let end = (start + max_blocks.max(1)).min(keys.len());
        let mut batch = VerifyBatch {
            next_after: end as u64,
            done: end == keys.len(),
            remaining_blocks: keys.len() as u64,
            ..VerifyBatch::default()
        };
        let slot_bytes = tier.slot_bytes();
        for (position, key) in (start..end).zip(&keys[start..end]) {
            let outcome = tier.scrub_block(key);
            batch.checked_nvme += 1;
            batch.bytes_read += slot_bytes as u64;
            // A bad block's file is quarantined by the tier; a read error is reported, not quarantined.
            let bad = match outcome {
                Ok(None) => None,
                Ok(Some(why)) => Some((why.to_string(), true)),
                Err(e) => Some((format!("read failed: {e}"), false)),
            };
            if let Some((reason, quarantined)) = bad {
                batch.bad_nvme += 1;
                log::warn!("kvtier verify: shared copy of {key:?} is bad ({reason}); quarantined: {quarantined}");
                batch.bad.push(BadBlock { key: *key, tier: Tier::Shared, reason, quarantined });
            }
            if let Some(rest) = pace.keep(batch.bytes_read) {
                batch.end_early(position as u64 + 1, position + 1 < end, rest);
                break;
            }
        }
        Ok(batch)
    }

    /// Removes what `request` selects, never a block in use (pinned by a request or a load, being
    /// filled, loaded, or written to NVMe). Freed NVMe regions get their trailers zeroed on disk.
    pub fn trim(&self, request: TrimRequest) -> Result<TrimCounts> {
        self.check_open()?;
        let sh = self.state();
        let mut meta = Vec::new();
        let mut freed = Vec::new();
        let counts = {
            let mut cat = sh.catalog.lock();
            let plan = match request {
                TrimRequest::All => TrimPlan::All,
                TrimRequest::NvmeTo(bytes) => TrimPlan::NvmeTo(bytes),
                TrimRequest::OlderThan(age) => {
                    let at = now_unix_ms().saturating_sub(age.as_millis() as u64);
                    TrimPlan::OlderThan(cat.timeline.cutoff(at))
                }
            };
            cat.trim(plan, &mut meta, &mut freed)
        };
        crate::mover::submit_meta(sh, meta);
        // A freed region must not come back at recovery: its trailer goes, and so does its first
        // entry (recovery scans a trailer-less region from its start). Nothing else writes there
        // while the catalog holds the region out of use.
        let mut zeroed = Vec::new();
        let mut result = Ok(());
        if let Some(geometry) = sh.geometry {
            let trailer = AlignedBuf::zeroed(geometry.trailer_bytes as usize);
            let page = AlignedBuf::zeroed(DESCRIPTOR_BYTES);
            for f in &freed {
                let device = &sh.device_files[f.device];
                let written = nvme::write_all_at(device, trailer.as_slice(), geometry.trailer_offset(f.region))
                    .and_then(|()| nvme::write_all_at(device, page.as_slice(), geometry.region_offset(f.region)));
                match written {
                    Ok(()) => zeroed.push(*f),
                    // Left out of use (it holds nothing): the next start recovers what is on disk.
                    Err(e) => result = Err(e),
                }
            }
            for device in &sh.device_files {
                if let Err(e) = device.file.sync_data() {
                    result = Err(Error::io(format!("fdatasync {}", device.path.display()), e));
                }
            }
        }
        sh.catalog.lock().release_trimmed(&zeroed);
        sh.changed.notify_all();
        result.map(|()| counts)
    }

    /// Block counts and dates, for `kvtier inspect`.
    pub fn namespace_facts(&self) -> NamespaceFacts {
        let cat = self.state().catalog.lock();
        let mut facts = NamespaceFacts {
            visible_blocks: cat.visible_blocks() as u64,
            opened_unix_ms: cat.timeline.opened_unix_ms(),
            write_backlog_bytes: cat.write_backlog_bytes() as u64,
            ..NamespaceFacts::default()
        };
        if let Some(tier) = self.state().remote.shared_fs() {
            facts.shared_index_age_ms = Some(tier.index_age_ms());
            let usage = tier.usage();
            facts.shared_used_bytes = usage.used_bytes;
            facts.shared_capacity_bytes = usage.capacity_bytes;
        }
        if let Some((lo, hi)) = cat.sequence_range() {
            facts.lowest_sequence = lo;
            facts.highest_sequence = hi;
            let open = cat.timeline.opened_unix_ms();
            facts.oldest_before_open = cat.timeline.undated_before_open(lo);
            facts.newest_before_open = cat.timeline.undated_before_open(hi);
            facts.oldest_unix_ms = cat.timeline.time_of(lo).unwrap_or(open);
            facts.newest_unix_ms = cat.timeline.time_of(hi).unwrap_or(open);
        }
        facts
    }
}
