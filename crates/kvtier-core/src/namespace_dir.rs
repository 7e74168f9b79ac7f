//! The files beside a namespace's device file, in `<path>/<namespace hex>/`: the engines'
//! DESCRIPTION and the saved TIMELINE. Written with a temporary file and a rename, so that a reader
//! sees the old file or the new one, never a part.

use crate::error::{Error, Result};
use crate::format::timeline;
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
    std::fs::write(&tmp, timeline::encode(points))
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| Error::io(format!("writing {} (is the directory writable?)", path.display()), e))
}

/// Records the engines' description next to the namespace's files (once; atomically), so that
/// operator tools can name the model and open the namespace without an engine.
pub(crate) fn write_description(dir: &Path, description: &[u8]) -> Result<()> {
    let path = dir.join(DESCRIPTION_FILE_NAME);
    if path.exists() {
        return Ok(());
    }
    let tmp = dir.join(format!("{DESCRIPTION_FILE_NAME}.tmp.{}", std::process::id()));
    std::fs::write(&tmp, description)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| Error::io(format!("writing {} (is the directory writable?)", path.display()), e))
}
