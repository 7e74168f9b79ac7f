//! The NVMe tier's device files: geometry, creation (preallocated, O_DIRECT when supported),
//! validation of an existing file, and recovery of the index from region trailers.
//!
//! A device file is a superblock page followed by `region_count` regions. A region is written
//! sequentially, entry after entry (descriptor page + value), and sealed with a trailer listing its
//! entries. Recovery reads the superblock and every trailer; a region without a valid trailer (the one
//! open at a crash) is scanned entry by entry and each entry is kept only if its descriptor and value
//! checksums prove it whole. Allocation and eviction of regions belong to the catalog.

use crate::error::{Error, Result};
use crate::format::descriptor::{Descriptor, DESCRIPTOR_BYTES};
use crate::format::encrypted::{decrypt_in_place, ValueCipher};
use crate::format::superblock::{Superblock, SUPERBLOCK_BYTES};
use crate::format::trailer::{trailer_bytes, Trailer, TrailerEntry};
use crate::format::{checksum, ALIGN_BYTES};
use crate::io::buffer::AlignedBuf;
use crate::io::DirectIo;
use crate::key::Namespace;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub const DEVICE_FILE_NAME: &str = "nvme.kvt";

/// Sizes derived from the configuration; identical on every device of a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub slot_bytes: u64,
    pub region_bytes: u64,
    pub region_count: u64,
    pub max_entries: u64,
    pub trailer_bytes: u64,
}

impl Geometry {
    pub fn new(slot_bytes: u64, region_bytes: u64, region_count: u64) -> Self {
        let mut max_entries = region_bytes / slot_bytes;
        while max_entries > 0 && max_entries * slot_bytes + trailer_bytes(max_entries as usize) as u64 > region_bytes {
            max_entries -= 1;
        }
        let trailer_bytes = trailer_bytes(max_entries as usize) as u64;
        assert!(
            max_entries == 0 || max_entries * slot_bytes + trailer_bytes <= region_bytes,
            "{max_entries} entries and their trailer overflow a region"
        );
        Geometry { slot_bytes, region_bytes, region_count, max_entries, trailer_bytes }
    }

    pub fn from_capacity(slot_bytes: u64, region_bytes: u64, device_bytes: u64) -> Self {
        let region_count = device_bytes.saturating_sub(SUPERBLOCK_BYTES as u64) / region_bytes;
        Self::new(slot_bytes, region_bytes, region_count)
    }

    pub fn file_bytes(&self) -> u64 {
        SUPERBLOCK_BYTES as u64 + self.region_count * self.region_bytes
    }

    pub fn region_offset(&self, region: u32) -> u64 {
        debug_assert!((region as u64) < self.region_count, "region {region} past the device's last");
        SUPERBLOCK_BYTES as u64 + region as u64 * self.region_bytes
    }

    pub fn trailer_offset(&self, region: u32) -> u64 {
        debug_assert!(self.trailer_bytes <= self.region_bytes, "a trailer larger than its region");
        self.region_offset(region) + self.region_bytes - self.trailer_bytes
    }

    /// Bytes of a region usable by entries.
    pub fn data_bytes(&self) -> u64 {
        self.max_entries * self.slot_bytes
    }
}

pub struct DeviceFile {
    pub path: PathBuf,
    pub file: File,
    pub direct: bool,
    pub index: u32,
}

/// The store id recorded by the first existing device file among `dirs` whose superblock decodes:
/// devices created now take it, so every device of one store carries the same id. `None`: no device
/// exists yet (a new store picks a random id).
pub fn existing_store_id(dirs: &[PathBuf]) -> Option<u64> {
    dirs.iter().find_map(|dir| {
        let path = dir.join(DEVICE_FILE_NAME);
        let file = OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path).ok()?;
        let mut page = vec![0u8; SUPERBLOCK_BYTES];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut page, 0).ok()?;
        Superblock::decode(&page).ok().map(|sb| sb.store_id)
    })
}

/// Opens (or creates and preallocates) the device file in `dir`: the device, and whether it was
/// created now (else it was checked against `template` and `geometry`, its blocks to be recovered).
pub fn open_device(
    dir: &Path,
    template: &Superblock,
    geometry: &Geometry,
    direct_io: DirectIo,
) -> Result<(DeviceFile, bool)> {
    let path = dir.join(DEVICE_FILE_NAME);
    // symlink_metadata: a symlink counts as present (and is then refused by O_NOFOLLOW), so a dangling
    // link can never make kvtier create a file outside its root.
    let exists = std::fs::symlink_metadata(&path).is_ok();
    if !exists {
        check_free_space(dir, geometry.file_bytes())?;
    }
    let (file, direct) = open_file(&path, direct_io)?;
    let device = DeviceFile { path, file, direct, index: template.device_index };
    if exists {
        check_existing_device(&device, template, geometry)?;
        Ok((device, false))
    } else {
        initialize_device(&device, template, geometry)?;
        Ok((device, true))
    }
}

/// An existing device file must be of this store and this layout, and not truncated.
fn check_existing_device(device: &DeviceFile, template: &Superblock, geometry: &Geometry) -> Result<()> {
    let path = &device.path;
    let len = device.file.metadata().map_err(|e| Error::io(format!("stat {}", path.display()), e))?.len();
    let mut page = AlignedBuf::zeroed(SUPERBLOCK_BYTES);
    read_exact_at(device, page.as_mut_slice(), 0)?;
    let found = Superblock::decode(page.as_slice()).map_err(|e| {
        Error::format(
            path,
            format!("not a kvtier device file of format version 1 ({e}); remove it or choose another directory"),
        )
    })?;
    if found.namespace != template.namespace {
        return Err(Error::Namespace {
            path: path.clone(),
            expected: template.namespace.hex(),
            found: found.namespace.hex(),
        });
    }
    check_same_store_and_layout(path, &found, template)?;
    if len < geometry.file_bytes() {
        return Err(Error::format(
            path,
            format!("truncated: {len} bytes, expected {}; delete it to start empty", geometry.file_bytes()),
        ));
    }
    Ok(())
}

/// The superblock `found` in `path` records the layout and store id this store expects.
fn check_same_store_and_layout(path: &Path, found: &Superblock, template: &Superblock) -> Result<()> {
    let geometry_matches = found.region_bytes == template.region_bytes
        && found.region_count == template.region_count
        && found.slot_bytes == template.slot_bytes
        && found.object_bytes == template.object_bytes
        && found.device_count == template.device_count
        && found.device_index == template.device_index;
    if !geometry_matches {
        return Err(Error::format(
            path,
            format!(
                "created with object_bytes={}, region_bytes={}, {} regions, device {}/{}; reopen with the same \
                 object_bytes, region_bytes, nvme_bytes and directories, or delete {} to start empty",
                found.object_bytes,
                found.region_bytes,
                found.region_count,
                found.device_index,
                found.device_count,
                path.display()
            ),
        ));
    }
    if found.store_id != template.store_id {
        return Err(Error::format(
            path,
            format!(
                "belongs to another store (store id {:016x}; this store's other directories have {:016x}): \
                 directories of two stores were mixed; list the directories of one store, or delete {} to start \
                 it empty",
                found.store_id,
                template.store_id,
                path.display()
            ),
        ));
    }
    Ok(())
}

/// Sizes a new device file for `geometry` and writes its superblock, durably.
fn initialize_device(device: &DeviceFile, template: &Superblock, geometry: &Geometry) -> Result<()> {
    preallocate(device, geometry.file_bytes())?;
    let mut page = AlignedBuf::zeroed(SUPERBLOCK_BYTES);
    assert_eq!(page.len(), SUPERBLOCK_BYTES, "the superblock is one aligned page");
    template.encode(page.as_mut_slice());
    write_all_at(device, page.as_slice(), 0)?;
    device.file.sync_all().map_err(|e| Error::io(format!("fsync {}", device.path.display()), e))
}

fn open_file(path: &Path, direct_io: DirectIo) -> Result<(File, bool)> {
    let open = |direct: bool| {
        let mut o = OpenOptions::new();
        o.read(true).write(true).create(true).mode(0o600);
        o.custom_flags(libc::O_NOFOLLOW | if direct { libc::O_DIRECT } else { 0 });
        o.open(path)
    };
    let io_error = |e: std::io::Error| {
        if e.raw_os_error() == Some(libc::ELOOP) {
            Error::io(
                format!(
                    "{} is a symbolic link; kvtier does not follow links out of its directory: remove it",
                    path.display()
                ),
                e,
            )
        } else if e.kind() == std::io::ErrorKind::PermissionDenied {
            Error::io(
                format!(
                    "{} is not writable; give kvtier a directory it can write (check owner and mode)",
                    path.display()
                ),
                e,
            )
        } else {
            Error::io(format!("opening {}", path.display()), e)
        }
    };
    match direct_io {
        DirectIo::Off => open(false).map(|f| (f, false)).map_err(io_error),
        DirectIo::On => match open(true) {
            Ok(f) => Ok((f, true)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Err(Error::config(
                "direct_io",
                format!(
                    "{} does not support O_DIRECT; use a local NVMe filesystem (ext4, xfs) or set direct_io=\"auto\"",
                    path.display()
                ),
            )),
            Err(e) => Err(io_error(e)),
        },
        DirectIo::Auto => match open(true) {
            Ok(f) => Ok((f, true)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                log::warn!("kvtier: {} does not support O_DIRECT; using buffered I/O", path.display());
                open(false).map(|f| (f, false)).map_err(io_error)
            }
            Err(e) => Err(io_error(e)),
        },
    }
}

fn preallocate(device: &DeviceFile, bytes: u64) -> Result<()> {
    // SAFETY: plain syscall on an owned fd.
    let rc = unsafe { libc::fallocate(device.file.as_raw_fd(), 0, 0, bytes as libc::off_t) };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ENOSPC) {
        let _ = std::fs::remove_file(&device.path);
        return Err(Error::Capacity {
            message: format!(
                "no space to preallocate {bytes} bytes for {}; lower nvme_bytes or free space",
                device.path.display()
            ),
        });
    }
    log::info!("kvtier: fallocate unsupported on {} ({err}); using a sparse file", device.path.display());
    device.file.set_len(bytes).map_err(|e| Error::io(format!("sizing {}", device.path.display()), e))
}

pub fn check_free_space(dir: &Path, bytes: u64) -> Result<()> {
    let stat = rustix::fs::statvfs(dir).map_err(|e| Error::io(format!("statvfs {}", dir.display()), e.into()))?;
    let free = stat.f_bavail * stat.f_frsize;
    if bytes > free {
        return Err(Error::Capacity {
            message: format!(
                "nvme_bytes asks for {bytes} bytes in {} but the filesystem has {free} bytes free; lower nvme_bytes \
                 or free space",
                dir.display()
            ),
        });
    }
    Ok(())
}

pub fn read_exact_at(device: &DeviceFile, buf: &mut [u8], offset: u64) -> Result<()> {
    use std::os::unix::fs::FileExt;
    device
        .file
        .read_exact_at(buf, offset)
        .map_err(|e| Error::io(format!("reading {} at {offset}", device.path.display()), e))
}

pub fn write_all_at(device: &DeviceFile, buf: &[u8], offset: u64) -> Result<()> {
    use std::os::unix::fs::FileExt;
    device
        .file
        .write_all_at(buf, offset)
        .map_err(|e| Error::io(format!("writing {} at {offset}", device.path.display()), e))
}

/// What recovery found in one region.
#[derive(Debug)]
pub struct RecoveredRegion {
    pub region: u32,
    pub region_seq: u64,
    pub entries: Vec<TrailerEntry>,
    /// The region had a valid trailer; otherwise it was scanned and needs one written.
    pub sealed: bool,
}

/// Reads every trailer and scans trailer-less regions. Regions found empty are not returned.
pub fn recover(
    device: &DeviceFile,
    geometry: &Geometry,
    namespace: &Namespace,
    object_bytes: u64,
    cipher: Option<&ValueCipher>,
) -> Result<Vec<RecoveredRegion>> {
    let mut trailer_buf = AlignedBuf::zeroed(geometry.trailer_bytes as usize);
    let mut slot_buf = AlignedBuf::zeroed(geometry.slot_bytes as usize);
    debug_assert!(trailer_buf.len() as u64 >= geometry.trailer_bytes && slot_buf.len() as u64 >= geometry.slot_bytes);
    debug_assert!(
        DESCRIPTOR_BYTES as u64 + object_bytes <= geometry.slot_bytes,
        "a slot holds the descriptor page and the value"
    );
    let mut found = Vec::new();
    let mut progress = RecoveryProgress::new(device, geometry.region_count);
    for region in 0..geometry.region_count as u32 {
        progress.at(region, &found);
        read_exact_at(device, trailer_buf.as_mut_slice(), geometry.trailer_offset(region))?;
        match Trailer::decode(trailer_buf.as_slice()) {
            Ok(Some(t)) if t.region_index == region as u64 && t.entries.len() as u64 <= geometry.max_entries => {
                let entries = t
                    .entries
                    .into_iter()
                    .filter(|e| valid_entry_position(geometry, e.offset) && e.value_bytes as u64 == object_bytes)
                    .collect();
                found.push(RecoveredRegion { region, region_seq: t.region_seq, entries, sealed: true });
                continue;
            }
            Ok(_) => {}
            Err(e) => log::warn!(
                "kvtier: {} region {region}: trailer rejected ({e}); scanning its entries",
                device.path.display()
            ),
        }
        if let Some(r) = scan_region(device, geometry, namespace, object_bytes, region, &mut slot_buf, cipher)? {
            found.push(r);
        }
    }
    Ok(found)
}

/// Logs how far a long recovery has come (a large device file reads trailers for a while, and a
/// store with no trailers scans every entry), every `RECOVERY_PROGRESS_PERIOD`.
struct RecoveryProgress<'a> {
    device: &'a DeviceFile,
    region_count: u64,
    started: Instant,
    last_report: Instant,
}

const RECOVERY_PROGRESS_PERIOD: Duration = Duration::from_secs(2);

impl<'a> RecoveryProgress<'a> {
    fn new(device: &'a DeviceFile, region_count: u64) -> Self {
        let now = Instant::now();
        RecoveryProgress { device, region_count, started: now, last_report: now }
    }

    fn at(&mut self, region: u32, found: &[RecoveredRegion]) {
        if self.last_report.elapsed() < RECOVERY_PROGRESS_PERIOD {
            return;
        }
        self.last_report = Instant::now();
        let blocks: usize = found.iter().map(|r| r.entries.len()).sum();
        let done = region as f64 / self.region_count.max(1) as f64;
        let elapsed_s = self.started.elapsed().as_secs_f64();
        log::info!(
            "kvtier: recovering {}: {region} of {} regions ({:.0}%), {blocks} blocks so far, about {:.0} s left",
            self.device.path.display(),
            self.region_count,
            done * 100.0,
            elapsed_s / done.max(1e-9) * (1.0 - done)
        );
    }
}

fn valid_entry_position(geometry: &Geometry, offset: u64) -> bool {
    offset.is_multiple_of(geometry.slot_bytes)
        && offset.checked_add(geometry.slot_bytes).is_some_and(|end| end <= geometry.data_bytes())
}

/// Recovers a trailer-less region (the open one at a crash, or one whose trailer write failed): every
/// entry position is read, not only up to the first bad one, so a failed or torn entry write leaves a
/// hole of one entry instead of losing every entry written after it. The region's generation is the
/// highest `region_seq` among the descriptors of this namespace whose value checksum passes; entries of
/// older generations (positions past where the current one reached before the crash) are left out.
fn scan_region(
    device: &DeviceFile,
    geometry: &Geometry,
    namespace: &Namespace,
    object_bytes: u64,
    region: u32,
    slot_buf: &mut AlignedBuf,
    cipher: Option<&ValueCipher>,
) -> Result<Option<RecoveredRegion>> {
    let mut candidates = scan_descriptors(device, geometry, namespace, object_bytes, region, slot_buf)?;
    // Newest generation first; within one, by position. A generation none of whose values verify
    // (a forged or torn descriptor claiming a newer one) gives way to the next.
    candidates.sort_by_key(|&(offset, ref desc)| (std::cmp::Reverse(desc.region_seq), offset));
    let mut at = 0;
    while at < candidates.len() {
        let region_seq = candidates[at].1.region_seq;
        let generation_end = candidates[at..].iter().position(|(_, d)| d.region_seq != region_seq);
        let generation = &candidates[at..at + generation_end.unwrap_or(candidates.len() - at)];
        let mut entries = Vec::new();
        for (offset, desc) in generation {
            debug_assert!(valid_entry_position(geometry, *offset), "a scanned entry at {offset} outside the data");
            let position = geometry.region_offset(region) + offset;
            let slot = &mut slot_buf.as_mut_slice()[..geometry.slot_bytes as usize];
            read_exact_at(device, slot, position)?;
            let (page, rest) = slot.split_at_mut(DESCRIPTOR_BYTES);
            let value = &mut rest[..object_bytes as usize];
            // An encrypted value is checked as a load checks it: opened, then its plaintext's checksum.
            if decrypt_in_place(cipher, page, value).is_ok() && checksum(value) == desc.value_checksum {
                entries.push(TrailerEntry {
                    key: desc.key,
                    sequence: desc.sequence,
                    offset: *offset,
                    value_bytes: desc.value_bytes,
                    value_checksum: desc.value_checksum,
                });
            }
        }
        if !entries.is_empty() {
            debug_assert!(entries.len() as u64 <= geometry.max_entries);
            return Ok(Some(RecoveredRegion { region, region_seq, entries, sealed: false }));
        }
        at += generation.len();
    }
    Ok(None)
}

/// The descriptors of this namespace and object size at every entry position of a region:
/// `(offset in the region, descriptor)`. Empty when the first descriptor page is all zeros: `kvtier
/// trim` empties a region by zeroing its trailer and that page, and it stays empty whatever older
/// entries still lie further in (docs/format.md).
fn scan_descriptors(
    device: &DeviceFile,
    geometry: &Geometry,
    namespace: &Namespace,
    object_bytes: u64,
    region: u32,
    slot_buf: &mut AlignedBuf,
) -> Result<Vec<(u64, Descriptor)>> {
    let mut found = Vec::new();
    let mut offset = 0;
    while offset + geometry.slot_bytes <= geometry.data_bytes() {
        let at = geometry.region_offset(region) + offset;
        read_exact_at(device, &mut slot_buf.as_mut_slice()[..DESCRIPTOR_BYTES], at)?;
        if offset == 0 && slot_buf.as_slice()[..DESCRIPTOR_BYTES].iter().all(|&b| b == 0) {
            return Ok(found);
        }
        if let Ok(desc) = Descriptor::decode(slot_buf.as_slice()) {
            if desc.namespace == *namespace && desc.value_bytes as u64 == object_bytes {
                found.push((offset, desc));
            }
        }
        offset += geometry.slot_bytes;
    }
    debug_assert!(found.len() as u64 <= geometry.max_entries, "more descriptors than a region's entries");
    Ok(found)
}

/// Builds the trailer bytes for a region (an aligned buffer of `trailer_bytes`).
pub fn encode_trailer(geometry: &Geometry, region: u32, region_seq: u64, entries: &[TrailerEntry]) -> AlignedBuf {
    debug_assert!(entries.len() as u64 <= geometry.max_entries, "a trailer of more entries than a region holds");
    let mut buf = AlignedBuf::zeroed(geometry.trailer_bytes as usize);
    assert_eq!(buf.len() as u64, geometry.trailer_bytes, "trailer_bytes is a multiple of the page");
    Trailer { region_seq, region_index: region as u64, entries: entries.to_vec() }.encode(buf.as_mut_slice());
    buf
}

pub const _ASSERT_ALIGN: () = assert!(DESCRIPTOR_BYTES == ALIGN_BYTES);
