//! Access objects (docs/object-tier.md, "Capacity"): which segments a store read, and when, so that
//! the evictor deletes the least recently used segments, not the oldest ones.
//!
//! A store with a budget notes every verified hit's segment in memory (`AccessLog`) and, at a
//! maintenance pass after new reads (and at close), overwrites its one access object,
//! `acc/<writer 16 hex>.kva`, with the latest read of each segment it still indexes. The lease holder,
//! when over budget, reads them all (several in flight; one it read before and that did not change
//! is not read again) and evicts by last use: the later of the segment's modification time and its
//! latest read anywhere (`accounts_of`; split by tenant, the tenants past their shares give up
//! segments first, `tiers::remote::tenants`). It also deletes access objects that can only name
//! deleted segments (older than every segment listed) and garbage ones.

use super::format::{stem, stem_tenant, Framing};
use super::BucketTier;
use crate::format::shared::{unix_ms, AuthKey};
use crate::format::{get_u64, put_u64, ParseError};
use crate::key::Namespace;
use crate::stats::Stats;
use crate::tenant::TenantShares;
use crate::tiers::remote::tenants::Accounts;
use object_store::path::Path as ObjectPath;
use object_store::ObjectMeta;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub const ACCESS_MAGIC: [u8; 8] = *b"KVTOACC\0";
pub const ACCESS_FORMAT_VERSION: u32 = 1;
pub const ACCESS_HEADER_BYTES: usize = 64;
pub const ACCESS_ENTRY_BYTES: usize = 24;
/// Entries an access object holds at most (the most recently read segments): 1.5 MiB.
pub const MAX_ACCESS_ENTRIES: usize = 1 << 16;
/// The longest access object: a listed one longer than this is never fetched.
pub fn max_access_bytes() -> u64 {
    ACCESS_FRAMING.object_bytes(MAX_ACCESS_ENTRIES)
}
const ACCESS_FRAMING: Framing = Framing {
    magic: ACCESS_MAGIC,
    version: ACCESS_FORMAT_VERSION,
    header_bytes: ACCESS_HEADER_BYTES,
    entry_bytes: ACCESS_ENTRY_BYTES,
    max_entries: MAX_ACCESS_ENTRIES,
    object: "access object",
    count: "access entry count",
};

/// `<writer 16 hex>.kva`: the name of a store's access object under `acc/`.
pub fn access_name(writer_id: u64) -> String {
    format!("{writer_id:016x}.kva")
}

/// The writer id an access object's name holds (`None`: not a name kvtier writes; ignored).
pub fn parse_access_name(name: &str) -> Option<u64> {
    let hex = name.strip_suffix(".kva")?;
    if hex.len() != 16 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// The writer id and sequence number a segment stem (`format::stem`) holds.
fn parse_stem(stem: &str) -> Option<(u64, u64)> {
    let (writer, seq) = stem.split_once('-')?;
    Some((u64::from_str_radix(writer, 16).ok()?, u64::from_str_radix(seq, 16).ok()?))
}

/// One segment's latest read by the access object's writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccessEntry {
    pub writer_id: u64,
    pub seq: u64,
    pub last_read_unix_ms: u64,
}

/// A store's access object (docs/object-tier.md, "Access object").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessObject {
    pub namespace: Namespace,
    pub writer_id: u64,
    pub written_unix_ms: u64,
    pub entries: Vec<AccessEntry>,
}

impl AccessObject {
    /// Header (64), entries (24 each), tag (32; zero without a key), checksum (8) of all before it.
    pub fn encode(&self, auth: Option<&AuthKey>) -> Vec<u8> {
        let mut out = ACCESS_FRAMING.start(self.entries.len());
        out[16..48].copy_from_slice(&self.namespace.0);
        put_u64(&mut out, 48, self.writer_id);
        put_u64(&mut out, 56, self.written_unix_ms);
        for (i, e) in self.entries.iter().enumerate() {
            let at = ACCESS_FRAMING.entry_at(i);
            put_u64(&mut out, at, e.writer_id);
            put_u64(&mut out, at + 8, e.seq);
            put_u64(&mut out, at + 16, e.last_read_unix_ms);
        }
        ACCESS_FRAMING.seal(&mut out, auth.map(|a| |body: &[u8]| a.object_access_tag(&self.namespace, body)));
        out
    }

    /// Decodes and checks an access object (length, checksum, tag when `auth` is set).
    /// `Ok(None)`: intact but its tag does not verify (written without our key, or forged).
    pub fn decode(b: &[u8], auth: Option<(&AuthKey, &Namespace)>) -> Result<Option<Self>, ParseError> {
        let tag = auth.map(|(key, namespace)| move |body: &[u8]| key.object_access_tag(namespace, body));
        let Some(n) = ACCESS_FRAMING.open(b, tag)? else {
            return Ok(None);
        };
        let entries = (0..n)
            .map(|i| {
                let at = ACCESS_FRAMING.entry_at(i);
                AccessEntry {
                    writer_id: get_u64(b, at),
                    seq: get_u64(b, at + 8),
                    last_read_unix_ms: get_u64(b, at + 16),
                }
            })
            .collect();
        Ok(Some(AccessObject {
            namespace: Namespace(b[16..48].try_into().unwrap()),
            writer_id: get_u64(b, 48),
            written_unix_ms: get_u64(b, 56),
            entries,
        }))
    }
}

/// A segment as the evictor orders it: its stem (or, for an object kvtier did not name, its file
/// name), its modification time and size, and what the caller needs to evict it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Candidate<T> {
    pub(super) stem: String,
    pub(super) modified_unix_ms: u64,
    pub(super) bytes: u64,
    pub(super) item: T,
}

/// The segments by tenant (`tiers::remote::tenants`: by the tag in their stems, when `shares` split
/// the tier), each last used at the later of its modification time (its write) and its latest read
/// in `reads` (stem -> unix ms); within a tenant least recently used first, then by stem, so that
/// the order is the same everywhere. `room_bytes`: what the shares are fractions of.
pub(super) fn accounts_of<T>(
    mut segments: Vec<Candidate<T>>,
    reads: &HashMap<String, u64>,
    shares: &TenantShares,
    room_bytes: u64,
) -> Accounts<T> {
    let last_use = |c: &Candidate<T>| c.modified_unix_ms.max(reads.get(&c.stem).copied().unwrap_or(0));
    segments.sort_by(|a, b| (last_use(a), &a.stem).cmp(&(last_use(b), &b.stem)));
    let mut accounts = Accounts::new(shares, room_bytes);
    for c in segments {
        let used_at = last_use(&c);
        accounts.add(stem_tenant(&c.stem), c.bytes, Some((used_at, c.item)));
    }
    accounts
}

/// What the evictor does with a listed access object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Listed {
    /// Not a name kvtier writes, or this store's own (its reads are in memory): left alone.
    Skip,
    /// Last written before every listed segment was: it can only name deleted segments.
    Stale,
    /// Empty: garbage, counted and deleted.
    Empty,
    /// To be read (or taken from what was read before, when unchanged).
    Read { writer_id: u64 },
}

/// The evictor's verdict on a listed access object, from its name, modification time and size, the
/// evictor's own writer id and the oldest listed segment's modification time. A segment an access
/// object names was written before its reader read it and so before the object was; an object older
/// than every listed segment names none of them.
pub(super) fn judge_listed(name: &str, modified_unix_ms: u64, size: u64, own: u64, oldest_segment_ms: u64) -> Listed {
    match parse_access_name(name) {
        None => Listed::Skip,
        Some(writer) if writer == own => Listed::Skip,
        Some(_) if modified_unix_ms < oldest_segment_ms => Listed::Stale,
        Some(_) if size == 0 => Listed::Empty,
        Some(writer_id) => Listed::Read { writer_id },
    }
}

/// The `max_entries` most recently read segments of `reads`, newest first (ties by stem).
pub(super) fn newest_reads(reads: &HashMap<Arc<str>, u64>, max_entries: usize) -> Vec<(Arc<str>, u64)> {
    let mut all: Vec<(Arc<str>, u64)> = reads.iter().map(|(s, &t)| (Arc::clone(s), t)).collect();
    all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    all.truncate(max_entries);
    all
}

/// What the evictor read of another store's access object: the object's version (ETag,
/// modification time, size) and its reads by stem (`None`: ignored), so that an unchanged object is
/// neither read nor counted again.
struct Seen {
    version: (Option<String>, u64, u64),
    reads: Option<Vec<(String, u64)>>,
}

/// This store's reads (what its access object says) and the evictor's view of the others'.
#[derive(Default)]
pub(super) struct AccessLog {
    /// Segments this store read (verified hits), by stem, and when it last did (unix ms).
    reads: Mutex<HashMap<Arc<str>, u64>>,
    /// A read since the access object was last written.
    changed: AtomicBool,
    /// Other stores' access objects as the evictor last read them, by name.
    seen: Mutex<HashMap<String, Seen>>,
}

fn modified_ms(m: &ObjectMeta) -> u64 {
    m.last_modified.timestamp_millis().max(0) as u64
}

impl BucketTier {
    fn access_path(&self, name: &str) -> ObjectPath {
        ObjectPath::from(format!("{}/acc/{name}", self.base))
    }

    /// Notes a verified hit in `stem` (only stores with a budget write access objects: without one
    /// no store of theirs evicts, and the PUTs would buy nothing).
    pub(super) fn record_read(&self, stem: &Arc<str>) {
        if self.config.budget_bytes == 0 {
            return;
        }
        let now = unix_ms();
        let mut reads = self.access.reads.lock();
        match reads.get_mut(stem) {
            Some(at) => *at = (*at).max(now),
            None => {
                reads.insert(Arc::clone(stem), now);
            }
        }
        self.access.changed.store(true, Ordering::Release);
    }

    /// Overwrites this store's access object when it read something since the last time (at each
    /// maintenance pass, so at most once per `bucket_refresh_ms`, and at close). A failed PUT is
    /// tried again at the next pass.
    pub(super) fn put_access_if_changed(&self) {
        if !self.access.changed.swap(false, Ordering::AcqRel) {
            return;
        }
        let bytes = self.access_object().encode(self.auth.as_ref());
        match self.put(&self.access_path(&access_name(self.writer_id)), bytes) {
            Ok(()) => Stats::add(&self.stats.bucket_access_objects_put, 1),
            Err(e) => {
                log::debug!("kvtier: writing the bucket access object failed: {e}; tried again at the next pass");
                Stats::add(&self.stats.bucket_request_errors, 1);
                self.access.changed.store(true, Ordering::Release);
            }
        }
    }

    /// The access object of this store's reads, bounded: segments no longer indexed (evicted or
    /// expired) are dropped, and past `MAX_ACCESS_ENTRIES` the least recently read ones.
    fn access_object(&self) -> AccessObject {
        let mut reads = self.access.reads.lock();
        {
            let index = self.index.read();
            reads.retain(|stem, _| index.segments.contains_key(stem));
        }
        if reads.len() > MAX_ACCESS_ENTRIES {
            *reads = newest_reads(&reads, MAX_ACCESS_ENTRIES).into_iter().collect();
        }
        let entries = reads
            .iter()
            .filter_map(|(stem, &at)| {
                let (writer_id, seq) = parse_stem(stem)?;
                Some(AccessEntry { writer_id, seq, last_read_unix_ms: at })
            })
            .collect();
        AccessObject { namespace: self.namespace, writer_id: self.writer_id, written_unix_ms: unix_ms(), entries }
    }

    /// The latest read of each segment (stem -> unix ms) by this store and in every other store's
    /// access object; deletes stale and garbage access objects on the way. `oldest_segment_ms`: the
    /// oldest listed segment's modification time. A failed listing leaves this store's reads alone.
    pub(super) fn latest_reads(&self, oldest_segment_ms: u64) -> HashMap<String, u64> {
        let mut latest: HashMap<String, u64> =
            self.access.reads.lock().iter().map(|(stem, &at)| (stem.to_string(), at)).collect();
        let listed = match self.list_within("acc", max_access_bytes()) {
            Ok(listed) => listed,
            Err(e) => {
                log::debug!("kvtier: listing the bucket's access objects failed: {e}; evicting by this store's reads");
                Stats::add(&self.stats.bucket_request_errors, 1);
                return latest;
            }
        };
        let to_read = self.sort_listed_access(listed, oldest_segment_ms);
        self.read_access_objects(to_read);
        for seen in self.access.seen.lock().values() {
            for (stem, at) in seen.reads.iter().flatten() {
                let latest_at = latest.entry(stem.clone()).or_insert(0);
                *latest_at = (*latest_at).max(*at);
            }
        }
        latest
    }

    /// Deletes the stale and empty access objects of `listed`, forgets those no longer listed, and
    /// returns the ones to read: new or changed since the evictor last read them.
    fn sort_listed_access(&self, listed: Vec<ObjectMeta>, oldest_segment_ms: u64) -> Vec<(ObjectMeta, u64)> {
        let mut to_read = Vec::new();
        let mut kept = HashSet::new();
        let mut seen = self.access.seen.lock();
        for m in listed {
            let Some(name) = m.location.filename().map(str::to_string) else { continue };
            match judge_listed(&name, modified_ms(&m), m.size, self.writer_id, oldest_segment_ms) {
                Listed::Skip => {}
                Listed::Stale => {
                    let _ = self.delete(&m.location);
                }
                Listed::Empty => {
                    log::warn!("kvtier: bucket access object {name} is empty; deleted");
                    Stats::add(&self.stats.bucket_access_objects_ignored, 1);
                    let _ = self.delete(&m.location);
                }
                Listed::Read { writer_id } => {
                    let unchanged = seen.get(&name).is_some_and(|s| s.version == version(&m));
                    kept.insert(name);
                    if !unchanged {
                        to_read.push((m, writer_id));
                    }
                }
            }
        }
        seen.retain(|name, _| kept.contains(name));
        to_read
    }

    /// GETs the access objects, all in flight together, and remembers what each says. One that did
    /// not arrive is tried again at the next eviction.
    fn read_access_objects(&self, objects: Vec<(ObjectMeta, u64)>) {
        let timeout = self.timeout();
        let handles: Vec<_> = objects
            .iter()
            .map(|(m, _)| {
                Stats::add(&self.stats.bucket_get_requests, 1);
                let (store, path) = (Arc::clone(&self.store), m.location.clone());
                self.rt.spawn(async move {
                    let got = tokio::time::timeout(timeout, async { store.get(&path).await?.bytes().await }).await;
                    got.ok().and_then(|r| r.ok()).map(|bytes| bytes.to_vec())
                })
            })
            .collect();
        let results: Vec<Option<Vec<u8>>> = self.rt.block_on(async {
            let mut out = Vec::with_capacity(handles.len());
            for h in handles {
                out.push(h.await.ok().flatten());
            }
            out
        });
        for ((m, writer_id), bytes) in objects.into_iter().zip(results) {
            let Some(bytes) = bytes else {
                // Gone meanwhile (its writer's turn, or another evictor's), or the server is slow.
                Stats::add(&self.stats.bucket_request_errors, 1);
                continue;
            };
            let reads = self.judge_access(&m, writer_id, &bytes);
            let name = m.location.filename().unwrap_or_default().to_string();
            self.access.seen.lock().insert(name, Seen { version: version(&m), reads });
        }
    }

    /// The reads an access object holds, or `None` when it is ignored (counted): one of another
    /// format version or without our tag is left for its writer; a corrupt one, another namespace's
    /// or another writer's under this name is garbage and deleted.
    fn judge_access(&self, m: &ObjectMeta, writer_id: u64, bytes: &[u8]) -> Option<Vec<(String, u64)>> {
        let auth = self.auth.as_ref().map(|k| (k, &self.namespace));
        let (why, garbage) = match AccessObject::decode(bytes, auth) {
            Ok(Some(object)) if object.namespace == self.namespace && object.writer_id == writer_id => {
                Stats::add(&self.stats.bucket_access_objects_read, 1);
                let reads = object.entries.iter().map(|e| (stem(e.writer_id, e.seq), e.last_read_unix_ms));
                return Some(reads.collect());
            }
            Ok(Some(_)) => ("it names another namespace or writer", true),
            Ok(None) => ("it has no valid tag for the deployment key", false),
            Err(ParseError::Version(v)) => {
                (if v > ACCESS_FORMAT_VERSION { "a newer format" } else { "an older format" }, false)
            }
            Err(_) => ("malformed or corrupt", true),
        };
        let done = if garbage { "deleted" } else { "ignored" };
        log::warn!("kvtier: bucket access object {} refused ({why}); {done}", m.location);
        Stats::add(&self.stats.bucket_access_objects_ignored, 1);
        if garbage {
            let _ = self.delete(&m.location);
        }
        None
    }
}

fn version(m: &ObjectMeta) -> (Option<String>, u64, u64) {
    (m.e_tag.clone(), modified_ms(m), m.size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::shared::TAG_BYTES;
    use crate::format::{checksum, put_u32};

    fn object() -> AccessObject {
        AccessObject {
            namespace: Namespace([5; 32]),
            writer_id: 0xfeed,
            written_unix_ms: 1_700_000_000_000,
            entries: (0..3)
                .map(|i| AccessEntry { writer_id: 0xabc, seq: i, last_read_unix_ms: 1_700_000_000_000 + i })
                .collect(),
        }
    }

    #[test]
    fn access_object_round_trips_and_refuses_corruption() {
        let obj = object();
        let bytes = obj.encode(None);
        assert_eq!(bytes.len(), ACCESS_HEADER_BYTES + 3 * ACCESS_ENTRY_BYTES + TAG_BYTES + 8);
        assert_eq!(AccessObject::decode(&bytes, None).unwrap().unwrap(), obj);
        let mut flipped = bytes.clone();
        flipped[ACCESS_HEADER_BYTES + 17] ^= 1;
        assert_eq!(AccessObject::decode(&flipped, None), Err(ParseError::BodyChecksum("access object")));
        assert!(AccessObject::decode(&bytes[..bytes.len() - 1], None).is_err(), "truncated");
        assert!(AccessObject::decode(&[], None).is_err(), "empty");
        let mut other_version = bytes.clone();
        put_u32(&mut other_version, 8, 2);
        assert_eq!(AccessObject::decode(&other_version, None), Err(ParseError::Version(2)));
        let mut index = bytes.clone();
        index[..8].copy_from_slice(&super::super::format::INDEX_MAGIC);
        assert_eq!(AccessObject::decode(&index, None), Err(ParseError::BadMagic));
        let empty = AccessObject { entries: Vec::new(), ..object() };
        assert_eq!(AccessObject::decode(&empty.encode(None), None).unwrap().unwrap(), empty);
    }

    #[test]
    fn access_tag_binds_key_and_namespace() {
        let (k1, k2) = (AuthKey::derive(&[1; 32]), AuthKey::derive(&[2; 32]));
        let (obj, ns) = (object(), Namespace([5; 32]));
        let tagged = obj.encode(Some(&k1));
        assert_eq!(AccessObject::decode(&tagged, Some((&k1, &ns))).unwrap(), Some(obj.clone()));
        assert_eq!(AccessObject::decode(&tagged, Some((&k2, &ns))).unwrap(), None, "another key");
        assert_eq!(AccessObject::decode(&tagged, Some((&k1, &Namespace([6; 32])))).unwrap(), None);
        assert_eq!(AccessObject::decode(&obj.encode(None), Some((&k1, &ns))).unwrap(), None, "unkeyed");
        // A forger without the key rewrites an entry and fixes the checksum: the tag still fails.
        let mut forged = tagged.clone();
        put_u64(&mut forged, ACCESS_HEADER_BYTES + 16, u64::MAX);
        let end = forged.len() - 8;
        let sum = checksum(&forged[..end]);
        put_u64(&mut forged, end, sum);
        assert_eq!(AccessObject::decode(&forged, None).unwrap().unwrap().entries[0].last_read_unix_ms, u64::MAX);
        assert_eq!(AccessObject::decode(&forged, Some((&k1, &ns))).unwrap(), None);
    }

    fn candidate(stem: &str, modified_unix_ms: u64) -> Candidate<String> {
        Candidate { stem: stem.to_string(), modified_unix_ms, bytes: 1, item: stem.to_string() }
    }

    /// The whole tier's eviction order, not split by tenant.
    fn eviction_order(segments: Vec<Candidate<String>>, reads: &HashMap<String, u64>) -> Vec<String> {
        let mut accounts = accounts_of(segments, reads, &TenantShares::default(), 0);
        accounts.victims(u64::MAX, 0).into_iter().map(|(stem, _)| stem).collect()
    }

    #[test]
    fn split_by_tenant_a_tenant_past_its_share_gives_up_its_segments_first() {
        let quiet = crate::tenant::tenant_id(b"quiet");
        let tag = crate::tiers::remote::tenants::tenant_tag(&quiet);
        let shares = TenantShares { default_share: 0.1, named: vec![(quiet, 0.5)], max_share: None };
        let quiet_stem = stem(1, super::super::format::tenant_seq(0, tag));
        let segments = vec![
            Candidate { stem: quiet_stem, modified_unix_ms: 10, bytes: 30, item: "quiet".to_string() },
            Candidate { stem: stem(2, 0), modified_unix_ms: 20, bytes: 30, item: "flood-1".to_string() },
            Candidate { stem: stem(2, 1), modified_unix_ms: 30, bytes: 30, item: "flood-2".to_string() },
        ];
        let mut accounts = accounts_of(segments.clone(), &HashMap::new(), &shares, 100);
        let victims: Vec<String> = accounts.victims(90, 50).into_iter().map(|(item, _)| item).collect();
        assert_eq!(victims, ["flood-1", "flood-2"], "the oldest segment is the quiet tenant's, within its share");
        assert_eq!(eviction_order(segments, &HashMap::new()), ["quiet", "flood-1", "flood-2"], "not split");
    }

    #[test]
    fn eviction_goes_by_last_use_then_name() {
        let segments = vec![candidate("s1", 100), candidate("s2", 200), candidate("s3", 300), candidate("s4", 400)];
        assert_eq!(eviction_order(segments.clone(), &HashMap::new()), ["s1", "s2", "s3", "s4"], "no reads: by age");
        let reads = HashMap::from([("s1".to_string(), 350), ("s3".to_string(), 50), ("gone".to_string(), 1)]);
        assert_eq!(eviction_order(segments, &reads), ["s2", "s3", "s1", "s4"], "s1 read after s3 was written");
        let tied = vec![candidate("b", 100), candidate("a", 100), candidate("c", 50)];
        let reads = HashMap::from([("c".to_string(), 100)]);
        assert_eq!(eviction_order(tied, &reads), ["a", "b", "c"], "ties by name");
    }

    #[test]
    fn stale_empty_foreign_and_own_access_objects_are_told_apart() {
        let own = 0xfeed;
        assert_eq!(judge_listed(&access_name(7), 500, 100, own, 400), Listed::Read { writer_id: 7 });
        assert_eq!(judge_listed(&access_name(7), 399, 100, own, 400), Listed::Stale, "older than every segment");
        assert_eq!(judge_listed(&access_name(7), 400, 100, own, 400), Listed::Read { writer_id: 7 }, "same second");
        assert_eq!(judge_listed(&access_name(7), 500, 0, own, 400), Listed::Empty);
        assert_eq!(judge_listed(&access_name(own), 1, 0, own, 400), Listed::Skip, "this store's own");
        for other in ["notes.txt", "00000000000000AB.kva", "07.kva", "0000000000000007.kvi"] {
            assert_eq!(judge_listed(other, 1, 0, own, 400), Listed::Skip, "{other}");
        }
        assert_eq!(parse_access_name(&access_name(u64::MAX)), Some(u64::MAX));
        assert_eq!(parse_stem(&stem(0xabc, 5)), Some((0xabc, 5)));
    }

    #[test]
    fn a_full_access_object_is_exactly_the_longest_allowed() {
        let entry = AccessEntry { writer_id: 1, seq: 2, last_read_unix_ms: 3 };
        let full = AccessObject { entries: vec![entry; MAX_ACCESS_ENTRIES], ..object() };
        assert_eq!(full.encode(None).len() as u64, max_access_bytes(), "a listing must never skip a real one");
    }

    #[test]
    fn the_log_keeps_the_most_recently_read_segments() {
        let reads: HashMap<Arc<str>, u64> = (0..10u64).map(|i| (Arc::from(format!("s{i}")), i * 10)).collect();
        let kept = newest_reads(&reads, 3);
        let stems: Vec<&str> = kept.iter().map(|(s, _)| &**s).collect();
        assert_eq!(stems, ["s9", "s8", "s7"]);
        assert_eq!(newest_reads(&reads, 100).len(), 10);
    }
}
