//! The namespace's files saved beside its device files as the store runs: the timeline that dates
//! its blocks and what its write budgets have left (docs/format.md).

use super::{budgets, Store};
use crate::error::{Error, Result};
use crate::io::bounded::{finish_within, Overdue};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

impl Store {
    /// Saves the timeline that dates this namespace's blocks and what its write budgets have left
    /// (`WRITE_BUDGET`), each when it changed since the last save (stores with an NVMe tier: without
    /// one nothing survives a restart). `flush` and `close` call it; so does the host service, every
    /// few seconds. With `nvme_read_stall_ms` set, the files are written on a thread of their own,
    /// waited for one stall limit: a frozen filesystem must not hold the service's janitor or a close.
    /// While such a write is still waiting, no other is started (one thread per frozen directory).
    pub fn save_namespace_state(&self) -> Result<()> {
        self.save_files(true)
    }

    /// Saves the write budgets, and only them, once one spent a step of its burst since its last
    /// save (the host service asks every janitor round): a crash forgets at most that step of
    /// each, not the save period's writes.
    pub fn save_budgets_if_due(&self) -> Result<()> {
        if budgets::save_due(&self.state) {
            return self.save_files(false);
        }
        Ok(())
    }

    /// `save_namespace_state`, the dates only with `dates`.
    fn save_files(&self, dates: bool) -> Result<()> {
        let sh = &self.state;
        let Some(dir) = sh.device_files.first().and_then(|d| d.path.parent()) else { return Ok(()) };
        let stall = Duration::from_millis(sh.config.nvme_read_stall_ms);
        if self.dates_saving.swap(true, Ordering::AcqRel) {
            return Ok(()); // the earlier save still waits (its failure was reported); these stay unsaved
        }
        let points = if dates { sh.catalog.lock().timeline.take_unsaved() } else { None };
        let budgets = budgets::to_save(sh, self.budgets_saved_changes.load(Ordering::Acquire));
        if points.is_none() && budgets.is_none() {
            self.dates_saving.store(false, Ordering::Release);
            return Ok(());
        }
        let dates_taken = points.is_some();
        let (dir, saving, saved_changes) =
            (dir.to_path_buf(), Arc::clone(&self.dates_saving), Arc::clone(&self.budgets_saved_changes));
        let save = move || {
            let dates = points.map_or(Ok(()), |points| crate::namespace_dir::write_timeline(&dir, &points));
            let budgets = budgets.map_or(Ok(()), |(budgets, changes)| {
                crate::namespace_dir::write_budgets(&dir, &budgets)
                    .map(|()| saved_changes.store(changes, Ordering::Release))
            });
            saving.store(false, Ordering::Release);
            dates.and(budgets)
        };
        let saved = if stall.is_zero() {
            save()
        } else {
            finish_within("kvtier-dates", stall, save).unwrap_or_else(|overdue| {
                if let Overdue::NoThread(_) = overdue {
                    self.dates_saving.store(false, Ordering::Release);
                }
                Err(Error::Timeout {
                    what: "saving block dates and write budgets (a hung disk?)".into(),
                    timeout_ms: stall.as_millis() as u64,
                })
            })
        };
        saved.inspect_err(|_| {
            if dates_taken {
                sh.catalog.lock().timeline.mark_unsaved();
            }
        })
    }
}
