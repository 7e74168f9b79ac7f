//! Options of the object-storage tier: `ObjectConfig::new` holds the defaults and `validate` the
//! constraints (naming the option and the fix). Names and descriptions are in the option table,
//! `crate::config::OPTIONS` (the `bucket_*` rows), from which `docs/configuration.md` is generated.

use crate::error::{Error, Result};
use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct ObjectConfig {
    /// `s3://bucket` or `s3://bucket/prefix`. Required.
    pub url: String,
    /// S3 endpoint for S3-compatible servers (`http://host:port`); unset: AWS (or `AWS_ENDPOINT_URL`).
    pub endpoint: Option<String>,
    /// Blocks are grouped into segment objects of about this size (the unit of publishing and eviction).
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
    /// A request (one GET of a block, a PUT of a segment) that takes longer is a miss or an error.
    pub request_timeout_ms: u64,
    /// Term of the evictor lease (only stores with a budget take it); a holder that stops renewing
    /// loses it after this.
    pub lease_ms: u64,
    /// Deployment key file (as `shared_key_file`); unset: `KVTIER_SHARED_KEY_FILE` if set, else no MAC.
    pub key_file: Option<PathBuf>,
}

impl ObjectConfig {
    pub fn new(url: impl Into<String>) -> Self {
        ObjectConfig {
            url: url.into(),
            endpoint: None,
            segment_bytes: 32 << 20,
            budget_bytes: 0,
            refresh_ms: 1000,
            publish_delay_ms: 2000,
            publish_queue_bytes: 256 << 20,
            reads_in_flight: 32,
            request_timeout_ms: 10_000,
            lease_ms: 10_000,
            key_file: None,
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
        let minimum = (super::format::SEGMENT_HEADER_BYTES + slot_bytes) as u64;
        if self.segment_bytes < minimum || self.segment_bytes > 5 << 30 {
            return Err(Error::config(
                "bucket_segment_bytes",
                format!(
                    "{} is out of range; give at least {minimum} (one block of {slot_bytes} bytes and the header) \
                     and at most 5 GiB (one S3 PUT)",
                    self.segment_bytes
                ),
            ));
        }
        if self.budget_bytes != 0 && self.budget_bytes < 2 * self.segment_bytes {
            return Err(Error::config(
                "bucket_budget_bytes",
                format!(
                    "{} is under two segments ({}); raise it or set 0 (no budget)",
                    self.budget_bytes, self.segment_bytes
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
}
