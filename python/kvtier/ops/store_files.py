"""A store directory read from the outside, without opening the store (no lock taken, no byte written).

Layout (docs/format.md)::

    <path>/<namespace hex>/LOCK       flock held while a store (or the service) has the namespace open
    <path>/<namespace hex>/nvme.kvt   the device file: a 4096-byte superblock, then the regions

Only the superblock's magic, version and namespace are checked here, not its header checksum
(xxh3-64, which needs a package the store does not depend on) and no region: that is what a
``kvtier verify`` would do.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPERBLOCK_BYTES = 4096
SUPERBLOCK_MAGIC = b"KVTRDEV\0"
FORMAT_VERSION = 1
DEVICE_FILE_NAME = "nvme.kvt"
LOCK_FILE_NAME = "LOCK"
# magic, format_version, device_index, device_count, reserved, namespace, region_bytes, region_count,
# slot_bytes, object_bytes, store_id (docs/format.md, "Superblock")
_SUPERBLOCK = struct.Struct("<8sIIII32sQQQQQ")
_NAMESPACE_DIR = re.compile(r"^[0-9a-f]{64}$")


class SuperblockError(ValueError):
    """The first 4096 bytes of a device file are not a version-1 kvtier superblock."""


@dataclass(frozen=True)
class Superblock:
    format_version: int
    device_index: int
    device_count: int
    namespace: str  # lowercase hex of the 32-byte digest
    region_bytes: int
    region_count: int
    slot_bytes: int
    object_bytes: int
    store_id: int

    @property
    def device_bytes(self) -> int:
        """The size the device file is preallocated to."""
        return SUPERBLOCK_BYTES + self.region_count * self.region_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "device_index": self.device_index,
            "device_count": self.device_count,
            "namespace": self.namespace,
            "object_bytes": self.object_bytes,
            "slot_bytes": self.slot_bytes,
            "region_bytes": self.region_bytes,
            "region_count": self.region_count,
            "capacity_bytes": self.region_count * self.region_bytes,
            "store_id": f"{self.store_id:016x}",
        }


def parse_superblock(page: bytes) -> Superblock:
    """Decodes a superblock; :class:`SuperblockError` names what is wrong and what to do."""
    if len(page) < _SUPERBLOCK.size:
        raise SuperblockError(
            f"{len(page)} bytes, shorter than a superblock: the file was truncated or is not a kvtier device file"
        )
    (
        magic,
        version,
        index,
        count,
        _reserved,
        namespace,
        region_bytes,
        region_count,
        slot_bytes,
        object_bytes,
        store_id,
    ) = _SUPERBLOCK.unpack_from(page)
    if magic != SUPERBLOCK_MAGIC:
        raise SuperblockError(f"magic {magic!r}, not {SUPERBLOCK_MAGIC!r}: not a kvtier device file")
    if version != FORMAT_VERSION:
        raise SuperblockError(
            f"format version {version}, this kvtier reads {FORMAT_VERSION}: use the kvtier that wrote it"
        )
    return Superblock(
        format_version=version,
        device_index=index,
        device_count=count,
        namespace=namespace.hex(),
        region_bytes=region_bytes,
        region_count=region_count,
        slot_bytes=slot_bytes,
        object_bytes=object_bytes,
        store_id=store_id,
    )


def read_superblock(device_file: Path) -> Superblock:
    with open(device_file, "rb") as file:
        return parse_superblock(file.read(SUPERBLOCK_BYTES))


def flock_holders() -> dict[tuple[int, int, int], int]:
    """(device major, minor, inode) -> pid of every granted flock on this host, from /proc/locks
    (read only: nothing is locked to find out). Empty where /proc/locks cannot be read."""
    holders: dict[tuple[int, int, int], int] = {}
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return holders
    for line in text.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 32458 fe:00:10216445 0 EOF"; waiters have "->" after the number
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            holders[(int(major, 16), int(minor, 16), int(inode))] = int(fields[4])
        except ValueError:
            continue
    return holders


@dataclass(frozen=True)
class NamespaceDir:
    """One ``<path>/<namespace hex>/`` directory as found on disk."""

    path: Path  # the store directory it sits in
    digest: str
    device_file_bytes: int | None  # None: no nvme.kvt (a DRAM-only store)
    superblock: Superblock | None
    error: str | None  # why the superblock could not be read, with what to do
    locked_by_pid: int | None  # who holds LOCK now (None: nobody, or no /proc/locks)

    @property
    def directory(self) -> Path:
        return self.path / self.digest


def is_namespace_dir(entry: Path) -> bool:
    return bool(_NAMESPACE_DIR.match(entry.name)) and entry.is_dir()


def scan(path: Path, holders: dict[tuple[int, int, int], int] | None = None) -> list[NamespaceDir]:
    """The namespace directories under ``path``, sorted by digest."""
    holders = flock_holders() if holders is None else holders
    found = []
    for entry in sorted(path.iterdir()):
        if not is_namespace_dir(entry):
            continue
        device = entry / DEVICE_FILE_NAME
        size: int | None = None
        superblock: Superblock | None = None
        error: str | None = None
        try:
            size = device.stat().st_size
        except FileNotFoundError:
            pass
        except OSError as exc:
            error = f"cannot stat {device}: {exc.strerror} (run as the store's owner)"
        if size is not None:
            try:
                superblock = read_superblock(device)
            except SuperblockError as exc:
                error = f"{device}: {exc}"
            except OSError as exc:
                error = f"cannot read {device}: {exc.strerror} (run as the store's owner)"
        if superblock is not None and superblock.namespace != entry.name:
            error = (
                f"{device}: its superblock names namespace {superblock.namespace[:16]}…, not the directory's: "
                "the file was moved here from another namespace; move it back or delete it"
            )
        if superblock is not None and size is not None and size < superblock.device_bytes:
            error = (
                f"{device}: {size} bytes, its superblock needs {superblock.device_bytes}: the file was truncated; "
                "delete it (the store recreates it empty)"
            )
        found.append(
            NamespaceDir(
                path=path,
                digest=entry.name,
                device_file_bytes=size,
                superblock=superblock,
                error=error,
                locked_by_pid=_lock_holder(entry / LOCK_FILE_NAME, holders),
            )
        )
    return found


def _lock_holder(lock_file: Path, holders: dict[tuple[int, int, int], int]) -> int | None:
    try:
        st = lock_file.stat()
    except OSError:
        return None
    return holders.get((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
