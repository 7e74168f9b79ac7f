"""How one job's copies are issued, on the side stream the caller made current (``device``).

A job is ``CopyJob``: a rank's KV-cache tensors (each a ``(num_blocks, page_bytes)`` uint8 view), the
engine block ids, where each block's object lies in the pool, and the direction. Executors, in the
order ``choose`` tries them on a GPU:

- ``DriverBatchExecutor``: every (block, segment) copy in one ``cuMemcpyBatchAsync`` call (CUDA 12.8+
  drivers), called through ``ctypes`` on ``libcuda``; kvtier's own path, needs nothing but the driver.
- ``VllmSwapExecutor``: vLLM's ``ops.swap_blocks_batch`` (the same driver call from vLLM's compiled
  ops, with vLLM's fallback loop on older CUDA), when GPU vLLM is installed.
- ``StagedExecutor``: per-layer ``index_select``/``index_copy_`` on the GPU into a staging buffer, then
  one DMA per block; needs only torch, and a contiguous plan (the rank's slice is one range of the
  object). Fragmented plans without a batch executor are refused at bind time with the fix.
- ``HostExecutor``: ``memmove`` per copy, for KV caches in host memory (the CPU tests run the whole
  path through it).

A GPU executor is chosen only after a self-test: a small batch through it, read back and compared,
issued on the side stream the jobs use (``cuMemcpyBatchAsync`` refuses the legacy default stream, so
a self-test there would never pick it). A driver whose ABI differs from what this module declares
fails that test and is never used.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kvtier.gpu.plan import CopyPlan

logger = logging.getLogger(__name__)

# Staged copies gather this many bytes at most per pass (device memory taken from the engine).
STAGING_BYTES = 64 << 20


@dataclass
class CopyJob:
    """The copies of one round of a job, between ``tensors`` and the pool mapped at ``pool_address``
    (``pool`` views the same bytes as a uint8 tensor)."""

    plan: CopyPlan
    tensors: Sequence[torch.Tensor]
    block_ids: Sequence[int]
    object_offsets: Sequence[int]
    pool: torch.Tensor
    pool_address: int
    to_pool: bool

    def pointers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        addresses = [t.data_ptr() for t in self.tensors]
        strides = [t.stride(0) * t.element_size() for t in self.tensors]
        objects = [self.pool_address + offset for offset in self.object_offsets]
        return self.plan.pointers(addresses, strides, self.block_ids, objects, self.to_pool)


class Executor(Protocol):
    name: str

    def copy(self, job: CopyJob) -> None:
        """Issues the job's copies on the current stream (on the host: performs them)."""


class HostExecutor:
    """Copies between host memory and the pool with ``memmove``, one call per segment."""

    name = "host-memmove"

    def copy(self, job: CopyJob) -> None:
        self.copy_pointers(*job.pointers(), job.to_pool)

    def copy_pointers(self, sources: np.ndarray, destinations: np.ndarray, sizes: np.ndarray, to_pool: bool) -> None:
        for source, destination, size in zip(sources.tolist(), destinations.tolist(), sizes.tolist(), strict=True):
            ctypes.memmove(destination, source, size)


# ---- cuMemcpyBatchAsync through ctypes -------------------------------------------------------


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_location_hint", _MemLocation),
        ("dst_location_hint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


# CUmemcpySrcAccessOrder. Stores read the live KV cache: in stream order, after the engine's event.
# Loads read pool slots the service pinned before the call and keeps unchanged until release: ANY
# lets the driver read them early. Both as vLLM 0.32's own batch copies (simple_kv_offload), which
# also pass no location hints and flags 0 (not PREFER_OVERLAP_WITH_COMPUTE).
ACCESS_ORDER_STREAM = 1
ACCESS_ORDER_ANY = 3
# The batch API's first driver (12.8) took a failIdx out-parameter; CUDA 13.0 dropped it.
_FIRST_BATCH_DRIVER = 12080
_NO_FAIL_INDEX_DRIVER = 13000


class DriverBatchExecutor:
    """All of a job's copies in one ``cuMemcpyBatchAsync`` on the current stream.

    The function pointer comes from ``cuGetProcAddress`` for the ABI this module declares (12.8's,
    with ``failIdx``, or 13.0's, without), so a newer driver hands out the matching entry point.
    Sources are read in stream order: the side stream already waits for the engine's event."""

    name = "cuMemcpyBatchAsync"

    def __init__(self, device: torch.device):
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", ordinal)
        driver = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
        self._driver = driver
        # The driver API acts on the calling thread's current context, and jobs run on the worker's
        # own thread: remember the context torch made current here and make it current per job.
        torch.zeros(1, device=self.device)
        self._context = ctypes.c_void_p()
        _check(driver.cuCtxGetCurrent(ctypes.byref(self._context)), "cuCtxGetCurrent")
        if not self._context.value:
            raise RuntimeError(f"no CUDA context is current for {self.device} after torch initialized it")
        version = ctypes.c_int()
        _check(driver.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        self.driver_version = version.value
        if self.driver_version < _FIRST_BATCH_DRIVER:
            raise RuntimeError(f"the CUDA driver ({self.driver_version}) predates cuMemcpyBatchAsync (12.8)")
        self.with_fail_index = self.driver_version < _NO_FAIL_INDEX_DRIVER
        abi_version = _FIRST_BATCH_DRIVER if self.with_fail_index else _NO_FAIL_INDEX_DRIVER
        function = ctypes.c_void_p()
        status = ctypes.c_int()
        get_proc = driver.cuGetProcAddress_v2
        get_proc.argtypes = [
            ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.POINTER(ctypes.c_int),
        ]
        _check(
            get_proc(b"cuMemcpyBatchAsync", ctypes.byref(function), abi_version, 0, ctypes.byref(status)),
            "cuGetProcAddress",
        )
        if not function.value:
            raise RuntimeError(
                f"the CUDA driver has no cuMemcpyBatchAsync for ABI {abi_version} (status {status.value})"
            )
        size_p = ctypes.POINTER(ctypes.c_size_t)
        arguments: list[Any] = [
            size_p,
            size_p,
            size_p,
            ctypes.c_size_t,
            ctypes.POINTER(_MemcpyAttributes),
            size_p,
            ctypes.c_size_t,
        ]
        if self.with_fail_index:
            arguments.append(size_p)
        arguments.append(ctypes.c_void_p)
        self._batch = ctypes.CFUNCTYPE(ctypes.c_int, *arguments)(function.value)
        self._attributes = {to_pool: batch_attributes(to_pool) for to_pool in (True, False)}

    def copy(self, job: CopyJob) -> None:
        sources, destinations, sizes = job.pointers()
        self.copy_pointers(sources, destinations, sizes, job.to_pool)

    def copy_pointers(self, sources: np.ndarray, destinations: np.ndarray, sizes: np.ndarray, to_pool: bool) -> None:
        count = len(sizes)
        if count == 0:
            return
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if stream == 0:
            raise RuntimeError("cuMemcpyBatchAsync refuses the legacy default stream: issue copies on the side stream")
        _check(self._driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
        # ctypes reads the arrays during the call only: the driver copies the descriptors.
        sources, destinations, sizes = (
            np.ascontiguousarray(a, dtype=np.uint64) for a in (sources, destinations, sizes)
        )
        size_p = ctypes.POINTER(ctypes.c_size_t)
        attribute_index = (ctypes.c_size_t * 1)(0)
        arguments: list[Any] = [
            destinations.ctypes.data_as(size_p),
            sources.ctypes.data_as(size_p),
            sizes.ctypes.data_as(size_p),
            count,
            ctypes.byref(self._attributes[to_pool]),
            attribute_index,
            1,
        ]
        fail_index = ctypes.c_size_t(0)
        if self.with_fail_index:
            arguments.append(ctypes.byref(fail_index))
        arguments.append(ctypes.c_void_p(stream))
        code = self._batch(*arguments)
        if code != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed with CUDA error {code} (copy {fail_index.value} of {count})")


def batch_attributes(to_pool: bool) -> _MemcpyAttributes:
    """The one attributes entry every copy of a job uses."""
    order = ACCESS_ORDER_STREAM if to_pool else ACCESS_ORDER_ANY
    return _MemcpyAttributes(order, _MemLocation(0, 0), _MemLocation(0, 0), 0)


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed with CUDA error {code}")


class VllmSwapExecutor:
    """vLLM's ``ops.swap_blocks_batch``: the batch copy from vLLM's compiled ops (GPU vLLM only)."""

    name = "vllm-swap_blocks_batch"

    def __init__(self) -> None:
        from vllm import _custom_ops as ops  # absent without GPU vLLM: ``choose`` skips this

        self._swap = ops.swap_blocks_batch

    def copy(self, job: CopyJob) -> None:
        sources, destinations, sizes = job.pointers()
        if len(sizes) == 0:
            return
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a).view(np.int64))  # noqa: E731
        self._swap(as_tensor(sources), as_tensor(destinations), as_tensor(sizes), False)


class PointerCopier(Protocol):
    def copy_pointers(self, sources: np.ndarray, destinations: np.ndarray, sizes: np.ndarray, to_pool: bool) -> None:
        """Issues one copy per (source, destination, size) on the current stream."""


class StagedExecutor:
    """Per-layer gathers on the GPU into a staging buffer laid out as the rank's slices, then one DMA
    per block between the staging row and the block's object. Needs a contiguous plan
    (``CopyPlan.contiguous``). The DMAs are torch copies, one call each (torch alone), or, with
    ``dma`` (``DriverBatchExecutor``), one batch per pass: small pages then move as whole slices
    (the first H200 runs: 18 KiB pages restored at 3.7 GB/s through the per-page batch, 31 GB/s
    staged)."""

    def __init__(self, device: torch.device, staging_bytes: int = STAGING_BYTES, dma: PointerCopier | None = None):
        self.device = device
        self.staging_bytes = staging_bytes
        self._staging: torch.Tensor | None = None
        self._dma = dma
        self.name = "staged-index-copy" if dma is None else "staged-index-copy+batch-dma"

    def _rows(self, slice_bytes: int) -> torch.Tensor:
        rows = max(1, self.staging_bytes // slice_bytes)
        if self._staging is None or self._staging.shape != (rows, slice_bytes):
            self._staging = torch.empty((rows, slice_bytes), dtype=torch.uint8, device=self.device)
        return self._staging

    def copy(self, job: CopyJob) -> None:
        plan = job.plan
        if not plan.contiguous or plan.object_offset is None:
            raise RuntimeError("staged copies need the rank's slice as one range of the object (a contiguous plan)")
        staging = self._rows(plan.slice_bytes)
        starts = np.cumsum([0, *plan.page_bytes])
        all_ids = self._index(job.block_ids)
        for first in range(0, len(job.block_ids), staging.shape[0]):
            index = all_ids[first : first + staging.shape[0]]
            offsets = job.object_offsets[first : first + len(index)]
            rows = staging[: len(index)]
            if job.to_pool:
                for t, tensor in enumerate(job.tensors):
                    rows[:, int(starts[t]) : int(starts[t + 1])].copy_(tensor.index_select(0, index))
            self._move_rows(job, rows, offsets)
            if not job.to_pool:
                for t, tensor in enumerate(job.tensors):
                    tensor.index_copy_(0, index, rows[:, int(starts[t]) : int(starts[t + 1])])

    def _move_rows(self, job: CopyJob, rows: torch.Tensor, offsets: Sequence[int]) -> None:
        """One DMA per staged row, between it and its block's slice in the pool."""
        plan = job.plan
        assert plan.object_offset is not None, "a contiguous plan"
        if self._dma is not None:
            row_bytes = rows.stride(0) * rows.element_size()
            staged = rows.data_ptr() + np.arange(len(offsets), dtype=np.uint64) * np.uint64(row_bytes)
            pooled = np.asarray(offsets, dtype=np.uint64) + np.uint64(job.pool_address + plan.object_offset)
            sizes = np.full(len(offsets), plan.slice_bytes, dtype=np.uint64)
            sources, destinations = (staged, pooled) if job.to_pool else (pooled, staged)
            self._dma.copy_pointers(sources, destinations, sizes, job.to_pool)
            return
        for row, offset in enumerate(offsets):
            at = offset + plan.object_offset
            pooled_bytes = job.pool[at : at + plan.slice_bytes]
            if job.to_pool:
                pooled_bytes.copy_(rows[row], non_blocking=True)
            else:
                rows[row].copy_(pooled_bytes, non_blocking=True)

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The job's block ids on the device, uploaded once per job without stalling the host:
        ``torch.tensor(ids, device=...)`` copies from pageable memory and synchronizes every pass.
        torch's pinned allocator keeps the host buffer until the copy completed."""
        host = torch.tensor(list(block_ids), dtype=torch.int64)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)


# ---- choosing one ------------------------------------------------------------------------------


class Side(Protocol):
    """What the self-test needs of ``kvtier.gpu.device``'s sides: the jobs' stream and its events."""

    def running(self, ready: Any) -> AbstractContextManager[Any]: ...

    def done_marker(self) -> Any: ...

    def wait(self, marker: Any) -> None: ...


# Below this mean page size a contiguous plan is copied staged first. The H200 runs (docs/gpu.md),
# DRAM→GPU GB/s, per-page batch against staged: 18 KiB pages 3.7 against 31, 32 KiB 23 against
# 22-35, 64 KiB 36-45 against 36-39, 72 KiB 40 against 30.
STAGED_FIRST_BELOW_PAGE_BYTES = 48 << 10


def gpu_candidates(device: torch.device, plan: CopyPlan) -> list[tuple[str, Any]]:
    """Executors to try for ``plan``, the preferred first."""
    batched: list[tuple[str, Any]] = [
        ("cuMemcpyBatchAsync", lambda: DriverBatchExecutor(device)),
        ("vLLM's swap_blocks_batch", VllmSwapExecutor),
    ]
    if not plan.contiguous:
        return batched
    staged: list[tuple[str, Any]] = [
        ("staged index copies, batched DMA", lambda: StagedExecutor(device, dma=DriverBatchExecutor(device))),
        ("staged index copies", lambda: StagedExecutor(device)),
    ]
    small_pages = plan.slice_bytes / plan.segment_count < STAGED_FIRST_BELOW_PAGE_BYTES
    return staged + batched if small_pages else batched + staged


def choose(
    device: torch.device, plan: CopyPlan, side: Side, candidates: list[tuple[str, Any]] | None = None
) -> Executor:
    """The executor for KV caches on ``device``: on a GPU the first that passes its self-test on
    ``side``'s stream (``candidates``: label and constructor, first preferred)."""
    if device.type == "cpu" and candidates is None:
        return HostExecutor()
    failures = []
    for label, make in candidates if candidates is not None else gpu_candidates(device, plan):
        try:
            executor = make()
            self_test(executor, device, side)
        except Exception as error:
            failures.append(f"{label}: {error}")
            continue
        if failures:
            logger.info("kvtier: GPU copies use %s (%s)", executor.name, "; ".join(failures))
        return executor
    raise RuntimeError(
        "kvtier found no way to copy this rank's KV-cache blocks to and from the host pool: "
        + "; ".join(failures)
        + ". A CUDA 12.8+ driver (cuMemcpyBatchAsync) or GPU vLLM covers every layout; without them only "
        "placements that keep a rank's slice in one range work (TP=1, or the default rank-major placement)"
    )


def self_test(executor: Executor, device: torch.device, side: Side, blocks: int = 4, page_bytes: int = 4096) -> None:
    """One small job each way through ``executor`` on ``side``'s stream, between a device tensor and
    pinned host memory, checked byte for byte. Raises when the executor moved anything but the
    expected bytes."""
    plan = CopyPlan([page_bytes, page_bytes], [(0, 0, 2 * page_bytes)], 2 * page_bytes)
    generator = torch.Generator(device="cpu").manual_seed(7)
    expected = torch.randint(0, 256, (2, blocks * 2, page_bytes), dtype=torch.uint8, generator=generator)
    tensors = [expected[0].to(device), expected[1].to(device)]
    pool = torch.zeros(blocks * 2 * page_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    ids = list(range(1, 2 * blocks, 2))
    offsets = [i * 2 * page_bytes for i in range(blocks)]
    job = CopyJob(plan, tensors, ids, offsets, pool, pool.data_ptr(), to_pool=True)
    run_on(side, executor, job)
    stored = pool.view(blocks, 2, page_bytes)
    if not (torch.equal(stored[:, 0], expected[0][ids]) and torch.equal(stored[:, 1], expected[1][ids])):
        raise RuntimeError("the self-test's store moved the wrong bytes")
    back = [torch.zeros_like(t) for t in tensors]
    run_on(side, executor, CopyJob(plan, back, ids, offsets, pool, pool.data_ptr(), to_pool=False))
    if not (torch.equal(back[0][ids].cpu(), expected[0][ids]) and torch.equal(back[1][ids].cpu(), expected[1][ids])):
        raise RuntimeError("the self-test's load moved the wrong bytes")


def run_on(side: Side, executor: Executor, job: CopyJob) -> None:
    """The job's copies on the side stream (after the caller's work, as a job runs), then waited for
    (the self-test's and the benchmarks' single jobs)."""
    if isinstance(job.tensors[0], torch.Tensor) and job.tensors[0].is_cuda:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(job.tensors[0].device))  # the tensors' uploads above
    else:
        ready = None
    with side.running(ready):
        executor.copy(job)
        marker = side.done_marker()
    side.wait(marker)
