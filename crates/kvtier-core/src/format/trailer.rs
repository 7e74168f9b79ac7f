//! Region trailer: written once at the end of a sealed region, listing its entries, so that a restart
//! rebuilds the index from trailers without reading values.
//!
//! The trailer occupies the last `trailer_bytes(max_entries)` bytes of the region.
//! ```text
//! header (64 bytes)
//!      0    8 magic            b"KVTRTRL\0"
//!      8    4 format_version   u32 LE (1)
//!     12    4 entry_count      u32 LE (<= the region's max_entries)
//!     16    8 region_seq       u64 LE (generation of the region)
//!     24    8 region_index     u64 LE
//!     32    8 entries_checksum xxh3-64 of the entry array (entry_count * 64 bytes)
//!     40   16 reserved (0)
//!     56    8 header_checksum  xxh3-64 of bytes 0..56
//! entries (64 bytes each), from byte 64
//!      0   32 key
//!     32    8 sequence         u64 LE
//!     40    8 offset           u64 LE (byte offset of the entry's descriptor inside the region)
//!     48    4 value_bytes      u32 LE
//!     52    4 reserved (0)
//!     56    8 value_checksum   xxh3-64
//! ```

use super::*;
use crate::key::BlockKey;

pub const TRAILER_MAGIC: [u8; 8] = *b"KVTRTRL\0";
pub const TRAILER_VERSION: u32 = 1;
pub const TRAILER_HEADER_BYTES: usize = 64;
pub const TRAILER_ENTRY_BYTES: usize = 64;

/// Bytes reserved at the end of a region for a trailer of up to `max_entries` entries.
pub fn trailer_bytes(max_entries: usize) -> usize {
    let bytes = round_up(TRAILER_HEADER_BYTES + TRAILER_ENTRY_BYTES * max_entries, ALIGN_BYTES);
    debug_assert!(bytes.is_multiple_of(ALIGN_BYTES) && bytes >= TRAILER_HEADER_BYTES);
    bytes
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrailerEntry {
    pub key: BlockKey,
    pub sequence: u64,
    pub offset: u64,
    pub value_bytes: u32,
    pub value_checksum: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trailer {
    pub region_seq: u64,
    pub region_index: u64,
    pub entries: Vec<TrailerEntry>,
}

impl Trailer {
    /// Encodes into `out`, which must be `trailer_bytes(max_entries)` long.
    pub fn encode(&self, out: &mut [u8]) {
        let count = self.entries.len();
        assert!(
            out.len() >= TRAILER_HEADER_BYTES + count * TRAILER_ENTRY_BYTES,
            "a trailer of {count} entries in {} bytes",
            out.len()
        );
        assert!(count <= u32::MAX as usize);
        out.fill(0);
        for (i, e) in self.entries.iter().enumerate() {
            let at = TRAILER_HEADER_BYTES + i * TRAILER_ENTRY_BYTES;
            out[at..at + 32].copy_from_slice(&e.key.0);
            put_u64(out, at + 32, e.sequence);
            put_u64(out, at + 40, e.offset);
            put_u32(out, at + 48, e.value_bytes);
            put_u64(out, at + 56, e.value_checksum);
        }
        let entries_end = TRAILER_HEADER_BYTES + count * TRAILER_ENTRY_BYTES;
        let entries_sum = checksum(&out[TRAILER_HEADER_BYTES..entries_end]);
        out[0..8].copy_from_slice(&TRAILER_MAGIC);
        put_u32(out, 8, TRAILER_VERSION);
        put_u32(out, 12, count as u32);
        put_u64(out, 16, self.region_seq);
        put_u64(out, 24, self.region_index);
        put_u64(out, 32, entries_sum);
        let sum = checksum(&out[..56]);
        put_u64(out, 56, sum);
        debug_assert_eq!(Trailer::decode(out), Ok(Some(self.clone())), "a trailer reads back as written");
    }

    /// Decodes a trailer area. `Ok(None)` means no trailer (an open, empty or invalidated region).
    pub fn decode(bytes: &[u8]) -> Result<Option<Self>, ParseError> {
        if bytes.len() < TRAILER_HEADER_BYTES {
            return Err(ParseError::TooShort(bytes.len()));
        }
        if bytes[0..8] != TRAILER_MAGIC {
            return Ok(None);
        }
        let version = get_u32(bytes, 8);
        if version != TRAILER_VERSION {
            return Err(ParseError::Version(version));
        }
        if checksum(&bytes[..56]) != get_u64(bytes, 56) {
            return Err(ParseError::HeaderChecksum);
        }
        let count = get_u32(bytes, 12) as usize;
        let entries_end = count
            .checked_mul(TRAILER_ENTRY_BYTES)
            .and_then(|n| n.checked_add(TRAILER_HEADER_BYTES))
            .filter(|&end| end <= bytes.len())
            .ok_or(ParseError::OutOfRange("entry_count"))?;
        if checksum(&bytes[TRAILER_HEADER_BYTES..entries_end]) != get_u64(bytes, 32) {
            return Err(ParseError::BodyChecksum("trailer entries"));
        }
        let entries = (0..count)
            .map(|i| {
                let at = TRAILER_HEADER_BYTES + i * TRAILER_ENTRY_BYTES;
                TrailerEntry {
                    key: BlockKey(bytes[at..at + 32].try_into().unwrap()),
                    sequence: get_u64(bytes, at + 32),
                    offset: get_u64(bytes, at + 40),
                    value_bytes: get_u32(bytes, at + 48),
                    value_checksum: get_u64(bytes, at + 56),
                }
            })
            .collect();
        Ok(Some(Trailer { region_seq: get_u64(bytes, 16), region_index: get_u64(bytes, 24), entries }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn damaged_entries_are_reported_as_such_not_as_a_bad_header() {
        let entry =
            TrailerEntry { key: BlockKey([7; 32]), sequence: 3, offset: 4096, value_bytes: 100, value_checksum: 9 };
        let trailer = Trailer { region_seq: 5, region_index: 1, entries: vec![entry; 2] };
        let mut buf = vec![0u8; trailer_bytes(4)];
        trailer.encode(&mut buf);
        assert_eq!(Trailer::decode(&buf), Ok(Some(trailer)));
        buf[TRAILER_HEADER_BYTES + TRAILER_ENTRY_BYTES + 40] ^= 1;
        assert_eq!(Trailer::decode(&buf), Err(ParseError::BodyChecksum("trailer entries")));
        buf[20] ^= 1;
        assert_eq!(Trailer::decode(&buf), Err(ParseError::HeaderChecksum));
    }
}
