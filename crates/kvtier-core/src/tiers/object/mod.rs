//! The bucket tier, `BucketTier` (object storage, docs/object-tier.md): blocks in an S3 bucket,
//! grouped into segment objects written once, each with an index object naming its blocks. Lookups
//! use an in-memory index that a background thread keeps fresh by listing the index objects; a load
//! reads each block with a ranged GET (many in flight) into its DRAM slot and verifies it before it
//! is served.
//!
//! Every request runs on the tier's own small tokio runtime, never on the store's threads: loads
//! hand it their reads and wait for the completions like any other I/O, publishing runs on the
//! store's publisher thread, refresh and eviction on the tier's maintenance thread.

mod access;
pub mod config;
mod damage;
pub mod format;
mod lease;
mod reads;
mod sink;
mod sync;
mod writer;

pub use config::BucketConfig;

use crate::error::{Error, Result};
use crate::format::descriptor::{Descriptor, DESCRIPTOR_BYTES};
use crate::format::encrypted::{open_slot, ValueCipher};
use crate::format::shared::{AuthKey, BLOCK_TAG_AT, TAG_BYTES};
use crate::format::{checksum, round_up, ALIGN_BYTES};
use crate::io::device::OnDone;
use crate::key::{BlockKey, Namespace};
use crate::stats::Stats;
use crate::tiers::remote::key::{load_key, KeySource, KEY_FILE_ENV};
use crate::tiers::remote::keys::KeyIndex;
use crate::tiers::remote::tenants::{TenantFigures, TenantLedger};
use crate::tiers::remote::{random_nonzero_u64, Heartbeat, ReadOutcome};
use object_store::path::Path as ObjectPath;
use object_store::ObjectStore;
use parking_lot::{Condvar, Mutex, RwLock};
use reads::Landing;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Where an indexed block is: its segment's name stem, offset and value checksum.
#[derive(Debug, Clone)]
struct Loc {
    stem: Arc<str>,
    offset: u64,
    value_checksum: u64,
}

#[derive(Debug, Clone)]
struct Segment {
    /// Every block it holds, whether its copy is the one in use or another's is.
    keys: Vec<BlockKey>,
    /// Its length, as its index object gives it.
    bytes: u64,
}

/// The blocks of every segment whose index object the bucket listed. A block in several segments
/// (two writers published it before either listed the other's) is read from the first listed, and
/// from another when that one goes (`KeyIndex`).
#[derive(Default)]
struct Index {
    /// Where each block is; its generation moves whenever a key is gained or lost, so the change
    /// log skips unchanged refreshes.
    blocks: KeyIndex<Loc>,
    segments: HashMap<Arc<str>, Segment>,
}

impl Index {
    fn insert(&mut self, stem: &str, index: &format::SegmentIndex) {
        let stem: Arc<str> = Arc::from(stem);
        for e in &index.entries {
            let loc = Loc { stem: Arc::clone(&stem), offset: e.offset, value_checksum: e.value_checksum };
            self.blocks.insert(e.key, loc);
        }
        let keys = index.entries.iter().map(|e| e.key).collect();
        self.segments.insert(stem, Segment { keys, bytes: index.segment_bytes });
    }

    /// Drops one block of `stem` (refused by verification); the segment's other blocks stay, and
    /// another segment's copy of the block, if any, is used instead.
    fn remove_block(&mut self, stem: &str, key: &BlockKey) {
        self.blocks.remove(key, |loc| &*loc.stem == stem);
        if let Some(seg) = self.segments.get_mut(stem) {
            seg.keys.retain(|k| k != key);
        }
    }

    /// Drops a segment: its blocks leave the index unless another segment holds them too.
    fn remove(&mut self, stem: &str) {
        if let Some(seg) = self.segments.remove(stem) {
            for k in seg.keys {
                self.blocks.remove(&k, |loc| &*loc.stem == stem);
            }
        }
    }
}

/// A ranged GET of one block, from `start_read` until `finish_started` judges it.
pub struct BucketRead {
    key: BlockKey,
    stem: Arc<str>,
    offset: u64,
    value_checksum: u64,
}

pub struct BucketTier {
    config: BucketConfig,
    namespace: Namespace,
    object_bytes: usize,
    slot_bytes: usize,
    /// Blocks per segment object (`BucketConfig::segment_blocks`): a full segment is published.
    segment_blocks: usize,
    /// Adjacent blocks of one segment that one ranged GET reads at most.
    blocks_per_get: usize,
    writer_id: u64,
    store: Arc<dyn ObjectStore>,
    /// The loads' ranged GETs (`sync::connect_reads`: bounded by `reads.rs`, not by the client).
    read_store: Arc<dyn ObjectStore>,
    /// `<prefix>/<namespace hex>`: segments under `seg/`, index objects under `idx/`.
    base: String,
    rt: tokio::runtime::Runtime,
    read_permits: Arc<tokio::sync::Semaphore>,
    index: RwLock<Index>,
    /// Segments never indexed again by this process while their index object is listed: a bad
    /// index object, or a segment found missing (its index object is an orphan).
    bad: Mutex<HashSet<String>>,
    /// Blocks refused by verification, as (segment stem, offset): only they leave the index.
    bad_blocks: Mutex<HashSet<(String, u64)>>,
    /// Requests that damage found on the load path calls for, made by the maintenance thread.
    cleanups: Mutex<Vec<damage::Cleanup>>,
    /// Segments this process has copied into quarantine (once each).
    quarantined: Mutex<HashSet<String>>,
    /// Listed objects longer than their format allows, already reported (never fetched; see
    /// `list_within`), by path.
    oversized: Mutex<HashSet<String>>,
    writer: Mutex<writer::SegmentWriters>,
    /// Split by tenant: the tenants' labels and the segments this process evicted of each.
    tenant_ledger: TenantLedger,
    auth: Option<AuthKey>,
    /// Encryption at rest of the values it publishes (`encryption_key_file`, `encrypt_with`).
    cipher: OnceLock<Arc<ValueCipher>>,
    stats: Arc<Stats>,
    stop: Mutex<bool>,
    stop_cv: Condvar,
    /// The maintenance thread's LISTs of the index objects, timed (`RemoteTier::heartbeat`).
    heartbeat: Heartbeat,
    closed: AtomicBool,
    /// Segments whose index object the evictor deleted, and when: deleted after the grace period.
    doomed: Mutex<Vec<(ObjectPath, std::time::Instant)>>,
    /// Whether the last maintenance pass held the evictor lease.
    lease_held: AtomicBool,
    /// The segments this store read, for its access object, and the others' as the evictor saw them.
    access: access::AccessLog,
    maintenance: Mutex<Option<JoinHandle<()>>>,
    /// Set once the store starts closing (`closing`): every request from then on, the publisher's
    /// last flush included, ends by it, so that a frozen or cut-off bucket cannot hold a close (and
    /// the service's namespace lock with it) for request after request.
    close_deadline: Mutex<Option<Instant>>,
}

impl BucketTier {
    /// Connects (credentials from the environment and credential chain, as object_store's
    /// `AmazonS3Builder::from_env`), checks that the bucket answers with them (a clear error now,
    /// not misses later), reads the index and starts the maintenance thread.
    pub fn open(
        config: &BucketConfig,
        namespace: Namespace,
        object_bytes: usize,
        stats: Arc<Stats>,
    ) -> Result<Arc<Self>> {
        let slot_bytes = DESCRIPTOR_BYTES + round_up(object_bytes, ALIGN_BYTES);
        config.validate(slot_bytes)?;
        let (bucket, prefix) = config.bucket_and_prefix()?;
        let store = sync::connect(config, &bucket)?;
        let read_store = sync::connect_reads(config, &bucket)?;
        let rt = runtime()?;
        // No shared root to keep the key off: the bucket is not a directory of this node.
        let auth = load_key(&KeySource {
            env: KEY_FILE_ENV,
            key_file: config.key_file.as_deref(),
            option: "bucket_key_file",
            shared_root: None,
        })?;
        let base = if prefix.is_empty() { namespace.hex() } else { format!("{prefix}/{}", namespace.hex()) };
        let tier = Arc::new(BucketTier {
            writer: Mutex::new(writer::SegmentWriters::new()),
            tenant_ledger: TenantLedger::new(&config.tenant_shares),
            read_permits: Arc::new(tokio::sync::Semaphore::new(config.reads_in_flight)),
            config: config.clone(),
            namespace,
            object_bytes,
            slot_bytes,
            segment_blocks: config.segment_blocks(slot_bytes) as usize,
            blocks_per_get: config.blocks_per_get(slot_bytes) as usize,
            writer_id: random_nonzero_u64(),
            store,
            read_store,
            base,
            rt,
            index: RwLock::new(Index::default()),
            bad: Mutex::new(HashSet::new()),
            bad_blocks: Mutex::new(HashSet::new()),
            cleanups: Mutex::new(Vec::new()),
            quarantined: Mutex::new(HashSet::new()),
            oversized: Mutex::new(HashSet::new()),
            auth,
            cipher: OnceLock::new(),
            stats,
            stop: Mutex::new(false),
            stop_cv: Condvar::new(),
            heartbeat: Heartbeat::new(Instant::now()),
            closed: AtomicBool::new(false),
            lease_held: AtomicBool::new(false),
            access: access::AccessLog::default(),
            doomed: Mutex::new(Vec::new()),
            maintenance: Mutex::new(None),
            close_deadline: Mutex::new(None),
        });
        tier.refresh_at_open(&bucket)?;
        sync::start_maintenance(&tier)?;
        Ok(tier)
    }

    /// The first refresh, timed as the heartbeat's first (a large bucket's LIST sets its stall
    /// limit from the start). Refused credentials or a missing bucket refuse the open; a bucket out
    /// of reach is not a refusal: DRAM and NVMe serve, the maintenance thread lists the bucket every
    /// `bucket_refresh_ms`, and its blocks become hits once it answers.
    fn refresh_at_open(&self, bucket: &str) -> Result<()> {
        let Err(e) = self.heartbeat.refresh(|| self.refresh()) else { return Ok(()) };
        if !out_of_reach(&e) {
            return Err(refused(bucket, &self.config, e));
        }
        log::warn!(
            "kvtier: bucket {bucket:?} did not answer at open ({e}); the object tier starts empty and lists it \
             again every {} ms",
            self.config.refresh_ms
        );
        Stats::add(&self.stats.bucket_unreachable_at_open, 1);
        Ok(())
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Adjacent blocks of one segment that one ranged GET reads at most.
    pub fn blocks_per_get(&self) -> usize {
        self.blocks_per_get
    }

    pub fn config(&self) -> &BucketConfig {
        &self.config
    }

    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// The tier by tenant, largest first, when it is split by tenant (`tenant_shares_bucket`); empty
    /// otherwise. Every tenant with indexed segments or segments this process evicted.
    pub fn tenant_figures(&self) -> Vec<TenantFigures> {
        if !self.config.tenant_shares.enabled() {
            return Vec::new();
        }
        let mut bytes = HashMap::new();
        for (stem, segment) in &self.index.read().segments {
            *bytes.entry(format::stem_tenant(stem)).or_default() += segment.bytes;
        }
        self.tenant_ledger.figures(bytes)
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.index.read().blocks.contains(key)
    }

    /// Changes whenever the index gains or loses a key; read it before the keys (a refresh that
    /// races a change then reads the keys again next time, never misses one).
    pub fn keys_generation(&self) -> u64 {
        self.index.read().blocks.generation()
    }

    fn segment_path(&self, stem: &str) -> ObjectPath {
        ObjectPath::from(format!("{}/seg/{stem}.kvo", self.base))
    }

    fn index_path(&self, stem: &str) -> ObjectPath {
        ObjectPath::from(format!("{}/idx/{stem}.kvi", self.base))
    }

    fn timeout(&self) -> Duration {
        self.bounded(Duration::from_millis(self.config.request_timeout_ms))
    }

    /// `limit`, cut to what is left before the close's deadline once the store is closing (at
    /// least 1 ms: a request past the deadline times out at once).
    fn bounded(&self, limit: Duration) -> Duration {
        match *self.close_deadline.lock() {
            Some(deadline) => {
                limit.min(deadline.saturating_duration_since(Instant::now())).max(Duration::from_millis(1))
            }
            None => limit,
        }
    }

    /// The store is closing: from now on the publisher's last flush and the close's own requests
    /// all end within two request timeouts in all, whatever the bucket does. Idempotent.
    pub fn closing(&self) -> Instant {
        *self
            .close_deadline
            .lock()
            .get_or_insert_with(|| Instant::now() + 2 * Duration::from_millis(self.config.request_timeout_ms))
    }

    /// Starts reading the blocks of `requests` into their slots on the tier's runtime, adjacent blocks
    /// of one segment with one ranged GET (`blocks_per_get` at most). Each read's `on_done` gets its
    /// block's result (always, within 6 request timeouts: `reads.rs`), to be handed with the returned read to
    /// `finish_started`: every block is verified alone. `None`: not indexed, a counted miss, and its
    /// `on_done` is dropped uncalled.
    ///
    /// # Safety
    /// Each slot is valid for `slot_bytes` bytes of writes and used by nothing else until its
    /// `on_done` ran.
    pub unsafe fn start_reads(&self, requests: Vec<(BlockKey, *mut u8, OnDone)>) -> Vec<Option<BucketRead>> {
        debug_assert!(requests.iter().all(|(_, slot, _)| !slot.is_null()), "a read into no slot");
        let mut started = Vec::with_capacity(requests.len());
        let mut located = Vec::with_capacity(requests.len());
        {
            let index = self.index.read();
            for (key, slot, on_done) in requests {
                let Some(loc) = index.blocks.get(&key) else {
                    Stats::add(&self.stats.bucket_misses, 1);
                    started.push(None);
                    continue;
                };
                let stem = Arc::clone(&loc.stem);
                started.push(Some(BucketRead { key, stem, offset: loc.offset, value_checksum: loc.value_checksum }));
                located.push((Arc::clone(&loc.stem), loc.offset, Landing { addr: slot as usize, on_done }));
            }
        }
        for run in reads::plan_runs(located, self.slot_bytes as u64, self.blocks_per_get) {
            self.spawn_run(run);
        }
        started
    }

    /// Judges a finished read: a verified block is a hit; anything else is a counted miss. A segment
    /// that is gone leaves the index (and its index object the bucket); a block that fails
    /// verification leaves it alone (`damage.rs`).
    ///
    /// # Safety
    /// `slot` is the read's own and its `on_done` ran.
    pub unsafe fn finish_started(&self, read: BucketRead, slot: *mut u8, result: std::io::Result<()>) -> ReadOutcome {
        if let Err(e) = result {
            // Failed requests were counted where they were made (`reads.rs`), once per GET.
            if e.kind() == std::io::ErrorKind::NotFound {
                // Evicted by another store or expired by a lifecycle rule since the last listing.
                self.segment_missing(&read.stem);
            } else {
                log::debug!("kvtier: bucket read of {:?} failed: {e}; counted as a miss", read.key);
            }
            Stats::add(&self.stats.bucket_misses, 1);
            return ReadOutcome::Miss;
        }
        // SAFETY: the read into the caller's slot finished (contract above).
        let slot = unsafe { std::slice::from_raw_parts_mut(slot, self.slot_bytes) };
        if let Err(refusal) = self.verify(&read, slot) {
            self.block_refused(&read, refusal);
            Stats::add(&self.stats.bucket_misses, 1);
            return ReadOutcome::Miss;
        }
        // The tag belongs to the segment: the DRAM slot's padding stays zero as elsewhere.
        slot[BLOCK_TAG_AT..BLOCK_TAG_AT + TAG_BYTES].fill(0);
        Stats::add(&self.stats.bucket_hits, 1);
        Stats::add(&self.stats.bucket_bytes_read, self.slot_bytes as u64);
        self.record_read(&read.stem);
        ReadOutcome::Hit
    }

    /// Encrypts the values this tier publishes from now on (`encryption_key_file`); a store sets it
    /// once, before it publishes anything. Encrypted blocks are read with or without it: without
    /// the key they are counted misses (`remote_decrypt_failures`).
    pub fn encrypt_with(&self, cipher: Arc<ValueCipher>) {
        assert!(self.cipher.set(cipher).is_ok(), "the object tier's cipher is set once");
    }

    /// A block in clear is checked, then its deployment-key tag. An encrypted one is authenticated
    /// first (the tag is over what was stored), then decrypted in place and checked.
    fn verify(&self, read: &BucketRead, slot: &mut [u8]) -> std::result::Result<(), damage::Refusal> {
        if !Descriptor::is_encrypted(&slot[..DESCRIPTOR_BYTES]) {
            return self.check_block(read, slot).and_then(|()| self.check_tag(read, slot));
        }
        self.check_tag(read, slot)?;
        if let Err(e) = open_slot(self.cipher.get().map(|c| &**c), slot, self.object_bytes) {
            log::debug!("kvtier: bucket block {:?} {e}; a miss", read.key);
            Stats::add(&self.stats.remote_decrypt_failures, 1);
            return Err(damage::Refusal::Unauthenticated);
        }
        self.check_block(read, slot)
    }

    fn check_block(&self, read: &BucketRead, slot: &[u8]) -> std::result::Result<(), damage::Refusal> {
        let checked = (|| {
            let desc = Descriptor::decode(&slot[..DESCRIPTOR_BYTES]).map_err(|_| "descriptor rejected")?;
            if desc.key != read.key || desc.namespace != self.namespace {
                return Err("key or namespace mismatch");
            }
            if desc.value_bytes as usize != self.object_bytes || desc.value_checksum != read.value_checksum {
                return Err("length or checksum differs from the index");
            }
            if checksum(&slot[DESCRIPTOR_BYTES..DESCRIPTOR_BYTES + self.object_bytes]) != desc.value_checksum {
                return Err("value checksum mismatch");
            }
            Ok(())
        })();
        if let Err(why) = checked {
            Stats::add(&self.stats.bucket_verify_failures, 1);
            return Err(damage::Refusal::Corrupt(why));
        }
        Ok(())
    }

    /// The deployment key's tag over the value as stored (`bucket_key_file`), if the tier has one.
    fn check_tag(&self, read: &BucketRead, slot: &[u8]) -> std::result::Result<(), damage::Refusal> {
        if let Some(auth) = &self.auth {
            let (page, value) = slot[..DESCRIPTOR_BYTES + self.object_bytes].split_at(DESCRIPTOR_BYTES);
            if !auth.verify_block(&self.namespace, &read.key, page, value) {
                Stats::add(&self.stats.bucket_auth_failures, 1);
                return Err(damage::Refusal::Unauthenticated);
            }
        }
        Ok(())
    }

    /// Publishes the open segment, stops the maintenance thread, all by the close's deadline
    /// (`closing`). Idempotent.
    pub fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let deadline = self.closing();
        self.flush();
        *self.stop.lock() = true;
        self.stop_cv.notify_all();
        if let Some(h) = self.maintenance.lock().take() {
            if h.thread().id() != std::thread::current().id() {
                // A listing it began before the deadline keeps its own timeout: past the deadline
                // the thread is left to end by itself (it holds only a weak reference).
                while !h.is_finished() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(5));
                }
                if h.is_finished() {
                    let _ = h.join();
                }
            }
        }
        // The reads since the last pass still count for the evictor after this store is gone.
        self.put_access_if_changed();
        // Left for the grace period, they would be nobody's: no index object names them.
        self.delete_doomed(true);
        self.release_lease();
    }
}

impl Drop for BucketTier {
    fn drop(&mut self) {
        self.close();
    }
}

/// The tier's own runtime, for its requests.
fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvtier-bucket")
        .enable_all()
        .build()
        .map_err(|e| Error::io("starting the object tier's runtime", e))
}

/// The open-time refusal: the bucket did not answer a listing with these credentials.
/// Whether a listing failed because nothing answered in time (a connection refused or reset, a
/// timeout: the gateway down, frozen or cut off), not because the bucket refused it: refused
/// credentials and a missing bucket are answers, and refuse the store at open.
fn out_of_reach(e: &Error) -> bool {
    use std::io::ErrorKind;
    let Error::Io { source, .. } = e else { return false };
    if matches!(
        source.kind(),
        ErrorKind::TimedOut | ErrorKind::ConnectionRefused | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted
    ) {
        return true;
    }
    // object_store reports a failed connection as a generic error: its chain names the cause.
    let mut cause: Option<&(dyn std::error::Error + 'static)> = source.get_ref().map(|inner| inner as _);
    while let Some(inner) = cause {
        let text = inner.to_string().to_ascii_lowercase();
        if ["error sending request", "connection refused", "timed out", "connection reset"]
            .iter()
            .any(|t| text.contains(t))
        {
            return true;
        }
        cause = inner.source();
    }
    false
}

fn refused(bucket: &str, config: &BucketConfig, e: Error) -> Error {
    let endpoint = config.endpoint.as_deref().unwrap_or("AWS (AWS_ENDPOINT_URL unset)");
    Error::config(
        "bucket_url",
        format!(
            "bucket {bucket:?} at {endpoint} refused a listing: {e}. Check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY \
             (or the web identity / instance credentials), that the bucket exists, and bucket_endpoint"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Namespace;

    fn segment(keys: &[u8]) -> format::SegmentIndex {
        let entries = keys
            .iter()
            .enumerate()
            .map(|(i, &k)| format::Entry { key: BlockKey([k; 32]), offset: 4096 * (i as u64 + 1), value_checksum: 0 })
            .collect();
        format::SegmentIndex {
            namespace: Namespace([1; 32]),
            object_bytes: 4096,
            writer_id: 7,
            seq: 0,
            segment_bytes: 4096 * (keys.len() as u64 + 1),
            created_unix_ms: 0,
            entries,
        }
    }

    #[test]
    fn the_generation_moves_exactly_when_the_index_gains_or_loses_a_key() {
        let mut index = Index::default();
        index.insert("a", &segment(&[1, 2]));
        let after_a = index.blocks.generation();
        assert!(after_a > 0, "new keys");
        index.insert("b", &segment(&[2]));
        assert_eq!(index.blocks.generation(), after_a, "a segment whose keys are all indexed adds none");
        index.remove("b");
        assert_eq!(index.blocks.generation(), after_a, "removing it loses none");
        assert!(index.blocks.contains(&BlockKey([2; 32])), "the first segment still owns the key");
        index.remove("a");
        assert!(index.blocks.generation() > after_a, "keys lost");
        assert!(index.blocks.len() == 0 && index.segments.is_empty());
        let emptied = index.blocks.generation();
        index.remove("a");
        assert_eq!(index.blocks.generation(), emptied, "a segment no longer listed changes nothing");
    }

    #[test]
    fn only_a_listing_nothing_answered_is_out_of_reach() {
        use std::io::{Error as IoError, ErrorKind};
        let io = |kind, text: &str| Error::io("listing", IoError::new(kind, text.to_string()));
        assert!(out_of_reach(&io(ErrorKind::TimedOut, "listing timed out")));
        assert!(out_of_reach(&io(ErrorKind::ConnectionRefused, "refused")));
        assert!(out_of_reach(&io(ErrorKind::Other, "Generic S3 error: error sending request for url")));
        assert!(!out_of_reach(&io(ErrorKind::Other, "Client error with status 403 Forbidden: SignatureDoesNotMatch")));
        assert!(!out_of_reach(&io(ErrorKind::NotFound, "NoSuchBucket")));
        assert!(!out_of_reach(&Error::config("bucket_url", "not an s3:// URL")));
    }

    #[test]
    fn a_block_in_two_segments_is_read_from_the_other_once_the_first_goes() {
        let mut index = Index::default();
        index.insert("a", &segment(&[1, 2]));
        index.insert("b", &segment(&[2, 3]));
        assert_eq!(index.blocks.get(&BlockKey([2; 32])).map(|l| &*l.stem), Some("a"), "the first listed");
        let before = index.blocks.generation();
        index.remove("a");
        let loc = index.blocks.get(&BlockKey([2; 32])).expect("segment b still holds block 2");
        assert_eq!((&*loc.stem, loc.offset), ("b", 4096), "b's copy, at b's offset");
        assert_eq!(index.blocks.generation(), before + 1, "only block 1 was lost");
        index.remove_block("b", &BlockKey([2; 32]));
        assert!(!index.blocks.contains(&BlockKey([2; 32])), "refused in its last segment: gone");
        assert!(index.blocks.contains(&BlockKey([3; 32])));
    }

    #[test]
    fn a_refused_block_leaves_alone_and_only_from_its_own_segment() {
        let mut index = Index::default();
        index.insert("a", &segment(&[1, 2, 3]));
        index.insert("b", &segment(&[3, 4]));
        let before = index.blocks.generation();
        index.remove_block("b", &BlockKey([3; 32]));
        assert_eq!(index.blocks.generation(), before, "segment a owns key 3: nothing changes");
        assert!(index.blocks.contains(&BlockKey([3; 32])));
        index.remove_block("a", &BlockKey([2; 32]));
        assert!(index.blocks.generation() > before, "a key lost");
        assert!(!index.blocks.contains(&BlockKey([2; 32])));
        assert!(index.blocks.contains(&BlockKey([1; 32])) && index.blocks.contains(&BlockKey([3; 32])));
        index.remove("a");
        assert!(!index.blocks.contains(&BlockKey([1; 32])), "the segment's remaining keys go with it");
        assert!(index.blocks.contains(&BlockKey([4; 32])));
    }
}
