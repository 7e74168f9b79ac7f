//! What the shared-filesystem tier implements for the store (`tiers::remote`): the publisher's sink
//! and the remote tier's reads, over the tier's own methods.

use super::reads::FileRead;
use super::SharedTier;
use crate::key::BlockKey;
use crate::tiers::remote::{Heartbeat, PublishSink, ReadOutcome, ReadRequest, RemoteTier, StartedRead};
use std::sync::atomic::AtomicU64;

impl PublishSink for SharedTier {
    fn slot_bytes(&self) -> usize {
        SharedTier::slot_bytes(self)
    }
    fn publish_queue_bytes(&self) -> usize {
        self.config().publish_queue_bytes
    }
    fn contains(&self, key: &BlockKey) -> bool {
        SharedTier::contains(self, key)
    }
    fn append_slots(&self, slots: &mut [(BlockKey, &mut [u8])]) -> usize {
        SharedTier::append_slots(self, slots)
    }
    fn flush(&self) {
        SharedTier::flush(self)
    }
    fn close(&self) {
        SharedTier::close(self)
    }
    fn deferred(&self) -> &AtomicU64 {
        &self.stats().shared_deferred_publishes
    }
    fn dropped(&self) -> &AtomicU64 {
        &self.stats().shared_dropped_publishes
    }
}

impl RemoteTier for SharedTier {
    fn keys_generation(&self) -> u64 {
        SharedTier::keys_generation(self)
    }

    fn cut_keys(&self, limit: usize) -> Vec<BlockKey> {
        self.index.read().cut(limit)
    }

    fn heartbeat(&self) -> &Heartbeat {
        &self.heartbeat
    }

    /// One read per block on the tier's device queue, all in flight together.
    unsafe fn start_reads(&self, requests: Vec<ReadRequest>) -> Vec<Option<StartedRead>> {
        requests
            .into_iter()
            // SAFETY: forwarded contract.
            .map(|(key, slot, on_done)| unsafe { self.start_read(&key, slot, on_done) }.map(StartedRead::new))
            .collect()
    }

    unsafe fn finish_read(&self, read: StartedRead, slot: *mut u8, result: std::io::Result<()>) -> ReadOutcome {
        // SAFETY: forwarded contract.
        unsafe { self.finish_started(read.into_inner::<FileRead>(), slot, result) }
    }
}
