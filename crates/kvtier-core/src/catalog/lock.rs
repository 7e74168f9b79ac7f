//! `CatalogLock`, the one mutex over the catalog. A section that changed the catalog ends with its
//! invariants checked (`Catalog::check_invariants`) in debug builds: when the guard drops, and before
//! a wait on a condition variable lets other threads in. Release builds check nothing (the walk is
//! O(blocks)); `cargo test` in debug runs every store test with the checks on.

use super::Catalog;
use parking_lot::{Condvar, Mutex, MutexGuard, WaitTimeoutResult};
use std::ops::{Deref, DerefMut};
use std::time::Instant;

const CHECK_SECTIONS: bool = cfg!(debug_assertions);

pub struct CatalogLock(Mutex<Catalog>);

/// The catalog, locked. Reading through it is free; the first write marks the section as changed.
pub struct CatalogGuard<'a> {
    guard: MutexGuard<'a, Catalog>,
    changed: bool,
}

impl CatalogLock {
    pub fn new(catalog: Catalog) -> Self {
        CatalogLock(Mutex::new(catalog))
    }

    pub fn lock(&self) -> CatalogGuard<'_> {
        CatalogGuard { guard: self.0.lock(), changed: false }
    }
}

impl CatalogGuard<'_> {
    /// Waits on `cv` until notified or `deadline`; the lock is released meanwhile, so the section so
    /// far ends here.
    pub fn wait_until(&mut self, cv: &Condvar, deadline: Instant) -> WaitTimeoutResult {
        self.section_ends();
        cv.wait_until(&mut self.guard, deadline)
    }

    fn section_ends(&mut self) {
        if CHECK_SECTIONS && std::mem::take(&mut self.changed) {
            self.guard.check_invariants();
        }
    }
}

impl Deref for CatalogGuard<'_> {
    type Target = Catalog;

    fn deref(&self) -> &Catalog {
        &self.guard
    }
}

impl DerefMut for CatalogGuard<'_> {
    fn deref_mut(&mut self) -> &mut Catalog {
        self.changed = true;
        &mut self.guard
    }
}

impl Drop for CatalogGuard<'_> {
    fn drop(&mut self) {
        // A panic inside the section already failed; a second one would abort the process.
        if !std::thread::panicking() {
            self.section_ends();
        }
    }
}
