//! The data plane: moves bytes between caller memory, DRAM slots and device queues, at locations the
//! catalog hands out. Stores are copied into slots here and written to NVMe behind the caller; loads
//! are streamed (`load`): reads for up to `io_depth` blocks per device are in flight while finished
//! ones are verified (descriptor, key, namespace, sequence, value checksum) and copied out. A block
//! that fails verification is a miss, counted, and dropped from the index: never bytes.

mod load;

pub(crate) use load::{execute_get, execute_get_pinned, execute_read_ahead, probe_sick_tiers};

use crate::admission::Verdict;
use crate::catalog::{Catalog, MetaWrite, Persist, PutStep, WriteOutcome, WritePlan};
use crate::format::descriptor::{Descriptor, DESCRIPTOR_BYTES};
use crate::format::encrypted::{fresh_nonce, page_tenant, set_page_tenant, ValueCipher};
use crate::format::ALIGN_BYTES;
use crate::io::buffer::AlignedBuf;
use crate::io::device::{is_abandoned, is_cancelled, is_shut_down, IoOp};
use crate::io::OpKind;
use crate::key::BlockKey;
use crate::stats::Stats;
use crate::store_state::StoreState;
use crate::tenant::TenantId;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Caller memory for one block: segments whose lengths add up to `object_bytes`.
#[derive(Debug, Clone)]
pub struct BlockBuffer {
    pub segments: Vec<(*mut u8, usize)>,
}

// SAFETY: the caller of the unsafe submission APIs promises the memory outlives the job.
unsafe impl Send for BlockBuffer {}
unsafe impl Sync for BlockBuffer {}

impl BlockBuffer {
    pub fn single(ptr: *mut u8, len: usize) -> Self {
        BlockBuffer { segments: vec![(ptr, len)] }
    }

    pub fn total_bytes(&self) -> usize {
        self.segments.iter().map(|s| s.1).sum()
    }

    /// Engine layout: where block `block_id`'s page starts in a layer buffer of `layer_bytes` that
    /// holds `page_bytes` per block, or `None` when any byte of the page would fall outside it. The
    /// id comes from the caller (Python), so nothing here may wrap: an unchecked `start + page_bytes`
    /// once let id 2^52 - 1 with 4 KiB pages pass as the page 4 KiB before the buffer.
    pub fn layer_page_offset(block_id: usize, page_bytes: usize, layer_bytes: usize) -> Option<usize> {
        let start = block_id.checked_mul(page_bytes)?;
        let end = start.checked_add(page_bytes)?;
        debug_assert_eq!(end - start, page_bytes);
        (end <= layer_bytes).then_some(start)
    }

    /// Every segment starts and ends on a 4096-byte boundary, so an O_DIRECT read can land in it.
    fn direct_capable(&self) -> bool {
        self.segments
            .iter()
            .all(|&(ptr, len)| (ptr as usize).is_multiple_of(ALIGN_BYTES) && len.is_multiple_of(ALIGN_BYTES) && len > 0)
    }
}

/// A slot's bytes, to read.
///
/// # Safety
/// The catalog has handed `slot` to the caller (Filling, Loading, or Resident and pinned or being
/// written) and nothing writes into it while the slice lives: no read is in flight into it.
unsafe fn slot_ref(sh: &StoreState, slot: u32) -> &[u8] {
    std::slice::from_raw_parts(sh.arena.slot_ptr(slot), sh.arena.slot_bytes())
}

/// A slot's bytes, to write. Takes the slot's pointer, not `&StoreState`, so that the exclusive borrow
/// it creates is visibly the caller's claim, not something `&StoreState` grants.
///
/// # Safety
/// The catalog has handed `slot` to the caller alone (Filling or Loading), no I/O is in flight on
/// it, and no other reference to its bytes exists while the slice lives.
unsafe fn slot_mut<'a>(slot_ptr: *mut u8, slot_bytes: usize) -> &'a mut [u8] {
    debug_assert!(!slot_ptr.is_null() && slot_bytes > 0, "slot_mut of no slot");
    std::slice::from_raw_parts_mut(slot_ptr, slot_bytes)
}

/// Walks the caller's segments in cache-sized chunks: `visit(segment pointer, value offset, length)`,
/// so that a copy and a hash can share one pass over each chunk while it is in cache.
fn for_each_chunk(buf: &BlockBuffer, mut visit: impl FnMut(*mut u8, usize, usize)) {
    const CHUNK_BYTES: usize = 128 * 1024;
    let mut at = 0;
    for &(segment, len) in &buf.segments {
        let mut done = 0;
        while done < len {
            let n = CHUNK_BYTES.min(len - done);
            // SAFETY: `done + n <= len`, inside the segment.
            visit(unsafe { segment.add(done) }, at, n);
            done += n;
            at += n;
        }
    }
}

/// Copies a value being stored into its slot and hashes it in the same pass: each cache-sized chunk
/// is hashed right after it is copied, while it is still in cache, instead of reading the whole
/// value back from memory (a store runs beside the engine's compute; memory traffic is what it costs).
fn copy_in_and_checksum(sh: &StoreState, slot: u32, buf: &BlockBuffer) -> u64 {
    debug_assert_eq!(buf.total_bytes(), sh.config.object_bytes, "a put's buffer holds one value");
    debug_assert!(DESCRIPTOR_BYTES + sh.config.object_bytes <= sh.arena.slot_bytes(), "a value fits its slot");
    // SAFETY: the slot is ours (Filling) and the caller's segments are valid for reading
    // (submission contract); the slot's value area holds object_bytes = the segments' total.
    let value = unsafe {
        std::slice::from_raw_parts_mut(sh.arena.slot_ptr(slot).add(DESCRIPTOR_BYTES), sh.config.object_bytes)
    };
    let mut hasher = crate::format::checksum_hasher();
    for_each_chunk(buf, |src, at, n| {
        let chunk = &mut value[at..at + n];
        // SAFETY: see above.
        unsafe { std::ptr::copy_nonoverlapping(src, chunk.as_mut_ptr(), n) };
        std::hash::Hasher::write(&mut hasher, chunk);
    });
    Stats::add(&sh.stats.bytes_copied_in, sh.config.object_bytes as u64);
    std::hash::Hasher::finish(&hasher)
}

pub(crate) fn execute_put(sh: &Arc<StoreState>, keys: &[BlockKey], bufs: &[BlockBuffer]) -> Vec<bool> {
    let n = keys.len();
    let mut results = vec![false; n];
    let batch_max = (sh.arena.slot_count() / 4).clamp(1, 64);
    let mut next = 0;
    let mut deadline: Option<Instant> = None;
    while next < n {
        let mut fills = Vec::new();
        {
            let mut cat = sh.catalog.lock();
            while next < n && fills.len() < batch_max {
                match cat.plan_put(&keys[next]) {
                    PutStep::Present => {
                        note_sighting(sh, &keys[next]);
                        results[next] = true;
                    }
                    PutStep::Fill { slot, sequence, tenant } => {
                        name_tenant(sh, slot, &tenant);
                        fills.push((next, slot, sequence));
                    }
                    PutStep::NoSlot => break,
                }
                next += 1;
            }
            if fills.is_empty() && next < n {
                let until =
                    *deadline.get_or_insert_with(|| Instant::now() + Duration::from_millis(sh.config.slot_wait_ms));
                // On a hung disk no write finishes to make room: dropped now rather than after the wait.
                let hung = sh.nvme_health.hung();
                if hung || (cat.wait_until(&sh.changed, until).timed_out() && Instant::now() >= until) {
                    Stats::add(&sh.stats.slot_wait_timeouts, 1);
                    Stats::add(&sh.stats.dropped_stores, (n - next) as u64);
                    break;
                }
                continue;
            }
            deadline = None;
        }
        let filled: Vec<Filled> = fills
            .iter()
            .map(|&(i, slot, sequence)| Filled {
                key: keys[i],
                slot,
                sequence,
                value_checksum: copy_in_and_checksum(sh, slot, &bufs[i]),
            })
            .collect();
        debug_assert!(filled.len() <= batch_max, "a fill batch past its bound");
        complete_fills(sh, &filled);
        for &(i, _, _) in &fills {
            results[i] = true;
        }
    }
    results
}

/// Copies a DRAM-resident block into `out` as its slot holds it (descriptor page + value), for a
/// remote publisher's backlog; `false` when the block is no longer in DRAM. The descriptor is built
/// from the catalog, not copied: an NVMe write may be stamping the slot's own descriptor page.
pub(crate) fn copy_resident_block(sh: &StoreState, key: &BlockKey, out: &mut [u8]) -> bool {
    let object_bytes = sh.config.object_bytes;
    assert!(out.len() >= DESCRIPTOR_BYTES + object_bytes, "a publish buffer holds a whole slot");
    let Some(block) = sh.catalog.lock().pin_resident_for_copy(key) else { return false };
    assert!((block.slot as usize) < sh.arena.slot_count(), "a resident block in slot {}", block.slot);
    // SAFETY: the block is pinned as a reader: its slot is resident and its value does not change
    // until released. Only the value area is read.
    let value =
        unsafe { std::slice::from_raw_parts(sh.arena.slot_ptr(block.slot).add(DESCRIPTOR_BYTES), object_bytes) };
    out[DESCRIPTOR_BYTES..DESCRIPTOR_BYTES + object_bytes].copy_from_slice(value);
    // SAFETY: as above; a resident slot's tenant is written only while the slot is a fill's or a
    // read's alone (`name_tenant`, a landing), and an NVMe write stamps only the descriptor's used bytes.
    let tenant = page_tenant(unsafe { std::slice::from_raw_parts(sh.arena.slot_ptr(block.slot), DESCRIPTOR_BYTES) });
    sh.catalog.lock().release_readers(std::slice::from_ref(key));
    sh.changed.notify_all();
    Descriptor {
        value_bytes: object_bytes as u32,
        key: *key,
        namespace: sh.namespace,
        sequence: block.sequence,
        region_seq: 0,
        value_checksum: block.value_checksum,
    }
    .encode(&mut out[..DESCRIPTOR_BYTES]);
    set_page_tenant(&mut out[..DESCRIPTOR_BYTES], &tenant);
    true
}

/// Writes the tenant of the block being stored in `slot` into its page (`set_page_tenant`), where the
/// writers below DRAM find it: the NVMe writer seals it under that tenant's key (`encryption_key_file`)
/// and the shared tier's publisher files it with the tenant's other blocks (`tenant_shares_shared_fs`).
/// Always, so that a slot never passes on its previous block's tenant.
fn name_tenant(sh: &StoreState, slot: u32, tenant: &TenantId) {
    // SAFETY: the slot is ours (Filling). Only its descriptor page is touched: other processes may be
    // copying into its value area (a reserved put through the shared pool).
    let page = unsafe { std::slice::from_raw_parts_mut(sh.arena.slot_ptr(slot), DESCRIPTOR_BYTES) };
    set_page_tenant(page, tenant);
}

/// A slot whose value is complete (copied in, here or by engine workers through the shared pool).
pub(crate) struct Filled {
    pub key: BlockKey,
    pub slot: u32,
    pub sequence: u64,
    pub value_checksum: u64,
}

/// Makes filled slots blocks: descriptor, remote-tier offer, visible in the catalog, NVMe write (the
/// last two below DRAM as `admission` decides), then writes the blocks reused meanwhile.
fn complete_fills(sh: &Arc<StoreState>, filled: &[Filled]) {
    let verdicts: Vec<(Persist, bool)> = filled.iter().map(|f| admit_store(sh, &f.key)).collect();
    debug_assert_eq!(verdicts.len(), filled.len());
    for (f, &(_, offer_now)) in filled.iter().zip(&verdicts) {
        // SAFETY: the slot is ours (Filling) and no I/O touches it until finish_put.
        let bytes = unsafe { slot_mut(sh.arena.slot_ptr(f.slot), sh.arena.slot_bytes()) };
        Descriptor {
            value_bytes: sh.config.object_bytes as u32,
            key: f.key,
            namespace: sh.namespace,
            sequence: f.sequence,
            region_seq: 0,
            value_checksum: f.value_checksum,
        }
        .encode(&mut bytes[..DESCRIPTOR_BYTES]);
        if offer_now {
            // Copied while the slot is still ours (Filling); the publisher thread does the rest.
            sh.remote.offer(f.key, bytes);
        }
    }
    let mut meta = Vec::new();
    let mut writes = Vec::new();
    {
        let mut cat = sh.catalog.lock();
        for (f, &(persist, offer_now)) in filled.iter().zip(&verdicts) {
            let plan = cat.finish_put(&f.key, f.slot, f.value_checksum, persist, &mut meta);
            let plan = if persist == Persist::Now { planned_within_budget(sh, plan) } else { plan };
            if let Some(plan) = plan {
                writes.push((f.key, plan));
            }
            if !offer_now && sh.remote.any() {
                cat.await_remote_reuse(&f.key);
            }
        }
    }
    sh.changed.notify_all();
    submit_meta(sh, meta);
    for (key, plan) in writes {
        submit_entry_write(sh, key, plan);
    }
    persist_reused(sh);
}

/// What a block just stored does below DRAM, by evidence of reuse (`admission`, per tier) and the
/// NVMe tier's write budget (the remote tiers check theirs as they take the offer): the NVMe part,
/// and whether the remote tiers are offered it now.
fn admit_store(sh: &StoreState, key: &BlockKey) -> (Persist, bool) {
    let verdict = sh.admission.admits_store(key);
    let has_nvme = sh.geometry.is_some();
    if (has_nvme && !verdict.nvme) || (sh.remote.any() && !verdict.remote) {
        Stats::add(&sh.stats.writes_awaiting_reuse, 1);
    }
    (nvme_part(sh, verdict), verdict.remote)
}

/// The NVMe part of `admit_store` alone, for a block already in DRAM whose write did not run (one
/// kept from a pool taken over: `store::takeover`).
pub(crate) fn admit_nvme_write(sh: &StoreState, key: &BlockKey) -> Persist {
    let verdict = sh.admission.admits_store(key);
    if !verdict.nvme {
        Stats::add(&sh.stats.writes_awaiting_reuse, 1);
    }
    nvme_part(sh, verdict)
}

fn nvme_part(sh: &StoreState, verdict: Verdict) -> Persist {
    if verdict.nvme {
        nvme_budget_allows(sh, verdict.evidence)
    } else {
        Persist::OnReuse
    }
}

/// A block the budget refuses stays in DRAM only; one refused for want of evidence (`all`, the
/// budget's reserve reached) waits there for it, as under `reuse`.
fn nvme_budget_allows(sh: &StoreState, evidence: bool) -> Persist {
    if sh.geometry.is_none() || sh.admission.take_nvme_budget(sh.arena.slot_bytes() as u64, evidence) {
        return Persist::Now;
    }
    Stats::add(&sh.stats.nvme_write_budget_refusals, 1);
    if !evidence && sh.admission.evidence_first() {
        Persist::OnReuse
    } else {
        Persist::DramOnly
    }
}

/// Writes the blocks kept from a tier for want of evidence of reuse that were used since (a load, a
/// pin, a second store) to those tiers: offered to the remote tiers, and written to NVMe within its
/// write budget and backlog. Called after each put, pin and load; cheap when nothing was reused, and
/// free (no lock) until a block may wait for a use (`Admission::may_hold_awaiting`).
pub(crate) fn persist_reused(sh: &Arc<StoreState>) {
    if !sh.admission.may_hold_awaiting() {
        return;
    }
    let reused = sh.catalog.lock().take_reused();
    if reused.is_empty() {
        return;
    }
    let mut slot = Vec::new();
    for (key, _) in reused.iter().filter(|(_, awaiting)| awaiting.remote) {
        slot.resize(sh.arena.slot_bytes(), 0);
        if copy_resident_block(sh, key, &mut slot) {
            sh.remote.offer(*key, &slot);
        }
    }
    let awaiting_nvme = reused.iter().filter(|(_, awaiting)| awaiting.nvme).map(|(key, _)| key);
    let mut waiting_again = 0;
    submit_nvme_writes(sh, awaiting_nvme, |cat, key, meta| {
        if !cat.nvme_write_wanted(key) {
            return None;
        }
        if !cat.write_backlog_has_room() {
            cat.await_nvme_reuse(key); // its next use writes it: a full backlog loses no evidence
            waiting_again += 1;
            return None;
        }
        if nvme_budget_allows(sh, true) != Persist::Now {
            return None;
        }
        planned_within_budget(sh, cat.plan_reused_write(key, meta))
    });
    if waiting_again > 0 {
        sh.admission.note_awaiting_use();
    }
    Stats::add(&sh.stats.writes_admitted_on_reuse, (reused.len() - waiting_again) as u64);
}

/// A write whose bytes the NVMe budget gave (`nvme_budget_allows`) that the catalog did not plan
/// after all (its block left DRAM meanwhile, no NVMe region was free) gives them back.
pub(crate) fn planned_within_budget(sh: &StoreState, plan: Option<WritePlan>) -> Option<WritePlan> {
    if plan.is_none() && sh.geometry.is_some() {
        sh.admission.return_nvme_budget(sh.arena.slot_bytes() as u64);
    }
    plan
}

/// Plans under one catalog lock the NVMe writes `plan` gives for `keys` (`None`: not written now),
/// then submits them.
pub(crate) fn submit_nvme_writes<'k>(
    sh: &Arc<StoreState>,
    keys: impl IntoIterator<Item = &'k BlockKey>,
    mut plan: impl FnMut(&mut Catalog, &BlockKey, &mut Vec<MetaWrite>) -> Option<WritePlan>,
) {
    let mut meta = Vec::new();
    let mut writes = Vec::new();
    {
        let mut cat = sh.catalog.lock();
        for key in keys {
            if let Some(write) = plan(&mut cat, key, &mut meta) {
                writes.push((*key, write));
            }
        }
    }
    submit_meta(sh, meta);
    for (key, write) in writes {
        submit_entry_write(sh, key, write);
    }
}

/// A store of a block the catalog holds, or is filling for another store: evidence of reuse. The
/// catalog hands a block it holds to the tiers that wait for a use (`note_reuse`); one still
/// filling (two engines computed it at once) is noted as seen, so that its own store has the
/// evidence (`Admission::admits_store`).
fn note_sighting(sh: &StoreState, key: &BlockKey) {
    sh.admission.note_retained(key);
}

/// What a reserved put got: a slot to fill, or nothing to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reservation {
    /// Fill the value area of this slot, then commit (or abort) with its sequence.
    Fill { slot: u32, sequence: u64 },
    /// The block is already stored.
    Present,
    /// No slot could be had (DRAM full of pinned or busy slots, or the NVMe write backlog is full):
    /// dropped and counted.
    Dropped,
}

/// How long a reserve that found no slot waits for a change before it looks again: the change
/// that frees one (an unpin, a release, a commit) may have come before the wait began.
const SLOT_FREED_POLL: Duration = Duration::from_millis(50);

/// Waits until the NVMe write backlog admits a put, as a local put does; `false` if it did not by
/// `deadline`, or at once on a hung disk (no write finishes to make room). When the backlog already
/// admits one, the caller found no slot (DRAM full of pinned, read or filling blocks: an engine
/// that froze holding them): it waits for the next change, at most `SLOT_FREED_POLL`, rather than
/// looking again at once (a reserve went round for its whole `slot_wait_ms`, scanning for victims
/// under the catalog lock every call of the namespace needs).
pub(crate) fn wait_for_put_room(sh: &StoreState, deadline: Instant) -> bool {
    let mut cat = sh.catalog.lock();
    if cat.has_put_room() {
        let _ = cat.wait_until(&sh.changed, deadline.min(Instant::now() + SLOT_FREED_POLL));
        return true;
    }
    while !cat.has_put_room() {
        if sh.nvme_health.hung() || cat.wait_until(&sh.changed, deadline).timed_out() {
            return cat.has_put_room();
        }
    }
    true
}

/// Reserves DRAM slots for blocks that other processes fill through the shared pool. Never waits:
/// a block with no slot now is `Dropped` (not counted: the caller may wait and try again).
pub(crate) fn reserve_puts(sh: &StoreState, keys: &[BlockKey]) -> Vec<Reservation> {
    let mut cat = sh.catalog.lock();
    keys.iter()
        .map(|key| match cat.plan_put(key) {
            PutStep::Present => {
                note_sighting(sh, key);
                Reservation::Present
            }
            PutStep::Fill { slot, sequence, tenant } => {
                name_tenant(sh, slot, &tenant);
                Reservation::Fill { slot, sequence }
            }
            PutStep::NoSlot => Reservation::Dropped,
        })
        .collect()
}

/// The reserved slots were filled: checksums their values (the writers are other processes, so the
/// checksum is taken here, after the last of them finished) and stores the blocks.
pub(crate) fn commit_puts(sh: &Arc<StoreState>, fills: &[(BlockKey, u32, u64)]) {
    let object_bytes = sh.config.object_bytes;
    let values: Vec<&[u8]> = fills
        .iter()
        // SAFETY: each slot is ours (Filling) and its writers have finished (commit contract).
        .map(|&(_, slot, _)| &unsafe { slot_ref(sh, slot) }[DESCRIPTOR_BYTES..DESCRIPTOR_BYTES + object_bytes])
        .collect();
    let value_checksums = checksums(&values, sh.config.checksum_threads);
    debug_assert_eq!(value_checksums.len(), fills.len(), "one checksum per fill");
    Stats::add(&sh.stats.bytes_copied_in, (object_bytes * fills.len()) as u64);
    let filled: Vec<Filled> = fills
        .iter()
        .zip(value_checksums)
        .map(|(&(key, slot, sequence), value_checksum)| Filled { key, slot, sequence, value_checksum })
        .collect();
    complete_fills(sh, &filled);
}

/// A commit smaller than this is checksummed on the calling thread (threads cost more than they save).
const PARALLEL_CHECKSUM_MIN_BYTES: usize = 32 << 20;
/// The threads one commit checksums on when `checksum_threads` is 0 (and the cores allow). The
/// service checksums every byte an engine's rank stores: on the H200 machine (docs/gpu.md) a core
/// checksummed about 4 GB/s of the pool, 8 threads about 30 GB/s, against 30-55 GB/s of DMA.
const DEFAULT_CHECKSUM_THREADS: usize = 8;

/// `format::checksum` of each value, in order: on up to `threads` threads (0: the cores, at most
/// `DEFAULT_CHECKSUM_THREADS`; contiguous shares) when the batch is large.
fn checksums(values: &[&[u8]], threads: usize) -> Vec<u64> {
    let total_bytes: usize = values.iter().map(|value| value.len()).sum();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let threads = if threads == 0 { cores.min(DEFAULT_CHECKSUM_THREADS) } else { threads };
    let threads = threads.min(values.len());
    if total_bytes < PARALLEL_CHECKSUM_MIN_BYTES || threads <= 1 {
        return values.iter().map(|value| crate::format::checksum(value)).collect();
    }
    let share = values.len().div_ceil(threads);
    let mut out = vec![0u64; values.len()];
    std::thread::scope(|scope| {
        for (part, sums) in values.chunks(share).zip(out.chunks_mut(share)) {
            scope.spawn(move || {
                for (value, sum) in part.iter().zip(sums.iter_mut()) {
                    *sum = crate::format::checksum(value);
                }
            });
        }
    });
    debug_assert_eq!(out.len(), values.len());
    out
}

/// Gives reserved slots back unfilled.
pub(crate) fn abort_puts(sh: &StoreState, fills: &[(BlockKey, u32)]) {
    let mut cat = sh.catalog.lock();
    for (key, slot) in fills {
        cat.abort_put(key, *slot);
    }
    Stats::add(&sh.stats.dropped_stores, fills.len() as u64);
    drop(cat);
    sh.changed.notify_all();
}

fn submit_entry_write(sh: &Arc<StoreState>, key: BlockKey, plan: WritePlan) {
    // The descriptor on disk records the region generation, which recovery uses to tell a reused
    // region's new entries from stale ones.
    // SAFETY: the slot is marked writing: nothing else writes into it, and no I/O is in flight on it yet.
    let page = unsafe { &mut slot_mut(sh.arena.slot_ptr(plan.slot), sh.arena.slot_bytes())[..DESCRIPTOR_BYTES] };
    if let Err(e) = Descriptor::stamp_region_seq(page, plan.region_seq) {
        // We encoded this descriptor ourselves: failing to read it back is a bug, never a silent skip.
        log::error!(
            "kvtier: the descriptor of {key:?} in DRAM slot {} does not decode ({e}); not writing it to NVMe",
            plan.slot
        );
        Stats::add(&sh.stats.nvme_dropped_writes, 1);
        finish_entry_write(sh, &key, &plan, WriteOutcome::Failed);
        return;
    }
    // With a key, the device writes an encrypted copy, made while the slot is still ours.
    let encrypted = match sh.value_cipher.as_ref().map(|cipher| encrypted_copy(sh, cipher, plan.slot)) {
        None => None,
        Some(Ok(copy)) => Some(copy),
        Some(Err(e)) => {
            log::error!("kvtier: no random nonce for {key:?} ({e}); not writing it to NVMe");
            Stats::add(&sh.stats.nvme_dropped_writes, 1);
            finish_entry_write(sh, &key, &plan, WriteOutcome::Failed);
            return;
        }
    };
    let buf = encrypted.as_ref().map_or(sh.arena.slot_ptr(plan.slot), AlignedBuf::as_ptr);
    // Stamped: from here until the device queue submits it, a load short of slots may take the slot
    // (the gate then cancels the write, which never touches the slot again).
    sh.catalog.lock().write_queued(&key, &plan);
    let geometry = sh.geometry.expect("writes need the NVMe tier");
    debug_assert_eq!(sh.arena.slot_bytes() as u64, geometry.slot_bytes, "a DRAM slot is an NVMe entry");
    debug_assert!(
        plan.loc.offset.is_multiple_of(geometry.slot_bytes)
            && plan.loc.offset + geometry.slot_bytes <= geometry.data_bytes(),
        "an entry write at {} outside its region's data",
        plan.loc.offset
    );
    debug_assert!((buf as usize).is_multiple_of(ALIGN_BYTES), "an entry write from an unaligned buffer");
    let (gate_state, state) = (Arc::clone(sh), Arc::clone(sh));
    sh.devices[plan.loc.device as usize].write(IoOp {
        kind: OpKind::Write,
        offset: geometry.region_offset(plan.loc.region) + plan.loc.offset,
        buf,
        len: sh.arena.slot_bytes(),
        iovecs: Vec::new(),
        file: None,
        gate: Some(Box::new(move || gate_state.catalog.lock().start_write(&plan))),
        on_done: Box::new(move |r| {
            // An abandoned write may still read the slot; reusing it can only change bytes at an
            // NVMe location the catalog records as unwritten (no trailer lists it), so it is freed.
            if r.as_ref().is_err_and(is_abandoned) {
                // The kernel may still read the encrypted copy: it is never freed.
                std::mem::forget(encrypted);
            } else if let Some(buffer) = encrypted {
                give_back_write_buffer(&state, buffer);
            }
            let outcome = write_outcome(&state, &key, &r);
            finish_entry_write(&state, &key, &plan, outcome);
        }),
    });
}

/// What an entry write's completion `r` means for its block.
fn write_outcome(sh: &StoreState, key: &BlockKey, r: &std::io::Result<()>) -> WriteOutcome {
    match r {
        Ok(()) => WriteOutcome::Written,
        Err(e) if is_cancelled(e) => {
            // A load took its slot before the device queue reached it: nothing was written.
            sh.admission.return_nvme_budget(sh.arena.slot_bytes() as u64);
            WriteOutcome::Cancelled
        }
        Err(e) => {
            log::warn!("kvtier: NVMe write of {key:?} failed: {e}; the block stays in DRAM only");
            WriteOutcome::Failed
        }
    }
}

/// A copy of the slot with its value encrypted (`encryption_key_file`): the DRAM pool stays in clear.
fn encrypted_copy(sh: &StoreState, cipher: &ValueCipher, slot: u32) -> std::io::Result<AlignedBuf> {
    let nonce = fresh_nonce()?;
    let reused = sh.write_buffers.lock().pop();
    // Every byte is overwritten below: a reused buffer needs no zeroing.
    let mut copy = reused.unwrap_or_else(|| AlignedBuf::zeroed(sh.arena.slot_bytes()));
    assert_eq!(copy.len(), sh.arena.slot_bytes(), "write buffers hold one slot");
    // SAFETY: the slot is marked writing: nothing else writes into it.
    copy.as_mut_slice().copy_from_slice(unsafe { slot_ref(sh, slot) });
    let (page, rest) = copy.as_mut_slice().split_at_mut(DESCRIPTOR_BYTES);
    let tenant = page_tenant(page);
    cipher.encrypt(page, &mut rest[..sh.config.object_bytes], &tenant, nonce);
    Ok(copy)
}

/// The most memory kept in idle write buffers of encrypted writes, per store.
const WRITE_BUFFERS_MAX_BYTES: usize = 64 << 20;

/// Keeps a finished write's buffer for the next encrypted write: at least one, and up to the writes
/// the devices take at once within `WRITE_BUFFERS_MAX_BYTES`.
fn give_back_write_buffer(sh: &StoreState, buffer: AlignedBuf) {
    debug_assert_eq!(buffer.len(), sh.arena.slot_bytes(), "write buffers hold one slot");
    let most = (WRITE_BUFFERS_MAX_BYTES / buffer.len()).clamp(1, sh.config.io_depth * sh.devices.len().max(1));
    let mut buffers = sh.write_buffers.lock();
    if buffers.len() < most {
        buffers.push(buffer);
    }
}

fn finish_entry_write(sh: &Arc<StoreState>, key: &BlockKey, plan: &WritePlan, outcome: WriteOutcome) {
    let trailer = sh.catalog.lock().complete_write(key, plan, outcome);
    sh.changed.notify_all();
    if let Some(t) = trailer {
        submit_meta(sh, vec![t]);
    }
}

pub(crate) fn submit_meta(sh: &Arc<StoreState>, writes: Vec<MetaWrite>) {
    let Some(geometry) = sh.geometry else { return };
    for write in writes {
        let buf = match &write.entries {
            Some(entries) => crate::tiers::nvme::encode_trailer(&geometry, write.region, write.region_seq, entries),
            None => AlignedBuf::zeroed(geometry.trailer_bytes as usize),
        };
        let state = Arc::clone(sh);
        let ptr = buf.as_ptr();
        let len = buf.len();
        debug_assert_eq!(len as u64, geometry.trailer_bytes, "a trailer write covers the trailer area");
        sh.devices[write.device].write(IoOp {
            kind: OpKind::Write,
            offset: geometry.trailer_offset(write.region),
            buf: ptr,
            len,
            iovecs: Vec::new(),
            file: None,
            gate: None,
            on_done: Box::new(move |r| {
                if r.as_ref().is_err_and(is_abandoned) {
                    std::mem::forget(buf); // the kernel may still read it
                } else {
                    drop(buf);
                }
                // A closed store's queue: no retry could reach the disk, and one line per block would
                // follow a hung close when its writes finish late.
                let shut_down = r.as_ref().is_err_and(is_shut_down);
                if let (Err(e), false) = (&r, shut_down) {
                    log::warn!("kvtier: writing the trailer of region {} failed: {e}", write.region);
                }
                let retry = state.catalog.lock().complete_meta(&write, r.is_ok()).filter(|_| !shut_down);
                state.changed.notify_all();
                if let Some(retry) = retry {
                    submit_meta(&state, vec![retry]);
                }
            }),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::BlockBuffer;

    #[test]
    fn layer_page_offset_accepts_exactly_the_pages_inside_the_layer() {
        let page = 4096;
        assert_eq!(BlockBuffer::layer_page_offset(0, page, 4 * page), Some(0));
        assert_eq!(BlockBuffer::layer_page_offset(3, page, 4 * page), Some(3 * page));
        assert_eq!(BlockBuffer::layer_page_offset(4, page, 4 * page), None);
        assert_eq!(BlockBuffer::layer_page_offset(0, page, page - 1), None);
        assert_eq!(BlockBuffer::layer_page_offset(0, 0, 0), Some(0));
    }

    #[test]
    fn layer_page_offset_refuses_ids_whose_page_wraps_or_overflows() {
        let page = 4096usize;
        // start = 2^64 - 4096: `start + page` wraps to 0, which an unchecked sum took for in bounds.
        let wrapping = (1usize << 52) - 1;
        assert_eq!(wrapping.wrapping_mul(page).wrapping_add(page), 0);
        for id in [wrapping, 1 << 52, usize::MAX / page + 1, usize::MAX] {
            assert_eq!(BlockBuffer::layer_page_offset(id, page, usize::MAX), None, "id {id}");
        }
        for id in [wrapping, wrapping - 1, 1 << 52, (1 << 30) / page, usize::MAX] {
            assert_eq!(BlockBuffer::layer_page_offset(id, page, 1 << 30), None, "id {id}");
        }
        // The page just below the wrap still fits a buffer that reaches the top of the address space.
        assert_eq!(BlockBuffer::layer_page_offset(wrapping - 1, page, usize::MAX), Some(usize::MAX - 2 * page + 1));
        // Every page size: the last id whose page starts below 2^64 ends past it, and is refused.
        for page in [1usize, 2, 3, 512, 4096, 12_288, 1 << 20, usize::MAX / 3] {
            let id = usize::MAX / page;
            assert_eq!(BlockBuffer::layer_page_offset(id, page, usize::MAX), None, "page {page}");
        }
    }
}

#[cfg(test)]
mod checksum_tests {
    use super::{checksums, PARALLEL_CHECKSUM_MIN_BYTES};

    #[test]
    fn parallel_checksums_match_one_thread_in_order() {
        let value_bytes = 1 << 20;
        let count = PARALLEL_CHECKSUM_MIN_BYTES / value_bytes + 7; // past the threshold, uneven shares
        let data: Vec<Vec<u8>> =
            (0..count).map(|i| (0..value_bytes).map(|j| (i * 31 + j * 7 % 251) as u8).collect()).collect();
        let values: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let expected: Vec<u64> = values.iter().map(|value| crate::format::checksum(value)).collect();
        for threads in [0, 1, 3, 64] {
            assert_eq!(checksums(&values, threads), expected);
        }
        assert_eq!(checksums(&values[..3], 0), expected[..3]); // small: the calling thread
        assert!(checksums(&[], 0).is_empty());
    }
}
