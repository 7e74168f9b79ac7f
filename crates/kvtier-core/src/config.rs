//! Store configuration: every option with its default and its constraints (mirrored in
//! `docs/configuration.md`). `validate` runs before anything touches the disk and names the option and
//! the fix in its error.

use crate::error::{Error, Result};
use crate::format::{round_up, ALIGN_BYTES};
use crate::io::faults::FaultPlan;
use crate::io::EngineChoice;
use std::path::PathBuf;
use std::sync::Arc;

/// Whether device files are opened with O_DIRECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectIo {
    /// O_DIRECT when the filesystem supports it, buffered I/O (logged) otherwise.
    Auto,
    /// O_DIRECT or fail at open.
    On,
    /// Buffered I/O through the page cache.
    Off,
}

/// Bounds the in-memory region table (and catches absurd capacities before anything is sized).
pub const MAX_REGIONS_PER_DEVICE: u64 = 1 << 20;

#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Local NVMe directories; several are striped (one device file and one I/O thread each).
    pub paths: Vec<PathBuf>,
    /// Description of the KV layout (model identity, dtype, layout, tokens per block, parallel layout);
    /// hashed to the namespace digest that names the store's subdirectory.
    pub namespace: Vec<u8>,
    /// Bytes per block object. Required. 1 ..= 1 GiB.
    pub object_bytes: usize,
    /// DRAM tier budget in bytes. Default 1 GiB.
    pub dram_bytes: usize,
    /// Minimum number of DRAM slots (I/O staging) whatever `dram_bytes` says. Default 8.
    pub staging_slots: usize,
    /// NVMe tier capacity in bytes, split evenly over `paths`; 0 disables the NVMe tier. Default 8 GiB.
    pub nvme_bytes: u64,
    /// Region size in bytes (unit of sequential writing and eviction); 0 picks
    /// max(64 MiB, 8 slots) rounded to 4 KiB. Must hold at least one slot plus its trailer.
    pub region_bytes: u64,
    /// I/O engine: auto (self-test io_uring, fall back to psync), io_uring, or psync.
    pub io_engine: EngineChoice,
    /// Operations in flight per device. Default 32. 1 ..= 4096.
    pub io_depth: usize,
    /// O_DIRECT policy. Default auto.
    pub direct_io: DirectIo,
    /// Bytes of writes in flight per device while reads may arrive. Default 8 MiB.
    pub max_write_inflight_bytes: usize,
    /// Bytes accepted into DRAM but not yet written to NVMe; past it stores skip NVMe (counted as
    /// dropped). 0 picks half of the DRAM pool.
    pub max_dirty_bytes: usize,
    /// Store jobs queued for the asynchronous API; past it a store job is dropped and counted. Default 64.
    pub store_queue_jobs: usize,
    /// Threads serving asynchronous load jobs. Default 2. Stores have one thread of their own.
    pub load_threads: usize,
    /// How long a store or a load waits for a free DRAM slot before giving up (drop or miss). Default 5000.
    pub slot_wait_ms: u64,
    /// Test seam: inject I/O faults. Never set in production.
    pub fault_plan: Option<Arc<FaultPlan>>,
    /// Shared-filesystem tier below (or instead of) NVMe; None disables it. Default None.
    /// See `docs/shared-tier.md` for its options.
    pub shared: Option<crate::tiers::shared::SharedConfig>,
}

impl StoreConfig {
    pub fn new(path: impl Into<PathBuf>, object_bytes: usize) -> Self {
        StoreConfig {
            paths: vec![path.into()],
            namespace: Vec::new(),
            object_bytes,
            dram_bytes: 1 << 30,
            staging_slots: 8,
            nvme_bytes: 8 << 30,
            region_bytes: 0,
            io_engine: EngineChoice::Auto,
            io_depth: 32,
            direct_io: DirectIo::Auto,
            max_write_inflight_bytes: 8 << 20,
            max_dirty_bytes: 0,
            store_queue_jobs: 64,
            load_threads: 2,
            slot_wait_ms: 5000,
            fault_plan: None,
            shared: None,
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

    pub fn validate(&self) -> Result<()> {
        if self.paths.is_empty() {
            return Err(Error::config("path", "no directory given; pass the local NVMe directory"));
        }
        for (i, p) in self.paths.iter().enumerate() {
            if p.as_os_str().is_empty() {
                return Err(Error::config("path", "empty path; pass a directory"));
            }
            if self.paths[..i].contains(p) {
                return Err(Error::config("path", format!("{} is listed twice; list each directory once", p.display())));
            }
        }
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
        if self.store_queue_jobs == 0 {
            return Err(Error::config("store_queue_jobs", "must be at least 1"));
        }
        if self.max_write_inflight_bytes == 0 {
            return Err(Error::config("max_write_inflight_bytes", "must be positive"));
        }
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
        if self.nvme_bytes > 0 {
            let region = self.effective_region_bytes();
            if region % ALIGN_BYTES as u64 != 0 {
                return Err(Error::config("region_bytes", "must be a multiple of 4096"));
            }
            if crate::tiers::nvme::Geometry::new(self.slot_bytes() as u64, region, 1).max_entries == 0 {
                return Err(Error::config(
                    "region_bytes",
                    format!("{region} cannot hold one slot of {} bytes plus its trailer; raise region_bytes", self.slot_bytes()),
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
        }
        if let Some(shared) = &self.shared {
            shared.validate(self.slot_bytes())?;
        }
        Ok(())
    }
}
