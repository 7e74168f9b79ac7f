"""The shared tier on real distributed filesystems: GlusterFS and CephFS on 127.0.0.1 (fixtures in
``fs_fixtures.py``, bring-up in ``scripts/distfs/``), each mounted twice so that node A and node B
only share the filesystem, with each filesystem's default client caching and with strict caching.

Every test checks every byte it is served against the value it expects, independently of kvtier's
checksums: a run passes only with 0 wrong bytes. Where default caching shows other nodes stale data
(GlusterFS: attributes, names and pages cached for 1 s), the tests accept a miss that is counted, or
the right (older) bytes, never anything else.

Run: ``.venv/bin/python -m pytest tests/test_shared_fs.py -v -s`` (as root; ``-m glusterfs`` or
``-m cephfs`` for one filesystem). See docs/shared-tier.md, "Filesystems".
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvtier
from fs_fixtures import REPO, DistFs

OBJECT_BYTES = 64 * 1024
SLOT_BYTES = 4096 + OBJECT_BYTES
STRESS = Path(os.environ.get("KVTIER_STRESS_BIN", REPO / "target" / "release" / "kvtier-shared-stress"))

FS_MODES = [
    pytest.param(("glusterfs", "default"), marks=pytest.mark.glusterfs, id="glusterfs-default"),
    pytest.param(("glusterfs", "strict"), marks=pytest.mark.glusterfs, id="glusterfs-strict"),
    pytest.param(("cephfs", "default"), marks=pytest.mark.cephfs, id="cephfs-default"),
    pytest.param(("cephfs", "strict"), marks=pytest.mark.cephfs, id="cephfs-strict"),
]


class Nodes:
    """One test's directory on the shared filesystem, as node A and node B see it."""

    def __init__(self, fs: DistFs, mode: str, a: Path, b: Path, local: Path) -> None:
        self.fs, self.mode, self.a, self.b, self.local = fs, mode, a, b, local
        self.stores: list[kvtier.Store] = []

    def open(self, name: str, shared: Path, **extra) -> kvtier.Store:
        """A store (closed by the fixture, also when the test fails) with local state in ``name``."""
        store = open_node(self.local / name, shared, **extra)
        self.stores.append(store)
        return store

    @property
    def label(self) -> str:
        return f"{self.fs.name}-{self.mode}"


@pytest.fixture(params=FS_MODES)
def nodes(request, tmp_path) -> Iterator[Nodes]:
    name, mode = request.param
    fs: DistFs = request.getfixturevalue(f"{name}_fs")
    sub = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name) + f"-{os.getpid()}-{time.time_ns()}"
    a, b = fs.nodes(mode, sub)
    n = Nodes(fs, mode, a, b, tmp_path)
    yield n
    for store in n.stores:
        store.close()
    shutil.rmtree(a, ignore_errors=True)


def key(i: int, tag: str = "fs") -> bytes:
    return hashlib.sha256(f"{tag}-{i}".encode()).digest()


def value(i: int, tag: str = "fs") -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(f"value-{tag}-{i}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, OBJECT_BYTES, dtype=np.uint8)


def open_node(local: Path, shared: Path, namespace: str = "fs-test", **extra) -> kvtier.Store:
    options: dict = {
        "object_bytes": OBJECT_BYTES,
        "namespace": namespace,
        "dram_bytes": SLOT_BYTES,  # the DRAM tier's minimum (eight slots): tests count shared_hits
        "nvme_bytes": 0,
        "io_engine": "psync",
        "shared_root": str(shared),
        "shared_staleness_ms": 100,
        "shared_file_bytes": 1 << 20,
    }
    options.update(extra)
    return kvtier.Store.open(str(local), **options)


def wait_visible(store: kvtier.Store, keys: list[bytes], timeout_s: float = 15.0) -> float | None:
    """Seconds until every key is indexed, or None."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if store.lookup_prefix(keys) == len(keys):
            return time.monotonic() - started
        time.sleep(0.02)
    return None


def read_checked(store: kvtier.Store, keys: list[bytes], expected: list[np.ndarray]) -> tuple[int, int, int]:
    """Gets every key one at a time (from DRAM or the shared tier: assertions about the shared tier
    use its counters) and compares it with what it must be. Returns (hits, misses, wrong)."""
    hits = misses = wrong = 0
    for k, want in zip(keys, expected, strict=True):
        out = np.zeros(OBJECT_BYTES, np.uint8)
        if store.get_many([k], [out])[0]:
            hits += 1
            wrong += int(not np.array_equal(out, want))
        else:
            misses += 1
    return hits, misses, wrong


def ns_dirs(root: Path) -> list[Path]:
    return sorted(d for d in root.iterdir() if d.is_dir() and re.fullmatch(r"[0-9a-f]{64}", d.name))


def data_files(ns_dir: Path) -> list[Path]:
    return sorted(ns_dir.glob("data/*/*.kvs"))


def test_cross_node_reuse_and_restart(nodes: Nodes) -> None:
    """Node A publishes, node B reads through its own mount; after both close, a new process on node
    B's mount rebuilds the index from the manifests and serves the same bytes."""
    keys = [key(i) for i in range(40)]
    values = [value(i) for i in range(40)]
    a = nodes.open("a", nodes.a)
    b = nodes.open("b", nodes.b)
    published_at = time.monotonic()
    a.put_many(keys, values)
    a.flush()
    flushed_s = time.monotonic() - published_at
    seen = wait_visible(b, keys)
    assert seen is not None, f"{nodes.label}: blocks published through node A never became visible to node B in 15 s"
    hits, misses, wrong = read_checked(b, keys, values)
    assert wrong == 0, f"{nodes.label}: node B was served {wrong} wrong blocks"
    assert (hits, misses) == (40, 0), f"{nodes.label}: node B hits {hits}, misses {misses}"
    assert b.stats()["shared_hits"] >= 40
    print(f"\n{nodes.label}: flush {flushed_s * 1e3:.0f} ms, visible on node B {seen * 1e3:.0f} ms after the flush")
    a.close()
    b.close()
    started = time.monotonic()
    c = nodes.open("c", nodes.b)
    reopened_s = time.monotonic() - started
    assert c.lookup_prefix(keys) == 40, f"{nodes.label}: a restarted store indexed {c.lookup_prefix(keys)} of 40"
    hits, misses, wrong = read_checked(c, keys, values)
    assert (hits, misses, wrong) == (40, 0, 0), (
        f"{nodes.label}: after restart hits {hits} misses {misses} wrong {wrong}"
    )
    print(f"{nodes.label}: restart indexed 40 blocks in {reopened_s * 1e3:.0f} ms")
    c.close()


OPEN_AT_ONCE = """
import sys, time, kvtier
root, local, at = sys.argv[1], sys.argv[2], float(sys.argv[3])
while time.time() < at:
    pass
try:
    kvtier.Store.open(local, object_bytes=65536, namespace="race", nvme_bytes=0, shared_root=root).close()
    print("ok")
except Exception as e:
    print(f"FAILED {type(e).__name__}: {e}")
"""


def test_nodes_opening_a_new_namespace_at_once(nodes: Nodes) -> None:
    """Replicas start together: one process per node opens the same new namespace at the same instant
    (three rounds). On GlusterFS with default caching the loser of a mkdir race saw EEXIST and
    then no directory, or ENOENT under the winner's new directory, and failed to open; the tier now
    retries for up to 3 s. Every open must succeed."""
    failures = []
    for round_ in range(3):
        sub = f"race{round_}"
        (nodes.a / sub).mkdir()
        at = time.time() + 1.5
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", OPEN_AT_ONCE, str(root / sub), str(nodes.local / f"{sub}-{i}"), str(at)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i, root in enumerate((nodes.a, nodes.b))
        ]
        for p in procs:
            out, _ = p.communicate(timeout=120)
            if "ok" not in out.splitlines():
                failures.append(f"round {round_}: {out.strip()[-400:]}")
    assert not failures, f"{nodes.label}: simultaneous opens failed:\n" + "\n".join(failures)


def corrupt_values(path: Path) -> int:
    """Flips bytes in the middle of every entry's value, in place (same inode, same size). Returns the
    number of entries."""
    size = path.stat().st_size
    entries = 0
    with open(path, "r+b") as f:
        offset = 4096
        while offset + SLOT_BYTES <= size - 4096:
            f.seek(offset)
            if f.read(8) != b"KVTRENT\0":
                break
            f.seek(offset + 4096 + OBJECT_BYTES // 2)
            chunk = f.read(64)
            f.seek(offset + 4096 + OBJECT_BYTES // 2)
            f.write(bytes(x ^ 0xFF for x in chunk))
            entries += 1
            offset += SLOT_BYTES
        f.flush()
        os.fsync(f.fileno())
    return entries


def test_corrupted_file_is_a_counted_miss_never_wrong_bytes(nodes: Nodes) -> None:
    """Node B has read a file (its handle is open, its caches warm); node A's mount overwrites the
    values in place. Node B is served the right (older, cached) bytes or a counted miss, never the
    corrupt ones; once its caches expire the first read of a corrupt block quarantines the file, and
    node A drops it too."""
    keys = [key(i, "corrupt") for i in range(12)]
    values = [value(i, "corrupt") for i in range(12)]
    a = nodes.open("a", nodes.a)
    b = nodes.open("b", nodes.b)
    a.put_many(keys, values)
    a.flush()
    assert wait_visible(b, keys) is not None
    assert read_checked(b, keys, values) == (12, 0, 0)
    (ns,) = ns_dirs(nodes.a)
    files = data_files(ns)
    assert len(files) == 1, f"expected one data file, found {files}"
    assert corrupt_values(files[0]) == 12
    corrupted_at = time.monotonic()
    stale_hits = 0
    while b.stats()["shared_quarantined_files"] == 0:
        before = b.stats()["shared_hits"]
        _hits, _misses, wrong = read_checked(b, keys, values)
        assert wrong == 0, f"{nodes.label}: node B was served {wrong} corrupt blocks"
        stale_hits += b.stats()["shared_hits"] - before
        assert time.monotonic() - corrupted_at < 10, f"{nodes.label}: the corruption went unnoticed for 10 s"
        time.sleep(0.05)
    detected_s = time.monotonic() - corrupted_at
    stats = b.stats()
    assert stats["checksum_failures"] >= 1
    assert (ns / "quarantine" / files[0].name).exists()
    before = b.stats()["shared_hits"]
    _hits, misses, wrong = read_checked(b, keys, values)  # hits: blocks still in node B's DRAM tier
    assert wrong == 0 and b.stats()["shared_hits"] == before, f"{nodes.label}: the quarantined file was served"
    assert misses >= 4
    # Node A drops the file too (the quarantine record, read within the staleness bound plus GlusterFS's
    # 1 s default caches) and never serves it.
    time.sleep(2)
    before = a.stats()["shared_hits"]
    assert read_checked(a, keys, values)[2] == 0
    assert a.stats()["shared_hits"] == before, f"{nodes.label}: node A served the quarantined file"
    print(
        f"\n{nodes.label}: corruption detected {detected_s * 1e3:.0f} ms after the overwrite; "
        f"{stale_hits} reads served the older right bytes meanwhile"
    )


def test_truncated_file_is_quarantined_after_the_settle_time(nodes: Nodes) -> None:
    """A published file read short is a miss counted in io_errors and, only if it is still short 2 s
    later, quarantined: GlusterFS with default caching serves short reads of whole files for about a
    second (a cached size), which quarantined good files before. A real truncation through node A's
    mount is never served and is quarantined once it has lasted 2 s."""
    keys = [key(i, "trunc") for i in range(12)]
    values = [value(i, "trunc") for i in range(12)]
    a = nodes.open("a", nodes.a)
    b = nodes.open("b", nodes.b)
    a.put_many(keys, values)
    a.flush()
    assert wait_visible(b, keys) is not None
    assert read_checked(b, keys, values) == (12, 0, 0)
    (ns,) = ns_dirs(nodes.a)
    (path,) = data_files(ns)
    os.truncate(path, 4096 + 3 * SLOT_BYTES)  # keeps the header and the first three entries
    truncated_at = time.monotonic()
    first_short = None
    while b.stats()["shared_quarantined_files"] == 0:
        before = b.stats()["shared_hits"]
        _hits, _misses, wrong = read_checked(b, keys, values)
        assert wrong == 0, f"{nodes.label}: node B served {wrong} wrong blocks from a truncated file"
        if first_short is None and b.stats()["io_errors"] > 0:
            first_short = time.monotonic()
        assert b.stats()["shared_hits"] - before <= 12
        assert time.monotonic() - truncated_at < 10, f"{nodes.label}: the truncated file was never quarantined"
        time.sleep(0.1)
    quarantined_at = time.monotonic()
    assert first_short is not None, f"{nodes.label}: short reads were not counted in io_errors"
    assert quarantined_at - first_short >= 1.9, f"{nodes.label}: quarantined {quarantined_at - first_short:.2f} s after"
    before = b.stats()["shared_hits"]
    read_checked(b, keys, values)
    assert b.stats()["shared_hits"] == before
    print(
        f"\n{nodes.label}: truncation seen {first_short - truncated_at:.2f} s after it, quarantined "
        f"{quarantined_at - first_short:.2f} s after the first short read"
    )


def test_a_name_replaced_under_a_reader_is_a_miss_or_the_old_bytes(nodes: Nodes) -> None:
    """rename() replaces a data file that node B has open and cached with another kvtier file (on
    GlusterFS with default caching, other mounts see the old inode or ESTALE for about 1 s). kvtier
    never reuses a name itself; this is the worst another writer can do to readers. Node B, whose
    handle keeps the old inode, serves the old (right) bytes or a counted miss; a fresh process on
    node B reads the replacement, which fails verification: a counted miss, its file quarantined."""
    first = [key(i, "first") for i in range(8)]
    second = [key(i, "second") for i in range(8)]
    vf = [value(i, "first") for i in range(8)]
    vs = [value(i, "second") for i in range(8)]
    a = nodes.open("a", nodes.a)
    b = nodes.open("b", nodes.b)
    a.put_many(first, vf)
    a.flush()
    a.put_many(second, vs)
    a.flush()
    assert wait_visible(b, first + second) is not None
    assert read_checked(b, first + second, vf + vs) == (16, 0, 0)
    (ns,) = ns_dirs(nodes.a)
    f1, f2 = data_files(ns)
    with open(f1, "rb") as f:  # which file holds the first keys: its first descriptor names one
        f.seek(4096)
        page = f.read(4096)
    old, new = (f1, f2) if any(k in page for k in first) else (f2, f1)
    a.close()  # node A's own handles stay out of it
    os.replace(new, old)  # through node A's mount
    replaced_at = time.monotonic()
    served_old = missed = 0
    while time.monotonic() - replaced_at < 2:
        hits, misses, wrong = read_checked(b, first, vf)
        assert wrong == 0, f"{nodes.label}: node B served {wrong} wrong blocks after the rename"
        served_old += hits
        missed += misses
        time.sleep(0.05)
    c = nodes.open("c", nodes.b)
    hits, misses, wrong = read_checked(c, first, vf)
    assert (hits, wrong) == (0, 0), (
        f"{nodes.label}: a fresh process served the replaced name: hits {hits}, wrong {wrong}"
    )
    stats = c.stats()
    assert stats["checksum_failures"] >= 1 and stats["shared_quarantined_files"] == 1, stats
    print(
        f"\n{nodes.label}: after rename-over, node B (open handle) served the old right bytes {served_old} times "
        f"and missed {missed} times in 2 s; a fresh process: {misses} counted misses, file quarantined"
    )


def test_foreign_namespace_is_never_served(nodes: Nodes) -> None:
    """Tenant X publishes through node A; tenant Y on node B sees nothing, also after X's manifest and
    data files are planted in Y's namespace directory."""
    keys = [key(i, "tenant") for i in range(8)]
    values = [value(i, "tenant") for i in range(8)]
    x = nodes.open("x", nodes.a, namespace="tenant-x")
    x.put_many(keys, values)
    x.flush()
    (x_dir,) = ns_dirs(nodes.a)
    y = nodes.open("y", nodes.b, namespace="tenant-y")
    y_dir = next(d for d in ns_dirs(nodes.a) if d != x_dir)
    for f in data_files(x_dir):
        target = y_dir / "data" / f.parent.name
        target.mkdir(exist_ok=True)
        shutil.copy(f, target / f.name)
    for m in (x_dir / "manifests").iterdir():
        shutil.copy(m, y_dir / "manifests" / m.name)
    time.sleep(1.5)  # past GlusterFS's default 1 s caches and many refresh passes
    y2 = nodes.open("y2", nodes.b, namespace="tenant-y")
    for store in (y, y2):
        assert store.lookup_prefix(keys) == 0
        hits, _misses, wrong = read_checked(store, keys, [np.zeros(OBJECT_BYTES, np.uint8)] * len(keys))
        assert (hits, wrong) == (0, 0), f"{nodes.label}: tenant Y was served tenant X's blocks"
        assert store.stats()["shared_hits"] == 0
    for s in (x, y, y2):
        s.close()


def statvfs_fraction(path: Path) -> tuple[float, int]:
    s = os.statvfs(path)
    used = (s.f_blocks - s.f_bfree) * s.f_frsize
    avail = s.f_bavail * s.f_frsize
    return (used / (used + avail) if used + avail else 1.0), s.f_blocks * s.f_frsize


def test_statvfs_drives_the_watermarks(nodes: Nodes) -> None:
    """The tier measures usage with statvfs of the shared root (no capacity_bytes). Both nodes must
    see a capacity; with shared_fail_on_full and the high watermark below the measured usage, writers
    refuse to publish (counted), and with it above they publish."""
    frac_a, cap_a = statvfs_fraction(nodes.a)
    frac_b, cap_b = statvfs_fraction(nodes.b)
    assert cap_a > 0 and cap_b > 0, (
        f"{nodes.label}: statvfs reports a capacity of {cap_a} bytes; the tier would count the root as full "
        "(CephFS: run a ceph-mgr, statvfs reads 0 without one)"
    )
    filler = None
    if frac_a < 0.1:  # a nearly empty filesystem (the CephFS OSD): fill it to a known level
        filler = nodes.a / "filler"
        chunk = os.urandom(8 << 20)
        target = int(cap_a * 0.3)
        with open(filler, "wb") as f:
            for _ in range(target // len(chunk)):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        written_at = time.monotonic()
        while statvfs_fraction(nodes.b)[0] < 0.2:
            assert time.monotonic() - written_at < 60, f"{nodes.label}: statvfs never showed the filler"
            time.sleep(0.2)
        print(f"\n{nodes.label}: statvfs showed {target >> 20} MiB written {time.monotonic() - written_at:.1f} s later")
    frac_b, _ = statvfs_fraction(nodes.b)
    print(f"\n{nodes.label}: statvfs capacity {cap_b >> 20} MiB, used {frac_b:.3f}")
    keys = [key(i, "full") for i in range(20)]
    values = [value(i, "full") for i in range(20)]
    try:
        high = round(frac_b * 0.5, 3)
        refused = nodes.open(
            "r",
            nodes.b,
            shared_high_watermark=high,
            shared_low_watermark=high / 2,
            shared_fail_on_full=True,
        )
        refused.put_many(keys, values)
        refused.flush()
        stats = refused.stats()
        assert stats["shared_files_published"] == 0, f"{nodes.label}: published above the high watermark"
        assert stats["shared_publish_errors"] >= 1
        refused.close()
        ok = nodes.open("ok", nodes.b, shared_high_watermark=0.99, shared_low_watermark=0.98)
        ok.put_many(keys, values)
        ok.flush()
        assert ok.stats()["shared_files_published"] >= 1
        assert read_checked(ok, keys, values) == (20, 0, 0)
        ok.close()
    finally:
        if filler is not None:
            filler.unlink()


def lease_holder(ns_dir: Path) -> tuple[str, int] | None:
    try:
        leases = sorted((ns_dir / "lease").iterdir())
        data = leases[-1].read_bytes() if leases else b""
    except OSError:
        return None
    if len(data) < 64:
        return None
    return f"{int.from_bytes(data[24:32], 'little'):016x}", int.from_bytes(data[32:40], "little")


def allocated(d: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(d):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, f)).st_blocks * 512
    return total


class UsageSampler:
    """The most bytes allocated under a directory, measured over and over on a thread of its own."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.max_bytes = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            self.max_bytes = max(self.max_bytes, allocated(self.directory))
            self.done.wait(0.05)

    def stop(self) -> int:
        self.done.set()
        self.thread.join(timeout=60)
        return self.max_bytes


def stress_total(lines: list[str], name: str) -> int:
    """Sum of one counter over the stress children's STATS lines."""
    total = 0
    for line in lines:
        found = re.search(rf" {name}=(\d+)", line)
        assert found, f"no {name} in {line!r}"
        total += int(found.group(1))
    return total


def test_four_writers_with_eviction_and_lease_takeover_after_sigkill(nodes: Nodes) -> None:
    """Four kvtier-shared-stress processes, two per node, publish and read random blocks (every value
    derived from its key, checked byte for byte) under a 24 MiB capacity, so the lease holder evicts
    all along; once a holder is seen with a live lease (it holds one only while there is eviction to
    do) after the first 3 s, it is SIGKILLed and another process must take the lease over. The run
    lasts as long as that takes (the children stop when told): on a busy machine the filesystems
    fill more slowly, and a run of fixed length once killed too late to see a takeover."""
    if not STRESS.exists():
        pytest.skip(
            f"{STRESS} missing: build it with "
            "`cargo build --release -p kvtier-core --features testing --bin kvtier-shared-stress`"
        )
    capacity = 24 << 20
    kill_after_s, kill_by_s, takeover_by_s = 3.0, 40.0, 20.0
    nodes.local.mkdir(parents=True, exist_ok=True)
    stop_file = nodes.local / "stop-stress"  # local: the children look for it at every publish
    args = [
        f"secs={int(kill_by_s + takeover_by_s + 10)}",  # a bound: the test stops them (stop_file)
        f"stop_file={stop_file}",
        f"capacity_bytes={capacity}",
        "file_bytes=1048576",
        "grace_ms=400",
        "lease_ms=2000",
        "staleness_ms=100",
        "publish_every_ms=10",
        # Blocks of about a tiny model's size (256 KiB): every publish fills a 1 MiB file.
        "object_bytes=240000",
    ]
    children: list[tuple[subprocess.Popen, str, Path]] = []
    for root in (nodes.a, nodes.b, nodes.a, nodes.b):
        p = subprocess.Popen(
            [str(STRESS), f"root={root}", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert p.stdout is not None
        first = p.stdout.readline().strip()
        assert first.startswith("WRITER "), f"stress child said {first!r}: {p.stderr.read() if p.stderr else ''}"
        children.append((p, first.removeprefix("WRITER "), root))
    ns_dir = ns_dirs(nodes.a)[0]
    started = time.monotonic()
    killed: str | None = None
    killed_at = 0.0
    takeover_s: float | None = None
    # Walking the namespace takes seconds on GlusterFS with strict caching: measured beside the loop,
    # which reads the lease every 50 ms so as not to miss the holder's live spells.
    usage = UsageSampler(ns_dir)
    try:
        while True:
            holder = lease_holder(ns_dir)
            elapsed = time.monotonic() - started
            if killed is None and elapsed > kill_by_s:
                break  # failed below
            if killed is not None and (takeover_s is not None or time.monotonic() - killed_at > takeover_by_s):
                time.sleep(1)  # the new holder evicts a while
                break
            if killed is None and elapsed > kill_after_s and holder and holder[1] > time.time() * 1000:
                for i, (p, wid, _root) in enumerate(children):
                    if wid == holder[0]:
                        p.send_signal(signal.SIGKILL)
                        p.wait()
                        killed, killed_at = wid, time.monotonic()
                        print(f"\n{nodes.label}: killed the lease holder {elapsed:.1f} s into the run")
                        children.pop(i)
                        break
            elif killed is not None and holder and holder[0] != killed:
                takeover_s = time.monotonic() - killed_at
            time.sleep(0.05)
    finally:
        stop_file.touch()
    max_used = usage.stop()
    lines = []
    for p, wid, root in children:
        out, err = p.communicate(timeout=60)
        stats = next((line for line in out.splitlines() if line.startswith("STATS")), "")
        lines.append(f"{wid} on {root.parent.name}: {stats}")
        assert p.returncode == 0, (
            f"{nodes.label}: stress child {wid} exited {p.returncode} (2 = wrong bytes):\n{err[-3000:]}"
        )
        assert " wrong=0 " in stats
    print(
        f"\n{nodes.label}: killed lease holder {killed}, taken over after {takeover_s}s; max usage {max_used >> 20} MiB"
    )
    print("\n".join(lines))
    assert killed is not None, f"{nodes.label}: no live lease holder was found to kill in {kill_by_s:.0f} s"
    assert takeover_s is not None, (
        f"{nodes.label}: the lease did not move from the killed holder in {takeover_by_s:.0f} s"
    )
    hits = stress_total(lines, "hits")
    evicted = stress_total(lines, "evicted")
    quarantined = stress_total(lines, "quarantined")
    assert hits > 100 and evicted > 0, f"{nodes.label}: hits {hits}, evicted {evicted}"
    # Nothing here is corrupt: a quarantine would be a good file taken for a bad one (GlusterFS's default
    # caching caused 1 to 4 per run before short reads were given SHORT_READ_SETTLE).
    assert quarantined == 0, f"{nodes.label}: {quarantined} good files quarantined"
    # The evictor runs between publishes, not inside them: past the high watermark each of the four
    # writers may still have one file being written and one published since the last pass, and the
    # killed writer leaves one file behind until its lease is taken over (9 files). The local-disk
    # version of this test (shared_tier.rs) allows 5; on GlusterFS with strict caching a fresh-clone
    # CI run measured 29508608 bytes against that bound of 29150412.
    bound = int(0.95 * capacity) + 9 * (1 << 20)
    assert max_used <= bound, f"{nodes.label}: usage {max_used} above {bound}"
