//! Options of the shared-filesystem tier: `SharedConfig::new` holds the defaults and `validate` the
//! constraints (naming the option and the fix). Names, kinds and descriptions are in the one option
//! table, `crate::config::OPTIONS` (the `shared_*` rows), from which `docs/shared-tier.md` and
//! `docs/configuration.md` are generated; field comments state no default values, so they cannot drift.

use crate::error::{Error, Result};
use crate::io::DirectIo;
use crate::tenant::TenantShares;
use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct SharedConfig {
    /// Root directory on the shared filesystem; one subdirectory per namespace. Required. Created
    /// if missing, but only when its parent exists (a missing parent usually means an unmounted volume).
    pub root: PathBuf,
    /// Eviction starts when the filesystem's used fraction exceeds this.
    pub high_watermark: f64,
    /// Eviction stops once the used fraction is at or below this. 0 < low < high <= 0.99.
    pub low_watermark: f64,
    /// Blocks are grouped into files of about this size (the unit of publishing and eviction).
    /// Must hold at least one block plus header and footer.
    pub file_target_bytes: u64,
    /// A block published by another process becomes visible here within this bound (the index is
    /// refreshed from the manifests every `staleness_ms / 2`). 10 ..= 600000.
    pub staleness_ms: u64,
    /// Expiry of the evictor lease; a holder that stops renewing loses it after this.
    pub lease_ms: u64,
    /// A file chosen for eviction is unlinked no sooner than this after it was chosen, and a file read
    /// within this is not chosen. At least 2 * staleness_ms.
    pub grace_ms: u64,
    /// Refuse to publish (counted in `shared_publish_errors`) above the high watermark instead of
    /// evicting.
    pub fail_on_full: bool,
    /// Files 0o640 and directories 0o750 (a group of service accounts shares the root) instead of
    /// 0o600 / 0o700.
    pub group_shared: bool,
    /// A quota on the filesystem: when set, usage is the physical size (st_blocks) of the files under the
    /// namespace directory and the capacity is this many bytes, instead of statvfs of the whole
    /// filesystem.
    pub capacity_bytes: Option<u64>,
    /// A file being filled is published at the latest this long after its first block, so a slow
    /// writer's blocks do not wait for a full file.
    pub publish_delay_ms: u64,
    /// Bytes of blocks queued for publishing (copies of DRAM slots). A store never waits for room:
    /// past it a block's key waits in the publisher's backlog and is copied again from DRAM later
    /// (see `publisher`).
    pub publish_queue_bytes: usize,
    /// Temporary files not written for this long belong to dead writers and are removed.
    pub orphan_tmp_ms: u64,
    /// O_DIRECT policy for data files (auto: probe at start-up, fall back to buffered I/O).
    pub direct_io: DirectIo,
    /// File holding the deployment key (at least 32 bytes, mode 0600, not on the shared root). When
    /// set (or, unset, when `KVTIER_SHARED_KEY_FILE` names one), every block and manifest record
    /// carries a keyed BLAKE3 tag and nothing untagged or tagged with another key is served.
    pub key_file: Option<PathBuf>,
    /// The tenants' shares of the tier (the DRAM pool's, `tenant_shares_shared_fs`), as fractions of
    /// `low_watermark` of the capacity; not enabled: the tier is not split (one file and one
    /// least-recently-used order for every tenant).
    pub tenant_shares: TenantShares,
}

impl SharedConfig {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        SharedConfig {
            root: root.into(),
            high_watermark: 0.90,
            low_watermark: 0.80,
            file_target_bytes: 256 << 20,
            staleness_ms: 1000,
            lease_ms: 10_000,
            grace_ms: 30_000,
            fail_on_full: false,
            group_shared: false,
            capacity_bytes: None,
            publish_delay_ms: 2000,
            publish_queue_bytes: 256 << 20,
            orphan_tmp_ms: 600_000,
            direct_io: DirectIo::Auto,
            key_file: None,
            tenant_shares: TenantShares::default(),
        }
    }

    /// Used fraction at which publishing stops even when eviction is on: halfway from the high
    /// watermark to full (0.95 with the defaults).
    pub fn hard_ceiling(&self) -> f64 {
        (self.high_watermark + 1.0) / 2.0
    }

    pub fn file_mode(&self) -> u32 {
        if self.group_shared {
            0o640
        } else {
            0o600
        }
    }

    pub fn dir_mode(&self) -> u32 {
        if self.group_shared {
            0o750
        } else {
            0o700
        }
    }

    /// Checks the options against each other and against the block size (`slot_bytes`).
    pub fn validate(&self, slot_bytes: usize) -> Result<()> {
        if self.root.as_os_str().is_empty() {
            return Err(Error::config("shared_root", "empty path; give the directory on the shared filesystem"));
        }
        self.validate_watermarks()?;
        self.validate_file_bytes(slot_bytes)?;
        self.validate_periods()?;
        if self.capacity_bytes == Some(0) {
            return Err(Error::config("shared_capacity_bytes", "must be positive (or unset to use statvfs)"));
        }
        if self.publish_queue_bytes < slot_bytes {
            return Err(Error::config(
                "shared_publish_queue_bytes",
                format!("{} cannot hold one block of {slot_bytes} bytes; raise it", self.publish_queue_bytes),
            ));
        }
        if self.key_file.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(Error::config("shared_key_file", "empty path; give the key file (or leave it unset)"));
        }
        if self.orphan_tmp_ms < self.grace_ms {
            return Err(Error::config("shared_orphan_tmp_ms", "must be at least shared_grace_ms"));
        }
        Ok(())
    }

    /// Both watermarks are fractions of the filesystem, the low one below the high one.
    fn validate_watermarks(&self) -> Result<()> {
        let fraction = |w: f64| w.is_finite() && w > 0.0 && w <= 0.99;
        if !fraction(self.high_watermark) {
            return Err(Error::config(
                "shared_high_watermark",
                format!(
                    "{} is out of range; give a fraction of the filesystem in (0, 0.99], e.g. 0.90",
                    self.high_watermark
                ),
            ));
        }
        if !fraction(self.low_watermark) || self.low_watermark >= self.high_watermark {
            return Err(Error::config(
                "shared_low_watermark",
                format!(
                    "{} must be a fraction below shared_high_watermark ({}); e.g. 0.80 with 0.90",
                    self.low_watermark, self.high_watermark
                ),
            ));
        }
        Ok(())
    }

    /// A data file holds at least one block (of `slot_bytes`) and at most 64 GiB.
    fn validate_file_bytes(&self, slot_bytes: usize) -> Result<()> {
        let minimum = (super::format::FILE_HEADER_BYTES + slot_bytes + super::format::footer_bytes(1)) as u64;
        if self.file_target_bytes < minimum {
            return Err(Error::config(
                "shared_file_bytes",
                format!(
                    "{} cannot hold one block of {slot_bytes} bytes; raise it to at least {minimum}",
                    self.file_target_bytes
                ),
            ));
        }
        if self.file_target_bytes > 64 << 30 {
            return Err(Error::config("shared_file_bytes", "at most 64 GiB; files are the unit of eviction"));
        }
        Ok(())
    }

    /// The staleness bound, and the lease and grace periods that must outlast it.
    fn validate_periods(&self) -> Result<()> {
        if !(10..=600_000).contains(&self.staleness_ms) {
            return Err(Error::config(
                "shared_staleness_ms",
                format!("{} is out of range 10 ..= 600000", self.staleness_ms),
            ));
        }
        if self.lease_ms < 2 * self.staleness_ms.min(1000) || self.lease_ms < 100 {
            return Err(Error::config(
                "shared_lease_ms",
                format!("{} is too short; give at least 100 and twice the maintenance period", self.lease_ms),
            ));
        }
        if self.grace_ms < 2 * self.staleness_ms {
            return Err(Error::config(
                "shared_grace_ms",
                format!(
                    "{} is shorter than 2 * shared_staleness_ms ({}): readers would not learn of an eviction before the \
                     file is unlinked; raise shared_grace_ms or lower shared_staleness_ms",
                    self.grace_ms, self.staleness_ms
                ),
            ));
        }
        Ok(())
    }
}
