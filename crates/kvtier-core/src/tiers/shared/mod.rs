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
//! - `writer`: the data file this process fills, sealed and published by a manifest record.
//! - `manifest`: this writer's manifest, and the tailing of the others' into the index.
//! - `maintenance`: the maintenance thread (see below).
//! - `root`: the checks and probes of the shared root at open, and directory and file creation.
//! - `files`: every open of an existing file under the root (no FIFO waited on, no symlink followed).
//! - `tenants`: the tier split by tenant (`SharedConfig::tenant_shares`): the evictor's choice of
//!   files by tenant, and the per-tenant figures.
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
mod maintenance;
mod manifest;
mod reads;
mod root;
mod sink;
mod tenants;
mod writer;

pub use config::SharedConfig;

use crate::error::{Error, Result};
use crate::format::descriptor::DESCRIPTOR_BYTES;
use crate::format::encrypted::ValueCipher;
// The tier's on-disk format, `super::format` to the submodules here.
use crate::format::shared as format;
use crate::format::{round_up, ALIGN_BYTES};
use crate::io::device::DeviceQueue;
use crate::io::IoSetup;
use crate::key::{BlockKey, Namespace};
use crate::stats::Stats;
use crate::tiers::remote::key::{load_key, KeySource, KEY_FILE_ENV};
use crate::tiers::remote::tenants::{TenantFigures, TenantLedger};
use crate::tiers::remote::{random_nonzero_u64, Heartbeat};
use files::Opener;
use format::{fanout_dir, unix_ms, AuthKey, Record};
use index::{FileId, Index};
use manifest::ManifestWriter;
use parking_lot::{Condvar, Mutex, RwLock};
use root::{check_root, create_file, make_dir, probe_direct_and_rename};
use std::collections::HashMap;
use std::fs::File;
use std::io::ErrorKind;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use writer::WriterState;

/// Open read handles kept per process; past it the cache is emptied (files are big, so few are hot).
const MAX_OPEN_DATA_FILES: usize = 256;
/// A published file read short is quarantined only if reads are still short this long after the
/// first: a mount's cached size can be older than the file (GlusterFS default caching: about 1 s).
const SHORT_READ_SETTLE: Duration = Duration::from_secs(2);

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
    /// Encryption at rest of the values it publishes (`encryption_key_file`, `encrypt_with`).
    cipher: OnceLock<Arc<ValueCipher>>,
    stats: Arc<Stats>,
    /// Block data I/O (see the module comment).
    io: DeviceQueue,
    index: RwLock<Index>,
    manifest: Mutex<ManifestWriter>,
    writer: Mutex<WriterState>,
    read_handles: Mutex<HashMap<FileId, Arc<File>>>,
    /// Opens the data files loads read, within a bound (`files::Opener`).
    opener: Opener,
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
    /// The maintenance thread's index refreshes, timed (`RemoteTier::heartbeat`).
    heartbeat: Heartbeat,
    /// Reads that found their file gone (evicted elsewhere): clean misses, counted for tests.
    pub vanished_reads: AtomicU64,
    /// Files read short (past their end), by when that was first seen; see `SHORT_READ_SETTLE`.
    short_reads: Mutex<HashMap<String, Instant>>,
    /// Short reads not (yet) taken for truncation (also counted in `io_errors`), for tests.
    pub short_reads_settling: AtomicU64,

    /// When the index last finished reading the other writers' manifests (staleness, for metrics).
    last_refresh_unix_ms: AtomicU64,
    /// Split by tenant: the tenants' labels and the files this process doomed of each.
    tenant_ledger: TenantLedger,
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
            cipher: OnceLock::new(),
            stats,
            io,
            index: RwLock::new(Index::default()),
            manifest: Mutex::new(ManifestWriter { file: Some(manifest_file), path: manifest_path, len: 0 }),
            writer: Mutex::new(WriterState { open: Vec::new(), next_file_seq: 1 }),
            read_handles: Mutex::new(HashMap::new()),
            opener: Opener::start().map_err(|e| Error::io("starting the shared tier's open thread", e))?,
            pending_access: Mutex::new(HashMap::new()),
            recorded_access: Mutex::new(HashMap::new()),
            evictor: Mutex::new(capacity::EvictorState::default()),
            last_usage: Mutex::new(Usage::default()),
            stop: Arc::new((Mutex::new(false), Condvar::new())),
            maintenance: Mutex::new(None),
            closed: AtomicBool::new(false),
            warned_stall: AtomicBool::new(false),
            last_warn_ms: AtomicU64::new(0),
            heartbeat: Heartbeat::new(Instant::now()),
            vanished_reads: AtomicU64::new(0),
            short_reads: Mutex::new(HashMap::new()),
            short_reads_settling: AtomicU64::new(0),

            last_refresh_unix_ms: AtomicU64::new(unix_ms()),
            tenant_ledger: TenantLedger::new(&config.tenant_shares),
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
        while self.heartbeat.refresh(|| self.refresh())? {}
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

    #[cfg(any(test, feature = "testing"))]
    pub fn writer_id(&self) -> u64 {
        self.writer_id
    }

    #[cfg(any(test, feature = "testing"))]
    pub fn namespace_dir(&self) -> &std::path::Path {
        &self.dir
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    #[cfg(any(test, feature = "testing"))]
    pub fn object_bytes(&self) -> usize {
        self.object_bytes
    }

    /// Encrypts the values this tier publishes from now on (`encryption_key_file`); a store sets it
    /// once, before it publishes anything. Encrypted blocks are read with or without it: without
    /// the key they are counted misses (`remote_decrypt_failures`).
    pub fn encrypt_with(&self, cipher: Arc<ValueCipher>) {
        assert!(self.cipher.set(cipher).is_ok(), "the shared tier's cipher is set once");
    }

    /// Whether a deployment key is configured (blocks and manifest records are authenticated).
    #[cfg(any(test, feature = "testing"))]
    pub fn authenticated(&self) -> bool {
        self.auth.is_some()
    }

    /// Whether data files are read and written with O_DIRECT (probed at open).
    #[cfg(any(test, feature = "testing"))]
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

    /// The tier by tenant, largest first, when it is split by tenant (`tenant_shares_shared_fs`);
    /// empty otherwise. Every tenant with indexed files or files this process doomed.
    pub fn tenant_figures(&self) -> Vec<TenantFigures> {
        if !self.config.tenant_shares.enabled() {
            return Vec::new();
        }
        let bytes = tenants::bytes_by_tenant(&self.index.read());
        self.tenant_ledger.figures(bytes)
    }

    pub(crate) fn data_path(&self, name: &str) -> PathBuf {
        self.dir.join("data").join(fanout_dir(name)).join(name)
    }

    /// Whether this process holds the evictor lease right now.
    #[cfg(any(test, feature = "testing"))]
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
        self.opener.close();
        self.io.shutdown();
    }
}

impl Drop for SharedTier {
    fn drop(&mut self) {
        self.close();
    }
}

fn is_vanished(e: &std::io::Error) -> bool {
    e.kind() == ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESTALE)
}
