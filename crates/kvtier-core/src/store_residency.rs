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
        let shared = self.shared();
        let local = shared.catalog.lock().residency_changes(full, cap);
        // Generations first, keys after: a change in between is read again next time, never missed.
        let now = shared.remote.generation();
        let unchanged = !full && remote_generation == Some(now);
        let remote = (!unchanged).then(|| shared.remote.indexed_keys(max_remote));
        ResidencyUpdate { local, remote, remote_generation: Some(now) }
    }
}
