"""The Python API of kvtier.Store on real files, against both I/O engines."""

import hashlib
import shutil
import threading

import numpy as np
import pytest

import kvtier

OBJECT_BYTES = 128 * 1024


def key(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def value(i: int, n: int = OBJECT_BYTES) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def open_store(path, engine, **overrides):
    options = dict(
        object_bytes=OBJECT_BYTES,
        namespace="test-model|bf16|LBHNC|128|tp1pp1r0",
        dram_bytes=8 * (OBJECT_BYTES + 4096),
        nvme_bytes=64 << 20,
        region_bytes=2 << 20,
        io_engine=engine,
    )
    options.update(overrides)
    return kvtier.Store.open(str(path), **options)


def test_put_get_roundtrip_and_stats(store_dir, engine):
    with open_store(store_dir, engine) as store:
        keys = [key(i) for i in range(4)]
        store.put_many(keys, [value(i) for i in range(4)])
        out = [np.zeros(OBJECT_BYTES, np.uint8) for _ in range(5)]
        hits = store.get_many([*keys, key(99)], out)
        assert hits == [True, True, True, True, False]
        for i in range(4):
            assert np.array_equal(out[i], value(i))
        assert not out[4].any(), "a miss must not write into the buffer"
        s = store.stats()
        assert s["dram_hits"] == 4 and s["misses"] == 1
        assert s["io_engine"] == engine
        assert store.locate_many([key(0), key(99)]) == ["dram", None]
        for name in (
            "nvme_hits",
            "bytes_read_nvme",
            "dram_evictions",
            "dropped_stores",
            "checksum_failures",
            "dram_used_bytes",
            "nvme_capacity_bytes",
        ):
            assert name in s


def test_nvme_tier_serves_after_dram_eviction_and_restart(store_dir, engine):
    keys = [key(i) for i in range(40)]
    with open_store(store_dir, engine) as store:
        store.put_many(keys, [value(i) for i in range(40)])
        store.flush()
        out = [np.zeros(OBJECT_BYTES, np.uint8) for _ in keys]
        assert all(store.get_many(keys, out))
        assert store.stats()["nvme_hits"] >= 30
    with open_store(store_dir, engine) as store:
        assert store.lookup_prefix(keys) == 40
        out = [np.zeros(OBJECT_BYTES, np.uint8) for _ in keys]
        assert all(store.get_many(keys, out))
        assert all(np.array_equal(o, value(i)) for i, o in enumerate(out))
        assert store.stats()["recovered_blocks"] >= 40


def test_segments_and_layer_blocks(store_dir, engine):
    layers, page = 4, OBJECT_BYTES // 4
    num_blocks = 6
    kv = [
        np.random.default_rng(100 + layer).integers(0, 256, num_blocks * page, dtype=np.uint8)
        for layer in range(layers)
    ]
    keys = [key(1000 + b) for b in range(num_blocks)]
    with open_store(store_dir, engine) as store:
        assert store.put_blocks(keys, kv, list(range(num_blocks))) == [True] * num_blocks
        # Read back as segments (one per layer) into fresh memory.
        segs = [[np.zeros(page, np.uint8) for _ in range(layers)] for _ in range(num_blocks)]
        assert all(store.get_many(keys, segs))
        for b in range(num_blocks):
            for layer in range(layers):
                assert np.array_equal(segs[b][layer], kv[layer][b * page : (b + 1) * page])
        # And scatter into other block ids of a second "engine cache".
        dst = [np.zeros(num_blocks * page, np.uint8) for _ in range(layers)]
        assert store.get_blocks(keys[:2], dst, [5, 3]) == [True, True]
        for layer in range(layers):
            assert np.array_equal(dst[layer][5 * page : 6 * page], kv[layer][0:page])
            assert np.array_equal(dst[layer][3 * page : 4 * page], kv[layer][page : 2 * page])


def test_async_jobs(store_dir, engine):
    with open_store(store_dir, engine) as store:
        keys = [key(i) for i in range(6)]
        vals = [value(i) for i in range(6)]
        store.submit_put(1, keys, vals)
        assert store.wait(1, timeout_ms=10_000) == [True] * 6
        out = [np.zeros(OBJECT_BYTES, np.uint8) for _ in keys]
        store.submit_get(2, keys, out)
        finished = {}
        for _ in range(1000):
            finished.update(dict(store.poll()))
            if 2 in finished:
                break
            threading.Event().wait(0.01)
        assert finished[2] == [True] * 6
        assert all(np.array_equal(o, v) for o, v in zip(out, vals, strict=True))
        with pytest.raises(ValueError):
            store.wait(2)  # already reported


def test_namespaces_are_isolated(store_dir, engine):
    with open_store(store_dir, engine) as store:
        store.put_many([key(1)], [value(1)])
    with open_store(store_dir, engine, namespace="another-model") as store:
        assert store.get_many([key(1)], [np.zeros(OBJECT_BYTES, np.uint8)]) == [False]
        assert store.lookup_prefix([key(1)]) == 0


def test_pins_keep_blocks(store_dir, engine):
    with open_store(store_dir, engine, nvme_bytes=0) as store:
        keys = [key(i) for i in range(4)]
        store.put_many(keys, [value(i) for i in range(4)])
        assert store.pin_many([*keys, key(77)]) == [True] * 4
        # Flood DRAM (no NVMe tier): pinned blocks must stay.
        store.put_many([key(100 + i) for i in range(30)], [value(100 + i) for i in range(30)])
        out = [np.zeros(OBJECT_BYTES, np.uint8) for _ in keys]
        assert all(store.get_many(keys, out))
        store.unpin_many(keys)


def test_errors_are_typed_and_name_the_option(store_dir):
    with pytest.raises(kvtier.ConfigError, match="namespace"):
        kvtier.Store.open(str(store_dir), object_bytes=4096)
    with pytest.raises(kvtier.ConfigError, match="bogus"):
        kvtier.Store.open(str(store_dir), object_bytes=4096, bogus=1)
    with pytest.raises(ValueError, match="object_bytes"):
        kvtier.Store.open(str(store_dir))
    with pytest.raises(ValueError, match="io_engine"):
        kvtier.Store.open(str(store_dir), object_bytes=4096, io_engine="spdk")
    with pytest.raises(kvtier.ConfigError, match="nvme_bytes"):
        kvtier.Store.open(str(store_dir), object_bytes=4096, namespace="m", nvme_bytes=1 << 20)
    free_bytes = shutil.disk_usage(store_dir.parent).free
    with pytest.raises(kvtier.CapacityError, match="nvme_bytes"):
        kvtier.Store.open(
            str(store_dir), object_bytes=4096, namespace="m", nvme_bytes=4 * free_bytes, region_bytes=1 << 30
        )
    with pytest.raises(kvtier.ConfigError, match="region_bytes"):
        kvtier.Store.open(str(store_dir), object_bytes=4096, namespace="m", nvme_bytes=1 << 60)
    store = open_store(store_dir, "psync")
    with pytest.raises(kvtier.LockedError):
        open_store(store_dir, "psync")
    with pytest.raises(ValueError, match="32-byte"):
        store.put_many([b"short"], [value(1)])
    with pytest.raises(ValueError, match="object_bytes"):
        store.put_many([key(1)], [np.zeros(10, np.uint8)])
    with pytest.raises(ValueError, match="writable"):
        store.get_many([key(1)], [bytes(OBJECT_BYTES)])
    store.close()
    with pytest.raises(kvtier.ClosedError):
        store.put_many([key(1)], [value(1)])


def test_corrupt_block_on_disk_is_a_counted_miss(store_dir, engine):
    keys = [key(i) for i in range(30)]
    with open_store(store_dir, engine) as store:
        store.put_many(keys, [value(i) for i in range(30)])
        ns = store.namespace_hex
    device = store_dir / ns / "nvme.kvt"
    data = bytearray(device.read_bytes())
    # Flip a byte in the value of the first entry of region 0 (superblock 4096 + descriptor 4096).
    data[4096 + 4096 + 1000] ^= 0xFF
    device.write_bytes(bytes(data))
    with open_store(store_dir, engine) as store:
        out = [np.zeros(OBJECT_BYTES, np.uint8) for _ in keys]
        hits = store.get_many(keys, out)
        assert hits.count(False) == 1
        for i, (h, o) in enumerate(zip(hits, out, strict=True)):
            if h:
                assert np.array_equal(o, value(i))
        assert store.stats()["checksum_failures"] == 1


def test_torch_tensors_without_copy(store_dir):
    torch = pytest.importorskip("torch")
    with open_store(store_dir, "psync") as store:
        t = torch.arange(OBJECT_BYTES // 2, dtype=torch.int16)
        store.put_many([key(5)], [t])
        out = torch.zeros(OBJECT_BYTES // 2, dtype=torch.int16)
        assert store.get_many([key(5)], [out]) == [True]
        assert torch.equal(out, t)
        bf16 = torch.randn(OBJECT_BYTES // 2).to(torch.bfloat16)
        store.put_many([key(6)], [bf16])
        back = torch.empty_like(bf16)
        assert store.get_many([key(6)], [back]) == [True]
        assert torch.equal(back, bf16)
