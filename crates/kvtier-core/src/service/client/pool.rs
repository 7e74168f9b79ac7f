//! The namespace's pool file, mapped shared into this process.

use crate::error::{Error, Result};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The pool file mapped shared, read and write.
pub(super) struct PoolMap {
    pub(super) base: *mut u8,
    pub(super) len: usize,
    /// The mapped file's `(device, inode)`: a second hello keeps the mapping only for this file.
    file_id: (u64, u64),
    /// `populate` faulted the whole mapping in.
    populated: bool,
    /// Open for the mapping's life: it holds this client's mark on the pool (`hold_as_client`).
    _file: std::fs::File,
}

// SAFETY: the mapping is process memory; the client serialises its use (`&mut self` calls).
unsafe impl Send for PoolMap {}

impl PoolMap {
    pub(super) fn map(path: &Path, len: usize) -> Result<PoolMap> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| Error::io(format!("opening the kvtier pool {}", path.display()), e))?;
        let meta = file.metadata().map_err(|e| Error::io(format!("stat {}", path.display()), e))?;
        // The service creates its pools itself, as this user: anything else at the name (another
        // user's file in the shared tmpfs) would hold this engine's KV where others read it.
        let me = rustix::process::geteuid().as_raw();
        if !meta.file_type().is_file() || std::os::unix::fs::MetadataExt::uid(&meta) != me {
            return Err(Error::format(
                path,
                format!(
                    "is not a regular file of this user (uid {me}; owner uid {}), so no pool of this user's service: \
                     refusing to map it; stop the service and remove the file",
                    std::os::unix::fs::MetadataExt::uid(&meta)
                ),
            ));
        }
        let size = meta.len();
        if size != len as u64 {
            return Err(Error::format(path, format!("{size} bytes, the service said {len}; reconnect")));
        }
        crate::tiers::dram::hold_as_client(&file)
            .map_err(|e| Error::io(format!("marking the kvtier pool {} as mapped here", path.display()), e))?;
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // No MAP_POPULATE: most connections never copy (an engine's scheduler side opens three),
        // and faulting in the whole pool cost each of them its page tables and time per GiB. A
        // connection that copies asks for it (`Client::populate_pool`).
        // SAFETY: maps the whole file, whose size we checked.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, file.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(Error::io(
                format!("mapping the kvtier pool {}", path.display()),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(PoolMap { base: p.cast(), len, file_id: file_id(&meta), populated: false, _file: file })
    }

    /// Faults every page of the mapping in, in steps of `POPULATE_STEP_BYTES`: the kernel holds the
    /// process's memory-map lock for a whole call, and the engine's other threads that map memory
    /// meanwhile would wait on it for the whole pool.
    pub(super) fn populate(&mut self) {
        // Read faults, as MAP_POPULATE makes on a shared mapping (with fault-around: 3x faster than
        // MADV_POPULATE_WRITE here, and no page is dirtied).
        const MADV_POPULATE_READ: libc::c_int = 22;
        const POPULATE_STEP_BYTES: usize = 16 << 20;
        const PAGE_BYTES: usize = 4096;
        if self.populated {
            return;
        }
        let mut offset = 0;
        while offset < self.len {
            let step = POPULATE_STEP_BYTES.min(self.len - offset);
            // SAFETY: inside our own mapping; faults pages in, changes no byte.
            if unsafe { libc::madvise(self.base.add(offset).cast(), step, MADV_POPULATE_READ) } != 0 {
                break;
            }
            offset += step;
        }
        // Kernels before 5.14: read one byte per page (never write: the pool holds other engines' KV).
        for at in (offset..self.len).step_by(PAGE_BYTES) {
            // SAFETY: in bounds of the mapping.
            unsafe { self.base.add(at).read_volatile() };
        }
        self.populated = true;
    }

    /// Whether `path` is the file mapped here, at `len` bytes.
    pub(super) fn is(&self, path: &Path, len: usize) -> bool {
        std::fs::symlink_metadata(path).is_ok_and(|meta| file_id(&meta) == self.file_id && self.len == len)
    }
}

fn file_id(meta: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    (meta.dev(), meta.ino())
}

impl Drop for PoolMap {
    fn drop(&mut self) {
        // SAFETY: mapped in `map` with this length.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}
