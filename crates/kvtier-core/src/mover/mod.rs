//! The data plane: moves bytes between caller memory, DRAM slots and device queues, at locations the
//! catalog hands out. Loads are streamed: reads for up to `max_inflight` blocks are in flight while
//! finished ones are verified (descriptor, key, namespace, sequence, value checksum) and copied out.
//! A block that fails verification is a miss, counted, and dropped from the index: never bytes.

use crate::catalog::{Catalog, GetStep, LoadOutcome, MetaWrite, NvmeRead, PutStep, WriteOutcome, WritePlan, NO_SLOT};
use crate::format::descriptor::{Descriptor, DESCRIPTOR_BYTES};
use crate::format::ALIGN_BYTES;
use crate::io::buffer::AlignedBuf;
use crate::io::device::OnDone;
use crate::io::device::{is_abandoned, is_cancelled, IoOp};
use crate::io::OpKind;
use crate::key::BlockKey;
use crate::shared_state::Shared;
use crate::stats::Stats;
use crate::tiers::object::ObjectRead;
use crate::tiers::shared::{ReadOutcome, StartedRead};
use crossbeam_channel::unbounded;
use std::collections::HashSet;
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
        (end <= layer_bytes).then_some(start)
    }

    /// Every segment starts and ends on a 4096-byte boundary, so an O_DIRECT read can land in it.
    fn direct_capable(&self) -> bool {
        self.segments
            .iter()
            .all(|&(ptr, len)| (ptr as usize).is_multiple_of(ALIGN_BYTES) && len.is_multiple_of(ALIGN_BYTES) && len > 0)
    }
}

/// Where a load's bytes landed.
enum Landing {
    /// In its DRAM slot (promoted to the DRAM tier on success).
    Slot,
    /// Value in the caller's memory; the descriptor in this page.
    Direct(AlignedBuf),
    /// In a heap staging buffer, because every DRAM slot was pinned or busy.
    Staged(AlignedBuf),
}

/// A read of `get_blocks` that finished: NVMe reads carry where they landed; a shared-tier read's
/// state waits in the load's table of started reads (its `on_done` can run before `start_read`
/// returns it).
enum Done {
    Nvme(usize, NvmeRead, std::io::Result<()>, Landing),
    Shared(usize, std::io::Result<()>),
}

/// A remote read in flight: from the shared filesystem tier or from the object tier.
enum RemoteRead {
    Fs(StartedRead),
    Object(ObjectRead),
}

/// Starts reading `key` into `slot` from the tier that indexes it (the shared tier first).
///
/// # Safety
/// As `SharedTier::start_read`: the slot is ours until the read is judged by `finish_remote_read`.
unsafe fn start_remote_read(sh: &Shared, key: &BlockKey, slot: *mut u8, on_done: OnDone) -> Option<RemoteRead> {
    if let Some(tier) = sh.shared_tier.as_ref().filter(|t| t.contains(key) || sh.object_tier.is_none()) {
        // SAFETY: forwarded contract.
        return unsafe { tier.start_read(key, slot, on_done) }.map(RemoteRead::Fs);
    }
    let tier = sh.object_tier.as_ref().expect("remote reads need the shared or the object tier");
    // SAFETY: forwarded contract.
    unsafe { tier.start_read(key, slot, on_done) }.map(RemoteRead::Object)
}

/// Judges a finished remote read (see `start_remote_read`).
///
/// # Safety
/// The read into `slot` finished.
unsafe fn finish_remote_read(sh: &Shared, read: RemoteRead, slot: *mut u8, result: std::io::Result<()>) -> ReadOutcome {
    match read {
        RemoteRead::Fs(read) => {
            let tier = sh.shared_tier.as_ref().expect("shared reads need the shared tier");
            // SAFETY: forwarded contract.
            unsafe { tier.finish_started(read, slot, result) }
        }
        RemoteRead::Object(read) => {
            let tier = sh.object_tier.as_ref().expect("object reads need the object tier");
            // SAFETY: forwarded contract.
            unsafe { tier.finish_started(read, slot, result) }
        }
    }
}

/// Heap-staged loads in flight per call, when no DRAM slot can be had.
const MAX_STAGED_READS: usize = 4;

/// Hashes the value a direct read left in the caller's memory.
fn checksum_segments(buf: &BlockBuffer) -> u64 {
    let mut hasher = crate::format::checksum_hasher();
    for &(ptr, len) in &buf.segments {
        // SAFETY: the read filled the segment; the caller keeps it alive (submission contract).
        std::hash::Hasher::write(&mut hasher, unsafe { std::slice::from_raw_parts(ptr, len) });
    }
    std::hash::Hasher::finish(&hasher)
}

/// Checks a direct read: the descriptor landed in `page`, the value in the caller's segments.
fn verify_direct(sh: &Shared, key: &BlockKey, read: &NvmeRead, page: &AlignedBuf, buf: &BlockBuffer) -> bool {
    let Ok(desc) = Descriptor::decode(page.as_slice()) else { return false };
    desc.key == *key
        && desc.namespace == sh.namespace
        && desc.value_bytes as usize == sh.config.object_bytes
        && desc.sequence == read.sequence
        && desc.value_checksum == read.value_checksum
        && checksum_segments(buf) == desc.value_checksum
}

/// Copies a slot's value out to the caller's segments (a DRAM hit).
///
/// SAFETY (callers): the slot is pinned and the caller's segments are valid for writing
/// (submission contract).
fn copy_value_out(sh: &Shared, slot: u32, buf: &BlockBuffer) {
    let mut value = unsafe { sh.arena.slot_ptr(slot).add(DESCRIPTOR_BYTES) };
    for &(segment, len) in &buf.segments {
        unsafe {
            std::ptr::copy_nonoverlapping(value, segment, len);
            value = value.add(len);
        }
    }
    Stats::add(&sh.stats.bytes_copied_out, sh.config.object_bytes as u64);
}

/// A slot's bytes, to read.
///
/// # Safety
/// The catalog has handed `slot` to the caller (Filling, Loading, or Resident and pinned or being
/// written) and nothing writes into it while the slice lives: no read is in flight into it.
unsafe fn slot_ref(sh: &Shared, slot: u32) -> &[u8] {
    std::slice::from_raw_parts(sh.arena.slot_ptr(slot), sh.arena.slot_bytes())
}

/// A slot's bytes, to write. Takes the slot's pointer, not `&Shared`, so that the exclusive borrow
/// it creates is visibly the caller's claim, not something `&Shared` grants.
///
/// # Safety
/// The catalog has handed `slot` to the caller alone (Filling or Loading), no I/O is in flight on
/// it, and no other reference to its bytes exists while the slice lives.
unsafe fn slot_mut<'a>(slot_ptr: *mut u8, slot_bytes: usize) -> &'a mut [u8] {
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

/// Checks a slot just read from NVMe against what the index expects and copies its value out.
/// The value is hashed and copied in cache-sized chunks (one pass over memory instead of two); if the
/// checksum then fails the caller's buffer holds unspecified bytes and the block is reported a miss.
fn verify_and_copy_out(sh: &Shared, key: &BlockKey, read: &NvmeRead, bytes: &[u8], buf: Option<&BlockBuffer>) -> bool {
    let Ok(desc) = Descriptor::decode(&bytes[..DESCRIPTOR_BYTES]) else { return false };
    let object_bytes = sh.config.object_bytes;
    let header_ok = desc.key == *key
        && desc.namespace == sh.namespace
        && desc.value_bytes as usize == object_bytes
        && desc.sequence == read.sequence
        && desc.value_checksum == read.value_checksum;
    if !header_ok {
        return false;
    }
    let value = &bytes[DESCRIPTOR_BYTES..DESCRIPTOR_BYTES + object_bytes];
    let Some(buf) = buf else { return crate::format::checksum(value) == desc.value_checksum };
    let mut hasher = crate::format::checksum_hasher();
    for_each_chunk(buf, |dst, at, n| {
        let chunk = &value[at..at + n];
        std::hash::Hasher::write(&mut hasher, chunk);
        // SAFETY: the caller's segment is valid for writing (submission contract).
        unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), dst, n) };
    });
    Stats::add(&sh.stats.bytes_copied_out, object_bytes as u64);
    std::hash::Hasher::finish(&hasher) == desc.value_checksum
}

/// Copies a value being stored into its slot and hashes it in the same pass: each cache-sized chunk
/// is hashed right after it is copied, while it is still in cache, instead of reading the whole
/// value back from memory (a store runs beside the engine's compute; memory traffic is what it costs).
fn copy_in_and_checksum(sh: &Shared, slot: u32, buf: &BlockBuffer) -> u64 {
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

/// Loads blocks: into the caller's buffers (`Some`), or only into DRAM slots (`None`: promoting them
/// for engine workers that copy out of the shared pool themselves).
pub(crate) fn execute_get(sh: &Arc<Shared>, keys: &[BlockKey], bufs: Option<&[BlockBuffer]>) -> Vec<bool> {
    get_blocks(sh, keys, bufs, None)
}

/// Makes blocks resident in DRAM and pins each one found, in the same catalog critical section that
/// finishes its load (a store elsewhere could otherwise evict it in between): per key its pinned
/// slot, or `None` for a miss. The caller unpins each slot it got.
pub(crate) fn execute_get_pinned(sh: &Arc<Shared>, keys: &[BlockKey]) -> Vec<Option<u32>> {
    let mut pinned = vec![None; keys.len()];
    get_blocks(sh, keys, None, Some(&mut pinned));
    pinned
}

/// Pins a block whose load just finished, when the caller asked for pins (`pinned`).
fn hold(cat: &mut Catalog, key: &BlockKey, pinned: &mut Option<&mut [Option<u32>]>, i: usize) {
    if let Some(pinned) = pinned.as_deref_mut() {
        pinned[i] = cat.pin_resident(key);
    }
}

fn get_blocks(
    sh: &Arc<Shared>,
    keys: &[BlockKey],
    bufs: Option<&[BlockBuffer]>,
    mut pinned: Option<&mut [Option<u32>]>,
) -> Vec<bool> {
    let n = keys.len();
    let mut results = vec![false; n];
    let (done_tx, done_rx) = unbounded::<Done>();
    // Shared-tier reads in flight, by key index: their DRAM slot and the tier's read state.
    let mut shared_started: Vec<Option<(u32, RemoteRead)>> = (0..n).map(|_| None).collect();
    let mut staged_inflight = 0;
    // Direct reads need O_DIRECT semantics end to end and values that fill whole pages.
    let direct_io = sh.device_files.iter().all(|d| d.direct) && sh.config.object_bytes.is_multiple_of(ALIGN_BYTES);
    // Bounded by the devices' queue depth; reads that need a DRAM slot are further bounded by the
    // slots the catalog can free (then heap-staged, see `MAX_STAGED_READS`).
    let max_inflight = (sh.config.io_depth * sh.devices.len().max(1)).max(1);
    let mut next = 0;
    let mut inflight = 0;
    let mut dram_hits = Vec::new();
    let mut reads = Vec::new();
    let mut shared_reads = Vec::new();
    // Keys another load is reading into DRAM (`GetStep::Pending`): planned again once it is done.
    let mut waiting: Vec<usize> = Vec::new();
    let mut deadline: Option<Instant> = None;
    // This load's keys, built when it first runs short of slots: queued writes it may take are
    // other blocks' (`Catalog::plan_get_taking_queued_write`).
    let mut spare: Option<HashSet<BlockKey>> = None;
    while next < n || inflight > 0 || !waiting.is_empty() {
        if (next < n || !waiting.is_empty()) && inflight < max_inflight {
            {
                let mut cat = sh.catalog.lock();
                let mut retry = std::mem::take(&mut waiting).into_iter().peekable();
                while inflight + reads.len() + shared_reads.len() < max_inflight {
                    let Some(i) = retry.peek().copied().or((next < n).then_some(next)) else { break };
                    let direct = direct_io && bufs.is_some_and(|b| b[i].direct_capable());
                    let mut step = cat.plan_get(&keys[i], direct);
                    let can_stage = bufs.is_some() && staged_inflight + reads.len() < MAX_STAGED_READS;
                    if matches!(step, GetStep::NoSlot) && !can_stage {
                        // Loads go first: rather than wait for the write backlog, take the slot of a
                        // queued write (not of a block this load still needs).
                        step = cat.plan_get_taking_queued_write(&keys[i], spare.get_or_insert_with(|| key_set(keys)));
                    }
                    let planned = match step {
                        GetStep::Dram { slot } => {
                            dram_hits.push((i, slot));
                            true
                        }
                        GetStep::Nvme(read) => {
                            reads.push((i, read));
                            true
                        }
                        GetStep::Pending => {
                            waiting.push(i);
                            true
                        }
                        GetStep::Miss => match plan_shared_read(sh, &mut cat, &keys[i], &mut spare, keys) {
                            Ok(Some(slot)) => {
                                shared_reads.push((i, slot));
                                true
                            }
                            Ok(None) => {
                                Stats::add(&sh.stats.misses, 1);
                                true
                            }
                            Err(()) => false,
                        },
                        // Every slot is pinned or busy: stage the read in a heap buffer rather than wait
                        // (bounded), so that pins held by the engine never stall a load.
                        GetStep::NoSlot if can_stage => {
                            match cat.plan_get(&keys[i], true) {
                                GetStep::Nvme(read) => reads.push((i, read)),
                                GetStep::Pending => waiting.push(i),
                                _ => Stats::add(&sh.stats.misses, 1),
                            }
                            true
                        }
                        GetStep::NoSlot => false,
                    };
                    if !planned {
                        break;
                    }
                    if retry.next_if_eq(&i).is_none() {
                        next += 1;
                    }
                }
                waiting.extend(retry);
                let planned_nothing = reads.is_empty() && dram_hits.is_empty() && shared_reads.is_empty();
                if planned_nothing && inflight == 0 && (next < n || !waiting.is_empty()) {
                    // Out of slots, or every key left waits for another load's read: wait for a change.
                    let until =
                        *deadline.get_or_insert_with(|| Instant::now() + Duration::from_millis(sh.config.slot_wait_ms));
                    // Only a load short of slots keeps puts off the pool; one waiting for another
                    // load's read needs no slot.
                    let starved = next < n;
                    if starved {
                        cat.load_waits(true);
                    }
                    let timed_out = sh.changed.wait_until(&mut cat, until).timed_out();
                    if starved {
                        cat.load_waits(false);
                    }
                    if timed_out && Instant::now() >= until {
                        Stats::add(&sh.stats.slot_wait_timeouts, 1);
                        Stats::add(&sh.stats.misses, (n - next + waiting.len()) as u64);
                        next = n;
                        waiting.clear();
                    }
                    continue;
                }
                deadline = None;
            }
            for (i, read) in reads.drain(..) {
                let tx = done_tx.clone();
                let geometry = sh.geometry.expect("NVMe reads need the NVMe tier");
                let direct = direct_io && bufs.is_some_and(|b| b[i].direct_capable());
                if read.slot == NO_SLOT && !direct {
                    let staging = AlignedBuf::zeroed(sh.arena.slot_bytes());
                    staged_inflight += 1;
                    sh.devices[read.loc.device as usize].read(IoOp {
                        kind: OpKind::Read,
                        offset: geometry.region_offset(read.loc.region) + read.loc.offset,
                        buf: staging.as_ptr(),
                        len: staging.len(),
                        iovecs: Vec::new(),
                        file: None,
                        gate: None,
                        on_done: Box::new(move |r| {
                            let _ = tx.send(Done::Nvme(i, read, r, Landing::Staged(staging)));
                        }),
                    });
                    inflight += 1;
                    continue;
                }
                if read.slot == NO_SLOT {
                    let page = AlignedBuf::zeroed(DESCRIPTOR_BYTES);
                    let mut iovecs = vec![libc::iovec { iov_base: page.as_ptr().cast(), iov_len: DESCRIPTOR_BYTES }];
                    iovecs.extend(
                        bufs.expect("direct reads land in caller buffers")[i]
                            .segments
                            .iter()
                            .map(|&(ptr, len)| libc::iovec { iov_base: ptr.cast(), iov_len: len }),
                    );
                    sh.devices[read.loc.device as usize].read(IoOp {
                        kind: OpKind::Read,
                        offset: geometry.region_offset(read.loc.region) + read.loc.offset,
                        buf: std::ptr::null_mut(),
                        len: DESCRIPTOR_BYTES + sh.config.object_bytes,
                        iovecs,
                        file: None,
                        gate: None,
                        on_done: Box::new(move |r| {
                            let _ = tx.send(Done::Nvme(i, read, r, Landing::Direct(page)));
                        }),
                    });
                    inflight += 1;
                    continue;
                }
                sh.devices[read.loc.device as usize].read(IoOp {
                    kind: OpKind::Read,
                    offset: geometry.region_offset(read.loc.region) + read.loc.offset,
                    buf: sh.arena.slot_ptr(read.slot),
                    len: sh.arena.slot_bytes(),
                    iovecs: Vec::new(),
                    file: None,
                    gate: None,
                    on_done: Box::new(move |r| {
                        let _ = tx.send(Done::Nvme(i, read, r, Landing::Slot));
                    }),
                });
                inflight += 1;
            }
            // In flight beside the NVMe reads: a load of blocks from both tiers waits for the slower.
            for (i, slot) in shared_reads.drain(..) {
                let tx = done_tx.clone();
                let on_done = Box::new(move |r| {
                    let _ = tx.send(Done::Shared(i, r));
                });
                // SAFETY: the slot is ours (Loading) until `finish_get_shared`; an abandoned one is retired.
                match unsafe { start_remote_read(sh, &keys[i], sh.arena.slot_ptr(slot), on_done) } {
                    Some(read) => {
                        shared_started[i] = Some((slot, read));
                        inflight += 1;
                    }
                    None => {
                        let missed = vec![(i, slot, ReadOutcome::Miss)];
                        finish_shared_reads(sh, keys, bufs, &mut results, missed, pinned.as_deref_mut());
                    }
                }
            }
            if !dram_hits.is_empty() {
                for &(i, slot) in &dram_hits {
                    if let Some(bufs) = bufs {
                        copy_value_out(sh, slot, &bufs[i]);
                    }
                    results[i] = true;
                }
                Stats::add(&sh.stats.dram_hits, dram_hits.len() as u64);
                let mut cat = sh.catalog.lock();
                for (i, _) in dram_hits.drain(..) {
                    cat.finish_get_dram(&keys[i]);
                    hold(&mut cat, &keys[i], &mut pinned, i);
                }
                drop(cat);
                sh.changed.notify_all();
            }
        }
        if inflight == 0 {
            continue;
        }
        let first = done_rx.recv().expect("sender held by this function");
        let mut finished = vec![first];
        finished.extend(done_rx.try_iter());
        inflight -= finished.len();
        let mut outcomes = Vec::with_capacity(finished.len());
        let mut shared_done = Vec::new();
        for done in finished {
            let (i, read, io_result, landing) = match done {
                Done::Nvme(i, read, io_result, landing) => (i, read, io_result, landing),
                Done::Shared(i, io_result) => {
                    let (slot, read) = shared_started[i].take().expect("a started shared read finishes once");
                    // SAFETY: the read into our slot finished; an abandoned slot is retired below.
                    let outcome = unsafe { finish_remote_read(sh, read, sh.arena.slot_ptr(slot), io_result) };
                    shared_done.push((i, slot, outcome));
                    continue;
                }
            };
            if matches!(landing, Landing::Staged(_)) {
                staged_inflight -= 1;
            }
            if io_result.as_ref().is_err_and(is_abandoned) {
                log::error!("kvtier: read of block {:?} abandoned by a broken I/O engine; counted as a miss", keys[i]);
                Stats::add(&sh.stats.io_errors, 1);
                Stats::add(&sh.stats.misses, 1);
                // The kernel may still write into these: they are never freed.
                match landing {
                    Landing::Direct(page) | Landing::Staged(page) => std::mem::forget(page),
                    Landing::Slot => {}
                }
                outcomes.push((i, read, LoadOutcome::Abandoned));
                continue;
            }
            let verified = |read: &NvmeRead| match &landing {
                Landing::Direct(page) => verify_direct(sh, &keys[i], read, page, &bufs.expect("direct")[i]),
                Landing::Staged(staging) => {
                    verify_and_copy_out(sh, &keys[i], read, staging.as_slice(), bufs.map(|b| &b[i]))
                }
                // SAFETY: the read into the slot has completed and the slot is ours (Loading).
                Landing::Slot => {
                    verify_and_copy_out(sh, &keys[i], read, unsafe { slot_ref(sh, read.slot) }, bufs.map(|b| &b[i]))
                }
            };
            let outcome = match io_result {
                Err(e) => {
                    log::warn!("kvtier: read of block {:?} failed: {e}; counted as a miss", keys[i]);
                    Stats::add(&sh.stats.io_errors, 1);
                    LoadOutcome::IoError
                }
                Ok(()) if verified(&read) => {
                    results[i] = true;
                    Stats::add(&sh.stats.nvme_hits, 1);
                    Stats::add(&sh.stats.bytes_read_nvme, sh.arena.slot_bytes() as u64);
                    LoadOutcome::Ok
                }
                Ok(()) => {
                    log::warn!("kvtier: block {:?} failed verification on load; counted as a miss", keys[i]);
                    Stats::add(&sh.stats.checksum_failures, 1);
                    LoadOutcome::Corrupt
                }
            };
            if !matches!(outcome, LoadOutcome::Ok) {
                Stats::add(&sh.stats.misses, 1);
            }
            outcomes.push((i, read, outcome));
        }
        let mut cat = sh.catalog.lock();
        for (i, read, outcome) in outcomes {
            let loaded = matches!(outcome, LoadOutcome::Ok);
            cat.finish_get_nvme(&keys[i], &read, outcome);
            if loaded {
                hold(&mut cat, &keys[i], &mut pinned, i);
            }
        }
        drop(cat);
        sh.changed.notify_all();
        if !shared_done.is_empty() {
            finish_shared_reads(sh, keys, bufs, &mut results, shared_done, pinned.as_deref_mut());
        }
    }
    results
}

pub(crate) fn execute_put(sh: &Arc<Shared>, keys: &[BlockKey], bufs: &[BlockBuffer]) -> Vec<bool> {
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
                    PutStep::Present => results[next] = true,
                    PutStep::Fill { slot, sequence } => fills.push((next, slot, sequence)),
                    PutStep::NoSlot => break,
                }
                next += 1;
            }
            if fills.is_empty() && next < n {
                let until =
                    *deadline.get_or_insert_with(|| Instant::now() + Duration::from_millis(sh.config.slot_wait_ms));
                if sh.changed.wait_until(&mut cat, until).timed_out() && Instant::now() >= until {
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
        complete_fills(sh, &filled);
        for &(i, _, _) in &fills {
            results[i] = true;
        }
    }
    results
}

/// Copies a DRAM-resident block into `out` as its slot holds it (descriptor page + value), for the
/// shared publisher's backlog; `false` when the block is no longer in DRAM. The descriptor is built
/// from the catalog, not copied: an NVMe write may be stamping the slot's own descriptor page.
pub(crate) fn copy_resident_block(sh: &Shared, key: &BlockKey, out: &mut [u8]) -> bool {
    let object_bytes = sh.config.object_bytes;
    assert!(out.len() >= DESCRIPTOR_BYTES + object_bytes, "a publish buffer holds a whole slot");
    let Some(block) = sh.catalog.lock().pin_resident_for_copy(key) else { return false };
    // SAFETY: the block is pinned as a reader: its slot is resident and its value does not change
    // until released. Only the value area is read.
    let value =
        unsafe { std::slice::from_raw_parts(sh.arena.slot_ptr(block.slot).add(DESCRIPTOR_BYTES), object_bytes) };
    out[DESCRIPTOR_BYTES..DESCRIPTOR_BYTES + object_bytes].copy_from_slice(value);
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
    true
}

/// A slot whose value is complete (copied in, here or by engine workers through the shared pool).
pub(crate) struct Filled {
    pub key: BlockKey,
    pub slot: u32,
    pub sequence: u64,
    pub value_checksum: u64,
}

/// Makes filled slots blocks: descriptor, shared-tier offer, visible in the catalog, NVMe write.
fn complete_fills(sh: &Arc<Shared>, filled: &[Filled]) {
    for f in filled {
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
        // Copied while the slot is still ours (Filling); the publisher thread does the rest.
        for publisher in sh.shared_publisher.iter().chain(&sh.object_publisher) {
            publisher.offer(f.key, bytes);
        }
    }
    let mut meta = Vec::new();
    let mut writes = Vec::new();
    {
        let mut cat = sh.catalog.lock();
        for f in filled {
            if let Some(plan) = cat.finish_put(&f.key, f.slot, f.value_checksum, &mut meta) {
                writes.push((f.key, plan));
            }
        }
    }
    sh.changed.notify_all();
    submit_meta(sh, meta);
    for (key, plan) in writes {
        submit_entry_write(sh, key, plan);
    }
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

/// Waits until the NVMe write backlog admits a put, as a local put does; `false` if it did not by
/// `deadline`.
pub(crate) fn wait_for_put_room(sh: &Shared, deadline: Instant) -> bool {
    let mut cat = sh.catalog.lock();
    while !cat.has_put_room() {
        if sh.changed.wait_until(&mut cat, deadline).timed_out() {
            return cat.has_put_room();
        }
    }
    true
}

/// Reserves DRAM slots for blocks that other processes fill through the shared pool. Never waits:
/// a block with no slot now is `Dropped` (not counted: the caller may wait and try again).
pub(crate) fn reserve_puts(sh: &Shared, keys: &[BlockKey]) -> Vec<Reservation> {
    let mut cat = sh.catalog.lock();
    keys.iter()
        .map(|key| match cat.plan_put(key) {
            PutStep::Present => Reservation::Present,
            PutStep::Fill { slot, sequence } => Reservation::Fill { slot, sequence },
            PutStep::NoSlot => Reservation::Dropped,
        })
        .collect()
}

/// The reserved slots were filled: checksums their values (the writers are other processes, so the
/// checksum is taken here, after the last of them finished) and stores the blocks.
pub(crate) fn commit_puts(sh: &Arc<Shared>, fills: &[(BlockKey, u32, u64)]) {
    let object_bytes = sh.config.object_bytes;
    let filled: Vec<Filled> = fills
        .iter()
        .map(|&(key, slot, sequence)| {
            // SAFETY: the slot is ours (Filling) and its writers have finished (commit contract).
            let value = &unsafe { slot_ref(sh, slot) }[DESCRIPTOR_BYTES..DESCRIPTOR_BYTES + object_bytes];
            Stats::add(&sh.stats.bytes_copied_in, object_bytes as u64);
            Filled { key, slot, sequence, value_checksum: crate::format::checksum(value) }
        })
        .collect();
    complete_fills(sh, &filled);
}

/// Gives reserved slots back unfilled.
pub(crate) fn abort_puts(sh: &Shared, fills: &[(BlockKey, u32)]) {
    let mut cat = sh.catalog.lock();
    for (key, slot) in fills {
        cat.abort_put(key, *slot);
    }
    Stats::add(&sh.stats.dropped_stores, fills.len() as u64);
    drop(cat);
    sh.changed.notify_all();
}

fn submit_entry_write(sh: &Arc<Shared>, key: BlockKey, plan: WritePlan) {
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
    // Stamped: from here until the device queue submits it, a load short of slots may take the slot
    // (the gate then cancels the write, which never touches the slot again).
    sh.catalog.lock().write_queued(&key, &plan);
    let geometry = sh.geometry.expect("writes need the NVMe tier");
    let (gate_shared, shared) = (Arc::clone(sh), Arc::clone(sh));
    sh.devices[plan.loc.device as usize].write(IoOp {
        kind: OpKind::Write,
        offset: geometry.region_offset(plan.loc.region) + plan.loc.offset,
        buf: sh.arena.slot_ptr(plan.slot),
        len: sh.arena.slot_bytes(),
        iovecs: Vec::new(),
        file: None,
        gate: Some(Box::new(move || gate_shared.catalog.lock().start_write(&plan))),
        on_done: Box::new(move |r| {
            // An abandoned write may still read the slot; reusing it can only change bytes at an
            // NVMe location the catalog records as unwritten (no trailer lists it), so it is freed.
            let outcome = match &r {
                Ok(()) => WriteOutcome::Written,
                Err(e) if is_cancelled(e) => WriteOutcome::Cancelled,
                Err(e) => {
                    log::warn!("kvtier: NVMe write of {key:?} failed: {e}; the block stays in DRAM only");
                    WriteOutcome::Failed
                }
            };
            finish_entry_write(&shared, &key, &plan, outcome);
        }),
    });
}

fn finish_entry_write(sh: &Arc<Shared>, key: &BlockKey, plan: &WritePlan, outcome: WriteOutcome) {
    let trailer = sh.catalog.lock().complete_write(key, plan, outcome);
    sh.changed.notify_all();
    if let Some(t) = trailer {
        submit_meta(sh, vec![t]);
    }
}

pub(crate) fn submit_meta(sh: &Arc<Shared>, writes: Vec<MetaWrite>) {
    let Some(geometry) = sh.geometry else { return };
    for write in writes {
        let buf = match &write.entries {
            Some(entries) => crate::tiers::nvme::encode_trailer(&geometry, write.region, write.region_seq, entries),
            None => AlignedBuf::zeroed(geometry.trailer_bytes as usize),
        };
        let shared = Arc::clone(sh);
        let ptr = buf.as_ptr();
        let len = buf.len();
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
                if let Err(e) = &r {
                    log::warn!("kvtier: writing the trailer of region {} failed: {e}", write.region);
                }
                let retry = shared.catalog.lock().complete_meta(&write, r.is_ok());
                shared.changed.notify_all();
                if let Some(retry) = retry {
                    submit_meta(&shared, vec![retry]);
                }
            }),
        });
    }
}

/// A DRAM slot to load `key` from the shared tier, if the shared index has it.
/// `Err(())`: the block is in the shared tier but no DRAM slot is free right now (try again later).
/// Short of slots, it takes the slot of a queued write of a block outside `keys` (loads first).
fn plan_shared_read(
    sh: &Shared,
    cat: &mut crate::catalog::Catalog,
    key: &BlockKey,
    spare: &mut Option<HashSet<BlockKey>>,
    keys: &[BlockKey],
) -> Result<Option<u32>, ()> {
    let indexed = sh.shared_tier.as_ref().is_some_and(|t| t.contains(key))
        || sh.object_tier.as_ref().is_some_and(|t| t.contains(key));
    if !indexed || cat.has_entry(key) {
        return Ok(None);
    }
    let slot = cat
        .plan_get_shared(key)
        .or_else(|| cat.plan_get_shared_taking_queued_write(key, spare.get_or_insert_with(|| key_set(keys))));
    slot.map(Some).ok_or(())
}

fn key_set(keys: &[BlockKey]) -> HashSet<BlockKey> {
    keys.iter().copied().collect()
}

/// Shared-tier reads into DRAM slots that the tier has judged (`(key index, slot, outcome)`): a hit
/// is copied out and made resident, anything else is a miss (the tier counted and quarantined).
fn finish_shared_reads(
    sh: &Arc<Shared>,
    keys: &[BlockKey],
    bufs: Option<&[BlockBuffer]>,
    results: &mut [bool],
    reads: Vec<(usize, u32, ReadOutcome)>,
    mut pinned: Option<&mut [Option<u32>]>,
) {
    let mut done = Vec::with_capacity(reads.len());
    for (i, slot, outcome) in reads {
        let checksum = match outcome {
            // The tier verified the block; the checksum is taken before anything counts it a hit.
            ReadOutcome::Hit => {
                // SAFETY: the read finished into our slot.
                let bytes = unsafe { slot_mut(sh.arena.slot_ptr(slot), sh.arena.slot_bytes()) };
                match Descriptor::decode(&bytes[..DESCRIPTOR_BYTES]) {
                    Ok(desc) => {
                        if let Some(bufs) = bufs {
                            copy_value_out(sh, slot, &bufs[i]);
                        }
                        results[i] = true;
                        Some(desc.value_checksum)
                    }
                    Err(e) => {
                        log::error!("kvtier: shared block {:?} passed verification but its descriptor does not decode ({e}); a miss", keys[i]);
                        Stats::add(&sh.stats.checksum_failures, 1);
                        None
                    }
                }
            }
            ReadOutcome::Miss | ReadOutcome::Abandoned => None,
        };
        if checksum.is_none() {
            Stats::add(&sh.stats.misses, 1);
        }
        done.push((i, slot, checksum, outcome == ReadOutcome::Abandoned));
    }
    let mut cat = sh.catalog.lock();
    for (i, slot, checksum, abandoned) in done {
        if abandoned {
            cat.abandon_get_shared(&keys[i], slot);
            continue;
        }
        let loaded = checksum.is_some();
        cat.finish_get_shared(&keys[i], slot, checksum);
        if loaded {
            hold(&mut cat, &keys[i], &mut pinned, i);
        }
    }
    drop(cat);
    sh.changed.notify_all();
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
