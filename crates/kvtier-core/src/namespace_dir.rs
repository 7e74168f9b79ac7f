//! The files beside a namespace's device file, in `<path>/<namespace hex>/`: the engines'
//! DESCRIPTION and the saved TIMELINE. Written with a temporary file and a rename, so that a reader
//! sees the old file or the new one, never a part.

use crate::error::{Error, Result};
use crate::format::{budget, timeline};
use std::path::Path;

/// The namespace description, as engines gave it, in `<path>/<namespace hex>/DESCRIPTION`.
pub const DESCRIPTION_FILE_NAME: &str = "DESCRIPTION";
/// The namespace's saved timeline (`format::timeline`), in the first path's namespace directory.
pub const TIMELINE_FILE_NAME: &str = "TIMELINE";

/// The saved timeline of the namespace in `dir`; empty (blocks dated by the open) when there is
/// none, or when it is damaged or foreign (logged: dates are a convenience, never worth a failed open).
pub(crate) fn read_timeline(dir: &Path) -> Vec<(u64, u64)> {
    let path = dir.join(TIMELINE_FILE_NAME);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            log::warn!("kvtier: cannot read {} ({e}); recovered blocks are dated by this open", path.display());
            return Vec::new();
        }
    };
    timeline::decode(&bytes).unwrap_or_else(|e| {
        log::warn!("kvtier: {} rejected ({e}); recovered blocks are dated by this open", path.display());
        Vec::new()
    })
}

/// Replaces the namespace's saved timeline (a temporary file, then a rename).
pub(crate) fn write_timeline(dir: &Path, points: &[(u64, u64)]) -> Result<()> {
    let path = dir.join(TIMELINE_FILE_NAME);
    // Unique per call: the service's periodic save and a flush may write at once.
    static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let save = SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!("{TIMELINE_FILE_NAME}.tmp.{}.{save}", std::process::id()));
    replace_file(&tmp, &path, &timeline::encode(points))
}

/// What the namespace's write budgets had left (`format::budget`), in the first path's namespace directory.
pub const BUDGET_FILE_NAME: &str = "WRITE_BUDGET";

/// The namespace's saved write budgets; `None` when there are none, or when the file is damaged or
/// foreign (logged: the budgets then start full, as at a first open).
pub(crate) fn read_budgets(dir: &Path) -> Option<budget::SavedBudgets> {
    let path = dir.join(BUDGET_FILE_NAME);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            log::warn!("kvtier: cannot read {} ({e}); the write budgets start full", path.display());
            return None;
        }
    };
    budget::decode(&bytes)
        .inspect_err(|e| log::warn!("kvtier: {} rejected ({e}); the write budgets start full", path.display()))
        .ok()
}

/// Replaces the namespace's saved write budgets (a temporary file, then a rename).
pub(crate) fn write_budgets(dir: &Path, saved: &budget::SavedBudgets) -> Result<()> {
    let path = dir.join(BUDGET_FILE_NAME);
    static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let save = SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!("{BUDGET_FILE_NAME}.tmp.{}.{save}", std::process::id()));
    replace_file(&tmp, &path, &budget::encode(saved))
}

/// Records the engines' description next to the namespace's files (once; atomically), so that
/// operator tools can name the model and open the namespace without an engine.
pub(crate) fn write_description(dir: &Path, description: &[u8]) -> Result<()> {
    let path = dir.join(DESCRIPTION_FILE_NAME);
    if path.exists() {
        return Ok(());
    }
    let tmp = dir.join(format!("{DESCRIPTION_FILE_NAME}.tmp.{}", std::process::id()));
    replace_file(&tmp, &path, description)
}

/// Writes `bytes` to `tmp`, then renames it to `path`. A failed write or rename removes `tmp`: the
/// timeline's save is retried every few seconds under a new name, so each failure would otherwise
/// leave one more file (issue 24 item 8).
fn replace_file(tmp: &Path, path: &Path, bytes: &[u8]) -> Result<()> {
    // Synced before the rename: after a power loss the file is the old one or the new one, not empty.
    let write_synced = || {
        let mut file = std::fs::File::create(tmp)?;
        std::io::Write::write_all(&mut file, bytes)?;
        file.sync_data()
    };
    write_synced().and_then(|()| std::fs::rename(tmp, path)).map_err(|e| {
        // Best effort: the error worth reporting is the write's (the file may not even exist).
        let _ = std::fs::remove_file(tmp);
        Error::io(format!("writing {} (is the directory writable?)", path.display()), e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The files in `dir`, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        names
    }

    #[test]
    fn a_failed_timeline_save_leaves_no_temporary_file() {
        // The rename fails on every try (a directory where the file goes), as a save retried by
        // the service every few seconds would: no try may leave its temporary file behind.
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(TIMELINE_FILE_NAME)).unwrap();
        std::fs::write(dir.path().join(TIMELINE_FILE_NAME).join("keep"), b"x").unwrap();
        for _ in 0..3 {
            assert!(write_timeline(dir.path(), &[(10, 1_000)]).is_err());
        }
        assert_eq!(names(dir.path()), [TIMELINE_FILE_NAME]);
        std::fs::remove_dir_all(dir.path().join(TIMELINE_FILE_NAME)).unwrap();
        write_timeline(dir.path(), &[(10, 1_000)]).unwrap();
        assert_eq!(read_timeline(dir.path()), [(10, 1_000)]);
        assert_eq!(names(dir.path()), [TIMELINE_FILE_NAME], "a save that succeeds leaves only its file");
    }
}
