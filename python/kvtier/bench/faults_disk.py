"""The ``nvme-full`` row of ``kvtier bench faults``: the NVMe tier's filesystem full (issue 36, item 5).

The row's store directory is a filesystem of its own (an ext4 image on a loop device, mounted by root),
sized for the store's NVMe device file with a little room; for the fault a filler file takes every free
block of it, as a log or another program filling the disk would, and is removed at the end. kvtier's
device file is preallocated at its first open (``fallocate``), so its writes and reads should go on; what
else the store writes there (its timeline, description) finds no room. A real full filesystem, not an
injected errno: what a user's disk does.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path

from kvtier.bench.faults_tiers import DISK_FULL

FILLER_NAME = "kvtier-bench-filler"  # the file that fills the disk for the fault
HEADROOM_BYTES = 256 << 20  # beside the device file: ext4's own metadata, the store's small files
CHUNK_BYTES = 1 << 20  # the filler's last writes: what fallocate left (ext4 keeps some blocks back)
COMMAND_TIMEOUT_S = 120


class SmallDisk:
    """An ext4 filesystem of ``size_bytes`` at ``mountpoint`` (its image beside it), for one row.
    ``start()`` makes and mounts it; ``fill()`` leaves no free block; ``drain()`` frees them again;
    ``close()`` unmounts and removes the image, whatever happened."""

    def __init__(self, row_dir: Path, mountpoint: Path, size_bytes: int):
        self.image = row_dir / "nvme-disk.img"
        self.mountpoint = mountpoint
        self.size_bytes = size_bytes
        self.filler = mountpoint / FILLER_NAME
        self.free_after_fill: int | None = None

    def start(self) -> None:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with self.image.open("wb") as image:
            image.truncate(self.size_bytes)  # sparse: blocks are taken as the store writes them
        # -m 0: no blocks reserved for root (the service runs as root and would use them); the
        # default reserve for converting preallocated extents stays.
        _run(["mkfs.ext4", "-q", "-F", "-m", "0", str(self.image)])
        _run(["mount", "-o", "loop", str(self.image), str(self.mountpoint)])

    def free_bytes(self) -> int:
        stat = os.statvfs(self.mountpoint)
        return stat.f_bavail * stat.f_frsize

    def fill(self) -> None:
        """Takes every free block: one preallocation of what is free, then writes until ENOSPC."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with contextlib.suppress(OSError):
                os.posix_fallocate(fd, 0, max(0, self.free_bytes() - CHUNK_BYTES))
            os.lseek(fd, 0, os.SEEK_END)
            chunk = b"\0" * CHUNK_BYTES
            while len(chunk) >= 4096:
                try:
                    os.write(fd, chunk)
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    chunk = chunk[: len(chunk) // 2]
        finally:
            os.close(fd)
        self.free_after_fill = self.free_bytes()

    def drain(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.drain()
        if os.path.ismount(self.mountpoint):
            result = subprocess.run(["umount", str(self.mountpoint)], capture_output=True, timeout=COMMAND_TIMEOUT_S)
            if result.returncode != 0:  # a process still holds a file there: detach it now, freed at its exit
                subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True, timeout=COMMAND_TIMEOUT_S)
        self.image.unlink(missing_ok=True)


def disk_bytes(nvme_gib: float) -> int:
    """The row's filesystem: the NVMe device file (``nvme_gib``), a tenth more, and the headroom."""
    device = int(nvme_gib * (1 << 30))
    return device + device // 10 + HEADROOM_BYTES


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed (exit {result.returncode}): {result.stderr.strip()[-500:]}; the "
            f"{DISK_FULL} row needs root, mkfs.ext4 and a free loop device"
        )
