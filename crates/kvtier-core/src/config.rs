//! Store configuration. `StoreConfig::new` (and `SharedConfig::new`) hold the defaults, `validate`
//! the constraints (run before anything touches the disk; the error names the option and the fix), and
//! [`OPTIONS`] is the one table of option names, kinds and descriptions: the Python binding parses
//! `Store.open(**options)` through it, `kvtier.options()` exposes it, and the option tables of
//! `docs/configuration.md` and `docs/shared-tier.md` are generated from it (`python -m kvtier.options
//! --write`), defaults rendered from `StoreConfig::new` / `SharedConfig::new`. Field comments below
//! therefore state no default values: they would be one more copy to drift.

use crate::admission::WriteAdmission;
use crate::error::{Error, Result};
use crate::format::{round_up, ALIGN_BYTES};
use crate::io::{DirectIo, EngineChoice};
use crate::tiers::health::HealthPolicy;
use crate::tiers::object::BucketConfig;
use crate::tiers::shared::SharedConfig;
use std::path::PathBuf;

/// Bounds the in-memory region table (and catches absurd capacities before anything is sized).
pub const MAX_REGIONS_PER_DEVICE: u64 = 1 << 20;

#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Local NVMe directories; several are striped (one device file and one I/O thread each).
    pub paths: Vec<PathBuf>,
    /// Description of the KV layout (model identity, dtype, layout, tokens per block, parallel layout);
    /// hashed to the namespace digest that names the store's subdirectory.
    pub namespace: Vec<u8>,
    /// Bytes per block object. Required (0 = not set).
    pub object_bytes: usize,
    /// DRAM tier budget in bytes.
    pub dram_bytes: usize,
    /// Minimum number of DRAM slots (I/O staging) whatever `dram_bytes` says.
    pub staging_slots: usize,
    /// NVMe tier capacity in bytes, split evenly over `paths`; 0 disables the NVMe tier.
    pub nvme_bytes: u64,
    /// What `Store::open` does when a device file still to be created does not fit on its filesystem.
    pub nvme_without_space: NvmeWithoutSpace,
    /// Region size in bytes (unit of sequential writing and eviction); 0 picks
    /// max(64 MiB, 8 slots) rounded to 4 KiB. Must hold at least one slot plus its trailer.
    pub region_bytes: u64,
    /// I/O engine: auto (self-test io_uring, fall back to psync), io_uring, or psync.
    pub io_engine: EngineChoice,
    /// Operations in flight per device.
    pub io_depth: usize,
    /// O_DIRECT policy.
    pub direct_io: DirectIo,
    /// Bytes of writes in flight per device while reads may arrive.
    pub max_write_inflight_bytes: usize,
    /// Bytes accepted into DRAM but not yet written to NVMe; past it a store waits (up to
    /// `slot_wait_ms`) for writes to finish. 0 picks half of the DRAM pool.
    pub max_dirty_bytes: usize,
    /// Store jobs queued for the asynchronous API; past it a store job is dropped and counted.
    pub store_queue_jobs: usize,
    /// Threads serving asynchronous load jobs. Stores have one thread of their own.
    pub load_threads: usize,
    /// Threads that checksum one large commit of blocks other processes filled (a GPU rank's
    /// store). 0: the machine's cores, at most 8.
    pub checksum_threads: usize,
    /// How long a store or a load waits for a free DRAM slot before giving up (drop or miss).
    pub slot_wait_ms: u64,
    /// How long a load waits for its remote reads (shared filesystem, object store) with none of
    /// them finishing before it gives them up as misses; longer for a tier whose recent reads were
    /// slow (`RemoteTiers::stall_limit`). 0: no limit.
    pub remote_read_stall_ms: u64,
    /// How long a load waits for its NVMe reads with none of them finishing (a hung disk) before it
    /// gives them up as misses and the NVMe tier steps aside. 0: no limit.
    pub nvme_read_stall_ms: u64,
    /// A load short of DRAM slots takes the slot of a stored block whose NVMe write has not started
    /// (dropping that store) instead of waiting for the write backlog to drain.
    pub loads_cancel_queued_writes: bool,
    /// Which stored blocks are written below DRAM (NVMe, shared filesystem, bucket): those with
    /// evidence of reuse, or all (`admission.rs`).
    pub write_admission: WriteAdmission,
    /// `write_admission` of the shared-filesystem and object tiers; `None`: as `write_admission`.
    pub remote_write_admission: Option<WriteAdmission>,
    /// How many blocks stored once `write_admission: "reuse"` remembers (8 bytes each).
    pub write_admission_memory_blocks: usize,
    /// The NVMe tier's write budget in drive writes per day of the filesystems holding `paths`
    /// (their total size); 0 = unbounded. Overridden by `write_budget_nvme_bytes_per_day`.
    pub write_budget_nvme_dwpd: f64,
    /// The NVMe tier's write budget in bytes per day; 0 = from `write_budget_nvme_dwpd`.
    pub write_budget_nvme_bytes_per_day: u64,
    /// The share of the DRAM pool guaranteed to each tenant not named in `tenant_dram_shares`
    /// (`crate::tenant`); 0 with no named tenants: the pool is not split.
    pub tenant_dram_share: f64,
    /// `salt=share` pairs (`tenant::parse_named_shares`), as given.
    pub tenant_dram_shares: Vec<u8>,
    /// The most of the DRAM pool one tenant holds before it evicts its own blocks; 0 = no cap.
    pub tenant_dram_max_share: f64,
    /// Whether the NVMe tier's regions are split by tenant with the DRAM pool's shares and cap.
    pub tenant_shares_nvme: bool,
    /// Whether the shared-filesystem tier is split by tenant with the DRAM pool's shares and cap.
    pub tenant_shares_shared_fs: bool,
    /// Whether the object tier's segments are split by tenant with the DRAM pool's shares and cap.
    pub tenant_shares_bucket: bool,
    /// The shared-filesystem and object tiers' write budgets in bytes per day; 0 = unbounded.
    pub write_budget_shared_bytes_per_day: u64,
    pub write_budget_bucket_bytes_per_day: u64,
    /// Seconds of its rate a write budget may spend at once (after an idle spell).
    pub write_budget_burst_s: u64,
    /// Key file for encryption at rest of NVMe values (`format::encrypted`); None: the
    /// `KVTIER_ENCRYPTION_KEY_FILE` file if set, else values are written in clear.
    pub encryption_key_file: Option<PathBuf>,
    /// Test seam: inject I/O faults. Only with the `testing` feature (not in production builds).
    #[cfg(any(test, feature = "testing"))]
    pub fault_plan: Option<std::sync::Arc<crate::io::faults::FaultPlan>>,
    /// Test seam: when a tier below DRAM (NVMe, a remote tier) turns sick and how long it steps
    /// aside (`tiers::health`). Not a user option.
    #[doc(hidden)]
    pub tier_health: HealthPolicy,
    /// Put the DRAM pool in this shared-memory file (a host service sharing it with engine processes)
    /// instead of anonymous memory. Set by the service, not a user option.
    pub pool_path: Option<PathBuf>,
    /// Shared-filesystem tier below (or instead of) NVMe; None disables it.
    /// See `docs/shared-tier.md` for its options.
    pub shared: Option<SharedConfig>,
    /// Object-storage (S3) tier below the others; None disables it. See `docs/object-tier.md`.
    pub bucket: Option<BucketConfig>,
}

/// What a store does at open when its NVMe tier's device file is still to be created and the
/// filesystem has no room for it (a full disk, or `nvme_bytes` larger than the disk).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NvmeWithoutSpace {
    /// Fail the open with a capacity error (what a program opening a store itself asked for).
    Refuse,
    /// Open without the NVMe tier (DRAM and the remote tiers only), with a warning and the
    /// `nvme_off_no_space` gauge: an engine must never fail to start because a disk is full.
    DramOnly,
}

impl StoreConfig {
    /// The I/O settings the shared tier's device queue shares with the NVMe tier's.
    pub fn io_setup(&self) -> crate::io::IoSetup {
        crate::io::IoSetup {
            depth: self.io_depth,
            max_write_inflight_bytes: self.max_write_inflight_bytes,
            #[cfg(any(test, feature = "testing"))]
            fault_plan: self.fault_plan.clone(),
        }
    }

    pub fn new(path: impl Into<PathBuf>, object_bytes: usize) -> Self {
        StoreConfig {
            paths: vec![path.into()],
            namespace: Vec::new(),
            object_bytes,
            dram_bytes: 1 << 30,
            staging_slots: 8,
            nvme_bytes: 8 << 30,
            nvme_without_space: NvmeWithoutSpace::Refuse,
            region_bytes: 0,
            io_engine: EngineChoice::Auto,
            io_depth: 32,
            direct_io: DirectIo::Auto,
            max_write_inflight_bytes: 8 << 20,
            max_dirty_bytes: 0,
            store_queue_jobs: 64,
            load_threads: 2,
            checksum_threads: 0,
            slot_wait_ms: 5000,
            remote_read_stall_ms: 1000,
            nvme_read_stall_ms: 1000,
            loads_cancel_queued_writes: true,
            write_admission: WriteAdmission::All,
            remote_write_admission: None,
            write_admission_memory_blocks: 1 << 20,
            write_budget_nvme_dwpd: 1.0,
            write_budget_nvme_bytes_per_day: 0,
            tenant_dram_share: 0.0,
            tenant_dram_shares: Vec::new(),
            tenant_dram_max_share: 0.0,
            tenant_shares_nvme: true,
            tenant_shares_shared_fs: true,
            tenant_shares_bucket: true,
            write_budget_shared_bytes_per_day: 0,
            write_budget_bucket_bytes_per_day: 0,
            write_budget_burst_s: 86_400,
            encryption_key_file: None,
            #[cfg(any(test, feature = "testing"))]
            fault_plan: None,
            tier_health: HealthPolicy::default(),
            pool_path: None,
            shared: None,
            bucket: None,
        }
    }

    /// Bytes of one slot: descriptor page plus the value rounded up to 4 KiB.
    pub fn slot_bytes(&self) -> usize {
        ALIGN_BYTES + round_up(self.object_bytes, ALIGN_BYTES)
    }

    pub fn slot_count(&self) -> usize {
        (self.dram_bytes / self.slot_bytes()).max(self.staging_slots)
    }

    pub fn effective_region_bytes(&self) -> u64 {
        if self.region_bytes != 0 {
            return self.region_bytes;
        }
        let eight_slots = 8 * self.slot_bytes() as u64 + 64 * 1024;
        round_up((64u64 << 20).max(eight_slots) as usize, ALIGN_BYTES) as u64
    }

    pub fn effective_max_dirty_bytes(&self) -> usize {
        if self.max_dirty_bytes != 0 {
            self.max_dirty_bytes
        } else {
            (self.slot_count() * self.slot_bytes() / 2).max(self.slot_bytes())
        }
    }

    /// Checks every option and their combinations, in this order: paths, the general options, the
    /// NVMe layout, then the shared and object tiers' own options. The first problem is the error.
    pub fn validate(&self) -> Result<()> {
        self.validate_paths()?;
        self.validate_general()?;
        if self.nvme_bytes > 0 {
            self.validate_nvme_layout()?;
        }
        if let Some(shared) = &self.shared {
            shared.validate(self.slot_bytes())?;
        }
        if let Some(bucket) = &self.bucket {
            bucket.validate(self.slot_bytes())?;
        }
        Ok(())
    }

    /// At least one directory, none empty, none listed twice.
    fn validate_paths(&self) -> Result<()> {
        if self.paths.is_empty() {
            return Err(Error::config("path", "no directory given; pass the local NVMe directory"));
        }
        for (i, p) in self.paths.iter().enumerate() {
            if p.as_os_str().is_empty() {
                return Err(Error::config("path", "empty path; pass a directory"));
            }
            if self.paths[..i].contains(p) {
                return Err(Error::config(
                    "path",
                    format!("{} is listed twice; list each directory once", p.display()),
                ));
            }
        }
        Ok(())
    }

    /// The namespace, block size, queues and threads, and the dirty-bytes bound.
    fn validate_general(&self) -> Result<()> {
        if self.namespace.is_empty() {
            return Err(Error::config(
                "namespace",
                "required: describe what makes KV bytes compatible (model and weights fingerprint, dtype, layout, \
                 tokens per block, TP/PP size and rank), so two models never share blocks",
            ));
        }
        if self.object_bytes == 0 || self.object_bytes > 1 << 30 {
            return Err(Error::config(
                "object_bytes",
                format!("{} is out of range; give the bytes of one block object, 1 ..= 1 GiB", self.object_bytes),
            ));
        }
        if self.staging_slots < 2 {
            return Err(Error::config("staging_slots", "must be at least 2"));
        }
        if !(1..=4096).contains(&self.io_depth) {
            return Err(Error::config("io_depth", format!("{} is out of range 1 ..= 4096", self.io_depth)));
        }
        if self.load_threads == 0 || self.load_threads > 64 {
            return Err(Error::config("load_threads", "must be in 1 ..= 64"));
        }
        if self.checksum_threads > 64 {
            return Err(Error::config("checksum_threads", "must be in 0 ..= 64 (0: the cores, at most 8)"));
        }
        if self.store_queue_jobs == 0 {
            return Err(Error::config("store_queue_jobs", "must be at least 1"));
        }
        if self.max_write_inflight_bytes == 0 {
            return Err(Error::config("max_write_inflight_bytes", "must be positive"));
        }
        self.validate_write_budgets()?;
        if self.max_dirty_bytes != 0 && self.max_dirty_bytes < self.slot_bytes() {
            // Below one slot no store is ever admitted: every put would wait slot_wait_ms and be dropped.
            return Err(Error::config(
                "max_dirty_bytes",
                format!(
                    "{} is below one slot ({} bytes), so every store would be dropped; raise it to at least {} or set 0 for the default",
                    self.max_dirty_bytes,
                    self.slot_bytes(),
                    self.slot_bytes()
                ),
            ));
        }
        Ok(())
    }

    fn validate_write_budgets(&self) -> Result<()> {
        if self.write_admission_memory_blocks == 0 {
            return Err(Error::config("write_admission_memory_blocks", "must be at least 1 block"));
        }
        let dwpd = self.write_budget_nvme_dwpd;
        if !dwpd.is_finite() || !(0.0..=1000.0).contains(&dwpd) {
            return Err(Error::config(
                "write_budget_nvme_dwpd",
                format!("{dwpd} is out of range; give drive writes per day, 0 (unbounded) ..= 1000"),
            ));
        }
        if !(1..=86_400).contains(&self.write_budget_burst_s) {
            return Err(Error::config("write_budget_burst_s", "must be in 1 ..= 86400 seconds"));
        }
        self.tenant_shares().map(|_| ())
    }

    /// The DRAM pool's tenant shares (`tenant_dram_share`, `tenant_dram_shares`), checked.
    pub fn tenant_shares(&self) -> Result<crate::tenant::TenantShares> {
        let default_share = self.tenant_dram_share;
        if !(0.0..=1.0).contains(&default_share) {
            return Err(Error::config(
                "tenant_dram_share",
                format!("{default_share} is out of range; give a fraction of the DRAM pool, 0 (no split) ..= 1"),
            ));
        }
        let text = std::str::from_utf8(&self.tenant_dram_shares)
            .map_err(|_| Error::config("tenant_dram_shares", "is not UTF-8; give salt=share pairs"))?;
        let named = crate::tenant::parse_named_shares(text).map_err(|e| Error::config("tenant_dram_shares", e))?;
        let max_share = self.tenant_max_share(default_share, &named)?;
        Ok(crate::tenant::TenantShares { default_share, named, max_share })
    }

    /// `tenant_dram_max_share` checked against the guarantees: a cap under a tenant's guaranteed
    /// share could not hold both.
    fn tenant_max_share(&self, default_share: f64, named: &[(crate::tenant::TenantId, f64)]) -> Result<Option<f64>> {
        let max_share = self.tenant_dram_max_share;
        if max_share == 0.0 {
            return Ok(None);
        }
        if !(max_share > 0.0 && max_share <= 1.0) {
            return Err(Error::config(
                "tenant_dram_max_share",
                format!("{max_share} is out of range; give a fraction of the DRAM pool in (0, 1], or 0 for no cap"),
            ));
        }
        let largest = named.iter().map(|&(_, share)| share).fold(default_share, f64::max);
        if max_share < largest {
            return Err(Error::config(
                "tenant_dram_max_share",
                format!(
                    "{max_share} is under a guaranteed share ({largest}): a tenant cannot be held under the \
                     share it is guaranteed; raise the cap or lower tenant_dram_share / tenant_dram_shares"
                ),
            ));
        }
        Ok(Some(max_share))
    }

    /// The NVMe tier's write budget in bytes per day (0: unbounded), given the total size of the
    /// filesystems holding `paths` (`write_budget_nvme_dwpd` applies to it).
    pub fn nvme_write_budget_bytes_per_day(&self, filesystem_bytes: u64) -> u64 {
        if self.write_budget_nvme_bytes_per_day != 0 {
            return self.write_budget_nvme_bytes_per_day;
        }
        (self.write_budget_nvme_dwpd * filesystem_bytes as f64) as u64
    }

    /// The NVMe regions: aligned, able to hold a slot, and neither too many nor fewer than 2 per
    /// directory.
    fn validate_nvme_layout(&self) -> Result<()> {
        assert!(!self.paths.is_empty(), "paths are validated first: the capacity is split over them");
        let region = self.effective_region_bytes();
        if !region.is_multiple_of(ALIGN_BYTES as u64) {
            return Err(Error::config("region_bytes", "must be a multiple of 4096"));
        }
        if crate::tiers::nvme::Geometry::new(self.slot_bytes() as u64, region, 1).max_entries == 0 {
            return Err(Error::config(
                "region_bytes",
                format!(
                    "{region} cannot hold one slot of {} bytes plus its trailer; raise region_bytes",
                    self.slot_bytes()
                ),
            ));
        }
        let per_device = self.nvme_bytes / self.paths.len() as u64;
        if per_device / region > MAX_REGIONS_PER_DEVICE {
            return Err(Error::config(
                "region_bytes",
                format!(
                    "nvme_bytes / region_bytes gives {} regions per directory, more than {MAX_REGIONS_PER_DEVICE}; \
                     raise region_bytes",
                    per_device / region
                ),
            ));
        }
        if per_device < 2 * region {
            return Err(Error::config(
                "nvme_bytes",
                format!(
                    "{} bytes over {} directories leaves fewer than 2 regions of {region} bytes per directory; \
                     raise nvme_bytes to at least {} or lower region_bytes",
                    self.nvme_bytes,
                    self.paths.len(),
                    2 * region * self.paths.len() as u64
                ),
            ));
        }
        Ok(())
    }
}

// ------------------------------------------------------------------------------------ option table

/// How an option's value is given (and converted from Python).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptionKind {
    /// A non-negative integer (a count or milliseconds).
    Int,
    /// A non-negative integer number of bytes (rendered with binary units when exact).
    Size,
    /// A float.
    Float,
    /// A bool.
    Bool,
    /// A filesystem path (Python: str or os.PathLike).
    Path,
    /// Bytes, or a str taken as its UTF-8 bytes.
    BytesOrStr,
    /// One of these strings.
    Choice(&'static [&'static str]),
}

impl OptionKind {
    /// Short name of the kind: `int`, `size`, `float`, `bool`, `path`, `bytes_or_str` or `choice`.
    pub fn name(&self) -> &'static str {
        match self {
            OptionKind::Int => "int",
            OptionKind::Size => "size",
            OptionKind::Float => "float",
            OptionKind::Bool => "bool",
            OptionKind::Path => "path",
            OptionKind::BytesOrStr => "bytes_or_str",
            OptionKind::Choice(_) => "choice",
        }
    }

    /// What a value of this kind must be, for error messages ("expected {expected}").
    pub fn expected(&self) -> String {
        match self {
            OptionKind::Int => "a non-negative int".into(),
            OptionKind::Size => "a non-negative int (bytes)".into(),
            OptionKind::Float => "a float".into(),
            OptionKind::Bool => "a bool".into(),
            OptionKind::Path => "a str or os.PathLike".into(),
            OptionKind::BytesOrStr => "bytes or str".into(),
            OptionKind::Choice(choices) => format!("one of {}", quoted_list(choices)),
        }
    }

    /// The allowed strings of a `Choice`, empty otherwise.
    pub fn choices(&self) -> &'static [&'static str] {
        match self {
            OptionKind::Choice(choices) => choices,
            _ => &[],
        }
    }

    fn accepts(&self, value: &OptionValue) -> bool {
        matches!(
            (self, value),
            (OptionKind::Int | OptionKind::Size, OptionValue::Int(_))
                | (OptionKind::Float, OptionValue::Float(_))
                | (OptionKind::Bool, OptionValue::Bool(_))
                | (OptionKind::Path, OptionValue::Path(_))
                | (OptionKind::BytesOrStr, OptionValue::Bytes(_))
        ) || matches!((self, value), (OptionKind::Choice(c), OptionValue::Str(s)) if c.contains(&s.as_str()))
    }
}

fn quoted_list(items: &[&str]) -> String {
    items.iter().map(|c| format!("\"{c}\"")).collect::<Vec<_>>().join(", ")
}

/// A typed option value (what a setter takes and a getter returns).
#[derive(Debug, Clone, PartialEq)]
pub enum OptionValue {
    /// `Int` and `Size` options.
    Int(u64),
    Float(f64),
    Bool(bool),
    Path(PathBuf),
    /// `BytesOrStr` options.
    Bytes(Vec<u8>),
    /// `Choice` options.
    Str(String),
}

impl OptionValue {
    // Accessors for the setters: `ConfigOption::apply` has checked the kind, so the fallbacks are never used.
    fn int(&self) -> u64 {
        if let OptionValue::Int(v) = self {
            *v
        } else {
            0
        }
    }
    fn float(&self) -> f64 {
        if let OptionValue::Float(v) = self {
            *v
        } else {
            f64::NAN
        }
    }
    fn bool(&self) -> bool {
        matches!(self, OptionValue::Bool(true))
    }
    fn path(self) -> PathBuf {
        if let OptionValue::Path(v) = self {
            v
        } else {
            PathBuf::new()
        }
    }
    fn bytes(self) -> Vec<u8> {
        if let OptionValue::Bytes(v) = self {
            v
        } else {
            Vec::new()
        }
    }
    fn choice(&self, choices: &[&str]) -> usize {
        match self {
            OptionValue::Str(s) => choices.iter().position(|c| c == s).unwrap_or(0),
            _ => 0,
        }
    }

    /// The value as the docs show it: sizes in binary units when exact (`256 MiB`), strings quoted.
    pub fn render(&self, kind: OptionKind) -> String {
        match self {
            OptionValue::Int(v) if kind == OptionKind::Size => render_size(*v),
            OptionValue::Int(v) => v.to_string(),
            OptionValue::Float(v) => format!("{v}"),
            OptionValue::Bool(v) => v.to_string(),
            OptionValue::Path(p) => format!("`{}`", p.display()),
            OptionValue::Bytes(b) => format!("`{:?}`", String::from_utf8_lossy(b)),
            OptionValue::Str(s) => format!("`\"{s}\"`"),
        }
    }
}

fn render_size(bytes: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes != 0 && bytes.is_multiple_of(1u64 << shift) {
            return format!("{} {unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// One option of `Store.open(path, **options)` (or, `python == false`, of the Rust `StoreConfig` only).
pub struct ConfigOption {
    /// Option name: the Python keyword, and the option named by `validate`'s errors.
    pub name: &'static str,
    /// The `StoreConfig` field it sets (`shared.x` for `SharedConfig` fields).
    pub field: &'static str,
    /// Settable from Python (`Store.open`, vLLM's `kv_connector_extra_config`); false: Rust only.
    pub python: bool,
    pub kind: OptionKind,
    /// What the default means when the getter reports no value (required, or an automatic choice).
    pub unset: &'static str,
    /// The constraint `validate` enforces, in words (for a `Choice`, beyond being one of its strings).
    pub constraint: &'static str,
    /// What the option does, one line.
    pub description: &'static str,
    set: fn(&mut StoreConfig, OptionValue),
    get: fn(&StoreConfig) -> Option<OptionValue>,
}

impl std::fmt::Debug for ConfigOption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfigOption").field("name", &self.name).field("kind", &self.kind).finish_non_exhaustive()
    }
}

impl ConfigOption {
    /// Sets the option on `config` (a `shared_*` option creates the shared-tier configuration, with an
    /// empty root that `validate` refuses until `shared_root` is set). A value of the wrong kind, or a
    /// choice not listed, is refused naming the option; ranges are left to `StoreConfig::validate`.
    pub fn apply(&self, config: &mut StoreConfig, value: OptionValue) -> Result<()> {
        if !self.kind.accepts(&value) {
            return Err(Error::config(self.name, format!("expected {}, got {value:?}", self.kind.expected())));
        }
        (self.set)(config, value);
        Ok(())
    }

    /// The option's value in `config`; `None` when not set (see `unset`). Shared-tier options read
    /// `SharedConfig::new`'s defaults while `config.shared` is `None`.
    pub fn value(&self, config: &StoreConfig) -> Option<OptionValue> {
        (self.get)(config)
    }

    /// The value rendered for the docs: `render` of the value, or `unset` when there is none.
    pub fn render(&self, config: &StoreConfig) -> String {
        match self.value(config) {
            Some(value) => value.render(self.kind),
            None => self.unset.to_string(),
        }
    }

    /// The configuration the defaults are read from: `StoreConfig::new` (object_bytes unset).
    pub fn default_config() -> StoreConfig {
        StoreConfig::new(PathBuf::new(), 0)
    }

    /// The default, typed (`None`: required or automatic, see `unset`).
    pub fn default_value(&self) -> Option<OptionValue> {
        self.value(&Self::default_config())
    }

    /// The default, rendered for the docs.
    pub fn default_text(&self) -> String {
        self.render(&Self::default_config())
    }
}

fn shared_mut(c: &mut StoreConfig) -> &mut SharedConfig {
    c.shared.get_or_insert_with(|| SharedConfig::new(PathBuf::new()))
}

fn shared_get<T>(c: &StoreConfig, f: impl Fn(&SharedConfig) -> T) -> T {
    match &c.shared {
        Some(shared) => f(shared),
        None => f(&SharedConfig::new(PathBuf::new())),
    }
}

fn bucket_mut(c: &mut StoreConfig) -> &mut BucketConfig {
    c.bucket.get_or_insert_with(|| BucketConfig::new(String::new()))
}

fn bucket_get<T>(c: &StoreConfig, f: impl Fn(&BucketConfig) -> T) -> T {
    match &c.bucket {
        Some(bucket) => f(bucket),
        None => f(&BucketConfig::new(String::new())),
    }
}

fn text(v: OptionValue) -> String {
    String::from_utf8_lossy(&v.bytes()).into_owned()
}

const NVME_WITHOUT_SPACE_CHOICES: &[&str] = &["refuse", "dram_only"];
const NVME_WITHOUT_SPACES: [NvmeWithoutSpace; 2] = [NvmeWithoutSpace::Refuse, NvmeWithoutSpace::DramOnly];

const IO_ENGINE_CHOICES: &[&str] = &["auto", "io_uring", "psync"];
const IO_ENGINES: [EngineChoice; 3] = [EngineChoice::Auto, EngineChoice::IoUring, EngineChoice::Psync];
const DIRECT_IO_CHOICES: &[&str] = &["auto", "on", "off"];
const DIRECT_IOS: [DirectIo; 3] = [DirectIo::Auto, DirectIo::On, DirectIo::Off];

const WRITE_ADMISSION_CHOICES: &[&str] = &["reuse", "all"];
const WRITE_ADMISSIONS: [WriteAdmission; 2] = [WriteAdmission::Reuse, WriteAdmission::All];
const REMOTE_WRITE_ADMISSION_CHOICES: &[&str] = &["same", "reuse", "all"];
const REMOTE_WRITE_ADMISSIONS: [Option<WriteAdmission>; 3] =
    [None, Some(WriteAdmission::Reuse), Some(WriteAdmission::All)];

fn remote_write_admission_value(a: Option<WriteAdmission>) -> Option<OptionValue> {
    let at = REMOTE_WRITE_ADMISSIONS.iter().position(|x| *x == a).unwrap_or(0);
    Some(OptionValue::Str(REMOTE_WRITE_ADMISSION_CHOICES[at].into()))
}

fn write_admission_value(a: WriteAdmission) -> Option<OptionValue> {
    let at = WRITE_ADMISSIONS.iter().position(|x| *x == a).unwrap_or(0);
    Some(OptionValue::Str(WRITE_ADMISSION_CHOICES[at].into()))
}

fn direct_io_value(d: DirectIo) -> OptionValue {
    OptionValue::Str(DIRECT_IO_CHOICES[DIRECT_IOS.iter().position(|x| *x == d).unwrap_or(0)].into())
}

fn int(v: u64) -> Option<OptionValue> {
    Some(OptionValue::Int(v))
}

/// Every option, in documentation order: the store's, then the shared tier's (Python-settable first).
pub static OPTIONS: &[ConfigOption] = &[
    ConfigOption {
        name: "object_bytes",
        field: "object_bytes",
        python: true,
        kind: OptionKind::Size,
        unset: "required",
        constraint: "1 B ..= 1 GiB",
        description: "Bytes of one block object; every put/get moves exactly this many bytes. For vLLM: layers x page bytes per block.",
        set: |c, v| c.object_bytes = v.int() as usize,
        get: |c| (c.object_bytes != 0).then_some(OptionValue::Int(c.object_bytes as u64)),
    },
    ConfigOption {
        name: "namespace",
        field: "namespace",
        python: true,
        kind: OptionKind::BytesOrStr,
        unset: "required",
        constraint: "non-empty bytes or str",
        description: "Description of what makes KV bytes compatible (model identity and weights fingerprint, dtype, layout, tokens per block, TP/PP size and rank). Hashed (sha256) into the directory name: another namespace sees no blocks.",
        set: |c, v| c.namespace = v.bytes(),
        get: |c| (!c.namespace.is_empty()).then(|| OptionValue::Bytes(c.namespace.clone())),
    },
    ConfigOption {
        name: "dram_bytes",
        field: "dram_bytes",
        python: true,
        kind: OptionKind::Size,
        unset: "",
        constraint: "<= MemAvailable (with every other store of the process)",
        description: "DRAM tier: one page-aligned arena of `max(dram_bytes / slot_bytes, staging_slots)` slots, `slot_bytes = 4096 + roundup(object_bytes, 4096)`. Populated at open; transparent huge pages requested.",
        set: |c, v| c.dram_bytes = v.int() as usize,
        get: |c| int(c.dram_bytes as u64),
    },
    ConfigOption {
        name: "staging_slots",
        field: "staging_slots",
        python: true,
        kind: OptionKind::Int,
        unset: "",
        constraint: ">= 2",
        description: "Minimum slot count, used for I/O staging when `dram_bytes` is small.",
        set: |c, v| c.staging_slots = v.int() as usize,
        get: |c| int(c.staging_slots as u64),
    },
    ConfigOption {
        name: "nvme_bytes",
        field: "nvme_bytes",
        python: true,
        kind: OptionKind::Size,
        unset: "",
        constraint: "0, or >= 2 regions per directory; <= free space",
        description: "NVMe tier capacity, split evenly over the directories; 0 disables the tier (DRAM only). Preallocated at first open.",
        set: |c, v| c.nvme_bytes = v.int(),
        get: |c| int(c.nvme_bytes),
    },
    ConfigOption {
        name: "nvme_without_space",
        field: "nvme_without_space",
        python: true,
        kind: OptionKind::Choice(NVME_WITHOUT_SPACE_CHOICES),
        unset: "refuse (dram_only in the host service and vLLM's engines)",
        constraint: "",
        description: "When the NVMe device file is still to be created and its filesystem has no room for it: refuse fails the open; dram_only opens without the NVMe tier (a warning, the gauge nvme_off_no_space) and tries again at the next open.",
        set: |c, v| c.nvme_without_space = NVME_WITHOUT_SPACES[v.choice(NVME_WITHOUT_SPACE_CHOICES)],
        get: |c| {
            let at = NVME_WITHOUT_SPACES.iter().position(|x| *x == c.nvme_without_space).unwrap_or(0);
            Some(OptionValue::Str(NVME_WITHOUT_SPACE_CHOICES[at].into()))
        },
    },
    ConfigOption {
        name: "region_bytes",
        field: "region_bytes",
        python: true,
        kind: OptionKind::Size,
        unset: "0: max(64 MiB, 8 slots + trailer)",
        constraint: "multiple of 4096, holds >= 1 slot + trailer; <= 2^20 regions per directory",
        description: "Unit of sequential writing and of eviction (whole regions, oldest first).",
        set: |c, v| c.region_bytes = v.int(),
        get: |c| (c.region_bytes != 0).then_some(OptionValue::Int(c.region_bytes)),
    },
    ConfigOption {
        name: "io_engine",
        field: "io_engine",
        python: true,
        kind: OptionKind::Choice(IO_ENGINE_CHOICES),
        unset: "",
        constraint: "",
        description: "`auto` runs an io_uring self-test at open and falls back to the pread/pwrite pool with a log line; `io_uring` fails at open if the self-test fails.",
        set: |c, v| c.io_engine = IO_ENGINES[v.choice(IO_ENGINE_CHOICES)],
        get: |c| {
            let i = IO_ENGINES.iter().position(|e| *e == c.io_engine).unwrap_or(0);
            Some(OptionValue::Str(IO_ENGINE_CHOICES[i].into()))
        },
    },
    ConfigOption {
        name: "io_depth",
        field: "io_depth",
        python: true,
        kind: OptionKind::Int,
        unset: "",
        constraint: "1 ..= 4096",
        description: "Operations in flight per device.",
        set: |c, v| c.io_depth = v.int() as usize,
        get: |c| int(c.io_depth as u64),
    },
    ConfigOption {
        name: "direct_io",
        field: "direct_io",
        python: true,
        kind: OptionKind::Choice(DIRECT_IO_CHOICES),
        unset: "",
        constraint: "",
        description: "O_DIRECT when supported (auto falls back to buffered I/O with a log line; on fails at open).",
        set: |c, v| c.direct_io = DIRECT_IOS[v.choice(DIRECT_IO_CHOICES)],
        get: |c| Some(direct_io_value(c.direct_io)),
    },
    ConfigOption {
        name: "max_write_inflight_bytes",
        field: "max_write_inflight_bytes",
        python: true,
        kind: OptionKind::Size,
        unset: "",
        constraint: "> 0",
        description: "Writes in flight per device; reads are always submitted first, so a burst of stores delays a load by at most this much I/O.",
        set: |c, v| c.max_write_inflight_bytes = v.int() as usize,
        get: |c| int(c.max_write_inflight_bytes as u64),
    },
    ConfigOption {
        name: "max_dirty_bytes",
        field: "max_dirty_bytes",
        python: true,
        kind: OptionKind::Size,
        unset: "0: half the DRAM pool",
        constraint: "0, or >= one slot",
        description: "Bytes accepted but not yet written to NVMe; past it a store waits (up to `slot_wait_ms`) for writes to finish.",
        set: |c, v| c.max_dirty_bytes = v.int() as usize,
        get: |c| (c.max_dirty_bytes != 0).then_some(OptionValue::Int(c.max_dirty_bytes as u64)),
    },
    ConfigOption {
        name: "store_queue_jobs",
        field: "store_queue_jobs",
        python: true,
        kind: OptionKind::Int,
        unset: "",
        constraint: ">= 1",
        description: "Queued asynchronous store jobs; past it a store job is dropped at once and counted in `dropped_stores` (it is a cache; a load is never slowed).",
        set: |c, v| c.store_queue_jobs = v.int() as usize,
        get: |c| int(c.store_queue_jobs as u64),
    },
    ConfigOption {
        name: "load_threads",
        field: "load_threads",
        python: true,
        kind: OptionKind::Int,
        unset: "",
        constraint: "1 ..= 64",
        description: "Threads serving asynchronous load jobs. Stores have one thread of their own and yield to queued loads.",
        set: |c, v| c.load_threads = v.int() as usize,
        get: |c| int(c.load_threads as u64),
    },
    ConfigOption {
        name: "checksum_threads",
        field: "checksum_threads",
        python: true,
        kind: OptionKind::Int,
        unset: "0: the cores, at most 8",
        constraint: "0 ..= 64",
        description: "Threads that checksum one commit of 32 MiB or more of blocks an engine's rank copied into the pool itself (GPU stores). A core checksums about 4-12 GB/s; a GPU copies 30-55 GB/s, so the commit bounds a GPU store: raise it where cores are spare.",
        set: |c, v| c.checksum_threads = v.int() as usize,
        get: |c| (c.checksum_threads != 0).then_some(OptionValue::Int(c.checksum_threads as u64)),
    },
    ConfigOption {
        name: "slot_wait_ms",
        field: "slot_wait_ms",
        python: true,
        kind: OptionKind::Int,
        unset: "",
        constraint: "milliseconds",
        description: "How long a store or load waits for a free DRAM slot before it gives up (store dropped / block missed, both counted).",
        set: |c, v| c.slot_wait_ms = v.int(),
        get: |c| int(c.slot_wait_ms),
    },
    ConfigOption {
        name: "remote_read_stall_ms",
        field: "remote_read_stall_ms",
        python: true,
        kind: OptionKind::Int,
        unset: "",
        constraint: "milliseconds; 0 = no limit",
        description: "A load gives up the reads from the shared-filesystem and object tiers it still waits for once none of them has finished for this long (or for 4x the tier's recent read time, at most 30 s, when that is longer: a slow link is not a dead one): their blocks are misses the engine recomputes, counted in `remote_reads_given_up` and as failures of the tier (docs/reliability.md, \"Sick tiers\").",
        set: |c, v| c.remote_read_stall_ms = v.int(),
        get: |c| int(c.remote_read_stall_ms),
    },
    ConfigOption {
        name: "nvme_read_stall_ms",
        field: "nvme_read_stall_ms",
        python: true,
        kind: OptionKind::Int,
        unset: "",
        constraint: "milliseconds; 0 = no limit",
        description: "A load gives up the NVMe reads it still waits for once none of them has finished for this long (a hung disk: a local drive's reads finish in milliseconds): their blocks are misses the engine recomputes, counted in `nvme_reads_given_up`, and the NVMe tier steps aside until one of those reads finishes (docs/reliability.md, \"The NVMe tier\"). A read straight into the caller's memory (`Store.get` with O_DIRECT-capable buffers, not the host service's loads) is never given up: the disk could still write into it.",
        set: |c, v| c.nvme_read_stall_ms = v.int(),
        get: |c| int(c.nvme_read_stall_ms),
    },
    ConfigOption {
        name: "loads_cancel_queued_writes",
        field: "loads_cancel_queued_writes",
        python: true,
        kind: OptionKind::Bool,
        unset: "",
        constraint: "bool",
        description: "Loads first: a load short of DRAM slots takes the slot of a stored block whose NVMe write has not started yet (that store is dropped, counted in `cancelled_writes`) instead of waiting for the write backlog to drain.",
        set: |c, v| c.loads_cancel_queued_writes = v.bool(),
        get: |c| Some(OptionValue::Bool(c.loads_cancel_queued_writes)),
    },
    ConfigOption {
        name: "write_admission",
        field: "write_admission",
        python: true,
        kind: OptionKind::Choice(WRITE_ADMISSION_CHOICES),
        unset: "",
        constraint: "",
        description: "Which stored blocks are written below DRAM (NVMe; the shared filesystem and the bucket too unless `remote_write_admission` says otherwise). `reuse`: a block goes down once there is evidence it is used again (stored a second time, or pinned or loaded while in DRAM, by any engine of the host, or its request said it comes back: `kv_transfer_params: {\"kvtier\": {\"retain\": true}}`, or a token count for the prompt's first tokens, docs/vllm.md); one that leaves DRAM unused is dropped, never written (`dropped_without_evidence`). `all`: every block, at once (restart persistence of everything, the most writes). DRAM takes every block either way.",
        set: |c, v| c.write_admission = WRITE_ADMISSIONS[v.choice(WRITE_ADMISSION_CHOICES)],
        get: |c| write_admission_value(c.write_admission),
    },
    ConfigOption {
        name: "remote_write_admission",
        field: "remote_write_admission",
        python: true,
        kind: OptionKind::Choice(REMOTE_WRITE_ADMISSION_CHOICES),
        unset: "",
        constraint: "",
        description: "`write_admission` of the shared-filesystem and object tiers: `same` (as `write_admission`), `reuse` or `all`. For example `write_admission: \"reuse\"` with `remote_write_admission: \"all\"` spares the local drive and still publishes every block for the other hosts.",
        set: |c, v| c.remote_write_admission = REMOTE_WRITE_ADMISSIONS[v.choice(REMOTE_WRITE_ADMISSION_CHOICES)],
        get: |c| remote_write_admission_value(c.remote_write_admission),
    },
    ConfigOption {
        name: "write_admission_memory_blocks",
        field: "write_admission_memory_blocks",
        python: true,
        kind: OptionKind::Int,
        unset: "",
        constraint: ">= 1",
        description: "Blocks stored once that `reuse` remembers (8 bytes each; a newer block may replace an older one's entry).",
        set: |c, v| c.write_admission_memory_blocks = v.int() as usize,
        get: |c| int(c.write_admission_memory_blocks as u64),
    },
    ConfigOption {
        name: "write_budget_nvme_dwpd",
        field: "write_budget_nvme_dwpd",
        python: true,
        kind: OptionKind::Float,
        unset: "",
        constraint: "0 ..= 1000",
        description: "The NVMe tier's write budget, in drive writes per day of the filesystems holding the directories (their whole size, each filesystem once however many directories it holds; one whose size cannot be read counts nothing, and a warning says the budget is then unbounded); 0 = unbounded. A write past the budget is refused, never waited for: the block stays in DRAM only (`nvme_write_budget_refusals`). The models of one host service take from one budget, which a restart resumes (docs/format.md, the write budget file). Under `write_admission: \"all\"` the budget's last half is kept for blocks with evidence of reuse: a block without it that the budget refuses waits in DRAM for a use, as under `reuse`.",
        set: |c, v| c.write_budget_nvme_dwpd = v.float(),
        get: |c| Some(OptionValue::Float(c.write_budget_nvme_dwpd)),
    },
    ConfigOption {
        name: "write_budget_nvme_bytes_per_day",
        field: "write_budget_nvme_bytes_per_day",
        python: true,
        kind: OptionKind::Size,
        unset: "0: from `write_budget_nvme_dwpd`",
        constraint: "bytes per day",
        description: "The NVMe tier's write budget in bytes per day; overrides `write_budget_nvme_dwpd`.",
        set: |c, v| c.write_budget_nvme_bytes_per_day = v.int(),
        get: |c| (c.write_budget_nvme_bytes_per_day != 0).then_some(OptionValue::Int(c.write_budget_nvme_bytes_per_day)),
    },
    ConfigOption {
        name: "tenant_dram_share",
        field: "tenant_dram_share",
        python: true,
        kind: OptionKind::Float,
        unset: "0: the pool is not split",
        constraint: "0 ..= 1",
        description: "The share of the DRAM pool guaranteed to each tenant (a request's `cache_salt`; no salt: the default tenant) not named in `tenant_dram_shares`. A tenant past its share evicts its own blocks first; one under it loses none to others while another tenant is past its share (docs/tenants.md).",
        set: |c, v| c.tenant_dram_share = v.float(),
        get: |c| (c.tenant_dram_share != 0.0).then_some(OptionValue::Float(c.tenant_dram_share)),
    },
    ConfigOption {
        name: "tenant_dram_max_share",
        field: "tenant_dram_max_share",
        python: true,
        kind: OptionKind::Float,
        unset: "0: no cap",
        constraint: "0 ..= 1, at least every guaranteed share",
        description: "The most of the DRAM pool one tenant holds: a tenant at its cap evicts its own blocks for new ones, even while slots are free (when none of its blocks may go, it takes room as any other: stores never wait on a cap). Splits the pool by tenant as `tenant_dram_share` does (docs/tenants.md).",
        set: |c, v| c.tenant_dram_max_share = v.float(),
        get: |c| (c.tenant_dram_max_share != 0.0).then_some(OptionValue::Float(c.tenant_dram_max_share)),
    },
    ConfigOption {
        name: "tenant_shares_nvme",
        field: "tenant_shares_nvme",
        python: true,
        kind: OptionKind::Bool,
        unset: "",
        constraint: "bool",
        description: "Whether the tenant shares and cap of the DRAM pool (`tenant_dram_share`, `tenant_dram_shares`, `tenant_dram_max_share`) split the NVMe tier too, as fractions of each device's regions: a tenant's blocks go to regions of its own, and a tenant past its share or at its cap rewrites its own oldest regions first. false: one first-in first-out log for every tenant (docs/tenants.md).",
        set: |c, v| c.tenant_shares_nvme = v.bool(),
        get: |c| Some(OptionValue::Bool(c.tenant_shares_nvme)),
    },
    ConfigOption {
        name: "tenant_shares_shared_fs",
        field: "tenant_shares_shared_fs",
        python: true,
        kind: OptionKind::Bool,
        unset: "",
        constraint: "bool",
        description: "Whether the tenant shares and cap of the DRAM pool (`tenant_dram_share`, `tenant_dram_shares`, `tenant_dram_max_share`) split the shared-filesystem tier too, as fractions of `shared_low_watermark` of its capacity: each tenant's blocks go to data files of its own, and above the high watermark the evictor takes files from the tenants past their shares first; a tenant past its cap loses its least recently used files even below the watermark. false: one least-recently-used order for every tenant (docs/tenants.md).",
        set: |c, v| c.tenant_shares_shared_fs = v.bool(),
        get: |c| Some(OptionValue::Bool(c.tenant_shares_shared_fs)),
    },
    ConfigOption {
        name: "tenant_shares_bucket",
        field: "tenant_shares_bucket",
        python: true,
        kind: OptionKind::Bool,
        unset: "",
        constraint: "bool",
        description: "Whether the tenant shares and cap of the DRAM pool (`tenant_dram_share`, `tenant_dram_shares`, `tenant_dram_max_share`) split the object tier too, as fractions of 0.9 of `bucket_budget_bytes`: each tenant's blocks go to segments of its own, and over the budget the evictor deletes the segments of the tenants past their shares first; a tenant past its cap loses its least recently used segments under the budget too. Only with a budget. false: one least-recently-used order for every tenant (docs/tenants.md).",
        set: |c, v| c.tenant_shares_bucket = v.bool(),
        get: |c| Some(OptionValue::Bool(c.tenant_shares_bucket)),
    },
    ConfigOption {
        name: "tenant_dram_shares",
        field: "tenant_dram_shares",
        python: true,
        kind: OptionKind::BytesOrStr,
        unset: "none",
        constraint: "salt=share pairs, comma-separated, adding up to at most 1",
        description: "Shares of the DRAM pool for named tenants, by their `cache_salt`: for example `\"team-a=0.5,team-b=0.25\"` (docs/tenants.md).",
        set: |c, v| c.tenant_dram_shares = v.bytes(),
        get: |c| (!c.tenant_dram_shares.is_empty()).then(|| OptionValue::Bytes(c.tenant_dram_shares.clone())),
    },
    ConfigOption {
        name: "write_budget_shared_bytes_per_day",
        field: "write_budget_shared_bytes_per_day",
        python: true,
        kind: OptionKind::Size,
        unset: "0: unbounded",
        constraint: "bytes per day",
        description: "The shared-filesystem tier's write budget, the host's (every model of a host service takes from it; a restart resumes it); an offer past it is not published (`remote_write_budget_refusals`).",
        set: |c, v| c.write_budget_shared_bytes_per_day = v.int(),
        get: |c| (c.write_budget_shared_bytes_per_day != 0).then_some(OptionValue::Int(c.write_budget_shared_bytes_per_day)),
    },
    ConfigOption {
        name: "write_budget_bucket_bytes_per_day",
        field: "write_budget_bucket_bytes_per_day",
        python: true,
        kind: OptionKind::Size,
        unset: "0: unbounded",
        constraint: "bytes per day",
        description: "The object tier's write budget (bytes of blocks per day, and so PUTs), the host's (every model of a host service takes from it; a restart resumes it); an offer past it is not published (`remote_write_budget_refusals`).",
        set: |c, v| c.write_budget_bucket_bytes_per_day = v.int(),
        get: |c| (c.write_budget_bucket_bytes_per_day != 0).then_some(OptionValue::Int(c.write_budget_bucket_bytes_per_day)),
    },
    ConfigOption {
        name: "write_budget_burst_s",
        field: "write_budget_burst_s",
        python: true,
        kind: OptionKind::Int,
        unset: "",
        constraint: "1 ..= 86400",
        description: "Seconds of its rate a write budget may spend at once: over any span of t seconds a tier takes at most (t + burst) x its rate. The default, a day, lets a day's budget go in one burst (a restart that refills a cold cache) and holds the daily rate over days.",
        set: |c, v| c.write_budget_burst_s = v.int(),
        get: |c| int(c.write_budget_burst_s),
    },
    ConfigOption {
        name: "encryption_key_file",
        field: "encryption_key_file",
        python: true,
        kind: OptionKind::Path,
        unset: "none (`KVTIER_ENCRYPTION_KEY_FILE` if set, else values in clear)",
        constraint: "a file of >= 32 bytes, mode 0600 (no group/other bits)",
        description: "Encryption at rest below DRAM: every value written to NVMe, the shared filesystem and the bucket is encrypted with AES-256-GCM under a key derived from this file (docs/format.md, \"Encrypted values\"); a value that does not decrypt under it is a miss (`nvme_auth_failures`, `remote_decrypt_failures`). Values in clear written before are still read. Give every host that shares a remote tier the same file. The DRAM pool stays in clear (process memory).",
        set: |c, v| c.encryption_key_file = Some(v.path()),
        get: |c| c.encryption_key_file.clone().map(OptionValue::Path),
    },
    // Shared-filesystem tier (docs/shared-tier.md): any shared_* option needs shared_root too.
    ConfigOption {
        name: "shared_root",
        field: "shared.root",
        python: true,
        kind: OptionKind::Path,
        unset: "none (tier off)",
        constraint: "a directory on a POSIX filesystem shared by the replicas; created if its parent exists",
        description: "Blocks are published there in grouped files and read by every store on the same root and namespace. Works with or without the NVMe tier.",
        set: |c, v| shared_mut(c).root = v.path(),
        get: |c| c.shared.as_ref().map(|s| OptionValue::Path(s.root.clone())),
    },
    ConfigOption {
        name: "shared_high_watermark",
        field: "shared.high_watermark",
        python: true,
        kind: OptionKind::Float,
        unset: "",
        constraint: "(0, 0.99]",
        description: "Fraction of the filesystem's physical usage above which the (single, lease-holding) evictor removes least recently used files.",
        set: |c, v| shared_mut(c).high_watermark = v.float(),
        get: |c| Some(OptionValue::Float(shared_get(c, |s| s.high_watermark))),
    },
    ConfigOption {
        name: "shared_low_watermark",
        field: "shared.low_watermark",
        python: true,
        kind: OptionKind::Float,
        unset: "",
        constraint: "(0, shared_high_watermark)",
        description: "Eviction stops here.",
        set: |c, v| shared_mut(c).low_watermark = v.float(),
        get: |c| Some(OptionValue::Float(shared_get(c, |s| s.low_watermark))),
    },
    ConfigOption {
        name: "shared_file_bytes",
        field: "shared.file_target_bytes",
        python: true,
        kind: OptionKind::Size,
        unset: "",
        constraint: ">= one slot + 8 KiB; <= 64 GiB",
        description: "Target size of one shared file (the unit of publishing and eviction).",
        set: |c, v| shared_mut(c).file_target_bytes = v.int(),
        get: |c| int(shared_get(c, |s| s.file_target_bytes)),
    },
    ConfigOption {
        name: "shared_staleness_ms",
        field: "shared.staleness_ms",
        python: true,
        kind: OptionKind::Int,
        unset: "",
        constraint: "10 ..= 600000",
        description: "Bound on how long a block published by another process or node takes to become visible (manifests are re-read every `shared_staleness_ms / 2`).",
        set: |c, v| shared_mut(c).staleness_ms = v.int(),
        get: |c| int(shared_get(c, |s| s.staleness_ms)),
    },
    ConfigOption {
        name: "shared_fail_on_full",
        field: "shared.fail_on_full",
        python: true,
        kind: OptionKind::Bool,
        unset: "",
        constraint: "bool",
        description: "Refuse publishing above the high watermark (counted in `shared_publish_errors`) instead of evicting.",
        set: |c, v| shared_mut(c).fail_on_full = v.bool(),
        get: |c| Some(OptionValue::Bool(shared_get(c, |s| s.fail_on_full))),
    },
    ConfigOption {
        name: "shared_publish_queue_bytes",
        field: "shared.publish_queue_bytes",
        python: true,
        kind: OptionKind::Size,
        unset: "",
        constraint: ">= one slot",
        description: "Copies of accepted blocks waiting for the publisher thread. A store never waits for room: past it the block's key waits in a backlog and is copied again from DRAM when there is room (`shared_deferred_publishes`); only a block that left DRAM first is not published (`shared_dropped_publishes`).",
        set: |c, v| shared_mut(c).publish_queue_bytes = v.int() as usize,
        get: |c| int(shared_get(c, |s| s.publish_queue_bytes) as u64),
    },
    ConfigOption {
        name: "shared_key_file",
        field: "shared.key_file",
        python: true,
        kind: OptionKind::Path,
        unset: "none (`KVTIER_SHARED_KEY_FILE` if set, else no MAC)",
        constraint: "a file of >= 32 bytes, mode 0600 (no group/other bits), not under shared_root",
        description: "Deployment key: every shared block and manifest record carries a keyed BLAKE3 tag and anything without a valid one is a miss (`shared_auth_failures`), its file quarantined. Without it the tier trusts everyone who can write shared_root.",
        set: |c, v| shared_mut(c).key_file = Some(v.path()),
        get: |c| shared_get(c, |s| s.key_file.clone()).map(OptionValue::Path),
    },
    ConfigOption {
        name: "shared_capacity_bytes",
        field: "shared.capacity_bytes",
        python: true,
        kind: OptionKind::Size,
        unset: "none (statvfs)",
        constraint: "> 0, or none",
        description: "A quota on the filesystem: the tier's capacity is this many bytes and its usage the allocated bytes (st_blocks) of the files under the namespace directory, instead of statvfs of the whole filesystem (the watermarks, and the tenants' shares with `tenant_shares_shared_fs`, apply to it).",
        set: |c, v| shared_mut(c).capacity_bytes = Some(v.int()),
        get: |c| shared_get(c, |s| s.capacity_bytes).map(OptionValue::Int),
    },
    ConfigOption {
        name: "shared_grace_ms",
        field: "shared.grace_ms",
        python: true,
        kind: OptionKind::Int,
        unset: "",
        constraint: ">= 2 x shared_staleness_ms",
        description: "Delay between dooming a file and unlinking it; a file read or published within it is not chosen for eviction.",
        set: |c, v| shared_mut(c).grace_ms = v.int(),
        get: |c| int(shared_get(c, |s| s.grace_ms)),
    },
    ConfigOption {
        name: "shared_publish_delay_ms",
        field: "shared.publish_delay_ms",
        python: true,
        kind: OptionKind::Int,
        unset: "",
        constraint: "milliseconds",
        description: "A partly filled file is published at the latest this long after its first block.",
        set: |c, v| shared_mut(c).publish_delay_ms = v.int(),
        get: |c| int(shared_get(c, |s| s.publish_delay_ms)),
    },
    // Object-storage tier (docs/object-tier.md): any bucket_* option needs bucket_url too.
    ConfigOption {
        name: "bucket_url",
        field: "bucket.url",
        python: true,
        kind: OptionKind::BytesOrStr,
        unset: "none (tier off)",
        constraint: "`s3://bucket` or `s3://bucket/prefix`; the bucket must exist",
        description: "Object-storage tier: blocks are published to segment objects under the prefix and read with ranged GETs by every store on the same bucket, prefix and namespace (docs/object-tier.md). Credentials come from the environment and the credential chain (`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`, web identity, ECS, instance metadata; no profile files), never from options.",
        set: |c, v| bucket_mut(c).url = text(v),
        get: |c| c.bucket.as_ref().map(|b| OptionValue::Bytes(b.url.clone().into_bytes())),
    },
    ConfigOption {
        name: "bucket_endpoint",
        field: "bucket.endpoint",
        python: true,
        kind: OptionKind::BytesOrStr,
        unset: "none (AWS, or `AWS_ENDPOINT_URL`)",
        constraint: "`http://host:port` or `https://host:port` of an S3-compatible server",
        description: "S3 endpoint for servers other than AWS (Ceph RGW, MinIO, ...); plain http is allowed only when given here.",
        set: |c, v| bucket_mut(c).endpoint = Some(text(v)),
        get: |c| bucket_get(c, |b| b.endpoint.clone()).map(|e| OptionValue::Bytes(e.into_bytes())),
    },
    ConfigOption {
        name: "bucket_segment_bytes",
        field: "bucket.segment_bytes",
        python: true,
        kind: OptionKind::Size,
        unset: "0: whole blocks to 32 MiB, at least 4",
        constraint: "one block + 4 KiB ..= 5 GiB",
        description: "Target size of one segment object (the unit of publishing, listing and eviction): it holds the whole number of blocks nearest to this (a block takes its value + 4 KiB, a segment 4 KiB more).",
        set: |c, v| bucket_mut(c).segment_bytes = v.int(),
        get: |c| bucket_get(c, |b| (b.segment_bytes != 0).then_some(OptionValue::Int(b.segment_bytes))),
    },
    ConfigOption {
        name: "bucket_budget_bytes",
        field: "bucket.budget_bytes",
        python: true,
        kind: OptionKind::Size,
        unset: "",
        constraint: "0 (no budget) or >= 2 segments",
        description: "Byte budget of the namespace's segments under the prefix: past it, the least recently used segments (last written or read by any store with a budget) are deleted down to 90% (`bucket_evicted_segments`); the holder also keeps the objects of `quarantine/` within a tenth of it, on top. 0 leaves capacity to the bucket (e.g. an expiry lifecycle rule, which should cover the whole prefix) and writes no access objects.",
        set: |c, v| bucket_mut(c).budget_bytes = v.int(),
        get: |c| int(bucket_get(c, |b| b.budget_bytes)),
    },
    ConfigOption {
        name: "bucket_refresh_ms",
        field: "bucket.refresh_ms",
        python: true,
        kind: OptionKind::Int,
        unset: "",
        constraint: "10 ..= 600000",
        description: "Period of the bucket listing that feeds the in-memory index and the budget: bound on how long another store's segment takes to become visible.",
        set: |c, v| bucket_mut(c).refresh_ms = v.int(),
        get: |c| int(bucket_get(c, |b| b.refresh_ms)),
    },
    ConfigOption {
        name: "bucket_publish_delay_ms",
        field: "bucket.publish_delay_ms",
        python: true,
        kind: OptionKind::Int,
        unset: "",
        constraint: "milliseconds",
        description: "A partly filled segment is published at the latest this long after its first block (checked every `bucket_refresh_ms`).",
        set: |c, v| bucket_mut(c).publish_delay_ms = v.int(),
        get: |c| int(bucket_get(c, |b| b.publish_delay_ms)),
    },
    ConfigOption {
        name: "bucket_publish_queue_bytes",
        field: "bucket.publish_queue_bytes",
        python: true,
        kind: OptionKind::Size,
        unset: "",
        constraint: ">= one slot",
        description: "Copies of accepted blocks waiting for the publisher; past it keys wait in a backlog (`bucket_deferred_publishes`) and only a block that left DRAM first is not published (`bucket_dropped_publishes`).",
        set: |c, v| bucket_mut(c).publish_queue_bytes = v.int() as usize,
        get: |c| int(bucket_get(c, |b| b.publish_queue_bytes) as u64),
    },
    ConfigOption {
        name: "bucket_reads_in_flight",
        field: "bucket.reads_in_flight",
        python: true,
        kind: OptionKind::Int,
        unset: "",
        constraint: "1 ..= 1024",
        description: "Ranged GETs in flight per store.",
        set: |c, v| bucket_mut(c).reads_in_flight = v.int() as usize,
        get: |c| int(bucket_get(c, |b| b.reads_in_flight) as u64),
    },
    ConfigOption {
        name: "bucket_get_max_bytes",
        field: "bucket.get_max_bytes",
        python: true,
        kind: OptionKind::Size,
        unset: "0: 4 blocks, or 8 MiB of smaller ones",
        constraint: "<= 5 GiB; at least one block is read",
        description: "A load's adjacent blocks of one segment are read with one ranged GET of up to this many bytes (each block still verified alone).",
        set: |c, v| bucket_mut(c).get_max_bytes = v.int(),
        get: |c| bucket_get(c, |b| (b.get_max_bytes != 0).then_some(OptionValue::Int(b.get_max_bytes))),
    },
    ConfigOption {
        name: "bucket_request_timeout_ms",
        field: "bucket.request_timeout_ms",
        python: true,
        kind: OptionKind::Int,
        unset: "",
        constraint: "100 ..= 600000",
        description: "A load's ranged GET whose response, or next bytes, take longer is a miss (all of it at most 6 times this: a slow link that delivers is not cut short); any other request that takes longer fails (a PUT: a failed publish). Bounds a load when the server is gone.",
        set: |c, v| bucket_mut(c).request_timeout_ms = v.int(),
        get: |c| int(bucket_get(c, |b| b.request_timeout_ms)),
    },
    ConfigOption {
        name: "bucket_lease_ms",
        field: "bucket.lease_ms",
        python: true,
        kind: OptionKind::Int,
        unset: "",
        constraint: ">= 100 and >= 2 x bucket_refresh_ms",
        description: "Term of the evictor lease: of the stores with a budget on one prefix only the holder evicts; one that stops renewing loses it after this.",
        set: |c, v| bucket_mut(c).lease_ms = v.int(),
        get: |c| int(bucket_get(c, |b| b.lease_ms)),
    },
    ConfigOption {
        name: "bucket_key_file",
        field: "bucket.key_file",
        python: true,
        kind: OptionKind::Path,
        unset: "none (`KVTIER_SHARED_KEY_FILE` if set, else no MAC)",
        constraint: "as `shared_key_file`",
        description: "Deployment key: every block and index object carries a keyed BLAKE3 tag and anything without a valid one is a miss (`bucket_auth_failures`).",
        set: |c, v| bucket_mut(c).key_file = Some(v.path()),
        get: |c| bucket_get(c, |b| b.key_file.clone()).map(OptionValue::Path),
    },
    // Rust only (`StoreConfig::shared`); from Python these keep their defaults.
    ConfigOption {
        name: "shared_lease_ms",
        field: "shared.lease_ms",
        python: false,
        kind: OptionKind::Int,
        unset: "",
        constraint: ">= 100 and >= 2 x the maintenance period",
        description: "Expiry of the evictor lease; a holder that stops renewing loses it after this.",
        set: |c, v| shared_mut(c).lease_ms = v.int(),
        get: |c| int(shared_get(c, |s| s.lease_ms)),
    },
    ConfigOption {
        name: "shared_group_shared",
        field: "shared.group_shared",
        python: false,
        kind: OptionKind::Bool,
        unset: "",
        constraint: "bool",
        description: "Files 0o640 and directories 0o750 (a group of service accounts shares the root) instead of 0o600 / 0o700.",
        set: |c, v| shared_mut(c).group_shared = v.bool(),
        get: |c| Some(OptionValue::Bool(shared_get(c, |s| s.group_shared))),
    },
    ConfigOption {
        name: "shared_orphan_tmp_ms",
        field: "shared.orphan_tmp_ms",
        python: false,
        kind: OptionKind::Int,
        unset: "",
        constraint: ">= shared_grace_ms",
        description: "Temporaries idle this long belong to dead writers and are removed; unlisted data files this old are evicted.",
        set: |c, v| shared_mut(c).orphan_tmp_ms = v.int(),
        get: |c| int(shared_get(c, |s| s.orphan_tmp_ms)),
    },
    ConfigOption {
        name: "shared_direct_io",
        field: "shared.direct_io",
        python: false,
        kind: OptionKind::Choice(DIRECT_IO_CHOICES),
        unset: "",
        constraint: "",
        description: "O_DIRECT for the shared data files: auto probes at start-up and falls back to buffered I/O (logged once).",
        set: |c, v| shared_mut(c).direct_io = DIRECT_IOS[v.choice(DIRECT_IO_CHOICES)],
        get: |c| Some(direct_io_value(shared_get(c, |s| s.direct_io))),
    },
];

/// The option called `name` (Python-settable or not).
pub fn find_option(name: &str) -> Option<&'static ConfigOption> {
    OPTIONS.iter().find(|o| o.name == name)
}

/// Python-settable options whose names are close to `name` (a likely misspelling), closest first.
pub fn close_options(name: &str) -> Vec<&'static str> {
    let mut close: Vec<(usize, &'static str)> = OPTIONS
        .iter()
        .filter(|o| o.python)
        .map(|o| (edit_distance(name, o.name), o.name))
        .filter(|&(d, candidate)| d <= (candidate.len() / 4).max(2) || candidate.contains(name) && name.len() >= 4)
        .collect();
    close.sort();
    close.into_iter().map(|(_, n)| n).collect()
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut previous = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitute = previous + usize::from(ca != *cb);
            previous = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(previous + 1);
        }
    }
    row[b.len()]
}

impl StoreConfig {
    /// Sets the option called `name` (see [`OPTIONS`]; Rust-only options included). An unknown name
    /// is refused with the close names ([`unknown_option_message`]).
    pub fn set_option(&mut self, name: &str, value: OptionValue) -> Result<()> {
        match find_option(name) {
            Some(option) => option.apply(self, value),
            None => Err(Error::config("(unknown)", format!("`{name}`: {}", unknown_option_message(name)))),
        }
    }
}

/// Why `name` is refused: "unknown option; did you mean ...?" with the close Python option names, or
/// the list of all of them when none is close.
pub fn unknown_option_message(name: &str) -> String {
    let close = close_options(name);
    let hint = if close.is_empty() {
        let all: Vec<&str> = OPTIONS.iter().filter(|o| o.python).map(|o| o.name).collect();
        format!("the options are {}", all.join(", "))
    } else {
        format!("did you mean {}?", close.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(" or "))
    };
    format!("unknown option; {hint} (see docs/configuration.md or kvtier.options())")
}
