"""The shared-filesystem tier through the Python API: two stores (two "replicas", each with its own
local NVMe directory) on one shared root."""

import hashlib
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import kvtier

OBJECT_BYTES = 64 * 1024


def key(i: int) -> bytes:
    return hashlib.sha256(f"shared-{i}".encode()).digest()


def value(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, OBJECT_BYTES, dtype=np.uint8)


def open_replica(local, shared, engine, **extra):
    return kvtier.Store.open(
        str(local),
        object_bytes=OBJECT_BYTES,
        namespace="shared-test",
        dram_bytes=8 * (OBJECT_BYTES + 4096),
        nvme_bytes=0,
        io_engine=engine,
        shared_root=str(shared),
        shared_staleness_ms=50,
        shared_file_bytes=1 << 20,
        **extra,
    )


def wait_visible(store, keys, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.lookup_prefix(keys) == len(keys):
            return True
        time.sleep(0.05)
    return False


def test_one_replica_serves_another(tmp_path, engine):
    shared = tmp_path / "shared"
    shared.mkdir()
    a = open_replica(tmp_path / "a", shared, engine)
    b = open_replica(tmp_path / "b", shared, engine)
    keys = [key(i) for i in range(20)]
    a.put_many(keys, [value(i) for i in range(20)])
    a.flush()  # publishes what is queued
    assert wait_visible(b, keys), "blocks published by replica A never became visible to B"
    out = [np.zeros(OBJECT_BYTES, np.uint8) for _ in keys]
    assert all(b.get_many(keys, out))
    assert all(np.array_equal(o, value(i)) for i, o in enumerate(out))
    assert b.stats()["shared_hits"] == 20
    a.close()
    b.close()
    # A new process over the same root sees everything, from the manifests.
    c = open_replica(tmp_path / "c", shared, engine)
    assert wait_visible(c, keys)
    c.close()


def test_shared_options_are_validated(tmp_path):
    with pytest.raises(kvtier.ConfigError, match="shared"):
        kvtier.Store.open(
            str(tmp_path / "x"),
            object_bytes=OBJECT_BYTES,
            namespace="m",
            nvme_bytes=0,
            shared_root=str(tmp_path / "s"),
            shared_high_watermark=1.5,
        )
    with pytest.raises(kvtier.KvtierError, match=r"shared_root|does not exist|parent"):
        kvtier.Store.open(
            str(tmp_path / "x"),
            object_bytes=OBJECT_BYTES,
            namespace="m",
            nvme_bytes=0,
            shared_root=str(tmp_path / "missing" / "deeper"),
        )


def make_key_file(path, n=32, mode=0o600):
    path.write_bytes(hashlib.sha256(path.name.encode()).digest() * (n // 32 + 1))
    path.write_bytes(path.read_bytes()[:n])
    path.chmod(mode)
    return path


def test_keyed_replicas_never_serve_unkeyed_or_other_key_blocks(tmp_path, engine):
    shared = tmp_path / "shared"
    shared.mkdir()
    keys = tmp_path / "keys"
    keys.mkdir()
    right = make_key_file(keys / "right.key")
    wrong = make_key_file(keys / "wrong.key", n=48)
    ks = [key(i) for i in range(8)]
    # Forgeries planted before the keyed replicas open: same keys, other bytes, valid checksums (half
    # each: the keyless writer indexes the other's blocks and would not publish them again).
    for i, (extra, name) in enumerate([({"shared_key_file": str(wrong)}, "w"), ({}, "p")]):
        forger = open_replica(tmp_path / name, shared, engine, **extra)
        half = ks[4 * i : 4 * i + 4]
        forger.put_many(half, [np.full(OBJECT_BYTES, 0xEE - i, np.uint8) for _ in half])
        forger.flush()
        forger.close()
    a = open_replica(tmp_path / "a", shared, engine, shared_key_file=str(right))
    stats = a.stats()
    assert stats["shared_auth_failures"] >= 4
    assert stats["shared_quarantined_files"] == 2
    assert a.lookup_prefix(ks) == 0
    out = [np.zeros(OBJECT_BYTES, np.uint8) for _ in ks]
    assert not any(a.get_many(ks, out))
    assert a.stats()["shared_hits"] == 0
    ns_dirs = [d for d in shared.iterdir() if d.is_dir()]
    assert len(ns_dirs) == 1 and len(list((ns_dirs[0] / "quarantine").iterdir())) == 2
    # The right key: one replica serves another.
    a.put_many(ks, [value(i) for i in range(8)])
    a.flush()
    b = open_replica(tmp_path / "b", shared, engine, shared_key_file=str(right))
    assert wait_visible(b, ks)
    assert all(b.get_many(ks, out))
    assert all(np.array_equal(o, value(i)) for i, o in enumerate(out))
    assert b.stats()["shared_hits"] == 8
    a.close()
    b.close()


def test_key_file_refused_with_the_fix(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    bad = [
        (make_key_file(shared / "on-root.key"), "is on the shared root"),
        (make_key_file(tmp_path / "world.key", mode=0o644), "chmod 600"),
        (make_key_file(tmp_path / "short.key", n=16), "fewer than the 32"),
    ]
    for path, message in bad:
        with pytest.raises(kvtier.ConfigError, match=message) as info:
            kvtier.Store.open(
                str(tmp_path / "x"),
                object_bytes=OBJECT_BYTES,
                namespace="m",
                nvme_bytes=0,
                shared_root=str(shared),
                shared_key_file=str(path),
            )
        assert "shared_key_file" in str(info.value)


def test_key_file_from_the_environment(tmp_path):
    """KVTIER_SHARED_KEY_FILE applies when shared_key_file is not given (in a child: the variable is
    read at open, and other tests' stores must not see it)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    code = (
        "import sys, kvtier\n"
        "try:\n"
        f"    kvtier.Store.open({str(tmp_path / 'x')!r}, object_bytes={OBJECT_BYTES}, namespace='m',"
        f" nvme_bytes=0, shared_root={str(shared)!r})\n"
        "except kvtier.ConfigError as e:\n"
        "    print(e); sys.exit(3)\n"
    )
    env = dict(os.environ, KVTIER_SHARED_KEY_FILE=str(make_key_file(shared / "env.key")))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "KVTIER_SHARED_KEY_FILE" in done.stdout and "is on the shared root" in done.stdout
    env["KVTIER_SHARED_KEY_FILE"] = str(make_key_file(tmp_path / "env.key"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
