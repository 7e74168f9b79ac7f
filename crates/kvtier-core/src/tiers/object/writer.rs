//! Publishing: slots gathered into one segment in memory, then written with one PUT of the segment
//! and one PUT of its index object (only the index makes the blocks visible to others). When the
//! tier is split by tenant (`BucketConfig::tenant_shares`) each tenant's blocks go to a segment of
//! its own, whose sequence number carries the tenant's tag in its high 32 bits (`format::stem`), so
//! that the evictor accounts segments by tenant from their names.

use super::format::{self, Entry, SegmentHeader, SegmentIndex, SEGMENT_HEADER_BYTES};
use super::BucketTier;
use crate::format::checksum;
use crate::format::descriptor::{Descriptor, DESCRIPTOR_BYTES};
use crate::format::encrypted::seal_slot;
use crate::format::shared::{unix_ms, BLOCK_TAG_AT, TAG_BYTES};
use crate::key::BlockKey;
use crate::stats::Stats;
use crate::tiers::remote::tenants::{slot_tag, MAX_OPEN_PER_WRITER};
use object_store::PutPayload;
use std::collections::HashSet;
use std::time::Instant;

/// A segment being filled by this store's publisher, for one tenant.
pub(super) struct SegmentWriter {
    /// Its tenant's tag; None: the default tenant's (or the tier is not split).
    tenant: Option<u32>,
    buf: Vec<u8>,
    entries: Vec<Entry>,
    keys: HashSet<BlockKey>,
    first_at: Option<Instant>,
}

/// The segments this store's publisher fills: at most one per tenant, one when not split.
pub(super) struct SegmentWriters {
    open: Vec<SegmentWriter>,
    /// The next segment's number (each segment's sequence carries it in its low 32 bits).
    next_seq: u64,
}

impl SegmentWriters {
    pub(super) fn new() -> Self {
        SegmentWriters { open: Vec::new(), next_seq: 0 }
    }

    /// Where the segment filling for `tenant` is, opened if none is.
    fn open_for(&mut self, tenant: Option<u32>) -> usize {
        if let Some(at) = self.open.iter().position(|w| w.tenant == tenant) {
            return at;
        }
        if tenant.is_some() && self.open.len() >= MAX_OPEN_PER_WRITER {
            return self.open_for(None);
        }
        let buf = vec![0; SEGMENT_HEADER_BYTES];
        self.open.push(SegmentWriter { tenant, buf, entries: Vec::new(), keys: HashSet::new(), first_at: None });
        self.open.len() - 1
    }

    fn holds(&self, key: &BlockKey) -> bool {
        self.open.iter().any(|w| w.keys.contains(key))
    }

    /// Takes segment `at` out to publish: its bytes, entries and sequence number.
    fn take(&mut self, at: usize) -> (Vec<u8>, Vec<Entry>, u64) {
        let w = self.open.swap_remove(at);
        let seq = format::tenant_seq(self.next_seq, w.tenant);
        self.next_seq += 1;
        (w.buf, w.entries, seq)
    }
}

impl BucketTier {
    /// Appends whole slots (as the DRAM tier holds them) to the open segment, publishing it as soon
    /// as it holds `segment_blocks` (`BucketConfig::segment_blocks`). A slot whose descriptor or checksum does not
    /// match its key is skipped; so is a key already indexed. Returns how many were appended.
    pub fn append_slots(&self, slots: &mut [(BlockKey, &mut [u8])]) -> usize {
        let mut appended = 0;
        for (key, slot) in slots.iter_mut() {
            if self.contains(key) || !self.slot_is_sound(key, slot) {
                continue;
            }
            let mut writers = self.writer.lock();
            if writers.holds(key) {
                continue;
            }
            let at = writers.open_for(self.tenant_of(slot));
            if !self.append_one(&mut writers.open[at], key, slot) {
                continue;
            }
            appended += 1;
            let w = &writers.open[at];
            debug_assert!(w.entries.len() <= self.segment_blocks, "a full segment is sealed at once");
            if w.entries.len() == self.segment_blocks {
                self.seal(&mut writers, at);
            }
        }
        appended
    }

    /// The tenant tag of the segment a slot goes to: its page's tenant when the tier is split by
    /// tenant, else None (one segment for all).
    fn tenant_of(&self, slot: &[u8]) -> Option<u32> {
        let tag = slot_tag(&self.config.tenant_shares, slot);
        if tag.is_some() {
            self.tenant_ledger.learn_slot(slot);
        }
        tag
    }

    fn slot_is_sound(&self, key: &BlockKey, slot: &[u8]) -> bool {
        let Ok(desc) = Descriptor::decode(&slot[..DESCRIPTOR_BYTES]) else { return false };
        desc.key == *key
            && desc.namespace == self.namespace
            && desc.value_bytes as usize == self.object_bytes
            && checksum(&slot[DESCRIPTOR_BYTES..DESCRIPTOR_BYTES + self.object_bytes]) == desc.value_checksum
    }

    /// Appends one sound slot, its value encrypted with a key (`encrypt_with`); `false` when it could
    /// not be (no nonce from the kernel): left out, as a failed publish is.
    fn append_one(&self, w: &mut SegmentWriter, key: &BlockKey, slot: &[u8]) -> bool {
        let offset = w.buf.len() as u64;
        debug_assert_eq!(
            offset as usize,
            SEGMENT_HEADER_BYTES + w.entries.len() * self.slot_bytes,
            "a segment holds its header, then one slot per entry"
        );
        w.buf.extend_from_slice(&slot[..self.slot_bytes]);
        let page_at = offset as usize;
        if let Some(cipher) = self.cipher.get() {
            if let Err(e) = seal_slot(cipher, &mut w.buf[page_at..page_at + self.slot_bytes], self.object_bytes) {
                log::warn!("kvtier: no nonce to encrypt block {key:?} for the bucket ({e}); not published");
                w.buf.truncate(page_at);
                return false;
            }
        }
        let tag = match &self.auth {
            Some(auth) => {
                let value = &w.buf[page_at + DESCRIPTOR_BYTES..page_at + DESCRIPTOR_BYTES + self.object_bytes];
                auth.block_tag(&self.namespace, key, value)
            }
            None => [0; TAG_BYTES],
        };
        w.buf[page_at + BLOCK_TAG_AT..page_at + BLOCK_TAG_AT + TAG_BYTES].copy_from_slice(&tag);
        let value_checksum = Descriptor::decode(&slot[..DESCRIPTOR_BYTES]).map(|d| d.value_checksum).unwrap_or(0);
        w.entries.push(Entry { key: *key, offset, value_checksum });
        debug_assert_eq!(w.buf.len() as u64, offset + self.slot_bytes as u64);
        w.keys.insert(*key);
        w.first_at.get_or_insert_with(Instant::now);
        true
    }

    /// Publishes the open segments that hold blocks.
    pub fn flush(&self) {
        let mut writers = self.writer.lock();
        while !writers.open.is_empty() {
            self.seal(&mut writers, 0);
        }
    }

    /// Publishes the open segments whose first block waited `bucket_publish_delay_ms`.
    pub(super) fn publish_if_due(&self) {
        let mut writers = self.writer.lock();
        let delay_ms = self.config.publish_delay_ms;
        while let Some(at) =
            writers.open.iter().position(|w| w.first_at.is_some_and(|t| t.elapsed().as_millis() as u64 >= delay_ms))
        {
            self.seal(&mut writers, at);
        }
    }

    /// Writes segment `at`, then its index object; only then are its blocks in this store's index.
    /// A failed PUT loses the segment's blocks (a cache; counted in `bucket_dropped_publishes`). An
    /// empty segment is dropped.
    fn seal(&self, writers: &mut SegmentWriters, at: usize) {
        if writers.open[at].entries.is_empty() {
            writers.open.swap_remove(at);
            return;
        }
        let (mut buf, entries, seq) = writers.take(at);
        debug_assert!(
            !entries.is_empty() && entries.len() <= self.segment_blocks,
            "a segment of {} blocks",
            entries.len()
        );
        debug_assert_eq!(buf.len(), SEGMENT_HEADER_BYTES + entries.len() * self.slot_bytes);
        let stem = format::stem(self.writer_id, seq);
        let created_unix_ms = unix_ms();
        SegmentHeader {
            namespace: self.namespace,
            object_bytes: self.object_bytes as u64,
            slot_bytes: self.slot_bytes as u64,
            writer_id: self.writer_id,
            seq,
            created_unix_ms,
            count: entries.len() as u32,
        }
        .encode(&mut buf[..SEGMENT_HEADER_BYTES]);
        let index = SegmentIndex {
            namespace: self.namespace,
            object_bytes: self.object_bytes as u64,
            writer_id: self.writer_id,
            seq,
            segment_bytes: buf.len() as u64,
            created_unix_ms,
            entries,
        };
        let bytes = buf.len() as u64;
        let index_bytes = index.encode(self.auth.as_ref());
        let written =
            self.put(&self.segment_path(&stem), buf).and_then(|()| self.put(&self.index_path(&stem), index_bytes));
        match written {
            Ok(()) => {
                Stats::add(&self.stats.bucket_segments_published, 1);
                Stats::add(&self.stats.bucket_bytes_written, bytes);
                self.index.write().insert(&stem, &index);
            }
            Err(e) => {
                log::warn!(
                    "kvtier: publishing bucket segment {stem} failed: {e}; its {} blocks are not published",
                    index.entries.len()
                );
                Stats::add(&self.stats.bucket_request_errors, 1);
                Stats::add(&self.stats.bucket_dropped_publishes, index.entries.len() as u64);
            }
        }
    }

    pub(super) fn put(&self, path: &object_store::path::Path, bytes: Vec<u8>) -> std::io::Result<()> {
        Stats::add(&self.stats.bucket_put_requests, 1);
        let (store, timeout) = (&self.store, self.timeout());
        let payload = PutPayload::from(bytes);
        self.rt.block_on(async {
            match tokio::time::timeout(timeout, store.put(path, payload)).await {
                Ok(r) => r.map(|_| ()).map_err(std::io::Error::from),
                Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "PUT timed out")),
            }
        })
    }
}
