//! The shared-filesystem tier: KV blocks shared by many processes on many nodes through one POSIX
//! directory (Lustre, CephFS, NFS, Storage Scale), persistent across restarts, with its capacity
//! managed by kvtier itself. Layout, formats and protocols are documented byte by byte in
//! `docs/shared-tier.md`; this module owns all of them.
//!
//! ```text
//! <root>/<namespace hex>/
//!     data/<2 hex>/<writer>-<seq>.kvs   published data files (many blocks each), immutable
//!     tmp/<writer>-<seq>.tmp            files being written (renamed into data/ when sealed)
//!     manifests/<writer>.log            one append-only log per writer process (publish, doom,
//!                                       quarantine and access records); every process tails all
//!     quarantine/<name>                 files that failed verification, kept for inspection
//!     lease/<generation>.lease          the evictor lease (highest generation in force)
//! ```
//!
//! - [`format`]: the bytes. [`index`]: the in-memory index fed by manifest records.
//! - The optional deployment key (loaded by `tiers::remote::key`): with it every block and manifest
//!   record carries a keyed BLAKE3 tag, and anything without a valid one is never served nor applied
//!   (`shared_auth_failures`, its file quarantined).
//! - [`capacity`]: usage measurement, the evictor lease, eviction with a grace period, orphan sweeps.
//! - `sink`: what the tier implements for the store (`tiers::remote::RemoteTier`): its publisher
//!   (`tiers::remote::publisher`, the store's background thread batching accepted blocks into files)
//!   appends through it, and loads start and judge reads through it.
//! - `reads`: the read path (batched reads, verification, quarantine of bad files).
//! - `files`: every open of an existing file under the root (no FIFO waited on, no symlink followed).
//!
//! Block data (reads, data-file appends, headers and footers) moves through the tier's own device
//! queue (`io::start_file_queue`): the I/O layer the NVMe tier uses, with its completion rules,
//! buffer ownership and fault injection. Manifests and directories use plain file calls.
//!
//! Lookups only consult the index (no filesystem call); a maintenance thread tails the manifests every
//! `staleness_ms / 2`, records file accesses, publishes files that waited `publish_delay_ms` and runs
//! the capacity rules.

pub mod capacity;
pub mod config;
mod files;
pub mod index;
mod reads;
mod sink;

pub use config::SharedConfig;

use crate::error::{Error, Result};
use crate::format::descriptor::{Descriptor, DESCRIPTOR_BYTES};
// The tier's on-disk format, `super::format` to the submodules here.
use crate::format::shared as format;
use crate::format::{checksum, round_up, ALIGN_BYTES};
use crate::io::buffer::AlignedBuf;
use crate::io::device::{DeviceQueue, Transfer};
use crate::io::{DirectIo, IoSetup, OpKind};
use crate::key::{BlockKey, Namespace};
use crate::stats::Stats;
use crate::tiers::remote::key::{load_key, KeySource, KEY_FILE_ENV};
use crate::tiers::remote::random_nonzero_u64;
use files::{open_dir, open_regular, OpenError};
use format::{
    data_file_name, fanout_dir, unix_ms, AuthKey, FileHeader, IndexEntry, Record, BLOCK_TAG_AT, FILE_HEADER_BYTES,
    TAG_BYTES,
};
use index::{FileId, Index};
use parking_lot::{Condvar, Mutex, RwLock};
use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Buffers of one vectored write of a data file (IOV_MAX on Linux).
const MAX_WRITE_IOVECS: usize = 1024;
/// Open read handles kept per process; past it the cache is emptied (files are big, so few are hot).
const MAX_OPEN_DATA_FILES: usize = 256;
/// Bytes of one manifest read per refresh; a longer backlog is read over several passes.
const MAX_MANIFEST_READ_BYTES: u64 = 64 << 20;
/// A published file read short is quarantined only if reads are still short this long after the
/// first: a mount's cached size can be older than the file (GlusterFS default caching: about 1 s).
const SHORT_READ_SETTLE: Duration = Duration::from_secs(2);

/// A data file being filled by this process.
struct OpenDataFile {
    file: Arc<File>,
    tmp_path: PathBuf,
    name: String,
    file_seq: u64,
    entries: Vec<IndexEntry>,
    keys: HashSet<BlockKey>,
    cursor: u64,
    started: Instant,
}

struct WriterState {
    open: Option<OpenDataFile>,
    next_file_seq: u64,
}

struct ManifestWriter {
    /// `None` once the tier is closed: the descriptor is released at close, not when the last
    /// reference goes (a caller may keep the store object, and an open file pins a mount).
    file: Option<File>,
    path: PathBuf,
    len: u64,
}

/// Usage of the filesystem (or of the namespace directory, with `capacity_bytes`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    pub used_bytes: u64,
    pub capacity_bytes: u64,
}

impl Usage {
    pub fn fraction(&self) -> f64 {
        if self.capacity_bytes == 0 {
            1.0
        } else {
            self.used_bytes as f64 / self.capacity_bytes as f64
        }
    }
}

pub struct SharedTier {
    config: SharedConfig,
    namespace: Namespace,
    object_bytes: usize,
    slot_bytes: usize,
    writer_id: u64,
    dir: PathBuf,
    direct: bool,
    /// The deployment key (`shared_key_file`): when set, blocks and manifest records are tagged on
    /// write and verified before use.
    auth: Option<AuthKey>,
    stats: Arc<Stats>,
    /// Block data I/O (see the module comment).
    io: DeviceQueue,
    index: RwLock<Index>,
    manifest: Mutex<ManifestWriter>,
    writer: Mutex<WriterState>,
    read_handles: Mutex<HashMap<FileId, Arc<File>>>,
    /// Reads since the last access record: file name -> latest read (unix ms).
    pending_access: Mutex<HashMap<String, u64>>,
    /// When each file's access was last recorded (rate limit: once per `grace_ms / 4`).
    recorded_access: Mutex<HashMap<String, u64>>,
    evictor: Mutex<capacity::EvictorState>,
    last_usage: Mutex<Usage>,
    stop: Arc<(Mutex<bool>, Condvar)>,
    maintenance: Mutex<Option<JoinHandle<()>>>,
    closed: AtomicBool,
    warned_stall: AtomicBool,
    /// When a throttled warning was last logged (unix ms).
    last_warn_ms: AtomicU64,
    /// Reads that found their file gone (evicted elsewhere): clean misses, counted for tests.
    pub vanished_reads: AtomicU64,
    /// Files read short (past their end), by when that was first seen; see `SHORT_READ_SETTLE`.
    short_reads: Mutex<HashMap<String, Instant>>,
    /// Short reads not (yet) taken for truncation (also counted in `io_errors`), for tests.
    pub short_reads_settling: AtomicU64,

    /// When the index last finished reading the other writers' manifests (staleness, for metrics).
    last_refresh_unix_ms: AtomicU64,
}

/// What one pass decoded from one manifest: the authentic records, how many were rejected, the
/// files those publish, and the bytes consumed (whole records only).
#[derive(Default)]
struct DecodedManifest {
    records: Vec<Record>,
    rejected: u64,
    forged_files: Vec<String>,
    consumed_bytes: usize,
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.into();
    move |e| Error::io(context, e)
}

impl SharedTier {
    /// Opens (creating what is missing) the namespace directory under `config.root`, loads the index
    /// from every manifest, and starts the maintenance thread.
    pub fn open(
        config: &SharedConfig,
        namespace: Namespace,
        object_bytes: usize,
        stats: Arc<Stats>,
        io: &IoSetup,
    ) -> Result<Arc<Self>> {
        let slot_bytes = DESCRIPTOR_BYTES + round_up(object_bytes, ALIGN_BYTES);
        config.validate(slot_bytes)?;
        check_root(config)?;
        let auth = load_key(&KeySource {
            env: KEY_FILE_ENV,
            key_file: config.key_file.as_deref(),
            option: "shared_key_file",
            shared_root: Some(&config.root),
        })?;
        let dir = config.root.join(namespace.hex());
        for sub in ["", "data", "tmp", "manifests", "quarantine", "lease"] {
            make_dir(config, &dir.join(sub))?;
        }
        let writer_id = random_nonzero_u64();
        let direct = probe_direct_and_rename(config, &dir.join("tmp"), writer_id)?;
        let manifest_path = dir.join("manifests").join(format!("{writer_id:016x}.log"));
        let manifest_file = create_file(config, &manifest_path, true, false)?;
        let io = crate::io::start_file_queue("shared", io)
            .map_err(|e| Error::io("starting the shared tier's I/O threads", e))?;
        let tier = Arc::new(SharedTier {
            config: config.clone(),
            namespace,
            object_bytes,
            slot_bytes,
            writer_id,
            dir,
            direct,
            auth,
            stats,
            io,
            index: RwLock::new(Index::default()),
            manifest: Mutex::new(ManifestWriter { file: Some(manifest_file), path: manifest_path, len: 0 }),
            writer: Mutex::new(WriterState { open: None, next_file_seq: 1 }),
            read_handles: Mutex::new(HashMap::new()),
            pending_access: Mutex::new(HashMap::new()),
            recorded_access: Mutex::new(HashMap::new()),
            evictor: Mutex::new(capacity::EvictorState::default()),
            last_usage: Mutex::new(Usage::default()),
            stop: Arc::new((Mutex::new(false), Condvar::new())),
            maintenance: Mutex::new(None),
            closed: AtomicBool::new(false),
            warned_stall: AtomicBool::new(false),
            last_warn_ms: AtomicU64::new(0),
            vanished_reads: AtomicU64::new(0),
            short_reads: Mutex::new(HashMap::new()),
            short_reads_settling: AtomicU64::new(0),

            last_refresh_unix_ms: AtomicU64::new(unix_ms()),
        });
        tier.append_records(&[Record::Header {
            namespace,
            object_bytes: object_bytes as u64,
            writer_id,
            created_unix_ms: unix_ms(),
        }])?;
        tier.load_index_at_open()?;
        tier.start_maintenance()?;
        Ok(tier)
    }

    /// Reads every manifest to its end, measures usage and checks there is room to start in.
    fn load_index_at_open(&self) -> Result<()> {
        let started = Instant::now();
        while self.refresh()? {}
        let usage = capacity::measure_usage(self)?;
        *self.last_usage.lock() = usage;
        self.check_space_at_start(usage)?;
        let index = self.index.read();
        log::info!(
            "kvtier: shared tier open at {} (writer {:016x}): {} blocks in {} files indexed from manifests in {:.0} ms; \
             usage {:.1}% of {} bytes; O_DIRECT {}; {}",
            self.dir.display(),
            self.writer_id,
            index.key_count(),
            index.files().count(),
            started.elapsed().as_secs_f64() * 1e3,
            usage.fraction() * 100.0,
            usage.capacity_bytes,
            if self.direct { "on" } else { "off" },
            if self.auth.is_some() {
                "blocks and records authenticated with the deployment key"
            } else {
                "no deployment key: trusting everyone who can write the shared root"
            }
        );
        Ok(())
    }

    fn check_space_at_start(&self, usage: Usage) -> Result<()> {
        let free = usage.capacity_bytes.saturating_sub(usage.used_bytes);
        let ours = self.index.read().indexed_bytes();
        if free < self.config.file_target_bytes && ours == 0 {
            return Err(Error::Capacity {
                message: format!(
                    "shared root {} has {free} bytes free, less than one file (shared_file_bytes={}), and holds no kvtier \
                     files of this namespace that eviction could remove; free space, lower shared_file_bytes or choose \
                     another shared_root",
                    self.config.root.display(),
                    self.config.file_target_bytes
                ),
            });
        }
        if usage.fraction() > self.config.high_watermark {
            if self.config.fail_on_full {
                log::warn!(
                    "kvtier: shared root {} is {:.1}% full, above shared_high_watermark {}; with shared_fail_on_full new \
                     blocks will not be published until space is freed",
                    self.config.root.display(),
                    usage.fraction() * 100.0,
                    self.config.high_watermark
                );
            } else {
                log::warn!(
                    "kvtier: shared root {} is {:.1}% full, above shared_high_watermark {}; eviction will start",
                    self.config.root.display(),
                    usage.fraction() * 100.0,
                    self.config.high_watermark
                );
            }
        }
        Ok(())
    }

    pub fn config(&self) -> &SharedConfig {
        &self.config
    }

    pub fn writer_id(&self) -> u64 {
        self.writer_id
    }

    pub fn namespace_dir(&self) -> &Path {
        &self.dir
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    pub fn object_bytes(&self) -> usize {
        self.object_bytes
    }

    /// Whether a deployment key is configured (blocks and manifest records are authenticated).
    pub fn authenticated(&self) -> bool {
        self.auth.is_some()
    }

    /// Whether data files are read and written with O_DIRECT (probed at open).
    pub fn direct_io(&self) -> bool {
        self.direct
    }

    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// The block is in the index (published by any process, not known to be evicted). A later read
    /// can still miss cleanly if another node evicts the file meanwhile.
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.index.read().contains(key)
    }

    /// A snapshot of up to `limit` indexed keys (tests, benchmarks).
    pub fn indexed_keys(&self, limit: usize) -> Vec<BlockKey> {
        self.index.read().keys().take(limit).copied().collect()
    }

    /// How long ago the index last finished reading the other writers' manifests: how stale this
    /// node's view of the shared tier may be.
    pub fn index_age_ms(&self) -> u64 {
        unix_ms().saturating_sub(self.last_refresh_unix_ms.load(Ordering::Relaxed))
    }

    /// Latest usage measured by the maintenance thread.
    pub fn usage(&self) -> Usage {
        *self.last_usage.lock()
    }

    pub(crate) fn data_path(&self, name: &str) -> PathBuf {
        self.dir.join("data").join(fanout_dir(name)).join(name)
    }

    /// Moves a file that failed verification to `quarantine/`, drops it from every index (through a
    /// quarantine record), and counts it once.
    pub(crate) fn quarantine(&self, name: &str, why: &str) {
        let removed = {
            let mut index = self.index.write();
            if let Some(id) = index.file_id(name) {
                self.read_handles.lock().remove(&id);
            }
            index.remove_file(name).is_some()
        };
        if !removed {
            return;
        }
        log::warn!("kvtier: shared file {name} failed verification ({why}); quarantined, its blocks are misses");
        Stats::add(&self.stats.shared_quarantined_files, 1);
        match std::fs::rename(self.data_path(name), self.dir.join("quarantine").join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => log::warn!("kvtier: moving {name} to quarantine failed: {e}"),
        }
        let _ = self.append_records(&[Record::Quarantine { at_unix_ms: unix_ms(), names: vec![name.to_string()] }]);
    }

    /// Quarantines a data file named by a manifest record that failed authentication (it was never
    /// indexed here): moved to `quarantine/` and a quarantine record appended, so that keyless
    /// processes on the same root drop it too. Counted once.
    fn quarantine_unauthenticated(&self, name: &str) {
        let first = {
            let mut index = self.index.write();
            let first = !index.is_gone(name);
            if let Some(id) = index.file_id(name) {
                self.read_handles.lock().remove(&id);
            }
            index.remove_file(name);
            first
        };
        if !first {
            return;
        }
        match std::fs::rename(self.data_path(name), self.dir.join("quarantine").join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => return,
            Err(e) => {
                log::warn!("kvtier: moving {name} to quarantine failed: {e}");
                return;
            }
        }
        Stats::add(&self.stats.shared_quarantined_files, 1);
        let _ = self.append_records(&[Record::Quarantine { at_unix_ms: unix_ms(), names: vec![name.to_string()] }]);
    }

    // ---- manifests ----

    /// Appends records to this writer's manifest in one write, then fdatasync. On failure the
    /// manifest is cut back so readers never see a torn record followed by good ones.
    pub(crate) fn append_records(&self, records: &[Record]) -> Result<()> {
        let mut bytes = Vec::new();
        let auth = self.auth.as_ref().map(|k| (k, &self.namespace, self.writer_id));
        for r in records {
            bytes.extend(r.encode_tagged(auth));
        }
        let mut m = self.manifest.lock();
        let len = m.len;
        let path = m.path.clone();
        let Some(file) = m.file.as_mut() else {
            return Err(Error::Closed);
        };
        let result = file.write_all(&bytes).and_then(|_| file.sync_data());
        if let Err(e) = result {
            let _ = file.set_len(len);
            let _ = file.seek(SeekFrom::End(0));
            return Err(Error::io(format!("appending to {}", path.display()), e));
        }
        m.len += bytes.len() as u64;
        drop(m);
        let mut index = self.index.write();
        for r in records {
            index.apply(self.writer_id, r.clone(), &self.namespace, self.object_bytes as u64);
        }
        Ok(())
    }

    /// Reads new records from every other writer's manifest. Returns whether anything was read.
    pub fn refresh(&self) -> Result<bool> {
        let dir = self.dir.join("manifests");
        let entries = std::fs::read_dir(&dir).map_err(io_err(format!("listing {}", dir.display())))?;
        let mut progressed = false;
        let mut forged_files = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(writer) = name.to_str().and_then(parse_manifest_name) else { continue };
            if writer == self.writer_id {
                continue;
            }
            progressed |= self.refresh_manifest(writer, &entry.path(), &mut forged_files);
        }
        for name in forged_files {
            self.quarantine_unauthenticated(&name);
        }
        self.last_refresh_unix_ms.store(unix_ms(), Ordering::Relaxed);
        Ok(progressed)
    }

    /// Reads one other writer's manifest from its cursor (at most `MAX_MANIFEST_READ_BYTES`) into
    /// the index; adds the files its forged records publish to `forged_files`. Returns whether a
    /// record was read. A manifest that cannot be read now is skipped: the next pass retries it.
    fn refresh_manifest(&self, writer: u64, path: &Path, forged_files: &mut Vec<String>) -> bool {
        let (offset, accepted) = {
            let index = self.index.read();
            let c = index.cursors.get(&writer);
            (c.map_or(0, |c| c.offset), c.and_then(|c| c.accepted))
        };
        if accepted == Some(false) {
            return false;
        }
        // Opened afresh every pass: on NFS, open revalidates the attribute cache (close-to-open
        // consistency), which is what bounds staleness there.
        let file = match open_regular(path, 0) {
            Ok(file) => file,
            Err(OpenError::NotRegular(kind)) => {
                self.skip_not_regular_manifest(writer, path, kind);
                return false;
            }
            Err(OpenError::Io(_)) => return false,
        };
        let Ok(len) = file.metadata().map(|m| m.len()) else { return false };
        if len <= offset {
            return false;
        }
        let want = (len - offset).min(MAX_MANIFEST_READ_BYTES) as usize;
        let mut buf = vec![0u8; want];
        let got = match read_at_most(&file, &mut buf, offset) {
            Ok(n) => n,
            Err(e) => {
                log::warn!("kvtier: reading manifest {} failed: {e}", path.display());
                return false;
            }
        };
        let mut decoded = self.decode_manifest(writer, &buf[..got], path, offset);
        if decoded.consumed_bytes == 0 {
            return false;
        }
        forged_files.append(&mut decoded.forged_files);
        self.apply_manifest(writer, path, offset, decoded);
        true
    }

    /// Decodes the whole records at the start of `bytes` (read from `path` at `offset`), checking
    /// each one's tag when a deployment key is set. Stops at a torn or unreadable record.
    fn decode_manifest(&self, writer: u64, bytes: &[u8], path: &Path, offset: u64) -> DecodedManifest {
        let mut decoded = DecodedManifest::default();
        let mut at = 0;
        loop {
            match Record::decode(&bytes[at..]) {
                Ok(Some((r, n))) => {
                    let authentic =
                        self.auth.as_ref().is_none_or(|k| k.verify_record(&self.namespace, writer, &bytes[at..at + n]));
                    if authentic {
                        decoded.records.push(r);
                    } else {
                        decoded.rejected += 1;
                        // The files such a record publishes are named after its manifest's writer
                        // (names are never reused): they are that writer's, and unauthenticated.
                        if let Record::Publish { name, .. } = &r {
                            if name.starts_with(&format!("{writer:016x}-")) {
                                decoded.forged_files.push(name.clone());
                            }
                        }
                    }
                    at += n;
                }
                Ok(None) => break,
                Err(e) => {
                    // A torn tail that is still being written looks the same: retry next pass, and
                    // say so once in case the writer died mid-record.
                    if !self.warned_stall.swap(true, Ordering::Relaxed) {
                        log::warn!(
                            "kvtier: manifest {} has an unreadable record at {} ({e}); waiting for it",
                            path.display(),
                            offset + at as u64
                        );
                    }
                    break;
                }
            }
        }
        debug_assert!(at <= bytes.len(), "decoded past the bytes read");
        decoded.consumed_bytes = at;
        decoded
    }

    /// Applies the authentic records decoded from `path` at `offset` to the index, counts (and warns
    /// once per writer about) the rejected ones, and moves the writer's cursor past them all.
    fn apply_manifest(&self, writer: u64, path: &Path, offset: u64, decoded: DecodedManifest) {
        debug_assert!(decoded.consumed_bytes > 0, "a cursor only moves forward");
        let mut index = self.index.write();
        if decoded.rejected > 0 {
            let rejected = decoded.rejected;
            Stats::add(&self.stats.shared_auth_failures, rejected);
            let cursor = index.cursors.entry(writer).or_default();
            if !cursor.auth_warned {
                cursor.auth_warned = true;
                log::warn!(
                    "kvtier: manifest {} has {rejected} records without a valid tag (written without the deployment \
                     key or with another); ignoring them and quarantining the files they publish",
                    path.display()
                );
            }
        }
        for r in decoded.records {
            index.apply(writer, r, &self.namespace, self.object_bytes as u64);
        }
        index.cursors.entry(writer).or_default().offset = offset + decoded.consumed_bytes as u64;
    }

    /// A manifest that is no regular file (as a FIFO, it would have blocked every refresh): skipped on
    /// every pass, counted each time, logged once per writer.
    fn skip_not_regular_manifest(&self, writer: u64, path: &Path, kind: &str) {
        Stats::add(&self.stats.shared_not_regular_files, 1);
        let mut index = self.index.write();
        let cursor = index.cursors.entry(writer).or_default();
        if !std::mem::replace(&mut cursor.not_regular_warned, true) {
            log::warn!(
                "kvtier: manifest {} is a {kind}, not a regular file; skipping it (only someone who can write the \
                 shared root can have put it there)",
                path.display()
            );
        }
    }

    /// Appends one access record for files read since the last one (each file at most once per
    /// `grace_ms / 4`: recency needs that resolution, not more).
    fn flush_accesses(&self) {
        let pending: Vec<(String, u64)> = self.pending_access.lock().drain().collect();
        if pending.is_empty() {
            return;
        }
        let interval = self.config.grace_ms / 4;
        let mut recorded = self.recorded_access.lock();
        let mut accesses = Vec::new();
        for (name, at) in pending {
            let last = recorded.get(&name).copied().unwrap_or(0);
            if at >= last + interval {
                recorded.insert(name.clone(), at);
                accesses.push((at, name));
            } else {
                self.index.write().touch(&name, at);
            }
        }
        if recorded.len() > 100_000 {
            recorded.clear();
        }
        drop(recorded);
        if !accesses.is_empty() {
            if let Err(e) = self.append_records(&[Record::Access { accesses }]) {
                log::warn!("kvtier: recording shared file accesses failed: {e}");
            }
        }
    }

    // ---- writing ----

    /// Builds slots (descriptor page + value) for values and appends them; for tests and tools.
    /// Returns how many were queued into a file (they become visible when the file is published).
    pub fn publish_values(&self, keys: &[BlockKey], values: &[&[u8]]) -> Result<usize> {
        let mut slots: Vec<(BlockKey, AlignedBuf)> = Vec::with_capacity(keys.len());
        for (key, value) in keys.iter().zip(values) {
            let mut buf = AlignedBuf::zeroed(self.slot_bytes);
            self.build_slot(key, value, buf.as_mut_slice());
            slots.push((*key, buf));
        }
        let mut refs: Vec<(BlockKey, &mut [u8])> = slots.iter_mut().map(|(k, b)| (*k, b.as_mut_slice())).collect();
        Ok(self.append_slots(&mut refs))
    }

    pub(crate) fn build_slot(&self, key: &BlockKey, value: &[u8], slot: &mut [u8]) {
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

    /// Appends whole slots (as the DRAM tier holds them) to the open data file, sealing and publishing
    /// files as they reach `file_target_bytes`. Each slot's descriptor and value checksum are checked
    /// first (a slot that changed under us is skipped). Returns how many were written.
    pub fn append_slots(&self, slots: &mut [(BlockKey, &mut [u8])]) -> usize {
        let mut written = 0;
        let mut w = self.writer.lock();
        let mut i = 0;
        while i < slots.len() {
            if w.open.is_none() && !self.start_file_below_limit(&mut w) {
                Stats::add(&self.stats.shared_publish_errors, (slots.len() - i) as u64);
                return written;
            }
            let batch = self.pick_batch(w.open.as_ref().unwrap(), slots, &mut i);
            if !batch.is_empty() {
                if !self.write_batch(&mut w, slots, &batch) {
                    continue;
                }
                written += batch.len();
            }
            let open = w.open.as_ref().unwrap();
            let full = open.cursor + self.slot_bytes as u64 + format::footer_bytes(open.entries.len() + 1) as u64
                > self.config.file_target_bytes;
            if full {
                self.seal(&mut w);
            }
        }
        written
    }

    /// Starts a data file unless the filesystem is too full for a new one, or creating it fails
    /// (logged). Returns whether a file is open now.
    fn start_file_below_limit(&self, w: &mut WriterState) -> bool {
        debug_assert!(w.open.is_none(), "one open data file per writer");
        // fail_on_full stops at the high watermark. Otherwise writers still stop at a hard ceiling
        // halfway between the high watermark and full, so that writers outpacing the evictor (whose
        // victims wait out the grace period) cannot fill the filesystem.
        let limit = if self.config.fail_on_full { self.config.high_watermark } else { self.config.hard_ceiling() };
        // Measured afresh (one statvfs) rather than from the maintenance thread's last pass: a
        // stale figure lets every writer start files past the ceiling between two passes.
        let usage_now = capacity::measure_usage(self).map(|u| u.fraction()).unwrap_or_else(|_| self.usage().fraction());
        if usage_now >= limit {
            return false;
        }
        match self.start_file(w) {
            Ok(()) => true,
            Err(e) => {
                log::warn!("kvtier: starting a shared data file failed: {e}; blocks not published");
                false
            }
        }
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
            batch.push(*next - 1);
            count += 1;
            end += self.slot_bytes as u64;
        }
        batch
    }

    /// Writes the slots `batch` names at the end of the open file and lists them in it. Returns
    /// whether they were written; if not, the file is abandoned and its blocks, these and those
    /// written before, are counted as errors.
    fn write_batch(&self, w: &mut WriterState, slots: &[(BlockKey, &mut [u8])], batch: &[usize]) -> bool {
        let open = w.open.as_mut().unwrap();
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
                self.abandon(w);
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

    fn start_file(&self, w: &mut WriterState) -> Result<()> {
        let file_seq = w.next_file_seq;
        w.next_file_seq += 1;
        let name = data_file_name(self.writer_id, file_seq);
        let tmp_path = self.dir.join("tmp").join(format!("{}.tmp", name.trim_end_matches(".kvs")));
        let file = create_file(&self.config, &tmp_path, false, self.direct)?;
        let mut header = AlignedBuf::zeroed(FILE_HEADER_BYTES);
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
        w.open = Some(OpenDataFile {
            file,
            tmp_path,
            name,
            file_seq,
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

    fn abandon(&self, w: &mut WriterState) {
        if let Some(open) = w.open.take() {
            drop(open.file);
            let _ = std::fs::remove_file(&open.tmp_path);
        }
    }

    /// Seals the open file: footer, fdatasync, rename into `data/`, directory fsync, publish record.
    fn seal(&self, w: &mut WriterState) {
        let Some(open) = w.open.take() else { return };
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

    /// Publishes the file being filled, if any, whatever its size.
    pub fn flush(&self) {
        let mut w = self.writer.lock();
        self.seal(&mut w);
    }

    fn seal_if_old(&self) {
        let Some(mut w) = self.writer.try_lock() else { return };
        let old =
            w.open.as_ref().is_some_and(|o| o.started.elapsed() >= Duration::from_millis(self.config.publish_delay_ms));
        if old {
            self.seal(&mut w);
        }
    }

    // ---- maintenance ----

    fn start_maintenance(self: &Arc<Self>) -> Result<()> {
        let weak = Arc::downgrade(self);
        let stop = Arc::clone(&self.stop);
        let period = Duration::from_millis((self.config.staleness_ms / 2).max(5));
        let handle = std::thread::Builder::new()
            .name("kvtier-shared".into())
            .spawn(move || loop {
                {
                    let (lock, cv) = &*stop;
                    let mut stopped = lock.lock();
                    if !*stopped {
                        cv.wait_for(&mut stopped, period);
                    }
                    if *stopped {
                        return;
                    }
                }
                let Some(tier) = weak.upgrade() else { return };
                tier.maintain();
            })
            .map_err(|e| Error::io("spawning the shared-tier maintenance thread", e))?;
        *self.maintenance.lock() = Some(handle);
        Ok(())
    }

    /// One maintenance pass: tail manifests, record accesses, publish an old open file, apply the
    /// capacity rules. Public so that tests can drive it deterministically.
    pub fn maintain(&self) {
        if !self.dir.join("manifests").is_dir() && !self.closed.load(Ordering::Acquire) {
            self.recreate_layout();
        }
        if let Err(e) = self.refresh() {
            // Throttled: a broken mount must not flood the log at the maintenance rate.
            let now = unix_ms();
            if now.saturating_sub(self.last_warn_ms.swap(now, Ordering::Relaxed)) >= 60_000 {
                log::warn!("kvtier: refreshing the shared index failed: {e} (repeats are silenced for 60 s)");
            }
        }
        self.flush_accesses();
        self.seal_if_old();
        capacity::tick(self);
    }

    /// The namespace directory vanished (removed by an operator or another tool): recreate it and
    /// start a new manifest, so publishing resumes; blocks that were in it become clean misses.
    fn recreate_layout(&self) {
        let made = ["", "data", "tmp", "manifests", "quarantine", "lease"]
            .iter()
            .try_for_each(|sub| make_dir(&self.config, &self.dir.join(sub)));
        if let Err(e) = made {
            let now = unix_ms();
            if now.saturating_sub(self.last_warn_ms.swap(now, Ordering::Relaxed)) >= 60_000 {
                log::warn!("kvtier: the shared directory {} is gone and cannot be recreated: {e}", self.dir.display());
            }
            return;
        }
        let mut m = self.manifest.lock();
        let _ = std::fs::remove_file(&m.path);
        match create_file(&self.config, &m.path, true, false) {
            Ok(f) => {
                m.file = Some(f);
                m.len = 0;
            }
            Err(e) => {
                log::warn!("kvtier: recreating the manifest {} failed: {e}", m.path.display());
                return;
            }
        }
        drop(m);
        let header = Record::Header {
            namespace: self.namespace,
            object_bytes: self.object_bytes as u64,
            writer_id: self.writer_id,
            created_unix_ms: unix_ms(),
        };
        match self.append_records(&[header]) {
            Ok(()) => log::warn!(
                "kvtier: the shared directory {} vanished; recreated it, publishing resumes",
                self.dir.display()
            ),
            Err(e) => log::warn!("kvtier: restarting the manifest in {} failed: {e}", self.dir.display()),
        }
    }

    /// Whether this process holds the evictor lease right now.
    pub fn is_evictor(&self) -> bool {
        self.evictor.lock().holds_lease()
    }

    /// Publishes the open file, stops the maintenance thread and releases the lease. Idempotent.
    pub fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        {
            let (lock, cv) = &*self.stop;
            *lock.lock() = true;
            cv.notify_all();
        }
        if let Some(h) = self.maintenance.lock().take() {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        self.flush();
        self.flush_accesses();
        capacity::release(self);
        self.manifest.lock().file.take();
        self.read_handles.lock().clear();
        self.io.shutdown();
    }
}

impl Drop for SharedTier {
    fn drop(&mut self) {
        self.close();
    }
}

fn parse_manifest_name(name: &str) -> Option<u64> {
    let hex = name.strip_suffix(".log")?;
    (hex.len() == 16).then(|| u64::from_str_radix(hex, 16).ok()).flatten()
}

fn is_vanished(e: &std::io::Error) -> bool {
    e.kind() == ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESTALE)
}

fn read_at_most(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// The root must exist (created only when its parent does) and be a directory.
fn check_root(config: &SharedConfig) -> Result<()> {
    let root = &config.root;
    match std::fs::metadata(root) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(Error::config(
            "shared_root",
            format!("{} is not a directory; give the directory on the shared filesystem", root.display()),
        )),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            let parent = root.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
            if parent.is_dir() {
                make_dir(config, root)
            } else {
                Err(Error::config(
                    "shared_root",
                    format!(
                        "{} does not exist, nor does its parent {}; mount the shared filesystem (or create the directory) \
                         first",
                        root.display(),
                        parent.display()
                    ),
                ))
            }
        }
        Err(e) => Err(Error::io(format!("checking shared_root {}", root.display()), e)),
    }
}

fn writable_error(path: &Path, e: std::io::Error) -> Error {
    match e.raw_os_error() {
        Some(libc::EROFS) => Error::config(
            "shared_root",
            format!(
                "{} is on a read-only filesystem; mount it read-write or choose another shared_root",
                path.display()
            ),
        ),
        Some(libc::EACCES) | Some(libc::EPERM) => Error::config(
            "shared_root",
            format!(
                "{} is not writable by uid {}; fix its owner or mode (several service accounts: a common group and \
                 group_shared=true)",
                path.display(),
                rustix::process::getuid().as_raw()
            ),
        ),
        Some(libc::ENOSPC) => Error::Capacity {
            message: format!(
                "{}: the shared filesystem is full; free space or choose another shared_root",
                path.display()
            ),
        },
        _ => Error::io(format!("creating {}", path.display()), e),
    }
}

/// Creates a directory with the configured mode (set explicitly: the umask must not narrow it).
/// How long `make_dir` keeps retrying a directory another node is creating at the same moment.
const MKDIR_SETTLE: Duration = Duration::from_secs(3);

fn make_dir(config: &SharedConfig, path: &Path) -> Result<()> {
    // Two nodes creating the same directory at once: on GlusterFS with default client caching the
    // loser's mkdir says EEXIST while its stat still fails for a moment, and creating a subdirectory
    // of the winner's new directory says ENOENT (measured on GlusterFS 10, tests/test_shared_fs.py).
    // Both settle within a second: retry for a bounded time before calling it an error.
    let started = Instant::now();
    loop {
        let transient = match std::fs::create_dir(path) {
            Ok(()) => {
                return std::fs::set_permissions(path, std::fs::Permissions::from_mode(config.dir_mode()))
                    .map_err(|e| writable_error(path, e))
            }
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                if path.is_dir() {
                    return Ok(());
                }
                Error::config("shared_root", format!("{} exists but is not a directory; remove it", path.display()))
            }
            Err(e) if e.kind() == ErrorKind::NotFound => writable_error(path, e),
            Err(e) => return Err(writable_error(path, e)),
        };
        if started.elapsed() >= MKDIR_SETTLE {
            return Err(transient);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Creates a new file exclusively, with the configured mode.
fn create_file(config: &SharedConfig, path: &Path, append: bool, direct: bool) -> Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).create_new(true).mode(config.file_mode());
    if append {
        o.append(true);
    } else {
        o.write(true);
    }
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    let f = o.open(path).map_err(|e| writable_error(path, e))?;
    if config.group_shared {
        let _ = f.set_permissions(std::fs::Permissions::from_mode(config.file_mode()));
    }
    Ok(f)
}

/// Probes O_DIRECT (write and read back one page) and rename-over-existing in `tmp/`.
fn probe_direct_and_rename(config: &SharedConfig, tmp: &Path, writer_id: u64) -> Result<bool> {
    let direct = probe_direct(config, tmp, writer_id)?;
    probe_rename(config, tmp, writer_id)?;
    Ok(direct)
}

/// Whether data files use O_DIRECT: as `direct_io` asks, where the filesystem supports it (`auto`
/// falls back to buffered I/O with a warning; `on` is an error without it).
fn probe_direct(config: &SharedConfig, tmp: &Path, writer_id: u64) -> Result<bool> {
    let want = config.direct_io;
    if want == DirectIo::Off {
        return Ok(false);
    }
    let probe = tmp.join(format!("probe-{writer_id:016x}.tmp"));
    let ok = write_and_read_back_direct(config, &probe);
    let _ = std::fs::remove_file(&probe);
    match ok {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) || e.kind() == ErrorKind::Other => {
            if want == DirectIo::On {
                return Err(Error::config(
                    "shared_direct_io",
                    format!("{} does not support O_DIRECT ({e}); set direct_io to auto or off", tmp.display()),
                ));
            }
            log::warn!(
                "kvtier: shared root {} does not support O_DIRECT ({e}); using buffered I/O for shared files",
                config.root.display()
            );
            Ok(false)
        }
        Err(e) => Err(writable_error(tmp, e)),
    }
}

/// Creates `probe` with O_DIRECT, writes one page and checks it reads back the same.
fn write_and_read_back_direct(config: &SharedConfig, probe: &Path) -> std::io::Result<()> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(config.file_mode())
        .custom_flags(libc::O_DIRECT)
        .open(probe)?;
    let mut page = AlignedBuf::zeroed(ALIGN_BYTES);
    page.as_mut_slice()[..8].copy_from_slice(b"kvtprobe");
    f.write_all_at(page.as_slice(), 0)?;
    let mut back = AlignedBuf::zeroed(ALIGN_BYTES);
    f.read_exact_at(back.as_mut_slice(), 0)?;
    if back.as_slice() != page.as_slice() {
        return Err(std::io::Error::other("O_DIRECT read back different bytes"));
    }
    Ok(())
}

/// Publishing relies on rename replacing a name atomically; a filesystem that refuses rename
/// (some object-store gateways) cannot host the tier.
fn probe_rename(config: &SharedConfig, tmp: &Path, writer_id: u64) -> Result<()> {
    let a = tmp.join(format!("probe-{writer_id:016x}.a"));
    let b = tmp.join(format!("probe-{writer_id:016x}.b"));
    let renamed = rename_over_existing(config, &a, &b);
    let _ = std::fs::remove_file(&a);
    let _ = std::fs::remove_file(&b);
    if let Err(e) = renamed {
        return Err(match e.raw_os_error() {
            Some(libc::EROFS) | Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::ENOSPC) => writable_error(tmp, e),
            _ => Error::config(
                "shared_root",
                format!(
                    "{} does not support atomic rename over an existing file ({e}); kvtier publishes by rename, use a \
                     POSIX filesystem (NFS, Lustre, CephFS, Storage Scale)",
                    config.root.display()
                ),
            ),
        });
    }
    Ok(())
}

/// Creates `a` and `b`, renames `a` over `b` and checks that `b` now holds `a`'s bytes.
fn rename_over_existing(config: &SharedConfig, a: &Path, b: &Path) -> std::io::Result<()> {
    // Created exclusively and read back through `open_regular`: a FIFO planted under either name must
    // not hang the open.
    let create = |path: &Path| OpenOptions::new().write(true).create_new(true).mode(config.file_mode()).open(path);
    let mut fa = create(a)?;
    fa.write_all(b"a")?;
    create(b)?.write_all(b"b")?;
    std::fs::rename(a, b)?;
    let mut s = String::new();
    let mut back = open_regular(b, 0).map_err(|e| match e {
        OpenError::Io(e) => e,
        other => std::io::Error::other(other.to_string()),
    })?;
    back.read_to_string(&mut s)?;
    if s != "a" {
        return Err(std::io::Error::other("rename did not replace the target"));
    }
    Ok(())
}
