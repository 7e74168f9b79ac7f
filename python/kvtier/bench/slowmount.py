"""A slow mount for the benchmarks: a FUSE passthrough of a directory whose reads and writes go through
the slow link's delay line (``kvtier.bench.slowlink.DelayLine``), so that a shared-filesystem tier on this
machine reads like one on a slow network filesystem (issue 36: load or recompute against slow tiers).

Why FUSE and not a throttled block device: this kernel's cgroup v2 hierarchy has no ``io`` controller
(``/sys/fs/cgroup/unified/cgroup.controllers`` lists only ``hugetlb``; blkio is v1, bandwidth only, no
latency), while a FUSE layer gives the same rate-and-latency delay line as the TCP link, and is what a
network filesystem's client is anyway (GlusterFS and CephFS here mount through FUSE).

Every read and write of the mount waits for its release on one line per direction (reads share one,
writes another): ``max(arrival + latency, previous release) + size / rate``. Metadata passes through
at once. The daemon is ``fusepy`` (ctypes over libfuse 2; ``pip install fusepy``), multithreaded, in a
child process (``python -m kvtier.bench.slowmount SOURCE MOUNTPOINT ...``) that unmounts and exits when its
standard input closes, so it goes with the benchmark that started it. libfuse 2 reads at most 128 KiB
per request, and the passthrough runs in Python: on this 2-core machine it moves about 150 MB/s
unthrottled, so speeds near that are the daemon's, not the line's (``SlowMount.ceiling_note``).

Read errors (``fail_reads_flag``, ``--fail-reads-when PATH``): while the file PATH exists (outside the
mount), every read of the mount fails with EIO, as a disk's bad sectors do; writes and metadata go on.
``kvtier bench faults`` puts kvtier's NVMe tier on such a mount to inject read errors, because this
kernel has no device-mapper (``dmsetup``'s ``error`` and ``flakey`` targets): ``/dev/mapper/control``
is absent. kvtier's NVMe tier opens its file there with O_DIRECT (FUSE passes such reads to the
daemon uncached, so each one sees the flag).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvtier.bench.slowlink import LinkSpec, SlowLinkError

READY_PREFIX = "slowmount mounted "
START_TIMEOUT_S = 30.0
INSTALL = "pip install fusepy (and libfuse2: apt-get install libfuse2)"
# The passthrough's own ceiling measured on this machine (2 cores): speeds above it are not the line's.
CEILING_MB_PER_S = 150.0


def missing_reason() -> str | None:
    """Why a slow mount cannot be made here (with the fix), or None."""
    if importlib.util.find_spec("fuse") is None:
        return f"the slow mount needs fusepy: {INSTALL}"
    if not os.path.exists("/dev/fuse"):
        return "the slow mount needs /dev/fuse (FUSE in the kernel; in a container, --device /dev/fuse)"
    if os.geteuid() != 0 and shutil.which("fusermount") is None:
        return "the slow mount needs root or fusermount (apt-get install fuse)"
    return None


class _Line:
    """A delay line shared by the daemon's threads (``slowlink.DelayLine`` runs in one event loop)."""

    def __init__(self, spec: LinkSpec):
        self._spec = spec
        self._lock = threading.Lock()
        self._last_release_s = 0.0

    def wait(self, size_bytes: int) -> None:
        with self._lock:
            now_s = time.monotonic()
            release_s = (
                max(now_s + self._spec.latency_s, self._last_release_s) + size_bytes / self._spec.rate_bytes_per_s
            )
            self._last_release_s = release_s
        delay_s = release_s - time.monotonic()
        if delay_s > 0:
            time.sleep(delay_s)


class _PassthroughOps:
    """The FUSE operations of the slow mount: each passed to the source directory; reads and writes
    wait on their delay line first (``passthrough`` adds fusepy's base and error mapping)."""

    def __init__(self, source: str, spec: LinkSpec, fail_reads_flag: str | None = None):
        self._source = source
        self._reads, self._writes = _Line(spec), _Line(spec)
        self._fail_reads_flag = fail_reads_flag

    def _path(self, path: str) -> str:
        return os.path.join(self._source, path.lstrip("/"))

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        st = os.lstat(self._path(path))
        names = ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size", "st_uid")
        return {name: getattr(st, name) for name in names}

    def readdir(self, path: str, fh: Any) -> list[str]:
        return [".", "..", *os.listdir(self._path(path))]

    def statfs(self, path: str) -> dict[str, Any]:
        st = os.statvfs(self._path(path))
        names = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_frsize")
        return {name: getattr(st, name) for name in (*names, "f_flag", "f_namemax")}

    def open(self, path: str, flags: int) -> int:
        # O_DIRECT is the mount's (the kernel sends such reads here uncached); the source file is
        # read with Python's unaligned buffers.
        return os.open(self._path(path), flags & ~os.O_DIRECT)

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        # fusepy does not pass the open flags here: read-write, so a file written and read back
        # through one descriptor (kvtier's O_DIRECT probe) works.
        return os.open(self._path(path), os.O_RDWR | os.O_CREAT, mode)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        if self._fail_reads_flag is not None and os.path.exists(self._fail_reads_flag):
            raise OSError(errno.EIO, "read error injected (slowmount --fail-reads-when)")
        data = os.pread(fh, size, offset)
        self._reads.wait(len(data))
        return data

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        self._writes.wait(len(data))
        return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: Any = None) -> None:
        os.truncate(self._path(path), length)

    def flush(self, path: str, fh: int) -> None:
        return None

    def fsync(self, path: str, datasync: int, fh: int) -> None:
        (os.fdatasync if datasync else os.fsync)(fh)

    def release(self, path: str, fh: int) -> None:
        os.close(fh)

    def unlink(self, path: str) -> None:
        os.unlink(self._path(path))

    def rename(self, old: str, new: str) -> None:
        os.rename(self._path(old), self._path(new))

    def mkdir(self, path: str, mode: int) -> None:
        os.mkdir(self._path(path), mode)

    def rmdir(self, path: str) -> None:
        os.rmdir(self._path(path))

    def chmod(self, path: str, mode: int) -> None:
        os.chmod(self._path(path), mode)

    def utimens(self, path: str, times: Any = None) -> None:
        os.utime(self._path(path), times)


def passthrough(source: str, spec: LinkSpec, fail_reads_flag: str | None = None) -> Any:
    """fusepy's operations object for the slow mount of ``source`` (reads fail with EIO while
    ``fail_reads_flag`` exists, when given)."""
    from fuse import FuseOSError, Operations

    class Passthrough(_PassthroughOps, Operations):
        def __call__(self, op: str, *args: Any) -> Any:
            try:
                return super().__call__(op, *args)
            except OSError as error:  # the source's own error, as the caller would see it locally
                raise FuseOSError(error.errno or errno.EIO) from None

    return Passthrough(source, spec, fail_reads_flag)


def _unmount(mountpoint: str) -> None:
    command = ["umount", mountpoint] if os.geteuid() == 0 else ["fusermount", "-u", mountpoint]
    subprocess.run(command, capture_output=True, timeout=30, check=False)


class SlowMount:
    """The slow mount of ``source`` at ``mountpoint`` in a child process; unmounted by ``close()``.
    ``fail_reads_flag``: while this file exists, every read of the mount fails with EIO."""

    def __init__(
        self,
        source: str | os.PathLike,
        mountpoint: str | os.PathLike,
        spec: LinkSpec,
        log_path: Any = None,
        fail_reads_flag: str | os.PathLike | None = None,
    ):
        self.source, self.mountpoint, self.spec = Path(source), Path(mountpoint), spec
        self._log_path = log_path
        self.fail_reads_flag = Path(fail_reads_flag).absolute() if fail_reads_flag is not None else None
        self.process: subprocess.Popen | None = None

    @property
    def ceiling_note(self) -> str | None:
        if self.spec.rate_mb_per_s < CEILING_MB_PER_S * 0.5:
            return None
        return (
            f"{self.spec.rate_mb_per_s:g} MB/s is near the FUSE passthrough's own ceiling here (about "
            f"{CEILING_MB_PER_S:g} MB/s): the mount may deliver less than its line"
        )

    def start(self) -> None:
        reason = missing_reason()
        if reason:
            raise SlowLinkError(reason)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "kvtier.bench.slowmount", str(self.source), str(self.mountpoint)]
        command += ["--rate-mb-per-s", repr(self.spec.rate_mb_per_s), "--latency-ms", repr(self.spec.latency_ms)]
        if self.fail_reads_flag is not None:
            command += ["--fail-reads-when", str(self.fail_reads_flag)]
        with contextlib.ExitStack() as stack:  # the log is the child's: closed here once it has it
            log = stack.enter_context(open(self._log_path, "a")) if self._log_path else subprocess.DEVNULL
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=log, stderr=log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.ismount(self.mountpoint):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                where = f"; see {self._log_path}" if self._log_path else ""
                raise SlowLinkError(f"the slow mount of {self.source} at {self.mountpoint} did not come up{where}")
            time.sleep(0.05)

    def close(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(OSError):
            assert process.stdin is not None
            process.stdin.close()  # the child unmounts and exits
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        if os.path.ismount(self.mountpoint):
            _unmount(str(self.mountpoint))

    def __enter__(self) -> SlowMount:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.bench.slowmount",
        description="A FUSE passthrough with a bandwidth limit and an added latency; unmounts when stdin closes.",
    )
    parser.add_argument("source", help="the directory passed through")
    parser.add_argument("mountpoint", help="where it is mounted")
    parser.add_argument("--rate-mb-per-s", type=float, required=True, help="bandwidth of reads, and of writes, MB/s")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="latency added to each read and write")
    parser.add_argument("--fail-reads-when", metavar="PATH", help="every read fails with EIO while this file exists")
    args = parser.parse_args(argv)
    try:
        spec = LinkSpec(args.rate_mb_per_s, args.latency_ms)
    except SlowLinkError as error:
        print(f"slowmount: {error}", file=sys.stderr)
        return 2
    from fuse import FUSE

    def unmount_at_end_of_input() -> None:
        sys.stdin.read()  # returns when the parent closes stdin, or is gone
        _unmount(args.mountpoint)

    threading.Thread(target=unmount_at_end_of_input, daemon=True).start()
    print(f"{READY_PREFIX}{args.mountpoint}", flush=True)
    FUSE(passthrough(args.source, spec, args.fail_reads_when), args.mountpoint, foreground=True, nothreads=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
