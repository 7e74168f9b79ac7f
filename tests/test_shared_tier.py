"""The shared-filesystem tier through the Python API: two stores (two "replicas", each with its own
local NVMe directory) on one shared root."""

import hashlib
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
