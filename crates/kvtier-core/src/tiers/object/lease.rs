//! The evictor lease: of the stores with a budget on one prefix, only the holder evicts. Lease
//! records are the shared tier's (`format::shared::Lease`, 64 bytes), one object per generation,
//! `lease/<generation 16 hex>.lease`, each created with a conditional PUT (`If-None-Match: *`), so
//! two stores cannot both win the same generation; the highest generation listed is in force. Which
//! generation is in force and whether a record holds others off are the remote tiers' common rules
//! (`tiers::remote::lease`): a forged generation or expiry is ignored, as the shared tier does.

use super::BucketTier;
use crate::format::shared::{lease_file_name, parse_lease_file_name, unix_ms, Lease, LEASE_BYTES};
use crate::stats::Stats;
use crate::tiers::remote::lease::{generation_in_force, holds_off, next_generation};
use object_store::path::Path as ObjectPath;
use object_store::{PutMode, PutOptions, PutPayload};
use std::sync::atomic::Ordering;

impl BucketTier {
    fn lease_path(&self, generation: u64) -> ObjectPath {
        ObjectPath::from(format!("{}/lease/{}", self.base, lease_file_name(generation)))
    }

    /// The generation in force (the highest genuine one listed) and its record (`None`: unreadable
    /// or gone: treated as expired).
    fn current_lease(&self) -> std::io::Result<(u64, Option<Lease>)> {
        let listed = self.list_within("lease", LEASE_BYTES as u64)?;
        let generations = listed.iter().filter_map(|m| parse_lease_file_name(m.location.filename()?));
        let Some(generation) = generation_in_force(generations) else {
            return Ok((0, None));
        };
        Stats::add(&self.stats.bucket_get_requests, 1);
        let (store, path, timeout) = (&self.store, self.lease_path(generation), self.timeout());
        let got = self
            .rt
            .block_on(async { tokio::time::timeout(timeout, async { store.get(&path).await?.bytes().await }).await });
        match got {
            Ok(Ok(bytes)) => Ok((generation, Lease::decode(&bytes).ok())),
            Ok(Err(object_store::Error::NotFound { .. })) => Ok((generation, None)),
            Ok(Err(e)) => Err(std::io::Error::from(e)),
            Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "lease GET timed out")),
        }
    }

    /// Creates generation `lease.generation` unless it exists: `Ok(false)` when another store won it.
    fn create_lease(&self, lease: &Lease) -> std::io::Result<bool> {
        Stats::add(&self.stats.bucket_put_requests, 1);
        let (store, path, timeout) = (&self.store, self.lease_path(lease.generation), self.timeout());
        let opts = PutOptions { mode: PutMode::Create, ..PutOptions::default() };
        let payload = PutPayload::from(lease.encode().to_vec());
        let r = self.rt.block_on(async { tokio::time::timeout(timeout, store.put_opts(&path, payload, opts)).await });
        match r {
            Ok(Ok(_)) => Ok(true),
            Ok(Err(object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. })) => Ok(false),
            Ok(Err(e)) => Err(std::io::Error::from(e)),
            Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "lease PUT timed out")),
        }
    }

    /// Takes the lease when it is free or expired, renews ours past half its term; whether this
    /// store holds it now. A failed request counts as not holding it (no eviction this pass).
    pub(super) fn hold_lease(&self) -> bool {
        let held = self.try_hold_lease().unwrap_or_else(|e| {
            log::debug!("kvtier: bucket lease: {e}");
            Stats::add(&self.stats.bucket_request_errors, 1);
            false
        });
        self.lease_held.store(held, Ordering::Release);
        held
    }

    fn try_hold_lease(&self) -> std::io::Result<bool> {
        let now = unix_ms();
        let (generation, current) = self.current_lease()?;
        let live = current.as_ref().filter(|l| holds_off(l, now, self.config.lease_ms));
        match live {
            Some(l) if l.holder != self.writer_id => return Ok(false),
            Some(l) if l.renewed_unix_ms + self.config.lease_ms / 2 > now => return Ok(true),
            _ => {}
        }
        let next = Lease {
            generation: next_generation(generation),
            holder: self.writer_id,
            expires_unix_ms: now + self.config.lease_ms,
            renewed_unix_ms: now,
        };
        if !self.create_lease(&next)? {
            return Ok(false);
        }
        if generation > 0 {
            // Only the newest generation matters; older ones are clutter.
            let _ = self.delete(&self.lease_path(generation));
        }
        Ok(true)
    }

    /// Gives the lease up at close (a released record: expired at once), so another store with a
    /// budget takes over at its next pass instead of after the lease's term.
    pub(super) fn release_lease(&self) {
        if !self.lease_held.swap(false, Ordering::AcqRel) {
            return;
        }
        let released = self.current_lease().and_then(|(generation, current)| {
            if current.is_some_and(|l| l.holder == self.writer_id) {
                let record = Lease {
                    generation: next_generation(generation),
                    holder: self.writer_id,
                    expires_unix_ms: 0,
                    renewed_unix_ms: unix_ms(),
                };
                if self.create_lease(&record)? {
                    let _ = self.delete(&self.lease_path(generation));
                }
            }
            Ok(())
        });
        if let Err(e) = released {
            log::debug!("kvtier: releasing the bucket lease: {e}; it expires by itself");
        }
    }
}
