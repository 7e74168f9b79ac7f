//! Where an NVMe read's bytes land, and how a finished read is judged: decrypted where it landed,
//! checked against what the index expects, and copied out to the caller.

use crate::catalog::{LoadOutcome, NvmeRead};
use crate::format::descriptor::{Descriptor, DESCRIPTOR_BYTES};
use crate::format::encrypted::{decrypt_in_place, DecryptError};
use crate::io::buffer::AlignedBuf;
use crate::io::device::is_abandoned;
use crate::key::BlockKey;
use crate::mover::{for_each_chunk, slot_mut, slot_ref, BlockBuffer};
use crate::stats::Stats;
use crate::store_state::StoreState;
use crate::tiers::health::Observed;

/// Where an NVMe read's bytes land (a remote read always lands in its DRAM slot).
pub(super) enum Landing {
    /// In its DRAM slot (promoted to the DRAM tier on success).
    Slot,
    /// Value in the caller's memory; the descriptor in this page.
    Direct(AlignedBuf),
    /// In a heap staging buffer, because every DRAM slot was pinned or busy.
    Staged(AlignedBuf),
}

impl Landing {
    /// The memory an NVMe read into this landing fills, as `IoOp` takes it: `(buf, len, iovecs)`,
    /// one buffer, or (direct) the descriptor page then the caller's segments.
    pub(super) fn target(
        &self,
        sh: &StoreState,
        read: &NvmeRead,
        buf: Option<&BlockBuffer>,
    ) -> (*mut u8, usize, Vec<libc::iovec>) {
        match self {
            Landing::Slot => (sh.arena.slot_ptr(read.slot), sh.arena.slot_bytes(), Vec::new()),
            Landing::Staged(staging) => (staging.as_ptr(), staging.len(), Vec::new()),
            Landing::Direct(page) => {
                let segments = &buf.expect("direct reads land in caller buffers").segments;
                let page = libc::iovec { iov_base: page.as_ptr().cast(), iov_len: DESCRIPTOR_BYTES };
                let values = segments.iter().map(|&(ptr, len)| libc::iovec { iov_base: ptr.cast(), iov_len: len });
                let iovecs = std::iter::once(page).chain(values).collect();
                (std::ptr::null_mut(), DESCRIPTOR_BYTES + sh.config.object_bytes, iovecs)
            }
        }
    }

    /// Decrypts an encrypted value where it landed (`encryption_key_file`); a value in clear is left
    /// as it is. A direct read only ever lands in clear (direct reads are off with a key).
    fn open(&mut self, sh: &StoreState, read: &NvmeRead) -> Result<(), DecryptError> {
        let bytes = match self {
            Landing::Direct(page) if Descriptor::is_encrypted(page.as_slice()) => return Err(DecryptError::NoKey),
            Landing::Direct(_) => return Ok(()),
            Landing::Staged(staging) => staging.as_mut_slice(),
            // SAFETY: the read into the slot has completed and the slot is ours (Loading).
            Landing::Slot => unsafe { slot_mut(sh.arena.slot_ptr(read.slot), sh.arena.slot_bytes()) },
        };
        let (page, rest) = bytes.split_at_mut(DESCRIPTOR_BYTES);
        decrypt_in_place(sh.value_cipher.as_deref(), page, &mut rest[..sh.config.object_bytes]).map(|_| ())
    }

    /// Checks a finished NVMe read against what the index expects and copies its value out.
    fn verify_and_copy_out(&self, sh: &StoreState, key: &BlockKey, read: &NvmeRead, buf: Option<&BlockBuffer>) -> bool {
        match self {
            Landing::Direct(page) => {
                verify_direct(sh, key, read, page, buf.expect("direct reads land in caller buffers"))
            }
            Landing::Staged(staging) => verify_and_copy_out(sh, key, read, staging.as_slice(), buf),
            // SAFETY: the read into the slot has completed and the slot is ours (Loading).
            Landing::Slot => verify_and_copy_out(sh, key, read, unsafe { slot_ref(sh, read.slot) }, buf),
        }
    }

    /// The I/O engine gave the read up: the kernel may still write into a heap buffer, so it is
    /// never freed (a slot is retired by the catalog instead).
    pub(super) fn abandon(self) {
        match self {
            Landing::Direct(page) | Landing::Staged(page) => std::mem::forget(page),
            Landing::Slot => {}
        }
    }
}

/// How an NVMe read ended, counted, and what it says of the tier's health (a block that fails
/// verification is bad, the disk is not).
pub(super) fn judge_nvme_read(
    sh: &StoreState,
    key: &BlockKey,
    read: &NvmeRead,
    io_result: std::io::Result<()>,
    mut landing: Landing,
    buf: Option<&BlockBuffer>,
) -> (LoadOutcome, Observed) {
    match io_result {
        Err(e) if is_abandoned(&e) => {
            log::error!("kvtier: read of block {key:?} abandoned by a broken I/O engine; counted as a miss");
            Stats::add(&sh.stats.io_errors, 1);
            landing.abandon();
            (LoadOutcome::Abandoned, Observed::Failed("the I/O engine gave the read up".to_string()))
        }
        Err(e) => {
            log::warn!("kvtier: read of block {key:?} failed: {e}; counted as a miss");
            Stats::add(&sh.stats.io_errors, 1);
            (LoadOutcome::IoError, Observed::Failed(e.to_string()))
        }
        Ok(()) if let Err(e) = landing.open(sh, read) => {
            log::warn!("kvtier: block {key:?} on NVMe is encrypted and {e}; counted as a miss");
            Stats::add(&sh.stats.nvme_auth_failures, 1);
            (LoadOutcome::Corrupt, Observed::CleanMiss)
        }
        Ok(()) if landing.verify_and_copy_out(sh, key, read, buf) => {
            Stats::add(&sh.stats.nvme_hits, 1);
            Stats::add(&sh.stats.bytes_read_nvme, sh.arena.slot_bytes() as u64);
            (LoadOutcome::Ok, Observed::Hit)
        }
        Ok(()) => {
            log::warn!("kvtier: block {key:?} failed verification on load; counted as a miss");
            Stats::add(&sh.stats.checksum_failures, 1);
            (LoadOutcome::Corrupt, Observed::CleanMiss)
        }
    }
}

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
fn verify_direct(sh: &StoreState, key: &BlockKey, read: &NvmeRead, page: &AlignedBuf, buf: &BlockBuffer) -> bool {
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
pub(super) fn copy_value_out(sh: &StoreState, slot: u32, buf: &BlockBuffer) {
    let mut value = unsafe { sh.arena.slot_ptr(slot).add(DESCRIPTOR_BYTES) };
    for &(segment, len) in &buf.segments {
        unsafe {
            std::ptr::copy_nonoverlapping(value, segment, len);
            value = value.add(len);
        }
    }
    Stats::add(&sh.stats.bytes_copied_out, sh.config.object_bytes as u64);
}

/// Checks a slot just read from NVMe against what the index expects and copies its value out.
/// The value is hashed and copied in cache-sized chunks (one pass over memory instead of two); if the
/// checksum then fails the caller's buffer holds unspecified bytes and the block is reported a miss.
fn verify_and_copy_out(
    sh: &StoreState,
    key: &BlockKey,
    read: &NvmeRead,
    bytes: &[u8],
    buf: Option<&BlockBuffer>,
) -> bool {
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
