//! `RemoteTiers`: the remote tiers a store was configured with (a shared filesystem, an object
//! store), each with its publisher thread, behind one value. The store, the mover and residency ask
//! it (contains, reads, publishing, generations, indexed keys) and never name a tier; a tier is named
//! once, in `RemoteTiers::open`'s arm for it. What a tier implements is `tiers::remote::RemoteTier`.
//!
//! Each tier has its health (`tiers::health`): reads that fail in a row make it sick, and a
//! sick tier steps aside (not offered by `contains`, no reads started) until one probe read brings
//! it back. The probe is the store's own read (`due_probes`, `Store`'s prober thread), never an
//! engine's load: a request that met the tier's outage once does not wait on it again. The prober
//! also watches each tier's heartbeat (`tiers::remote::heartbeat`, its index refresh): a refresh
//! unanswered for the stall limit makes the tier sick before any request meets the outage, and
//! the refresh finishing ends the back-off. Counted in `remote_tier_*` / `remote_tiers_sick` /
//! `remote_refreshes_stalled`, logged once per change of state.

use crate::admission::WriteBudget;
use crate::catalog::Tier;
use crate::config::StoreConfig;
use crate::error::Result;
use crate::format::encrypted::ValueCipher;
use crate::key::{BlockKey, Namespace};
use crate::stats::Stats;
use crate::tiers::health::{Admit, Change, Health, Observed};
use crate::tiers::object::BucketTier;
use crate::tiers::remote::{PublishSink, Publisher, ReadOutcome, ReadRequest, Refetch, RemoteTier, StartedRead};
use crate::tiers::shared::SharedTier;
use parking_lot::Mutex;
use std::io::ErrorKind;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A load waits for its remote reads at least `remote_read_stall_ms` without any of them finishing,
/// and at least this many times the tier's recent read time (a slow link is not a dead one).
const STALL_READ_TIMES: u32 = 4;
/// Nor longer than this, whatever the tier's recent reads took.
const MAX_STALL: Duration = Duration::from_secs(30);
/// Indexed keys a sick tier's probe is chosen from (the first that no local tier holds).
const PROBE_CANDIDATES: usize = 16;

/// The remote indexes' generation: the sum of the tiers' own. Each tier's only grows (it counts the
/// keys its index gained or lost), so the sum moves whenever any of them does.
pub type RemoteGeneration = u64;

/// One remote tier and the publisher thread that feeds it.
struct Remote {
    tier: Arc<dyn RemoteTier>,
    publisher: Publisher,
    /// For the log: "shared filesystem", "object store".
    name: &'static str,
    /// What lookups call a block this tier serves.
    serves_as: Tier,
    health: Health,
    /// Bytes per day this tier may take (`write_budget_*_bytes_per_day`); `None`: unbounded. Shared
    /// with the publisher, which gives back the bytes of blocks it did not write.
    budget: Option<Arc<Mutex<WriteBudget>>>,
    /// How long its recent reads took, start to finish, queueing included (an exponentially
    /// weighted mean, in microseconds; 0: none measured yet).
    recent_read_us: AtomicU64,
}

impl Remote {
    fn start<T: RemoteTier + 'static>(
        tier: Arc<T>,
        (name, serves_as): (&'static str, Tier),
        config: &StoreConfig,
        (budget_bytes_per_day, place): (u64, String),
    ) -> Result<Remote> {
        let publisher = Publisher::start(Arc::clone(&tier) as Arc<dyn PublishSink>)?;
        let now = Instant::now();
        let budget = WriteBudget::of_store(place, &config.paths, budget_bytes_per_day, config.write_budget_burst_s);
        if let Some(budget) = &budget {
            let (budget, slot_bytes) = (Arc::clone(budget), tier.slot_bytes() as u64);
            publisher.set_unwritten(Box::new(move |blocks| budget.lock().give_back(blocks as u64 * slot_bytes)));
        }
        let health = Health::new(config.tier_health, now);
        Ok(Remote { tier, publisher, name, serves_as, health, budget, recent_read_us: AtomicU64::new(0) })
    }

    /// Folds a read that took `took` into the recent read time; `reset` (a late probe's answer: the
    /// tier is alive but slower than it was) replaces it.
    fn note_read_time(&self, took: Duration, reset: bool) {
        let took_us = (took.as_micros() as u64).max(1);
        let old = self.recent_read_us.load(Ordering::Relaxed);
        let new = if old == 0 || reset { took_us } else { (old * 4 + took_us) / 5 };
        self.recent_read_us.store(new, Ordering::Relaxed);
    }

    /// How long a load waits for this tier's reads with none finishing: `floor`, or longer for a
    /// tier whose recent reads were slow.
    fn stall_limit(&self, floor: Duration) -> Duration {
        let recent = Duration::from_micros(self.recent_read_us.load(Ordering::Relaxed));
        (recent * STALL_READ_TIMES).clamp(floor, MAX_STALL.max(floor))
    }

    /// Whether the tier's write budget takes one more block (what its publisher writes of it).
    fn budget_allows(&self) -> bool {
        let bytes = self.tier.slot_bytes() as u64;
        self.budget.as_ref().is_none_or(|b| b.lock().try_take(bytes, Instant::now()))
    }

    /// Whether the tier indexes `key` and is offered in lookups now (not sick).
    fn offers(&self, key: &BlockKey) -> bool {
        !self.health.is_sick() && self.tier.contains(key)
    }

    /// A block to probe the tier with: one it indexes that no local tier holds (`held_locally`),
    /// so that the probe's read-ahead reads it from the tier.
    fn probe_candidate(&self, held_locally: &impl Fn(&BlockKey) -> bool) -> Option<BlockKey> {
        self.tier.cut_keys(PROBE_CANDIDATES).into_iter().find(|key| !held_locally(key))
    }
}

/// A read started on one of the remote tiers: which one, and that tier's record of it.
pub(crate) struct RemoteRead {
    tier: usize,
    read: StartedRead,
    /// The one read let through to a sick tier to see whether it is back.
    probe: bool,
    started: Instant,
}

pub(crate) struct RemoteTiers {
    /// In load order: a block indexed by several is read from the first.
    tiers: Vec<Remote>,
    /// The shared-filesystem tier again, for the operator's tools that only it has (scrub, usage).
    shared_fs: Option<Arc<SharedTier>>,
    /// The object tier again, for its per-tenant figures.
    bucket: Option<Arc<BucketTier>>,
    stats: Arc<Stats>,
    /// `remote_read_stall_ms`; zero: a load waits for its remote reads however long they take.
    stall_floor: Duration,
}

impl RemoteTiers {
    /// Each tier's bounded write budget.
    pub(crate) fn write_budgets(&self) -> impl Iterator<Item = (Tier, &Mutex<WriteBudget>)> {
        self.tiers.iter().filter_map(|r| r.budget.as_deref().map(|budget| (r.serves_as, budget)))
    }

    /// Opens the tiers the configuration asks for, after NVMe: either, both, or neither. One arm per
    /// tier; the shared filesystem comes first, so that a block in both is read from it.
    /// `cipher`: encryption at rest (`encryption_key_file`), for every tier.
    pub(crate) fn open(
        config: &StoreConfig,
        namespace: Namespace,
        stats: &Arc<Stats>,
        cipher: Option<&Arc<ValueCipher>>,
    ) -> Result<RemoteTiers> {
        let mut tiers = Vec::new();
        let mut shared_fs = None;
        if let Some(c) = &config.shared {
            let mut c = c.clone();
            if config.tenant_shares_shared_fs {
                c.tenant_shares = config.tenant_shares()?;
            }
            let tier = SharedTier::open(&c, namespace, config.object_bytes, Arc::clone(stats), &config.io_setup())?;
            if let Some(cipher) = cipher {
                tier.encrypt_with(Arc::clone(cipher));
            }
            shared_fs = Some(Arc::clone(&tier));
            let named = ("shared filesystem", Tier::Shared);
            let place = format!("shared:{}", c.root.display());
            tiers.push(Remote::start(tier, named, config, (config.write_budget_shared_bytes_per_day, place))?);
        }
        let mut bucket = None;
        if let Some(c) = &config.bucket {
            let mut c = c.clone();
            if config.tenant_shares_bucket {
                c.tenant_shares = config.tenant_shares()?;
            }
            let tier = BucketTier::open(&c, namespace, config.object_bytes, Arc::clone(stats))?;
            bucket = Some(Arc::clone(&tier));
            if let Some(cipher) = cipher {
                tier.encrypt_with(Arc::clone(cipher));
            }
            let named = ("object store", Tier::Bucket);
            let place = format!("bucket:{}@{}", c.url, c.endpoint.as_deref().unwrap_or_default());
            tiers.push(Remote::start(tier, named, config, (config.write_budget_bucket_bytes_per_day, place))?);
        }
        let stall_floor = Duration::from_millis(config.remote_read_stall_ms);
        Ok(RemoteTiers { tiers, shared_fs, bucket, stats: Arc::clone(stats), stall_floor })
    }

    /// The shared-filesystem tier, for what only it offers (`kvtier verify`'s scrub, usage facts).
    pub(crate) fn shared_fs(&self) -> Option<&Arc<SharedTier>> {
        self.shared_fs.as_ref()
    }

    /// The remote tiers split by tenant, per tenant (`Store::stats`' tenant fields): each tier's
    /// bytes and what this process evicted of them, `<figure>:<tenant label>`.
    pub(crate) fn tenant_fields(&self) -> Vec<(String, u64)> {
        let shared = self.shared_fs.iter().flat_map(|t| t.tenant_figures()).map(|t| ("shared", "files", t));
        let bucket = self.bucket.iter().flat_map(|t| t.tenant_figures()).map(|t| ("bucket", "segments", t));
        let mut fields = Vec::new();
        for (tier, unit, t) in shared.chain(bucket) {
            fields.push((format!("tenant_{tier}_bytes:{}", t.label), t.bytes));
            fields.push((format!("tenant_{tier}_evicted_{unit}:{}", t.label), t.evicted));
        }
        fields
    }

    /// Whether any remote tier indexes the block and is offered (memory only): a sick tier in its
    /// back-off is not, and a block only it holds is a counted `remote_tier_lookups_skipped`.
    pub(crate) fn contains(&self, key: &BlockKey) -> bool {
        self.locate(key).is_some()
    }

    /// The remote tier a load would read `key` from (the first healthy one that holds it, as
    /// `tier_for` picks), or `None`.
    pub(crate) fn locate(&self, key: &BlockKey) -> Option<Tier> {
        let mut skipped = false;
        for r in self.tiers.iter().filter(|r| r.tier.contains(key)) {
            if !r.health.is_sick() {
                return Some(r.serves_as);
            }
            skipped = true;
        }
        if skipped {
            Stats::add(&self.stats.remote_tier_lookups_skipped, 1);
        }
        None
    }

    /// The blocks to probe the sick tiers with now: one per tier whose back-off passed with no probe
    /// in flight. The store's prober reads them ahead (a probe load, `probe: true` to
    /// `readable` and `start_reads`), the only load let through to a sick tier; `held_locally` says
    /// which blocks DRAM or NVMe holds (a read-ahead of those would not reach the tier).
    /// A due tier with no block to read (its index empty, or all of it held locally) is brought
    /// back by its heartbeat instead: a refresh that began after it turned sick and finished.
    /// A sick tier whose stalled refresh finished (`Heartbeat::take_thaw`: the tier answers again)
    /// is due its probe at once, whatever back-off its failed probes during the outage had reached.
    pub(crate) fn due_probes(&self, held_locally: impl Fn(&BlockKey) -> bool) -> Vec<BlockKey> {
        for r in self.tiers.iter().filter(|r| r.tier.heartbeat().take_thaw()) {
            r.health.end_backoff(Instant::now());
        }
        let mut keys = Vec::new();
        for r in self.tiers.iter().filter(|r| r.health.due_probe(Instant::now)) {
            match r.probe_candidate(&held_locally) {
                Some(key) => keys.push(key),
                None => self.probe_by_heartbeat(r),
            }
        }
        keys
    }

    /// A sick tier with nothing to read as its probe: healthy again once a refresh that began after
    /// it turned sick finished (the tier answers).
    fn probe_by_heartbeat(&self, r: &Remote) {
        let Some(since) = r.health.sick_since() else { return };
        if r.tier.heartbeat().answered_since(since) && r.health.admit(Instant::now) == Admit::Probe {
            self.note(r, r.health.record(true, Observed::CleanMiss, Instant::now()));
        }
    }

    /// Watches each healthy tier's heartbeat (`tiers::remote::heartbeat`): one whose index refresh
    /// went unanswered for its stall limit turns sick now, before a request's load meets it and
    /// waits that long. The store's prober calls it every tick; off with `remote_read_stall_ms` 0.
    pub(crate) fn watch_heartbeats(&self) {
        if self.stall_floor.is_zero() {
            return;
        }
        let now = Instant::now();
        for r in self.tiers.iter().filter(|r| !r.health.is_sick()) {
            let Some(waited) = r.tier.heartbeat().stalled(r.stall_limit(self.stall_floor), now) else { continue };
            Stats::add(&self.stats.remote_refreshes_stalled, 1);
            self.note(r, r.health.stalled(format!("its index refresh has not answered in {waited:?}"), now));
        }
    }

    /// Whether a load may read `key` from a remote tier: one offers it, or, for the prober's probe
    /// load (`probe`), a sick tier indexes it.
    pub(crate) fn readable(&self, key: &BlockKey, probe: bool) -> bool {
        self.contains(key) || (probe && self.tiers.iter().any(|r| r.health.is_sick() && r.tier.contains(key)))
    }

    /// Offers an accepted block (its slot: descriptor page + value) to every tier's publisher that
    /// does not hold it yet. A tier's budget pays for the block here and gets it back from the
    /// publisher if it is not written after all.
    pub(crate) fn offer(&self, key: BlockKey, slot: &[u8]) {
        for r in self.tiers.iter().filter(|r| !r.tier.contains(&key)) {
            if r.budget_allows() {
                r.publisher.offer(key, slot);
            } else {
                Stats::add(&self.stats.remote_write_budget_refusals, 1);
            }
        }
    }

    /// Whether the store has any remote tier.
    pub(crate) fn any(&self) -> bool {
        !self.tiers.is_empty()
    }

    /// Gives every publisher its way to copy a backlogged block out of DRAM.
    pub(crate) fn set_refetch(&self, refetch: impl Fn() -> Refetch) {
        for r in &self.tiers {
            r.publisher.set_refetch(refetch());
        }
    }

    /// Waits until every tier published what was offered before the call.
    pub(crate) fn flush(&self, timeout: Duration) -> Result<()> {
        self.tiers.iter().try_for_each(|r| r.publisher.flush(timeout))
    }

    /// Publishes what is queued, stops the publishers, then closes the tiers, each within its own
    /// close deadline (`PublishSink::closing`). Idempotent.
    pub(crate) fn close(&self) {
        self.closing(); // before the publishers' last flush, which sends into the tiers
        for r in &self.tiers {
            r.publisher.close();
        }
        for r in &self.tiers {
            r.tier.close();
        }
    }

    /// The store starts closing: each tier's deadline for what is left to send starts now
    /// (`PublishSink::closing`), the store's last flush included. Idempotent.
    pub(crate) fn closing(&self) {
        for r in &self.tiers {
            r.tier.closing();
        }
    }

    /// The tiers' index generation (see `RemoteTier::keys_generation`); 0 with no remote tier.
    pub(crate) fn generation(&self) -> RemoteGeneration {
        self.tiers.iter().fold(0, |sum, r| sum.wrapping_add(r.tier.keys_generation()))
    }

    /// Up to `limit_each` indexed keys of each tier, for the residency report: a key it named stays
    /// named while its tier indexes it (`KeyIndex::cut`), whatever else the index gains.
    pub(crate) fn indexed_keys(&self, limit_each: usize) -> Vec<BlockKey> {
        self.tiers.iter().flat_map(|r| r.tier.cut_keys(limit_each)).collect()
    }

    /// How long a load waits for its remote reads while none of them finishes before it gives them
    /// up (`give_up`): `remote_read_stall_ms`, or longer where a tier's recent reads were slow.
    /// `None`: it waits however long they take (`remote_read_stall_ms` is 0).
    pub(crate) fn stall_limit(&self) -> Option<Duration> {
        if self.stall_floor.is_zero() {
            return None;
        }
        self.tiers.iter().map(|r| r.stall_limit(self.stall_floor)).max()
    }

    /// The most adjacent blocks one request of any tier reads (1 with no remote tier).
    pub(crate) fn blocks_per_request(&self) -> usize {
        self.tiers.iter().map(|r| r.tier.blocks_per_request()).max().unwrap_or(1)
    }

    /// The tier that reads `key`: the first offered one that indexes it, else for a probe load a
    /// sick one that does, else the last (which counts the miss); `None` when only sick tiers index
    /// it (a skipped lookup, not started).
    fn tier_for(&self, key: &BlockKey, probe: bool) -> Option<usize> {
        let last = self.tiers.len().checked_sub(1).expect("remote reads need a remote tier");
        if let Some(tier) = self.tiers.iter().position(|r| r.offers(key)) {
            return Some(tier);
        }
        if probe {
            return self.tiers.iter().position(|r| r.tier.contains(key)).or(Some(last));
        }
        if self.tiers.iter().any(|r| r.tier.contains(key)) {
            Stats::add(&self.stats.remote_tier_lookups_skipped, 1);
            return None;
        }
        Some(last)
    }

    /// Starts the reads, each on the tier that reads its key (`tier_for`), each tier's together (a
    /// tier may read adjacent blocks with one request): per request, in order, its read or `None`
    /// (not started: a miss its tier counted, or one only a sick tier could serve; its `on_done`
    /// dropped uncalled). Only a probe load (`probe`: the store's prober, `due_probes`) reads a sick
    /// tier, one request of its batch, as the tier's probe.
    ///
    /// # Safety
    /// As `RemoteTier::start_reads`, for every request.
    pub(crate) unsafe fn start_reads(&self, requests: Vec<ReadRequest>, probe: bool) -> Vec<Option<RemoteRead>> {
        let count = requests.len();
        let mut by_tier: Vec<(Vec<usize>, Vec<ReadRequest>)> = self.tiers.iter().map(|_| Default::default()).collect();
        for (i, request) in requests.into_iter().enumerate() {
            if let Some(tier) = self.tier_for(&request.0, probe) {
                let (order, batch) = &mut by_tier[tier];
                order.push(i);
                batch.push(request);
            }
        }
        let mut started: Vec<Option<RemoteRead>> = (0..count).map(|_| None).collect();
        for (tier, (mut order, mut batch)) in
            by_tier.into_iter().enumerate().filter(|(_, (order, _))| !order.is_empty())
        {
            let health = &self.tiers[tier].health;
            let probe = match health.admit(Instant::now) {
                Admit::Read => false,
                Admit::Probe => true,
                Admit::Refused => continue,
            };
            if probe {
                order.truncate(1);
                batch.truncate(1);
            }
            // SAFETY: forwarded contract.
            let reads = unsafe { self.tiers[tier].tier.start_reads(batch) };
            assert_eq!(reads.len(), order.len(), "a remote tier answers every request");
            if probe && reads[0].is_none() {
                health.release_probe();
            }
            let now = Instant::now();
            for (i, read) in order.into_iter().zip(reads) {
                started[i] = read.map(|read| RemoteRead { tier, read, probe, started: now });
            }
        }
        started
    }

    /// Judges a finished read, by the tier that started it.
    ///
    /// # Safety
    /// As `RemoteTier::finish_read`.
    pub(crate) unsafe fn finish_read(
        &self,
        read: RemoteRead,
        slot: *mut u8,
        result: std::io::Result<()>,
    ) -> ReadOutcome {
        // SAFETY: forwarded contract.
        unsafe { self.judge_read(read, slot, result, false) }
    }

    /// A load stopped waiting for this read (`stall_limit` passed with no remote read finishing):
    /// its block is a counted miss, and the tier is sick at once (a stall is the tier, not a bad
    /// block), unless this is its probe, which its late answer judges (`finish_late`). The read stays
    /// the tier's until it finishes.
    pub(crate) fn give_up(&self, read: &RemoteRead, stalled: Duration) {
        Stats::add(&self.stats.remote_reads_given_up, 1);
        if read.probe {
            return;
        }
        let remote = &self.tiers[read.tier];
        self.note(remote, remote.health.stalled(format!("no read finished in {stalled:?}"), Instant::now()));
    }

    /// Judges a read its load gave up (`give_up`) once it finishes: nobody is served from it. A
    /// probe's answer still tells the tier's health: a hit brings a slow tier back, with its new
    /// read time.
    ///
    /// # Safety
    /// As `RemoteTier::finish_read`.
    pub(crate) unsafe fn finish_late(
        &self,
        read: RemoteRead,
        slot: *mut u8,
        result: std::io::Result<()>,
    ) -> ReadOutcome {
        // SAFETY: forwarded contract.
        unsafe { self.judge_read(read, slot, result, true) }
    }

    /// Has the read's tier judge it, and records what it says of the tier: every read in time; of
    /// a late one (`late`), only the probe's, whose hit also resets the read time (the tier is
    /// slower, not dead).
    ///
    /// # Safety
    /// As `RemoteTier::finish_read`.
    unsafe fn judge_read(
        &self,
        read: RemoteRead,
        slot: *mut u8,
        result: std::io::Result<()>,
        late: bool,
    ) -> ReadOutcome {
        let (remote, probe, took) = (&self.tiers[read.tier], read.probe, read.started.elapsed());
        // SAFETY: forwarded contract.
        let (outcome, observed) = unsafe { judge(remote, read.read, slot, result) };
        if late && !probe {
            return outcome;
        }
        if outcome == ReadOutcome::Hit {
            remote.note_read_time(took, late);
        }
        self.note(remote, remote.health.record(probe, observed, Instant::now()));
        outcome
    }

    /// Counts and logs a change of a tier's health, once.
    fn note(&self, remote: &Remote, change: Change) {
        match change {
            Change::None => {}
            Change::Sick { backoff, last_error } => {
                Stats::add(&self.stats.remote_tier_outages, 1);
                Stats::add(&self.stats.remote_tiers_sick, 1);
                log::warn!(
                    "kvtier: the {} tier is sick (last: {last_error}); its blocks are misses for \
                     {backoff:?}, then one read probes it",
                    remote.name
                );
            }
            Change::ProbeFailed { backoff, last_error } => {
                log::debug!("kvtier: the {} tier's probe failed ({last_error}); next in {backoff:?}", remote.name);
            }
            Change::Healthy => {
                self.stats.remote_tiers_sick.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                log::info!("kvtier: the {} tier answers again; its blocks are offered again", remote.name);
            }
        }
    }
}

/// Has `remote`'s tier judge a finished read; what it says of the tier's health.
///
/// # Safety
/// As `RemoteTier::finish_read`.
unsafe fn judge(
    remote: &Remote,
    read: StartedRead,
    slot: *mut u8,
    result: std::io::Result<()>,
) -> (ReadOutcome, Observed) {
    let failure = match &result {
        Err(e) if !is_clean_miss(e) => Some(e.to_string()),
        _ => None,
    };
    // SAFETY: forwarded contract.
    let outcome = unsafe { remote.tier.finish_read(read, slot, result) };
    let observed = match (outcome, failure) {
        (ReadOutcome::Abandoned, _) => Observed::Failed("the I/O engine gave the read up".to_string()),
        (_, Some(error)) => Observed::Failed(error),
        (ReadOutcome::Hit, None) => Observed::Hit,
        (ReadOutcome::Miss, None) => Observed::CleanMiss,
    };
    (outcome, observed)
}

/// A failed read's error that is no failure of the tier: the block is gone (evicted elsewhere, a
/// stale NFS handle) or shorter than its slot (being replaced): a clean miss the tier deals with.
fn is_clean_miss(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::NotFound | ErrorKind::UnexpectedEof) || e.raw_os_error() == Some(libc::ESTALE)
}
