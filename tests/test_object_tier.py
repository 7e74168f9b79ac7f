"""The object-storage tier against a real S3 server: Ceph's RADOS gateway on 127.0.0.1
(``scripts/distfs/radosgw.sh``, one cluster for the whole module), two stores ("nodes") that share
only the bucket.

Every test checks the bytes it is served against the values it stored. Tampering goes straight to
the bucket with curl's SigV4 signing (no S3 SDK in the test environment).

Skips (with the fix in the reason) when not root or without the Debian packages (``scripts/setup.sh``
installs them as root); ``KVTIER_REQUIRE_DISTFS=1`` turns the skips into failures.

Run: ``.venv/bin/python -m pytest tests/test_object_tier.py -v`` (as root). See docs/object-tier.md.
"""

from __future__ import annotations

import atexit
import base64
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import kvtier
from fs_fixtures import REPO, STATE_ROOT, _skip_or_fail, processes_naming
from served import ServedStore

pytestmark = pytest.mark.radosgw

OBJECT_BYTES = 64 * 1024
SLOT_BYTES = 4096 + OBJECT_BYTES
BUCKET = "kvtier-test"
SCRIPT = REPO / "scripts" / "distfs" / "radosgw.sh"
# A lifecycle "day" of the test gateway (radosgw.sh sets rgw_lc_debug_interval to it; rules run as often).
LC_DAY_S = int(os.environ.get("KVTIER_RGW_LC_DAY_S", "5"))
BINARIES = ["ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph-authtool", "monmaptool", "curl"]


@dataclass
class Rgw:
    endpoint: str
    access_key: str
    secret_key: str
    pid: int
    state: Path

    def s3(
        self, method: str, path: str, body: bytes = b"", query: str = "", headers: tuple[str, ...] = ()
    ) -> tuple[int, bytes]:
        """One signed request (curl --aws-sigv4); returns (HTTP status, body)."""
        url = f"{self.endpoint}/{path}" + (f"?{query}" if query else "")
        cmd = ["curl", "-s", "-X", method, "--aws-sigv4", "aws:amz:us-east-1:s3"]
        cmd += ["--user", f"{self.access_key}:{self.secret_key}", "-o", "-", "-w", "\n%{http_code}"]
        for header in headers:
            cmd += ["-H", header]
        cmd += ["-H", f"x-amz-content-sha256: {hashlib.sha256(body).hexdigest()}", url]
        if body or method == "PUT":
            cmd[1:1] = ["--data-binary", "@-"]
        done = subprocess.run(cmd, input=body, capture_output=True, timeout=30)
        out, _, code = done.stdout.rpartition(b"\n")
        return int(code or 0), out

    def keys(self, prefix: str) -> list[tuple[str, int]]:
        return [(k, size) for k, size, _ in self.listing(prefix)]

    def listing(self, prefix: str) -> list[tuple[str, int, str]]:
        """(key, size, LastModified) of every object under `prefix`."""
        status, body = self.s3("GET", BUCKET, query=f"list-type=2&prefix={prefix}")
        assert status == 200, body
        ns = {"s3": "http://s3.amazonaws.com/doc/2006-03-01/"}
        root = ET.fromstring(body)
        return [
            (
                c.findtext("s3:Key", namespaces=ns) or "",
                int(c.findtext("s3:Size", namespaces=ns) or 0),
                c.findtext("s3:LastModified", namespaces=ns) or "",
            )
            for c in root.findall("s3:Contents", ns)
        ]


def missing_reason() -> str | None:
    if os.geteuid() != 0:
        return "object tier tests need root (the Ceph daemons radosgw.sh starts); run them as root"
    absent = [b for b in BINARIES if shutil.which(b) is None]
    if absent:
        return (
            f"object tier tests need {' '.join(absent)}: apt-get install ceph-mon ceph-osd radosgw ceph-common curl "
            "(scripts/setup.sh installs them when run as root)"
        )
    return None


def _down(state: Path) -> None:
    subprocess.run(["bash", str(SCRIPT), "down", str(state)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def rgw() -> Iterator[Rgw]:
    reason = missing_reason()
    if reason:
        _skip_or_fail(reason)
    state = STATE_ROOT / "radosgw"
    atexit.register(_down, state)
    started = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPT), "up", str(state)], capture_output=True, text=True, timeout=300)
    if done.returncode == 3:
        _down(state)
        _skip_or_fail(done.stderr.strip())
    if done.returncode != 0:
        _down(state)
        pytest.fail(f"bringing up radosgw failed (rc {done.returncode}):\n{done.stdout}\n{done.stderr}")
    info = dict(line.split("=", 1) for line in done.stdout.split() if "=" in line)
    server = Rgw(info["ENDPOINT"], info["ACCESS_KEY"], info["SECRET_KEY"], int(info["PID"]), state)
    print(f"\nradosgw: up in {time.monotonic() - started:.1f} s at {server.endpoint}")
    status, body = server.s3("PUT", BUCKET)
    assert status == 200, f"creating bucket {BUCKET}: {status} {body!r}"
    # The gateway creates its data pool at the first object written, which can take seconds: done
    # here, so that no test's first PUT meets it.
    deadline = time.monotonic() + 60
    while server.s3("PUT", f"{BUCKET}/warm-up", b"x")[0] != 200:
        assert time.monotonic() < deadline, "the gateway did not take a first object within 60 s"
        time.sleep(0.5)
    try:
        yield server
    finally:
        _down(state)
        assert not processes_naming(state), "radosgw processes survived teardown"


@pytest.fixture
def bucket(rgw, request, monkeypatch) -> Iterator[dict]:
    """Options of a fresh prefix in the test bucket, with the credentials in the environment."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", rgw.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", rgw.secret_key)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    prefix = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name) + f"-{time.time_ns()}"
    yield {
        "bucket_url": f"s3://{BUCKET}/{prefix}",
        "bucket_endpoint": rgw.endpoint,
        "bucket_segment_bytes": 4096 + 8 * SLOT_BYTES,
        "bucket_refresh_ms": 100,
        "bucket_request_timeout_ms": 5000,
    }


class Nodes:
    """Stores opened by a test (closed by the fixture, also when the test fails)."""

    def __init__(self, local: Path) -> None:
        self.local = local
        self.stores: list[kvtier.Store] = []

    def open(self, name: str, **options) -> kvtier.Store:
        store = kvtier.Store.open(
            str(self.local / name),
            object_bytes=OBJECT_BYTES,
            namespace="object-test",
            dram_bytes=64 * SLOT_BYTES,
            nvme_bytes=0,
            **options,
        )
        self.stores.append(store)
        return store


@pytest.fixture
def nodes(tmp_path) -> Iterator[Nodes]:
    n = Nodes(tmp_path)
    yield n
    for store in n.stores:
        store.close()


def key(i: int, tag: str = "obj") -> bytes:
    return hashlib.sha256(f"{tag}-{i}".encode()).digest()


def value(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, OBJECT_BYTES, dtype=np.uint8)


def wait_visible(store: kvtier.Store, keys: list[bytes], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.lookup_prefix(keys) == len(keys):
            return True
        time.sleep(0.05)
    return False


def load(store: kvtier.Store, ids: list[int], tag: str = "obj") -> list[bool]:
    """Loads the blocks; every block served must hold exactly the value stored."""
    out = [np.zeros(OBJECT_BYTES, np.uint8) for _ in ids]
    got = store.get_many([key(i, tag) for i in ids], out)
    for ok, i, o in zip(got, ids, out, strict=True):
        assert not ok or np.array_equal(o, value(i)), f"block {i} served with wrong bytes"
    return got


def publish(store: kvtier.Store, ids: list[int], tag: str = "obj") -> None:
    store.put_many([key(i, tag) for i in ids], [value(i) for i in ids])
    store.flush()


def test_two_nodes_share_a_bucket_and_it_survives_reopen(nodes, bucket):
    a = nodes.open("a", **bucket)
    b = nodes.open("b", **bucket)
    ids = list(range(20))
    publish(a, ids)
    stats = a.stats()
    assert stats["bucket_segments_published"] == 3  # 8 blocks per segment
    assert stats["bucket_dropped_publishes"] == 0
    assert wait_visible(b, [key(i) for i in ids]), "segments published by A never became visible to B"
    # Named as the tier they come from: the load-or-recompute model keeps a rate per tier.
    assert b.locate_many([key(i) for i in ids]) == ["bucket"] * 20
    before = b.stats()["bucket_get_requests"]
    assert all(load(b, ids))
    stats = b.stats()
    assert stats["bucket_hits"] == 20 and stats["bucket_misses"] == 0
    # One ranged GET per segment (8, 8 and 4 adjacent blocks, under 8 MiB), no listing on the path.
    assert stats["bucket_get_requests"] - before == 3
    # Staged through the DRAM pool: the next load is a DRAM hit.
    assert all(load(b, ids))
    assert b.stats()["bucket_hits"] == 20
    a.close()
    b.close()
    # A fresh node with an empty local store: the index comes from the bucket at open.
    c = nodes.open("c", **bucket)
    assert c.lookup_prefix([key(i) for i in ids]) == 20
    assert all(load(c, ids))
    assert c.stats()["bucket_hits"] == 20


def test_the_bucket_by_reuse_takes_the_blocks_a_caller_says_come_back_and_nothing_else(nodes, bucket):
    """Issue 39: under ``write_admission: "reuse"`` the bucket is offered a block once there is
    evidence it is read again; a retention hint (``note_retained``, what a hinted request's scheduler
    sends) is that evidence before the first store. Of 16 stored blocks, the 8 hinted ones make one
    segment (one PUT of data) that another node reads; the 8 others stay in DRAM, unpublished."""
    a = nodes.open("a", write_admission="reuse", **bucket)
    hinted, plain = list(range(8)), list(range(8, 16))
    a.note_retained([key(i) for i in hinted])
    publish(a, hinted + plain)
    stats = a.stats()
    assert stats["retained_by_hint"] == 8
    assert stats["bucket_segments_published"] == 1, "the hinted eight, one segment"
    assert stats["bucket_bytes_written"] < 9 * SLOT_BYTES + 8192, "and nothing of the unhinted eight"
    assert stats["writes_awaiting_reuse"] == 8, "the unhinted blocks wait in DRAM for evidence"
    b = nodes.open("b", **bucket)
    assert wait_visible(b, [key(i) for i in hinted]), "the hinted blocks never became visible to B"
    assert all(load(b, hinted))
    assert b.lookup_prefix([key(plain[0])]) == 0, "an unhinted block was published"


def _tamper(rgw: Rgw, name: str, offset: int) -> None:
    status, body = rgw.s3("GET", f"{BUCKET}/{name}")
    assert status == 200
    data = bytearray(body)
    data[offset] ^= 0xFF
    status, _ = rgw.s3("PUT", f"{BUCKET}/{name}", bytes(data))
    assert status == 200


def test_corrupt_truncated_and_foreign_objects_are_counted_misses(rgw, nodes, bucket):
    a = nodes.open("a", **bucket)
    publish(a, list(range(16)))  # two segments of 8
    prefix = bucket["bucket_url"].removeprefix(f"s3://{BUCKET}/")
    segments = sorted(k for k, _ in rgw.keys(prefix) if k.endswith(".kvo"))
    assert len(segments) == 2
    # A flipped value byte in the first segment's first block; the second segment truncated.
    _tamper(rgw, segments[0], 4096 + 4096 + 100)
    status, body = rgw.s3("GET", f"{BUCKET}/{segments[1]}")
    assert status == 200
    assert rgw.s3("PUT", f"{BUCKET}/{segments[1]}", body[: len(body) // 2])[0] == 200
    # Garbage and a foreign-looking index object beside them: ignored, counted.
    idx_dir = segments[0].rsplit("/seg/", 1)[0] + "/idx/"
    assert rgw.s3("PUT", f"{BUCKET}/{idx_dir}{'f' * 16}-{'0' * 16}.kvi", b"not an index")[0] == 200
    b = nodes.open("b", **bucket)
    got = load(b, list(range(16)))
    stats = b.stats()
    assert not got[0], "a block whose value was flipped in the bucket was served"
    # Halved, the second segment still holds its first 3 slots whole (served, bytes checked by load).
    assert all(got[8:11]) and not any(got[11:]), f"truncated segment: {got[8:]}"
    assert stats["bucket_verify_failures"] >= 2  # the flipped block, the garbage index
    assert stats["bucket_misses"] >= 6
    assert stats["bucket_request_errors"] >= 1  # a range past the end of the truncated object


def test_adjacent_blocks_make_one_get_and_are_verified_alone(rgw, nodes, bucket):
    """A load's adjacent blocks of one segment are read with one ranged GET (bounded by
    bucket_get_max_bytes) into their DRAM slots, identical to what was stored; a block flipped in
    the bucket in the middle of a run is a miss alone, the rest of its run is served."""
    a = nodes.open("a", **bucket)
    ids = list(range(16))
    publish(a, ids)  # two segments of 8
    b = nodes.open("b", **bucket, bucket_get_max_bytes=3 * SLOT_BYTES)
    assert wait_visible(b, [key(i) for i in ids])
    before = b.stats()["bucket_get_requests"]
    assert all(load(b, ids))  # load() compares every block with the value stored
    assert b.stats()["bucket_get_requests"] - before == 6  # per segment: runs of 3, 3 and 2
    prefix = bucket["bucket_url"].removeprefix(f"s3://{BUCKET}/")
    segments = sorted(k for k, _ in rgw.keys(prefix) if k.endswith(".kvo"))
    # A value byte of the fifth block of the first segment (blocks 0-7, in the order put).
    _tamper(rgw, segments[0], 4096 + 4 * SLOT_BYTES + 4096 + 100)
    c = nodes.open("c", **bucket)  # the automatic bound: 8 MiB, the whole segment
    assert wait_visible(c, [key(i) for i in ids])
    before = c.stats()
    got = load(c, list(range(8)))
    after = c.stats()
    assert got == [True] * 4 + [False] + [True] * 3, got
    assert after["bucket_get_requests"] - before["bucket_get_requests"] == 1
    assert after["bucket_hits"] - before["bucket_hits"] == 7
    assert after["bucket_misses"] - before["bucket_misses"] == 1
    assert after["bucket_verify_failures"] - before["bucket_verify_failures"] == 1
    # The flipped block takes only itself out: on a fresh node, after its miss and several
    # refreshes, the segment's other blocks are still indexed and load from the bucket.
    d = nodes.open("d", **bucket)
    assert wait_visible(d, [key(i) for i in ids])
    assert load(d, [4]) == [False]
    time.sleep(0.5)  # five listings at bucket_refresh_ms = 100: none may index the block again
    assert d.contains_many([key(i) for i in range(8)]) == [True] * 4 + [False] + [True] * 3
    before = d.stats()
    assert all(load(d, [0, 1, 2, 3, 5, 6, 7]))
    after = d.stats()
    assert after["bucket_hits"] - before["bucket_hits"] == 7
    assert after["bucket_get_requests"] - before["bucket_get_requests"] == 2  # runs 0-3 and 5-7
    assert load(d, [4]) == [False] and d.stats()["bucket_get_requests"] == after["bucket_get_requests"]
    # A corrupt segment is copied into quarantine/ for the operator (and stays in service).
    quarantined = segments[0].replace("/seg/", "/quarantine/")
    assert _wait_for(lambda: quarantined in dict(rgw.keys(prefix))), rgw.keys(prefix)
    assert c.stats()["bucket_quarantined_objects"] == 1 and d.stats()["bucket_quarantined_objects"] == 1
    assert segments[0] in dict(rgw.keys(prefix))


def _wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_forged_blocks_are_refused_with_a_deployment_key(rgw, nodes, bucket, tmp_path):
    good, other = tmp_path / "good.key", tmp_path / "other.key"
    for path in (good, other):
        path.write_bytes(os.urandom(32))
        path.chmod(0o600)
    forger = nodes.open("forger", bucket_key_file=str(other), **bucket)
    publish(forger, list(range(8)), tag="forged")
    unkeyed = nodes.open("unkeyed", **bucket)
    publish(unkeyed, list(range(8)), tag="unkeyed")
    honest = nodes.open("honest", bucket_key_file=str(good), **bucket)
    publish(honest, list(range(8)), tag="honest")
    reader = nodes.open("reader", bucket_key_file=str(good), **bucket)
    assert wait_visible(reader, [key(i, "honest") for i in range(8)])
    assert all(load(reader, list(range(8)), tag="honest"))
    assert not any(load(reader, list(range(8)), tag="forged"))
    assert not any(load(reader, list(range(8)), tag="unkeyed"))
    assert reader.stats()["bucket_auth_failures"] >= 2  # the two index objects without our tag
    # Without our tag is not damage (another key, or none): nothing is moved or deleted.
    time.sleep(0.5)
    prefix = bucket["bucket_url"].removeprefix(f"s3://{BUCKET}/")
    names = [k for k, _ in rgw.keys(prefix)]
    assert sum(k.endswith(".kvi") for k in names) == 3 and not any("/quarantine/" in k for k in names), names
    assert reader.stats()["bucket_quarantined_objects"] == 0


def _wait_under_budget(rgw: Rgw, prefix: str, budget: int) -> int:
    deadline = time.monotonic() + 10
    while True:
        total = sum(size for k, size in rgw.keys(prefix) if k.endswith(".kvo"))
        if total <= budget or time.monotonic() > deadline:
            return total
        time.sleep(0.1)


def test_values_in_the_bucket_are_encrypted_under_the_encryption_key(rgw, nodes, bucket, tmp_path):
    """Issue 40, item 3: with `encryption_key_file`, the values a store publishes to the bucket are
    AES-256-GCM encrypted (docs/format.md, "Encrypted values"): no stored value can be read from the
    objects, a store with the key is served every block (through the deployment key's tag too), and a
    store without it, or with another key, gets counted misses, never wrong bytes."""
    keys = {}
    for name in ("good", "other", "auth"):
        keys[name] = tmp_path / f"{name}.key"
        keys[name].write_bytes(os.urandom(32))
        keys[name].chmod(0o600)
    auth = {"bucket_key_file": str(keys["auth"])}
    writer = nodes.open("writer", encryption_key_file=str(keys["good"]), **auth, **bucket)
    ids = list(range(8))
    publish(writer, ids)
    prefix = bucket["bucket_url"].removeprefix(f"s3://{BUCKET}/")
    stored = b"".join(rgw.s3("GET", f"{BUCKET}/{name}")[1] for name, _ in rgw.keys(prefix))
    assert len(stored) > len(ids) * OBJECT_BYTES, "the segments were read back"
    for i in ids:
        plain = value(i).tobytes()
        assert not any(plain[at : at + 64] in stored for at in range(0, OBJECT_BYTES, 4096)), f"block {i} in clear"
    reader = nodes.open("reader", encryption_key_file=str(keys["good"]), **auth, **bucket)
    assert wait_visible(reader, [key(i) for i in ids]) and all(load(reader, ids))
    assert reader.stats()["remote_decrypt_failures"] == 0
    for name, extra in (("keyless", {}), ("stranger", {"encryption_key_file": str(keys["other"])})):
        other = nodes.open(name, **extra, **auth, **bucket)
        assert wait_visible(other, [key(i) for i in ids])
        assert not any(load(other, ids)), f"{name} was served encrypted blocks"
        assert other.stats()["remote_decrypt_failures"] == len(ids), name


def test_budget_evicts_the_oldest_segments_by_the_lease_holder_only(rgw, nodes, bucket):
    segment = bucket["bucket_segment_bytes"]
    budget = 3 * segment
    # A 1 s request timeout: evicted segments are deleted after 2 x 100 ms + 1 s of grace.
    options = {**bucket, "bucket_budget_bytes": budget, "bucket_lease_ms": 1000, "bucket_request_timeout_ms": 1000}
    a, b = nodes.open("a", **options), nodes.open("b", **options)
    for first in range(0, 48, 8):  # six segments, oldest first
        publish(a, list(range(first, first + 8)))
        time.sleep(1.1)  # S3 modification times have a resolution of one second
    prefix = bucket["bucket_url"].removeprefix(f"s3://{BUCKET}/")
    total = _wait_under_budget(rgw, prefix, budget)
    assert total <= budget, f"{total} bytes of segments stayed over the {budget}-byte budget"
    evicted = {"a": a.stats()["bucket_evicted_segments"], "b": b.stats()["bucket_evicted_segments"]}
    assert sorted(evicted.values())[0] == 0 and sum(evicted.values()) >= 3, f"one evictor expected: {evicted}"
    reader = nodes.open("reader", **bucket)
    assert not any(load(reader, list(range(8)))), "the oldest segment survived eviction"
    assert all(load(reader, list(range(40, 48)))), "the newest segment was evicted"
    # The holder closes (releasing the lease): the other store takes over the budget.
    holder, other = (a, b) if evicted["a"] else (b, a)
    holder.close()
    for first in range(100, 124, 8):
        publish(other, list(range(first, first + 8)))
        time.sleep(1.1)
    total = _wait_under_budget(rgw, prefix, budget)
    assert total <= budget and other.stats()["bucket_evicted_segments"] >= 2, total
    leases = [k for k, _ in rgw.keys(prefix) if "/lease/" in k]
    assert 1 <= len(leases) <= 2, leases


def test_budget_evicts_the_least_recently_read_segments_first(rgw, nodes, bucket):
    """S1 is the oldest segment but was read after S2 and S3 were written: over budget, the evictor
    (whichever store holds the lease) deletes S2 and S3, never read, and keeps S1."""
    segment = bucket["bucket_segment_bytes"]
    budget = 3 * segment
    options = {**bucket, "bucket_budget_bytes": budget, "bucket_lease_ms": 1000, "bucket_request_timeout_ms": 1000}
    writer, reader = nodes.open("writer", **options), nodes.open("reader", **options)
    for first in range(0, 24, 8):  # S1, S2, S3: exactly the budget, nothing evicted
        publish(writer, list(range(first, first + 8)))
    assert wait_visible(reader, [key(i) for i in range(24)])
    assert all(load(reader, list(range(8)))), "S1's blocks"
    deadline = time.monotonic() + 5
    while reader.stats()["bucket_access_objects_put"] == 0:
        assert time.monotonic() < deadline, "the reader never wrote its access object"
        time.sleep(0.05)
    prefix = bucket["bucket_url"].removeprefix(f"s3://{BUCKET}/")
    names = [k for k, _ in rgw.keys(prefix)]
    accessed = [k for k in names if "/acc/" in k]
    assert len(accessed) == 1 and accessed[0].endswith(".kva"), names
    garbage = accessed[0].rsplit("/", 1)[0] + "/00000000000000ff.kva"
    assert rgw.s3("PUT", f"{BUCKET}/{garbage}", b"not an access object")[0] == 200
    time.sleep(1.1)  # S3 modification times have a resolution of one second: S4 is newer than the read
    publish(writer, list(range(24, 32)))  # S4: over budget, evicted down to 90% of it: two segments go
    total = _wait_under_budget(rgw, prefix, int(0.9 * budget))
    assert total <= 0.9 * budget, f"{total} bytes of segments stayed over 90% of the {budget}-byte budget"
    stats = {"writer": writer.stats(), "reader": reader.stats()}
    assert sum(s["bucket_evicted_segments"] for s in stats.values()) == 2, stats
    assert sum(s["bucket_access_objects_ignored"] for s in stats.values()) == 1, "the garbage access object"
    assert garbage not in [k for k, _ in rgw.keys(prefix)], "garbage is deleted once counted"
    fresh = nodes.open("fresh", **bucket)  # its DRAM holds nothing: every hit comes from the bucket
    assert all(load(fresh, list(range(8)))), "S1, read after S2 and S3 were written, was evicted"
    assert not any(load(fresh, list(range(8, 24)))), "S2 and S3, never read, survived"
    assert all(load(fresh, list(range(24, 32)))), "S4, the newest, was evicted"
    # The reader goes; once every segment it read is evicted, its access object is garbage: the next
    # eviction finds it older than every segment left, and deletes it.
    reader.close()
    publish(writer, list(range(32, 48)))  # S5, S6: S1 and S4 go
    assert _wait_under_budget(rgw, prefix, int(0.9 * budget)) <= 0.9 * budget
    assert [k for k, _ in rgw.keys(prefix) if "/acc/" in k] == accessed, "S1 was still listed: kept"
    publish(writer, list(range(48, 64)))  # S7, S8: over budget again, every segment newer than it
    deadline = time.monotonic() + 5
    while [k for k, _ in rgw.keys(prefix) if "/acc/" in k]:
        assert time.monotonic() < deadline, "an access object naming only deleted segments was kept"
        time.sleep(0.1)


@pytest.mark.parametrize("split", [True, False])
def test_split_by_tenant_a_flood_loses_its_own_segments_and_the_quiet_tenant_keeps_its(rgw, nodes, bucket, split):
    """Two segments of a quiet tenant, then eight of a flood, over a budget of six: the evictor keeps the
    bucket under the budget (each time it is passed, down to 90% of it; how the publishes and the
    evictor's ticks interleave decides how many passes there are, so five or six segments are left).
    Split by tenant (``tenant_shares_bucket``, shares 0.4 each), the flood, past its share, gives up its
    own segments, and the quiet tenant's, the oldest, stay for another node to read; in one order for
    everyone (the control) they go first."""
    budget = 6 * bucket["bucket_segment_bytes"]
    options = {
        **bucket,
        "bucket_budget_bytes": budget,
        "bucket_lease_ms": 1000,
        "bucket_request_timeout_ms": 1000,
        "tenant_dram_share": 0.4,
        "tenant_shares_bucket": split,
    }
    writer = nodes.open("writer", **options)
    quiet, flood = list(range(16)), list(range(100, 164))
    writer.assign_tenant([key(i) for i in quiet], kvtier.tenant_id("quiet"))
    publish(writer, quiet)
    time.sleep(1.1)  # S3 modification times have a resolution of one second: the quiet segments are older
    for first in range(0, 64, 8):
        chunk = flood[first : first + 8]
        writer.assign_tenant([key(i) for i in chunk], kvtier.tenant_id("flood"))
        publish(writer, chunk)
    prefix = bucket["bucket_url"].removeprefix(f"s3://{BUCKET}/")
    total = _wait_under_budget(rgw, prefix, budget)
    assert total <= budget, f"{total} bytes of segments stayed over the {budget}-byte budget"
    fresh = nodes.open("fresh", **bucket)  # its DRAM holds nothing: every hit comes from the bucket
    assert wait_visible(fresh, [key(flood[-1])])
    served = load(fresh, quiet)
    stats = writer.stats()
    quiet_label, flood_label = kvtier.tenant_id("quiet")[:8].hex(), kvtier.tenant_id("flood")[:8].hex()
    if split:
        assert all(served), f"the flood took {served.count(False)} of the quiet tenant's blocks"
        assert stats[f"tenant_bucket_bytes:{quiet_label}"] == 2 * bucket["bucket_segment_bytes"]
        assert stats[f"tenant_bucket_evicted_segments:{quiet_label}"] == 0
        # At most six segments stay and the quiet tenant's two are among them: the flood lost four at least.
        assert stats[f"tenant_bucket_evicted_segments:{flood_label}"] >= 4, stats
    else:
        assert not any(served), "the oldest segments, the quiet tenant's, went first"
        assert not any(name.startswith("tenant_bucket") for name in stats)


def _lease_objects(rgw: Rgw, prefix: str) -> list[str]:
    return sorted(k for k, _ in rgw.keys(prefix) if "/lease/" in k)


def _genuine_lease_record(rgw: Rgw, nodes, bucket, lease_ms: int) -> tuple[bytes, str]:
    """A lease record as a store with a budget and this lease term writes it (its expiry: its clock
    plus the term), and the namespace's lease directory. The store then closes, giving the lease up
    (a newer generation, already expired): what is left is a record nobody holds any more."""
    prefix = bucket["bucket_url"].removeprefix(f"s3://{BUCKET}/")
    store = nodes.open("taker", **{**bucket, "bucket_budget_bytes": 64 << 20, "bucket_lease_ms": lease_ms})
    assert _wait_for(lambda: _lease_objects(rgw, prefix) != []), "the store never took the lease"
    taken = _lease_objects(rgw, prefix)[0]
    status, record = rgw.s3("GET", f"{BUCKET}/{taken}")
    assert status == 200 and len(record) == 64, (status, record)
    store.close()
    return record, taken.rsplit("/", 1)[0]


def _keeps_the_budget(rgw: Rgw, nodes, bucket) -> kvtier.Store:
    """A store with a budget of three segments publishes six; returns it once the bucket is back
    under the budget (fails if it stays over)."""
    budget = 3 * bucket["bucket_segment_bytes"]
    options = {**bucket, "bucket_budget_bytes": budget, "bucket_lease_ms": 1000, "bucket_request_timeout_ms": 1000}
    keeper = nodes.open("keeper", **options)
    publish(keeper, list(range(48)))  # six segments
    prefix = bucket["bucket_url"].removeprefix(f"s3://{BUCKET}/")
    total = _wait_under_budget(rgw, prefix, budget)
    assert total <= budget, f"{total} bytes of segments stayed over the {budget}-byte budget: nobody evicts"
    assert keeper.stats()["bucket_evicted_segments"] >= 3
    return keeper


def test_a_lease_expiring_far_in_the_future_does_not_stop_eviction(rgw, nodes, bucket):
    """A store whose clock ran a year ahead (here: one with a year-long lease term, which writes the
    same record) took the evictor lease and died without giving it up. Its expiry is further out than
    any holder's clock plus the term and the skew between nodes allow: forged, it holds nobody off,
    and the next store with a budget takes the lease over and keeps the budget (as the shared tier
    does)."""
    year_ms = 365 * 24 * 3600 * 1000
    record, lease_dir = _genuine_lease_record(rgw, nodes, bucket, year_ms)
    # Above the released generation, so that it is the lease in force.
    assert rgw.s3("PUT", f"{BUCKET}/{lease_dir}/0000000000000010.lease", record)[0] == 200
    _keeps_the_budget(rgw, nodes, bucket)
    prefix = bucket["bucket_url"].removeprefix(f"s3://{BUCKET}/")
    generations = [int(k.rsplit("/", 1)[1].removesuffix(".lease"), 16) for k in _lease_objects(rgw, prefix)]
    assert max(generations) > 0x10, f"not taken over above the forged one: {[hex(g) for g in generations]}"


def test_a_lease_object_of_the_last_generation_is_ignored_not_wrapped(rgw, nodes, bucket):
    """`lease/ffffffffffffffff.lease`, planted: no generation follows it (the increment would wrap to
    0, or panic in a debug build). It is never the lease in force: the store takes generation 1 under
    it and keeps the budget, and no lease object of generation 0 ever appears."""
    record, lease_dir = _genuine_lease_record(rgw, nodes, bucket, 1000)
    prefix = bucket["bucket_url"].removeprefix(f"s3://{BUCKET}/")
    for name in _lease_objects(rgw, prefix):
        assert rgw.s3("DELETE", f"{BUCKET}/{name}")[0] == 204
    last = f"{lease_dir}/ffffffffffffffff.lease"
    assert rgw.s3("PUT", f"{BUCKET}/{last}", record)[0] == 200
    _keeps_the_budget(rgw, nodes, bucket)
    leases = _lease_objects(rgw, prefix)
    assert f"{lease_dir}/0000000000000000.lease" not in leases, f"the generation wrapped: {leases}"
    assert last in leases and len(leases) >= 2, f"the store holds a generation under it: {leases}"


def test_listed_objects_longer_than_their_format_allows_are_never_fetched(rgw, nodes, bucket):
    """An index, an access and a lease object planted longer than their formats allow (each begins
    like its format, so that fetched it would be judged corrupt and acted on): a store leaves each out
    of its listing, counts it once in bucket_oversized_objects, never fetches it and never acts on it
    (no quarantine, no delete), and keeps serving and keeping its budget beside them."""
    writer = nodes.open("writer", **bucket)
    publish(writer, list(range(48)))  # six segments
    prefix = bucket["bucket_url"].removeprefix(f"s3://{BUCKET}/")
    ns_dir = next(k for k, _ in rgw.keys(prefix) if k.endswith(".kvi")).rsplit("/idx/", 1)[0]
    # The formats' longest: an index object of the largest segment (5 GiB) of these slots; an
    # access object of 65,536 entries; a 64-byte lease record.
    max_index = 96 + min(((5 << 30) - 4096) // SLOT_BYTES, 1 << 20) * 48 + 40
    max_access = 64 + (1 << 16) * 24 + 40
    version = (1).to_bytes(4, "little")
    planted = {
        f"{ns_dir}/idx/00000000000000ab-0000000000000001.kvi": b"KVTOIDX\0" + version + bytes(max_index),
        f"{ns_dir}/acc/00000000000000ab.kva": b"KVTOACC\0" + version + bytes(max_access),
        f"{ns_dir}/lease/0000000000000100.lease": b"KVTSLSE\0" + version + bytes(64),
    }
    for name, body in planted.items():
        assert rgw.s3("PUT", f"{BUCKET}/{name}", body)[0] == 200
    reader = nodes.open("reader", **bucket)  # no budget: it only lists and fetches index objects
    assert wait_visible(reader, [key(i) for i in range(48)])
    time.sleep(0.5)  # five more listings
    assert reader.stats()["bucket_get_requests"] == 6, "only the six real index objects are fetched"
    keeper = _keeps_the_budget(rgw, nodes, bucket)  # lists lease/ and, over the budget, acc/
    time.sleep(0.5)
    for store in (reader, keeper):
        stats = store.stats()
        assert stats["bucket_verify_failures"] == 0 and stats["bucket_quarantined_objects"] == 0, stats
        assert stats["bucket_access_objects_ignored"] == 0, "the access object was fetched and judged"
    assert reader.stats()["bucket_oversized_objects"] == 1, "the index object, once across many listings"
    assert keeper.stats()["bucket_oversized_objects"] == 3, "each planted object, once"
    listed = dict(rgw.keys(prefix))
    assert all(listed.get(name) == len(body) for name, body in planted.items()), "left alone, not acted on"
    assert load(reader, list(range(48))).count(True) >= 16, "the two segments the budget keeps are served"


def test_a_block_two_writers_published_is_read_from_the_other_segment_once_the_first_goes(rgw, nodes, bucket):
    """Two stores publish the same blocks before either listed the other's segment (two nodes
    racing; here the second lists the bucket only at open). A reader indexes the first segment; when
    that one goes (its index object, then the segment, deleted as the evictor does), the reader
    serves the blocks from the other store's segment instead of missing them."""
    a = nodes.open("a", **bucket)
    b = nodes.open("b", **{**bucket, "bucket_refresh_ms": 600_000, "bucket_lease_ms": 1_200_000})
    publish(a, list(range(8)))
    prefix = bucket["bucket_url"].removeprefix(f"s3://{BUCKET}/")
    first = sorted(k for k, _ in rgw.keys(prefix))
    reader = nodes.open("reader", **bucket)  # indexes a's segment at open
    publish(b, list(range(8)))  # b never listed a's segment: the same blocks again, in b's segment
    second = [k for k, _ in rgw.keys(prefix) if k not in first]
    assert len(first) == 2 and len(second) == 2, (first, second)
    assert _wait_for(lambda: reader.stats()["bucket_get_requests"] >= 2), "the reader never fetched b's index"
    index, segment = (next(k for k in first if k.endswith(ext)) for ext in (".kvi", ".kvo"))
    assert rgw.s3("DELETE", f"{BUCKET}/{index}")[0] == 204
    assert rgw.s3("DELETE", f"{BUCKET}/{segment}")[0] == 204
    time.sleep(0.5)  # five listings: a's segment left the reader's index
    assert reader.contains_many([key(i) for i in range(8)]) == [True] * 8, "b's copies were forgotten"
    assert all(load(reader, list(range(8)))), "not served from b's segment"
    assert reader.stats()["bucket_hits"] == 8


def _two_segments_seen_by_b(rgw: Rgw, nodes, bucket) -> tuple[kvtier.Store, list[str]]:
    """Node A publishes blocks 0-15 (two segments); node B indexes them all. Returns B and the
    prefix's object names, sorted (by sequence: the segment of blocks 0-7 first)."""
    a = nodes.open("a", **bucket)
    publish(a, list(range(16)))
    b = nodes.open("b", **bucket)
    assert wait_visible(b, [key(i) for i in range(16)])
    prefix = bucket["bucket_url"].removeprefix(f"s3://{BUCKET}/")
    return b, sorted(k for k, _ in rgw.keys(prefix))


def test_objects_deleted_behind_its_back_are_misses_then_forgotten(rgw, nodes, bucket):
    """Deletions by anyone else (an operator, another tool): a segment deleted while indexed is a miss
    at once; a deleted index object leaves the index at the next listing."""
    b, names = _two_segments_seen_by_b(rgw, nodes, bucket)
    segments = [k for k in names if k.endswith(".kvo")]
    indexes = [k for k in names if k.endswith(".kvi")]
    assert rgw.s3("DELETE", f"{BUCKET}/{segments[0]}")[0] == 204
    assert not any(load(b, list(range(8))))
    assert b.stats()["bucket_request_errors"] == 0  # a 404 is a clean miss
    assert rgw.s3("DELETE", f"{BUCKET}/{indexes[1]}")[0] == 204
    deadline = time.monotonic() + 5
    while b.contains_many([key(i) for i in range(8, 16)]) != [False] * 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b.contains_many([key(i) for i in range(8, 16)]) == [False] * 8


def test_a_segment_gone_before_its_index_object_is_forgotten_and_its_index_object_deleted(rgw, nodes, bucket):
    """An expiry rule deletes by age: a segment (written first) goes before its index object. The
    first load of its blocks is a 404; then the segment stays out of the index across listings, its
    index object is deleted (dead for every store), and no request is made for it again."""
    b, names = _two_segments_seen_by_b(rgw, nodes, bucket)
    segment = next(k for k in names if k.endswith(".kvo"))
    index = segment.replace("/seg/", "/idx/").removesuffix(".kvo") + ".kvi"
    assert index in names
    assert rgw.s3("DELETE", f"{BUCKET}/{segment}")[0] == 204
    first, rest = list(range(8)), list(range(8, 16))  # names sort by sequence: blocks 0-7 first
    assert not any(load(b, first))
    assert b.stats()["bucket_request_errors"] == 0  # a 404 is a clean miss
    prefix = bucket["bucket_url"].removeprefix(f"s3://{BUCKET}/")
    assert _wait_for(lambda: index not in dict(rgw.keys(prefix))), "the orphan index object was not deleted"
    time.sleep(0.5)  # five listings at bucket_refresh_ms = 100
    assert b.contains_many([key(i) for i in first]) == [False] * 8
    before = b.stats()["bucket_get_requests"]
    assert not any(load(b, first))
    time.sleep(0.3)
    assert b.stats()["bucket_get_requests"] == before, "requests for a segment known to be gone"
    assert all(load(b, rest))
    c = nodes.open("c", **bucket)  # a fresh node never sees the orphan
    assert c.contains_many([key(i) for i in first]) == [False] * 8


def test_corrupt_index_objects_are_moved_into_quarantine_which_a_budget_bounds(rgw, nodes, bucket):
    """An index object whose checksum fails is moved into quarantine/ (copied, then deleted from
    idx/), so that no store fetches it again; the evictor lease's holder keeps quarantine/ within a
    tenth of its budget."""
    a = nodes.open("a", **bucket)
    publish(a, list(range(16)))  # two segments
    prefix = bucket["bucket_url"].removeprefix(f"s3://{BUCKET}/")
    indexes = sorted(k for k, _ in rgw.keys(prefix) if k.endswith(".kvi"))
    _tamper(rgw, indexes[0], 96 + 40)  # a byte of the first entry's value checksum
    b = nodes.open("b", **bucket)
    moved = indexes[0].replace("/idx/", "/quarantine/")
    assert _wait_for(lambda: moved in dict(rgw.keys(prefix)) and indexes[0] not in dict(rgw.keys(prefix)))
    stats = b.stats()
    assert stats["bucket_quarantined_objects"] == 1 and stats["bucket_verify_failures"] >= 1, stats
    got = load(b, list(range(16)))
    assert got.count(True) == 8, got  # the other segment's blocks
    # A copy of a segment (as a corrupt block makes), then a store with a budget of three segments:
    # its quarantine share (0.3 segments) holds the small index object, not the segment.
    segment = next(k for k, _ in rgw.keys(prefix) if k.endswith(".kvo"))
    status, body = rgw.s3("GET", f"{BUCKET}/{segment}")
    assert status == 200
    big = segment.replace("/seg/", "/quarantine/")
    assert rgw.s3("PUT", f"{BUCKET}/{big}", body)[0] == 200
    budget = 3 * bucket["bucket_segment_bytes"]
    nodes.open("keeper", **{**bucket, "bucket_budget_bytes": budget, "bucket_lease_ms": 1000})
    assert _wait_for(lambda: big not in dict(rgw.keys(prefix))), "the quarantine outgrew its share of the budget"
    assert moved in dict(rgw.keys(prefix))


def test_a_stopped_server_costs_misses_not_a_hang(rgw, nodes, bucket):
    a = nodes.open("a", **bucket)
    publish(a, list(range(16)))
    bucket = {**bucket, "bucket_request_timeout_ms": 1000}
    # The tier's own request deadline, not the load's stall limit (the next test).
    b = nodes.open("b", **bucket, remote_read_stall_ms=0)
    assert wait_visible(b, [key(i) for i in range(16)])
    os.kill(rgw.pid, signal.SIGSTOP)  # connections hang: harder than a refused connection
    try:
        started = time.monotonic()
        got = load(b, list(range(16)))
        elapsed = time.monotonic() - started
    finally:
        os.kill(rgw.pid, signal.SIGCONT)
    assert not any(got)
    assert elapsed < 3 * bucket["bucket_request_timeout_ms"] / 1000, f"the load took {elapsed:.1f} s"
    stats = b.stats()
    assert stats["bucket_request_errors"] >= 1
    # Its reads timed out: the bucket turned sick and steps aside for its back-off (1 s), then one
    # probe read brings it back (docs/reliability.md, "Sick tiers").
    assert (stats["remote_tier_outages"], stats["remote_tiers_sick"]) == (1, 1), stats
    # The server is back: after the back-off, a probe, and the same blocks load again.
    assert _wait_for(lambda: all(load(b, list(range(16)))), timeout_s=10.0)
    assert b.stats()["remote_tiers_sick"] == 0


def test_a_frozen_bucket_turns_sick_before_any_load_meets_it(rgw, nodes, bucket):
    """Issue 36: only a load's read could tell that the gateway froze, so the first request after it
    waited the whole stall limit. Now the tier's LIST every `bucket_refresh_ms` is its heartbeat:
    unanswered for the stall limit, the store's prober makes the tier sick, and no load waits."""
    a = nodes.open("a", **bucket)
    publish(a, list(range(16)))
    b = nodes.open("b", **{**bucket, "bucket_request_timeout_ms": 30_000}, remote_read_stall_ms=500)
    keys = [key(i) for i in range(16)]
    assert wait_visible(b, keys)
    os.kill(rgw.pid, signal.SIGSTOP)
    try:
        offered_again = _wait_for(lambda: b.lookup_prefix(keys) == 0, timeout_s=3.0)
        started = time.monotonic()
        got = load(b, list(range(16)))
        load_s = time.monotonic() - started
        stats = b.stats()
    finally:
        os.kill(rgw.pid, signal.SIGCONT)
    assert offered_again, f"the frozen bucket was still offered after 3 s: {b.stats()}"
    assert not any(got)
    assert load_s < 0.2, f"a load waited {load_s:.2f} s for a bucket already known frozen"
    assert (stats["remote_refreshes_stalled"], stats["remote_tier_outages"]) == (1, 1), stats
    assert stats["remote_reads_given_up"] == 0, f"a load met the frozen gateway: {stats}"
    assert _wait_for(lambda: b.lookup_prefix(keys) == 16, timeout_s=10.0), b.stats()
    assert all(load(b, list(range(16))))


def test_a_load_gives_up_reads_from_a_frozen_bucket_long_before_their_requests_time_out(rgw, nodes, bucket):
    """Issue 36, item 1: a frozen gateway held a load until its GETs timed out (10 s by default),
    so a request waited the whole freeze or the timeout. Now a load whose remote reads all stall for
    `remote_read_stall_ms` gives them up: counted misses the engine recomputes, failures of the tier
    (which turns sick, so the next load does not wait at all). The slots the held GETs still write
    into stay out of use until they finish, then are free again, and nothing wrong is ever served.
    Once its back-off passed, the store probes the sick tier itself: a request's load never is the
    probe (with the tier still frozen it cost the request that met it a second stall limit)."""
    a = nodes.open("a", **bucket)
    publish(a, list(range(16)))
    b = nodes.open("b", **{**bucket, "bucket_request_timeout_ms": 30_000}, remote_read_stall_ms=300)
    assert wait_visible(b, [key(i) for i in range(16)])
    os.kill(rgw.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        got = load(b, list(range(16)))
        stalled_s = time.monotonic() - started
        started = time.monotonic()
        again = load(b, list(range(16)))
        sick_s = time.monotonic() - started
        stats = b.stats()
        # Past the back-off (1 s) the store probes the tier itself, in the background: still frozen,
        # it stays out of lookups, and no request's load is the probe that waits on it.
        time.sleep(1.5)
        offered_after_backoff = b.lookup_prefix([key(i) for i in range(16)])
        started = time.monotonic()
        after_backoff = load(b, list(range(16)))
        after_backoff_s = time.monotonic() - started
    finally:
        os.kill(rgw.pid, signal.SIGCONT)
    assert not any(got) and not any(again) and not any(after_backoff)
    assert stalled_s < 3.0, f"the load waited {stalled_s:.1f} s for a frozen bucket (its GETs time out in 30 s)"
    assert sick_s < 0.5, f"the second load waited {sick_s:.2f} s for a sick tier"
    assert offered_after_backoff == 0, "a sick tier was offered to a request after its back-off"
    assert after_backoff_s < 0.2, f"a load after the back-off waited {after_backoff_s:.2f} s (it was the probe)"
    assert stats["remote_reads_given_up"] == 16, stats
    assert (stats["remote_tier_outages"], stats["remote_tiers_sick"]) == (1, 1), stats
    assert stats["bucket_request_errors"] == 0, "the GETs are still held, not timed out"
    # The gateway answers again: the store's probe, held with the other GETs, finishes and brings
    # the tier back by itself (no load comes to settle it while the tier is out of lookups); the held
    # GETs' slots come back too.
    keys = [key(i) for i in range(16)]
    assert _wait_for(lambda: b.lookup_prefix(keys) == 16, timeout_s=10.0), b.stats()
    assert _wait_for(lambda: all(load(b, list(range(16)))), timeout_s=10.0)
    stats = b.stats()
    assert (stats["remote_tiers_sick"], stats["retired_slots"]) == (0, 0), stats
    assert stats["dram_used_bytes"] == 16 * SLOT_BYTES, stats


def test_a_close_against_a_frozen_bucket_ends_within_its_deadline(rgw, nodes, bucket):
    """Issue 37, item 12 (confirmed): closing a store sends its last segment, its access object and
    its lease release, and waits for its maintenance thread's listing, each request with its own
    timeout (a listing four), so a frozen gateway held a close (and the host service's lock of the
    namespace, which a reopening engine waits on) for request after request. Now every request of
    the close ends by one deadline, two request timeouts from its start; what did not get out is a
    miss for the other nodes."""
    timeout_ms = 1000
    publish(nodes.open("a", **bucket), list(range(8)))
    store = nodes.open(
        "closing",
        **{**bucket, "bucket_request_timeout_ms": timeout_ms, "bucket_publish_delay_ms": 600_000},
        bucket_budget_bytes=64 * bucket["bucket_segment_bytes"],  # it takes the evictor lease
    )
    assert wait_visible(store, [key(i) for i in range(8)]) and all(load(store, list(range(8))))  # reads to log
    store.put_many([key(i, "closing") for i in range(6)], [value(i) for i in range(6)])  # a segment to send
    time.sleep(0.5)  # maintenance passes every 100 ms: the lease taken, a listing under way
    os.kill(rgw.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        store.close()
        elapsed = time.monotonic() - started
    finally:
        os.kill(rgw.pid, signal.SIGCONT)
    assert elapsed < 2 * timeout_ms / 1000 + 0.5, f"the close took {elapsed:.2f} s"  # before: 3.0 s


def test_a_worker_load_waiting_on_a_slow_bucket_that_delivers_is_not_given_up(rgw, bucket, tmp_path):
    """Issue 36, slow links under load: a load round waits while the service reads its blocks from the
    bucket (at kv8b one round is a whole 256 MiB prefix, and all of its GETs share the link, so none
    ends for seconds). Three places cut such a load short: the worker's watchdog (no round copied
    for the stall timeout), the service's remote stall limit (no read finished), and each GET's
    timeout (at 20 MB/s, 32 GETs of 8 MiB in flight take 13 s each). Bytes arriving now count as
    progress at all three. Here node A publishes 16 blocks (2 MiB) through its host service and node
    B loads them through a 0.5 MB/s link: one round of about 4 s, five stall timeouts (0.8 s: the
    first bytes come after the gateway's own latency, which on a busy 2-core machine once took more
    than 0.4 s), its GET four times the request timeout (1 s); every byte arrives."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier import service as kvtier_service
    from kvtier.bench.slowlink import LinkSpec, SlowLink
    from kvtier.vllm import KvtierLoadStoreSpec, KvtierOptions, ServiceConnection
    from test_vllm_worker import load_watched, publish_and_stop

    layers, page_bytes, count = 2, 64 * 1024, 16
    blocks = GPULoadStoreSpec(list(range(count)), group_sizes=[count], block_indices=[0])
    keys = KvtierLoadStoreSpec([hashlib.sha256(f"slow-{i}".encode()).digest() for i in range(count)])

    def node(name: str, endpoint: str) -> tuple[KvtierOptions, ServiceConnection]:
        own = {"path": str(tmp_path / name), "dram_bytes": 8 << 20, "nvme_bytes": 0, "region_bytes": 1 << 20}
        # One segment, read with one GET: its bytes arrive steadily (several GETs through this
        # proxy's one delay line take turns, and a turn may outlast the 1 s timeout at 1 MB/s).
        one_get = {
            "bucket_segment_bytes": 4096 + count * (4096 + layers * page_bytes),
            "bucket_request_timeout_ms": 1000,
        }
        options = KvtierOptions.from_extra_config(
            {**own, **bucket, **one_get, "bucket_endpoint": endpoint, "pool_dir": str(tmp_path)}
        )
        return options, ServiceConnection(options, {"test": "slow bucket"}, 1, 0, page_bytes * layers)

    source = [np.random.default_rng(i).integers(0, 256, (count, page_bytes), dtype=np.uint8) for i in range(layers)]
    writer, connection = node("a", rgw.endpoint)
    publish_and_stop(writer, connection, source, page_bytes, keys, blocks)
    link = SlowLink(rgw.endpoint.removeprefix("http://"), LinkSpec(0.5))
    reader, connection = node("b", f"http://127.0.0.1:{link.start()}")
    try:
        load = load_watched(connection, "bucket", keys, blocks, source, page_bytes, stall_timeout_ms=800)
        elapsed, stats = load.elapsed_s, load.stats
        assert load.worker.given_up_loads == 0, f"a load the bucket was delivering was given up after {elapsed:.1f} s"
        assert load.worker.take_failed_load_block_ids() == set(), "blocks missed (the service's remote stall limit?)"
        assert elapsed > 2.4, f"{elapsed:.1f} s: not through the 0.5 MB/s link"
        assert all(np.array_equal(got, want) for got, want in zip(load.target, source, strict=True)), (
            "the bytes node A stored"
        )
        assert stats["bucket_bytes_received"] >= count * page_bytes * layers, "the bytes received as they arrived"
        assert stats["bucket_request_errors"] == 0, "a GET timed out while its bytes arrived"
    finally:
        kvtier_service.stop_service(reader.socket_path())
        link.close()


def test_a_bucket_out_of_reach_at_open_is_an_empty_tier_until_it_answers(rgw, nodes, bucket):
    """Issue 36, item 2: a bucket that does not answer at open (here: nothing listens at its endpoint
    yet) no longer refuses the store, so engines start and serve from DRAM and NVMe; the tier starts
    empty and lists the bucket every bucket_refresh_ms, and its blocks become hits once it answers
    (here: a proxy to the gateway starts listening at that endpoint)."""
    import socket

    from kvtier.bench.slowlink import LinkSpec, SlowLink

    publish(nodes.open("a", **bucket), list(range(8)))
    with socket.socket() as probe:  # a free port: connections to it are refused until the proxy starts
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    reader = nodes.open("reader", **{**bucket, "bucket_endpoint": f"http://127.0.0.1:{port}"})
    assert reader.stats()["bucket_unreachable_at_open"] == 1
    assert reader.lookup_prefix([key(0)]) == 0, "an empty tier until the bucket answers"
    reader.put_many([key(100, "local")], [value(100)])  # DRAM serves meanwhile
    assert reader.lookup_prefix([key(100, "local")]) == 1
    link = SlowLink(rgw.endpoint.removeprefix("http://"), LinkSpec(1000.0))
    link.start(port)
    try:
        assert wait_visible(reader, [key(i) for i in range(8)]), "the bucket's blocks never appeared"
        assert all(load(reader, list(range(8))))
    finally:
        link.close()


def test_refused_credentials_are_a_clear_error_at_open(nodes, bucket, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(kvtier.ConfigError, match=r"refused a listing.*AWS_SECRET_ACCESS_KEY") as e:
        nodes.open("a", **bucket)
    assert "wrong-secret" not in str(e.value)
    with pytest.raises(kvtier.ConfigError, match="bucket_url"):
        nodes.open("b", **{**bucket, "bucket_url": "http://not-s3"})


def test_every_bucket_option_is_accepted_by_open(nodes, bucket, tmp_path):
    key_file = tmp_path / "bucket.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    values = {
        **bucket,
        "bucket_budget_bytes": 64 << 20,
        "bucket_publish_delay_ms": 50,
        "bucket_publish_queue_bytes": 4 << 20,
        "bucket_reads_in_flight": 4,
        "bucket_get_max_bytes": 2 * SLOT_BYTES,
        "bucket_lease_ms": 5000,
        "bucket_key_file": str(key_file),
    }
    names = {o["name"] for o in kvtier.options() if o["name"].startswith("bucket_")}
    assert set(values) == names, "cover every bucket_* option"
    store = nodes.open("all", **values)
    store.put_many([key(0)], [value(0)])
    deadline = time.monotonic() + 10  # published by the delay, without a flush
    while store.stats()["bucket_segments_published"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.stats()["bucket_segments_published"] == 1
    defaults = {o["name"]: o["default"] for o in kvtier.options() if o["name"] in names and o["default"] is not None}
    nodes.open("defaults", **{**defaults, **bucket}).close()


@pytest.mark.parametrize("encrypted", [False, True])
def test_bench_io_object_sweep_at_ci_size(rgw, bucket, tmp_path, encrypted):
    """`kvtier bench io --small --object` on the module's gateway: every block read back is compared
    with what was written (the benchmark fails on one wrong byte), and the requests it counts are the
    ones docs/object-tier.md promises: 2 PUTs per segment of whole blocks (4 MiB: 2 blocks of 2 MiB,
    16 MiB: 8), 1 ranged GET per run of up to 4 adjacent blocks of a segment. With ``--encrypted``
    (issue 40), every point again with the key on both stores (same requests: the seal's tag and
    nonce fit in the slot's page), and encryption's cost paired by repeat."""
    import json

    from kvtier.bench import io

    out = tmp_path / "out"
    argv = ["--small", "--object", "--no-kvtier", "--no-fio", "--no-lmcache", "--object-size", "512"]
    argv += ["--bucket-url", f"s3://{BUCKET}/bench-io", "--bucket-endpoint", rgw.endpoint]
    argv += ["--dir", str(tmp_path / "scratch"), "--out", str(out)] + (["--encrypted"] if encrypted else [])
    started = time.monotonic()
    assert io.main(argv) == io.EXIT_OK
    print(f"\nbench io --small --object{' --encrypted' if encrypted else ''}: {time.monotonic() - started:.1f} s")
    section = json.loads((out / "results.json").read_text())["object_tier"]
    sweep = section["sweep"]
    assert section["problems"] == [] and (out / "io-object.png").exists()
    variants = [False, True] if encrypted else [False]
    assert [(p["segment_bytes"] >> 20, p["encrypted"]) for p in section["points"]] == [
        (mib, sealed) for mib in (4, 16) for sealed in variants
    ]
    if encrypted:
        cost = section["summary"]["encryption_cost"]
        assert all(cost["publish"][str(s)]["n"] == 1 for s in sweep["segment_bytes"]), cost
        assert all(r["median"] > 0 for r in cost["retrieve"].values()) and len(cost["retrieve"]) == 4, cost
        assert "Encryption at rest on the object tier" in (out / "table.txt").read_text()
    for point in section["points"]:
        blocks_per_segment = 2 if point["segment_bytes"] >> 20 == 4 else 8
        published = point["publish"]
        segments = sweep["object_count"] // blocks_per_segment
        assert published["put_requests"] == 2 * published["segments"] == 2 * segments
        assert [r["reads_in_flight"] for r in point["retrieves"]] == [1, 8]
        for retrieved in point["retrieves"]:
            assert retrieved["found_objects"] == retrieved["bucket_hits"] == sweep["object_count"]
            assert retrieved["get_requests"] == segments * -(-blocks_per_segment // 4) < sweep["object_count"]
            assert retrieved["wrong_objects"] == 0
        assert point["deleted_objects"] == 2 * published["segments"]
    assert rgw.keys("bench-io") == [], "the benchmark left objects in the bucket"


def _put_expiry_rule(rgw: Rgw, prefix: str, days: int) -> None:
    """A bucket lifecycle configuration (it replaces the bucket's) expiring `prefix` after `days`."""
    rule = (
        "<LifecycleConfiguration><Rule><ID>kvtier-test-expiry</ID>"
        f"<Filter><Prefix>{prefix}/</Prefix></Filter><Status>Enabled</Status>"
        f"<Expiration><Days>{days}</Days></Expiration></Rule></LifecycleConfiguration>"
    ).encode()
    md5 = base64.b64encode(hashlib.md5(rule).digest()).decode()
    status, body = rgw.s3("PUT", BUCKET, rule, query="lifecycle=", headers=(f"Content-MD5: {md5}",))
    assert status == 200, f"PUT ?lifecycle: {status} {body!r}"


def test_an_expiry_lifecycle_rule_under_a_working_store(rgw, nodes, bucket):
    """A real expiry rule (1 lifecycle day: LC_DAY_S seconds on the test gateway) on the prefix while
    a store publishes and others load: every load is a verified hit or a counted miss (load() checks
    the bytes), none hangs, expired blocks leave the index, orphan index objects are not fetched
    again and again, the evictor lease is taken again when its object expires, and new publishes
    keep working."""
    prefix = bucket["bucket_url"].removeprefix(f"s3://{BUCKET}/")
    _put_expiry_rule(rgw, prefix, days=1)
    try:
        # A budget far above what is published: the writer takes the evictor lease, whose object
        # (renewed after 60 s) the rule expires first.
        options = {**bucket, "bucket_budget_bytes": 64 << 20, "bucket_lease_ms": 120_000}
        writer = nodes.open("writer", **options)
        reader, prober = nodes.open("reader", **bucket), nodes.open("prober", **bucket)
        watcher = nodes.open("watcher", **bucket)  # loads nothing: what it contains is its index
        assert _wait_for(lambda: any("/lease/" in k for k, _, _ in rgw.listing(prefix)))
        first_lease = next(item for item in rgw.listing(prefix) if "/lease/" in item[0])
        rounds, started = 0, time.monotonic()
        while time.monotonic() - started < 4 * LC_DAY_S:
            ids = list(range(8 * rounds, 8 * rounds + 8))
            publish(writer, ids)
            assert wait_visible(reader, [key(i) for i in ids]), f"round {rounds} never became visible"
            t0 = time.monotonic()
            assert all(load(reader, ids)), f"round {rounds}: fresh blocks missed"
            # The prober loads each older round once, as it ages past a lifecycle day: hit or miss.
            old = rounds - LC_DAY_S
            if old >= 0:
                load(prober, list(range(8 * old, 8 * old + 8)))
            assert time.monotonic() - t0 < 4, "a load took longer than a request timeout"
            rounds += 1
            time.sleep(1)

        # Publishing stops: the rule expires everything; every store's index follows.
        def expired() -> bool:
            return not any(k.endswith((".kvo", ".kvi")) for k, _, _ in rgw.listing(prefix))

        assert _wait_for(expired, timeout_s=4 * LC_DAY_S), "the rule did not expire the objects"
        published = [key(i) for i in range(8 * rounds)]
        assert _wait_for(lambda: not any(watcher.contains_many(published))), "expired blocks stayed indexed"
        stats = [s.stats() for s in (reader, prober)]
        time.sleep(1)
        assert [s.stats()["bucket_get_requests"] for s in (reader, prober)] == [
            s["bucket_get_requests"] for s in stats
        ], "GETs while idle: an orphan index object fetched again"
        prober_stats = prober.stats()
        assert prober_stats["bucket_request_errors"] == 0, prober_stats  # a 404 is a clean miss
        hits, misses = prober_stats["bucket_hits"], prober_stats["bucket_misses"]
        print(f"\nlifecycle: {rounds} rounds; the prober's loads of aged rounds: {hits} hits, {misses} misses")

        # The lease's first object expired (before its renewal was due); the writer took it again.
        def leases() -> list[tuple[str, int, str]]:
            return [item for item in rgw.listing(prefix) if "/lease/" in item[0]]

        assert _wait_for(lambda: leases() != [] and first_lease not in leases(), timeout_s=3 * LC_DAY_S), leases()
        # New publishes still work.
        ids = list(range(1000, 1008))
        publish(writer, ids)
        assert wait_visible(reader, [key(i) for i in ids]) and all(load(reader, ids))
    finally:
        rgw.s3("DELETE", BUCKET, query="lifecycle=")


SERVICE_SLICE = 16 << 10
SERVICE_DESCRIPTION = json.dumps(
    {
        "engine": "vllm",
        "model": "bucket-ops-model",
        "kv_dtype": "bfloat16",
        "kv_cache_layout": "NHD",
        "parallel": {"tp_size": 1, "pp_size": 1},
        "groups": [{"tokens_per_block": 16, "layers": ["layer.0"]}],
        "object_layout": "rank-major slices of layer pages",
    },
    sort_keys=True,
).encode()


def service_value(i: int) -> np.ndarray:
    return ((np.arange(SERVICE_SLICE, dtype=np.uint32) * 13 + i * 5) % 251).astype(np.uint8)


class HostService(ServedStore):
    """``kvtier serve`` of one host on the bucket (credentials from the environment), one engine's
    connection to it."""

    def __init__(self, root: Path, bucket: dict) -> None:
        super().__init__(root, {"dram_bytes": 64 * (4096 + SERVICE_SLICE), "nvme_bytes": 0, **bucket})
        self.client = kvtier.ServiceClient.connect(os.fspath(self.socket), 30_000)
        self.client.hello(SERVICE_DESCRIPTION, 1, 0, SERVICE_SLICE)


def test_bucket_hits_reach_the_scrape_and_status(bucket, tmp_path):
    """Two hosts' services share the bucket: the blocks B serves from it are bucket hits in its scrape
    (``kvtier_hits_total{tier="bucket"}``, counted in its lookups and loaded bytes), in its engine's
    lookups (``tier="bucket"``, not the shared filesystem's), in ``kvtier status``'s tiers and in
    ``kvtier top``'s, not lost from the hit rate."""
    from click.testing import CliRunner
    from rich.console import Console

    from kvtier.cli import cli
    from kvtier.ops import top
    from kvtier.ops.metrics import ServiceSnapshot

    keys = [hashlib.sha256(f"ops-{i}".encode()).digest() for i in range(12)]
    hosts: list[HostService] = []
    try:
        hosts.append(HostService(tmp_path / "a", bucket))
        a = hosts[0]
        assert all(a.client.store_blocks(keys, [np.stack([service_value(i) for i in range(12)])], list(range(12))))
        a.client.flush()
        hosts.append(HostService(tmp_path / "b", bucket))
        b = hosts[1]
        b.client.set_label("engine-b")
        deadline = time.monotonic() + 15
        while b.client.locate_many(keys) != ["bucket"] * 12:
            assert time.monotonic() < deadline, (
                f"A's blocks never reached B through the bucket: {b.client.locate_many(keys)}"
            )
            time.sleep(0.1)
        snapshot = ServiceSnapshot(b.socket)
        before, _ = snapshot.read()
        out = np.zeros((12, SERVICE_SLICE), dtype=np.uint8)
        assert all(b.client.load_blocks(keys, [out], list(range(12))))
        assert all(np.array_equal(out[i], service_value(i)) for i in range(12))
        after, stats = snapshot.read()
        console = Console(width=160, record=True, file=io.StringIO())
        console.print(top.frame(b.socket, before, after, stats, 1.0))
        screen = console.export_text()
        assert re.search(r"bucket\s+100\.0%\s+12\b", screen) and re.search(r"all\s+100\.0%", screen), screen
        text = b.scrape()
        hits = dict(re.findall(r'kvtier_hits_total\{[^}]*tier="(\w+)"\} (\S+)', text))
        assert float(hits["bucket"]) == 12 and float(hits["dram"]) == 0, hits
        engine_lookups = r'kvtier_engine_lookup_blocks_total\{[^}]*engine="engine-b"[^}]*tier="(\w+)"\} (\S+)'
        engine = dict(re.findall(engine_lookups, text))
        assert float(engine["bucket"]) >= 12 and float(engine["shared"]) == 0, engine
        lookups = re.search(r"kvtier_lookups_total\{[^}]*\} (\S+)", text)
        assert lookups is not None and float(lookups.group(1)) >= 12
        result = CliRunner().invoke(cli, ["status", str(b.path), "--socket", str(b.socket), "--json"])
        assert result.exit_code == 0, result.output
        tiers = json.loads(result.stdout)["tiers"]
        assert tiers["bucket"]["hits"] == 12 and tiers["bucket"]["hit_rate"] > 0, tiers
        table = CliRunner().invoke(cli, ["status", str(b.path), "--socket", str(b.socket)])
        assert re.search(r"bucket .* 12 ", table.output), table.output
    finally:
        for host in hosts:
            host.stop()
