//! Counters of the store, updated lock-free on the data path and read by `Store::stats`.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        #[derive(Default)]
        pub struct Stats { $(pub $name: AtomicU64,)* }

        #[derive(Debug, Clone, Default, PartialEq, Eq)]
        pub struct StatsSnapshot { $(pub $name: u64,)* }

        impl Stats {
            pub fn snapshot(&self) -> StatsSnapshot {
                StatsSnapshot { $($name: self.$name.load(Ordering::Relaxed),)* }
            }
        }

        impl StatsSnapshot {
            /// (name, value) pairs, for the Python dict and Prometheus.
            pub fn fields(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)*]
            }
        }
    };
}

counters!(
    dram_hits,
    nvme_hits,
    misses,
    // Loads served from DRAM blocks that a read-ahead (`Store::read_ahead`) brought in from a lower
    // tier: counted there as that tier's hit, so not in `dram_hits`.
    read_ahead_hits,
    bytes_read_nvme,
    bytes_written_nvme,
    bytes_copied_in,
    bytes_copied_out,
    puts,
    dram_evictions,
    nvme_region_evictions,
    dropped_stores,
    // Stores dropped before their NVMe write started because a load short of DRAM slots took their
    // slot (`loads_cancel_queued_writes`).
    cancelled_writes,
    checksum_failures,
    io_errors,
    retired_slots,
    recovered_blocks,
    // Blocks a service kept from the DRAM pool of a dead one it took over (`store/takeover.rs`).
    recovered_dram_blocks,
    slot_wait_timeouts,
    nvme_dropped_writes,
    shared_hits,
    shared_misses,
    shared_files_published,
    shared_bytes_written,
    shared_bytes_read,
    // Bytes of shared-tier reads as their pieces land, before their blocks are verified (a load's
    // progress on a slow mount).
    shared_bytes_received,
    shared_evicted_files,
    shared_quarantined_files,
    shared_publish_errors,
    shared_dropped_publishes,
    // Offers that found every publish staging buffer in use and waited in the backlog (published
    // later from DRAM, or counted in shared_dropped_publishes if the block left DRAM first).
    shared_deferred_publishes,
    shared_auth_failures,
    // Opens under the shared root refused because a symlink, FIFO, socket or device sat where a data
    // file, manifest or lease should be (each refusal; such a data file is also quarantined).
    shared_not_regular_files,
    // The object-storage tier (docs/object-tier.md): blocks served and missed, segment and index
    // objects written, bytes moved, requests by kind, segments evicted for the budget, publishing
    // drops and deferrals (as the shared tier's), blocks refused by checksum or keyed MAC, and
    // failed requests (publishing, refresh, eviction).
    bucket_hits,
    bucket_misses,
    bucket_segments_published,
    bucket_bytes_written,
    bucket_bytes_read,
    // Bytes of ranged GETs as they arrive, before their blocks are verified (a load's progress).
    bucket_bytes_received,
    bucket_get_requests,
    bucket_put_requests,
    bucket_list_requests,
    bucket_delete_requests,
    bucket_evicted_segments,
    // Access objects (the segments each store read, for least-recently-used eviction): written by
    // this store, read by it as the evictor, and refused (corrupt, forged, foreign; each version once).
    bucket_access_objects_put,
    bucket_access_objects_read,
    bucket_access_objects_ignored,
    bucket_dropped_publishes,
    bucket_deferred_publishes,
    bucket_verify_failures,
    bucket_auth_failures,
    bucket_request_errors,
    // Objects copied into the bucket's quarantine/ (corrupt segments and index objects).
    bucket_quarantined_objects,
    // Listed index, access and lease objects longer than their format allows: never fetched (each
    // counted once while it stays listed).
    bucket_oversized_objects,
    // Opens whose first listing of the bucket got no answer (connection refused or timed out): the
    // tier started empty and retried in the background (a refusal refuses the open instead).
    bucket_unreachable_at_open,
    // Remote tiers' health (crate::tiers::health, docs/reliability.md): times a remote tier
    // turned sick (failed reads in a row), lookups and reads of blocks a sick tier indexes that it was
    // not offered (counted misses, recomputed), and how many remote tiers are sick now (a gauge).
    remote_tier_outages,
    remote_tier_lookups_skipped,
    remote_tiers_sick,
    // Remote reads a load stopped waiting for (`remote_read_stall_ms` passed with none of its remote
    // reads finishing, a frozen gateway or FUSE daemon): counted misses, recomputed.
    remote_reads_given_up,
    // Index refreshes of a remote tier that went unanswered for its stall limit (the tier's
    // heartbeat, `tiers::remote::heartbeat`): each made the tier sick before a load met it.
    remote_refreshes_stalled,
    // The NVMe tier's health (the same rules, `store_state::NvmeHealth`): times it turned sick
    // (I/O errors or abandoned reads in a row), lookups and reads of blocks only NVMe holds while it
    // stepped aside (counted misses, recomputed), and whether it is sick now (a gauge, 0 or 1).
    nvme_outages,
    nvme_lookups_skipped,
    nvme_sick,
    // NVMe reads a load stopped waiting for (`nvme_read_stall_ms` passed with none of its NVMe reads
    // finishing, a hung disk): counted misses, recomputed; the tier steps aside until one finishes.
    nvme_reads_given_up,
    // 1 when the store opened without its NVMe tier because its filesystem had no room for the device
    // file (`nvme_without_space = "dram_only"`): a gauge, until the next open.
    nvme_off_no_space,
    // Encryption at rest (`encryption_key_file`, crate::format::encrypted): NVMe values that did not open
    // (another key, changed bytes, or encrypted and no key set): counted misses, never served.
    nvme_auth_failures,
    // Blocks of the shared-filesystem and object tiers that did not decrypt (another key, changed
    // bytes, or encrypted and this store has no key): counted misses, never served.
    remote_decrypt_failures,
    // Writes below DRAM (crate::admission, docs/architecture.md "Writes below DRAM"): stored blocks
    // kept in DRAM only for want of evidence of reuse, such blocks written below DRAM once reused,
    // such blocks evicted from DRAM unused (never written), and writes refused by a tier's write
    // budget (NVMe blocks; remote-tier offers); blocks a caller said will be read again
    // (`Store::note_retained`, a request's retention hint), evidence of reuse by itself.
    writes_awaiting_reuse,
    writes_admitted_on_reuse,
    dropped_without_evidence,
    // Blocks whose NVMe write was wanted (reused, or kept from a pool taken over) and that the full
    // write backlog held in DRAM only, evicted before a later use could write them.
    dropped_behind_backlog,
    nvme_write_budget_refusals,
    remote_write_budget_refusals,
    retained_by_hint,
    // The NVMe tier's I/O pattern, as the device queues submit it (seed 002's experiment 6): requests,
    // their bytes, those starting where the device's previous request of the same kind ended, and
    // how many fall in each size class (upper bounds, `IO_SIZE_CLASSES`).
    nvme_read_requests,
    nvme_read_request_bytes,
    nvme_read_sequential,
    nvme_reads_le_4k,
    nvme_reads_le_16k,
    nvme_reads_le_64k,
    nvme_reads_le_256k,
    nvme_reads_le_1m,
    nvme_reads_le_4m,
    nvme_reads_le_16m,
    nvme_reads_le_64m,
    nvme_reads_gt_64m,
    nvme_write_requests,
    nvme_write_request_bytes,
    nvme_write_sequential,
    nvme_writes_le_4k,
    nvme_writes_le_16k,
    nvme_writes_le_64k,
    nvme_writes_le_256k,
    nvme_writes_le_1m,
    nvme_writes_le_4m,
    nvme_writes_le_16m,
    nvme_writes_le_64m,
    nvme_writes_gt_64m,
);

/// Upper bounds of the request size classes of the I/O pattern counters (a last class takes the rest).
pub const IO_SIZE_CLASSES: [u64; 8] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20];

impl Stats {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

impl Stats {
    /// One request a device queue submitted (not its retries): `sequential` when it starts where the
    /// device's previous request of the same kind ended.
    pub fn record_io(&self, write: bool, len: usize, sequential: bool) {
        let len = len as u64;
        let class = IO_SIZE_CLASSES.iter().position(|&le| len <= le).unwrap_or(IO_SIZE_CLASSES.len());
        let (requests, bytes, seq, classes) = if write {
            let classes = [
                &self.nvme_writes_le_4k,
                &self.nvme_writes_le_16k,
                &self.nvme_writes_le_64k,
                &self.nvme_writes_le_256k,
                &self.nvme_writes_le_1m,
                &self.nvme_writes_le_4m,
                &self.nvme_writes_le_16m,
                &self.nvme_writes_le_64m,
                &self.nvme_writes_gt_64m,
            ];
            (&self.nvme_write_requests, &self.nvme_write_request_bytes, &self.nvme_write_sequential, classes)
        } else {
            let classes = [
                &self.nvme_reads_le_4k,
                &self.nvme_reads_le_16k,
                &self.nvme_reads_le_64k,
                &self.nvme_reads_le_256k,
                &self.nvme_reads_le_1m,
                &self.nvme_reads_le_4m,
                &self.nvme_reads_le_16m,
                &self.nvme_reads_le_64m,
                &self.nvme_reads_gt_64m,
            ];
            (&self.nvme_read_requests, &self.nvme_read_request_bytes, &self.nvme_read_sequential, classes)
        };
        Stats::add(requests, 1);
        Stats::add(bytes, len);
        Stats::add(classes[class], 1);
        if sequential {
            Stats::add(seq, 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_requests_fall_in_their_size_class() {
        let stats = Stats::default();
        stats.record_io(false, 4096, false);
        stats.record_io(false, (16 << 20) + 4096, true);
        stats.record_io(true, 100 << 20, true);
        let s = stats.snapshot();
        assert_eq!((s.nvme_read_requests, s.nvme_read_sequential), (2, 1));
        assert_eq!((s.nvme_reads_le_4k, s.nvme_reads_le_16m, s.nvme_reads_le_64m), (1, 0, 1));
        assert_eq!(s.nvme_read_request_bytes, 4096 + (16 << 20) + 4096);
        assert_eq!((s.nvme_write_requests, s.nvme_writes_gt_64m, s.nvme_write_sequential), (1, 1, 1));
    }
}
