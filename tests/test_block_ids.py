"""Block ids of the engine-layout calls (`put_blocks`, `get_blocks`, their `submit_*` forms, and the
service client's `store_blocks` / `load_blocks`): an id whose page is not wholly inside every layer
buffer is a ValueError before any byte moves, never an access outside the buffer (issue 24, item 1:
`id * page_bytes + page_bytes` wrapped for 2**52 - 1 with 4 KiB pages and pointed 4 KiB before each
layer)."""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvtier
from kvtier import Service, ServiceClient

PAGE = 4096
LAYERS = 2
BLOCKS = 4
# Each id wraps or overflows `id * PAGE (+ PAGE)` in 64 bits, is negative, or is just past the end.
BAD_IDS: list[Any] = [
    2**52 - 1,  # id * 4096 + 4096 == 2**64: wrapped to 0 and passed the old check
    2**52 - 2,
    2**52,
    2**52 - 8,
    BLOCKS,
    BLOCKS + 1,
    2**32,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    2**100,
    -1,
    -(2**63),
    np.uint64(2**52 - 1),
    np.int64(-1),
]


def key(i: int) -> bytes:
    return hashlib.sha256(f"block-id-{i}".encode()).digest()


def layers(blocks: int = BLOCKS, page: int = PAGE, count: int = LAYERS) -> list[np.ndarray]:
    # Small buffers (heap, not mmap): on the unfixed code an out-of-bounds page lands in mapped memory,
    # so the test fails on a missing ValueError instead of crashing the interpreter.
    return [np.full(blocks * page, layer + 1, np.uint8) for layer in range(count)]


def open_store(path: Path, page: int = PAGE, count: int = LAYERS) -> Any:
    return kvtier.Store.open(
        str(path),
        object_bytes=count * page,
        namespace=f"block-ids|{count}x{page}",
        dram_bytes=16 * (count * page + 4096),
        nvme_bytes=8 << 20,
        region_bytes=1 << 20,
        io_engine="psync",
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Any]:
    s = open_store(tmp_path / "store")
    try:
        yield s
    finally:
        s.close()


def store_calls(store: Any) -> dict[str, Any]:
    """Each engine-layout call of a Store, as f(keys, layers, ids). Gets use keys never stored: on the
    unfixed code they miss without writing, so a wrong acceptance fails the test without corrupting memory."""
    return {
        "put_blocks": store.put_blocks,
        "get_blocks": store.get_blocks,
        "submit_put_blocks": lambda k, lay, ids: store.submit_put_blocks(1, k, lay, ids),
        "submit_get_blocks": lambda k, lay, ids: store.submit_get_blocks(2, k, lay, ids),
    }


@pytest.mark.parametrize("call", ["put_blocks", "get_blocks", "submit_put_blocks", "submit_get_blocks"])
@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_store_refuses_block_ids_outside_the_layers(store: Any, call: str, bad: Any) -> None:
    kv = layers()
    before = [layer.copy() for layer in kv]
    with pytest.raises(ValueError, match="block_ids"):
        store_calls(store)[call]([key(0), key(1)], kv, [0, bad])
    assert all(np.array_equal(a, b) for a, b in zip(kv, before, strict=True))
    assert store.lookup_prefix([key(0)]) == 0, "nothing of a refused call is stored"


def test_the_last_block_of_each_layer_is_accepted(store: Any) -> None:
    kv = layers()
    for layer in kv:
        layer[(BLOCKS - 1) * PAGE :] = np.arange(PAGE, dtype=np.uint32).astype(np.uint8)
    assert store.put_blocks([key(7)], kv, [BLOCKS - 1]) == [True]
    out = [np.zeros(BLOCKS * PAGE, np.uint8) for _ in range(LAYERS)]
    assert store.get_blocks([key(7)], out, [BLOCKS - 1]) == [True]
    assert all(np.array_equal(o[(BLOCKS - 1) * PAGE :], i[(BLOCKS - 1) * PAGE :]) for o, i in zip(out, kv, strict=True))


def test_a_non_integer_block_id_is_a_value_error(store: Any) -> None:
    with pytest.raises(ValueError, match="block_ids"):
        store.get_blocks([key(0)], layers(), ["0"])


def fuzz_id(rng: random.Random, page: int, blocks: int) -> int:
    """An id from near every edge: inside, just past the end, around the 64-bit wrap of id * page, huge
    and negative."""
    wrap = 2**64 // page
    return rng.choice(
        [
            rng.randrange(blocks),
            blocks + rng.randrange(4),
            wrap - rng.randrange(1, 4),
            wrap + rng.randrange(4),
            rng.randrange(2**64),
            rng.randrange(2**64, 2**70),
            -rng.randrange(1, 2**64),
        ]
    )


def test_fuzz_block_ids_are_accepted_exactly_when_inside_every_layer(tmp_path: Path) -> None:
    rng = random.Random(24)
    for page, count in [(4096, 2), (8192, 1), (4096 * 3, 3)]:
        store = open_store(tmp_path / f"store-{page}-{count}", page, count)
        blocks = rng.randrange(1, 6)
        kv = layers(blocks, page, count)
        try:
            for _ in range(150):
                ids = [fuzz_id(rng, page, blocks) for _ in range(rng.randrange(1, 4))]
                keys = [key(1000 + i) for i in range(len(ids))]
                if all(0 <= i < blocks for i in ids):
                    assert store.get_blocks(keys, kv, ids) == [False] * len(ids)
                else:
                    with pytest.raises(ValueError, match="block_ids"):
                        store.get_blocks(keys, kv, ids)
        finally:
            store.close()


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Any]:
    socket = tmp_path / "kvtier.sock"
    options = {"dram_bytes": 1 << 20, "nvme_bytes": 4 << 20, "region_bytes": 1 << 20}
    service: Any = Service.start(
        os.fspath(socket), os.fspath(tmp_path / "store"), os.fspath(tmp_path), 30_000, **options
    )
    try:
        c = ServiceClient.connect(os.fspath(socket), 10_000)
        c.hello(b"block-ids|service", 1, 0, LAYERS * PAGE)
        yield c
    finally:
        service.stop()


@pytest.mark.parametrize("call", ["store_blocks", "load_blocks"])
@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_service_client_refuses_block_ids_outside_the_layers(client: Any, call: str, bad: Any) -> None:
    kv = layers()
    before = [layer.copy() for layer in kv]
    with pytest.raises(ValueError, match="block_ids"):
        getattr(client, call)([key(0), key(1)], kv, [0, bad])
    assert all(np.array_equal(a, b) for a, b in zip(kv, before, strict=True))
    assert client.locate_many([key(0)]) == [None], "nothing of a refused call is stored"
