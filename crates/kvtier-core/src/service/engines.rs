//! Per-engine counters of one namespace: what each engine sharing the host's pool looked up,
//! loaded and stored. An engine names itself with `Op::Label` on each of its connections (the
//! scheduler's and every rank's); unlabelled connections count only in the namespace's totals.
//! The table is bounded: a label past `MAX_ENGINES` replaces the one idle the longest, so engines
//! that restart under new labels cannot grow the service's memory.

use crate::catalog::{Tier, TIER_ROWS};
use std::collections::HashMap;

/// Labels kept per namespace.
pub const MAX_ENGINES: usize = 64;

/// One engine's counts. Lookups count blocks (the scheduler asks once per block); loads and stores
/// count slices (each rank moves its own slice of a block).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EngineCounters {
    /// Blocks found, per tier (`Tier as usize`; on the wire by `TierRow::lookup_counter`). Until the
    /// object tier had its own counter (`lookup_bucket`), `lookup_shared` counted both remote tiers.
    pub lookups: [u64; TIER_ROWS.len()],
    pub lookup_miss: u64,
    pub loaded_slices: u64,
    pub load_missed_slices: u64,
    pub stored_slices: u64,
    pub dropped_slices: u64,
    /// What the engine counted itself and reported (`Op::Report`), in `ENGINE_REPORTED`'s order.
    pub reported: [u64; ENGINE_REPORTED.len()],
}

/// What an engine served at recompute because the service did not answer, as it reports it
/// (`Op::Report`): calls that failed (sent, then timed out or broke; each answered with its miss),
/// outages (times the service stopped answering), jobs given up after a stall (loads recomputed,
/// stores not stored), loads and store blocks answered at once while the job thread was stuck in a
/// call, and calls answered with their miss without being sent while the service was stepped aside
/// (added last: an older service ignores the name).
pub const ENGINE_FALLBACKS: [&str; 7] = [
    "failed_calls",
    "outages",
    "given_up_loads",
    "given_up_stores",
    "skipped_loads",
    "skipped_store_blocks",
    "stepped_aside_calls",
];

/// Loads a worker held until its connection reattached to a service started again (vLLM's plain
/// `OffloadingConnector`, which stops the engine on a failed load): served late, not recomputed, so
/// not a fallback.
pub const LOADS_AFTER_REATTACH: &str = "loads_after_reattach";

/// Every count an engine reports of itself: its fallbacks, then the loads it held for a reattach.
pub const ENGINE_REPORTED: [&str; ENGINE_FALLBACKS.len() + 1] = reported_names();

const fn reported_names() -> [&'static str; ENGINE_FALLBACKS.len() + 1] {
    let mut names = [LOADS_AFTER_REATTACH; ENGINE_FALLBACKS.len() + 1];
    let mut i = 0;
    while i < ENGINE_FALLBACKS.len() {
        names[i] = ENGINE_FALLBACKS[i];
        i += 1;
    }
    names
}

impl EngineCounters {
    /// The lookup counter of a block found in `tier` (`None`: a miss).
    pub fn lookup(&mut self, tier: Option<Tier>) -> &mut u64 {
        match tier {
            None => &mut self.lookup_miss,
            Some(tier) => &mut self.lookups[tier as usize],
        }
    }

    /// Adds an engine's report; names not in `ENGINE_REPORTED` (a newer engine's) are ignored.
    pub fn add_reported(&mut self, counts: &[(String, u64)]) {
        for (name, value) in counts {
            if let Some(i) = ENGINE_REPORTED.iter().position(|known| known == name) {
                self.reported[i] = self.reported[i].saturating_add(*value);
            }
        }
    }

    /// Name and value of each counter, in the wire's pair form (docs/service.md).
    pub fn fields(&self) -> Vec<(&'static str, u64)> {
        // Pairs are read by name: a tier added last (as the bucket was) is a pair an older reader skips.
        let mut fields: Vec<(&'static str, u64)> =
            TIER_ROWS.iter().map(|row| (row.lookup_counter, self.lookups[row.tier as usize])).collect();
        fields.extend([
            ("lookup_miss", self.lookup_miss),
            ("loaded_slices", self.loaded_slices),
            ("load_missed_slices", self.load_missed_slices),
            ("stored_slices", self.stored_slices),
            ("dropped_slices", self.dropped_slices),
        ]);
        fields.extend(ENGINE_REPORTED.iter().copied().zip(self.reported));
        fields
    }
}

#[derive(Default)]
pub struct EngineTable {
    /// Per label: its counters and the tick of its last update.
    entries: HashMap<String, (EngineCounters, u64)>,
    tick: u64,
}

impl EngineTable {
    /// Applies `update` to `label`'s counters, making room for a new label if needed.
    pub fn record(&mut self, label: &str, update: impl FnOnce(&mut EngineCounters)) {
        self.tick += 1;
        // Every op of a labelled connection lands here: a known label costs a lookup, no allocation.
        if let Some((counters, at)) = self.entries.get_mut(label) {
            update(counters);
            *at = self.tick;
            return;
        }
        if self.entries.len() >= MAX_ENGINES {
            let idlest = self.entries.iter().min_by_key(|(_, (_, at))| *at).map(|(name, _)| name.clone());
            if let Some(idlest) = idlest {
                self.entries.remove(&idlest);
            }
        }
        let mut counters = EngineCounters::default();
        update(&mut counters);
        self.entries.insert(label.to_string(), (counters, self.tick));
    }

    /// Every label's counters, sorted by label.
    pub fn snapshot(&self) -> Vec<(String, EngineCounters)> {
        let mut out: Vec<(String, EngineCounters)> =
            self.entries.iter().map(|(name, (counters, _))| (name.clone(), *counters)).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_per_label() {
        let mut table = EngineTable::default();
        table.record("engine-a", |c| c.loaded_slices += 3);
        table.record("engine-b", |c| c.stored_slices += 2);
        table.record("engine-a", |c| c.lookups[Tier::Dram as usize] += 5);
        let snapshot = table.snapshot();
        assert_eq!(snapshot.len(), 2);
        assert_eq!(snapshot[0].0, "engine-a");
        assert_eq!((snapshot[0].1.loaded_slices, snapshot[0].1.lookups[Tier::Dram as usize]), (3, 5));
        assert_eq!(snapshot[1].1.stored_slices, 2);
    }

    #[test]
    fn each_tier_a_lookup_names_has_its_own_counter() {
        let mut counters = EngineCounters::default();
        let tiers =
            [Some(Tier::Dram), Some(Tier::Nvme), Some(Tier::Shared), Some(Tier::Bucket), Some(Tier::Bucket), None];
        for tier in tiers {
            *counters.lookup(tier) += 1;
        }
        let fields: std::collections::HashMap<_, _> = counters.fields().into_iter().collect();
        let lookups =
            ["lookup_dram", "lookup_nvme", "lookup_shared", "lookup_bucket", "lookup_miss"].map(|n| fields[n]);
        assert_eq!(lookups, [1, 1, 1, 2, 1], "the bucket's lookups are not the shared filesystem's");
    }

    #[test]
    fn reports_add_up_and_unknown_names_are_ignored() {
        let mut table = EngineTable::default();
        let report = |pairs: &[(&str, u64)]| pairs.iter().map(|(n, v)| (n.to_string(), *v)).collect::<Vec<_>>();
        table.record("engine-a", |c| c.add_reported(&report(&[("failed_calls", 2), ("from_the_future", 9)])));
        table.record("engine-a", |c| c.add_reported(&report(&[("failed_calls", 1), ("given_up_loads", 4)])));
        table.record("engine-a", |c| c.add_reported(&report(&[(LOADS_AFTER_REATTACH, 2)])));
        let (_, counters) = &table.snapshot()[0];
        let fields: std::collections::HashMap<_, _> = counters.fields().into_iter().collect();
        assert_eq!((fields["failed_calls"], fields["given_up_loads"], fields["outages"]), (3, 4, 0));
        assert_eq!(fields[LOADS_AFTER_REATTACH], 2, "a load held for a reattach is reported beside the fallbacks");
        assert!(!fields.contains_key("from_the_future"));
    }

    #[test]
    fn a_label_past_the_bound_replaces_the_idlest() {
        let mut table = EngineTable::default();
        for i in 0..MAX_ENGINES {
            table.record(&format!("engine-{i:02}"), |c| c.loaded_slices += 1);
        }
        table.record("engine-00", |c| c.loaded_slices += 1); // engine-01 is now the idlest
        table.record("newcomer", |c| c.loaded_slices += 1);
        let labels: Vec<String> = table.snapshot().into_iter().map(|(name, _)| name).collect();
        assert_eq!(labels.len(), MAX_ENGINES);
        assert!(labels.contains(&"newcomer".to_string()) && labels.contains(&"engine-00".to_string()));
        assert!(!labels.contains(&"engine-01".to_string()), "the idlest label goes");
    }
}
