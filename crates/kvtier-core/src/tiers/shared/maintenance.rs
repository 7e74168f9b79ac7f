//! The maintenance thread: every `staleness_ms / 2` it tails the manifests, records file accesses,
//! publishes a file that waited `publish_delay_ms` and runs the capacity rules.

use super::format::{unix_ms, Record};
use super::root::{create_file, make_dir};
use super::{capacity, SharedTier};
use crate::error::{Error, Result};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

impl SharedTier {
    /// Appends one access record for files read since the last one (each file at most once per
    /// `grace_ms / 4`: recency needs that resolution, not more).
    pub(super) fn flush_accesses(&self) {
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

    pub(super) fn start_maintenance(self: &Arc<Self>) -> Result<()> {
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
        // Timed, as the tier's heartbeat: a mount that hangs shows here first.
        let refreshed = self.heartbeat.refresh(|| {
            if !self.dir.join("manifests").is_dir() && !self.closed.load(Ordering::Acquire) {
                self.recreate_layout();
            }
            self.refresh()
        });
        if let Err(e) = refreshed {
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
}
