//! Damage in the bucket (docs/object-tier.md, "Damage and quarantine"): segments that are gone while
//! their index object is still listed, blocks that fail verification, corrupt index objects.
//!
//! The load path only records what it found (no request is made on a load's thread); the requests
//! it calls for run on the maintenance thread (`run_cleanups`). Only certain damage is acted on in
//! the bucket: a 404 of a segment (its index object is dead for every store) and a checksum or
//! descriptor failure of an object in this format version. A refusal that can come from this
//! process's own configuration (no deployment key, another one, another block size or namespace,
//! a newer format) is counted and ignored, never copied or deleted: a misconfigured or forged
//! store must not be able to destroy another's data.

use super::format::{self, INDEX_MAGIC, OBJECT_FORMAT_VERSION};
use super::BucketTier;
use crate::format::shared::unix_ms;
use crate::format::{get_u32, ParseError};
use crate::stats::Stats;
use object_store::path::Path as ObjectPath;
use std::collections::HashSet;
use std::sync::Arc;

/// Objects in `quarantine/` older than this are deleted by the evictor lease's holder.
pub(super) const QUARANTINE_KEEP_MS: u64 = 7 * 24 * 3600 * 1000;
/// The quarantine holds at most this fraction of `bucket_budget_bytes` (beyond the budget, which
/// counts the segments only); the holder deletes its oldest objects past it.
pub(super) const QUARANTINE_BUDGET_SHARE: u64 = 10;

/// Why a block read from the bucket was refused.
#[derive(Debug, Clone, Copy)]
pub(super) enum Refusal {
    /// Its bytes are not what the index says (checksum, descriptor, key): the object is damaged.
    Corrupt(&'static str),
    /// Its keyed tag does not verify: forged, or this store has no key or another one.
    Unauthenticated,
}

impl Refusal {
    pub(super) fn reason(self) -> &'static str {
        match self {
            Refusal::Corrupt(why) => why,
            Refusal::Unauthenticated => "block tag does not verify: written without the deployment key or with another",
        }
    }
}

/// A request the load path's findings call for, made by the maintenance thread.
#[derive(Debug)]
pub(super) enum Cleanup {
    /// The segment answered 404: its index object names nothing any more (an expiry rule deletes
    /// the older segment first); deleted so that no store GETs it again.
    OrphanIndex(Arc<str>),
    /// A block of the segment failed its checksum or descriptor: the segment is copied into
    /// `quarantine/` for the operator; it stays in service (its other blocks are good).
    CorruptSegment(Arc<str>),
    /// The index object failed its checksum: moved into `quarantine/`, so no store fetches it again.
    CorruptIndex(Arc<str>),
}

/// Whether an index object that failed to decode is damaged (an index of this format version whose
/// checksum or length is wrong), not someone else's object or a newer format: only then is it moved.
pub(super) fn index_is_corrupt(bytes: &[u8], err: &ParseError) -> bool {
    let ours = bytes.starts_with(&INDEX_MAGIC) && (bytes.len() < 12 || get_u32(bytes, 8) == OBJECT_FORMAT_VERSION);
    ours && matches!(err, ParseError::BodyChecksum(_) | ParseError::OutOfRange(_) | ParseError::TooShort(_))
}

impl BucketTier {
    /// A ranged GET of the segment answered 404: it is gone (evicted, or expired by a lifecycle rule
    /// before its index object). Its blocks leave the index; the index object is not indexed again
    /// and is deleted at the next maintenance pass.
    pub(super) fn segment_missing(&self, stem: &Arc<str>) {
        if self.bad.lock().insert(stem.to_string()) {
            log::info!("kvtier: bucket segment {stem} is gone; its index object will be deleted");
            self.cleanups.lock().push(Cleanup::OrphanIndex(Arc::clone(stem)));
        }
        self.index.write().remove(stem);
    }

    /// A block failed verification: it alone leaves the index, for the life of the process (a
    /// refresh does not add it back). A corrupt one also has its segment copied into quarantine.
    pub(super) fn block_refused(&self, read: &super::BucketRead, refusal: Refusal) {
        log::warn!(
            "kvtier: bucket block at {:#x} of segment {} refused ({}); it is a miss from now on",
            read.offset,
            read.stem,
            refusal.reason()
        );
        self.bad_blocks.lock().insert((read.stem.to_string(), read.offset));
        self.index.write().remove_block(&read.stem, &read.key);
        if matches!(refusal, Refusal::Corrupt(_)) && self.quarantined.lock().insert(read.stem.to_string()) {
            self.cleanups.lock().push(Cleanup::CorruptSegment(Arc::clone(&read.stem)));
        }
    }

    /// Forgets the bad segments and blocks whose index object is no longer listed (`stems`): their
    /// names are never reused, so the sets stay as small as the damage still in the bucket.
    pub(super) fn forget_damage_not_listed(&self, stems: &HashSet<String>) {
        self.bad.lock().retain(|s| stems.contains(s));
        self.bad_blocks.lock().retain(|(s, _)| stems.contains(s));
        self.quarantined.lock().retain(|s| stems.contains(s));
    }

    /// Leaves out of a freshly fetched index the blocks refused before (by offset).
    pub(super) fn without_bad_blocks(&self, stem: &str, idx: &mut format::SegmentIndex) {
        let bad = self.bad_blocks.lock();
        if bad.iter().any(|(s, _)| s == stem) {
            idx.entries.retain(|e| !bad.contains(&(stem.to_string(), e.offset)));
        }
    }

    /// Makes the requests recorded since the last pass. Best effort, once each: a store with
    /// read-only credentials must not retry a refused DELETE every pass (its sets keep it from
    /// reading the damage again).
    pub(super) fn run_cleanups(&self) {
        let work = std::mem::take(&mut *self.cleanups.lock());
        for cleanup in work {
            let done = match &cleanup {
                Cleanup::OrphanIndex(stem) => self.delete(&self.index_path(stem)),
                Cleanup::CorruptSegment(stem) => self.quarantine(&self.segment_path(stem), &format!("{stem}.kvo")),
                Cleanup::CorruptIndex(stem) => {
                    let path = self.index_path(stem);
                    self.quarantine(&path, &format!("{stem}.kvi")).and_then(|()| self.delete(&path))
                }
            };
            if let Err(e) = done {
                log::warn!("kvtier: bucket cleanup {cleanup:?} failed: {e}; left as it is");
                Stats::add(&self.stats.bucket_request_errors, 1);
            }
        }
    }

    /// Copies `from` to `<base>/quarantine/<name>` on the server (a COPY, billed as a PUT).
    fn quarantine(&self, from: &ObjectPath, name: &str) -> std::io::Result<()> {
        Stats::add(&self.stats.bucket_put_requests, 1);
        let to = ObjectPath::from(format!("{}/quarantine/{name}", self.base));
        let (store, timeout) = (&self.store, self.timeout());
        match self.rt.block_on(async { tokio::time::timeout(timeout, store.copy(from, &to)).await }) {
            Ok(Ok(())) => {
                log::warn!("kvtier: bucket object {from} copied to {to} (quarantine)");
                Stats::add(&self.stats.bucket_quarantined_objects, 1);
                Ok(())
            }
            Ok(Err(e)) => Err(std::io::Error::from(e)),
            Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "COPY timed out")),
        }
    }

    /// Keeps `quarantine/` bounded (run by the evictor lease's holder): deletes objects older than
    /// `QUARANTINE_KEEP_MS` and, newest first, those that do not fit in a tenth of the budget.
    pub(super) fn bound_quarantine(&self) -> std::io::Result<()> {
        let mut listed = self.list("quarantine")?;
        listed.sort_by_key(|m| std::cmp::Reverse(m.last_modified));
        let cap = self.config.budget_bytes / QUARANTINE_BUDGET_SHARE;
        let oldest_kept_ms = unix_ms().saturating_sub(QUARANTINE_KEEP_MS) as i64;
        let mut kept: u64 = 0;
        for m in listed {
            if kept + m.size > cap || m.last_modified.timestamp_millis() < oldest_kept_ms {
                self.delete(&m.location)?;
            } else {
                kept += m.size;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::put_u32;

    #[test]
    fn only_an_index_of_this_version_with_a_bad_checksum_or_length_is_corrupt() {
        let mut ours = vec![0u8; 200];
        ours[..8].copy_from_slice(&INDEX_MAGIC);
        put_u32(&mut ours, 8, OBJECT_FORMAT_VERSION);
        assert!(index_is_corrupt(&ours, &ParseError::BodyChecksum("index object")));
        assert!(index_is_corrupt(&ours, &ParseError::OutOfRange("index entry count")));
        assert!(index_is_corrupt(&ours[..10], &ParseError::TooShort(10)), "truncated inside the header");
        let mut newer = ours.clone();
        put_u32(&mut newer, 8, OBJECT_FORMAT_VERSION + 1);
        assert!(!index_is_corrupt(&newer, &ParseError::Version(OBJECT_FORMAT_VERSION + 1)));
        assert!(!index_is_corrupt(&newer, &ParseError::TooShort(200)), "a newer format may be shorter");
        assert!(!index_is_corrupt(b"not an index", &ParseError::BadMagic), "not ours: left alone");
    }
}
