//! The write budgets below DRAM across restarts: resumed at open from the namespace's
//! `WRITE_BUDGET` file (`format::budget`), saved with its block dates (`Store::save_namespace_state`).
//! Without this each open started every budget full: a day's burst by default, so a service started
//! again every hour could write 24 days' budget a day.

use crate::admission::WriteBudget;
use crate::catalog::Tier;
use crate::format::budget::SavedBudgets;
use crate::store_state::StoreState;
use parking_lot::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Each bounded write budget below DRAM, by tier.
pub(crate) fn by_tier(state: &StoreState) -> Vec<(Tier, &Mutex<WriteBudget>)> {
    let nvme = state.admission.nvme_write_budget().map(|budget| (Tier::Nvme, &**budget));
    nvme.into_iter().chain(state.remote.write_budgets()).collect()
}

/// Each bounded write budget below DRAM, by its tier's code on the wire.
fn budgets(state: &StoreState) -> Vec<(u32, &Mutex<WriteBudget>)> {
    by_tier(state).into_iter().map(|(tier, budget)| (u32::from(Tier::wire_code(Some(tier))), budget)).collect()
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |since| since.as_millis() as u64)
}

/// At open, from the files of the namespace directories beside `dir` (the first path's) of a store
/// with an NVMe tier (without one nothing is saved), `dir`'s own included. A budget keeps the least
/// of what each file resumes it to: the latest save, refilled since, is the least.
pub(crate) fn resume_from_dir(state: &StoreState, dir: &std::path::Path) {
    if state.geometry.is_none() {
        return;
    }
    // The budgets are the store's, shared by its namespaces: each resumes from every namespace's
    // file, not only those of the namespaces opened so far (one that spent the budget and has not
    // come back since must still count).
    let namespaces = dir.parent().and_then(|store| std::fs::read_dir(store).ok());
    let dirs = namespaces.into_iter().flatten().filter_map(|entry| entry.ok().map(|entry| entry.path()));
    for namespace_dir in dirs.filter(|path| path.join(crate::namespace_dir::BUDGET_FILE_NAME).is_file()) {
        let file = namespace_dir.join(crate::namespace_dir::BUDGET_FILE_NAME);
        resume(state, crate::namespace_dir::read_budgets(&namespace_dir), &file);
    }
}

/// How far in the future a save may be dated and still count (as saved now): clocks of one host
/// disagree by less. A file dated later was written by a clock that ran ahead; resuming from it
/// would hold the budget near what it had then at every open until that date, days away perhaps.
const FUTURE_SAVE_SLACK_MS: u64 = 5 * 60 * 1000;

/// Each budget the file names resumes what it had left at the save, refilled since (a
/// clock that went back a little refills nothing); one it does not name starts full.
fn resume(state: &StoreState, saved: Option<SavedBudgets>, file: &std::path::Path) {
    let Some(saved) = saved else { return };
    let now_unix_ms = unix_ms();
    if saved.saved_unix_ms > now_unix_ms.saturating_add(FUTURE_SAVE_SLACK_MS) {
        log::warn!(
            "kvtier: {} was saved {} s in the future (a clock that ran ahead?); its write budgets are not resumed",
            file.display(),
            (saved.saved_unix_ms - now_unix_ms) / 1000
        );
        return;
    }
    let elapsed = Duration::from_millis(now_unix_ms.saturating_sub(saved.saved_unix_ms));
    let now = Instant::now();
    for (code, budget) in budgets(state) {
        if let Some(&(_, left_bytes)) = saved.entries.iter().find(|(tier, _)| *tier == code) {
            budget.lock().resume(left_bytes, elapsed, now);
        }
    }
}

/// What the budgets have left now, with the count of their changes, when they changed since a save
/// that counted `saved_changes` (a refill alone is no change: the reader refills from the save's time).
pub(crate) fn to_save(state: &StoreState, saved_changes: u64) -> Option<(SavedBudgets, u64)> {
    let now = Instant::now();
    let mut changes = 0;
    let entries: Vec<(u32, u64)> = budgets(state)
        .into_iter()
        .map(|(code, budget)| {
            let mut budget = budget.lock();
            changes += budget.changes();
            (code, budget.left_bytes_for_save(now))
        })
        .collect();
    let changed = !entries.is_empty() && changes != saved_changes;
    changed.then(|| (SavedBudgets { saved_unix_ms: unix_ms(), entries }, changes))
}

/// Whether a budget spent enough since its last save to be saved now, before the save period.
pub(crate) fn save_due(state: &StoreState) -> bool {
    budgets(state).into_iter().any(|(_, budget)| budget.lock().save_due())
}
