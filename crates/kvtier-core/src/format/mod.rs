//! On-disk formats, byte by byte: the NVMe tier's (mirrored in `docs/format.md`) and, in [`shared`],
//! the shared tier's (mirrored in `docs/shared-tier.md`).
//!
//! Every structure carries a magic number, a format version and an xxh3-64 checksum of its header,
//! and every parser here treats its input as hostile: lengths are bounded before they are used and
//! nothing is trusted until its checksum passes.

pub mod budget;
pub mod descriptor;
pub mod encrypted;
/// The shared tier's files (data file header and footer, manifest records, lease). Here rather than
/// beside the tier that writes them, so that formats depend on nothing above them.
pub mod shared;
pub mod superblock;
pub mod timeline;
pub mod trailer;

/// Alignment of every on-disk structure and value (O_DIRECT and page size).
pub const ALIGN_BYTES: usize = 4096;

pub(crate) fn round_up(value: usize, align: usize) -> usize {
    debug_assert!(align > 0);
    let rounded = value.div_ceil(align) * align;
    debug_assert!(rounded >= value && rounded.is_multiple_of(align) && rounded - value < align);
    rounded
}

/// XXH3-64 (seed 0) of `bytes`. twox-hash picks AVX2/SSE2/NEON at run time, about twice the speed
/// of a build for baseline x86-64; the value is the standard XXH3-64, so the format does not depend
/// on the implementation.
pub fn checksum(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

/// The same checksum over bytes that arrive in pieces.
pub fn checksum_hasher() -> twox_hash::XxHash3_64 {
    twox_hash::XxHash3_64::with_seed(0)
}

pub(crate) fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().unwrap())
}
pub(crate) fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
pub(crate) fn get_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}
pub(crate) fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Why a stored structure was rejected. Never fatal to the store: the caller counts it as a miss.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("buffer too short ({0} bytes)")]
    TooShort(usize),
    #[error("bad magic")]
    BadMagic,
    #[error("unsupported format version {0}")]
    Version(u32),
    #[error("header checksum mismatch")]
    HeaderChecksum,
    /// The header is intact but what it covers by checksum (entries, an index, a record) is not.
    #[error("checksum mismatch in the {0}")]
    BodyChecksum(&'static str),
    #[error("field out of range: {0}")]
    OutOfRange(&'static str),
}
