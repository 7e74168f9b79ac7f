//! The bucket side of the index: connecting, listing index objects into the in-memory index
//! (`refresh`), the byte budget (`evict`), and the maintenance thread that runs both.

use super::access::{accounts_of, Candidate};
use super::format::{self, SegmentIndex};
use super::{BucketConfig, BucketTier};
use crate::error::{Error, Result};
use crate::stats::Stats;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectMeta, ObjectStore, RetryConfig};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Eviction stops at this fraction of the budget, so that it runs in batches, not per segment.
const LOW_WATER: f64 = 0.9;

fn modified_ms(m: &ObjectMeta) -> u64 {
    m.last_modified.timestamp_millis().max(0) as u64
}

/// Listed segments as the evictor's candidates, by their stems.
fn candidates(segments: Vec<ObjectMeta>) -> Vec<Candidate<ObjectMeta>> {
    segments
        .into_iter()
        .map(|m| {
            let name = m.location.filename().unwrap_or_default();
            let stem = name.strip_suffix(".kvo").unwrap_or(name).to_string();
            Candidate { stem, modified_unix_ms: modified_ms(&m), bytes: m.size, item: m }
        })
        .collect()
}

/// The S3 client: credentials, region and endpoint from the environment and the credential chain
/// (`AWS_ACCESS_KEY_ID`, web identity, ECS, instance metadata; no profile files), the bucket and endpoint from the
/// options. Retries are bounded by the request timeout, so a dead server costs misses, not hangs.
pub(super) fn connect(config: &BucketConfig, bucket: &str) -> Result<Arc<dyn ObjectStore>> {
    let timeout = Duration::from_millis(config.request_timeout_ms);
    client(config, bucket, object_store::ClientOptions::new().with_timeout(timeout))
}

/// The client of the ranged GETs that serve loads: no total timeout, because a load's GETs share
/// the link and on a slow one each takes longer than a request timeout while bytes still arrive
/// (at 20 MB/s, 32 GETs of 8 MiB in flight: 13 s each). `reads.rs` bounds each GET instead: its
/// response and every next chunk of its body within the request timeout, all of it within
/// `MAX_GET_TIMEOUTS` of them.
pub(super) fn connect_reads(config: &BucketConfig, bucket: &str) -> Result<Arc<dyn ObjectStore>> {
    client(config, bucket, object_store::ClientOptions::new().with_timeout_disabled())
}

fn client(config: &BucketConfig, bucket: &str, options: object_store::ClientOptions) -> Result<Arc<dyn ObjectStore>> {
    let timeout = Duration::from_millis(config.request_timeout_ms);
    let mut builder = AmazonS3Builder::from_env()
        .with_bucket_name(bucket)
        .with_retry(RetryConfig { max_retries: 2, retry_timeout: timeout, ..RetryConfig::default() })
        .with_client_options(options.with_connect_timeout(timeout.min(Duration::from_secs(5))));
    if let Some(endpoint) = &config.endpoint {
        builder = builder.with_endpoint(endpoint).with_allow_http(endpoint.starts_with("http://"));
    }
    let store = builder.build().map_err(|e| {
        Error::config(
            "bucket_url",
            format!("cannot configure the S3 client: {e}; check bucket_url, bucket_endpoint and AWS_* variables"),
        )
    })?;
    Ok(Arc::new(store))
}

impl BucketTier {
    pub(super) fn list(&self, dir: &str) -> std::io::Result<Vec<ObjectMeta>> {
        Stats::add(&self.stats.bucket_list_requests, 1);
        let prefix = ObjectPath::from(format!("{}/{dir}", self.base));
        let store = &self.store;
        // Listing a large prefix takes a request per 1000 objects: allow it several timeouts' worth.
        let timeout = self.bounded(Duration::from_millis(self.config.request_timeout_ms) * 4);
        self.rt.block_on(async {
            match tokio::time::timeout(timeout, store.list_with_delimiter(Some(&prefix))).await {
                Ok(r) => r.map(|l| l.objects).map_err(std::io::Error::from),
                Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "listing timed out")),
            }
        })
    }

    /// Lists `dir` without the objects longer than `max_bytes` (the longest its format allows): those
    /// are never fetched, whatever they hold. Each is counted in `bucket_oversized_objects` and
    /// logged once while it stays listed.
    pub(super) fn list_within(&self, dir: &str, max_bytes: u64) -> std::io::Result<Vec<ObjectMeta>> {
        let mut listed = self.list(dir)?;
        let too_long: HashSet<String> =
            listed.iter().filter(|m| m.size > max_bytes).map(|m| m.location.to_string()).collect();
        let under = format!("{}/{dir}/", self.base);
        let mut reported = self.oversized.lock();
        reported.retain(|path| !path.starts_with(&under) || too_long.contains(path));
        for m in listed.iter().filter(|m| m.size > max_bytes) {
            if reported.insert(m.location.to_string()) {
                log::warn!(
                    "kvtier: bucket object {} is {} bytes, longer than its format allows ({max_bytes}); never fetched",
                    m.location,
                    m.size
                );
                Stats::add(&self.stats.bucket_oversized_objects, 1);
            }
        }
        drop(reported);
        listed.retain(|m| m.size <= max_bytes);
        Ok(listed)
    }

    /// Lists the index objects: indexes segments new to this process, forgets those gone (evicted
    /// elsewhere, or expired by a lifecycle rule). Returns whether the index changed.
    pub fn refresh(&self) -> Result<bool> {
        let listed = self
            .list_within("idx", format::max_index_bytes(self.slot_bytes as u64))
            .map_err(|e| Error::io("listing the bucket's index objects", e))?;
        let stems: HashSet<String> = listed
            .iter()
            .filter_map(|m| m.location.filename()?.strip_suffix(".kvi").map(str::to_string))
            .filter(|s| format::valid_stem(s))
            .collect();
        let (known, gone): (HashSet<String>, Vec<String>) = {
            let index = self.index.read();
            let known = index.segments.keys().map(|s| s.to_string()).collect::<HashSet<_>>();
            let gone = known.iter().filter(|s| !stems.contains(*s)).cloned().collect();
            (known, gone)
        };
        self.forget_damage_not_listed(&stems);
        let bad = self.bad.lock().clone();
        let new: Vec<String> = stems.into_iter().filter(|s| !known.contains(s) && !bad.contains(s)).collect();
        let mut fetched = self.fetch_indexes(&new);
        for (stem, idx) in &mut fetched {
            self.without_bad_blocks(stem, idx);
        }
        let mut index = self.index.write();
        for stem in &gone {
            index.remove(stem);
        }
        for (stem, idx) in &fetched {
            index.insert(stem, idx);
        }
        Ok(!gone.is_empty() || !fetched.is_empty())
    }

    /// GETs index objects, several in flight; a forged, foreign or corrupt one is remembered as bad.
    fn fetch_indexes(&self, stems: &[String]) -> Vec<(String, SegmentIndex)> {
        let timeout = self.timeout();
        let handles: Vec<_> = stems
            .iter()
            .map(|stem| {
                Stats::add(&self.stats.bucket_get_requests, 1);
                let (store, path) = (Arc::clone(&self.store), self.index_path(stem));
                self.rt.spawn(async move {
                    let got = tokio::time::timeout(timeout, async { store.get(&path).await?.bytes().await }).await;
                    got.map_err(|_| ()).and_then(|r| r.map_err(|_| ()))
                })
            })
            .collect();
        let results: Vec<_> = self.rt.block_on(async {
            let mut out = Vec::with_capacity(handles.len());
            for h in handles {
                out.push(h.await.ok().and_then(|r| r.ok()));
            }
            out
        });
        let mut fetched = Vec::new();
        for (stem, bytes) in stems.iter().zip(results) {
            match bytes {
                Some(bytes) => match self.judge_index(stem, &bytes) {
                    Some(idx) => fetched.push((stem.clone(), idx)),
                    None => {
                        self.bad.lock().insert(stem.clone());
                    }
                },
                // Gone meanwhile, or the server is slow: tried again at the next refresh.
                None => Stats::add(&self.stats.bucket_request_errors, 1),
            }
        }
        fetched
    }

    fn judge_index(&self, stem: &str, bytes: &[u8]) -> Option<SegmentIndex> {
        let auth = self.auth.as_ref().map(|k| (k, &self.namespace));
        match SegmentIndex::decode(bytes, auth) {
            Ok(Some(idx))
                if idx.consistent(&self.namespace, self.object_bytes as u64, self.slot_bytes as u64, stem) =>
            {
                Some(idx)
            }
            Ok(Some(_)) => {
                log::warn!(
                    "kvtier: bucket index object {stem} names another namespace, block size or segment; ignored"
                );
                Stats::add(&self.stats.bucket_verify_failures, 1);
                None
            }
            Ok(None) => {
                log::warn!("kvtier: bucket index object {stem} has no valid tag for the deployment key; ignored");
                Stats::add(&self.stats.bucket_auth_failures, 1);
                None
            }
            Err(e) if super::damage::index_is_corrupt(bytes, &e) => {
                log::warn!("kvtier: bucket index object {stem} is corrupt ({e}); moving it into quarantine");
                Stats::add(&self.stats.bucket_verify_failures, 1);
                self.cleanups.lock().push(super::damage::Cleanup::CorruptIndex(Arc::from(stem)));
                None
            }
            Err(e) => {
                log::warn!("kvtier: bucket index object {stem} rejected ({e}); ignored");
                Stats::add(&self.stats.bucket_verify_failures, 1);
                None
            }
        }
    }

    /// Keeps the namespace's segments under `bucket_budget_bytes` (run by the lease holder): when the
    /// listed segments exceed it, the least recently used are deleted (index object first, so readers
    /// stop choosing them) down to 90%. Last use: the later of a segment's modification time and its
    /// latest read in any store's access object (`access.rs`). Split by tenant, the segments of the
    /// tenants past their shares of that 90% go first, and a tenant past its cap loses segments under
    /// the budget too (`tiers::remote::tenants`). Returns how many segments were evicted.
    pub fn evict(&self) -> Result<usize> {
        if self.config.budget_bytes == 0 {
            return Ok(0);
        }
        self.delete_doomed(false);
        let mut segments = self.list("seg").map_err(|e| Error::io("listing the bucket's segments", e))?;
        // Doomed segments are gone for the budget: counting them again would evict more.
        let doomed: HashSet<String> = self.doomed.lock().iter().map(|(path, _)| path.to_string()).collect();
        segments.retain(|m| !doomed.contains(m.location.as_ref()));
        let total: u64 = segments.iter().map(|m| m.size).sum();
        let (shares, room_bytes) = (&self.config.tenant_shares, (self.config.budget_bytes as f64 * LOW_WATER) as u64);
        let over_budget = total > self.config.budget_bytes;
        // A cap applies under the budget too; whether one is passed is seen by write times alone.
        let past_cap = shares.max_share.is_some()
            && accounts_of(candidates(segments.clone()), &HashMap::new(), shares, room_bytes).past_cap();
        if !over_budget && !past_cap {
            return Ok(0);
        }
        let oldest_ms = segments.iter().map(modified_ms).min().unwrap_or(0);
        // Read only when evicting: the access objects cost a LIST and GETs, and only this uses them.
        let reads = self.latest_reads(oldest_ms);
        let mut accounts = accounts_of(candidates(segments), &reads, shares, room_bytes);
        let target = if over_budget { room_bytes } else { total };
        let mut evicted = 0;
        for (m, tag) in accounts.victims(total, target) {
            let Some(stem) = m.location.filename().and_then(|f| f.strip_suffix(".kvo")).map(str::to_string) else {
                continue;
            };
            self.index.write().remove(&stem);
            // The index object goes now (no store picks the segment after its next listing); the
            // segment after the grace period, so that loads that chose it before still find it.
            if self.delete(&self.index_path(&stem)).is_ok() {
                self.doomed.lock().push((m.location, Instant::now()));
                Stats::add(&self.stats.bucket_evicted_segments, 1);
                if shares.enabled() {
                    self.tenant_ledger.count_evicted([tag]);
                }
                evicted += 1;
            }
        }
        Ok(evicted)
    }

    /// Deletes the doomed segments whose grace period (`2 * bucket_refresh_ms +
    /// bucket_request_timeout_ms`: every store has listed the bucket and finished a GET since) is
    /// over, or all of them (`all`, at close).
    pub(super) fn delete_doomed(&self, all: bool) {
        let grace = Duration::from_millis(2 * self.config.refresh_ms) + self.timeout();
        let due: Vec<ObjectPath> = {
            let mut doomed = self.doomed.lock();
            let (due, keep): (Vec<_>, Vec<_>) = doomed.drain(..).partition(|(_, at)| all || at.elapsed() >= grace);
            *doomed = keep;
            due.into_iter().map(|(path, _)| path).collect()
        };
        for path in due {
            // A failed delete leaves an unindexed segment: the next evictor's listing counts it and,
            // as the oldest, deletes it.
            let _ = self.delete(&path);
        }
    }

    pub(super) fn delete(&self, path: &ObjectPath) -> std::io::Result<()> {
        Stats::add(&self.stats.bucket_delete_requests, 1);
        let (store, timeout) = (&self.store, self.timeout());
        let r = self.rt.block_on(async { tokio::time::timeout(timeout, store.delete(path)).await });
        match r {
            Ok(Ok(())) => Ok(()),
            Ok(Err(object_store::Error::NotFound { .. })) => Ok(()),
            Ok(Err(e)) => Err(std::io::Error::from(e)),
            Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "DELETE timed out")),
        }
    }

    /// One maintenance pass: refresh, publish a segment that waited long enough, and, holding the
    /// evictor lease, keep the budget. The refresh comes first and is timed (the tier's
    /// heartbeat): a frozen gateway shows in it within the stall limit, not after a PUT's timeout.
    pub fn maintain(&self) {
        if let Err(e) = self.heartbeat.refresh(|| self.refresh()) {
            log::debug!("kvtier: bucket refresh failed: {e}");
            Stats::add(&self.stats.bucket_request_errors, 1);
        }
        self.publish_if_due();
        self.run_cleanups();
        self.put_access_if_changed();
        if self.config.budget_bytes == 0 || !self.hold_lease() {
            return;
        }
        if let Err(e) = self.evict() {
            log::debug!("kvtier: bucket eviction failed: {e}");
            Stats::add(&self.stats.bucket_request_errors, 1);
        }
        if let Err(e) = self.bound_quarantine() {
            log::debug!("kvtier: bounding the bucket's quarantine failed: {e}");
            Stats::add(&self.stats.bucket_request_errors, 1);
        }
    }
}

/// Runs `maintain` every `bucket_refresh_ms` until the tier closes (holding only a weak reference).
pub(super) fn start_maintenance(tier: &Arc<BucketTier>) -> Result<()> {
    let weak = Arc::downgrade(tier);
    let period = Duration::from_millis(tier.config.refresh_ms);
    let handle = std::thread::Builder::new()
        .name("kvtier-bucket-sync".into())
        .spawn(move || loop {
            let Some(tier) = weak.upgrade() else { return };
            {
                let mut stop = tier.stop.lock();
                if !*stop {
                    tier.stop_cv.wait_for(&mut stop, period);
                }
                if *stop {
                    return;
                }
            }
            tier.maintain();
        })
        .map_err(|e| Error::io("spawning the object tier's maintenance thread", e))?;
    *tier.maintenance.lock() = Some(handle);
    Ok(())
}
