//! On-disk formats of the shared tier, byte by byte (mirrored in `docs/shared-tier.md`): the data
//! file header page, the footer index and trailer, the manifest records and the evictor lease.
//!
//! Everything here is read from a directory that other machines write, so every parser treats its
//! input as hostile: lengths are bounded before use, file names are checked against the one pattern
//! kvtier writes (no path can escape the namespace directory), and nothing is trusted until its
//! checksum passes. All integers are little-endian; checksums are xxh3-64. With a deployment key
//! (`shared_key_file`, see [`AuthKey`]) every block and every manifest record also carries a 32-byte
//! keyed BLAKE3 tag (all zero when written without a key), checked before the block is served or the
//! record applied.
//!
//! Data file `<writer>-<seq>.kvs` (`writer` 16 hex digits, `seq` 8 hex digits), or, when the tier is
//! split by tenant, `<writer>-<tenant><seq>.kvs` for a tenant other than the default one (`tenant`:
//! 8 hex digits, the first 4 bytes of its id; see [`data_file_name`]):
//! ```text
//! header page (4096 bytes)
//!      0    8 magic            b"KVTSHDR\0"
//!      8    4 format_version   u32 (2)
//!     12    4 reserved (0)
//!     16   32 namespace        namespace digest
//!     48    8 object_bytes     u64 (value length of every entry)
//!     56    8 slot_bytes       u64 (4096 + object_bytes rounded up to 4096)
//!     64    8 writer_id        u64
//!     72    8 file_seq         u64
//!     80    8 created_unix_ms  u64
//!     88   32 reserved (0)
//!    120    8 header_checksum  xxh3-64 of bytes 0..120
//!    128 3968 zero padding
//! entries, from byte 4096, each `slot_bytes` long, exactly an NVMe slot:
//!      descriptor page (format::descriptor, region_seq = file_seq; bytes 128..160 of the page: the
//!      block tag, `AuthKey::block_tag`, zero without a key), value, zero padding to 4096
//! footer, from `index_offset` = 4096 + count * slot_bytes to the end of the file
//!      count * 48 bytes of index entries: key (32), offset u64 (of the entry's descriptor), value_checksum u64
//!      zero padding so that the file length is a multiple of 4096
//!      last 64 bytes: the trailer
//!          0  8 magic b"KVTSFTR\0"   8 4 format_version u32 (2)   12 4 entry_count u32
//!         16  8 index_offset u64      24 8 index_checksum (xxh3-64 of the index entries)
//!         32  8 writer_id u64         40 8 file_seq u64            48 8 file_bytes u64
//!         56  8 trailer_checksum (xxh3-64 of trailer bytes 0..56)
//! ```

use crate::format::{checksum, get_u16, get_u32, get_u64, put_u32, put_u64, round_up, ParseError, ALIGN_BYTES};
use crate::key::{BlockKey, Namespace, KEY_BYTES};

pub const FILE_HEADER_MAGIC: [u8; 8] = *b"KVTSHDR\0";
pub const FILE_FOOTER_MAGIC: [u8; 8] = *b"KVTSFTR\0";
pub const MANIFEST_MAGIC: [u8; 8] = *b"KVTSMAN\0";
pub const LEASE_MAGIC: [u8; 8] = *b"KVTSLSE\0";
/// Version of the data file header and footer trailer. 2: each entry's descriptor page carries the
/// block tag at `BLOCK_TAG_AT` (version 1 left those bytes zero; readers still accept its entries
/// when no key is configured, since they read only descriptor pages and values).
pub const SHARED_FORMAT_VERSION: u32 = 2;
/// Version of the evictor lease (its layout did not change with the tags).
pub const LEASE_FORMAT_VERSION: u32 = 1;
/// Bytes of a keyed BLAKE3 tag (block or manifest record).
pub const TAG_BYTES: usize = 32;
/// Offset of the block tag inside an entry's descriptor page (the page's padding: the descriptor
/// itself, shared with the DRAM and NVMe tiers, is unchanged).
pub const BLOCK_TAG_AT: usize = crate::format::descriptor::DESCRIPTOR_USED_BYTES;
/// Context string of `blake3::derive_key`: the 32-byte MAC key is derived from the key file's bytes.
pub const KEY_DERIVATION_CONTEXT: &str = "kvtier shared tier v1";
const BLOCK_TAG_DOMAIN: &[u8; 16] = b"kvtier block v1\0";
const RECORD_TAG_DOMAIN: &[u8; 16] = b"kvtier record v1";
const OBJECT_INDEX_TAG_DOMAIN: &[u8; 16] = b"kvtier objidx v1";
const OBJECT_ACCESS_TAG_DOMAIN: &[u8; 16] = b"kvtier objacc v1";
pub const FILE_HEADER_BYTES: usize = ALIGN_BYTES;
pub const INDEX_ENTRY_BYTES: usize = 48;
pub const FOOTER_TRAILER_BYTES: usize = 64;
pub const LEASE_BYTES: usize = 64;
/// Longest manifest record accepted; a longer length prefix is corruption, not a record.
pub const MAX_RECORD_BYTES: usize = 64 << 20;
const HEADER_CHECKSUM_AT: usize = 120;

/// The name of a data file: `<writer 16 hex>-<seq 8 hex>.kvs`, or with `tenant` (the tier split by
/// tenant, its tag: the first 4 bytes of its id) `<writer>-<tenant 8 hex><seq 8 hex>.kvs`. The tenant is folded into the
/// sequence's digits (at most 16 of them) so that the pattern stays the one every earlier version
/// checks: those read, serve and evict a tenant's files as any other. A sequence past 32 bits (four
/// billion files from one writer) is named without its tenant.
pub fn data_file_name(writer_id: u64, file_seq: u64, tenant: Option<u32>) -> String {
    match tenant {
        Some(tag) if file_seq <= u32::MAX as u64 => format!("{writer_id:016x}-{tag:08x}{file_seq:08x}.kvs"),
        _ => format!("{writer_id:016x}-{file_seq:08x}.kvs"),
    }
}

/// The tenant tag a data file's name carries (`data_file_name`); None: the default tenant's, or a
/// file named before the split. Sequences of 16 digits are never written otherwise (2^60 files), and
/// a tag is never zero (`tiers::remote::tenants::tenant_tag`).
pub fn data_file_tenant(name: &str) -> Option<u32> {
    let digits = name.strip_suffix(".kvs")?.split_once('-')?.1;
    if digits.len() != 16 {
        return None;
    }
    u32::from_str_radix(&digits[..8], 16).ok().filter(|&tag| tag != 0)
}

/// Accepts only names produced by `data_file_name`, so a hostile manifest cannot name `../x`.
pub fn valid_data_file_name(name: &str) -> bool {
    let b = name.as_bytes();
    let hex = |s: &[u8]| s.iter().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c));
    b.len() >= 16 + 1 + 8 + 4
        && b.len() <= 16 + 1 + 16 + 4
        && hex(&b[..16])
        && b[16] == b'-'
        && name.ends_with(".kvs")
        && hex(&b[17..b.len() - 4])
}

/// Fan-out subdirectory of a data file (`data/<2 hex>/`): 256 directories at most, chosen from the
/// name so every process derives the same path without a lookup.
pub fn fanout_dir(name: &str) -> String {
    format!("{:02x}", checksum(name.as_bytes()) & 0xff)
}

/// Length of the footer (index, padding, trailer) of a file holding `count` entries.
pub fn footer_bytes(count: usize) -> usize {
    let bytes = round_up(count * INDEX_ENTRY_BYTES + FOOTER_TRAILER_BYTES, ALIGN_BYTES);
    debug_assert!(bytes.is_multiple_of(ALIGN_BYTES) && bytes >= count * INDEX_ENTRY_BYTES + FOOTER_TRAILER_BYTES);
    bytes
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileHeader {
    pub namespace: Namespace,
    pub object_bytes: u64,
    pub slot_bytes: u64,
    pub writer_id: u64,
    pub file_seq: u64,
    pub created_unix_ms: u64,
}

impl FileHeader {
    pub fn encode(&self, out: &mut [u8]) {
        assert!(out.len() >= FILE_HEADER_BYTES, "a file header page of {} bytes", out.len());
        let out = &mut out[..FILE_HEADER_BYTES];
        out.fill(0);
        out[0..8].copy_from_slice(&FILE_HEADER_MAGIC);
        put_u32(out, 8, SHARED_FORMAT_VERSION);
        out[16..48].copy_from_slice(&self.namespace.0);
        put_u64(out, 48, self.object_bytes);
        put_u64(out, 56, self.slot_bytes);
        put_u64(out, 64, self.writer_id);
        put_u64(out, 72, self.file_seq);
        put_u64(out, 80, self.created_unix_ms);
        let sum = checksum(&out[..HEADER_CHECKSUM_AT]);
        put_u64(out, HEADER_CHECKSUM_AT, sum);
        debug_assert_eq!(FileHeader::decode(out), Ok(*self), "a file header reads back as written");
    }

    pub fn decode(b: &[u8]) -> Result<Self, ParseError> {
        if b.len() < 128 {
            return Err(ParseError::TooShort(b.len()));
        }
        if b[0..8] != FILE_HEADER_MAGIC {
            return Err(ParseError::BadMagic);
        }
        let version = get_u32(b, 8);
        if version != SHARED_FORMAT_VERSION {
            return Err(ParseError::Version(version));
        }
        if checksum(&b[..HEADER_CHECKSUM_AT]) != get_u64(b, HEADER_CHECKSUM_AT) {
            return Err(ParseError::HeaderChecksum);
        }
        Ok(FileHeader {
            namespace: Namespace(b[16..48].try_into().unwrap()),
            object_bytes: get_u64(b, 48),
            slot_bytes: get_u64(b, 56),
            writer_id: get_u64(b, 64),
            file_seq: get_u64(b, 72),
            created_unix_ms: get_u64(b, 80),
        })
    }
}

/// One block of a data file, as the footer index and the manifest list it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexEntry {
    pub key: BlockKey,
    /// Byte offset of the entry's descriptor page in the data file.
    pub offset: u64,
    pub value_checksum: u64,
}

impl IndexEntry {
    fn encode(&self, out: &mut [u8]) {
        debug_assert!(out.len() >= INDEX_ENTRY_BYTES);
        out[..32].copy_from_slice(&self.key.0);
        put_u64(out, 32, self.offset);
        put_u64(out, 40, self.value_checksum);
    }

    fn decode(b: &[u8]) -> Self {
        IndexEntry {
            key: BlockKey(b[..KEY_BYTES].try_into().unwrap()),
            offset: get_u64(b, 32),
            value_checksum: get_u64(b, 40),
        }
    }
}

/// Encodes the footer (index + padding + trailer) of a file whose entries end at `index_offset`.
pub fn encode_footer(entries: &[IndexEntry], index_offset: u64, writer_id: u64, file_seq: u64, out: &mut [u8]) {
    let len = footer_bytes(entries.len());
    assert!(out.len() >= len, "a footer of {} entries in {} bytes", entries.len(), out.len());
    assert!(entries.len() <= u32::MAX as usize);
    let out = &mut out[..len];
    out.fill(0);
    for (i, e) in entries.iter().enumerate() {
        e.encode(&mut out[i * INDEX_ENTRY_BYTES..(i + 1) * INDEX_ENTRY_BYTES]);
    }
    let index_sum = checksum(&out[..entries.len() * INDEX_ENTRY_BYTES]);
    let t = &mut out[len - FOOTER_TRAILER_BYTES..];
    t[0..8].copy_from_slice(&FILE_FOOTER_MAGIC);
    put_u32(t, 8, SHARED_FORMAT_VERSION);
    put_u32(t, 12, entries.len() as u32);
    put_u64(t, 16, index_offset);
    put_u64(t, 24, index_sum);
    put_u64(t, 32, writer_id);
    put_u64(t, 40, file_seq);
    put_u64(t, 48, index_offset + len as u64);
    let sum = checksum(&t[..56]);
    put_u64(t, 56, sum);
    debug_assert!(
        FooterTrailer::decode(t)
            .is_ok_and(|f| f.entry_count as usize == entries.len() && f.index_offset == index_offset),
        "a footer reads back as written"
    );
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FooterTrailer {
    pub entry_count: u32,
    pub index_offset: u64,
    pub index_checksum: u64,
    pub writer_id: u64,
    pub file_seq: u64,
    pub file_bytes: u64,
}

impl FooterTrailer {
    pub fn decode(t: &[u8]) -> Result<Self, ParseError> {
        if t.len() < FOOTER_TRAILER_BYTES {
            return Err(ParseError::TooShort(t.len()));
        }
        if t[0..8] != FILE_FOOTER_MAGIC {
            return Err(ParseError::BadMagic);
        }
        let version = get_u32(t, 8);
        if version != SHARED_FORMAT_VERSION {
            return Err(ParseError::Version(version));
        }
        if checksum(&t[..56]) != get_u64(t, 56) {
            return Err(ParseError::HeaderChecksum);
        }
        let trailer = FooterTrailer {
            entry_count: get_u32(t, 12),
            index_offset: get_u64(t, 16),
            index_checksum: get_u64(t, 24),
            writer_id: get_u64(t, 32),
            file_seq: get_u64(t, 40),
            file_bytes: get_u64(t, 48),
        };
        let footer = footer_bytes(trailer.entry_count as usize) as u64;
        if trailer.index_offset.checked_add(footer) != Some(trailer.file_bytes) {
            return Err(ParseError::OutOfRange("index_offset"));
        }
        Ok(trailer)
    }

    /// Decodes the index entries (`bytes` starts at `index_offset`).
    pub fn decode_index(&self, bytes: &[u8]) -> Result<Vec<IndexEntry>, ParseError> {
        let n = self.entry_count as usize * INDEX_ENTRY_BYTES;
        if bytes.len() < n {
            return Err(ParseError::TooShort(bytes.len()));
        }
        if checksum(&bytes[..n]) != self.index_checksum {
            return Err(ParseError::BodyChecksum("file index"));
        }
        Ok(bytes[..n].chunks_exact(INDEX_ENTRY_BYTES).map(IndexEntry::decode).collect())
    }
}

// ---- manifest records ----
//
// A manifest `manifests/<writer 16 hex>.log` is a sequence of records, each:
//      0 4 record_bytes u32 (whole record, this field, the tag and the checksum included; 48 ..= 64 MiB)
//      4 1 kind u8 (1 header, 2 publish, 3 doom, 4 quarantine, 5 access)
//      5 1 format_version u8 (2; version 1 records, which have no tag, are still read)
//      6 2 reserved (0)
//      8 . body (below)
//   end-40 32 tag: AuthKey::record_tag of bytes 0..end-40 (all zero when written without a key)
//    end-8 8 checksum: xxh3-64 of bytes 0..end-8
// Bodies (strings are u16 length + bytes, at most 64 bytes, and must be valid data file names):
//   header:     magic b"KVTSMAN\0" (8), namespace (32), object_bytes u64, writer_id u64, created_unix_ms u64
//   publish:    name, file_bytes u64, published_unix_ms u64, count u32, count * 48-byte index entries
//   doom:       at_unix_ms u64, count u32, count * name   (files chosen for eviction; unlinked after grace)
//   quarantine: at_unix_ms u64, count u32, count * name   (files moved to quarantine/)
//   access:     count u32, count * (at_unix_ms u64, name) (reads of whole files, for LRU)

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    Header { namespace: Namespace, object_bytes: u64, writer_id: u64, created_unix_ms: u64 },
    Publish { name: String, file_bytes: u64, published_unix_ms: u64, entries: Vec<IndexEntry> },
    Doom { at_unix_ms: u64, names: Vec<String> },
    Quarantine { at_unix_ms: u64, names: Vec<String> },
    Access { accesses: Vec<(u64, String)> },
}

const KIND_HEADER: u8 = 1;
const KIND_PUBLISH: u8 = 2;
const KIND_DOOM: u8 = 3;
const KIND_QUARANTINE: u8 = 4;
const KIND_ACCESS: u8 = 5;
const RECORD_VERSION: u8 = 2;
/// Records written before the tags (no tag field); read, but never authenticated.
const RECORD_VERSION_UNTAGGED: u8 = 1;
const MAX_NAME_BYTES: usize = 64;

fn push_name(out: &mut Vec<u8>, name: &str) {
    debug_assert!(name.len() <= MAX_NAME_BYTES, "a record names a file of {} bytes", name.len());
    out.extend_from_slice(&(name.len() as u16).to_le_bytes());
    out.extend_from_slice(name.as_bytes());
}

impl Record {
    /// Encodes the record with an all-zero tag (no key); see `encode_tagged`.
    pub fn encode(&self) -> Vec<u8> {
        self.encode_tagged(None)
    }

    /// Encodes the record; with `auth` (key, namespace, writer id of the manifest) its tag is set.
    pub fn encode_tagged(&self, auth: Option<(&AuthKey, &Namespace, u64)>) -> Vec<u8> {
        let mut out = vec![0u8; 8];
        let kind = match self {
            Record::Header { namespace, object_bytes, writer_id, created_unix_ms } => {
                out.extend_from_slice(&MANIFEST_MAGIC);
                out.extend_from_slice(&namespace.0);
                out.extend_from_slice(&object_bytes.to_le_bytes());
                out.extend_from_slice(&writer_id.to_le_bytes());
                out.extend_from_slice(&created_unix_ms.to_le_bytes());
                KIND_HEADER
            }
            Record::Publish { name, file_bytes, published_unix_ms, entries } => {
                push_name(&mut out, name);
                out.extend_from_slice(&file_bytes.to_le_bytes());
                out.extend_from_slice(&published_unix_ms.to_le_bytes());
                out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
                let at = out.len();
                out.resize(at + entries.len() * INDEX_ENTRY_BYTES, 0);
                for (i, e) in entries.iter().enumerate() {
                    e.encode(&mut out[at + i * INDEX_ENTRY_BYTES..]);
                }
                KIND_PUBLISH
            }
            Record::Doom { at_unix_ms, names } | Record::Quarantine { at_unix_ms, names } => {
                out.extend_from_slice(&at_unix_ms.to_le_bytes());
                out.extend_from_slice(&(names.len() as u32).to_le_bytes());
                for n in names {
                    push_name(&mut out, n);
                }
                if matches!(self, Record::Doom { .. }) {
                    KIND_DOOM
                } else {
                    KIND_QUARANTINE
                }
            }
            Record::Access { accesses } => {
                out.extend_from_slice(&(accesses.len() as u32).to_le_bytes());
                for (at, n) in accesses {
                    out.extend_from_slice(&at.to_le_bytes());
                    push_name(&mut out, n);
                }
                KIND_ACCESS
            }
        };
        let total = out.len() + TAG_BYTES + 8;
        put_u32(&mut out, 0, total as u32);
        out[4] = kind;
        out[5] = RECORD_VERSION;
        let tag = match auth {
            Some((key, namespace, writer_id)) => key.record_tag(namespace, writer_id, &out),
            None => [0u8; TAG_BYTES],
        };
        out.extend_from_slice(&tag);
        let sum = checksum(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        debug_assert_eq!(out.len(), total, "a record's length field is its length");
        out
    }

    /// Decodes the record at the start of `bytes`. `Ok(None)`: the record is not all there yet
    /// (a writer is appending, or the tail is not yet visible); try again later from the same offset.
    pub fn decode(bytes: &[u8]) -> Result<Option<(Record, usize)>, ParseError> {
        if bytes.len() < 4 {
            return Ok(None);
        }
        let total = get_u32(bytes, 0) as usize;
        if !(16..=MAX_RECORD_BYTES).contains(&total) {
            return Err(ParseError::OutOfRange("record_bytes"));
        }
        if bytes.len() < total {
            return Ok(None);
        }
        let r = &bytes[..total];
        if checksum(&r[..total - 8]) != get_u64(r, total - 8) {
            return Err(ParseError::BodyChecksum("manifest record"));
        }
        let body_end = match r[5] {
            RECORD_VERSION if total >= 8 + TAG_BYTES + 8 => total - TAG_BYTES - 8,
            RECORD_VERSION => return Err(ParseError::OutOfRange("record_bytes")),
            RECORD_VERSION_UNTAGGED => total - 8,
            v => return Err(ParseError::Version(v as u32)),
        };
        let mut cur = Cursor { b: &r[..body_end], at: 8 };
        let record = match r[4] {
            KIND_HEADER => {
                if cur.take(8)? != MANIFEST_MAGIC {
                    return Err(ParseError::BadMagic);
                }
                Record::Header {
                    namespace: Namespace(cur.take(32)?.try_into().unwrap()),
                    object_bytes: cur.u64()?,
                    writer_id: cur.u64()?,
                    created_unix_ms: cur.u64()?,
                }
            }
            KIND_PUBLISH => {
                let name = cur.name()?;
                let file_bytes = cur.u64()?;
                let published_unix_ms = cur.u64()?;
                let count = cur.u32()? as usize;
                let raw = cur.take(count.checked_mul(INDEX_ENTRY_BYTES).ok_or(ParseError::OutOfRange("count"))?)?;
                let entries = raw.chunks_exact(INDEX_ENTRY_BYTES).map(IndexEntry::decode).collect();
                Record::Publish { name, file_bytes, published_unix_ms, entries }
            }
            kind @ (KIND_DOOM | KIND_QUARANTINE) => {
                let at_unix_ms = cur.u64()?;
                let count = cur.u32()? as usize;
                let mut names = Vec::with_capacity(count.min(4096));
                for _ in 0..count {
                    names.push(cur.name()?);
                }
                if kind == KIND_DOOM {
                    Record::Doom { at_unix_ms, names }
                } else {
                    Record::Quarantine { at_unix_ms, names }
                }
            }
            KIND_ACCESS => {
                let count = cur.u32()? as usize;
                let mut accesses = Vec::with_capacity(count.min(4096));
                for _ in 0..count {
                    let at = cur.u64()?;
                    accesses.push((at, cur.name()?));
                }
                Record::Access { accesses }
            }
            _ => return Err(ParseError::OutOfRange("kind")),
        };
        Ok(Some((record, total)))
    }
}

/// The deployment key of the shared tier: 32 bytes derived from the key file with
/// `blake3::derive_key(KEY_DERIVATION_CONTEXT, file bytes)`. Tags are keyed BLAKE3 (`blake3::keyed_hash`
/// of the concatenation below, fed incrementally) and compared in constant time.
#[derive(Clone)]
pub struct AuthKey([u8; 32]);

impl std::fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AuthKey(..)")
    }
}

impl AuthKey {
    pub fn derive(key_file_bytes: &[u8]) -> Self {
        AuthKey(blake3::derive_key(KEY_DERIVATION_CONTEXT, key_file_bytes))
    }

    /// Tag of a block: keyed BLAKE3 of `b"kvtier block v1\0"` (16), namespace (32), key (32),
    /// value_bytes u64, then the value itself (not only its xxh3, which is no MAC and can be collided).
    pub fn block_tag(&self, namespace: &Namespace, key: &BlockKey, value: &[u8]) -> [u8; TAG_BYTES] {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(BLOCK_TAG_DOMAIN);
        h.update(&namespace.0);
        h.update(&key.0);
        h.update(&(value.len() as u64).to_le_bytes());
        h.update(value);
        *h.finalize().as_bytes()
    }

    /// Tag of a manifest record: keyed BLAKE3 of `b"kvtier record v1"` (16), namespace (32), the
    /// writer id u64 of the manifest it is in (its file name), then the record's bytes 0..end-40.
    pub fn record_tag(&self, namespace: &Namespace, writer_id: u64, record_head: &[u8]) -> [u8; TAG_BYTES] {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(RECORD_TAG_DOMAIN);
        h.update(&namespace.0);
        h.update(&writer_id.to_le_bytes());
        h.update(record_head);
        *h.finalize().as_bytes()
    }

    /// Tag of an object tier index object (docs/object-tier.md): keyed BLAKE3 of `b"kvtier objidx v1"`
    /// (16), namespace (32), then the object's bytes before the tag.
    pub fn object_index_tag(&self, namespace: &Namespace, head: &[u8]) -> [u8; TAG_BYTES] {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(OBJECT_INDEX_TAG_DOMAIN);
        h.update(&namespace.0);
        h.update(head);
        *h.finalize().as_bytes()
    }

    /// Tag of an object tier access object (docs/object-tier.md): keyed BLAKE3 of
    /// `b"kvtier objacc v1"` (16), namespace (32), then the object's bytes before the tag. Its own
    /// domain, so that no index object's tag is ever a valid access object's.
    pub fn object_access_tag(&self, namespace: &Namespace, head: &[u8]) -> [u8; TAG_BYTES] {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(OBJECT_ACCESS_TAG_DOMAIN);
        h.update(&namespace.0);
        h.update(head);
        *h.finalize().as_bytes()
    }

    /// Whether the block's tag (at `BLOCK_TAG_AT` of its descriptor page) is ours for this value.
    pub fn verify_block(&self, namespace: &Namespace, key: &BlockKey, page: &[u8], value: &[u8]) -> bool {
        let Some(stored) = page.get(BLOCK_TAG_AT..BLOCK_TAG_AT + TAG_BYTES) else { return false };
        let stored: [u8; TAG_BYTES] = stored.try_into().unwrap();
        blake3::Hash::from(self.block_tag(namespace, key, value)) == stored
    }

    /// Whether `record` (one whole encoded record, as `Record::decode` measured it) is a tagged record
    /// written with this key by `writer_id`'s manifest in this namespace. Untagged (version 1) records fail.
    pub fn verify_record(&self, namespace: &Namespace, writer_id: u64, record: &[u8]) -> bool {
        let total = record.len();
        if total < 8 + TAG_BYTES + 8 || record[5] != RECORD_VERSION {
            return false;
        }
        let head = &record[..total - TAG_BYTES - 8];
        let stored: [u8; TAG_BYTES] = record[total - TAG_BYTES - 8..total - 8].try_into().unwrap();
        blake3::Hash::from(self.record_tag(namespace, writer_id, head)) == stored
    }
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ParseError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or(ParseError::TooShort(self.b.len()))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, ParseError> {
        Ok(get_u32(self.take(4)?, 0))
    }
    fn u64(&mut self) -> Result<u64, ParseError> {
        Ok(get_u64(self.take(8)?, 0))
    }
    fn name(&mut self) -> Result<String, ParseError> {
        let len = get_u16(self.take(2)?, 0) as usize;
        if len > MAX_NAME_BYTES {
            return Err(ParseError::OutOfRange("name"));
        }
        let name = std::str::from_utf8(self.take(len)?).map_err(|_| ParseError::OutOfRange("name"))?;
        if !valid_data_file_name(name) {
            return Err(ParseError::OutOfRange("name"));
        }
        Ok(name.to_string())
    }
}

// ---- evictor lease ----
//
// `lease/<generation 16 hex>.lease`, 64 bytes; the lease in force is the highest generation present.
//      0 8 magic b"KVTSLSE\0"   8 4 format_version u32 (1)   12 4 reserved
//     16 8 generation u64       24 8 holder writer_id u64     32 8 expires_unix_ms u64 (0: released)
//     40 8 renewed_unix_ms u64  48 8 reserved                 56 8 checksum (xxh3-64 of 0..56)

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub generation: u64,
    pub holder: u64,
    pub expires_unix_ms: u64,
    pub renewed_unix_ms: u64,
}

impl Lease {
    pub fn encode(&self) -> [u8; LEASE_BYTES] {
        let mut out = [0u8; LEASE_BYTES];
        out[0..8].copy_from_slice(&LEASE_MAGIC);
        put_u32(&mut out, 8, LEASE_FORMAT_VERSION);
        put_u64(&mut out, 16, self.generation);
        put_u64(&mut out, 24, self.holder);
        put_u64(&mut out, 32, self.expires_unix_ms);
        put_u64(&mut out, 40, self.renewed_unix_ms);
        let sum = checksum(&out[..56]);
        put_u64(&mut out, 56, sum);
        out
    }

    pub fn decode(b: &[u8]) -> Result<Self, ParseError> {
        if b.len() < LEASE_BYTES {
            return Err(ParseError::TooShort(b.len()));
        }
        if b[0..8] != LEASE_MAGIC {
            return Err(ParseError::BadMagic);
        }
        if get_u32(b, 8) != LEASE_FORMAT_VERSION {
            return Err(ParseError::Version(get_u32(b, 8)));
        }
        if checksum(&b[..56]) != get_u64(b, 56) {
            return Err(ParseError::HeaderChecksum);
        }
        Ok(Lease {
            generation: get_u64(b, 16),
            holder: get_u64(b, 24),
            expires_unix_ms: get_u64(b, 32),
            renewed_unix_ms: get_u64(b, 40),
        })
    }
}

pub fn lease_file_name(generation: u64) -> String {
    format!("{generation:016x}.lease")
}

pub fn parse_lease_file_name(name: &str) -> Option<u64> {
    let hex = name.strip_suffix(".lease")?;
    (hex.len() == 16).then(|| u64::from_str_radix(hex, 16).ok()).flatten()
}

pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_roundtrip_and_reject_bad_names() {
        let e = IndexEntry { key: BlockKey([7; 32]), offset: 4096, value_checksum: 9 };
        let recs = vec![
            Record::Header { namespace: Namespace([1; 32]), object_bytes: 10, writer_id: 3, created_unix_ms: 4 },
            Record::Publish {
                name: data_file_name(1, 2, None),
                file_bytes: 3,
                published_unix_ms: 4,
                entries: vec![e, e],
            },
            Record::Doom { at_unix_ms: 5, names: vec![data_file_name(1, 2, None)] },
            Record::Quarantine { at_unix_ms: 5, names: vec![data_file_name(3, 2, None)] },
            Record::Access { accesses: vec![(6, data_file_name(1, 2, None))] },
        ];
        let mut log = Vec::new();
        for r in &recs {
            log.extend(r.encode());
        }
        let mut at = 0;
        for r in &recs {
            let (got, n) = Record::decode(&log[at..]).unwrap().unwrap();
            assert_eq!(&got, r);
            at += n;
        }
        assert!(Record::decode(&log[..log.len() - 1 - (log.len() - at)]).is_ok());
        let bad = Record::Doom { at_unix_ms: 1, names: vec!["../../etc".into()] }.encode();
        assert!(Record::decode(&bad).is_err());
        assert!(valid_data_file_name(&data_file_name(u64::MAX, 5, None)));
        assert!(!valid_data_file_name("0000000000000001-0000000/.kvs"));
    }

    #[test]
    fn a_tenants_files_carry_its_tag_in_a_name_every_version_accepts() {
        let tag = 0x1234_abcd;
        let named = data_file_name(7, 5, Some(tag));
        assert_eq!(named.len(), 16 + 1 + 16 + 4);
        assert!(valid_data_file_name(&named), "the pattern of every earlier version");
        assert_eq!(data_file_tenant(&named), Some(tag));
        assert_eq!(data_file_tenant(&data_file_name(7, 5, None)), None, "the default tenant's");
        assert_eq!(data_file_tenant(&data_file_name(7, 5, Some(0))), None, "no tag is zero");
        let past_32_bits = data_file_name(7, 1 << 32, Some(tag));
        assert_eq!(data_file_tenant(&past_32_bits), None, "named without its tenant");
        assert!(valid_data_file_name(&past_32_bits));
    }

    #[test]
    fn record_tags_bind_key_namespace_and_writer() {
        let k = AuthKey::derive(&[1u8; 32]);
        let other = AuthKey::derive(&[2u8; 32]);
        let ns = Namespace([3; 32]);
        let r = Record::Doom { at_unix_ms: 5, names: vec![data_file_name(1, 2, None)] };
        let tagged = r.encode_tagged(Some((&k, &ns, 7)));
        assert_eq!(Record::decode(&tagged).unwrap().unwrap(), (r.clone(), tagged.len()));
        assert!(k.verify_record(&ns, 7, &tagged));
        assert!(!k.verify_record(&ns, 8, &tagged), "replayed into another writer's manifest");
        assert!(!k.verify_record(&Namespace([4; 32]), 7, &tagged));
        assert!(!other.verify_record(&ns, 7, &tagged));
        assert!(!k.verify_record(&ns, 7, &r.encode()), "untagged");
        // A version 1 record (no tag) still decodes, and never verifies.
        let mut v1 = r.encode();
        v1.drain(v1.len() - 8 - TAG_BYTES..v1.len() - 8);
        let n = v1.len();
        put_u32(&mut v1, 0, n as u32);
        v1[5] = RECORD_VERSION_UNTAGGED;
        let sum = checksum(&v1[..n - 8]);
        put_u64(&mut v1, n - 8, sum);
        assert_eq!(Record::decode(&v1).unwrap().unwrap(), (r, n));
        assert!(!k.verify_record(&ns, 7, &v1));
        let mut page = vec![0u8; 4096];
        let value = vec![9u8; 100];
        let tag = k.block_tag(&ns, &BlockKey([1; 32]), &value);
        page[BLOCK_TAG_AT..BLOCK_TAG_AT + TAG_BYTES].copy_from_slice(&tag);
        assert!(k.verify_block(&ns, &BlockKey([1; 32]), &page, &value));
        assert!(!k.verify_block(&ns, &BlockKey([2; 32]), &page, &value));
        assert!(!k.verify_block(&ns, &BlockKey([1; 32]), &page, &value[..99]));
        assert!(!other.verify_block(&ns, &BlockKey([1; 32]), &page, &value));
    }

    #[test]
    fn footer_roundtrip() {
        let entries: Vec<_> = (0..100)
            .map(|i| IndexEntry { key: BlockKey([i as u8; 32]), offset: 4096 + i * 8192, value_checksum: i })
            .collect();
        let mut out = vec![0u8; footer_bytes(entries.len())];
        encode_footer(&entries, 4096 + 100 * 8192, 1, 2, &mut out);
        let t = FooterTrailer::decode(&out[out.len() - FOOTER_TRAILER_BYTES..]).unwrap();
        assert_eq!(t.entry_count, 100);
        assert_eq!(t.decode_index(&out).unwrap(), entries);
    }
}
