//! Writing: slots appended to this process's open data file through the tier's device queue, and
//! the file sealed (footer, fdatasync, rename into `data/`) and published by a manifest record.
//! When the tier is split by tenant (`SharedConfig::tenant_shares`) each tenant's blocks go to an
//! open file of its own, named with the tenant's tag (`format::data_file_name`), so that the evictor
//! can account and evict by tenant from the names alone.

use super::files::open_dir;
use super::format::{
    self, data_file_name, unix_ms, FileHeader, IndexEntry, Record, BLOCK_TAG_AT, FILE_HEADER_BYTES, TAG_BYTES,
};
use super::root::{create_file, make_dir};
use super::{capacity, io_err, tenants, SharedTier};
use crate::error::{Error, Result};
use crate::format::descriptor::{Descriptor, DESCRIPTOR_BYTES};
use crate::format::encrypted::seal_slot;
use crate::format::{checksum, ALIGN_BYTES};
use crate::io::buffer::AlignedBuf;
use crate::io::device::Transfer;
use crate::io::OpKind;
use crate::key::BlockKey;
use crate::stats::Stats;
use crate::tiers::remote::tenants::{slot_tag, MAX_OPEN_PER_WRITER};
use std::collections::HashSet;
use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Buffers of one vectored write of a data file (IOV_MAX on Linux).
const MAX_WRITE_IOVECS: usize = 1024;

/// A data file being filled by this process.
pub(super) struct OpenDataFile {
    file: Arc<File>,
    pub(super) tmp_path: PathBuf,
    name: String,
    file_seq: u64,
    /// The tenant tag in its name; None: the default tenant's (or the tier is not split).
    tenant: Option<u32>,
    entries: Vec<IndexEntry>,
    keys: HashSet<BlockKey>,
    cursor: u64,
    started: Instant,
}

pub(super) struct WriterState {
    /// The files being filled: at most one per tenant, and one when the tier is not split.
    pub(super) open: Vec<OpenDataFile>,
    pub(super) next_file_seq: u64,
}

impl WriterState {
    /// Where the open file for `tenant`'s blocks is in `open`, if one is.
    fn open_for(&self, tenant: Option<u32>) -> Option<usize> {
        self.open.iter().position(|o| o.tenant == tenant)
    }
}

impl SharedTier {
    /// Builds slots (descriptor page + value) for values and appends them; for tests and tools.
    /// Returns how many were queued into a file (they become visible when the file is published).
    #[cfg(any(test, feature = "testing"))]
    pub fn publish_values(&self, keys: &[BlockKey], values: &[&[u8]]) -> Result<usize> {
        let mut slots: Vec<(BlockKey, AlignedBuf)> = Vec::with_capacity(keys.len());
        for (key, value) in keys.iter().zip(values) {
            let mut buf = AlignedBuf::zeroed(self.slot_bytes);
            debug_assert!(buf.len() >= self.slot_bytes);
            self.build_slot(key, value, buf.as_mut_slice());
            slots.push((*key, buf));
        }
        let mut refs: Vec<(BlockKey, &mut [u8])> = slots.iter_mut().map(|(k, b)| (*k, b.as_mut_slice())).collect();
        Ok(self.append_slots(&mut refs))
    }

    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn build_slot(&self, key: &BlockKey, value: &[u8], slot: &mut [u8]) {
        debug_assert!(slot.len() >= self.slot_bytes, "a slot of {} bytes", slot.len());
        slot[DESCRIPTOR_BYTES..DESCRIPTOR_BYTES + value.len()].copy_from_slice(value);
        Descriptor {
            value_bytes: self.object_bytes as u32,
            key: *key,
            namespace: self.namespace,
            sequence: 0,
            region_seq: 0,
            value_checksum: checksum(value),
        }
        .encode(&mut slot[..DESCRIPTOR_BYTES]);
    }

    /// Appends whole slots (as the DRAM tier holds them) to the open data file of their tenant,
    /// sealing and publishing files as they reach `file_target_bytes`. Each slot's descriptor and
    /// value checksum are checked first (a slot that changed under us is skipped). Returns how many
    /// were written. Split by tenant, the slots are reordered so that each tenant's are together,
    /// in the order they came (a prompt's first blocks first).
    pub fn append_slots(&self, slots: &mut [(BlockKey, &mut [u8])]) -> usize {
        if self.config.tenant_shares.enabled() {
            slots.sort_by_cached_key(|(_, slot)| slot_tag(&self.config.tenant_shares, slot));
        }
        let mut written = 0;
        let mut w = self.writer.lock();
        let mut start = 0;
        while start < slots.len() {
            let tenant = slot_tag(&self.config.tenant_shares, slots[start].1);
            let run = slots[start..]
                .iter()
                .take_while(|(_, slot)| slot_tag(&self.config.tenant_shares, slot) == tenant)
                .count();
            written += self.append_run(&mut w, tenant, &mut slots[start..start + run]);
            start += run;
        }
        debug_assert!(written <= slots.len());
        written
    }

    /// Appends slots of one tenant to its open file (see `append_slots`).
    fn append_run(&self, w: &mut WriterState, tenant: Option<u32>, slots: &mut [(BlockKey, &mut [u8])]) -> usize {
        let tenant = if w.open_for(tenant).is_none() && w.open.len() >= MAX_OPEN_PER_WRITER { None } else { tenant };
        if tenant.is_some() {
            self.tenant_ledger.learn_slot(slots[0].1);
        }
        let mut written = 0;
        let mut i = 0;
        while i < slots.len() {
            let at = match w.open_for(tenant) {
                Some(at) => at,
                None if self.start_file_below_limit(w, tenant) => w.open.len() - 1,
                None => {
                    Stats::add(&self.stats.shared_publish_errors, (slots.len() - i) as u64);
                    return written;
                }
            };
            let batch = self.pick_batch(&w.open[at], slots, &mut i);
            if !batch.is_empty() {
                if !self.write_batch(w, at, slots, &batch) {
                    continue;
                }
                written += batch.len();
            }
            let open = &w.open[at];
            let full = open.cursor + self.slot_bytes as u64 + format::footer_bytes(open.entries.len() + 1) as u64
                > self.config.file_target_bytes;
            if full {
                self.seal(w, at);
            }
        }
        written
    }

    /// Starts a data file unless the filesystem is too full for a new one, or creating it fails
    /// (logged). Returns whether a file is open now.
    fn start_file_below_limit(&self, w: &mut WriterState, tenant: Option<u32>) -> bool {
        debug_assert!(w.open_for(tenant).is_none(), "one open data file per writer and tenant");
        // fail_on_full stops at the high watermark. Otherwise writers still stop at a hard ceiling
        // halfway between the high watermark and full, so that writers outpacing the evictor (whose
        // victims wait out the grace period) cannot fill the filesystem.
        let limit = if self.config.fail_on_full { self.config.high_watermark } else { self.config.hard_ceiling() };
        // Measured afresh (one statvfs) rather than from the maintenance thread's last pass: a
        // stale figure lets every writer start files past the ceiling between two passes.
        let usage = capacity::measure_usage(self).unwrap_or_else(|_| self.usage());
        if usage.fraction() >= limit && !self.may_pass_the_ceiling(tenant, usage) {
            return false;
        }
        match self.start_file(w, tenant) {
            Ok(()) => true,
            Err(e) => {
                log::warn!("kvtier: starting a shared data file failed: {e}; blocks not published");
                false
            }
        }
    }

    /// Split by tenant, a tenant under its share of the tier's room starts files past the hard
    /// ceiling, until the tier is full: the files that fill it to the ceiling are then other
    /// tenants', waiting out their grace period before the evictor may take them, and a tenant within
    /// its share does not pay for them (its share is a floor, as in the DRAM pool). A file started
    /// just under full may pass it by up to its size. Never with `fail_on_full`.
    fn may_pass_the_ceiling(&self, tenant: Option<u32>, usage: super::Usage) -> bool {
        let shares = &self.config.tenant_shares;
        if !shares.enabled() || self.config.fail_on_full || usage.fraction() >= 1.0 {
            return false;
        }
        let room_bytes = (self.config.low_watermark * usage.capacity_bytes as f64) as u64;
        tenants::accounts(&self.index.read(), shares, room_bytes, 0).under_its_share(tenant)
    }

    /// The indices of the slots from `slots[*next..]` to write next: as many as fit `open` (at least
    /// one into an empty file), moving `*next` past every slot looked at. Slots already in the file
    /// or the index are skipped, and so are slots that fail their checks (counted as errors).
    fn pick_batch(&self, open: &OpenDataFile, slots: &mut [(BlockKey, &mut [u8])], next: &mut usize) -> Vec<usize> {
        let mut batch: Vec<usize> = Vec::new();
        let mut count = open.entries.len();
        let mut end = open.cursor;
        while *next < slots.len() {
            let (key, slot) = &mut slots[*next];
            let fits =
                end + self.slot_bytes as u64 + format::footer_bytes(count + 1) as u64 <= self.config.file_target_bytes;
            if !fits && count > 0 {
                break;
            }
            *next += 1;
            if open.keys.contains(key) || self.index.read().contains(key) {
                continue;
            }
            if !self.prepare_slot(key, slot, open.file_seq) {
                Stats::add(&self.stats.shared_publish_errors, 1);
                continue;
            }
            debug_assert!(batch.last().is_none_or(|&last| last < *next - 1), "a slot picked twice");
            batch.push(*next - 1);
            count += 1;
            end += self.slot_bytes as u64;
        }
        batch
    }

    /// Writes the slots `batch` names at the end of the open file and lists them in it. Returns
    /// whether they were written; if not, the file is abandoned and its blocks, these and those
    /// written before, are counted as errors.
    fn write_batch(&self, w: &mut WriterState, at: usize, slots: &[(BlockKey, &mut [u8])], batch: &[usize]) -> bool {
        let open = &mut w.open[at];
        debug_assert!(!batch.is_empty(), "an empty batch is not written");
        debug_assert!(open.cursor.is_multiple_of(ALIGN_BYTES as u64), "a data file's cursor off its alignment");
        let bufs: Vec<&[u8]> = batch.iter().map(|&j| &slots[j].1[..self.slot_bytes]).collect();
        match self.write_data(&open.file, &bufs, open.cursor) {
            Ok(()) => {
                for &j in batch {
                    let slot = &slots[j].1;
                    let value_checksum =
                        Descriptor::decode(&slot[..DESCRIPTOR_BYTES]).map(|d| d.value_checksum).unwrap_or(0);
                    open.entries.push(IndexEntry { key: slots[j].0, offset: open.cursor, value_checksum });
                    open.keys.insert(slots[j].0);
                    open.cursor += self.slot_bytes as u64;
                }
                debug_assert_eq!(
                    open.cursor,
                    FILE_HEADER_BYTES as u64 + (open.entries.len() * self.slot_bytes) as u64,
                    "a data file holds its header, then one slot per entry"
                );
                true
            }
            Err(e) => {
                log::warn!("kvtier: writing shared file {} failed: {e}; abandoning it", open.tmp_path.display());
                Stats::add(&self.stats.shared_publish_errors, (batch.len() + open.entries.len()) as u64);
                self.abandon(w, at);
                false
            }
        }
    }

    /// Checks a slot handed to us and stamps the file sequence into its descriptor.
    fn prepare_slot(&self, key: &BlockKey, slot: &mut [u8], file_seq: u64) -> bool {
        let Ok(mut desc) = Descriptor::decode(&slot[..DESCRIPTOR_BYTES]) else { return false };
        let ok = desc.key == *key
            && desc.namespace == self.namespace
            && desc.value_bytes as usize == self.object_bytes
            && checksum(&slot[DESCRIPTOR_BYTES..DESCRIPTOR_BYTES + self.object_bytes]) == desc.value_checksum;
        if ok {
            desc.region_seq = file_seq;
            desc.encode(&mut slot[..DESCRIPTOR_BYTES]);
            if let Some(cipher) = self.cipher.get() {
                if let Err(e) = seal_slot(cipher, slot, self.object_bytes) {
                    log::warn!("kvtier: no nonce to encrypt block {key:?} for the shared tier ({e}); not published");
                    return false;
                }
            }
            let tag = match &self.auth {
                Some(k) => {
                    k.block_tag(&self.namespace, key, &slot[DESCRIPTOR_BYTES..DESCRIPTOR_BYTES + self.object_bytes])
                }
                None => [0u8; TAG_BYTES],
            };
            slot[BLOCK_TAG_AT..BLOCK_TAG_AT + TAG_BYTES].copy_from_slice(&tag);
        }
        ok
    }

    fn start_file(&self, w: &mut WriterState, tenant: Option<u32>) -> Result<()> {
        debug_assert!(w.open_for(tenant).is_none(), "one open data file per writer and tenant");
        let file_seq = w.next_file_seq;
        w.next_file_seq += 1;
        let name = data_file_name(self.writer_id, file_seq, tenant);
        let tmp_path = self.dir.join("tmp").join(format!("{}.tmp", name.trim_end_matches(".kvs")));
        let file = create_file(&self.config, &tmp_path, false, self.direct)?;
        let mut header = AlignedBuf::zeroed(FILE_HEADER_BYTES);
        assert_eq!(header.len(), FILE_HEADER_BYTES, "the data file header is one page");
        FileHeader {
            namespace: self.namespace,
            object_bytes: self.object_bytes as u64,
            slot_bytes: self.slot_bytes as u64,
            writer_id: self.writer_id,
            file_seq,
            created_unix_ms: unix_ms(),
        }
        .encode(header.as_mut_slice());
        let file = Arc::new(file);
        if let Err(e) = self.write_data(&file, &[header.as_slice()], 0) {
            let _ = std::fs::remove_file(&tmp_path);
            return Err(Error::io(format!("writing {}", tmp_path.display()), e));
        }
        w.open.push(OpenDataFile {
            file,
            tmp_path,
            name,
            file_seq,
            tenant,
            entries: Vec::new(),
            keys: HashSet::new(),
            cursor: FILE_HEADER_BYTES as u64,
            started: Instant::now(),
        });
        Ok(())
    }

    /// Writes `bufs` back to back at `offset` through the tier's device queue: one vectored write per
    /// `MAX_WRITE_IOVECS` buffers. Not split further to run in parallel: each write extends the file,
    /// and extending writes are serialized by the filesystem anyway (ext4's O_DIRECT takes the inode
    /// lock for them); measured, parallel 8 MiB writes stored a third slower than one stream.
    fn write_data(&self, file: &Arc<File>, bufs: &[&[u8]], offset: u64) -> std::io::Result<()> {
        let mut transfers: Vec<Transfer> = Vec::new();
        let mut at = offset;
        for b in bufs {
            let iovec = libc::iovec { iov_base: b.as_ptr().cast_mut().cast(), iov_len: b.len() };
            match transfers.last_mut() {
                Some(t) if t.iovecs.len() < MAX_WRITE_IOVECS => {
                    t.iovecs.push(iovec);
                    t.len += b.len();
                }
                _ => transfers.push(Transfer {
                    kind: OpKind::Write,
                    file: Arc::clone(file),
                    offset: at,
                    buf: std::ptr::null_mut(),
                    len: b.len(),
                    iovecs: vec![iovec],
                }),
            }
            at += b.len() as u64;
        }
        // An abandoned write may read its buffer after this returns. Reused meanwhile, it can only
        // change bytes of this file, which the failure makes the writer abandon, unpublished.
        self.io.run_all(transfers).into_iter().collect()
    }

    fn abandon(&self, w: &mut WriterState, at: usize) {
        let open = w.open.swap_remove(at);
        drop(open.file);
        let _ = std::fs::remove_file(&open.tmp_path);
    }

    /// Seals the open file `w.open[at]`: footer, fdatasync, rename into `data/`, directory fsync,
    /// publish record.
    fn seal(&self, w: &mut WriterState, at: usize) {
        let open = w.open.swap_remove(at);
        if open.entries.is_empty() {
            drop(open.file);
            let _ = std::fs::remove_file(&open.tmp_path);
            return;
        }
        let count = open.entries.len();
        match self.seal_file(&open) {
            Ok(file_bytes) => {
                Stats::add(&self.stats.shared_files_published, 1);
                Stats::add(&self.stats.shared_bytes_written, file_bytes);
                let record = Record::Publish {
                    name: open.name.clone(),
                    file_bytes,
                    published_unix_ms: unix_ms(),
                    entries: open.entries,
                };
                if let Err(e) = self.append_records(&[record]) {
                    // The file is in place but unlisted: the evictor's orphan sweep removes it later.
                    log::warn!(
                        "kvtier: publishing {} to the manifest failed: {e}; its blocks stay unshared",
                        open.name
                    );
                    Stats::add(&self.stats.shared_publish_errors, count as u64);
                }
            }
            Err(e) => {
                log::warn!("kvtier: sealing shared file {} failed: {e}; its blocks are not published", open.name);
                Stats::add(&self.stats.shared_publish_errors, count as u64);
                let _ = std::fs::remove_file(&open.tmp_path);
            }
        }
    }

    fn seal_file(&self, open: &OpenDataFile) -> Result<u64> {
        let footer_len = format::footer_bytes(open.entries.len());
        let mut footer = AlignedBuf::zeroed(footer_len);
        format::encode_footer(&open.entries, open.cursor, self.writer_id, open.file_seq, footer.as_mut_slice());
        let ctx = || format!("writing {}", open.tmp_path.display());
        self.write_data(&open.file, &[&footer.as_slice()[..footer_len]], open.cursor).map_err(io_err(ctx()))?;
        open.file.sync_data().map_err(io_err(format!("fdatasync {}", open.tmp_path.display())))?;
        let target = self.data_path(&open.name);
        let parent = target.parent().expect("data path has a parent");
        if !parent.exists() {
            make_dir(&self.config, parent)?;
        }
        std::fs::rename(&open.tmp_path, &target).map_err(io_err(format!(
            "renaming {} to {}",
            open.tmp_path.display(),
            target.display()
        )))?;
        // Without it a crash could forget the rename while the manifest (synced later) remembers it;
        // a reader would then get a clean miss, so failure here is ignored.
        if let Ok(d) = open_dir(parent) {
            let _ = d.sync_all();
        }
        Ok(open.cursor + footer_len as u64)
    }

    /// Publishes the files being filled, whatever their size.
    pub fn flush(&self) {
        let mut w = self.writer.lock();
        while !w.open.is_empty() {
            self.seal(&mut w, 0);
        }
    }

    pub(super) fn seal_if_old(&self) {
        let Some(mut w) = self.writer.try_lock() else { return };
        let delay = Duration::from_millis(self.config.publish_delay_ms);
        while let Some(at) = w.open.iter().position(|o| o.started.elapsed() >= delay) {
            self.seal(&mut w, at);
        }
    }

    /// The temporaries of the files being filled (the orphan sweep leaves them alone).
    pub(super) fn open_tmp_paths(&self) -> Vec<PathBuf> {
        self.writer.try_lock().map(|w| w.open.iter().map(|o| o.tmp_path.clone()).collect()).unwrap_or_default()
    }
}
