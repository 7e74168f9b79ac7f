//! Device superblock: the first 4096 bytes of every NVMe device file.
//!
//! ```text
//! offset size field
//!      0    8 magic            b"KVTRDEV\0"
//!      8    4 format_version   u32 LE (1)
//!     12    4 device_index     u32 LE (stripe member index)
//!     16    4 device_count     u32 LE
//!     20    4 reserved (0)
//!     24   32 namespace        namespace digest
//!     56    8 region_bytes     u64 LE (multiple of 4096)
//!     64    8 region_count     u64 LE
//!     72    8 slot_bytes       u64 LE (descriptor page + value rounded up to 4096)
//!     80    8 object_bytes     u64 LE (value length of every block)
//!     88    8 store_id         u64 LE (random, equal on every device of one store)
//!     96 3992 reserved (0)
//!   4088    8 header_checksum  xxh3-64 of bytes 0..4088
//! ```
//! Region `i` starts at byte `4096 + i * region_bytes`.

use super::*;
use crate::key::Namespace;

pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"KVTRDEV\0";
pub const SUPERBLOCK_VERSION: u32 = 1;
pub const SUPERBLOCK_BYTES: usize = 4096;
const CHECKSUM_AT: usize = SUPERBLOCK_BYTES - 8;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub device_index: u32,
    pub device_count: u32,
    pub namespace: Namespace,
    pub region_bytes: u64,
    pub region_count: u64,
    pub slot_bytes: u64,
    pub object_bytes: u64,
    pub store_id: u64,
}

impl Superblock {
    pub fn encode(&self, out: &mut [u8]) {
        assert!(out.len() >= SUPERBLOCK_BYTES, "a superblock page of {} bytes", out.len());
        let out = &mut out[..SUPERBLOCK_BYTES];
        out.fill(0);
        out[0..8].copy_from_slice(&SUPERBLOCK_MAGIC);
        put_u32(out, 8, SUPERBLOCK_VERSION);
        put_u32(out, 12, self.device_index);
        put_u32(out, 16, self.device_count);
        out[24..56].copy_from_slice(&self.namespace.0);
        put_u64(out, 56, self.region_bytes);
        put_u64(out, 64, self.region_count);
        put_u64(out, 72, self.slot_bytes);
        put_u64(out, 80, self.object_bytes);
        put_u64(out, 88, self.store_id);
        let sum = checksum(&out[..CHECKSUM_AT]);
        put_u64(out, CHECKSUM_AT, sum);
        // Reads back past its checksum (the ranges it checks are the caller's choice).
        debug_assert!(!matches!(
            Superblock::decode(out),
            Err(ParseError::TooShort(_) | ParseError::BadMagic | ParseError::Version(_) | ParseError::HeaderChecksum)
        ));
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, ParseError> {
        if bytes.len() < SUPERBLOCK_BYTES {
            return Err(ParseError::TooShort(bytes.len()));
        }
        if bytes[0..8] != SUPERBLOCK_MAGIC {
            return Err(ParseError::BadMagic);
        }
        let version = get_u32(bytes, 8);
        if version != SUPERBLOCK_VERSION {
            return Err(ParseError::Version(version));
        }
        if checksum(&bytes[..CHECKSUM_AT]) != get_u64(bytes, CHECKSUM_AT) {
            return Err(ParseError::HeaderChecksum);
        }
        let sb = Superblock {
            device_index: get_u32(bytes, 12),
            device_count: get_u32(bytes, 16),
            namespace: Namespace(bytes[24..56].try_into().unwrap()),
            region_bytes: get_u64(bytes, 56),
            region_count: get_u64(bytes, 64),
            slot_bytes: get_u64(bytes, 72),
            object_bytes: get_u64(bytes, 80),
            store_id: get_u64(bytes, 88),
        };
        if sb.region_bytes == 0 || !sb.region_bytes.is_multiple_of(ALIGN_BYTES as u64) {
            return Err(ParseError::OutOfRange("region_bytes"));
        }
        if sb.slot_bytes == 0 || !sb.slot_bytes.is_multiple_of(ALIGN_BYTES as u64) || sb.slot_bytes > sb.region_bytes {
            return Err(ParseError::OutOfRange("slot_bytes"));
        }
        if sb.device_index >= sb.device_count {
            return Err(ParseError::OutOfRange("device_index"));
        }
        if sb.object_bytes.saturating_add(ALIGN_BYTES as u64) > sb.slot_bytes {
            return Err(ParseError::OutOfRange("object_bytes"));
        }
        Ok(sb)
    }
}
