"""The GPU data path on a CPU: everything but the CUDA calls themselves.

The transfers (reserve → copy → commit, pipelined acquire → copy → release), the copy plans and two
of the executors run here unchanged on host tensors, against the real host service: what they store
is what the service's own copy path loads, byte for byte, in every layout vLLM uses; failures end as
misses with nothing pinned or half-written. The CUDA pieces (events, ``cudaHostRegister``,
``cuMemcpyBatchAsync``) await a GPU (docs/gpu.md).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtier import Service, ServiceClient
from kvtier.gpu import CopyPlan
from kvtier.gpu.device import POOL_PINS, HostSide, PinnedRange
from kvtier.gpu.executors import (
    ACCESS_ORDER_ANY,
    ACCESS_ORDER_STREAM,
    CopyJob,
    HostExecutor,
    StagedExecutor,
    _MemcpyAttributes,
    batch_attributes,
    choose,
    gpu_candidates,
    self_test,
)
from kvtier.gpu.layouts import ModelShape, PagedCache, fill_random, layouts_for, paged_cache
from kvtier.gpu.plan import PlanError, round_blocks
from kvtier.gpu.transfers import BlockTransfers

SMALL = ModelShape("small", layers=4, kv_heads=2, head_dim=16)
SMALL_MLA = ModelShape("small-mla", layers=3, kv_heads=1, head_dim=0, latent=40)
BLOCK_TOKENS = 4
NUM_BLOCKS = 24
CPU = torch.device("cpu")


def key(i: int, salt: int = 0) -> bytes:
    return (i + 1000 * salt).to_bytes(8, "little") * 4


class Host:
    """A host service in this process with one engine's namespace."""

    def __init__(self, directory: Path, slice_bytes: int, dram_bytes: int = 4 << 20, tp_size: int = 1):
        self.socket = str(directory / "kvtier.sock")
        self.service: Any = Service.start(
            self.socket,
            str(directory / "store"),
            str(directory),
            5_000,
            dram_bytes=dram_bytes,
            nvme_bytes=64 << 20,
            region_bytes=1 << 20,
        )
        self.slice_bytes, self.tp_size = slice_bytes, tp_size

    def client(self, rank: int = 0, runs: list[tuple[int, int, int]] | None = None) -> Any:
        client = ServiceClient.connect(self.socket, 10_000)
        client.hello(b"test-gpu-path", self.tp_size, rank, self.slice_bytes)
        if runs is not None:
            client.set_placement(runs)
        return client

    def digest(self, client: Any) -> str:
        return client.namespaces()["namespaces"][0]["digest"]

    def assert_nothing_pinned(self, client: Any) -> None:
        """A trim of everything skips nothing: no block is pinned (or still on its way to NVMe)."""
        client.flush()
        trimmed = client.trim(self.digest(client), "all", 0)
        assert trimmed["skipped_in_use"] == 0, f"pins left behind: {trimmed}"


@pytest.fixture
def small_cache() -> PagedCache:
    cache = paged_cache(SMALL, "nhd", NUM_BLOCKS, BLOCK_TOKENS, CPU)
    fill_random(cache, seed=1)
    return cache


# ---- plans ----------------------------------------------------------------------------------------


def test_a_rank_major_plan_is_one_range_and_its_pointers_walk_pages_then_blocks():
    plan = CopyPlan([100, 100, 50], [(0, 250, 250)], 500)
    assert plan.contiguous and plan.object_offset == 250
    assert [(s.tensor, s.page_offset, s.object_offset, s.size) for s in plan.segments] == [
        (0, 0, 250, 100),
        (1, 0, 350, 100),
        (2, 0, 450, 50),
    ]
    src, dst, sizes = plan.pointers([10_000, 20_000, 30_000], [100, 100, 64], [3, 5], [1_000_000, 2_000_000], True)
    assert src.tolist() == [10_300, 20_300, 30_192, 10_500, 20_500, 30_320]
    assert dst.tolist() == [1_000_250, 1_000_350, 1_000_450, 2_000_250, 2_000_350, 2_000_450]
    assert sizes.tolist() == [100, 100, 50] * 2
    back_src, back_dst, _ = plan.pointers(
        [10_000, 20_000, 30_000], [100, 100, 64], [3, 5], [1_000_000, 2_000_000], False
    )
    assert back_src.tolist() == dst.tolist() and back_dst.tolist() == src.tolist()


def test_interleaved_runs_split_at_page_ends_and_merge_where_they_continue():
    # A TP=2 rank's half of each head group: runs of 30 bytes every 60, over pages of 45 bytes.
    runs = [(i * 30, 60 * i + 30, 30) for i in range(3)]
    plan = CopyPlan([45, 45], runs, 180)
    assert not plan.contiguous
    assert [(s.tensor, s.page_offset, s.object_offset, s.size) for s in plan.segments] == [
        (0, 0, 30, 30),
        (0, 30, 90, 15),
        (1, 0, 105, 15),
        (1, 15, 150, 30),
    ]
    assert sum(s.size for s in plan.segments) == plan.slice_bytes == 90
    merged = CopyPlan([20, 20], [(0, 0, 10), (10, 10, 30)], 40)
    assert merged.contiguous and merged.runs == [(0, 0, 40)]


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        ([(0, 0, 50)], "cover 50 bytes"),
        ([(10, 0, 100)], "tile the slice in order"),
        ([(0, 150, 100)], "ends past"),
        ([(0, 0, 60), (50, 60, 40)], "tile the slice in order"),
    ],
)
def test_runs_that_do_not_tile_the_slice_inside_the_object_are_refused(runs, message):
    with pytest.raises(PlanError, match=message):
        CopyPlan([50, 50], runs, 200)


def test_a_round_is_a_quarter_of_the_pool_or_about_64_mib():
    assert round_blocks(slot_count=16, object_bytes=1 << 20) == 4
    assert round_blocks(slot_count=4096, object_bytes=2 << 20) == 32
    assert round_blocks(slot_count=2, object_bytes=1 << 30) == 1


def test_every_layout_gives_block_major_rows_that_alias_the_cache():
    for model in (SMALL, SMALL_MLA):
        for layout in layouts_for(model):
            cache = paged_cache(model, layout, 5, BLOCK_TOKENS, CPU)
            assert cache.block_bytes == model.token_bytes(torch.bfloat16) * BLOCK_TOKENS, layout
            for row in cache.rows:
                assert row.shape[0] == 5 and row.is_contiguous()
            cache.rows[-1][4].fill_(7)
            storage_bytes = cache.storage[-1].view(torch.uint8).flatten()
            assert int((storage_bytes == 7).sum()) >= cache.rows[-1].shape[1], f"{layout}: rows copy the cache"


# ---- executors ------------------------------------------------------------------------------------


def test_the_driver_attribute_struct_matches_cuda_h():
    # CUmemcpyAttributes: srcAccessOrder (4), srcLocHint {type, id} (8), dstLocHint (8), flags (4).
    assert ctypes.sizeof(_MemcpyAttributes) == 24
    assert _MemcpyAttributes.dst_location_hint.offset == 12 and _MemcpyAttributes.flags.offset == 20


@pytest.mark.parametrize(
    "executor",
    [
        HostExecutor(),
        StagedExecutor(CPU, staging_bytes=3 * 1000),
        StagedExecutor(CPU, staging_bytes=3 * 1000, dma=HostExecutor()),
    ],
    ids=["host", "staged", "staged-batched-dma"],
)
def test_executors_pass_their_self_test_and_place_bytes_identically(executor, small_cache):
    self_test(executor, CPU, HostSide(CPU))
    page_bytes = [r.shape[1] for r in small_cache.rows]
    slice_bytes = sum(page_bytes)
    plan = CopyPlan(page_bytes, [(0, 8, slice_bytes)], slice_bytes + 16)
    pool = torch.zeros(10 * (slice_bytes + 16), dtype=torch.uint8)
    ids, offsets = [7, 2, 19, 11, 3], [o * (slice_bytes + 16) for o in (9, 0, 4, 5, 1)]
    executor.copy(CopyJob(plan, small_cache.rows, ids, offsets, pool, pool.data_ptr(), to_pool=True))
    for block, offset in zip(ids, offsets, strict=True):
        assert torch.equal(pool[offset + 8 : offset + 8 + slice_bytes], small_cache.block(block))
    restored = paged_cache(SMALL, "nhd", NUM_BLOCKS, BLOCK_TOKENS, CPU)
    fill_random(restored, seed=2)
    executor.copy(CopyJob(plan, restored.rows, [0, 1, 2, 3, 4], offsets, pool, pool.data_ptr(), to_pool=False))
    for new_id, block in enumerate(ids):
        assert torch.equal(restored.block(new_id), small_cache.block(block))
    assert not torch.equal(restored.block(5), small_cache.block(5)), "only the job's blocks were written"


def test_small_pages_are_copied_staged_first_and_large_pages_batched_first():
    # Only labels: nothing is constructed, so no GPU is needed.
    def labels(page_bytes: list[int], runs: list[tuple[int, int, int]], object_bytes: int) -> list[str]:
        return [label for label, _ in gpu_candidates(torch.device("cuda"), CopyPlan(page_bytes, runs, object_bytes))]

    mla_block16 = [18432] * 61
    assert labels(mla_block16, [(0, 0, sum(mla_block16))], sum(mla_block16))[:2] == [
        "staged index copies, batched DMA",
        "staged index copies",
    ]
    nhd_block64 = [256 << 10] * 32
    assert labels(nhd_block64, [(0, 0, sum(nhd_block64))], sum(nhd_block64))[0] == "cuMemcpyBatchAsync"
    interleaved = labels([16 << 10] * 2, [(0, 0, 16 << 10), (16 << 10, 32 << 10, 16 << 10)], 64 << 10)
    assert not any(label.startswith("staged") for label in interleaved), "staged copies need one range"


def test_a_wrong_executor_fails_its_self_test():
    class Shifted(HostExecutor):
        def copy(self, job: CopyJob) -> None:
            src, dst, sizes = job.pointers()
            for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
                ctypes.memmove(d, s + 1, n - 1)

    with pytest.raises(RuntimeError, match="wrong bytes"):
        self_test(Shifted(), CPU, HostSide(CPU))


def test_staged_copies_refuse_interleaved_placements():
    plan = CopyPlan([30, 30], [(0, 0, 30), (30, 60, 30)], 120)
    pool = torch.zeros(120, dtype=torch.uint8)
    rows = [torch.zeros((2, 30), dtype=torch.uint8)] * 2
    with pytest.raises(RuntimeError, match="contiguous plan"):
        StagedExecutor(CPU).copy(CopyJob(plan, rows, [0], [0], pool, pool.data_ptr(), True))
    assert isinstance(choose(CPU, plan, HostSide(CPU)), HostExecutor)


# ---- transfers against the real service -----------------------------------------------------------


def _round_trip(tmp_path: Path, model: ModelShape, layout: str) -> None:
    cache = paged_cache(model, layout, NUM_BLOCKS, BLOCK_TOKENS, CPU)
    fill_random(cache, seed=3)
    host = Host(tmp_path, cache.block_bytes)
    try:
        gpu_like = BlockTransfers(cache.rows)
        client = host.client()
        ids = [5, 17, 2, 9, 23, 0]
        keys = [key(i) for i in range(len(ids))]
        assert gpu_like.store(client, keys, ids) == [True] * len(ids)
        assert gpu_like.counters.stored_blocks == len(ids)
        # The service's own copy path (another engine, TP=1) reads exactly those bytes.
        other = np.zeros((len(ids), cache.block_bytes), dtype=np.uint8)
        assert host.client().load_blocks(keys, [other], list(range(len(ids)))) == [True] * len(ids)
        for row, block in enumerate(ids):
            assert np.array_equal(other[row], cache.block(block).numpy()), f"{layout}: block {block}"
        # Restored into other block ids of a fresh cache.
        restored = paged_cache(model, layout, NUM_BLOCKS, BLOCK_TOKENS, CPU)
        fill_random(restored, seed=4)
        targets = [1, 3, 4, 6, 7, 8]
        assert BlockTransfers(restored.rows).load(host.client(), keys, targets) == [True] * len(ids)
        for target, block in zip(targets, ids, strict=True):
            assert torch.equal(restored.block(target), cache.block(block)), f"{layout}: block {block}"
        # Stored already: nothing is copied again.
        assert gpu_like.store(client, keys[:2], ids[:2]) == [True, True]
        assert gpu_like.counters.stored_blocks == len(ids)
    finally:
        host.service.stop()


@pytest.mark.parametrize("layout", layouts_for(SMALL))
def test_store_and_restore_into_other_block_ids_in_every_layout(tmp_path, layout):
    _round_trip(tmp_path, SMALL, layout)


def test_store_and_restore_an_mla_cache(tmp_path):
    _round_trip(tmp_path, SMALL_MLA, "mla")


def test_a_load_runs_in_rounds_stops_at_the_first_miss_and_keeps_no_pins(tmp_path, small_cache):
    host = Host(tmp_path, small_cache.block_bytes, dram_bytes=16 * 8192)
    try:
        transfers = BlockTransfers(small_cache.rows)
        client = host.client()
        assert client.pool()["slot_count"] == 16, "rounds of 4 blocks"
        keys = [key(i) for i in range(11)]
        assert all(transfers.store(client, keys[:7] + keys[8:], list(range(7)) + list(range(8, 11))))
        restored = paged_cache(SMALL, "nhd", NUM_BLOCKS, BLOCK_TOKENS, CPU)
        loader = BlockTransfers(restored.rows)
        found = loader.load(client, keys, list(range(12, 23)))
        assert found == [True] * 7 + [False] * 4, "a hole ends the prefix"
        assert loader.counters.load_rounds == 2 and loader.counters.loaded_blocks == 7
        for i in range(7):
            assert torch.equal(restored.block(12 + i), small_cache.block(i))
        assert not torch.equal(restored.block(20), small_cache.block(8)), "nothing after the hole is copied"
        host.assert_nothing_pinned(client)
    finally:
        host.service.stop()


def test_a_store_larger_than_the_pool_commits_and_asks_again(tmp_path, small_cache):
    host = Host(tmp_path, small_cache.block_bytes, dram_bytes=8 * 8192)
    try:
        transfers = BlockTransfers(small_cache.rows)
        client = host.client()
        keys = [key(i) for i in range(20)]
        stored = transfers.store(client, keys, list(range(20)))
        assert sum(stored) >= 8, stored
        assert transfers.counters.stored_blocks == sum(stored)
        # What is still in the pool or on NVMe comes back right.
        restored = paged_cache(SMALL, "nhd", NUM_BLOCKS, BLOCK_TOKENS, CPU)
        found = BlockTransfers(restored.rows).load(host.client(), keys[-4:], [0, 1, 2, 3])
        for i, ok in enumerate(found):
            if ok:
                assert torch.equal(restored.block(i), small_cache.block(16 + i))
    finally:
        host.service.stop()


def test_a_store_that_never_gets_room_is_counted_as_a_dropped_store(tmp_path, small_cache):
    """Issue 24 item 7: a store given up after a round with no progress (the service kept answering
    "no room now") is counted in the service's ``dropped_stores``, like the drops it decides."""
    host = Host(tmp_path, small_cache.block_bytes, dram_bytes=8 * 8192)
    try:
        holder = host.client()
        assert holder.reserve_many([key(90)])[0][0] == "fill"
        others = _fill_the_write_backlog(host)
        dropped = holder.stats()["dropped_stores"]
        transfers = BlockTransfers(small_cache.rows)
        keys = [key(i) for i in range(3)]
        assert transfers.store(holder, keys, [0, 1, 2]) == [False] * 3
        assert holder.stats()["dropped_stores"] == dropped + 3
        del others
    finally:
        host.service.stop()


def _fill_the_write_backlog(host: Host) -> list[Any]:
    """Connections that reserve until the NVMe write backlog is full, each holding what it got: a
    connection holds at most half the pool in fills, so it may take several."""
    others: list[Any] = []
    while len(others) < 16:
        other = host.client()
        others.append(other)
        capped = other.stats()["service_capped_reserves"]
        kinds = [kind for kind, _ in other.reserve_many([key(100 + 16 * len(others) + i) for i in range(16)])]
        if "fill" not in kinds or other.stats()["service_capped_reserves"] - capped < kinds.count("retry"):
            return others  # "no room now" for the backlog, not only for the cap
    raise AssertionError("the write backlog never filled")


class FailingExecutor(HostExecutor):
    name = "failing"

    def __init__(self, fail_stores: bool, fail_loads: bool):
        self.fail_stores, self.fail_loads = fail_stores, fail_loads

    def copy(self, job: CopyJob) -> None:
        if (job.to_pool and self.fail_stores) or (not job.to_pool and self.fail_loads):
            raise RuntimeError("the copy engine reported an error")
        super().copy(job)


def test_a_store_whose_copy_fails_leaves_the_blocks_absent_and_fillable(tmp_path, small_cache):
    host = Host(tmp_path, small_cache.block_bytes)
    try:
        client = host.client()
        keys = [key(i) for i in range(4)]
        broken = BlockTransfers(small_cache.rows, executor=FailingExecutor(fail_stores=True, fail_loads=False))
        assert broken.store(client, keys, [0, 1, 2, 3]) == [False] * 4
        assert broken.counters.failed_copies == 1 and broken.counters.aborted_blocks == 4
        assert client.locate_many(keys) == [None] * 4
        working = BlockTransfers(small_cache.rows)
        assert working.store(client, keys, [0, 1, 2, 3]) == [True] * 4
        out = np.zeros((4, small_cache.block_bytes), dtype=np.uint8)
        assert host.client().load_blocks(keys, [out], [0, 1, 2, 3]) == [True] * 4
        assert np.array_equal(out[2], small_cache.block(2).numpy())
    finally:
        host.service.stop()


class FailsAfter(HostExecutor):
    """Copies ``good`` jobs, then raises."""

    name = "fails-after"

    def __init__(self, good: int):
        self.good = good

    def copy(self, job: CopyJob) -> None:
        if self.good == 0:
            raise RuntimeError("the copy engine reported an error")
        self.good -= 1
        super().copy(job)


def test_a_store_commits_chunk_by_chunk_and_aborts_the_chunks_behind_a_failed_copy(tmp_path, small_cache):
    host = Host(tmp_path, small_cache.block_bytes, dram_bytes=16 * 8192)
    try:
        client = host.client()
        assert round_blocks(client.pool()["slot_count"], client.pool()["object_bytes"]) == 4, "chunks of 4"
        keys = [key(i) for i in range(10)]
        broken = BlockTransfers(small_cache.rows, executor=FailsAfter(good=1))
        assert broken.store(client, keys, list(range(10))) == [True] * 4 + [False] * 6
        # The blocks the service asked for again (its write backlog) fail in a round of their own.
        assert broken.counters.stored_blocks == 4 and broken.counters.aborted_blocks == 6
        assert client.locate_many(keys[4:]) == [None] * 6, "the aborted chunks are absent"
        assert BlockTransfers(small_cache.rows).store(client, keys, list(range(10))) == [True] * 10
        out = np.zeros((10, small_cache.block_bytes), dtype=np.uint8)
        assert host.client().load_blocks(keys, [out], list(range(10))) == [True] * 10
        for i in range(10):
            assert np.array_equal(out[i], small_cache.block(i).numpy())
        host.assert_nothing_pinned(client)
    finally:
        host.service.stop()


def test_a_load_whose_copy_fails_is_a_miss_and_releases_its_pins(tmp_path, small_cache):
    host = Host(tmp_path, small_cache.block_bytes)
    try:
        client = host.client()
        keys = [key(i) for i in range(4)]
        assert BlockTransfers(small_cache.rows).store(client, keys, [0, 1, 2, 3]) == [True] * 4
        broken = BlockTransfers(small_cache.rows, executor=FailingExecutor(fail_stores=False, fail_loads=True))
        assert broken.load(client, keys, [10, 11, 12, 13]) == [False] * 4
        assert broken.counters.failed_copies == 1
        host.assert_nothing_pinned(client)
    finally:
        host.service.stop()


def test_a_dead_service_gives_misses_not_exceptions(tmp_path, small_cache):
    host = Host(tmp_path, small_cache.block_bytes)
    client = host.client()
    transfers = BlockTransfers(small_cache.rows)
    assert transfers.store(client, [key(0)], [0]) == [True]
    host.service.stop()
    assert transfers.store(client, [key(1)], [1]) == [False]
    assert transfers.load(client, [key(0)], [2]) == [False]
    assert transfers.counters.failed_calls >= 2
    assert transfers.store(None, [key(1)], [1]) == [False], "no client (reconnecting) is a miss"


def _canonical_runs(tp_size: int, rank: int, layers: int, head_bytes: int, heads: int) -> list[tuple[int, int, int]]:
    """Rank ``rank``'s heads of every layer inside a rank-independent object (layer-major, heads in order)."""
    per_rank = heads // tp_size
    runs = []
    for layer in range(layers):
        slice_offset = layer * per_rank * head_bytes
        object_offset = (layer * heads + rank * per_rank) * head_bytes
        runs.append((slice_offset, object_offset, per_rank * head_bytes))
    return runs


def test_two_ranks_with_interleaved_placements_build_one_object_a_tp1_engine_reads(tmp_path):
    layers, heads, head_bytes, blocks = 3, 4, 64, 6
    whole = torch.randint(0, 256, (blocks, layers, heads, head_bytes), dtype=torch.uint8)
    slice_bytes = layers * (heads // 2) * head_bytes
    host = Host(tmp_path, slice_bytes, tp_size=2)
    try:
        keys = [key(i) for i in range(blocks)]
        ranks = []
        for rank in range(2):
            # Each layer's page on this rank: its two heads of the block, contiguous.
            mine = whole[:, :, rank * 2 : rank * 2 + 2].contiguous()
            rows = [mine[:, layer].reshape(blocks, -1).contiguous() for layer in range(layers)]
            ranks.append((rows, host.client(rank, _canonical_runs(2, rank, layers, head_bytes, heads))))
        first = BlockTransfers(ranks[0][0])
        assert first.store(ranks[0][1], keys, list(range(blocks))) == [True] * blocks
        assert ranks[0][1].locate_many(keys) == [None] * blocks, "half an object is not a block"
        assert not first.executor.name.startswith("staged")  # type: ignore[union-attr]
        assert BlockTransfers(ranks[1][0]).store(ranks[1][1], keys, list(range(blocks))) == [True] * blocks
        reader = ServiceClient.connect(host.socket, 10_000)
        reader.hello(b"test-gpu-path", 2, 0, slice_bytes)
        # The whole object, both ranks' heads, through acquire: it is the TP=1 block.
        pool = reader.pool()
        offsets = reader.acquire_many(keys)
        base = (ctypes.c_uint8 * pool["bytes"]).from_address(pool["address"])
        for i, offset in enumerate(offsets):
            got = np.frombuffer(base, dtype=np.uint8, count=2 * slice_bytes, offset=offset)
            assert np.array_equal(got, whole[i].reshape(-1).numpy()), f"block {i}"
        reader.release_many(keys)
    finally:
        host.service.stop()


# ---- issue 27: what a desk review of the CUDA path found, shown on a CPU ---------------------------
# Fakes of the CUDA runtime below test kvtier's logic around it only; the CUDA calls themselves are
# validated by the GPU run alone (docs/gpu.md).


class RecordingSide(HostSide):
    """A host side that knows whether copies are being issued on its (side) stream."""

    def __init__(self) -> None:
        super().__init__(CPU)
        self.on_side_stream = False
        self.active = False

    @contextmanager
    def running(self, ready: Any) -> Iterator[None]:
        self.on_side_stream = True
        try:
            yield
        finally:
            self.on_side_stream = False


class SideStreamOnly(HostExecutor):
    """Like ``cuMemcpyBatchAsync``: copies issued on the legacy default stream are refused."""

    name = "side-stream-only"

    def __init__(self, side: RecordingSide):
        self.side = side

    def copy(self, job: CopyJob) -> None:
        if not self.side.on_side_stream:
            raise RuntimeError("CUDA_ERROR_INVALID_VALUE: the legacy default stream")
        super().copy(job)


def test_the_executor_self_test_runs_on_the_side_stream_so_the_batch_copy_is_chosen():
    side = RecordingSide()
    plan = CopyPlan([64], [(0, 0, 64)], 64)
    candidates: list[tuple[str, Callable[[], Any]]] = [
        ("batch", lambda: SideStreamOnly(side)),
        ("staged", lambda: StagedExecutor(CPU)),
    ]
    assert choose(CPU, plan, side, candidates).name == "side-stream-only"


def test_batch_copy_attributes_are_vllms_stream_order_for_stores_any_for_loads_no_flags():
    store, load = batch_attributes(to_pool=True), batch_attributes(to_pool=False)
    assert store.src_access_order == ACCESS_ORDER_STREAM == 1
    assert load.src_access_order == ACCESS_ORDER_ANY == 3
    for attributes in (store, load):
        assert attributes.flags == 0, "vLLM passes 0, not PREFER_OVERLAP_WITH_COMPUTE"
        assert attributes.src_location_hint.type == attributes.dst_location_hint.type == 0


class FakeRuntime:
    """cudaHostRegister's bookkeeping as the CUDA runtime keeps it: a range registered twice is
    refused (cudaErrorHostMemoryAlreadyRegistered), and a refusal sets the last error."""

    ALREADY_REGISTERED = 712

    def __init__(self, refuse: bool = False):
        self.refuse = refuse
        self.registered: dict[int, int] = {}
        self.register_calls = 0
        self.last_error = 0

    def host_register(self, address: int, nbytes: int, flags: int) -> int:
        self.register_calls += 1
        code = 1 if self.refuse else self.ALREADY_REGISTERED if address in self.registered else 0
        if code:
            self.last_error = code
        else:
            self.registered[address] = nbytes
        return code

    def host_unregister(self, address: int) -> int:
        return 0 if self.registered.pop(address, None) is not None else 713

    def get_last_error(self) -> int:
        code, self.last_error = self.last_error, 0
        return code


class PinningSide(RecordingSide):
    """A host side that registers the pool through a fake runtime, as ``CudaSide`` does through CUDA."""

    def __init__(self, runtime: FakeRuntime):
        super().__init__()
        self.runtime = runtime

    @contextmanager
    def activate(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def register(self, address: int, nbytes: int, align: int) -> Any:
        assert self.active, "pinned outside the KV cache's device context"
        return PinnedRange(address, nbytes, align, self.runtime)


def test_a_refused_registration_clears_the_runtime_error():
    runtime = FakeRuntime(refuse=True)
    pinned = PinnedRange(1 << 30, 1 << 20, 4096, runtime)
    assert not pinned.pinned and runtime.registered == {}
    assert runtime.last_error == 0, "left set, torch's next kernel launch check raises it as its own"


def test_transfers_on_one_client_share_one_registration_until_the_last_closes(tmp_path, small_cache):
    runtime = FakeRuntime()
    host = Host(tmp_path, small_cache.block_bytes)
    try:
        client = host.client()
        storer = BlockTransfers(small_cache.rows, side=PinningSide(runtime))
        loader = BlockTransfers(small_cache.rows, side=PinningSide(runtime))
        storer.bind(client)
        loader.bind(client)
        assert storer.pool_pinned and loader.pool_pinned, "the second registration of the pool was refused"
        assert runtime.register_calls == 1 and len(runtime.registered) == 1
        storer.close()
        assert runtime.registered and loader.pool_pinned, "unpinned under the other transfers"
        loader.close()
        assert runtime.registered == {} and runtime.last_error == 0
    finally:
        host.service.stop()


def test_the_benchmark_closes_its_registrations_after_the_ordering_check_and_a_failed_case(tmp_path, monkeypatch):
    from kvtier.bench import gpu as bench

    before = POOL_PINS.open_count()
    assert bench.ordering_check(CPU, tmp_path)["ok"]
    assert POOL_PINS.open_count() == before, "the ordering check left its pool registered"

    def broken_compare(*args: Any) -> int:
        raise RuntimeError("a case failed halfway")

    monkeypatch.setattr(bench, "compare", broken_compare)
    args = bench.build_parser().parse_args(
        ["--device", "cpu", "--job-mib", "1", "--repeats", "1", "--dir", str(tmp_path)]
    )
    with pytest.raises(RuntimeError, match="halfway"):
        bench.run_case(args, bench.SMALL_MODELS["small"], 16, "nhd", tmp_path)
    assert POOL_PINS.open_count() == before, "a failed case left its pool registered"


class QueueingSide(HostSide):
    """Copies queue as on a GPU stream and run only when a marker after them is waited on (or
    ``flush``: the DMA engine getting to them later)."""

    def __init__(self) -> None:
        super().__init__(CPU)
        self.queued: list[Callable[[], Any]] = []
        self.issued = self.ran = 0

    def done_marker(self) -> int:
        return self.issued

    def wait(self, marker: Any) -> None:
        while self.ran < marker:
            self.queued[self.ran]()
            self.ran += 1

    def flush(self) -> None:
        self.wait(self.issued)


class RaisesHalfway(HostExecutor):
    """Queues the first half of a job's copies on the side, then raises (a staged copy's second pass)."""

    name = "raises-halfway"

    def __init__(self, side: QueueingSide):
        self.side = side

    def copy(self, job: CopyJob) -> None:
        sources, destinations, sizes = job.pointers()
        for n, (s, d, size) in enumerate(zip(sources.tolist(), destinations.tolist(), sizes.tolist(), strict=True)):
            if n == len(sizes) // 2:
                raise RuntimeError("the copy failed halfway")
            self.side.queued.append(functools.partial(ctypes.memmove, d, s, size))
            self.side.issued += 1


def test_a_store_failing_halfway_hands_no_slot_back_while_its_copies_may_land(tmp_path, small_cache):
    host = Host(tmp_path, small_cache.block_bytes, dram_bytes=4 * 8192)
    try:
        client = host.client()
        slots = client.pool()["slot_count"]
        assert slots <= NUM_BLOCKS // 2, "the failed store takes every slot; the next store reuses them"
        side = QueueingSide()
        broken = BlockTransfers(small_cache.rows, executor=RaisesHalfway(side), side=side)
        assert broken.store(client, [key(i) for i in range(slots)], list(range(slots))) == [False] * slots
        other = paged_cache(SMALL, "nhd", NUM_BLOCKS, BLOCK_TOKENS, CPU)
        fill_random(other, seed=9)
        keys = [key(i, salt=1) for i in range(slots)]
        assert BlockTransfers(other.rows).store(client, keys, list(range(slots, 2 * slots))) == [True] * slots
        side.flush()  # whatever the failed store left queued lands now
        out = np.zeros((slots, small_cache.block_bytes), dtype=np.uint8)
        assert host.client().load_blocks(keys, [out], list(range(slots))) == [True] * slots
        for i in range(slots):
            assert np.array_equal(out[i], other.block(slots + i).numpy()), f"block {i} holds the failed store's bytes"
    finally:
        host.service.stop()


def test_a_load_failing_halfway_reports_its_misses_only_once_its_copies_landed(tmp_path, small_cache):
    host = Host(tmp_path, small_cache.block_bytes)
    try:
        client = host.client()
        keys = [key(i) for i in range(4)]
        assert BlockTransfers(small_cache.rows).store(client, keys, [0, 1, 2, 3]) == [True] * 4
        restored = paged_cache(SMALL, "nhd", NUM_BLOCKS, BLOCK_TOKENS, CPU)
        side = QueueingSide()
        broken = BlockTransfers(restored.rows, executor=RaisesHalfway(side), side=side)
        assert broken.load(client, keys, [10, 11, 12, 13]) == [False] * 4
        for row in restored.rows:  # vLLM recomputes the missed blocks into the same pages
            row[10:14].fill_(0x55)
        side.flush()
        for block in range(10, 14):
            assert bool((restored.block(block) == 0x55).all()), f"a late copy overwrote recomputed block {block}"
        host.assert_nothing_pinned(client)
    finally:
        host.service.stop()
