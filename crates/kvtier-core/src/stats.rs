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
    bytes_read_nvme,
    bytes_written_nvme,
    bytes_copied_in,
    bytes_copied_out,
    puts,
    dram_evictions,
    nvme_region_evictions,
    dropped_stores,
    checksum_failures,
    io_errors,
    retired_slots,
    recovered_blocks,
    slot_wait_timeouts,
    nvme_dropped_writes,
    shared_hits,
    shared_misses,
    shared_files_published,
    shared_bytes_written,
    shared_bytes_read,
    shared_evicted_files,
    shared_quarantined_files,
    shared_publish_errors,
    shared_dropped_publishes,
    shared_auth_failures,
);

impl Stats {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}
