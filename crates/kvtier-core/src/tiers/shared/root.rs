//! The shared root at open: its checks and probes (a directory, writable, O_DIRECT, atomic rename),
//! and the creation of the tier's directories and files with the configured modes.

use super::files::{open_regular, OpenError};
use super::SharedConfig;
use crate::error::{Error, Result};
use crate::format::ALIGN_BYTES;
use crate::io::buffer::AlignedBuf;
use crate::io::DirectIo;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

/// The root must exist (created only when its parent does) and be a directory.
pub(super) fn check_root(config: &SharedConfig) -> Result<()> {
    let root = &config.root;
    match std::fs::metadata(root) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(Error::config(
            "shared_root",
            format!("{} is not a directory; give the directory on the shared filesystem", root.display()),
        )),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            let parent = root.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
            if parent.is_dir() {
                make_dir(config, root)
            } else {
                Err(Error::config(
                    "shared_root",
                    format!(
                        "{} does not exist, nor does its parent {}; mount the shared filesystem (or create the directory) \
                         first",
                        root.display(),
                        parent.display()
                    ),
                ))
            }
        }
        Err(e) => Err(Error::io(format!("checking shared_root {}", root.display()), e)),
    }
}

fn writable_error(path: &Path, e: std::io::Error) -> Error {
    match e.raw_os_error() {
        Some(libc::EROFS) => Error::config(
            "shared_root",
            format!(
                "{} is on a read-only filesystem; mount it read-write or choose another shared_root",
                path.display()
            ),
        ),
        Some(libc::EACCES) | Some(libc::EPERM) => Error::config(
            "shared_root",
            format!(
                "{} is not writable by uid {}; fix its owner or mode (several service accounts: a common group and \
                 group_shared=true)",
                path.display(),
                rustix::process::getuid().as_raw()
            ),
        ),
        Some(libc::ENOSPC) => Error::Capacity {
            message: format!(
                "{}: the shared filesystem is full; free space or choose another shared_root",
                path.display()
            ),
        },
        _ => Error::io(format!("creating {}", path.display()), e),
    }
}

/// How long `make_dir` keeps retrying a directory another node is creating at the same moment.
const MKDIR_SETTLE: Duration = Duration::from_secs(3);

/// Creates a directory with the configured mode (set explicitly: the umask must not narrow it).
pub(super) fn make_dir(config: &SharedConfig, path: &Path) -> Result<()> {
    // Two nodes creating the same directory at once: on GlusterFS with default client caching the
    // loser's mkdir says EEXIST while its stat still fails for a moment, and creating a subdirectory
    // of the winner's new directory says ENOENT (measured on GlusterFS 10, tests/test_shared_fs.py).
    // Both settle within a second: retry for a bounded time before calling it an error.
    let started = Instant::now();
    loop {
        let transient = match std::fs::create_dir(path) {
            Ok(()) => {
                return std::fs::set_permissions(path, std::fs::Permissions::from_mode(config.dir_mode()))
                    .map_err(|e| writable_error(path, e))
            }
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                if path.is_dir() {
                    return Ok(());
                }
                Error::config("shared_root", format!("{} exists but is not a directory; remove it", path.display()))
            }
            Err(e) if e.kind() == ErrorKind::NotFound => writable_error(path, e),
            Err(e) => return Err(writable_error(path, e)),
        };
        if started.elapsed() >= MKDIR_SETTLE {
            return Err(transient);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Creates a new file exclusively, with the configured mode.
pub(super) fn create_file(config: &SharedConfig, path: &Path, append: bool, direct: bool) -> Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).create_new(true).mode(config.file_mode());
    if append {
        o.append(true);
    } else {
        o.write(true);
    }
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    let f = o.open(path).map_err(|e| writable_error(path, e))?;
    if config.group_shared {
        let _ = f.set_permissions(std::fs::Permissions::from_mode(config.file_mode()));
    }
    Ok(f)
}

/// Probes O_DIRECT (write and read back one page) and rename-over-existing in `tmp/`.
pub(super) fn probe_direct_and_rename(config: &SharedConfig, tmp: &Path, writer_id: u64) -> Result<bool> {
    let direct = probe_direct(config, tmp, writer_id)?;
    probe_rename(config, tmp, writer_id)?;
    Ok(direct)
}

/// Whether data files use O_DIRECT: as `direct_io` asks, where the filesystem supports it (`auto`
/// falls back to buffered I/O with a warning; `on` is an error without it).
fn probe_direct(config: &SharedConfig, tmp: &Path, writer_id: u64) -> Result<bool> {
    let want = config.direct_io;
    if want == DirectIo::Off {
        return Ok(false);
    }
    let probe = tmp.join(format!("probe-{writer_id:016x}.tmp"));
    let ok = write_and_read_back_direct(config, &probe);
    let _ = std::fs::remove_file(&probe);
    match ok {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) || e.kind() == ErrorKind::Other => {
            if want == DirectIo::On {
                return Err(Error::config(
                    "shared_direct_io",
                    format!("{} does not support O_DIRECT ({e}); set direct_io to auto or off", tmp.display()),
                ));
            }
            log::warn!(
                "kvtier: shared root {} does not support O_DIRECT ({e}); using buffered I/O for shared files",
                config.root.display()
            );
            Ok(false)
        }
        Err(e) => Err(writable_error(tmp, e)),
    }
}

/// Creates `probe` with O_DIRECT, writes one page and checks it reads back the same.
fn write_and_read_back_direct(config: &SharedConfig, probe: &Path) -> std::io::Result<()> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(config.file_mode())
        .custom_flags(libc::O_DIRECT)
        .open(probe)?;
    let mut page = AlignedBuf::zeroed(ALIGN_BYTES);
    page.as_mut_slice()[..8].copy_from_slice(b"kvtprobe");
    f.write_all_at(page.as_slice(), 0)?;
    let mut back = AlignedBuf::zeroed(ALIGN_BYTES);
    f.read_exact_at(back.as_mut_slice(), 0)?;
    if back.as_slice() != page.as_slice() {
        return Err(std::io::Error::other("O_DIRECT read back different bytes"));
    }
    Ok(())
}

/// Publishing relies on rename replacing a name atomically; a filesystem that refuses rename
/// (some object-store gateways) cannot host the tier.
fn probe_rename(config: &SharedConfig, tmp: &Path, writer_id: u64) -> Result<()> {
    let a = tmp.join(format!("probe-{writer_id:016x}.a"));
    let b = tmp.join(format!("probe-{writer_id:016x}.b"));
    let renamed = rename_over_existing(config, &a, &b);
    let _ = std::fs::remove_file(&a);
    let _ = std::fs::remove_file(&b);
    if let Err(e) = renamed {
        return Err(match e.raw_os_error() {
            Some(libc::EROFS) | Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::ENOSPC) => writable_error(tmp, e),
            _ => Error::config(
                "shared_root",
                format!(
                    "{} does not support atomic rename over an existing file ({e}); kvtier publishes by rename, use a \
                     POSIX filesystem (NFS, Lustre, CephFS, Storage Scale)",
                    config.root.display()
                ),
            ),
        });
    }
    Ok(())
}

/// Creates `a` and `b`, renames `a` over `b` and checks that `b` now holds `a`'s bytes.
fn rename_over_existing(config: &SharedConfig, a: &Path, b: &Path) -> std::io::Result<()> {
    // Created exclusively and read back through `open_regular`: a FIFO planted under either name must
    // not hang the open.
    let create = |path: &Path| OpenOptions::new().write(true).create_new(true).mode(config.file_mode()).open(path);
    let mut fa = create(a)?;
    fa.write_all(b"a")?;
    create(b)?.write_all(b"b")?;
    std::fs::rename(a, b)?;
    let mut s = String::new();
    let mut back = open_regular(b, 0).map_err(|e| match e {
        OpenError::Io(e) => e,
        other => std::io::Error::other(other.to_string()),
    })?;
    back.read_to_string(&mut s)?;
    if s != "a" {
        return Err(std::io::Error::other("rename did not replace the target"));
    }
    Ok(())
}
