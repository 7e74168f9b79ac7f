//! Options of the object-storage tier: `BucketConfig::new` holds the defaults and `validate` the
//! constraints (naming the option and the fix). Names and descriptions are in the option table,
//! `crate::config::OPTIONS` (the `bucket_*` rows), from which `docs/configuration.md` is generated.

use super::format::SEGMENT_HEADER_BYTES;
use crate::error::{Error, Result};
use crate::tenant::TenantShares;
use std::path::PathBuf;

/// `bucket_segment_bytes` unset (0): the fewest whole blocks that reach this many bytes ...
pub const AUTO_SEGMENT_BYTES: u64 = 32 << 20;
/// ... and never fewer blocks than this, so that large blocks still share a segment (two PUTs)
/// and a prefix's consecutive blocks still make one ranged GET.
pub const AUTO_SEGMENT_MIN_BLOCKS: u64 = 4;
/// `bucket_get_max_bytes` unset (0): a ranged GET reads this many adjacent blocks at most ...
pub const AUTO_GET_BLOCKS: u64 = 4;
/// ... or more of them when they fit in this many bytes (small blocks).
pub const AUTO_GET_BYTES: u64 = 8 << 20;
/// One S3 PUT.
pub const MAX_SEGMENT_BYTES: u64 = 5 << 30;

#[derive(Debug, Clone)]
pub struct BucketConfig {
    /// `s3://bucket` or `s3://bucket/prefix`. Required.
    pub url: String,
    /// S3 endpoint for S3-compatible servers (`http://host:port`); unset: AWS (or `AWS_ENDPOINT_URL`).
    pub endpoint: Option<String>,
    /// Blocks are grouped into segment objects of about this size (the unit of publishing and
    /// eviction), rounded to whole blocks (`segment_blocks`); 0: automatic.
    pub segment_bytes: u64,
    /// Byte budget of the namespace's segments under the prefix; 0: no budget (e.g. a lifecycle rule).
    pub budget_bytes: u64,
    /// Bound on how long another writer's segment takes to become visible (the bucket is listed every
    /// `refresh_ms`).
    pub refresh_ms: u64,
    /// A partly filled segment is published at the latest this long after its first block.
    pub publish_delay_ms: u64,
    /// Bytes of block copies queued for the publisher; past it keys wait in the backlog.
    pub publish_queue_bytes: usize,
    /// Ranged GETs in flight per store.
    pub reads_in_flight: usize,
    /// A ranged GET reads adjacent blocks of one segment up to this many bytes (at least one block;
    /// `blocks_per_get`); 0: automatic.
    pub get_max_bytes: u64,
    /// A request (one GET of a block, a PUT of a segment) that takes longer is a miss or an error.
    pub request_timeout_ms: u64,
    /// Term of the evictor lease (only stores with a budget take it); a holder that stops renewing
    /// loses it after this.
    pub lease_ms: u64,
    /// Deployment key file (as `shared_key_file`); unset: `KVTIER_SHARED_KEY_FILE` if set, else no MAC.
    pub key_file: Option<PathBuf>,
    /// The tenants' shares of the namespace's segments (the DRAM pool's, `tenant_shares_bucket`), as
    /// fractions of 0.9 of `budget_bytes` (where eviction stops); not enabled: the tier is not split.
    pub tenant_shares: TenantShares,
}

impl BucketConfig {
    pub fn new(url: impl Into<String>) -> Self {
        BucketConfig {
            url: url.into(),
            endpoint: None,
            segment_bytes: 0,
            budget_bytes: 0,
            refresh_ms: 1000,
            publish_delay_ms: 2000,
            publish_queue_bytes: 256 << 20,
            reads_in_flight: 32,
            get_max_bytes: 0,
            request_timeout_ms: 10_000,
            lease_ms: 10_000,
            key_file: None,
            tenant_shares: TenantShares::default(),
        }
    }

    /// The bucket and the prefix (without slashes at either end) of `url`.
    pub fn bucket_and_prefix(&self) -> Result<(String, String)> {
        let rest = self.url.strip_prefix("s3://").ok_or_else(|| {
            Error::config(
                "bucket_url",
                format!("{:?} is not an s3:// URL; give s3://bucket or s3://bucket/prefix", self.url),
            )
        })?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(Error::config("bucket_url", "no bucket name; give s3://bucket or s3://bucket/prefix"));
        }
        Ok((bucket.to_string(), prefix.trim_matches('/').to_string()))
    }

    /// Checks the options against each other and against the block size (`slot_bytes`).
    pub fn validate(&self, slot_bytes: usize) -> Result<()> {
        self.bucket_and_prefix()?;
        self.validate_segment(slot_bytes)?;
        let segment = self.segment_object_bytes(slot_bytes);
        if self.budget_bytes != 0 && self.budget_bytes < 2 * segment {
            return Err(Error::config(
                "bucket_budget_bytes",
                format!(
                    "{} is under two segments ({segment} bytes: {} blocks); raise it, lower bucket_segment_bytes \
                     or set 0 (no budget)",
                    self.budget_bytes,
                    self.segment_blocks(slot_bytes)
                ),
            ));
        }
        if !(10..=600_000).contains(&self.refresh_ms) {
            return Err(Error::config(
                "bucket_refresh_ms",
                format!("{} is out of range 10 ..= 600000", self.refresh_ms),
            ));
        }
        if self.publish_queue_bytes < slot_bytes {
            return Err(Error::config(
                "bucket_publish_queue_bytes",
                format!("{} cannot hold one block of {slot_bytes} bytes; raise it", self.publish_queue_bytes),
            ));
        }
        if !(1..=1024).contains(&self.reads_in_flight) {
            return Err(Error::config("bucket_reads_in_flight", "give 1 ..= 1024"));
        }
        if self.get_max_bytes > MAX_SEGMENT_BYTES {
            return Err(Error::config("bucket_get_max_bytes", "give at most 5 GiB, or 0 (automatic)"));
        }
        if self.lease_ms < 100 || self.lease_ms < 2 * self.refresh_ms {
            return Err(Error::config(
                "bucket_lease_ms",
                format!(
                    "{} is too short; give at least 100 and twice bucket_refresh_ms ({})",
                    self.lease_ms, self.refresh_ms
                ),
            ));
        }
        if !(100..=600_000).contains(&self.request_timeout_ms) {
            return Err(Error::config("bucket_request_timeout_ms", "give 100 ..= 600000"));
        }
        Ok(())
    }

    /// Blocks per segment object. Unset (0): the fewest whole blocks that reach 32 MiB, at least 4
    /// (2 MiB blocks: 16; 16 MiB blocks: 4). Set: the whole number of blocks nearest to the value,
    /// at least one, so that "two 16 MiB blocks" given as 32 MiB holds two (32 MiB + 12 KiB with the
    /// descriptor pages and the header), not one.
    pub fn segment_blocks(&self, slot_bytes: usize) -> u64 {
        let slot = slot_bytes as u64;
        assert!(slot > 0, "a slot holds at least its descriptor page");
        if self.segment_bytes == 0 {
            return AUTO_SEGMENT_BYTES.div_ceil(slot).max(AUTO_SEGMENT_MIN_BLOCKS);
        }
        let room = self.segment_bytes.saturating_sub(SEGMENT_HEADER_BYTES as u64);
        ((room + slot / 2) / slot).max(1)
    }

    /// The length of a full segment object: its header and `segment_blocks` slots.
    pub fn segment_object_bytes(&self, slot_bytes: usize) -> u64 {
        SEGMENT_HEADER_BYTES as u64 + self.segment_blocks(slot_bytes) * slot_bytes as u64
    }

    /// Adjacent blocks read by one ranged GET at most. Unset (0): 4, or as many as fit in 8 MiB
    /// when that is more (small blocks). Set: as many as fit in the value, at least one.
    pub fn blocks_per_get(&self, slot_bytes: usize) -> u64 {
        let slot = slot_bytes as u64;
        if self.get_max_bytes == 0 {
            return (AUTO_GET_BYTES / slot).max(AUTO_GET_BLOCKS);
        }
        (self.get_max_bytes / slot).max(1)
    }

    fn validate_segment(&self, slot_bytes: usize) -> Result<()> {
        let (header, slot) = (SEGMENT_HEADER_BYTES as u64, slot_bytes as u64);
        if self.segment_bytes != 0 && self.segment_bytes < header + slot {
            return Err(Error::config(
                "bucket_segment_bytes",
                format!(
                    "{} holds no whole block: a block takes {slot} bytes with its descriptor page, and a segment \
                     {header} more for its header. Give at least {} (one block), e.g. {} (four blocks), or leave \
                     it unset (whole blocks to 32 MiB, at least four)",
                    self.segment_bytes,
                    header + slot,
                    header + 4 * slot
                ),
            ));
        }
        let segment = self.segment_object_bytes(slot_bytes);
        if segment > MAX_SEGMENT_BYTES {
            return Err(Error::config(
                "bucket_segment_bytes",
                format!(
                    "a segment of {} blocks of {slot} bytes is {segment} bytes, over 5 GiB (one S3 PUT); give less",
                    self.segment_blocks(slot_bytes)
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Slot of a block of `value_bytes` (a multiple of 4096): its descriptor page and the value.
    fn slot(value_bytes: u64) -> usize {
        (4096 + value_bytes) as usize
    }

    fn with_segment(segment_bytes: u64) -> BucketConfig {
        BucketConfig { segment_bytes, ..BucketConfig::new("s3://b") }
    }

    #[test]
    fn the_automatic_segment_holds_several_blocks_of_any_size() {
        let auto = BucketConfig::new("s3://b");
        assert_eq!(auto.segment_blocks(slot(2 * MIB)), 16, "2 MiB blocks: 32 MiB of them");
        assert_eq!(auto.segment_blocks(slot(16 * MIB)), 4, "16 MiB blocks: four, not one");
        assert_eq!(auto.segment_blocks(slot(64 * 1024)), 482, "64 KiB blocks: 32 MiB of them");
        assert_eq!(auto.segment_object_bytes(slot(16 * MIB)), 4096 + 4 * (16 * MIB + 4096));
        assert!(auto.validate_segment(slot(1024 * MIB)).is_ok(), "four of the largest blocks fit one PUT");
    }

    #[test]
    fn a_set_segment_holds_the_nearest_whole_number_of_blocks() {
        assert_eq!(with_segment(32 * MIB).segment_blocks(slot(16 * MIB)), 2, "32 MiB: two 16 MiB blocks");
        assert_eq!(with_segment(32 * MIB).segment_blocks(slot(2 * MIB)), 16);
        assert_eq!(with_segment(4 * MIB).segment_blocks(slot(2 * MIB)), 2);
        assert_eq!(with_segment(4096 + 8 * slot(64 * 1024) as u64).segment_blocks(slot(64 * 1024)), 8, "exact");
        assert_eq!(with_segment(24 * MIB).segment_blocks(slot(16 * MIB)), 1, "1.5 blocks rounds to the nearer");
        assert_eq!(with_segment(17 * MIB).segment_blocks(slot(16 * MIB)), 1);
    }

    #[test]
    fn a_segment_under_one_block_is_refused_with_the_fix() {
        let err = with_segment(16 * MIB).validate(slot(16 * MIB)).unwrap_err().to_string();
        assert!(err.contains("bucket_segment_bytes") && err.contains("holds no whole block"), "{err}");
        assert!(err.contains(&(8192 + 16 * MIB).to_string()) && err.contains("unset"), "the minimum, the fix: {err}");
        assert!(with_segment(8192 + 16 * MIB).validate(slot(16 * MIB)).is_ok(), "one block exactly");
        let err = with_segment(5 << 30).validate(slot(1024 * MIB)).unwrap_err().to_string();
        assert!(err.contains("over 5 GiB"), "{err}");
    }

    #[test]
    fn the_budget_holds_two_segments_as_rounded() {
        let mut config = with_segment(32 * MIB);
        config.budget_bytes = 64 * MIB;
        let err = config.validate(slot(16 * MIB)).unwrap_err().to_string();
        assert!(err.contains("bucket_budget_bytes") && err.contains("2 blocks"), "{err}");
        config.budget_bytes = 65 * MIB;
        assert!(config.validate(slot(16 * MIB)).is_ok());
    }

    #[test]
    fn a_get_reads_a_bounded_run_of_blocks() {
        let auto = BucketConfig::new("s3://b");
        assert_eq!(auto.blocks_per_get(slot(2 * MIB)), 4);
        assert_eq!(auto.blocks_per_get(slot(16 * MIB)), 4);
        assert_eq!(auto.blocks_per_get(slot(64 * 1024)), 120, "8 MiB of small blocks");
        let set = BucketConfig { get_max_bytes: MIB, ..BucketConfig::new("s3://b") };
        assert_eq!(set.blocks_per_get(slot(2 * MIB)), 1, "at least one block");
        assert_eq!(set.blocks_per_get(slot(60 * 1024)), 16);
        let err = BucketConfig { get_max_bytes: 6 << 30, ..BucketConfig::new("s3://b") }.validate(slot(MIB));
        assert!(err.unwrap_err().to_string().contains("bucket_get_max_bytes"));
    }
}
