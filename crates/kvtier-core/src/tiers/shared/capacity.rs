//! Capacity of the shared tier: usage measurement, the evictor lease, eviction of whole files least
//! recently used first, the grace period, and sweeps of orphaned temporaries, unlisted files and the
//! quarantine.
//!
//! Rules (see `docs/shared-tier.md`):
//! - Usage is what the filesystem reports (statvfs of the root: used / (used + available)), or with
//!   `capacity_bytes` the allocated size of the files under the namespace directory.
//! - Above `high_watermark`, the lease holder dooms files (least recently read first, never one read or
//!   published within `grace_ms`) until usage minus doomed bytes is at or below `low_watermark`, by
//!   appending a doom record; every process drops doomed files from its index within the staleness
//!   bound, and the holder unlinks them `grace_ms` after the doom. A reader that still loses the race
//!   gets a clean miss.
//! - One evictor at a time across all processes and nodes: the holder of the highest-generation lease
//!   file in `lease/`. Taking over an expired lease means creating the next generation with O_EXCL,
//!   which exactly one contender wins. The holder stops acting a quarter of `lease_ms` before others may
//!   take over (tolerating that much clock skew between nodes).

use super::files::{open_regular, OpenError};
use super::format::{
    lease_file_name, parse_lease_file_name, unix_ms, valid_data_file_name, Lease, Record, LEASE_BYTES,
};
use super::tenants;
use super::{SharedTier, Usage};
use crate::error::{Error, Result};
use crate::stats::Stats;
use crate::tiers::remote::lease;
use crate::tiers::remote::tenants::Accounts;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

struct HeldLease {
    generation: u64,
    file: File,
    /// This process acts as evictor only before this instant (local monotonic clock).
    act_until: Instant,
}

#[derive(Default)]
pub struct EvictorState {
    lease: Option<HeldLease>,
    last_sweep: Option<Instant>,
    warned_nothing_to_evict: bool,
}

impl EvictorState {
    pub fn holds_lease(&self) -> bool {
        self.lease.as_ref().is_some_and(|l| Instant::now() < l.act_until)
    }
}

/// Usage as the capacity rules see it.
pub fn measure_usage(tier: &SharedTier) -> Result<Usage> {
    match tier.config.capacity_bytes {
        Some(capacity_bytes) => Ok(Usage { used_bytes: allocated_bytes(&tier.dir), capacity_bytes }),
        None => {
            let root = &tier.config.root;
            let s =
                rustix::fs::statvfs(root).map_err(|e| Error::io(format!("statvfs {}", root.display()), e.into()))?;
            let used = s.f_blocks.saturating_sub(s.f_bfree) * s.f_frsize;
            let available = s.f_bavail * s.f_frsize;
            Ok(Usage { used_bytes: used, capacity_bytes: used + available })
        }
    }
}

/// Allocated bytes (st_blocks) of every file under `dir`, two levels deep (`data/<xx>/file`).
fn allocated_bytes(dir: &Path) -> u64 {
    fn walk(dir: &Path, depth: u32) -> u64 {
        let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
        let mut total = 0;
        for e in entries.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                if depth > 0 {
                    total += walk(&e.path(), depth - 1);
                }
            } else {
                total += m.blocks() * 512;
            }
        }
        total
    }
    walk(dir, 2)
}

fn age_ms(m: &std::fs::Metadata) -> u64 {
    m.modified().ok().and_then(|t| SystemTime::now().duration_since(t).ok()).map_or(0, |d| d.as_millis() as u64)
}

/// One capacity pass of the maintenance thread.
pub fn tick(tier: &SharedTier) {
    let usage = match measure_usage(tier) {
        Ok(u) => u,
        Err(e) => {
            log::warn!("kvtier: measuring shared usage failed: {e}");
            return;
        }
    };
    *tier.last_usage.lock() = usage;
    let config = &tier.config;
    let now = unix_ms();
    let (doomed_due, doomed_bytes) = {
        let mut index = tier.index.write();
        // Other processes' holders unlink what they doomed; forget entries long past their grace.
        let forget_after = config.grace_ms + 4 * config.lease_ms;
        index.doomed.retain(|_, (at, _)| now < at.saturating_add(forget_after));
        let due = index.doomed.values().any(|(at, _)| now >= at.saturating_add(config.grace_ms));
        (due, index.doomed.values().map(|(_, b)| *b).sum::<u64>())
    };
    let mut st = tier.evictor.lock();
    let over_high = usage.fraction() > config.high_watermark;
    let sweep_period = Duration::from_millis((config.orphan_tmp_ms / 4).max(config.grace_ms));
    let sweep_due = st.last_sweep.is_none_or(|t| t.elapsed() >= sweep_period);
    // With a cap, a tenant past it loses files below the watermark too: the accounts are needed then.
    let accounts = (over_high || config.tenant_shares.max_share.is_some()).then(|| {
        let room_bytes = (config.low_watermark * usage.capacity_bytes as f64) as u64;
        let evictable_before = now.saturating_sub(config.grace_ms);
        tenants::accounts(&tier.index.read(), &config.tenant_shares, room_bytes, evictable_before)
    });
    let past_cap = accounts.as_ref().is_some_and(Accounts::past_cap);
    if !(over_high || doomed_due || sweep_due || past_cap) {
        release_locked(tier, &mut st);
        return;
    }
    if !try_hold(tier, &mut st) {
        return;
    }
    if doomed_due {
        unlink_doomed(tier, &st);
    }
    if let Some(mut accounts) = accounts {
        let used = usage.used_bytes.saturating_sub(doomed_bytes);
        // Below the high watermark (or refusing writes instead of evicting) only the caps take files.
        let target = if over_high && !config.fail_on_full {
            (config.low_watermark * usage.capacity_bytes as f64) as u64
        } else {
            used
        };
        doom(tier, &mut st, &mut accounts, used, target);
    }
    if over_high {
        // Quarantined files are evidence, not cache: under pressure they go first.
        sweep_dir(tier, &tier.dir.join("quarantine"), 0);
    }
    if sweep_due {
        st.last_sweep = Some(Instant::now());
        sweep_tmp(tier, &tier.open_tmp_paths());
        sweep_dir(tier, &tier.dir.join("quarantine"), config.orphan_tmp_ms);
        doom_unlisted(tier);
    }
}

/// Gives the lease up (closing or idle) so another process can take it at once.
pub fn release(tier: &SharedTier) {
    let mut st = tier.evictor.lock();
    release_locked(tier, &mut st);
}

fn release_locked(tier: &SharedTier, st: &mut EvictorState) {
    if let Some(l) = st.lease.take() {
        let lease =
            Lease { generation: l.generation, holder: tier.writer_id, expires_unix_ms: 0, renewed_unix_ms: unix_ms() };
        let _ = l.file.write_all_at(&lease.encode(), 0);
        let _ = l.file.sync_data();
    }
}

fn lease_generations(tier: &SharedTier) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(tier.dir.join("lease")) else { return Vec::new() };
    let mut gens: Vec<u64> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(parse_lease_file_name))
        .filter(|&generation| lease::genuine_generation(generation))
        .collect();
    gens.sort_unstable();
    gens
}

/// Renews the lease we hold or takes a free or expired one. Returns whether we hold it now.
fn try_hold(tier: &SharedTier, st: &mut EvictorState) -> bool {
    let config = &tier.config;
    let gens = lease_generations(tier);
    let top = gens.last().copied();
    if let Some(held) = &mut st.lease {
        if top != Some(held.generation) || Instant::now() >= held.act_until {
            log::info!("kvtier: shared evictor lease generation {} lost (expired or taken over)", held.generation);
            st.lease = None;
        } else {
            let started = Instant::now();
            let now = unix_ms();
            let lease = Lease {
                generation: held.generation,
                holder: tier.writer_id,
                expires_unix_ms: now + config.lease_ms,
                renewed_unix_ms: now,
            };
            if held.file.write_all_at(&lease.encode(), 0).and_then(|_| held.file.sync_data()).is_ok() {
                held.act_until = started + Duration::from_millis(config.lease_ms * 3 / 4);
                return true;
            }
            st.lease = None;
            return false;
        }
    }
    let lease_dir = tier.dir.join("lease");
    let now = unix_ms();
    let next = match top {
        None => 1,
        Some(g) => {
            if !lease_expired(tier, &lease_dir.join(lease_file_name(g)), now) {
                return false;
            }
            lease::next_generation(g)
        }
    };
    let path = lease_dir.join(lease_file_name(next));
    let started = Instant::now();
    let file = match OpenOptions::new().read(true).write(true).create_new(true).mode(config.file_mode()).open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == ErrorKind::AlreadyExists => return false,
        Err(e) => {
            log::warn!("kvtier: creating the evictor lease {} failed: {e}", path.display());
            return false;
        }
    };
    let lease = Lease {
        generation: next,
        holder: tier.writer_id,
        expires_unix_ms: now + config.lease_ms,
        renewed_unix_ms: now,
    };
    if file.write_all_at(&lease.encode(), 0).and_then(|_| file.sync_data()).is_err() {
        let _ = std::fs::remove_file(&path);
        return false;
    }
    log::info!("kvtier: writer {:016x} holds the shared evictor lease (generation {next})", tier.writer_id);
    for g in gens.into_iter().filter(|&g| g < next) {
        let _ = std::fs::remove_file(lease_dir.join(lease_file_name(g)));
    }
    st.lease =
        Some(HeldLease { generation: next, file, act_until: started + Duration::from_millis(config.lease_ms * 3 / 4) });
    true
}

/// Whether the lease file at `path` (the highest generation) no longer holds anyone off.
fn lease_expired(tier: &SharedTier, path: &Path, now: u64) -> bool {
    let file = match open_regular(path, 0) {
        Ok(file) => file,
        // No process can hold a lease through a FIFO, socket or symlink (and opening a FIFO would
        // have stopped maintenance for good): it holds nobody off, and the next generation is taken
        // above it, which also removes it.
        Err(OpenError::NotRegular(kind)) => {
            Stats::add(&tier.stats.shared_not_regular_files, 1);
            log::warn!(
                "kvtier: evictor lease {} is a {kind}, not a regular file; taking the next generation",
                path.display()
            );
            return true;
        }
        Err(OpenError::Io(_)) => return false,
    };
    let mut buf = [0u8; LEASE_BYTES];
    match file.read_exact_at(&mut buf, 0).ok().and_then(|_| Lease::decode(&buf).ok()) {
        Some(l) => !lease::holds_off(&l, now, tier.config.lease_ms),
        // Torn or unreadable: treat as held until its file has not changed for a whole lease.
        None => file.metadata().map(|m| age_ms(&m) >= tier.config.lease_ms).unwrap_or(false),
    }
}

/// Unlinks doomed files whose grace period is over.
fn unlink_doomed(tier: &SharedTier, st: &EvictorState) {
    let now = unix_ms();
    let due: Vec<String> = tier
        .index
        .read()
        .doomed
        .iter()
        .filter(|(_, (at, _))| now >= at.saturating_add(tier.config.grace_ms))
        .map(|(n, _)| n.clone())
        .collect();
    for name in due {
        if !st.holds_lease() {
            return;
        }
        match std::fs::remove_file(tier.data_path(&name)) {
            Ok(()) => Stats::add(&tier.stats.shared_evicted_files, 1),
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => {
                log::warn!("kvtier: unlinking evicted shared file {name} failed: {e}");
                continue;
            }
        }
        tier.index.write().doomed.remove(&name);
    }
}

/// Dooms files until usage is back at `target_bytes` and every tenant at its cap, least recently
/// used first within a tenant, the tenants in the order of the split (`tenants`).
fn doom(tier: &SharedTier, st: &mut EvictorState, accounts: &mut Accounts<String>, used_bytes: u64, target_bytes: u64) {
    let victims = accounts.victims(used_bytes, target_bytes);
    if victims.is_empty() {
        if used_bytes > target_bytes && !st.warned_nothing_to_evict {
            log::warn!(
                "kvtier: shared usage is above shared_high_watermark but no kvtier file is old enough to evict (all read \
                 or published within shared_grace_ms, or the space is used by others)"
            );
            st.warned_nothing_to_evict = true;
        }
        return;
    }
    st.warned_nothing_to_evict = false;
    if !st.holds_lease() {
        return;
    }
    let count = victims.len();
    let names: Vec<String> = victims.iter().map(|(name, _)| name.clone()).collect();
    // Applying the record drops the files from our index and remembers their sizes with the doom.
    if let Err(e) = tier.append_records(&[Record::Doom { at_unix_ms: unix_ms(), names }]) {
        log::warn!("kvtier: recording evictions failed: {e}");
        return;
    }
    if tier.config.tenant_shares.enabled() {
        tier.tenant_ledger.count_evicted(victims.iter().map(|(_, tag)| *tag));
    }
    log::debug!("kvtier: doomed {count} shared files (usage {used_bytes}, target {target_bytes})");
}

/// Removes temporaries not written for `orphan_tmp_ms` (their writer died).
fn sweep_tmp(tier: &SharedTier, own: &[std::path::PathBuf]) {
    let Ok(entries) = std::fs::read_dir(tier.dir.join("tmp")) else { return };
    for e in entries.flatten() {
        let path = e.path();
        if own.contains(&path) {
            continue;
        }
        let Ok(m) = e.metadata() else { continue };
        if m.is_file() && age_ms(&m) >= tier.config.orphan_tmp_ms {
            log::info!("kvtier: removing orphaned temporary {}", path.display());
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// Removes files in `dir` older than `min_age_ms`.
fn sweep_dir(_tier: &SharedTier, dir: &Path, min_age_ms: u64) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let Ok(m) = e.metadata() else { continue };
        if m.is_file() && age_ms(&m) >= min_age_ms {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Dooms data files that no manifest lists (a writer died between rename and manifest append),
/// once they are older than `orphan_tmp_ms`.
fn doom_unlisted(tier: &SharedTier) {
    let Ok(dirs) = std::fs::read_dir(tier.dir.join("data")) else { return };
    let mut names = Vec::new();
    for d in dirs.flatten() {
        // lstat: a symlink planted in data/ must not lead the evictor to doom (and unlink) files of the
        // same names in a directory elsewhere.
        if !d.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let Ok(files) = std::fs::read_dir(d.path()) else { continue };
        for f in files.flatten() {
            let Some(name) = f.file_name().to_str().map(str::to_string) else { continue };
            if !valid_data_file_name(&name) {
                continue;
            }
            let listed = {
                let index = tier.index.read();
                index.file_id(&name).is_some() || index.is_gone(&name)
            };
            if listed {
                continue;
            }
            if f.metadata().is_ok_and(|m| age_ms(&m) >= tier.config.orphan_tmp_ms) {
                names.push(name);
            }
        }
    }
    if !names.is_empty() {
        log::info!("kvtier: {} shared files are listed in no manifest; evicting them", names.len());
        let _ = tier.append_records(&[Record::Doom { at_unix_ms: unix_ms(), names }]);
    }
}
