//! Slot descriptor: the 4096-byte page in front of every stored value, in DRAM slots and on NVMe alike,
//! so that one read of `slot_bytes` lands descriptor and value in a DRAM slot with no copy.
//!
//! ```text
//! offset size field
//!      0    8 magic            b"KVTRENT\0"
//!      8    2 format_version   u16 LE (1; 2: the value is encrypted, see `encrypted.rs`)
//!     10    2 flags            u16 LE (0; version 2: bit 0, encrypted, set)
//!     12    4 value_bytes      u32 LE (length of the value that follows the page)
//!     16   32 key              block key
//!     48   32 namespace        namespace digest
//!     80    8 sequence         u64 LE (store-wide, increasing with every accepted put)
//!     88    8 region_seq       u64 LE (generation of the region the entry was written into; 0 in DRAM)
//!     96    8 value_checksum   xxh3-64 of the value bytes
//!    104   16 reserved (0)
//!    120    8 header_checksum  xxh3-64 of bytes 0..120
//!    128 3968 zero padding (version 2: the encryption header's 48 bytes at 256, `encrypted.rs`)
//! ```

use super::*;
use crate::key::{BlockKey, Namespace};

pub const DESCRIPTOR_MAGIC: [u8; 8] = *b"KVTRENT\0";
pub const DESCRIPTOR_VERSION: u16 = 1;
/// The version of a descriptor whose value is encrypted (at rest, `format::encrypted`).
pub const DESCRIPTOR_VERSION_ENCRYPTED: u16 = 2;
const FLAG_ENCRYPTED: u16 = 1;
pub const DESCRIPTOR_BYTES: usize = 4096;
const CHECKSUM_AT: usize = 120;
pub const DESCRIPTOR_USED_BYTES: usize = 128;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    pub value_bytes: u32,
    pub key: BlockKey,
    pub namespace: Namespace,
    pub sequence: u64,
    pub region_seq: u64,
    pub value_checksum: u64,
}

impl Descriptor {
    /// Writes the used part of the page; the padding is left as the caller has it (zero).
    pub fn encode(&self, out: &mut [u8]) {
        assert!(out.len() >= DESCRIPTOR_USED_BYTES, "a descriptor page of {} bytes", out.len());
        let out = &mut out[..DESCRIPTOR_USED_BYTES];
        out.fill(0);
        out[0..8].copy_from_slice(&DESCRIPTOR_MAGIC);
        put_u16(out, 8, DESCRIPTOR_VERSION);
        put_u32(out, 12, self.value_bytes);
        out[16..48].copy_from_slice(&self.key.0);
        out[48..80].copy_from_slice(&self.namespace.0);
        put_u64(out, 80, self.sequence);
        put_u64(out, 88, self.region_seq);
        put_u64(out, 96, self.value_checksum);
        let sum = checksum(&out[..CHECKSUM_AT]);
        put_u64(out, CHECKSUM_AT, sum);
        debug_assert_eq!(Descriptor::decode(out), Ok(*self), "a descriptor reads back as written");
    }

    /// Rewrites the `region_seq` of an encoded descriptor (and its header checksum) in place.
    pub fn stamp_region_seq(page: &mut [u8], region_seq: u64) -> Result<(), ParseError> {
        let mut desc = Descriptor::decode(page)?;
        desc.region_seq = region_seq;
        desc.encode(page);
        debug_assert_eq!(Descriptor::decode(page).map(|d| d.region_seq), Ok(region_seq));
        Ok(())
    }

    /// Whether an encoded page says its value is encrypted (version 2, flag set; not validated).
    pub fn is_encrypted(page: &[u8]) -> bool {
        page.len() >= DESCRIPTOR_USED_BYTES
            && get_u16(page, 8) == DESCRIPTOR_VERSION_ENCRYPTED
            && get_u16(page, 10) & FLAG_ENCRYPTED != 0
    }

    /// Marks an encoded page encrypted (version 2, flag bit 0) and checksums it again; the encryption
    /// header is the cipher's to write.
    pub fn mark_encrypted(page: &mut [u8]) {
        assert!(page.len() >= DESCRIPTOR_USED_BYTES, "a descriptor page of {} bytes", page.len());
        put_u16(page, 8, DESCRIPTOR_VERSION_ENCRYPTED);
        put_u16(page, 10, FLAG_ENCRYPTED);
        let sum = checksum(&page[..CHECKSUM_AT]);
        put_u64(page, CHECKSUM_AT, sum);
        debug_assert!(Descriptor::is_encrypted(page));
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, ParseError> {
        if bytes.len() < DESCRIPTOR_USED_BYTES {
            return Err(ParseError::TooShort(bytes.len()));
        }
        if bytes[0..8] != DESCRIPTOR_MAGIC {
            return Err(ParseError::BadMagic);
        }
        let version = get_u16(bytes, 8);
        let flags = get_u16(bytes, 10);
        let known =
            matches!((version, flags), (DESCRIPTOR_VERSION, 0) | (DESCRIPTOR_VERSION_ENCRYPTED, FLAG_ENCRYPTED));
        if !known {
            return Err(ParseError::Version(version as u32));
        }
        if checksum(&bytes[..CHECKSUM_AT]) != get_u64(bytes, CHECKSUM_AT) {
            return Err(ParseError::HeaderChecksum);
        }
        Ok(Descriptor {
            value_bytes: get_u32(bytes, 12),
            key: BlockKey(bytes[16..48].try_into().unwrap()),
            namespace: Namespace(bytes[48..80].try_into().unwrap()),
            sequence: get_u64(bytes, 80),
            region_seq: get_u64(bytes, 88),
            value_checksum: get_u64(bytes, 96),
        })
    }
}
