//! Per-namespace latency histograms of the service's ops, as the service measures them (from a
//! request's arrival to its reply being built), for `kvtier serve --metrics-port` and `kvtier top`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the buckets, in microseconds (a last bucket, +Inf, takes the rest).
pub const BUCKETS_US: [u64; 14] =
    [50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000];

/// The op classes measured: lookups (`Locate`, `Pin`), loads (`Acquire`: DRAM hit, or an NVMe or
/// shared-tier read into the pool), and the two halves of a store (`Reserve`, `Commit`).
pub const CLASSES: [&str; 4] = ["lookup", "load", "reserve", "commit"];

#[derive(Default)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS_US.len() + 1],
    count: AtomicU64,
    sum_us: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, elapsed: Duration) {
        let us = elapsed.as_micros().min(u128::from(u64::MAX)) as u64;
        let at = BUCKETS_US.iter().position(|&le| us <= le).unwrap_or(BUCKETS_US.len());
        self.buckets[at].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// `(name, value)` pairs: `latency_<class>_count`, `_sum_us`, and cumulative `_le_<us>` buckets.
    pub fn fields(&self, class: &str, out: &mut Vec<(String, u64)>) {
        out.push((format!("latency_{class}_count"), self.count.load(Ordering::Relaxed)));
        out.push((format!("latency_{class}_sum_us"), self.sum_us.load(Ordering::Relaxed)));
        let mut cumulative = 0;
        for (i, le) in BUCKETS_US.iter().enumerate() {
            cumulative += self.buckets[i].load(Ordering::Relaxed);
            out.push((format!("latency_{class}_le_{le}"), cumulative));
        }
    }
}

#[derive(Default)]
pub struct OpLatencies {
    pub by_class: [Histogram; CLASSES.len()],
}

impl OpLatencies {
    pub fn fields(&self, out: &mut Vec<(String, u64)>) {
        for (class, h) in CLASSES.iter().zip(&self.by_class) {
            h.fields(class, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(40));
        h.observe(Duration::from_micros(700));
        h.observe(Duration::from_secs(5));
        let mut out = Vec::new();
        h.fields("load", &mut out);
        let get = |n: &str| out.iter().find(|(k, _)| k == n).unwrap().1;
        assert_eq!(get("latency_load_count"), 3);
        assert_eq!(get("latency_load_le_50"), 1);
        assert_eq!(get("latency_load_le_500"), 1);
        assert_eq!(get("latency_load_le_1000"), 2);
        assert_eq!(get("latency_load_le_1000000"), 2);
        assert_eq!(get("latency_load_sum_us"), 5_000_740);
    }
}
