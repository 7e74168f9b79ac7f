"""The benchmarks' slow mount (``kvtier.bench.slowmount``): a real FUSE passthrough of a directory whose
reads and writes go through the slow link's delay line.

- a cold read through the mount gets the source's bytes, never faster than the rate (within a tolerance
  of it on this busy machine), and a small read waits the added latency;
- a write through the mount lands in the source, at the rate;
- renames, listings and removals pass through (what the shared tier's publisher does);
- closing it unmounts and leaves no process;
- with a fail-reads flag, every read fails with EIO while the flag file exists.

Needs fusepy and /dev/fuse (root, or fusermount): skipped with the install command otherwise. About 3 s.
"""

from __future__ import annotations

import errno
import os
import time

import pytest

from kvtier.bench import slowmount
from kvtier.bench.slowlink import LinkSpec

MB = 1_000_000

pytestmark = pytest.mark.skipif(slowmount.missing_reason() is not None, reason=str(slowmount.missing_reason()))


def test_reads_and_writes_go_at_the_rate_and_arrive_intact(tmp_path):
    source, mountpoint = tmp_path / "source", tmp_path / "mount"
    source.mkdir()
    payload = os.urandom(4 * MB)
    (source / "blob").write_bytes(payload)
    mount = slowmount.SlowMount(source, mountpoint, LinkSpec(20), log_path=tmp_path / "mount.log")
    with mount:
        assert os.path.ismount(mountpoint) and mount.ceiling_note is None
        started = time.perf_counter()
        assert (mountpoint / "blob").read_bytes() == payload  # cold: this mount has cached nothing
        read_s = time.perf_counter() - started
        started = time.perf_counter()
        (mountpoint / "copy.partial").write_bytes(payload[: 2 * MB])
        write_s = time.perf_counter() - started
        os.rename(mountpoint / "copy.partial", mountpoint / "copy")
        assert sorted(os.listdir(mountpoint)) == ["blob", "copy"]
        os.unlink(mountpoint / "blob")
        process = mount.process
    assert (source / "copy").read_bytes() == payload[: 2 * MB]
    assert not (source / "blob").exists()
    assert 0.95 * 0.2 <= read_s <= 1.6 * 0.2 + 0.1, read_s  # 4 MB at 20 MB/s
    assert 0.95 * 0.1 <= write_s <= 1.6 * 0.1 + 0.1, write_s  # 2 MB
    assert not os.path.ismount(mountpoint)
    assert process is not None and process.poll() is not None
    assert slowmount.SlowMount(source, mountpoint, LinkSpec(100)).ceiling_note is not None


def test_each_request_waits_the_added_latency(tmp_path):
    source, mountpoint = tmp_path / "source", tmp_path / "mount"
    source.mkdir()
    (source / "small").write_bytes(b"x")
    with slowmount.SlowMount(source, mountpoint, LinkSpec(100, latency_ms=50)):
        started = time.perf_counter()
        assert (mountpoint / "small").read_bytes() == b"x"
        small_s = time.perf_counter() - started
    assert 0.05 <= small_s <= 0.05 * 1.6 + 0.1, small_s


def test_reads_fail_while_the_flag_exists(tmp_path):
    """``--fail-reads-when FLAG`` (kvtier bench faults' nvme-read-errors): EIO on every read while the
    flag file exists; writes go on; reads work again once it is gone."""
    source, mountpoint, flag = tmp_path / "source", tmp_path / "mount", tmp_path / "fail-reads"
    source.mkdir()
    (source / "blob").write_bytes(b"kv" * 1000)
    with slowmount.SlowMount(source, mountpoint, LinkSpec(1000), fail_reads_flag=flag):
        assert (mountpoint / "blob").read_bytes() == b"kv" * 1000
        flag.touch()
        fd = os.open(mountpoint / "blob", os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            with pytest.raises(OSError) as raised:
                os.read(fd, 4096)
            assert raised.value.errno == errno.EIO
        finally:
            os.close(fd)
        (mountpoint / "written").write_bytes(b"ok")
        flag.unlink()
        fd = os.open(mountpoint / "blob", os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            assert os.read(fd, 4096).startswith(b"kvkv")
        finally:
            os.close(fd)
    assert (source / "written").read_bytes() == b"ok"
    assert not os.path.ismount(mountpoint)
