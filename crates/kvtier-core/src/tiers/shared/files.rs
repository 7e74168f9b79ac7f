//! Opening what is already under the shared root. Anyone who can write the root (no deployment key
//! needed) can put something other than a regular file where kvtier expects one: a FIFO, whose plain
//! `open` blocks until a writer comes (a load or the maintenance thread stuck for good), a socket, a
//! device, or a symlink to anywhere. Every open of an existing data file, manifest or lease goes
//! through [`open_regular`]: it never waits on such a thing and never follows a final symlink, and what
//! it refuses is a typed error the caller turns into a counted miss or a skipped entry. (Files kvtier
//! creates are opened with `O_CREAT | O_EXCL`, which fails on any existing name, symlinks included.)

use crossbeam_channel::{bounded, Sender};
use parking_lot::Mutex;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long a load waits for a data file to open: past it, the block is a counted miss.
pub(crate) const OPEN_WAIT: Duration = Duration::from_secs(1);

/// One open of `path` with `flags`, answered on `reply`.
type OpenRequest = (PathBuf, i32, Sender<Result<File, OpenError>>);

/// Opens data files for loads on a thread of its own: on a frozen filesystem (a FUSE daemon stopped,
/// a hung NFS server) `open` itself blocks, and a load must not (`remote_read_stall_ms` bounds its
/// reads, not its opens). A load waits [`OPEN_WAIT`] for its open; while one open is held, the next
/// ones fail at once, so a frozen mount holds one thread, never a load.
pub(crate) struct Opener {
    requests: Mutex<Option<Sender<OpenRequest>>>,
    /// An open is in progress (set by the caller, cleared by the thread before it answers).
    busy: Arc<AtomicBool>,
}

impl Opener {
    pub(crate) fn start() -> std::io::Result<Opener> {
        let (tx, rx) = crossbeam_channel::unbounded::<OpenRequest>();
        let busy = Arc::new(AtomicBool::new(false));
        let done = Arc::clone(&busy);
        // Detached: a thread held by a frozen filesystem ends once it thaws (or with the process).
        std::thread::Builder::new().name("kvtier-shared-open".into()).spawn(move || {
            for (path, flags, reply) in rx {
                let opened = open_regular(&path, flags);
                done.store(false, Ordering::Release);
                let _ = reply.send(opened);
            }
        })?;
        Ok(Opener { requests: Mutex::new(Some(tx)), busy })
    }

    /// `open_regular(path, flags)`, within [`OPEN_WAIT`]; a timeout or a held open is an `Io` error.
    pub(crate) fn open(&self, path: &Path, flags: i32) -> Result<File, OpenError> {
        if self.busy.swap(true, Ordering::AcqRel) {
            return Err(OpenError::Io(std::io::Error::new(
                std::io::ErrorKind::WouldBlock,
                "another open under the shared root is still held (is the filesystem frozen?)",
            )));
        }
        let (reply, answer) = bounded(1);
        let sent = self.requests.lock().as_ref().is_some_and(|tx| tx.send((path.to_path_buf(), flags, reply)).is_ok());
        if !sent {
            self.busy.store(false, Ordering::Release);
            return Err(OpenError::Io(std::io::Error::other("the shared tier is closed")));
        }
        answer.recv_timeout(OPEN_WAIT).unwrap_or_else(|_| {
            Err(OpenError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("opening {} took over {OPEN_WAIT:?} (is the filesystem frozen?)", path.display()),
            )))
        })
    }

    /// Ends the thread once it is done with what it holds.
    pub(crate) fn close(&self) {
        self.requests.lock().take();
    }
}

/// Why a path under the shared root was not opened.
#[derive(Debug)]
pub(crate) enum OpenError {
    /// Not a regular file (a symlink, FIFO, socket, device or directory, named here): never read
    /// from, written to or waited on.
    NotRegular(&'static str),
    /// The open itself failed (missing, permissions, I/O).
    Io(std::io::Error),
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpenError::NotRegular(kind) => write!(f, "a {kind}, not a regular file"),
            OpenError::Io(e) => e.fmt(f),
        }
    }
}

/// Opens an existing regular file for reading, with `extra_flags` (such as `O_DIRECT`). `O_NONBLOCK`
/// makes the open of a FIFO return at once instead of waiting for a writer; `O_NOFOLLOW` refuses a
/// final symlink; the fstat then refuses anything but a regular file. The returned file is blocking
/// again: reads of regular files mostly ignore the flag, but io_uring, for one, may answer EAGAIN for it
/// where a filesystem cannot read without blocking, and no reader should have to know.
pub(crate) fn open_regular(path: &Path, extra_flags: i32) -> Result<File, OpenError> {
    let opened = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC | extra_flags)
        .open(path);
    let file = match opened {
        Ok(file) => file,
        // ELOOP (a symlink), ENXIO (a socket), ...: say what is there when it is no regular file.
        Err(e) => {
            return Err(match std::fs::symlink_metadata(path) {
                Ok(m) if !m.file_type().is_file() => OpenError::NotRegular(kind_of(m.file_type())),
                _ => OpenError::Io(e),
            })
        }
    };
    let file_type = file.metadata().map_err(OpenError::Io)?.file_type();
    if !file_type.is_file() {
        return Err(OpenError::NotRegular(kind_of(file_type)));
    }
    let flags = rustix::fs::fcntl_getfl(&file).map_err(|e| OpenError::Io(e.into()))?;
    rustix::fs::fcntl_setfl(&file, flags - rustix::fs::OFlags::NONBLOCK).map_err(|e| OpenError::Io(e.into()))?;
    Ok(file)
}

/// Opens a directory under the root (to fsync it): `O_DIRECTORY` fails on anything else before a FIFO
/// could block the open, and a symlinked directory is refused.
pub(crate) fn open_dir(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
}

fn kind_of(t: std::fs::FileType) -> &'static str {
    if t.is_symlink() {
        "symlink"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_socket() {
        "socket"
    } else if t.is_block_device() || t.is_char_device() {
        "device"
    } else if t.is_dir() {
        "directory"
    } else {
        "special file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};

    fn mkfifo(path: &Path) {
        rustix::fs::mknodat(
            rustix::fs::CWD,
            path,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::RUSR.union(rustix::fs::Mode::WUSR),
            0,
        )
        .unwrap();
    }

    #[test]
    fn regular_files_open_blocking_and_everything_else_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let regular = dir.path().join("regular");
        std::fs::File::create(&regular).unwrap().write_all(b"kvtier").unwrap();
        let mut f = open_regular(&regular, 0).unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        assert_eq!(s, "kvtier");
        let flags = rustix::fs::fcntl_getfl(&f).unwrap();
        assert!(!flags.contains(rustix::fs::OFlags::NONBLOCK), "O_NONBLOCK is cleared on the returned file");

        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        let link_to_regular = dir.path().join("link-regular");
        std::os::unix::fs::symlink(&regular, &link_to_regular).unwrap();
        let link_to_fifo = dir.path().join("link-fifo");
        std::os::unix::fs::symlink(&fifo, &link_to_fifo).unwrap();
        let socket_path = dir.path().join("socket");
        let _socket = std::os::unix::net::UnixListener::bind(&socket_path).unwrap();
        let cases = [
            (&fifo, "FIFO"),
            (&link_to_regular, "symlink"),
            (&link_to_fifo, "symlink"),
            (&socket_path, "socket"),
            (&dir.path().to_path_buf(), "directory"),
        ];
        for (path, kind) in cases {
            for extra_flags in [0, libc::O_DIRECT] {
                let started = Instant::now();
                match open_regular(path, extra_flags) {
                    Err(OpenError::NotRegular(k)) => assert_eq!(k, kind, "{}", path.display()),
                    other => panic!("{} (flags {extra_flags:#x}): {other:?}", path.display()),
                }
                assert!(started.elapsed() < Duration::from_secs(1));
            }
        }
        assert!(matches!(open_regular(&dir.path().join("missing"), 0), Err(OpenError::Io(_))));
        assert!(open_dir(dir.path()).is_ok());
        assert!(open_dir(&fifo).is_err(), "a FIFO is no directory, and its open does not wait");
    }
}
