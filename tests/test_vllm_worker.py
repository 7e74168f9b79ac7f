"""The service worker and the manager's prefetcher against a real host service (no engine): loads
go first, stores are held back while a prefill step runs and go at once when vLLM fences them, a
full held-back backlog drops new stores (counted) instead of growing, and a lookup that finds a
block on NVMe answers HIT_PENDING while the service reads it into DRAM, then HIT.

The worker is driven the way vLLM's OffloadingConnector drives it (submit_store / submit_load with
vLLM's own specs, get_finished, wait), over numpy "layers" that stand in for the KV cache tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

try:
    from vllm.v1.kv_offload.base import (
        CacheHitSource,
        GPULoadStoreSpec,
        LookupResult,
        OffloadingEvent,
        OffloadKey,
        ReqContext,
        ScheduleEndContext,
        make_offload_key,
    )
except Exception as import_error:  # pragma: no cover - depends on the environment
    pytest.skip(f"vllm is not importable ({import_error!r}); run scripts/install_vllm.sh", allow_module_level=True)

import kvtier
from kvtier import service as kvtier_service
from kvtier import tenant_id
from kvtier.vllm import (
    GpuServiceWorker,
    JobQueueWorker,
    KvtierLoadStoreSpec,
    KvtierManager,
    KvtierOptions,
    KvtierVllmConfigError,
    Prefetcher,
    ServiceBackend,
    ServiceConnection,
    ServiceWorker,
    kvtier_key,
)
from processes import wait_stopped
from served import engine_counts

LAYERS = 2
PAGE_BYTES = 64 * 1024
ENGINE_BLOCKS = 16
HELD_BACK_S = 0.5  # long enough for a store that is not held back to finish many times over


def key(i: int) -> bytes:
    return hashlib.sha256(f"worker-{i}".encode()).digest()


def options_for(tmp_path: Path, nvme_bytes: int = 0, **store_options: object) -> KvtierOptions:
    return KvtierOptions.from_extra_config(
        {
            "path": str(tmp_path / "store"),
            "dram_bytes": 8 << 20,
            "nvme_bytes": nvme_bytes,
            "region_bytes": 1 << 20,
            "pool_dir": str(tmp_path),
            **store_options,
        }
    )


@pytest.fixture
def service(tmp_path: Path):
    options = options_for(tmp_path)
    yield options
    kvtier_service.stop_service(options.socket_path())


def layers(fill: int | None = None) -> list[np.ndarray]:
    if fill is None:
        rng = np.random.default_rng(7)
        return [rng.integers(0, 256, (ENGINE_BLOCKS, PAGE_BYTES), dtype=np.uint8) for _ in range(LAYERS)]
    return [np.full((ENGINE_BLOCKS, PAGE_BYTES), fill, dtype=np.uint8) for _ in range(LAYERS)]


def connection(options: KvtierOptions, label: str = "") -> ServiceConnection:
    return ServiceConnection(options, {"test": "worker"}, 1, 0, PAGE_BYTES * LAYERS, label=label)


def worker(options: KvtierOptions, kv: list[np.ndarray], label: str = "", **kwargs) -> ServiceWorker:
    return ServiceWorker(connection(options, label), kv, PAGE_BYTES, job_timeout_ms=10_000, **kwargs)


def engine_blocks(ids: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(ids, group_sizes=[len(ids)], block_indices=[0])


def finished(w: JobQueueWorker, job_id: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(result.job_id == job_id for result in w.get_finished()):
            return True
        time.sleep(0.01)
    return False


@dataclasses.dataclass
class WatchedLoad:
    """A load through a slow tier, watched as an engine's would be (`load_watched`)."""

    target: list[np.ndarray]
    worker: ServiceWorker  # shut down
    elapsed_s: float
    stats: dict  # the service's counters right after the load


def publish_and_stop(
    options: KvtierOptions,
    connection: ServiceConnection,
    data: list[np.ndarray],
    page_bytes: int,
    keys: KvtierLoadStoreSpec,
    blocks: GPULoadStoreSpec,
) -> None:
    """Node A of a two-node test: stores `data` through its host service, waits until it is on its
    tiers (published), then stops the service."""
    try:
        w = ServiceWorker(connection, data, page_bytes, job_timeout_ms=30_000)
        assert w.submit_store(1, blocks, keys) and finished(w, 1)
        w.shutdown()
        connection.flush()
    finally:
        kvtier_service.stop_service(options.socket_path())


def load_watched(
    connection: ServiceConnection,
    tier: str,
    keys: KvtierLoadStoreSpec,
    blocks: GPULoadStoreSpec,
    like: list[np.ndarray],
    page_bytes: int,
    stall_timeout_ms: int = 400,
) -> WatchedLoad:
    """Waits until the service locates every key in `tier`, then loads them into buffers shaped as
    `like` on KvtierConnector's route (a stalled load is failed) with this stall timeout."""
    deadline = time.monotonic() + 10
    while connection.locate_many(keys.keys) != [tier] * len(keys.keys):
        assert time.monotonic() < deadline, f"the published blocks never became visible in the {tier} tier"
        time.sleep(0.05)
    target = [np.zeros_like(layer) for layer in like]
    w = ServiceWorker(connection, target, page_bytes, job_timeout_ms=30_000, stall_timeout_ms=stall_timeout_ms)
    w.can_report_load_failures = True
    started = time.monotonic()
    assert w.submit_load(2, keys, blocks) and finished(w, 2, timeout_s=30)
    elapsed_s = time.monotonic() - started
    stats = connection.stats()
    w.shutdown()
    return WatchedLoad(target, w, elapsed_s, stats)


def test_stores_wait_for_the_prefill_step_and_loads_do_not(service):
    source = layers()
    w = worker(service, source)
    try:
        assert w.submit_store(1, engine_blocks([0, 1]), KvtierLoadStoreSpec([key(0), key(1)]))
        assert finished(w, 1), "a store with no step running goes at once"

        w.step_begins(prefill_tokens=2048)
        assert w.submit_store(2, engine_blocks([2, 3, 4]), KvtierLoadStoreSpec([key(2), key(3), key(4)]))
        # A load during the same prefill step is not held back, nor stuck behind the held store.
        assert w.submit_load(3, KvtierLoadStoreSpec([key(0), key(1)]), engine_blocks([8, 9]))
        assert finished(w, 3), "a load runs while stores are held back"
        for layer in source:
            assert np.array_equal(layer[8:10], layer[0:2]), "the load restored the stored bytes"
        assert not finished(w, 2, timeout_s=HELD_BACK_S), "a store waits while a prefill step runs"
        assert w.deferred_store_jobs == 1

        w.step_begins(prefill_tokens=0)  # a decode step: stores may run beside it
        assert finished(w, 2)
        w.step_ends()
    finally:
        w.shutdown()
    stats = kvtier_service.service_stats(service.socket_path())
    assert stats["puts"] == 5 and stats["dram_hits"] == 2


def test_steps_wake_the_job_thread_only_to_release_held_back_stores(service):
    # On a CPU engine every wakeup of the job thread takes a core and the GIL from the forward pass.
    w = worker(service, layers())
    try:
        assert w.submit_store(1, engine_blocks([0]), KvtierLoadStoreSpec([key(40)]))
        assert finished(w, 1)
        time.sleep(0.05)
        idle_wakeups = w.job_thread_wakeups
        for prefill_tokens in [2048, 0, 0, 512, 0] * 20:
            w.step_begins(prefill_tokens)
            w.step_ends()
            w.step_ends()  # vLLM's clear_connector_metadata ends a step again
        time.sleep(0.05)
        assert w.job_thread_wakeups == idle_wakeups, "steps with nothing held back woke the job thread"

        w.step_begins(prefill_tokens=2048)
        assert w.submit_store(2, engine_blocks([1]), KvtierLoadStoreSpec([key(41)]))
        assert not finished(w, 2, timeout_s=HELD_BACK_S)
        w.step_ends()
        assert finished(w, 2), "the end of the prefill step released the held-back store"
    finally:
        w.shutdown()


def test_a_fenced_store_goes_at_once_during_a_prefill_step(service):
    w = worker(service, layers())
    try:
        w.step_begins(prefill_tokens=512)
        assert w.submit_store(1, engine_blocks([0, 1]), KvtierLoadStoreSpec([key(10), key(11)]))
        started = time.monotonic()
        w.wait({1})  # vLLM is about to reuse blocks 0 and 1
        assert time.monotonic() - started < 5
        assert finished(w, 1, timeout_s=1)
        w.step_ends()
    finally:
        w.shutdown()


def test_a_store_held_back_longer_than_the_stall_timeout_is_stored_at_its_fence_not_given_up(service):
    """A store held back behind prefill steps (on a CPU engine one step of a 2K-token prompt takes
    seconds) had copied nothing since its submission, so vLLM's fence took it for stalled and gave it
    up at once: never stored, counted as a fallback, an error logged against a healthy service. Its
    stall clock now starts at the fence: it runs then."""
    w = worker(service, layers(), stall_timeout_ms=300)
    try:
        w.step_begins(prefill_tokens=4096)
        assert w.submit_store(1, engine_blocks([0, 1]), KvtierLoadStoreSpec([key(12), key(13)]))
        time.sleep(0.6)  # held back past the stall timeout
        w.wait({1})
        assert finished(w, 1, timeout_s=1)
        assert w.given_up_stores == 0, "a store held back by prefill steps was given up at its fence"
        w.step_ends()
    finally:
        w.shutdown()
    stats = kvtier_service.service_stats(service.socket_path())
    assert stats["puts"] == 2


def test_a_full_held_back_backlog_drops_new_stores_and_counts_them(service):
    w = worker(service, layers(), deferred_store_max_blocks=3)
    try:
        w.step_begins(prefill_tokens=4096)
        assert w.submit_store(1, engine_blocks([0, 1]), KvtierLoadStoreSpec([key(20), key(21)]))
        assert w.submit_store(2, engine_blocks([2, 3]), KvtierLoadStoreSpec([key(22), key(23)]))
        assert finished(w, 2, timeout_s=1), "the dropped job completes at once"
        assert w.dropped_store_blocks == 2
        w.step_ends()
        assert finished(w, 1), "the job held back before the backlog filled is stored"
    finally:
        w.shutdown()
    stats = kvtier_service.service_stats(service.socket_path())
    assert stats["puts"] == 2


def test_defer_stores_off_stores_during_prefill(service):
    w = worker(service, layers(), defer_stores=False)
    try:
        w.step_begins(prefill_tokens=4096)
        assert w.submit_store(1, engine_blocks([0]), KvtierLoadStoreSpec([key(30)]))
        assert finished(w, 1)
        assert w.deferred_store_jobs == 0
    finally:
        w.shutdown()


def test_a_lookup_prefetches_nvme_blocks_into_dram_and_answers_pending_meanwhile(tmp_path):
    options = options_for(tmp_path, nvme_bytes=16 << 20)
    offload_keys = [make_offload_key(hashlib.sha256(bytes([i])).digest(), 0) for i in range(4)]
    store_keys = [kvtier_key(k) for k in offload_keys]
    try:
        w = worker(options, layers())
        assert w.submit_store(1, engine_blocks([0, 1, 2, 3]), KvtierLoadStoreSpec(store_keys))
        assert finished(w, 1)
        w.shutdown()
        connection(options).flush()
        assert kvtier_service.stop_service(options.socket_path())
        # The next connection starts a new service, which finds the blocks on NVMe only.
        manager = KvtierManager(ServiceBackend(connection(options), Prefetcher(lambda: connection(options))))
        probe = connection(options)
        assert probe.locate_many(store_keys) == ["nvme"] * 4
        request = ReqContext(req_id="r1")
        assert [manager.lookup(k, request) for k in offload_keys[:2]] == [LookupResult.HIT_PENDING] * 2
        deadline = time.monotonic() + 10
        while manager.lookup(offload_keys[0], request) != LookupResult.HIT:
            assert time.monotonic() < deadline, "the prefetch never ended"
            time.sleep(0.02)
        assert manager.lookup(offload_keys[1], request) == LookupResult.HIT
        assert probe.locate_many(store_keys) == ["dram", "dram", "nvme", "nvme"]
        assert manager.get_load_source(offload_keys[0], request) == CacheHitSource.DISK, "the origin, not DRAM"
        manager.shutdown()
        probe.close()
    finally:
        kvtier_service.stop_service(options.socket_path())


def test_a_prefetch_of_blocks_gone_meanwhile_is_no_measure_of_their_tier(service):
    """The prefetcher times what a tier delivers from its reads into DRAM. A chunk whose blocks had
    left every tier by then answered at once and was recorded as the tier's rate: a few such made a
    slow link look fast to the load-or-recompute model. Only blocks read count now."""
    from kvtier.vllm.costs import TierRates

    prefetcher = Prefetcher(lambda: connection(service))
    prefetcher.rates = rates = TierRates()
    gone = [key(70 + i) for i in range(4)]  # located once, evicted since: nothing to read
    for store_key in gone:
        assert prefetcher.lookup(store_key, "bucket") is LookupResult.HIT_PENDING
    deadline = time.monotonic() + 10
    while any(prefetcher.origin(store_key) is None for store_key in gone) or prefetcher.in_flight(gone):
        assert time.monotonic() < deadline, "the prefetch never ended"
        time.sleep(0.02)
    assert rates.seconds_per_block("bucket") is None, "a tier timed by reads that never happened"
    assert prefetcher.prefetched_blocks == 0
    prefetcher.close()


def test_the_gpu_worker_moves_vllm_jobs_through_reserve_and_acquire(service):
    """GpuServiceWorker is the GPU rank's worker; its copies are kvtier.gpu's, which run on host
    tensors too. Driven by vLLM's calls, it stores and restores into other block ids, and what it
    stores is what the CPU worker (the service's own copy path) loads."""
    import torch

    from kvtier.gpu.transfers import rank_tensors

    source = layers()
    canonical = [torch.from_numpy(layer).view(torch.int8) for layer in source]  # vLLM's int8 rows
    w = GpuServiceWorker(connection(service), rank_tensors(canonical), job_timeout_ms=10_000)
    try:
        assert w.submit_store(1, engine_blocks([0, 1, 2]), KvtierLoadStoreSpec([key(40), key(41), key(42)]))
        w.wait({1})
        assert finished(w, 1)
        assert w.submit_load(
            2, KvtierLoadStoreSpec([key(40), key(41), key(42), key(49)]), engine_blocks([8, 9, 10, 11])
        )
        w.wait({2})
        for layer in source:
            assert np.array_equal(layer[8:11], layer[0:3]), "restored into other block ids"
        assert w.take_failed_load_block_ids() == set(), "a worker not told it may report failures keeps none"
        w.can_report_load_failures = True
        assert w.submit_load(3, KvtierLoadStoreSpec([key(49)]), engine_blocks([12]))
        w.wait({3})
        assert w.take_failed_load_block_ids() == {12}, "a missing block is reported for recompute"
        assert w.transfers.counters.stored_blocks == 3 and w.transfers.counters.loaded_blocks == 3
    finally:
        w.shutdown()
    cpu_side = layers(fill=0)
    reader = worker(service, cpu_side)
    try:
        assert reader.submit_load(4, KvtierLoadStoreSpec([key(40), key(41), key(42)]), engine_blocks([5, 6, 7]))
        reader.wait({4})
        for stored, loaded in zip(source, cpu_side, strict=True):
            assert np.array_equal(loaded[5:8], stored[0:3])
    finally:
        reader.shutdown()


def test_an_idle_gpu_worker_lets_go_of_a_killed_services_pool(service, tmp_path):
    """A GPU rank's transfers hold their service client (its pool mapping, pinned for DMA) between
    jobs: after the service was killed, an idle GPU engine kept the dead pool mapped until its next
    job, so the service started again could not take that pool over and allocated a new one beside
    it. The worker now lets go of it on its job thread as soon as the connection notices the
    hang-up. kvtier.gpu's transfers run on host tensors too: the same code as on a GPU."""
    import torch

    from kvtier.gpu.transfers import rank_tensors

    source = layers()
    canonical = [torch.from_numpy(layer).view(torch.int8) for layer in source]
    w = GpuServiceWorker(connection(service), rank_tensors(canonical), job_timeout_ms=10_000)
    try:
        assert w.submit_store(1, engine_blocks([0]), KvtierLoadStoreSpec([key(110)])) and finished(w, 1)
        [pool] = [p for p in tmp_path.iterdir() if p.suffix == ".pool"]
        assert str(pool) in Path("/proc/self/maps").read_text()
        pid = kvtier_service.service_pid(service.socket_path())
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while str(pool) in Path("/proc/self/maps").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert str(pool) not in Path("/proc/self/maps").read_text(), "the idle GPU worker kept the dead pool mapped"
        assert w.submit_store(2, engine_blocks([1]), KvtierLoadStoreSpec([key(111)])) and finished(w, 2)
    finally:
        w.shutdown()


def test_second_sight_admission_stores_a_block_the_second_time_it_is_computed(service):
    manager = KvtierManager(ServiceBackend(connection(service)), admission="second_sight", admission_memory_blocks=2)
    request = ReqContext(req_id="r1")
    keys = [make_offload_key(hashlib.sha256(bytes([40 + i])).digest(), 0) for i in range(3)]
    first = manager.prepare_store(keys[:2], request)
    assert first is not None and first.keys_to_store == [], "seen once: not stored"
    second = manager.prepare_store(keys[:2], request)
    assert second is not None and second.keys_to_store == keys[:2], "seen twice: stored"
    manager.complete_store(keys[:2], request, success=False)  # (no worker here stored them)
    # The memory is bounded: with room for two keys, the oldest of three is forgotten.
    for key in keys:
        manager.prepare_store([key], request)
    assert manager.prepare_store([keys[0]], request).keys_to_store == []  # type: ignore[union-attr]
    assert manager.not_admitted_blocks == 2 + 3 + 1
    manager.shutdown()


def test_a_request_that_says_it_comes_back_has_its_blocks_written_below_dram_at_once(tmp_path):
    """``write_admission: "reuse"``: a request whose ``kv_transfer_params`` carry kvtier's retention
    hint has the blocks it stores written to NVMe at their first store (the manager tells the service
    before the worker stores); an unhinted request's wait in DRAM for evidence, as before. With
    ``admission: "second_sight"`` a hinted request's blocks are stored at first sight too."""
    options = options_for(tmp_path, nvme_bytes=16 << 20, write_admission="reuse")
    try:
        manager = KvtierManager(ServiceBackend(connection(options)), admission="second_sight")
        hinted = ReqContext(req_id="doc", kv_transfer_params={"kvtier": {"retain": True}})
        plain = ReqContext(req_id="one-off")
        keys = [make_offload_key(hashlib.sha256(bytes([80 + i])).digest(), 0) for i in range(4)]
        assert manager.prepare_store(keys[2:], plain).keys_to_store == [], "second sight: not at first"  # type: ignore[union-attr]
        planned = [manager.prepare_store(keys[:2], hinted), manager.prepare_store(keys[2:], plain)]
        assert [p.keys_to_store for p in planned if p is not None] == [keys[:2], keys[2:]], "hinted: at once"
        store_two_by_two(options, planned)
        stats = connection(options).stats()
        assert stats["retained_by_hint"] == 2
        assert stats["bytes_written_nvme"] == 2 * (PAGE_BYTES * LAYERS + 4096), "the hinted two, at once"
        assert stats["writes_awaiting_reuse"] == 2, "the unhinted blocks wait in DRAM for evidence"
        manager.shutdown()
    finally:
        kvtier_service.stop_service(options.socket_path())


def store_two_by_two(options: KvtierOptions, planned: list[Any]) -> None:
    """A worker stores the planned blocks, two per job, from engine blocks 0, 1, 2, ..."""
    w = worker(options, layers())
    try:
        for job, plan in enumerate(planned):
            assert plan is not None and len(plan.keys_to_store) == 2, plan
            assert w.submit_store(job, engine_blocks([2 * job, 2 * job + 1]), plan.store_spec)
            assert finished(w, job)
    finally:
        w.shutdown()


def test_a_hint_of_a_prompts_first_tokens_retains_only_the_blocks_that_end_within_them(tmp_path):
    """``"retain": N``: of a request's blocks, those that end within its first N tokens (by the end
    position vLLM's scheduler records per key) are written below DRAM at once and stored at first
    sight under ``second_sight``; the request's later blocks (a unique question, the answer) wait for
    evidence like an unhinted request's."""
    options = options_for(tmp_path, nvme_bytes=16 << 20, write_admission="reuse")
    try:
        manager = KvtierManager(ServiceBackend(connection(options)), admission="second_sight")
        request = ReqContext(req_id="doc-and-question", kv_transfer_params={"kvtier": {"retain": 40}})
        keys = [make_offload_key(hashlib.sha256(bytes([90 + i])).digest(), 0) for i in range(4)]
        for index, key in enumerate(keys):
            request.set_offload_key_position(key, 16 * (index + 1))  # 16-token blocks: ends 16, 32, 48, 64
        first = manager.prepare_store(keys, request)
        assert first is not None and first.keys_to_store == keys[:2], "ends 16 and 32 within 40: at first sight"
        second = manager.prepare_store(keys[2:], request)
        assert second is not None and second.keys_to_store == keys[2:], "the tail: at its second sight"
        store_two_by_two(options, [first, second])
        stats = connection(options).stats()
        assert stats["retained_by_hint"] == 2, "only the blocks within the first 40 tokens"
        assert stats["bytes_written_nvme"] == 2 * (PAGE_BYTES * LAYERS + 4096), "the two retained, at once"
        assert stats["writes_awaiting_reuse"] == 2, "the tail waits in DRAM for evidence"
        manager.shutdown()
    finally:
        kvtier_service.stop_service(options.socket_path())


def trim_unpinned(options: KvtierOptions) -> int:
    """Removes every block nothing pins (``kvtier trim --to 0`` does so): how many were skipped as pinned."""
    client = kvtier_service.connect(options.socket_path())
    (namespace,) = client.namespaces()["namespaces"]
    return int(dict(client.trim(namespace["digest"], "all", 0))["skipped_in_use"])


def store_one_block(w: ServiceWorker, name: bytes) -> OffloadKey:
    """The worker stores engine block 0 as the block named ``name``: vLLM's key of it."""
    offload_key = make_offload_key(hashlib.sha256(name).digest(), 0)
    assert w.submit_store(1, engine_blocks([0]), KvtierLoadStoreSpec([kvtier_key(offload_key)])) and finished(w, 1)
    return offload_key


def test_pins_are_taken_again_when_the_scheduler_reattaches(tmp_path):
    """Pins live as long as the client that took them. A scheduler call that fails (a service stopped
    for longer than the call's deadline) lets go of that client and the service released the pins
    with it; the connection then reattached, and the manager believed it still held them: a block
    promised to a load could be evicted before it ran (under vLLM's plain OffloadingConnector a
    missed load stops the engine), and a request's complete_load unpinned the pin another request
    had taken on the new client. Now the manager takes its pins again at its next call."""
    options = options_for(tmp_path)
    scheduler = connection(options)
    manager = KvtierManager(ServiceBackend(scheduler))
    w = worker(options, layers())
    try:
        promised = store_one_block(w, b"promised")
        block = kvtier_key(promised)
        first, second = ReqContext(req_id="first"), ReqContext(req_id="second")
        manager.prepare_load([promised], first)  # pinned: vLLM will load it
        scheduler._drop_dead(scheduler._client)  # as a call that timed out does; the service lets the pins go
        assert scheduler.wait_attached(10), "the scheduler's connection did not reattach"
        manager.prepare_load([], ReqContext(req_id="next"))  # the manager's next call
        assert trim_unpinned(options) == 1, "the promised block lost its pin at the reattach"
        assert scheduler.locate_many([block]) == ["dram"]
        manager.prepare_load([promised], second)
        manager.complete_load([promised], first)  # must release the first request's pin only
        assert trim_unpinned(options) == 1, "the first request released the second's pin"
        manager.complete_load([promised], second)
        assert trim_unpinned(options) == 0 and scheduler.locate_many([block]) == [None], "unpinned once both loaded"
        assert manager.pins_lost_at_reattach == 0
    finally:
        w.shutdown()
        manager.shutdown()
        kvtier_service.stop_service(options.socket_path())


def test_under_the_plain_connector_a_block_a_lookup_offers_is_pinned_until_its_load_or_the_steps_end(tmp_path):
    """Issue 36: under vLLM's plain OffloadingConnector a block offered as a hit was pinned only at
    prepare_load, later in the scheduler's step: another engine's store that evicted it in between
    failed the load, and vLLM's assert stopped the engine. The lookup pins it now, with the request's
    later blocks located on the host; the load takes the pins over, and what no load took (a block vLLM
    did not load, a request it did not schedule) is let go by the load or at the step's end."""
    options = options_for(tmp_path)
    scheduler = connection(options)
    manager = KvtierManager(ServiceBackend(scheduler))  # the plain route: failed loads are not recomputed
    w = worker(options, layers())
    try:
        offload_keys = [make_offload_key(hashlib.sha256(bytes([i])).digest(), 0) for i in range(5)]
        blocks = [kvtier_key(k) for k in offload_keys]
        stored = [blocks[i] for i in (0, 1, 2, 4)]  # the fourth is missing: vLLM's pass stops there
        assert w.submit_store(1, engine_blocks([0, 1, 2, 3]), KvtierLoadStoreSpec(stored)) and finished(w, 1)
        waiting, loaded = ReqContext(req_id="waiting"), ReqContext(req_id="loaded")
        for at, key in enumerate(offload_keys):
            loaded.set_offload_key_position(key, (at + 1) * 16)
        assert manager.lookup(offload_keys[0], waiting) == LookupResult.HIT
        hits = [LookupResult.HIT] * 3 + [LookupResult.MISS]
        assert [manager.lookup(k, loaded) for k in offload_keys[:4]] == hits
        # Another engine's store evicts every block nothing pins (as `kvtier trim --to 0` removes them):
        # the three offered stay, the one past the miss goes.
        assert trim_unpinned(options) == 3, "a block offered to a load could be evicted before it"
        assert scheduler.locate_many(blocks[3:]) == [None, None], "a block past the pass's miss was pinned"
        manager.prepare_load(offload_keys[:2], loaded)  # vLLM loads two of them
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        assert trim_unpinned(options) == 2, "the load's two blocks stay pinned, and only they"
        assert scheduler.locate_many(blocks[:3]) == ["dram", "dram", None]
        manager.complete_load(offload_keys[:2], loaded)
        assert trim_unpinned(options) == 0, "the load released its pins"
        assert manager.pins_lost_at_reattach == 0
    finally:
        w.shutdown()
        manager.shutdown()
        kvtier_service.stop_service(options.socket_path())


def assert_no_pin_left(manager: KvtierManager, options: KvtierOptions) -> None:
    """After the manager's next call (which takes lost pins again), every pin was released once."""
    manager.prepare_load([], ReqContext(req_id="next"))
    assert trim_unpinned(options) == 0, "a pin was taken twice and released once"
    assert manager.pins_lost_at_reattach == 0


def test_pins_taken_during_a_reattach_are_neither_lost_nor_doubled(tmp_path, monkeypatch):
    """A reattach that comes while a pin call is in flight puts that call's pins on the new client.
    The manager took its other pins again only at its next call, and then took these a second time:
    a block promised to a load was evictable meanwhile, and one pin of the new block was never
    released. The pins of the old client are now taken again as soon as the call returns."""
    options = options_for(tmp_path)
    scheduler = connection(options)
    manager = KvtierManager(ServiceBackend(scheduler))
    w = worker(options, layers())
    try:
        offload_keys = [make_offload_key(hashlib.sha256(bytes([50 + i])).digest(), 0) for i in range(2)]
        blocks = [kvtier_key(k) for k in offload_keys]
        assert w.submit_store(1, engine_blocks([0, 1]), KvtierLoadStoreSpec(blocks)) and finished(w, 1)
        first, second = ReqContext(req_id="first"), ReqContext(req_id="second")
        manager.prepare_load(offload_keys[:1], first)  # pinned on the first client
        pin_many_served = scheduler.pin_many_served

        def reattach_then_pin(keys: list[bytes]) -> tuple[list[bool], int | None]:
            monkeypatch.setattr(scheduler, "pin_many_served", pin_many_served)  # once
            scheduler._drop_dead(scheduler._client)  # as a call that timed out does; its pins go
            assert scheduler.wait_attached(10), "the scheduler's connection did not reattach"
            return pin_many_served(keys)

        monkeypatch.setattr(scheduler, "pin_many_served", reattach_then_pin)
        manager.prepare_load(offload_keys[1:], second)
        assert trim_unpinned(options) == 2, "the first request's block lost its pin at the reattach"
        manager.complete_load(offload_keys[:1], first)
        manager.complete_load(offload_keys[1:], second)
        assert_no_pin_left(manager, options)
    finally:
        w.shutdown()
        manager.shutdown()
        kvtier_service.stop_service(options.socket_path())


def test_pins_a_client_took_just_before_it_was_let_go_are_taken_again(tmp_path, monkeypatch):
    """Another thread's failed call (the prefetcher's, the event feed's) can let the client go, and
    a new one attach, between a pin call's answer and the manager recording its pins: they went with
    the old client, yet the manager counted them as held, and the block promised to a load was
    evictable (under vLLM's plain OffloadingConnector a missed load stops the engine). The manager
    now checks which client took them, and takes them again on the new one."""
    options = options_for(tmp_path)
    scheduler = connection(options)
    manager = KvtierManager(ServiceBackend(scheduler))
    w = worker(options, layers())
    try:
        promised = store_one_block(w, b"let go")
        live_client = scheduler.live_client

        class LetGoAfterItsPin:
            def __init__(self, client: Any) -> None:
                self.client = client

            def __getattr__(self, name: str) -> Any:
                return getattr(self.client, name)

            def pin_many(self, keys: list[bytes]) -> list[bool]:
                monkeypatch.setattr(scheduler, "live_client", live_client)  # once
                flags = self.client.pin_many(keys)
                self.client.unpin_many(keys)  # what the service does with a client gone
                scheduler._drop_dead(self.client)  # another thread's call to the frozen service timed out
                assert scheduler.wait_attached(10), "the scheduler's connection did not reattach"
                return flags

        monkeypatch.setattr(scheduler, "live_client", lambda reconnect=True: LetGoAfterItsPin(live_client(reconnect)))
        request = ReqContext(req_id="promised")
        manager.prepare_load([promised], request)
        assert trim_unpinned(options) == 1, "a pin the client let go took was counted as held"
        manager.complete_load([promised], request)
        assert_no_pin_left(manager, options)
    finally:
        w.shutdown()
        manager.shutdown()
        kvtier_service.stop_service(options.socket_path())


def store_as_a_salted_request(options: KvtierOptions) -> KvtierManager:
    """A request salted "team-a" stores three blocks: the manager plans them, a worker stores them."""
    manager = KvtierManager(ServiceBackend(connection(options)))
    request = ReqContext(req_id="salted")
    manager.note_cache_salt("salted", "team-a")
    offload_keys = [make_offload_key(hashlib.sha256(bytes([60 + i])).digest(), 0) for i in range(3)]
    planned = manager.prepare_store(offload_keys, request)
    assert planned is not None and planned.keys_to_store == offload_keys
    w = worker(options, layers())
    assert w.submit_store(1, engine_blocks([0, 1, 2]), planned.store_spec)
    assert finished(w, 1)
    w.shutdown()
    manager.complete_store(offload_keys, request)
    manager.on_request_finished(request)
    assert manager._tenants == {}, "a finished request's tenant is forgotten"
    return manager


def test_a_salted_requests_stores_are_charged_to_its_tenant(tmp_path):
    """KvtierConnector tells the manager a request's cache_salt; the manager names the tenant of the
    blocks it plans to store, before the worker's store claims their slots (docs/tenants.md)."""
    extra = {"path": str(tmp_path / "store"), "dram_bytes": 8 << 20, "nvme_bytes": 0, "pool_dir": str(tmp_path)}
    options = KvtierOptions.from_extra_config({**extra, "tenant_dram_share": 0.3})
    try:
        manager = store_as_a_salted_request(options)
        stats = connection(options).stats()
        label = tenant_id("team-a")[:8].hex()
        slot_bytes = stats["dram_used_bytes"] // stats["blocks_dram"]
        assert stats[f"tenant_dram_bytes:{label}"] == 3 * slot_bytes
        assert stats["tenant_dram_bytes:default"] == 0
        manager.shutdown()
    finally:
        kvtier_service.stop_service(options.socket_path())


def test_a_salted_requests_stores_are_sealed_under_its_tenants_key(tmp_path):
    """With encryption_key_file and no split pool, the manager still names the tenant, and every
    copy written to NVMe names it in its encryption header (sealed under its key; docs/tenants.md)."""
    key_file = tmp_path / "kvtier.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    store_dir = tmp_path / "store"
    extra = {
        "path": str(store_dir),
        "dram_bytes": 8 << 20,
        "nvme_bytes": 8 << 20,
        "region_bytes": 1 << 20,
        "pool_dir": str(tmp_path),
    }
    options = KvtierOptions.from_extra_config({**extra, "encryption_key_file": str(key_file)})
    try:
        manager = store_as_a_salted_request(options)
        assert connection(options).stats()["tenant_keys"] == 1
        manager.shutdown()
    finally:
        kvtier_service.stop_service(options.socket_path())
    device = b"".join(path.read_bytes() for path in store_dir.rglob("*.kvt"))
    assert device.count(tenant_id("team-a")) == 3, "each of the three blocks names team-a in its header"


def test_admission_options_are_checked():
    with pytest.raises(KvtierVllmConfigError, match="admission"):
        KvtierOptions.from_extra_config({"path": "/tmp/x", "admission": "sometimes"})
    with pytest.raises(KvtierVllmConfigError, match="admission_memory_blocks"):
        KvtierOptions.from_extra_config({"path": "/tmp/x", "admission_memory_blocks": 0})


def test_config_info_fills_every_label_the_spec_declares_and_no_secret(service):
    from kvtier.vllm import KvtierConnector, KvtierOffloadingSpec

    extra = {"path": "/tmp/kvtier-info", "dram_bytes": 64 << 20, "shared_root": "/mnt/s", "shared_key_file": "/k"}
    options = KvtierOptions.from_extra_config(extra)
    manager = KvtierManager(ServiceBackend(connection(service)), config_info=options.config_info())
    (info,) = manager.config_info()
    assert tuple(info) == KvtierOffloadingSpec.config_info_keys(extra)
    assert info["kvtier_dram_bytes"] == 64 << 20 and info["kvtier_shared_tier"] is True
    assert info["kvtier_store_path"] == "/tmp/kvtier-info" and info["kvtier_host_service"] is True
    assert info["kvtier_nvme_bytes"] == next(row["default"] for row in kvtier.options() if row["name"] == "nvme_bytes")
    assert "/k" not in {str(value) for value in info.values()}
    assert KvtierConnector.supports_sleep_mode(None) is False
    manager.shutdown()


def test_sleep_mode_is_refused_with_the_fix():
    from types import SimpleNamespace

    from kvtier.vllm.spec import refuse_sleep_mode

    refuse_sleep_mode(SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=False)))
    with pytest.raises(KvtierVllmConfigError, match="without enable_sleep_mode"):
        refuse_sleep_mode(SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=True)))


def test_host_dram_bytes_reaches_a_service_the_engine_starts_and_caps_the_pools(tmp_path):
    options = KvtierOptions.from_extra_config(
        {
            "path": str(tmp_path / "store"),
            "dram_bytes": 8 << 20,
            "nvme_bytes": 0,
            "pool_dir": str(tmp_path),
            "host_dram_bytes": 12 << 20,
        }
    )
    assert options.service_options()["host_dram_bytes"] == 12 << 20
    socket = kvtier_service.ensure_service(
        options.path, options.service_options(), socket_path=options.socket_path(), pool_dir=options.pool_dir
    )
    try:
        pools = []
        for model in (b"model-one", b"model-two"):
            client = kvtier_service.connect(socket)
            pools.append(client.hello(model, 1, 0, PAGE_BYTES * LAYERS)["pool_bytes"])
        assert pools[1] < pools[0] <= 8 << 20, pools
        assert sum(pools) <= 12 << 20
        with pytest.raises(Exception, match="host_dram_bytes"):
            kvtier_service.connect(socket).hello(b"model-three", 1, 0, PAGE_BYTES * LAYERS)
    finally:
        kvtier_service.stop_service(socket)


def test_a_completed_store_that_never_landed_is_released_and_one_that_landed_is_stored(service):
    """vLLM 0.33 keeps a stored block's tokens (self-describing events) until a removal; a store
    that never reached kvtier must free them without telling routers anything."""
    from kvtier.vllm.events import SETTLE_AFTER_S, EventFeed, direct_offload_key

    w = worker(service, layers())
    feed = EventFeed(lambda: connection(service), direct_offload_key(0), poll_interval_s=3600)
    follower = connection(service)
    try:
        assert w.submit_store(1, engine_blocks([0, 1]), KvtierLoadStoreSpec([key(40), key(41)]))
        assert finished(w, 1)
        # vLLM completes the store job; key(42)'s copy never landed (dropped, refused or failed).
        feed.expect_stored([key(40), key(41), key(42)])
        feed.poll_once(follower)
        assert feed.unlanded_store_blocks == 0, "settled only on a log refreshed after the completion"
        time.sleep(SETTLE_AFTER_S)
        feed.poll_once(follower)
        assert feed.unlanded_store_blocks == 1
        events = feed.take()
        stored = [k for e in events if not e.removed for k in e.keys]
        assert sorted(stored) == sorted(make_offload_key(k, 0) for k in (key(40), key(41)))
        released = [e for e in events if e.removed]
        if "metadata_only" in {f.name for f in dataclasses.fields(OffloadingEvent)}:  # vLLM 0.33
            assert [e.keys for e in released] == [[make_offload_key(key(42), 0)]]
            assert all(vars(e)["metadata_only"] for e in released)
            assert all(vars(e)["removal_expected"] for e in events if not e.removed)
        else:  # vLLM 0.32 keeps no snapshot: nothing to release, no removal reaches routers
            assert released == []
        feed.poll_once(follower)
        assert feed.unlanded_store_blocks == 1, "each completed store is settled once"
        assert feed.take() == []

        # vLLM's cache reset (reset_connector) publishes AllBlocksCleared: kvtier restates its blocks.
        feed.restate()
        feed.poll_once(follower)
        restated = [k for e in feed.take() if not e.removed for k in e.keys]
        assert sorted(restated) == sorted(stored)
    finally:
        feed.close()
        follower.close()
        w.shutdown()


def test_spare_cores_are_the_reserved_ones_under_vllms_binding_and_none_under_the_users():
    from kvtier.vllm.cores import spare_cores

    host = {0, 1, 2, 3}
    assert spare_cores({1, 2, 3}, host, "auto") == {0}  # VLLM_CPU_NUM_OF_RESERVED_CPU kept core 0 back
    assert spare_cores({1, 2, 3}, host, "") == {0}
    assert spare_cores({0, 1}, host, "0-1") == set()  # a partitioned host: 2-3 are another engine's
    assert spare_cores({0, 1}, host, "0,1|2,3") == set()
    assert spare_cores(set(), host, "auto") == set()  # unknown binding: leave the thread as it is


@contextlib.contextmanager
def frozen(socket_path: Path):
    """The host service stopped (SIGSTOP) for the block: it accepts connections, answers nothing."""
    pid = kvtier_service.service_pid(socket_path)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    wait_stopped(pid)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_frozen_service_costs_a_fence_or_a_load_one_stall_timeout_and_nothing_lands_late(service):
    """Issue 36: a fence on a store stuck in a frozen service returned only after job_timeout_ms
    (then raised, and the engine stopped). Now a job that copies nothing for the stall timeout is
    given up through its gate: the fence returns; jobs submitted while the job thread is still stuck
    are answered at once (a store not stored, a load failed and recomputed), and when the service
    answers again the late replies copy nothing into pages vLLM has reused."""
    source = layers()
    w = ServiceWorker(connection(service), source, PAGE_BYTES, job_timeout_ms=30_000, stall_timeout_ms=1_000)
    w.can_report_load_failures = True  # KvtierConnector's route
    try:
        assert w.submit_store(1, engine_blocks([0, 1]), KvtierLoadStoreSpec([key(60), key(61)])) and finished(w, 1)
        with frozen(service.socket_path()):
            assert w.submit_store(2, engine_blocks([2, 3]), KvtierLoadStoreSpec([key(62), key(63)]))
            assert w.submit_store(6, engine_blocks([6, 7]), KvtierLoadStoreSpec([key(66), key(67)]))
            started = time.monotonic()
            w.wait({2})  # vLLM fences the store before it reuses blocks 2 and 3
            assert time.monotonic() - started < 3, "the fence waited past the stall timeout"
            # Store 6, queued behind the stuck call and never fenced, is given up by the watchdog:
            # vLLM holds a storing request's engine blocks until its store finishes.
            reported: set[int] = set()
            while {2, 6} - reported and time.monotonic() - started < 3:
                reported |= {result.job_id for result in w.get_finished()}
                time.sleep(0.01)
            assert reported == {2, 6} and w.given_up_stores == 2
            for layer in source:
                layer[2:4] = 0xAA  # vLLM reuses the blocks at once
            # The job thread is still stuck in the store's call: later jobs are answered at once,
            # not queued behind it (each would cost its fence or load another stall timeout).
            started = time.monotonic()
            assert w.submit_store(5, engine_blocks([4, 5]), KvtierLoadStoreSpec([key(64), key(65)]))
            w.wait({5})
            assert w.submit_load(3, KvtierLoadStoreSpec([key(60), key(61)]), engine_blocks([8, 9]))
            assert finished(w, 3, timeout_s=0.5) and time.monotonic() - started < 0.5
            assert (w.skipped_store_blocks, w.skipped_loads, w.given_up_stores) == (2, 1, 2)
            assert w.take_failed_load_block_ids() == {8, 9}, "a skipped load is recomputed"
            for layer in source:
                layer[8:10] = 0x55  # vLLM recomputes into them
        time.sleep(1.0)  # the stuck calls come back late
        assert all((layer[8:10] == 0x55).all() for layer in source), "a late load copied into recomputed pages"
        probe = connection(service)
        assert probe.locate_many([key(62), key(63)]) == [None, None], "a given-up store was committed late"
        assert probe.locate_many([key(64), key(65)]) == [None, None], "a skipped store was stored"
        assert probe.locate_many([key(66), key(67)]) == [None, None], "a given-up store was stored late"
        # The worker kept its connection: the next load works.
        assert w.submit_load(4, KvtierLoadStoreSpec([key(60), key(61)]), engine_blocks([10, 11])) and finished(w, 4)
        assert all(np.array_equal(layer[10:12], layer[0:2]) for layer in source)
        probe.close()
    finally:
        w.shutdown()


def test_a_load_queued_behind_a_slow_load_that_progresses_waits_its_turn(service, monkeypatch):
    """Issue 36, 200 MB/s under load: the worker's job thread runs one transfer at a time, and the
    watchdog gave up any pending load that had copied nothing for the stall timeout, including
    loads merely queued behind a slow load that was copying: they were recomputed while the tier
    delivered. A queued load now counts as stalled only while the transfer ahead of it is stuck."""
    source = layers()
    w = ServiceWorker(connection(service), source, PAGE_BYTES, job_timeout_ms=30_000, stall_timeout_ms=400)
    w.can_report_load_failures = True  # KvtierConnector's route: a stalled load would be failed
    real_load = w.transport.load

    def slow_first_load(job, keys, engine_idle):
        if job.vllm_job_id != 2:
            return real_load(job, keys, engine_idle)
        for _ in range(6):  # copies a round every 0.25 s for 1.5 s: slow, never stalled
            found = real_load(job, keys, engine_idle)
            time.sleep(0.25)
        return found

    monkeypatch.setattr(w.transport, "load", slow_first_load)
    try:
        assert w.submit_store(1, engine_blocks([0, 1, 2, 3]), KvtierLoadStoreSpec([key(i) for i in range(80, 84)]))
        assert finished(w, 1)
        assert w.submit_load(2, KvtierLoadStoreSpec([key(80), key(81)]), engine_blocks([8, 9]))
        time.sleep(0.05)  # the job thread is in load 2
        assert w.submit_load(3, KvtierLoadStoreSpec([key(82), key(83)]), engine_blocks([10, 11]))
        reported: set[int] = set()
        deadline = time.monotonic() + 10
        while {2, 3} - reported and time.monotonic() < deadline:
            reported |= {result.job_id for result in w.get_finished()}
            time.sleep(0.01)
        assert reported == {2, 3}
        assert w.given_up_loads == 0, "a load queued behind one that progresses was given up"
        assert w.take_failed_load_block_ids() == set()
        assert all(np.array_equal(layer[8:12], layer[0:4]) for layer in source)
    finally:
        w.shutdown()


def test_under_the_plain_connector_a_stalled_load_is_waited_for_not_failed(service):
    """vLLM's plain OffloadingConnector stops the engine on a failed load: there a load stuck behind a
    frozen service is waited for, and completes once the service answers again."""
    source = layers()
    w = ServiceWorker(connection(service), source, PAGE_BYTES, job_timeout_ms=30_000, stall_timeout_ms=500)
    try:
        assert w.submit_store(1, engine_blocks([0, 1]), KvtierLoadStoreSpec([key(70), key(71)])) and finished(w, 1)
        with frozen(service.socket_path()):
            assert w.submit_load(2, KvtierLoadStoreSpec([key(70), key(71)]), engine_blocks([8, 9]))
            assert not finished(w, 2, timeout_s=1.5) and w.given_up_loads == 0
        assert finished(w, 2)
        assert all(np.array_equal(layer[8:10], layer[0:2]) for layer in source)
    finally:
        w.shutdown()


def load_arrives_under_the_plain_connector(w: JobQueueWorker, source: list[np.ndarray], keys: list[bytes]) -> None:
    """Loads the blocks stored from engine blocks 0 and 1 (``keys``) into blocks 8 and 9, as load job 2,
    and checks that they arrive: vLLM's plain connector stops the engine on a failed load."""
    for layer in source:
        layer[8:10] = 0
    assert w.submit_load(2, KvtierLoadStoreSpec(keys), engine_blocks([8, 9]))
    deadline = time.monotonic() + 20
    results: list[Any] = []
    while not results and time.monotonic() < deadline:
        results = [r for r in w.get_finished() if r.job_id == 2]
        time.sleep(0.01)
    assert results and results[0].success, "the load failed: vLLM's plain connector would stop the engine"
    reference = layers()
    assert all(np.array_equal(layer[8:10], ref[0:2]) for layer, ref in zip(source, reference, strict=True))


def test_a_load_waiting_for_a_reattach_lets_an_engine_shut_down_at_once(tmp_path):
    """Under vLLM's plain OffloadingConnector a load the service did not answer waits for the worker's
    connection to reattach, up to ``job_timeout_ms``. Once the engine shuts down nothing reattaches
    it (``stop_reconnecting``), yet the load went on waiting: vLLM's shutdown waited the whole
    ``job_timeout_ms`` (120 s by default) beside a stopped service."""
    options = options_for(tmp_path)
    w = worker(options, layers())
    try:
        assert w.submit_store(1, engine_blocks([0]), KvtierLoadStoreSpec([key(90)])) and finished(w, 1)
        assert kvtier_service.stop_service(options.socket_path())
        assert w.submit_load(2, KvtierLoadStoreSpec([key(90)]), engine_blocks([8]))
        time.sleep(0.3)  # the job thread's call fails; its load waits for a reattach
        started = time.monotonic()
        w.shutdown()
        waited_s = time.monotonic() - started
        assert waited_s < 3, f"the shutdown waited {waited_s:.1f} s for a load no reattach would serve"
    finally:
        kvtier_service.stop_service(options.socket_path())


def test_an_engine_shuts_down_beside_a_frozen_service_in_a_stall_timeout_not_the_job_timeout(service):
    """A worker's shutdown lets its job thread run the stores still queued, and waited up to
    ``job_timeout_ms`` (120 s by default) for it: beside a frozen service (SIGSTOP) a ``vllm serve``
    stopped with SIGTERM waited that long. A job thread stuck in a call is now let go once it has
    made no progress for the stall timeout, and its late reply copies nothing."""
    source = layers()
    w = ServiceWorker(connection(service), source, PAGE_BYTES, job_timeout_ms=30_000, stall_timeout_ms=500)
    assert w.submit_store(1, engine_blocks([0, 1]), KvtierLoadStoreSpec([key(100), key(101)])) and finished(w, 1)
    with frozen(service.socket_path()):
        assert w.submit_store(2, engine_blocks([2, 3]), KvtierLoadStoreSpec([key(102), key(103)]))
        time.sleep(0.1)  # the job thread is in the store's call
        started = time.monotonic()
        w.shutdown()
        waited_s = time.monotonic() - started
        assert waited_s < 3, f"the shutdown waited {waited_s:.1f} s for a frozen service"
    time.sleep(1.0)  # the stuck call comes back late
    probe = connection(service)
    try:
        assert probe.locate_many([key(100), key(101)]) == ["dram", "dram"]
        assert probe.locate_many([key(102), key(103)]) == [None, None], "a store let go at shutdown was committed"
    finally:
        probe.close()


def test_under_the_plain_connector_a_load_after_a_service_restart_waits_for_the_worker_to_reattach(tmp_path):
    """vLLM's plain OffloadingConnector stops the engine on a failed load. After the host service
    died and was started again (its NVMe tier recovered), the scheduler's connection reattached at
    its next lookup and offered the recovered blocks, while the worker's connection, idle, was still
    unattached: the load was answered "not loaded" unsent, and the engine stopped. Now on that route
    a load the service did not answer waits for the worker's connection to reattach (within
    ``job_timeout_ms``) and is tried again; the blocks arrive."""
    options = options_for(tmp_path, nvme_bytes=64 << 20)
    source = layers()
    w = worker(options, source, label="engine-r")
    scheduler = ServiceConnection(options, {"test": "worker"}, 1, 0, PAGE_BYTES * LAYERS, timeout_ms=1_000)
    try:
        keys = [key(95), key(96)]
        assert w.submit_store(1, engine_blocks([0, 1]), KvtierLoadStoreSpec(keys)) and finished(w, 1)
        scheduler.flush()  # on NVMe: a service started again recovers them
        pid = kvtier_service.service_pid(options.socket_path())
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while scheduler.available and time.monotonic() < deadline:
            time.sleep(0.05)  # the hang-up watch lets go of the process's clients
        while not all(tier in ("dram", "nvme") for tier in scheduler.locate_many(keys)):  # kept or recovered
            assert time.monotonic() < deadline, "the scheduler did not reattach and find the recovered blocks"
            time.sleep(0.1)
        assert scheduler.pin_many(keys) == [True, True]
        load_arrives_under_the_plain_connector(w, source, keys)
        assert w.loads_after_reattach >= 1
        reported = 0  # the worker reports it after the job: served late, not a fallback to recompute
        while reported < w.loads_after_reattach and time.monotonic() < deadline:
            time.sleep(0.05)
            reported = engine_counts(options.socket_path(), "engine-r").get("loads_after_reattach", 0)
        assert reported == w.loads_after_reattach
    finally:
        scheduler.close()
        w.shutdown()
        kvtier_service.stop_service(options.socket_path())


def test_under_the_plain_connector_a_load_promised_before_a_service_kill_finds_its_dram_blocks(tmp_path):
    """The scheduler offered blocks held only in the host service's DRAM (vLLM promises their load),
    then the service was SIGKILLed before the load ran. The service started again takes the dead
    one's pool over; it freed every slot, so the load failed and vLLM's plain OffloadingConnector
    stopped the engine. Now it keeps the blocks its predecessor had marked resident (checksums
    checked): the load waits for the worker to reattach and the blocks arrive."""
    options = options_for(tmp_path, nvme_bytes=0)
    source = layers()
    w = worker(options, source)
    scheduler = ServiceConnection(options, {"test": "worker"}, 1, 0, PAGE_BYTES * LAYERS, timeout_ms=1_000)
    try:
        keys = [key(97), key(98)]
        assert w.submit_store(1, engine_blocks([0, 1]), KvtierLoadStoreSpec(keys)) and finished(w, 1)
        assert scheduler.locate_many(keys) == ["dram", "dram"] and scheduler.pin_many(keys) == [True, True]
        pid = kvtier_service.service_pid(options.socket_path())
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        load_arrives_under_the_plain_connector(w, source, keys)
    finally:
        scheduler.close()
        w.shutdown()
        kvtier_service.stop_service(options.socket_path())


def test_a_frozen_service_costs_the_scheduler_one_timeout_then_misses_at_once_until_it_answers(service):
    """Issue 36: the scheduler's connection waited max(job_timeout_ms, service_timeout_ms) = 120 s per
    call on a frozen service, holding vLLM's engine loop. Now one call waits service_timeout_ms, the
    service steps aside (later calls miss at once), and a probe reattaches once it answers."""
    w = worker(service, layers())
    scheduler = ServiceConnection(service, {"test": "worker"}, 1, 0, PAGE_BYTES * LAYERS, timeout_ms=1_000)
    try:
        assert w.submit_store(1, engine_blocks([0]), KvtierLoadStoreSpec([key(80)])) and finished(w, 1)
        assert scheduler.locate_many([key(80)]) == ["dram"]
        with frozen(service.socket_path()):
            started = time.monotonic()
            assert scheduler.locate_many([key(80)]) == [None]
            assert time.monotonic() - started < 2.5, "one call waits service_timeout_ms, no longer"
            started = time.monotonic()
            assert scheduler.locate_many([key(80)]) == [None] and scheduler.pin_many([key(80)]) == []
            assert time.monotonic() - started < 0.1, "a stepped-aside service costs nothing more"
            assert not scheduler.available and scheduler.outages == 1
        deadline = time.monotonic() + 30
        while not scheduler.available and time.monotonic() < deadline:
            scheduler.locate_many([key(80)])
            time.sleep(0.1)
        assert scheduler.locate_many([key(80)]) == ["dram"], "reattached without a restart"
        assert scheduler.outages == 1
    finally:
        scheduler.close()
        w.shutdown()


def test_a_reconnect_that_keeps_failing_says_why_once_then_reattaches_when_it_can(tmp_path, caplog):
    """An engine whose reconnects fail (here, after its service stopped, its socket's directory is
    open to others, which the service start refuses) said why only at DEBUG: an engine that never
    reattached showed nothing. Now the first failure of an outage is a WARNING with the reason, not
    repeated at every retry."""
    run_dir = tmp_path / "run"
    options = options_for(tmp_path, service_socket=str(run_dir / "kv.sock"))
    caplog.set_level(logging.DEBUG, logger="kvtier.vllm")
    scheduler = ServiceConnection(options, {"test": "worker"}, 1, 0, PAGE_BYTES * LAYERS, timeout_ms=1_000)
    try:
        assert scheduler.available
        assert kvtier_service.stop_service(options.socket_path())
        os.chmod(run_dir, 0o777)
        caplog.clear()
        deadline = time.monotonic() + 3.5
        while time.monotonic() < deadline:
            assert scheduler.locate_many([key(90)]) == [None]
            time.sleep(0.1)
        # A record can reach caplog twice (vLLM's logging, configured by an earlier test of the
        # session, hands kvtier's records on): one warning is one (message, time).
        warned = sorted({(r.getMessage(), r.created) for r in caplog.records if r.levelno == logging.WARNING})
        assert len(warned) == 1 and "closed to others" in warned[0][0], warned
        retried = [r for r in caplog.records if r.levelno == logging.DEBUG and "still unreachable" in r.getMessage()]
        assert retried, "the reconnects went on (at DEBUG)"
        os.chmod(run_dir, 0o700)
        deadline = time.monotonic() + 30
        while not scheduler.available and time.monotonic() < deadline:
            scheduler.locate_many([key(90)])
            time.sleep(0.1)
        assert scheduler.available, "reattached once the cause was gone"
        assert any("reattached" in r.getMessage() for r in caplog.records)
    finally:
        scheduler.close()
        kvtier_service.stop_service(options.socket_path())


def test_a_hinted_request_against_a_frozen_service_costs_one_timeout_and_the_hint_counts_once_it_answers(tmp_path):
    """Issue 36 with issue 39's hint: a hinted request's ``prepare_store`` against a frozen service
    waits the scheduler's one ``service_timeout_ms`` (its lookup), passes the hint on at no further
    cost (the service stepped aside) and never raises; once the service answers again, the next
    hinted request's blocks are retained and written below DRAM at once, no restart."""
    options = options_for(tmp_path, nvme_bytes=16 << 20, write_admission="reuse")
    try:
        scheduler = ServiceConnection(options, {"test": "worker"}, 1, 0, PAGE_BYTES * LAYERS, timeout_ms=1_000)
        manager = KvtierManager(ServiceBackend(scheduler))
        hint = {"kvtier": {"retain": True}}
        keys = [make_offload_key(hashlib.sha256(bytes([120 + i])).digest(), 0) for i in range(4)]
        connection(options).stats()  # the service is up before it is frozen
        with frozen(options.socket_path()):
            started = time.monotonic()
            planned = manager.prepare_store(keys[:2], ReqContext(req_id="during", kv_transfer_params=hint))
            assert time.monotonic() - started < 2.5, "a hinted store waited more than the one deadline"
            assert planned is not None and planned.keys_to_store == keys[:2], "vLLM's store goes on"
            assert not scheduler.available
        deadline = time.monotonic() + 30
        while not scheduler.available and time.monotonic() < deadline:
            scheduler.locate_many([kvtier_key(keys[0])])
            time.sleep(0.1)
        after = manager.prepare_store(keys[2:], ReqContext(req_id="after", kv_transfer_params=hint))
        assert after is not None and after.keys_to_store == keys[2:]
        store_two_by_two(options, [after])
        stats = connection(options).stats()
        assert stats["retained_by_hint"] == 2, "the hint reached the service once it answered"
        assert stats["bytes_written_nvme"] == 2 * (PAGE_BYTES * LAYERS + 4096)
        manager.shutdown()
    finally:
        kvtier_service.stop_service(options.socket_path())


def _published_to_a_shared_directory(tmp_path: Path, count: int) -> tuple[KvtierOptions, list[OffloadKey]]:
    """``count`` blocks node A stored and published to a shared directory; node B's options (nothing
    in its DRAM or on its NVMe): the blocks are held by the shared tier alone there."""
    shared = {"shared_root": str(tmp_path / "shared"), "shared_staleness_ms": 100, "shared_file_bytes": 1 << 20}

    def node(name: str) -> KvtierOptions:
        own = options_for(tmp_path / name)
        return KvtierOptions.from_extra_config(
            {**own.store_options, **shared, "path": own.path, "pool_dir": str(tmp_path)}
        )

    writer, reader = node("a"), node("b")
    offload_keys = [make_offload_key(hashlib.sha256(bytes([200 + i])).digest(), 0) for i in range(count)]
    store_keys = [kvtier_key(k) for k in offload_keys]
    try:
        w = worker(writer, layers())
        assert w.submit_store(1, engine_blocks(list(range(count))), KvtierLoadStoreSpec(store_keys))
        assert finished(w, 1)
        w.shutdown()
        connection(writer).flush()
    finally:
        kvtier_service.stop_service(writer.socket_path())
    probe = connection(reader)
    deadline = time.monotonic() + 10
    while probe.locate_many(store_keys) != ["shared"] * count:
        assert time.monotonic() < deadline, "the published blocks never became visible"
        time.sleep(0.05)
    probe.close()
    return reader, offload_keys


def test_under_the_plain_connector_a_block_only_a_remote_tier_holds_is_not_offered(tmp_path):
    """Issue 36: a block held only by the shared (or object) tier is not pinned: another node may
    evict it between the lookup and the load, and under vLLM's plain OffloadingConnector that failed
    load stops the engine. There such a block is a miss unless a prefetch brought it into DRAM;
    KvtierConnector, which recomputes a failed load, is offered it."""
    reader, offload_keys = _published_to_a_shared_directory(tmp_path, 2)
    store_keys = [kvtier_key(k) for k in offload_keys]
    try:
        probe = connection(reader)  # another node: nothing in its DRAM or on its NVMe
        request = ReqContext(req_id="r1")
        plain = KvtierManager(ServiceBackend(connection(reader)))
        assert plain.lookup(offload_keys[0], request) == LookupResult.MISS
        recomputing = KvtierManager(ServiceBackend(connection(reader)))
        recomputing.recomputes_failed_loads = True
        assert recomputing.lookup(offload_keys[0], request) == LookupResult.HIT
        # With the prefetcher the block is read into DRAM first, where a pin holds it: offered.
        prefetching = KvtierManager(ServiceBackend(connection(reader), Prefetcher(lambda: connection(reader))))
        deadline = time.monotonic() + 10
        while prefetching.lookup(offload_keys[1], request) != LookupResult.HIT:
            assert time.monotonic() < deadline, "the prefetch never ended"
            time.sleep(0.02)
        assert probe.locate_many(store_keys[1:]) == ["dram"]
        for manager in (plain, recomputing, prefetching):
            manager.shutdown()
        probe.close()
    finally:
        kvtier_service.stop_service(reader.socket_path())


def test_a_remote_tier_with_no_rate_is_timed_in_the_background_while_the_request_recomputes(tmp_path):
    """Issue 36: at kv8b a 20 MB/s bucket took 6.2 s to probe on the request's path (twice a recompute).
    A remote tier with no rate yet is now a miss for the request, and its first hits are read into DRAM
    in the background, which times the tier for the next request."""
    from kvtier.vllm.costs import PROBE_BLOCKS, work_of

    reader, offload_keys = _published_to_a_shared_directory(tmp_path, PROBE_BLOCKS + 2)
    store_keys = [kvtier_key(k) for k in offload_keys]
    try:
        manager = KvtierManager(ServiceBackend(connection(reader), Prefetcher(lambda: connection(reader))))
        manager.recomputes_failed_loads = True  # KvtierConnector's route
        for tokens in range(64, 64 + 16 * 64, 64):  # an engine computing 1 ms per token
            manager.decider.prefill.observe(tokens, work_of(tokens, 0), 0.001 * tokens)
        request = ReqContext(req_id="r1")
        assert [manager.lookup(k, request) for k in offload_keys] == [LookupResult.RETRY] * len(offload_keys)
        assert manager.lookup(offload_keys[0], request) == LookupResult.MISS, "the request does not wait"
        assert manager.decider.decisions == {("shared", "probe_aside"): PROBE_BLOCKS, ("shared", "recompute"): 2}
        probe = connection(reader)
        deadline = time.monotonic() + 10
        while manager.decider.rates.seconds_per_block("shared") is None:
            assert time.monotonic() < deadline, "the probe never timed the tier"
            time.sleep(0.02)
        assert probe.locate_many(store_keys) == ["dram"] * PROBE_BLOCKS + ["shared"] * 2, "read aside: the probe's"
        # The next request finds the rate known: its hits are weighed, none probed again.
        second = ReqContext(req_id="r2")
        for _ in range(2):  # the first pass sees every hit, the second decides
            [manager.lookup(k, second) for k in offload_keys]
        assert manager.decider.decisions[("shared", "probe_aside")] == PROBE_BLOCKS
        assert manager.decider.decisions.get(("dram", "load"), 0) == PROBE_BLOCKS, "the probe's blocks, offered"
        probe.close()
        manager.shutdown()
    finally:
        kvtier_service.stop_service(reader.socket_path())


def test_the_manager_recomputes_nvme_hits_that_load_slower_than_the_engine_computes(tmp_path):
    """Issue 36 (load or recompute): hits on NVMe are offered only when loading them is expected to
    beat recomputing them. The first lookup pass retries (it sees every hit and its tier); the next
    one offers the leading blocks that save time: none with a slow NVMe, all with a fast one, and all
    with an NVMe not measured yet (a local tier is not probed a few blocks at a time)."""
    from kvtier.vllm.costs import work_of

    options = options_for(tmp_path, nvme_bytes=16 << 20)
    all_keys = [make_offload_key(hashlib.sha256(bytes([100 + i])).digest(), 0) for i in range(8)]
    offload_keys, unmeasured_keys = all_keys[:4], all_keys[4:]  # the second four: a fresh manager's
    store_keys = [kvtier_key(k) for k in all_keys]
    try:
        w = worker(options, layers())
        assert w.submit_store(1, engine_blocks(list(range(8))), KvtierLoadStoreSpec(store_keys)) and finished(w, 1)
        w.shutdown()
        connection(options).flush()
        assert kvtier_service.stop_service(options.socket_path())  # the blocks are on NVMe only now
        manager = KvtierManager(ServiceBackend(connection(options), Prefetcher(lambda: connection(options))))
        for tokens in range(64, 64 + 16 * 64, 64):  # an engine computing 1 ms per token
            manager.decider.prefill.observe(tokens, work_of(tokens, 0), 0.001 * tokens)
        per_block_s = 0.001 * manager.decider.block_tokens
        for nvme_s, expected in ((50 * per_block_s, LookupResult.MISS), (per_block_s / 50, LookupResult.HIT_PENDING)):
            for _ in range(40):  # a weighted mean: it follows the tier in a few observations
                manager.decider.rates.observe("nvme", 1, nvme_s)
            request = ReqContext(req_id=f"nvme-{nvme_s}")
            assert [manager.lookup(k, request) for k in offload_keys] == [LookupResult.RETRY] * 4
            assert manager.lookup(offload_keys[0], request) == expected
        assert manager.decider.decisions == {("nvme", "recompute"): 4, ("nvme", "load"): 4}
        manager.shutdown()
        # A fresh engine's manager: no NVMe rate yet. Every hit is offered (the load times the tier).
        fresh = KvtierManager(ServiceBackend(connection(options), Prefetcher(lambda: connection(options))))
        for tokens in range(64, 64 + 16 * 64, 64):
            fresh.decider.prefill.observe(tokens, work_of(tokens, 0), 0.001 * tokens)
        request = ReqContext(req_id="nvme-unmeasured")
        assert [fresh.lookup(k, request) for k in unmeasured_keys] == [LookupResult.RETRY] * 4
        assert fresh.lookup(unmeasured_keys[0], request) == LookupResult.HIT_PENDING
        assert fresh.decider.decisions == {("nvme", "probe"): 4}
        fresh.shutdown()
        # With ``prefetch: false`` the worker's load reads NVMe itself: no NVMe rate is ever measured,
        # and its hits must not be probed 4 blocks at a time forever (they are costed as the loads').
        direct = KvtierManager(ServiceBackend(connection(options)))
        for tokens in range(64, 64 + 16 * 64, 64):
            direct.decider.prefill.observe(tokens, work_of(tokens, 0), 0.001 * tokens)
        direct.decider.rates.observe("dram", 1, per_block_s / 50)
        request = ReqContext(req_id="direct")
        assert [direct.lookup(k, request) for k in offload_keys] == [LookupResult.HIT] * 4
        direct.shutdown()
    finally:
        kvtier_service.stop_service(options.socket_path())


def test_the_scheduler_fingerprints_the_weights_once_not_on_a_requests_path(tmp_path, monkeypatch):
    """Issue 37, item 7: the prefetcher's and the event feed's connections open lazily, at a request's
    first NVMe hit or event drain, and each hashed every weight file again there (about 15 s for an
    8B model, spent in HIT_PENDING). The scheduler now fingerprints the model once, at start."""
    from types import SimpleNamespace

    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    from kvtier.models import ensure_model
    from kvtier.vllm import namespace, spec

    hashed: list[str] = []
    real = namespace._file_sha256

    def counted(path: Path) -> tuple[int, str]:
        hashed.append(path.name)
        return real(path)

    monkeypatch.setattr(namespace, "_file_sha256", counted)
    options = options_for(tmp_path)
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0", "layer.1"), 0),),
        worker_kv_bytes_per_block=PAGE_BYTES * LAYERS,
        enable_kv_cache_events=True,
        extra_config={
            "path": options.path,
            **options.store_options,
            "pool_dir": str(tmp_path),
            "load_wait_max_ratio": 3,
        },
        engine_id="fingerprint-once",
        model=OffloadingModelConfig(str(ensure_model("tiny")), "float32"),
        cache=OffloadingCacheConfig(16, 1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
    )
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256"),
        model_config=SimpleNamespace(enable_sleep_mode=False, revision=None),
        load_config=SimpleNamespace(download_dir=None),
        kv_transfer_config=SimpleNamespace(kv_connector="KvtierConnector"),
    )
    monkeypatch.setattr(spec._constructing, "vllm_config", vllm_config, raising=False)
    manager = spec.KvtierOffloadingSpec(config).get_manager()
    assert isinstance(manager, KvtierManager)
    assert manager.decider.max_wait_ratio == 3.0, "the option reaches the scheduler's load decider"
    try:
        at_start = len(hashed)
        assert at_start >= 1
        # A request's first lookup that needs the prefetcher, and the first drain of events.
        prefetcher = manager._prefetcher
        assert prefetcher is not None
        prefetcher.lookup(key(120), "nvme")
        deadline = time.monotonic() + 10
        while prefetcher._connection is None and time.monotonic() < deadline:
            time.sleep(0.02)
        list(manager.take_events())
        assert prefetcher._connection is not None
        assert len(hashed) == at_start, f"weights hashed again on a request's path: {hashed}"
    finally:
        manager.shutdown()
        kvtier_service.stop_service(options.socket_path())


def wait_prefetched(prefetcher: Prefetcher, store_key: bytes) -> None:
    """Until the NVMe block's prefetch ended (its lookup answers HIT)."""
    deadline = time.monotonic() + 10
    while prefetcher.lookup(store_key, "nvme") != LookupResult.HIT:
        assert time.monotonic() < deadline, "the first prefetch did not end"
        time.sleep(0.05)


def wait_pending_given_up(prefetcher: Prefetcher, store_key: bytes, why: str) -> None:
    """Until a lookup of the NVMe block no longer answers HIT_PENDING, within 5 s, as a miss counted."""
    deadline = time.monotonic() + 5
    while prefetcher.lookup(store_key, "nvme") == LookupResult.HIT_PENDING:
        assert time.monotonic() < deadline, why
        time.sleep(0.05)
    assert prefetcher.expired_pending >= 1


def test_a_request_waits_for_a_prefetch_only_while_it_progresses(service):
    """A prefetch stuck behind a frozen service holds its requests in HIT_PENDING at most the pending
    timeout after its last chunk ended: then they are misses (recomputed)."""
    w = worker(service, layers())
    try:
        assert w.submit_store(1, engine_blocks([0]), KvtierLoadStoreSpec([key(130)])) and finished(w, 1)
        prefetcher = Prefetcher(lambda: connection(service), pending_timeout_s=0.5)
        # Its connection made before the freeze: one made during it starts unattached within a second
        # (the service's process is seen stopped), and its prefetches end at once, unsent.
        wait_prefetched(prefetcher, key(130))
        with frozen(service.socket_path()):
            assert prefetcher.lookup(key(131), "nvme") == LookupResult.HIT_PENDING
            time.sleep(0.2)
            assert prefetcher.lookup(key(131), "nvme") == LookupResult.HIT_PENDING, "not yet stalled"
            wait_pending_given_up(prefetcher, key(131), "a stalled prefetch held its request")
        prefetcher.close()
    finally:
        w.shutdown()


def test_a_slow_buckets_rate_does_not_let_a_stuck_nvme_prefetch_hold_its_request(service):
    """A chunk may take three times what its tier's measured rate says before the prefetcher counts
    as stalled (a slow link still delivers). That limit came from the slowest tier known, whatever
    the chunk read: with a bucket timed at 2 s a block, a prefetch from NVMe stuck behind a frozen
    service held its request in HIT_PENDING for 96 s. The limit is the chunk's own tier's now."""
    from kvtier.vllm.costs import TierRates

    w = worker(service, layers())
    try:
        assert w.submit_store(1, engine_blocks([0]), KvtierLoadStoreSpec([key(132)])) and finished(w, 1)
        prefetcher = Prefetcher(lambda: connection(service), pending_timeout_s=0.5)
        prefetcher.rates = rates = TierRates()
        wait_prefetched(prefetcher, key(132))
        assert (rates.seconds_per_block("nvme") or 1.0) < 0.05, "NVMe timed by its own prefetch"
        rates.observe("bucket", 1, 2.0)  # a slow link elsewhere: 96 s for a chunk of 16 blocks
        with frozen(service.socket_path()):
            assert prefetcher.lookup(key(133), "nvme") == LookupResult.HIT_PENDING
            wait_pending_given_up(prefetcher, key(133), "the bucket's rate let a stuck NVMe prefetch hold its request")
        prefetcher.close()
    finally:
        w.shutdown()


def _resident_bytes(address: int) -> int:
    """Resident bytes of this process's mapping that starts at ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):
            inside = int(head.split("-")[0], 16) == address
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def test_only_a_connection_that_copies_faults_the_pool_in(service):
    """Issue 37, item 12: the scheduler side's connections (manager, prefetcher, event feed) never
    copy; each used to fault in the whole pool at attach (MAP_POPULATE). A worker's connection,
    which copies, still does (and again after a reconnect: it is part of attaching)."""
    asks = ServiceConnection(service, {"test": "worker"}, 1, 0, PAGE_BYTES * LAYERS)
    copies = ServiceConnection(service, {"test": "worker"}, 1, 0, PAGE_BYTES * LAYERS, populate_pool=True)
    try:
        asks_pool, copies_pool = asks.live_client().pool(), copies.live_client().pool()
        assert _resident_bytes(asks_pool["address"]) == 0
        assert _resident_bytes(copies_pool["address"]) == copies_pool["bytes"]
    finally:
        asks.close()
        copies.close()
