//! What a store keeps of a DRAM pool it took over from a dead service (`Arena::adopted`): the
//! blocks of the slots marked resident (`ResidentMarks`) whose descriptor names this namespace and
//! object size and whose value matches its checksum. The rest of the pool is free.

use crate::catalog::{Catalog, Persist, PoolBlock};
use crate::format::checksum;
use crate::format::descriptor::{Descriptor, DESCRIPTOR_BYTES};
use crate::format::encrypted::page_tenant;
use crate::key::{BlockKey, Namespace};
use crate::mover::{admit_nvme_write, planned_within_budget, submit_nvme_writes};
use crate::stats::Stats;
use crate::store_state::StoreState;
use crate::tiers::dram::Arena;
use std::sync::Arc;

/// Indexes what a pool taken over still holds (after NVMe recovery, before any use), then keeps
/// the pool's resident marks in step with the catalog. Does nothing for an anonymous pool. Returns
/// the kept blocks NVMe recovery did not find: the dead service had accepted them, and their NVMe
/// writes had not run (`persist_kept` decides them again).
pub(super) fn keep_taken_over_blocks(
    arena: &Arena,
    catalog: &mut Catalog,
    namespace: Namespace,
    object_bytes: usize,
) -> Vec<BlockKey> {
    let Some(marks) = arena.resident_marks() else { return Vec::new() };
    let mut dram_only = Vec::new();
    if arena.adopted() {
        let started = std::time::Instant::now();
        let marked: Vec<u32> = (0..arena.slot_count() as u32).filter(|&slot| marks.get(slot)).collect();
        let found: Vec<PoolBlock> =
            marked.iter().filter_map(|&slot| check_slot(arena, slot, namespace, object_bytes)).collect();
        let kept;
        (kept, dram_only) = catalog.keep_pool_blocks(&found);
        log::info!(
            "kvtier: kept {kept} blocks of the pool taken over ({} slots marked resident, {} whole, {} in DRAM only) \
             in {:?}",
            marked.len(),
            found.len(),
            dram_only.len(),
            started.elapsed()
        );
    }
    catalog.set_resident_marks(marks);
    dram_only
}

/// Admits the NVMe writes of `dram_only` (`keep_taken_over_blocks`) as a new put's would be: each is
/// written now when the admission policy, the write budget and the write backlog let it (`all`, the
/// default), or waits for a use (`reuse`, the budget's evidence-first reserve, a full backlog),
/// which `persist_reused` then writes whatever the policy. The remote tiers are offered each at its
/// first use: the dead service's publishers went with it.
pub(super) fn persist_kept(sh: &Arc<StoreState>, dram_only: &[BlockKey]) {
    if dram_only.is_empty() {
        return;
    }
    let mut awaiting = false;
    if sh.remote.any() {
        let mut cat = sh.catalog.lock();
        dram_only.iter().for_each(|key| cat.await_remote_reuse(key));
        awaiting = true;
    }
    if sh.geometry.is_some() {
        let mut past_the_backlog = 0;
        submit_nvme_writes(sh, dram_only, |cat, key, meta| {
            if !cat.write_backlog_has_room() {
                if sh.admission.admits_store(key).nvme {
                    cat.await_nvme_reuse(key); // the policy would write it: only the backlog holds it
                }
                past_the_backlog += 1;
                awaiting = true;
                return None;
            }
            if admit_nvme_write(sh, key) != Persist::Now {
                awaiting = true;
                return None;
            }
            let plan = planned_within_budget(sh, cat.plan_kept_write(key, meta));
            awaiting |= plan.is_none();
            plan
        });
        Stats::add(&sh.stats.writes_awaiting_reuse, past_the_backlog);
    }
    if awaiting {
        sh.admission.note_awaiting_use(); // their first use writes them (`persist_reused`)
    }
}

/// The block in `slot`, if its descriptor is this store's and its value is whole.
fn check_slot(arena: &Arena, slot: u32, namespace: Namespace, object_bytes: usize) -> Option<PoolBlock> {
    assert!(DESCRIPTOR_BYTES + object_bytes <= arena.slot_bytes(), "a value past its slot");
    // SAFETY: inside the slot; no other process maps a pool taken over (`adopt_orphan_pool`), and
    // the store is not open yet.
    let bytes = unsafe { std::slice::from_raw_parts(arena.slot_ptr(slot), DESCRIPTOR_BYTES + object_bytes) };
    let (page, value) = bytes.split_at(DESCRIPTOR_BYTES);
    let d = Descriptor::decode(page).ok()?;
    let ours = d.namespace == namespace && d.value_bytes as usize == object_bytes;
    (ours && checksum(value) == d.value_checksum).then(|| PoolBlock {
        slot,
        key: d.key,
        sequence: d.sequence,
        value_checksum: d.value_checksum,
        tenant: page_tenant(page),
    })
}
