//! The DRAM tier's memory: one page-aligned mapping cut into fixed-size slots. Anonymous for a store
//! used by one process; a shared-memory file (`pool_path`, in /dev/shm) when a host service shares
//! the pool with the engine processes that copy their KV into and out of it.
//!
//! Each slot is `slot_bytes` long: a 4096-byte descriptor page, then the value rounded up to 4096.
//! The same bytes are written to and read from NVMe, so a read lands a block in its slot with no copy.
//! Huge pages are used when the kernel has them reserved (MAP_HUGETLB), else transparent huge pages
//! are requested (MADV_HUGEPAGE). On CUDA hosts this mapping is what gets registered as pinned
//! memory (cudaHostRegister), so io_uring can register it too.

use crate::error::{Error, Result};
use crate::io::RegisteredRange;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes of DRAM arenas mapped by every store of this process (the process-wide budget).
static PROCESS_ARENA_BYTES: AtomicUsize = AtomicUsize::new(0);

/// io_uring caps one registered buffer at 1 GiB.
const MAX_REGISTERED_BYTES: usize = 1 << 30;

pub struct Arena {
    base: *mut u8,
    len: usize,
    slot_bytes: usize,
    slot_count: usize,
    huge_pages: bool,
    /// The shared-memory file mapped, removed when the arena is dropped.
    file: Option<PathBuf>,
}

unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

impl Arena {
    /// Maps the pool: anonymous memory, or the shared-memory file `pool_path` (created 0600, sized
    /// with fallocate so that a /dev/shm too small for it fails here, not at a page fault later).
    pub fn map(slot_bytes: usize, slot_count: usize, pool_path: Option<&Path>) -> Result<Self> {
        let len =
            slot_bytes.checked_mul(slot_count).ok_or_else(|| Error::config("dram_bytes", "arena size overflows"))?;
        let available = mem_available_bytes();
        let already = PROCESS_ARENA_BYTES.load(Ordering::Relaxed);
        if let Some(available) = available {
            if len > available {
                return Err(Error::Capacity {
                    message: format!(
                        "the DRAM pool needs {len} bytes ({slot_count} slots of {slot_bytes}) but only {available} bytes \
                         of memory are available (MemAvailable; {already} bytes already mapped by other kvtier stores in \
                         this process); lower `dram_bytes` (or `staging_slots`)"
                    ),
                });
            }
        }
        let (base, huge_pages, file) = match pool_path {
            None => {
                let (base, huge_pages) = map_anonymous(len)?;
                (base, huge_pages, None)
            }
            Some(path) => (map_shared_file(path, len)?, false, Some(path.to_path_buf())),
        };
        PROCESS_ARENA_BYTES.fetch_add(len, Ordering::Relaxed);
        Ok(Arena { base, len, slot_bytes, slot_count, huge_pages, file })
    }

    /// The shared-memory file behind the pool, when it has one.
    pub fn file(&self) -> Option<&Path> {
        self.file.as_deref()
    }

    /// Bytes of the whole mapping (slot_count * slot_bytes).
    pub fn mapped_bytes(&self) -> usize {
        self.len
    }

    pub fn huge_pages(&self) -> bool {
        self.huge_pages
    }

    pub fn slot_count(&self) -> usize {
        self.slot_count
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Start of slot `index` (its descriptor page).
    pub fn slot_ptr(&self, index: u32) -> *mut u8 {
        assert!((index as usize) < self.slot_count, "slot index out of range");
        // SAFETY: in bounds of the mapping.
        unsafe { self.base.add(index as usize * self.slot_bytes) }
    }

    /// Ranges to register with io_uring: whole slots, each range at most 1 GiB.
    pub fn registration_ranges(&self) -> Vec<RegisteredRange> {
        let slots_per_range = (MAX_REGISTERED_BYTES / self.slot_bytes).max(1);
        let mut ranges = Vec::new();
        let mut first = 0;
        while first < self.slot_count {
            let count = slots_per_range.min(self.slot_count - first);
            let len = count * self.slot_bytes;
            if len > MAX_REGISTERED_BYTES {
                break; // a single slot over 1 GiB cannot be registered
            }
            ranges.push(RegisteredRange { base: self.slot_ptr(first as u32), len });
            first += count;
        }
        ranges
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: mapped in `map` with this length; no I/O is in flight (the store joined its threads).
        unsafe { libc::munmap(self.base.cast(), self.len) };
        PROCESS_ARENA_BYTES.fetch_sub(self.len, Ordering::Relaxed);
        if let Some(path) = &self.file {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn map_anonymous(len: usize) -> Result<(*mut u8, bool)> {
    const HUGE_PAGE_BYTES: usize = 2 << 20;
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    if len.is_multiple_of(HUGE_PAGE_BYTES) {
        // SAFETY: anonymous mapping, no fd.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags | libc::MAP_HUGETLB, -1, 0) };
        if p != libc::MAP_FAILED {
            log::info!("kvtier: DRAM pool of {len} bytes on reserved huge pages");
            return Ok((p.cast(), true));
        }
    }
    // SAFETY: as above.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, -1, 0) };
    if p == libc::MAP_FAILED {
        return Err(Error::io(format!("mapping a DRAM pool of {len} bytes"), std::io::Error::last_os_error()));
    }
    // SAFETY: advisory only; asks for transparent huge pages when none are reserved.
    unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
    populate(p.cast(), len);
    Ok((p.cast(), false))
}

/// Creates (or replaces) the pool file and maps it shared. A leftover file of a dead service is
/// replaced: its blocks were never recorded anywhere but in that service's memory.
fn map_shared_file(path: &Path, len: usize) -> Result<*mut u8> {
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::io(format!("creating the shared DRAM pool {}", path.display()), e))?;
    // SAFETY: a valid fd; allocates the file's blocks up front.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
    if rc != 0 {
        let _ = std::fs::remove_file(path);
        let dir = path.parent().unwrap_or(Path::new("/"));
        return Err(Error::Capacity {
            message: format!(
                "the shared DRAM pool needs {len} bytes in {} but it has {} bytes free ({}); enlarge it (Docker: \
                 --shm-size, Kubernetes: an emptyDir with medium Memory and a sizeLimit) or lower `dram_bytes`",
                dir.display(),
                free_bytes(dir).map_or_else(|| "unknown".to_string(), |b| b.to_string()),
                std::io::Error::from_raw_os_error(rc)
            ),
        });
    }
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: maps the whole file we just sized; the mapping outlives the fd.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, file.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        let _ = std::fs::remove_file(path);
        return Err(Error::io(
            format!("mapping the shared DRAM pool {}", path.display()),
            std::io::Error::last_os_error(),
        ));
    }
    populate(p.cast(), len);
    Ok(p.cast())
}

fn free_bytes(dir: &Path) -> Option<u64> {
    let st = rustix::fs::statvfs(dir).ok()?;
    Some(st.f_bavail * st.f_frsize)
}

/// Faults the pool in at open so that page faults and zeroing stay off the load path.
fn populate(base: *mut u8, len: usize) {
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    // SAFETY: the range is our own fresh mapping.
    if unsafe { libc::madvise(base.cast(), len, MADV_POPULATE_WRITE) } == 0 {
        return;
    }
    // Kernels before 5.14: touch one byte per page.
    for offset in (0..len).step_by(4096) {
        // SAFETY: in bounds of the mapping.
        unsafe { base.add(offset).write_volatile(0) };
    }
}

/// MemAvailable from /proc/meminfo, in bytes.
pub fn mem_available_bytes() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
