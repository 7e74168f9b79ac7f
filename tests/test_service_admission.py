"""Writes below DRAM through the host service (docs/architecture.md, "Writes below DRAM"): with
``write_admission: "reuse"`` the evidence is the host's, not one engine's. Blocks one engine stored
are written to NVMe when another engine's request pins and loads them, and only those."""

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvtier._core import Service, ServiceClient

SLICE_BYTES = 64 << 10
SLOT_BYTES = SLICE_BYTES + 4096


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 4


@contextlib.contextmanager
def reuse_service(tmp_path: Path) -> Iterator[Path]:
    """A host service with ``write_admission: "reuse"`` over a small NVMe tier: its socket."""
    socket = tmp_path / "kvtier.sock"
    options = {"dram_bytes": 8 << 20, "nvme_bytes": 16 << 20, "region_bytes": 1 << 20, "write_admission": "reuse"}
    service = Service.start(os.fspath(socket), os.fspath(tmp_path / "store"), os.fspath(tmp_path), 30_000, **options)
    try:
        yield socket
    finally:
        service.stop()


def engine(socket: Path) -> ServiceClient:
    client = ServiceClient.connect(os.fspath(socket), 10_000)
    client.hello(b"admission|service", 1, 0, SLICE_BYTES)
    return client


def test_a_block_one_engine_stored_is_written_once_another_engine_uses_it(tmp_path: Path) -> None:
    with reuse_service(tmp_path) as socket:
        first, second = engine(socket), engine(socket)
        keys = [key(i) for i in range(8)]
        layer = np.stack([np.full(SLICE_BYTES, i, dtype=np.uint8) for i in range(8)])
        assert all(first.store_blocks(keys, [layer], list(range(8))))
        first.flush()
        stats = first.stats()
        assert (stats["writes_awaiting_reuse"], stats["bytes_written_nvme"]) == (8, 0), "seen once: DRAM only"
        assert second.pin_many(keys[:4]) == [True] * 4, "the other engine's lookup hits in DRAM"
        out = np.zeros((4, SLICE_BYTES), dtype=np.uint8)
        assert all(second.load_blocks(keys[:4], [out], list(range(4))))
        second.unpin_many(keys[:4])
        assert all((out[i] == i).all() for i in range(4))
        second.flush()
        stats = second.stats()
        assert stats["writes_admitted_on_reuse"] == 4
        assert stats["bytes_written_nvme"] == 4 * SLOT_BYTES, "the four blocks used again, once each"
        assert second.locate_many(keys[4:]) == ["dram"] * 4, "the others stay in DRAM, unwritten"


def test_blocks_an_engine_says_will_come_back_are_written_at_their_first_store(tmp_path: Path) -> None:
    """A request's retention hint (``kv_transfer_params: {"kvtier": {"retain": true}}``) reaches the
    service as ``note_retained`` before the worker's store: those blocks go to NVMe at their first
    store, the others wait in DRAM for evidence."""
    with reuse_service(tmp_path) as socket:
        scheduler, worker = engine(socket), engine(socket)
        keys = [key(i) for i in range(8)]
        scheduler.note_retained(keys[:3])
        layer = np.stack([np.full(SLICE_BYTES, i, dtype=np.uint8) for i in range(8)])
        assert all(worker.store_blocks(keys, [layer], list(range(8))))
        worker.flush()
        stats = worker.stats()
        assert stats["retained_by_hint"] == 3
        assert (stats["bytes_written_nvme"], stats["writes_awaiting_reuse"]) == (3 * SLOT_BYTES, 5)
