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
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

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
    /// The open pool file, holding an exclusive flock for the arena's life: a file no process
    /// holds locked is an orphan (its service died), which `remove_orphan_pools` may delete.
    owner: Option<std::fs::File>,
    /// Set when a read may still write into a slot after the store closed (`keep_mapped`).
    keep_mapped: AtomicBool,
    /// The pool was a dead service's, taken over (`adopt_orphan_pool`): its resident blocks may be kept.
    adopted: bool,
}

/// A shared pool's resident marks: one byte per slot, in the page-rounded area after the last slot
/// (docs/format.md, "The shared DRAM pool"), 1 while the slot holds a block its service serves from
/// DRAM (written whole and verified, not quarantined), 0 otherwise. A service that takes over a dead one's pool
/// keeps only the blocks of marked slots: an unmarked slot may hold a fill or a read that never
/// finished, an evicted block, or a remote tier's block that failed its check.
#[derive(Clone, Copy)]
pub struct ResidentMarks {
    base: *mut u8,
    count: usize,
}

// SAFETY: bytes of a shared mapping that outlives the store; each is written under the catalog lock.
unsafe impl Send for ResidentMarks {}
unsafe impl Sync for ResidentMarks {}

impl ResidentMarks {
    /// Marks kept in `bytes` (the catalog's model tests: a pool's marks without a pool).
    #[cfg(test)]
    pub(crate) fn over(bytes: &'static mut [u8]) -> Self {
        ResidentMarks { base: bytes.as_mut_ptr(), count: bytes.len() }
    }

    pub fn set(&self, slot: u32, resident: bool) {
        assert!((slot as usize) < self.count, "a mark for slot {slot} of {}", self.count);
        // SAFETY: in bounds of the marks area, which the arena maps for the store's life.
        unsafe { self.base.add(slot as usize).write_volatile(u8::from(resident)) };
    }

    pub fn get(&self, slot: u32) -> bool {
        assert!((slot as usize) < self.count, "a mark for slot {slot} of {}", self.count);
        // SAFETY: as in `set`.
        unsafe { self.base.add(slot as usize).read_volatile() == 1 }
    }
}

/// Bytes of a shared pool's marks area for `slot_count` slots: a byte each, rounded up to a page.
fn marks_bytes(slot_count: usize) -> usize {
    slot_count.div_ceil(4096) * 4096
}

unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

impl Arena {
    /// Maps the pool: anonymous memory, or the shared-memory file `pool_path` (created 0600, sized
    /// with fallocate so that a /dev/shm too small for it fails here, not at a page fault later).
    pub fn map(slot_bytes: usize, slot_count: usize, pool_path: Option<&Path>) -> Result<Self> {
        let slots_len =
            slot_bytes.checked_mul(slot_count).ok_or_else(|| Error::config("dram_bytes", "arena size overflows"))?;
        let len = if pool_path.is_some() { slots_len + marks_bytes(slot_count) } else { slots_len };
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
        let (base, huge_pages, file, adopted) = match pool_path {
            None => {
                let (base, huge_pages) = map_anonymous(len)?;
                (base, huge_pages, None, false)
            }
            Some(path) => {
                let (base, owner, adopted) = map_shared_file(path, len)?;
                (base, false, Some((path.to_path_buf(), owner)), adopted)
            }
        };
        debug_assert!((base as usize).is_multiple_of(4096), "a mapping off its page");
        PROCESS_ARENA_BYTES.fetch_add(len, Ordering::Relaxed);
        let (file, owner) = file.unzip();
        let keep_mapped = AtomicBool::new(false);
        Ok(Arena { base, len, slot_bytes, slot_count, huge_pages, file, owner, keep_mapped, adopted })
    }

    /// Whether the pool is a dead service's, taken over (its resident marks and blocks as it left them).
    pub fn adopted(&self) -> bool {
        self.adopted
    }

    /// The resident marks of a shared pool (none for an anonymous one: no other service takes it over).
    pub fn resident_marks(&self) -> Option<ResidentMarks> {
        self.file.as_ref()?;
        let slots_len = self.slot_count * self.slot_bytes;
        debug_assert_eq!(self.len, slots_len + marks_bytes(self.slot_count), "a shared pool without its marks");
        // SAFETY: the marks area starts right after the last slot, inside the mapping.
        Some(ResidentMarks { base: unsafe { self.base.add(slots_len) }, count: self.slot_count })
    }

    /// The mapping outlives the arena (leaked, never unmapped): a read that did not finish by the
    /// store's close may still write into it, and it must never land in memory mapped since.
    pub fn keep_mapped(&self) {
        self.keep_mapped.store(true, Ordering::Release);
    }

    /// Removes the pool's shared-memory file now, if it has one (what `Drop` does), for an arena
    /// that will never drop (`keep_mapped`, held by a thread that outlives its store): the mapping
    /// stays, and no file is left in `/dev/shm` once the process exits.
    pub fn remove_file(&self) {
        if let (Some(path), Some(owner)) = (&self.file, &self.owner) {
            remove_if_same_file(path, owner);
        }
    }

    /// The shared-memory file behind the pool, when it has one.
    pub fn file(&self) -> Option<&Path> {
        self.file.as_deref()
    }

    /// Bytes of the whole mapping: the slots, and a shared pool's resident marks after them.
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
        debug_assert!((index as usize + 1) * self.slot_bytes <= self.len, "slot {index} ends past the mapping");
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
        debug_assert!(ranges.iter().all(|r| r.len <= MAX_REGISTERED_BYTES && r.len > 0));
        debug_assert!(ranges.iter().map(|r| r.len).sum::<usize>() <= self.len, "ranges past the mapping");
        ranges
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if !self.keep_mapped.load(Ordering::Acquire) {
            // SAFETY: mapped in `map` with this length; no I/O is in flight (the store joined its
            // threads and waited for the reads its loads gave up).
            unsafe { libc::munmap(self.base.cast(), self.len) };
        }
        let before = PROCESS_ARENA_BYTES.fetch_sub(self.len, Ordering::Relaxed);
        debug_assert!(before >= self.len, "an arena unmapped that was never counted");
        if let (Some(path), Some(owner)) = (&self.file, &self.owner) {
            remove_if_same_file(path, owner);
        }
    }
}

/// Removes `path` if it still names the file `owner` is open on. The name may have been given to
/// another file since this one was created (a namespace closed while a request still held its
/// store, then reopened at the same name): that file is another store's pool, mapped by engines.
fn remove_if_same_file(path: &Path, owner: &std::fs::File) {
    use std::os::unix::fs::MetadataExt;
    let same = |a: &std::fs::Metadata, b: &std::fs::Metadata| a.dev() == b.dev() && a.ino() == b.ino();
    match (std::fs::symlink_metadata(path), owner.metadata()) {
        (Ok(at_path), Ok(ours)) if same(&at_path, &ours) => {
            let _ = std::fs::remove_file(path);
        }
        _ => {}
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

/// Creates the pool file, locks it and maps it shared. Only a file created here is used: whatever
/// is at `path` already (a file another local user put there, a symbolic link) is neither opened
/// nor removed. The service names its pools unpredictably, so nothing can be there in its way.
fn map_shared_file(path: &Path, len: usize) -> Result<(*mut u8, std::fs::File, bool)> {
    if let Some((p, file)) = adopt_orphan_pool(path, len) {
        return Ok((p, file, true));
    }
    let file = create_pool_file(path)?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
        .map_err(|e| Error::io(format!("locking the shared DRAM pool {}", path.display()), e.into()))?;
    // SAFETY: a valid fd; allocates the file's blocks up front.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
    if rc != 0 {
        remove_if_same_file(path, &file);
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
        remove_if_same_file(path, &file);
        return Err(Error::io(
            format!("mapping the shared DRAM pool {}", path.display()),
            std::io::Error::last_os_error(),
        ));
    }
    populate(p.cast(), len);
    Ok((p.cast(), file, false))
}

/// The byte of a pool file on which each client that maps the pool holds an open-file-description
/// read lock (`hold_as_client`) for as long as its mapping lives.
const CLIENT_LOCK_BYTE: libc::off_t = 1;

/// Marks `file` as mapped by this process until `file` is closed: a service never takes over a pool
/// a client still maps (`adopt_orphan_pool`), since a copy of that client's could still land in it.
/// Kernels without open-file-description locks (before 3.15) take no mark, and then no service can
/// take a pool over either.
pub fn hold_as_client(file: &std::fs::File) -> std::io::Result<()> {
    match ofd_lock(file, libc::F_RDLCK) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
        other => other,
    }
}

fn ofd_lock(file: &std::fs::File, kind: libc::c_int) -> std::io::Result<()> {
    // SAFETY: a plain struct of integers, all zero is valid.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = CLIENT_LOCK_BYTE;
    lock.l_len = 1;
    // SAFETY: a valid fd and a valid lock description; F_OFD_SETLK never blocks.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &mut lock) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Takes over, as `path`, the pool of the same namespace that this socket's dead predecessor left
/// (named like `path` up to its random part), if no process holds it any more: no service (its
/// `flock`) and no client (`hold_as_client`). A service killed and started again by its engines then
/// finds its pool's memory allocated and zeroed already; a new pool of gigabytes costs seconds of
/// CPU, which on a busy host the engine's requests paid for. The blocks the old pool held are kept
/// where its resident marks and their checksums vouch for them (`store::takeover`): a block promised
/// to an engine before the kill can still be loaded (vLLM's plain route stops the engine otherwise).
fn adopt_orphan_pool(path: &Path, len: usize) -> Option<(*mut u8, std::fs::File)> {
    let (dir, name) = (path.parent()?, path.file_name()?.to_str()?);
    let stem = &name[..name.rfind('-')? + 1];
    let deadline = std::time::Instant::now() + ADOPTION_WAIT;
    loop {
        let mut mapped = false;
        for entry in std::fs::read_dir(dir).ok()?.flatten() {
            let candidate = entry.file_name();
            let Some(candidate) = candidate.to_str() else { continue };
            if !candidate.starts_with(stem) || !candidate.ends_with(".pool") || candidate == name {
                continue;
            }
            match try_adopt(&entry.path(), path, len) {
                Adoption::Taken(p, file) => return Some((p, file)),
                Adoption::Mapped => mapped = true,
                Adoption::Unfit => {}
            }
        }
        if !mapped || std::time::Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(ADOPTION_POLL);
    }
}

/// How long a namespace's open waits for the clients of a dead service to let go of its pool (each
/// does at its next call to the service, which fails), before it makes a new pool. An engine that
/// makes no call meanwhile keeps its mapping, and the pool stays for the janitor's sweep.
const ADOPTION_WAIT: std::time::Duration = std::time::Duration::from_secs(1);
const ADOPTION_POLL: std::time::Duration = std::time::Duration::from_millis(20);

enum Adoption {
    Taken(*mut u8, std::fs::File),
    /// A dead service's pool that a client still maps.
    Mapped,
    /// Not a pool to take over: held by a live service, another size or owner, gone.
    Unfit,
}

fn try_adopt(orphan: &Path, path: &Path, len: usize) -> Adoption {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(orphan);
    let Ok(file) = opened else { return Adoption::Unfit };
    let Ok(meta) = file.metadata() else { return Adoption::Unfit };
    let mine = meta.uid() == rustix::process::geteuid().as_raw() && meta.mode() & 0o077 == 0;
    if !meta.file_type().is_file() || !mine || meta.len() != len as u64 {
        return Adoption::Unfit;
    }
    if rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_err() {
        return Adoption::Unfit;
    }
    if ofd_lock(&file, libc::F_WRLCK).is_err() {
        return Adoption::Mapped;
    }
    let _ = ofd_lock(&file, libc::F_UNLCK);
    let flags = rustix::fs::RenameFlags::NOREPLACE;
    if rustix::fs::renameat_with(rustix::fs::CWD, orphan, rustix::fs::CWD, path, flags).is_err() {
        return Adoption::Unfit;
    }
    let renamed = std::fs::symlink_metadata(path).is_ok_and(|m| (m.dev(), m.ino()) == (meta.dev(), meta.ino()));
    if !renamed {
        return Adoption::Unfit; // another process of this user moved files there meanwhile: leave them be
    }
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: maps the whole file, whose size we checked; the mapping outlives the fd.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, file.as_raw_fd(), 0) };
    if p == libc::MAP_FAILED {
        remove_if_same_file(path, &file);
        return Adoption::Unfit;
    }
    populate(p.cast(), len);
    log::info!("kvtier: took over the pool {} of a service that is gone, as {}", orphan.display(), path.display());
    Adoption::Taken(p.cast(), file)
}

/// `path`, created here (0600, never through a symbolic link). Anything already there is an error
/// naming its owner: in a shared tmpfs it may be another user's, planted to be written into or to
/// stop kvtier.
fn create_pool_file(path: &Path) -> Result<std::fs::File> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let created = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path);
    match created {
        Ok(file) => Ok(file),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let owner = std::fs::symlink_metadata(path).map_or_else(|_| "unknown".to_string(), |m| m.uid().to_string());
            Err(Error::io(
                format!(
                    "creating the shared DRAM pool {}: a file is there already (owner uid {owner}); kvtier uses \
                     only pool files it creates itself. Remove it, or give the service another --pool-dir",
                    path.display()
                ),
                e,
            ))
        }
        Err(e) => Err(Error::io(format!("creating the shared DRAM pool {}", path.display()), e)),
    }
}

/// Removes the pool files in `dir` whose names start with `prefix` (and not with `keep_prefix`) and
/// that no process holds locked (their service died without removing them: tmpfs memory held until
/// reboot). Returns the paths removed. Files of other users, anything that is not a regular file,
/// and files younger than `min_age` (their creator may not have locked them yet) are left alone.
pub fn remove_orphan_pools(
    dir: &Path,
    prefix: &str,
    keep_prefix: Option<&str>,
    min_age: std::time::Duration,
) -> Vec<PathBuf> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let me = rustix::process::geteuid().as_raw();
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !name.starts_with(prefix)
            || keep_prefix.is_some_and(|keep| name.starts_with(keep))
            || !name.ends_with(".pool")
        {
            continue;
        }
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
        let young = meta.modified().ok().and_then(|t| t.elapsed().ok()).is_none_or(|age| age < min_age);
        if !meta.file_type().is_file() || meta.uid() != me || young {
            continue;
        }
        let Ok(file) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&path)
        else {
            continue;
        };
        if rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok()
            && std::fs::remove_file(&path).is_ok()
        {
            removed.push(path);
        }
    }
    removed
}

fn free_bytes(dir: &Path) -> Option<u64> {
    let st = rustix::fs::statvfs(dir).ok()?;
    Some(st.f_bavail * st.f_frsize)
}

/// Faults the pool in at open so that page faults and zeroing stay off the load path.
///
/// In steps of `POPULATE_STEP_BYTES`: the kernel holds the process's memory-map lock for a whole
/// populate call, and every thread that maps memory meanwhile (a new thread's stack: the service's
/// next connection) waits for it. One call over a few GiB stalled the service for seconds.
fn populate(base: *mut u8, len: usize) {
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    const POPULATE_STEP_BYTES: usize = 16 << 20;
    let mut offset = 0;
    while offset < len {
        let step = POPULATE_STEP_BYTES.min(len - offset);
        // SAFETY: the range is inside our own fresh mapping.
        if unsafe { libc::madvise(base.add(offset).cast(), step, MADV_POPULATE_WRITE) } != 0 {
            break;
        }
        offset += step;
    }
    if offset < len {
        // SAFETY: the rest of the same mapping.
        unsafe { touch_pages(base.add(offset), len - offset) };
    }
}

/// Kernels before 5.14 (no `MADV_POPULATE_WRITE`): faults each page in for writing by writing back
/// one byte it holds. Never a constant: a pool taken over keeps its blocks (`store::takeover`).
///
/// # Safety
/// `base..base + len` is mapped, readable and writable, and no other thread writes it meanwhile.
unsafe fn touch_pages(base: *mut u8, len: usize) {
    for offset in (0..len).step_by(4096) {
        // SAFETY: in bounds of the mapping (the caller's).
        unsafe {
            let byte = base.add(offset);
            byte.write_volatile(byte.read_volatile());
        }
    }
}

/// MemAvailable from /proc/meminfo, in bytes.
pub fn mem_available_bytes() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    #[test]
    fn faulting_pages_in_by_touch_keeps_what_they_hold() {
        let mut bytes: Vec<u8> = (0..3 * 4096 + 100).map(|i| (i % 251) as u8 + 1).collect();
        let before = bytes.clone();
        // SAFETY: this test's own buffer; no other thread.
        unsafe { super::touch_pages(bytes.as_mut_ptr(), bytes.len()) };
        assert_eq!(bytes, before, "a touched page lost its bytes: a pool taken over would lose its blocks");
    }
}
