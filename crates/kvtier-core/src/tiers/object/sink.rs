//! What the object tier implements for the store (`tiers::remote`): the publisher's sink and the
//! remote tier's reads, over the tier's own methods.

use super::{BucketRead, BucketTier};
use crate::key::BlockKey;
use crate::tiers::remote::{Heartbeat, PublishSink, ReadOutcome, ReadRequest, RemoteTier, StartedRead};
use std::sync::atomic::AtomicU64;

impl PublishSink for BucketTier {
    fn slot_bytes(&self) -> usize {
        BucketTier::slot_bytes(self)
    }
    fn publish_queue_bytes(&self) -> usize {
        self.config().publish_queue_bytes
    }
    fn contains(&self, key: &BlockKey) -> bool {
        BucketTier::contains(self, key)
    }
    fn append_slots(&self, slots: &mut [(BlockKey, &mut [u8])]) -> usize {
        BucketTier::append_slots(self, slots)
    }
    fn flush(&self) {
        BucketTier::flush(self)
    }
    fn closing(&self) {
        BucketTier::closing(self);
    }
    fn close(&self) {
        BucketTier::close(self)
    }
    fn deferred(&self) -> &AtomicU64 {
        &self.stats().bucket_deferred_publishes
    }
    fn dropped(&self) -> &AtomicU64 {
        &self.stats().bucket_dropped_publishes
    }
}

impl RemoteTier for BucketTier {
    fn keys_generation(&self) -> u64 {
        BucketTier::keys_generation(self)
    }

    fn cut_keys(&self, limit: usize) -> Vec<BlockKey> {
        self.index.read().blocks.cut(limit)
    }

    fn heartbeat(&self) -> &Heartbeat {
        &self.heartbeat
    }

    fn blocks_per_request(&self) -> usize {
        self.blocks_per_get()
    }

    /// Adjacent blocks of one segment are read with one ranged GET.
    unsafe fn start_reads(&self, requests: Vec<ReadRequest>) -> Vec<Option<StartedRead>> {
        // SAFETY: forwarded contract.
        let started = unsafe { BucketTier::start_reads(self, requests) };
        started.into_iter().map(|read| read.map(StartedRead::new)).collect()
    }

    unsafe fn finish_read(&self, read: StartedRead, slot: *mut u8, result: std::io::Result<()>) -> ReadOutcome {
        // SAFETY: forwarded contract.
        unsafe { self.finish_started(read.into_inner::<BucketRead>(), slot, result) }
    }
}
