//! The service's socket and pid file at their paths, against the other processes that act there:
//! another service started at the same moment (by hand, by systemd, by an engine: only engines
//! coordinate among themselves), a service starting while this one stops, a service sweeping the
//! sockets dead ones left.
//!
//! Each of them looks at what is at a socket's path and then acts on it: is a live service there,
//! remove a dead one's socket, bind; at stop, remove the pid file and the socket. Done apart, two
//! services started at once each found the old socket refusing, removed what was at the path and
//! bound their own, so one removed the other's live socket (and later, stopping, removed the other's
//! again). Here every such look-then-act runs under one lock per socket path (`PathLock`, an
//! `flock` of `<socket>.path-lock`, held for microseconds), and a service removes only the socket
//! it bound (its inode) and a pid file that names its own process. With its socket it removes the
//! path's lock files (they piled up, a pair per store path ever served): a lock file is removed only
//! while locked, and a lock counts only once its file is checked to be still at its path (`is_at`).

use crate::error::{Error, Result};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A file's `(device, inode)`: what names one socket whatever is at its path later.
pub(super) type FileId = (u64, u64);

/// How long a service waits for another one's look-then-act at the same socket path.
const PATH_LOCK_WAIT: Duration = Duration::from_secs(5);
const PATH_LOCK_POLL: Duration = Duration::from_millis(5);

/// The lock of one socket path, held while a service looks at what is there and acts on it.
struct PathLock(#[allow(dead_code)] std::fs::File);

impl PathLock {
    fn path(socket_path: &Path) -> PathBuf {
        socket_path.with_extension("path-lock")
    }

    fn open(socket_path: &Path) -> std::io::Result<std::fs::File> {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(Self::path(socket_path))
    }

    /// Waits (at most `PATH_LOCK_WAIT`) for the lock of `socket_path`.
    fn take(socket_path: &Path) -> Result<PathLock> {
        let lock_path = Self::path(socket_path);
        let deadline = Instant::now() + PATH_LOCK_WAIT;
        loop {
            let file = Self::open(socket_path).map_err(|e| Error::io(format!("opening {}", lock_path.display()), e))?;
            match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
                Ok(()) if is_at(&file, &lock_path) => return Ok(PathLock(file)),
                Ok(()) => continue, // removed while we waited (`remove_lock_files`): lock the file there now
                Err(_) if Instant::now() < deadline => std::thread::sleep(PATH_LOCK_POLL),
                Err(e) => {
                    return Err(Error::config(
                        "service_socket",
                        format!(
                            "another process has held {} for over {PATH_LOCK_WAIT:?} ({e}): a kvtier service starting \
                             or stopping on {} is hung; stop it (kvtier service stop PATH) and start again",
                            lock_path.display(),
                            socket_path.display()
                        ),
                    ))
                }
            }
        }
    }

    /// The lock of `socket_path` if nobody holds it now.
    fn try_take(socket_path: &Path) -> Option<PathLock> {
        let file = Self::open(socket_path).ok()?;
        rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).ok()?;
        is_at(&file, &Self::path(socket_path)).then_some(PathLock(file))
    }
}

/// Whether `file` is the file at `path` now. A lock file is removed while locked
/// (`remove_lock_files`), so a lock taken on a file no longer at its path locks nothing: everyone
/// who locks one checks this after the lock is taken (Python's `ensure_service` too).
fn is_at(file: &std::fs::File, path: &Path) -> bool {
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(held), Ok(there)) => file_id(&held) == file_id(&there),
        _ => false,
    }
}

/// Removes the lock files of a socket path whose service is gone, so that they do not pile up in
/// the socket directory (one pair per store path ever served): the path lock, held by the caller,
/// and the engines' start lock (`<socket>.lock`, `kvtier.service.ensure_service`) unless an engine
/// holds it now (it is starting a service there). Each is removed while locked: whoever waited on it
/// finds it gone once the lock is theirs, and locks the file at the path then.
fn remove_lock_files(socket_path: &Path, held: PathLock) {
    let path_lock = PathLock::path(socket_path);
    if is_at(&held.0, &path_lock) {
        let _ = std::fs::remove_file(&path_lock);
    }
    drop(held);
    let start_lock = socket_path.with_extension("lock");
    let opened =
        std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC).open(&start_lock);
    if let Ok(file) = opened {
        let locked = rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok();
        if locked && is_at(&file, &start_lock) {
            let _ = std::fs::remove_file(&start_lock);
        }
    }
}

fn file_id(meta: &std::fs::Metadata) -> FileId {
    (meta.dev(), meta.ino())
}

/// Creates the socket's directory (0700) and the socket (0600): a dead service's socket is
/// replaced, a live one's is an error. Returns the listener and the socket file's identity.
pub(super) fn bind(socket_path: &Path) -> Result<(UnixListener, FileId)> {
    if let Some(dir) = socket_path.parent() {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(|e| {
            Error::io(format!("creating the service socket directory {} (give a writable path)", dir.display()), e)
        })?;
        check_private_dir(dir)?;
    }
    let _lock = PathLock::take(socket_path)?;
    if std::fs::symlink_metadata(socket_path).is_ok() {
        if UnixStream::connect(socket_path).is_ok() {
            return Err(Error::config(
                "service_socket",
                format!(
                    "a kvtier service already serves {}; use it, or stop it first (one service per store path)",
                    socket_path.display()
                ),
            ));
        }
        let _ = std::fs::remove_file(socket_path);
    }
    let listener = UnixListener::bind(socket_path)
        .map_err(|e| Error::io(format!("binding the service socket {}", socket_path.display()), e))?;
    std::fs::set_permissions(socket_path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| Error::io(format!("chmod 0600 {}", socket_path.display()), e))?;
    let meta = std::fs::symlink_metadata(socket_path)
        .map_err(|e| Error::io(format!("stat of the service socket {}", socket_path.display()), e))?;
    Ok((listener, file_id(&meta)))
}

/// Removes this service's pid file (`<socket>.pid`, written by `kvtier serve`) if it names this
/// process, then its socket if the path still names the socket it bound (`id`). The pid file goes
/// first: once the socket is gone another service may start and write its own.
pub(super) fn release(socket_path: &Path, id: FileId) {
    let lock = PathLock::take(socket_path);
    if lock.is_err() {
        log::warn!("kvtier: removing the socket {} without its path lock", socket_path.display());
    }
    let pid_path = socket_path.with_extension("pid");
    let names_us = std::fs::read_to_string(&pid_path)
        .ok()
        .and_then(|text| text.split_whitespace().next().and_then(|pid| pid.parse::<u32>().ok()))
        == Some(std::process::id());
    if names_us {
        let _ = std::fs::remove_file(&pid_path);
    }
    if std::fs::symlink_metadata(socket_path).is_ok_and(|meta| file_id(&meta) == id) {
        let _ = std::fs::remove_file(socket_path);
    }
    // Whoever serves the path now (a second release after the idle exit's, another service): a lock
    // file removed while locked is safe to remove, and the lock just taken may have created it.
    if let Ok(lock) = lock {
        remove_lock_files(socket_path, lock);
    }
}

/// Removes the sockets in `dir` (but `own`) that nothing listens on, with their pid files: a
/// service killed with SIGKILL leaves them. A socket whose path lock is held is left alone: a
/// service is binding it (between bind and listen it refuses connections too).
pub(super) fn remove_dead_sockets(dir: &Path, own: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let is_socket = entry.file_type().is_ok_and(|t| std::os::unix::fs::FileTypeExt::is_socket(&t));
        if !is_socket || path == own {
            continue;
        }
        let Some(lock) = PathLock::try_take(&path) else { continue };
        let refused = matches!(UnixStream::connect(&path), Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused);
        if refused && std::fs::remove_file(&path).is_ok() {
            let _ = std::fs::remove_file(path.with_extension("pid"));
            remove_lock_files(&path, lock);
            log::info!("kvtier: removed the socket {} of a service that is gone", path.display());
        }
    }
}

/// The socket's directory must be ours and closed to others: someone who can write it could put
/// their own socket in place of the service's.
fn check_private_dir(dir: &Path) -> Result<()> {
    let meta = std::fs::symlink_metadata(dir)
        .map_err(|e| Error::io(format!("stat of the service socket directory {}", dir.display()), e))?;
    let me = rustix::process::geteuid().as_raw();
    if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o022 != 0 {
        return Err(Error::config(
            "service_socket",
            format!(
                "{} is not a directory owned by uid {me} and closed to writes by others (owner uid {}, mode {:o}); \
                 remove it so kvtier can create it 0700, or choose another socket path",
                dir.display(),
                meta.uid(),
                meta.mode() & 0o7777
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A service removes a path's lock file while it holds it; a process that waited on that file
    /// must not count the lock it then gets (on a file no longer at the path), or it and whoever
    /// locks the new file at the path would both act there at once.
    #[test]
    fn a_lock_taken_on_a_removed_lock_file_is_taken_again_on_the_file_at_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("kvtier.sock");
        let first = PathLock::take(&socket).unwrap();
        let waiting = socket.clone();
        let waiter = std::thread::spawn(move || PathLock::take(&waiting).unwrap());
        std::thread::sleep(Duration::from_millis(100)); // the waiter polls the first file's lock
        remove_lock_files(&socket, first);
        let held = waiter.join().unwrap();
        assert!(is_at(&held.0, &PathLock::path(&socket)), "the waiter holds a lock on a removed file");
        assert!(PathLock::try_take(&socket).is_none(), "two processes hold the path's lock at once");
        drop(held);
        assert!(PathLock::try_take(&socket).is_some());
    }

    /// The engines' start lock goes with the path lock, unless an engine holds it (it is starting a
    /// service on the path).
    #[test]
    fn the_start_lock_is_removed_unless_an_engine_holds_it() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("kvtier.sock");
        let start_lock = socket.with_extension("lock");
        let engine = std::fs::File::create(&start_lock).unwrap();
        rustix::fs::flock(&engine, rustix::fs::FlockOperation::NonBlockingLockExclusive).unwrap();
        remove_lock_files(&socket, PathLock::take(&socket).unwrap());
        assert!(start_lock.exists() && !PathLock::path(&socket).exists());
        drop(engine);
        remove_lock_files(&socket, PathLock::take(&socket).unwrap());
        assert!(!start_lock.exists() && !PathLock::path(&socket).exists());
    }
}
