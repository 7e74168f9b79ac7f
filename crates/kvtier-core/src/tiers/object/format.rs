//! Byte layouts of the object tier (docs/object-tier.md, version 1): segment objects (a header page,
//! then slots exactly as the DRAM tier and the shared tier hold them) and index objects (the keys of
//! one segment, checksummed and, with a deployment key, tagged). Little-endian; xxh3-64 checksums.

use super::config::MAX_SEGMENT_BYTES;
use crate::format::descriptor::DESCRIPTOR_BYTES;
use crate::format::shared::{AuthKey, TAG_BYTES};
use crate::format::{checksum, get_u32, get_u64, put_u32, put_u64, ParseError, ALIGN_BYTES};
use crate::key::{BlockKey, Namespace};

pub const SEGMENT_MAGIC: [u8; 8] = *b"KVTOSEG\0";
pub const INDEX_MAGIC: [u8; 8] = *b"KVTOIDX\0";
pub const OBJECT_FORMAT_VERSION: u32 = 1;
pub const SEGMENT_HEADER_BYTES: usize = ALIGN_BYTES;
pub const INDEX_HEADER_BYTES: usize = 96;
pub const INDEX_ENTRY_BYTES: usize = 48;
/// Bounds what a reader allocates for an index object: 1M entries (48 MiB).
pub const MAX_INDEX_ENTRIES: usize = 1 << 20;

/// The framing that index and access objects share: magic (8), format version (4), entry count (4)
/// at the start of a `header_bytes` header, `entry_bytes` per entry, then a tag (32; zero without a
/// deployment key) and an xxh3 checksum (8) of everything before it.
pub struct Framing {
    pub magic: [u8; 8],
    pub version: u32,
    pub header_bytes: usize,
    pub entry_bytes: usize,
    /// Bounds what a reader allocates.
    pub max_entries: usize,
    /// Name the parse errors give: the object ("index object") and its count ("index entry count").
    pub object: &'static str,
    pub count: &'static str,
}

impl Framing {
    /// A zeroed object of `n` entries, its magic, version and count written.
    pub fn start(&self, n: usize) -> Vec<u8> {
        assert!(n <= self.max_entries, "{}: {n} entries, at most {}", self.object, self.max_entries);
        let mut out = vec![0u8; self.header_bytes + n * self.entry_bytes + TAG_BYTES + 8];
        out[..8].copy_from_slice(&self.magic);
        put_u32(&mut out, 8, self.version);
        put_u32(&mut out, 12, n as u32);
        debug_assert_eq!(out.len() as u64, self.object_bytes(n), "a framed object's length is its entries'");
        out
    }

    /// Where entry `i` starts.
    pub fn entry_at(&self, i: usize) -> usize {
        self.header_bytes + i * self.entry_bytes
    }

    /// The length of an object of `n` entries (header, entries, tag, checksum).
    pub fn object_bytes(&self, n: usize) -> u64 {
        (self.entry_at(n) + TAG_BYTES + 8) as u64
    }

    /// Writes the tag (`tag`: the keyed tag of the bytes before it, with a deployment key) and the
    /// checksum: the object is complete.
    pub fn seal(&self, out: &mut [u8], tag: Option<impl Fn(&[u8]) -> [u8; TAG_BYTES]>) {
        assert!(out.len() >= self.header_bytes + TAG_BYTES + 8, "{}: sealed before it was started", self.object);
        let tag_at = out.len() - TAG_BYTES - 8;
        if let Some(tag) = tag {
            let t = tag(&out[..tag_at]);
            out[tag_at..tag_at + TAG_BYTES].copy_from_slice(&t);
        }
        let end = out.len() - 8;
        let sum = checksum(&out[..end]);
        put_u64(out, end, sum);
        debug_assert!(
            matches!(self.open(out, None::<fn(&[u8]) -> [u8; TAG_BYTES]>), Ok(Some(_))),
            "{}: reads back as sealed",
            self.object
        );
    }

    /// Checks length, magic, version, entry count, checksum and (with `tag`) the tag, compared in
    /// constant time. Returns the entry count; `Ok(None)`: intact but its tag does not verify.
    pub fn open(&self, b: &[u8], tag: Option<impl Fn(&[u8]) -> [u8; TAG_BYTES]>) -> Result<Option<usize>, ParseError> {
        if b.len() < self.header_bytes + TAG_BYTES + 8 {
            return Err(ParseError::TooShort(b.len()));
        }
        if b[..8] != self.magic {
            return Err(ParseError::BadMagic);
        }
        let version = get_u32(b, 8);
        if version != self.version {
            return Err(ParseError::Version(version));
        }
        let n = get_u32(b, 12) as usize;
        if n > self.max_entries || b.len() != self.entry_at(n) + TAG_BYTES + 8 {
            return Err(ParseError::OutOfRange(self.count));
        }
        if get_u64(b, b.len() - 8) != checksum(&b[..b.len() - 8]) {
            return Err(ParseError::BodyChecksum(self.object));
        }
        let tag_at = b.len() - TAG_BYTES - 8;
        if let Some(tag) = tag {
            let expected = blake3::Hash::from(tag(&b[..tag_at]));
            let stored: [u8; TAG_BYTES] = b[tag_at..tag_at + TAG_BYTES].try_into().unwrap();
            if expected != stored {
                return Ok(None);
            }
        }
        Ok(Some(n))
    }
}

pub const INDEX_FRAMING: Framing = Framing {
    magic: INDEX_MAGIC,
    version: OBJECT_FORMAT_VERSION,
    header_bytes: INDEX_HEADER_BYTES,
    entry_bytes: INDEX_ENTRY_BYTES,
    max_entries: MAX_INDEX_ENTRIES,
    object: "index object",
    count: "index entry count",
};

/// The longest index object of a segment of `slot_bytes` slots: one entry per slot of the largest
/// segment any store writes (`MAX_SEGMENT_BYTES`, one PUT), within `MAX_INDEX_ENTRIES`. A listed index
/// object longer than this is no index of this namespace's block size, and is never fetched.
pub fn max_index_bytes(slot_bytes: u64) -> u64 {
    assert!(slot_bytes > 0, "a slot holds at least its descriptor page");
    let slots = (MAX_SEGMENT_BYTES - SEGMENT_HEADER_BYTES as u64) / slot_bytes;
    INDEX_FRAMING.object_bytes((slots as usize).min(MAX_INDEX_ENTRIES))
}

/// `<writer 16 hex>-<seq 16 hex>`: the stem of a segment's and its index object's names.
pub fn stem(writer_id: u64, seq: u64) -> String {
    format!("{writer_id:016x}-{seq:016x}")
}

/// A segment's sequence number: the store's `count`-th segment, with a tenant's tag (the tier split
/// by tenant) in the high 32 bits. The stem keeps its pattern, so every version reads, serves and
/// evicts a tenant's segments. Past 2^32 segments from one store (petabytes) the tag is left out, so
/// that names stay unique (such a count reads as a tag: those segments are misattributed, not lost).
pub fn tenant_seq(count: u64, tenant: Option<u32>) -> u64 {
    match tenant {
        Some(tag) if count <= u32::MAX as u64 => (tag as u64) << 32 | count,
        _ => count,
    }
}

/// The tenant tag a stem's sequence carries (`tenant_seq`); None: the default tenant's, a segment
/// written before the split, or no stem kvtier writes.
pub fn stem_tenant(stem: &str) -> Option<u32> {
    if !valid_stem(stem) {
        return None;
    }
    let seq = u64::from_str_radix(&stem[17..], 16).ok()?;
    Some((seq >> 32) as u32).filter(|&tag| tag != 0)
}

/// Whether `stem` is one kvtier writes (anything else under the prefix is ignored).
pub fn valid_stem(stem: &str) -> bool {
    stem.len() == 33
        && stem.as_bytes()[16] == b'-'
        && stem.bytes().enumerate().all(|(i, b)| i == 16 || matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// One block of a segment: its key, the offset of its descriptor page, its value checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub key: BlockKey,
    pub offset: u64,
    pub value_checksum: u64,
}

/// The segment's header page (bytes 0..4096; checksum over 0..120, zero after 128).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentHeader {
    pub namespace: Namespace,
    pub object_bytes: u64,
    pub slot_bytes: u64,
    pub writer_id: u64,
    pub seq: u64,
    pub created_unix_ms: u64,
    pub count: u32,
}

impl SegmentHeader {
    pub fn encode(&self, out: &mut [u8]) {
        assert!(out.len() >= SEGMENT_HEADER_BYTES, "a segment header of {} bytes", out.len());
        out[..SEGMENT_HEADER_BYTES].fill(0);
        out[..8].copy_from_slice(&SEGMENT_MAGIC);
        put_u32(out, 8, OBJECT_FORMAT_VERSION);
        put_u32(out, 12, self.count);
        out[16..48].copy_from_slice(&self.namespace.0);
        put_u64(out, 48, self.object_bytes);
        put_u64(out, 56, self.slot_bytes);
        put_u64(out, 64, self.writer_id);
        put_u64(out, 72, self.seq);
        put_u64(out, 80, self.created_unix_ms);
        let sum = checksum(&out[..120]);
        put_u64(out, 120, sum);
    }

    /// For tools and tests: no read path needs the header (the index object locates every block).
    #[cfg(test)]
    pub fn decode(b: &[u8]) -> Result<Self, ParseError> {
        if b.len() < SEGMENT_HEADER_BYTES {
            return Err(ParseError::TooShort(b.len()));
        }
        if b[..8] != SEGMENT_MAGIC {
            return Err(ParseError::BadMagic);
        }
        if get_u64(b, 120) != checksum(&b[..120]) {
            return Err(ParseError::HeaderChecksum);
        }
        let version = get_u32(b, 8);
        if version != OBJECT_FORMAT_VERSION {
            return Err(ParseError::Version(version));
        }
        Ok(SegmentHeader {
            count: get_u32(b, 12),
            namespace: Namespace(b[16..48].try_into().unwrap()),
            object_bytes: get_u64(b, 48),
            slot_bytes: get_u64(b, 56),
            writer_id: get_u64(b, 64),
            seq: get_u64(b, 72),
            created_unix_ms: get_u64(b, 80),
        })
    }
}

/// The index object of one segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentIndex {
    pub namespace: Namespace,
    pub object_bytes: u64,
    pub writer_id: u64,
    pub seq: u64,
    pub segment_bytes: u64,
    pub created_unix_ms: u64,
    pub entries: Vec<Entry>,
}

impl SegmentIndex {
    /// Header (96), entries (48 each), tag (32; zero without a key), checksum (8) of all before it.
    pub fn encode(&self, auth: Option<&AuthKey>) -> Vec<u8> {
        let mut out = INDEX_FRAMING.start(self.entries.len());
        out[16..48].copy_from_slice(&self.namespace.0);
        put_u64(&mut out, 48, self.object_bytes);
        put_u64(&mut out, 56, self.writer_id);
        put_u64(&mut out, 64, self.seq);
        put_u64(&mut out, 72, self.segment_bytes);
        put_u64(&mut out, 80, self.created_unix_ms);
        for (i, e) in self.entries.iter().enumerate() {
            let at = INDEX_FRAMING.entry_at(i);
            out[at..at + 32].copy_from_slice(&e.key.0);
            put_u64(&mut out, at + 32, e.offset);
            put_u64(&mut out, at + 40, e.value_checksum);
        }
        INDEX_FRAMING.seal(&mut out, auth.map(|a| |body: &[u8]| a.object_index_tag(&self.namespace, body)));
        debug_assert_eq!(out.len() as u64, INDEX_FRAMING.object_bytes(self.entries.len()));
        out
    }

    /// Decodes and checks an index object (length, checksum, tag when `auth` is set, entry bounds).
    /// `Ok(None)`: intact but its tag does not verify (counted by the caller as an auth failure).
    pub fn decode(b: &[u8], auth: Option<(&AuthKey, &Namespace)>) -> Result<Option<Self>, ParseError> {
        let tag = auth.map(|(key, namespace)| move |body: &[u8]| key.object_index_tag(namespace, body));
        let opened = INDEX_FRAMING.open(b, tag)?;
        Ok(opened.map(|n| Self::decode_body(b, n)))
    }

    fn decode_body(b: &[u8], n: usize) -> Self {
        let entries = (0..n)
            .map(|i| {
                let at = INDEX_FRAMING.entry_at(i);
                Entry {
                    key: BlockKey(b[at..at + 32].try_into().unwrap()),
                    offset: get_u64(b, at + 32),
                    value_checksum: get_u64(b, at + 40),
                }
            })
            .collect();
        SegmentIndex {
            namespace: Namespace(b[16..48].try_into().unwrap()),
            object_bytes: get_u64(b, 48),
            writer_id: get_u64(b, 56),
            seq: get_u64(b, 64),
            segment_bytes: get_u64(b, 72),
            created_unix_ms: get_u64(b, 80),
            entries,
        }
    }

    /// Whether every entry is a whole slot inside the segment, past its header, and the index is
    /// this namespace's, object size's and name's.
    pub fn consistent(&self, namespace: &Namespace, object_bytes: u64, slot_bytes: u64, stem: &str) -> bool {
        self.namespace == *namespace
            && self.object_bytes == object_bytes
            && self::stem(self.writer_id, self.seq) == stem
            && self.entries.iter().all(|e| {
                e.offset >= SEGMENT_HEADER_BYTES as u64
                    && (e.offset - SEGMENT_HEADER_BYTES as u64).is_multiple_of(slot_bytes)
                    && e.offset.checked_add(slot_bytes).is_some_and(|end| end <= self.segment_bytes)
            })
    }
}

const _: () = assert!(SEGMENT_HEADER_BYTES == DESCRIPTOR_BYTES);

#[cfg(test)]
mod tests {
    use super::*;

    fn slot_offset(i: usize, slot_bytes: usize) -> u64 {
        (SEGMENT_HEADER_BYTES + i * slot_bytes) as u64
    }

    #[test]
    fn the_index_object_of_the_largest_segment_is_exactly_the_longest_allowed() {
        let slot_bytes = 4096 + 65536; // 64 KiB values: 77,101 slots in 5 GiB
        let slots = ((MAX_SEGMENT_BYTES - SEGMENT_HEADER_BYTES as u64) / slot_bytes) as usize;
        let entries = (0..slots)
            .map(|i| Entry { key: BlockKey([0; 32]), offset: slot_offset(i, slot_bytes as usize), value_checksum: 0 })
            .collect();
        let full = SegmentIndex { entries, segment_bytes: MAX_SEGMENT_BYTES, ..index() };
        let bytes = full.encode(None);
        assert_eq!(bytes.len() as u64, max_index_bytes(slot_bytes), "a listing must never skip a real one");
        assert!(SegmentIndex::decode(&bytes, None).is_ok());
        assert_eq!(max_index_bytes(8192), INDEX_FRAMING.object_bytes(655_359), "the smallest slots");
    }

    fn index() -> SegmentIndex {
        let entries = (0..3u8)
            .map(|i| Entry {
                key: BlockKey([i; 32]),
                offset: slot_offset(i as usize, 8192),
                value_checksum: i as u64 * 7,
            })
            .collect();
        SegmentIndex {
            namespace: Namespace([9; 32]),
            object_bytes: 4096,
            writer_id: 0xabc,
            seq: 5,
            segment_bytes: slot_offset(3, 8192),
            created_unix_ms: 1,
            entries,
        }
    }

    #[test]
    fn index_round_trips_and_checks() {
        let idx = index();
        let bytes = idx.encode(None);
        assert_eq!(bytes.len(), INDEX_HEADER_BYTES + 3 * INDEX_ENTRY_BYTES + TAG_BYTES + 8);
        assert_eq!(SegmentIndex::decode(&bytes, None).unwrap().unwrap(), idx);
        assert!(idx.consistent(&Namespace([9; 32]), 4096, 8192, &stem(0xabc, 5)));
        assert!(!idx.consistent(&Namespace([8; 32]), 4096, 8192, &stem(0xabc, 5)));
        assert!(!idx.consistent(&Namespace([9; 32]), 4096, 8192, &stem(0xabc, 6)));
        let mut flipped = bytes.clone();
        flipped[INDEX_HEADER_BYTES + 40] ^= 1;
        assert!(SegmentIndex::decode(&flipped, None).is_err());
        assert!(SegmentIndex::decode(&bytes[..bytes.len() - 1], None).is_err());
    }

    #[test]
    fn index_tag_binds_key_and_namespace() {
        let (k1, k2) = (AuthKey::derive(&[1; 32]), AuthKey::derive(&[2; 32]));
        let idx = index();
        let bytes = idx.encode(Some(&k1));
        let ns = Namespace([9; 32]);
        assert_eq!(SegmentIndex::decode(&bytes, Some((&k1, &ns))).unwrap(), Some(idx.clone()));
        assert_eq!(SegmentIndex::decode(&bytes, Some((&k2, &ns))).unwrap(), None);
        assert_eq!(SegmentIndex::decode(&bytes, Some((&k1, &Namespace([1; 32])))).unwrap(), None);
        assert_eq!(SegmentIndex::decode(&idx.encode(None), Some((&k1, &ns))).unwrap(), None);
    }

    #[test]
    fn entries_outside_the_segment_are_inconsistent() {
        let mut idx = index();
        idx.entries[1].offset += 1;
        assert!(!idx.consistent(&Namespace([9; 32]), 4096, 8192, &stem(0xabc, 5)));
        let mut idx = index();
        idx.segment_bytes -= 1;
        assert!(!idx.consistent(&Namespace([9; 32]), 4096, 8192, &stem(0xabc, 5)));
    }

    #[test]
    fn header_round_trips() {
        let h = SegmentHeader {
            namespace: Namespace([3; 32]),
            object_bytes: 4096,
            slot_bytes: 8192,
            writer_id: 1,
            seq: 2,
            created_unix_ms: 3,
            count: 4,
        };
        let mut page = vec![0u8; SEGMENT_HEADER_BYTES];
        h.encode(&mut page);
        assert_eq!(SegmentHeader::decode(&page).unwrap(), h);
        page[50] ^= 1;
        assert!(SegmentHeader::decode(&page).is_err());
        assert!(valid_stem(&stem(1, 2)) && !valid_stem("x") && !valid_stem(&stem(0xab, 2).to_uppercase()));
        let tagged = stem(1, tenant_seq(2, Some(0x1234_abcd)));
        assert!(valid_stem(&tagged) && stem_tenant(&tagged) == Some(0x1234_abcd), "{tagged}");
        assert_eq!(stem_tenant(&stem(1, tenant_seq(2, None))), None, "the default tenant's");
        assert_eq!(tenant_seq(1 << 32, Some(7)), 1 << 32, "past 2^32 segments: no tag, names stay unique");
        assert_eq!(stem_tenant("not a stem"), None);
    }
}
