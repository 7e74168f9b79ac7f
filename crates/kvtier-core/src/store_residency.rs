//! What the service's change log reads from a store on each refresh (`service::changes`): the
//! local tiers of the blocks whose tiers changed (the catalog tracks them, `Catalog::residency_changes`)
//! and the remote tiers' keys when their indexes changed. A refresh holds the catalog's lock for
//! O(changes), not for a walk of millions of entries.

use crate::catalog::ResidencyChanges;
use crate::key::BlockKey;
pub use crate::remote_tiers::RemoteGeneration;
use crate::store::Store;

/// `Store::residency_changes`'s answer.
pub struct ResidencyUpdate {
    /// The local tiers (bit 0 DRAM, bit 1 NVMe) of every block or of the blocks that changed.
    pub local: ResidencyChanges,
    /// The keys in the remote tiers now (shared filesystem, object store), at most `max_remote`
    /// of each; `None`: unchanged since the generation the caller passed.
    pub remote: Option<Vec<BlockKey>>,
    /// The remote generation to pass next time.
    pub remote_generation: Option<RemoteGeneration>,
}

impl Store {
    /// What changed since the last call: see `ResidencyUpdate`. `full`: the caller has not seen
    /// the state yet (every block and the remote keys are read whatever changed). `cap`: past this
    /// many changed keys the catalog stops recording them and the next call walks its index.
    pub(crate) fn residency_changes(
        &self,
        full: bool,
        cap: usize,
        max_remote: usize,
        remote_generation: Option<RemoteGeneration>,
    ) -> ResidencyUpdate {
        let state = self.state();
        let local = state.catalog.lock().residency_changes(full, cap);
        // Generations first, keys after: a change in between is read again next time, never missed.
        let now = state.remote.generation();
        let unchanged = !full && remote_generation == Some(now);
        let remote = (!unchanged).then(|| state.remote.indexed_keys(max_remote));
        ResidencyUpdate { local, remote, remote_generation: Some(now) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StoreConfig;
    use crate::tiers::shared::SharedConfig;
    use std::collections::HashSet;

    const OBJECT_BYTES: usize = 4096;

    fn key(i: u64) -> BlockKey {
        BlockKey(*blake3::hash(&i.to_le_bytes()).as_bytes())
    }

    /// A store whose remote tier holds more keys than the report takes: the keys it names stay
    /// named while the blocks are there, whatever the remote index gains (and however its map grows).
    #[test]
    fn a_present_remote_block_is_never_reported_removed_past_the_cut() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = StoreConfig::new(dir.path().join("local"), OBJECT_BYTES);
        config.namespace = b"residency-cut-test".to_vec();
        config.nvme_bytes = 0;
        config.dram_bytes = 64 * 2 * OBJECT_BYTES;
        let mut shared = SharedConfig::new(dir.path().join("shared"));
        shared.publish_delay_ms = 20;
        config.shared = Some(shared);
        let store = Store::open(config).unwrap();
        let (max_remote, mut generation, mut named) = (16, None, HashSet::new());
        for round in 0..20u64 {
            let keys: Vec<BlockKey> = (round * 25..(round + 1) * 25).map(key).collect();
            let value = vec![round as u8; OBJECT_BYTES];
            assert!(store.put_many(&keys, &vec![value.as_slice(); keys.len()]).unwrap().iter().all(|&ok| ok));
            store.flush().unwrap();
            let update = store.residency_changes(false, 1024, max_remote, generation);
            generation = update.remote_generation;
            let now: HashSet<BlockKey> = update.remote.expect("the remote index grew").into_iter().collect();
            assert_eq!(now.len(), max_remote, "as many as the report takes, at round {round}");
            let dropped = named.difference(&now).count();
            assert_eq!(dropped, 0, "{dropped} present blocks reported removed at round {round}");
            named = now;
        }
    }
}
