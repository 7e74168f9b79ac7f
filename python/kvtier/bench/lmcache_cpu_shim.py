"""CPU copy shim for LMCache's vLLM connector, so that ``kvtier bench ttft`` can run LMCache on a CPU host.

This module exists only for the benchmark. LMCache (0.5.6) moves KV data between the serving
engine's paged cache and its own chunk memory objects through a "GPU connector", and it ships
connectors for cuda, xpu, musa and hpu only. On vLLM's CPU build its factory raises "No supported
cpu connector found", LMCacheConnectorV1 logs "degraded mode (recompute)" and serves no hits.

:class:`CPUPagedKVConnector` is a small copy routine written for this project (plain torch indexing,
no LMCache kernels) between:

- vLLM-CPU's per-layer KV tensors, ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``,
  which the CPU attention backend reads as ``[num_blocks, num_kv_heads, 2, block_size, head_size]``
  (keys then values inside each block and head), addressed by vLLM's slot mapping
  (``block_id * block_size + offset`` per token);
- LMCache's chunk memory objects in its ``KV_2LTD`` format, ``[2, num_layers, tokens, heads * head_size]``.

Tokens are copied as runs of consecutive slots inside one vLLM block (one strided tensor copy per
run and layer). Its cost is part of the LMCache figure the benchmark reports.

:func:`install` wraps LMCache's connector factory (``lmcache.v1.gpu_connector.CreateGPUConnector``,
which LMCache's vLLM service factory looks up when the worker builds its engine) so that a vLLM
engine on the CPU device gets this connector; every other case goes to LMCache's own factory. Call
it in the engine process before the vLLM engine starts (the patch itself is applied when vLLM
creates its KV connector). Runs using it are labeled
"LMCache + CPU copy shim" in the benchmark's tables.

:data:`COUNTERS` counts what went through the shim and what LMCache's local disk backend read, so
that the benchmark can check that a hit was really served, and served from disk.
"""

from __future__ import annotations

import threading
from typing import Any, Self

import torch

COUNTERS: dict[str, int] = {
    "stored_tokens": 0,  # tokens copied from vLLM's cache into LMCache memory objects
    "loaded_tokens": 0,  # tokens copied from LMCache memory objects into vLLM's cache
    "disk_chunks_read": 0,  # chunks LocalDiskBackend loaded from its files
    "disk_chunks_missed": 0,  # chunks LocalDiskBackend was asked for and did not return
}
_counters_lock = threading.Lock()
_installed = False


def _count(name: str, value: int) -> None:
    with _counters_lock:
        COUNTERS[name] += value


def counters() -> dict[str, int]:
    with _counters_lock:
        return dict(COUNTERS)


def _connector_base():
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    return GPUConnectorInterface


class _PagedKVCopier:
    """Copies KV between vLLM-CPU's paged per-layer tensors and LMCache KV_2LTD memory objects.

    Plain torch: only the connector's base class comes from LMCache, which must be imported late (see
    install), so _make_connector_class puts this class in front of that base when LMCache is loaded."""

    kv_format: Any  # LMCache's MemoryFormat.KV_2LTD, set by _make_connector_class

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, chunk_size: int, dtype: torch.dtype):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.chunk_size = chunk_size
        self.dtype = dtype
        self.kvcaches: list[torch.Tensor] | None = None
        self._views: list[torch.Tensor] | None = None
        self._views_source: list[int] = []
        self.block_size = 0

    # LMCache's factory signature hands us its metadata; kv_shape is
    # (num_layers, 2, chunk_size, num_kv_heads, head_size).
    @classmethod
    def from_metadata(cls, metadata: Any) -> Self:
        num_layers, kv_size, chunk_size, num_kv_heads, head_size = metadata.kv_shape
        if metadata.use_mla or kv_size != 2:
            raise RuntimeError("kvtier's LMCache CPU shim supports K/V attention only (no MLA)")
        return cls(num_layers, num_kv_heads, head_size, chunk_size, metadata.kv_dtype)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_size])

    def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
        if "kvcaches" in kwargs:
            self.kvcaches = list(kwargs["kvcaches"])

    def _layer_views(self) -> list[torch.Tensor]:
        """Per layer, vLLM's tensor seen as [blocks, heads, 2 (K, V), block_size, head_size]."""
        if self.kvcaches is None:
            raise RuntimeError("LMCache CPU shim: no KV caches were passed (kvcaches kwarg)")
        source = [tensor.data_ptr() for tensor in self.kvcaches]
        if self._views is not None and source == self._views_source:
            return self._views
        if len(self.kvcaches) != self.num_layers:
            raise RuntimeError(f"LMCache CPU shim: {len(self.kvcaches)} KV tensors for {self.num_layers} layers")
        views = []
        for tensor in self.kvcaches:
            if tensor.device.type != "cpu" or tensor.dim() != 4:
                raise RuntimeError(
                    f"LMCache CPU shim: expected 4-d CPU KV tensors, got {tuple(tensor.shape)} on {tensor.device}"
                )
            num_blocks, heads, block_size, width = tensor.shape
            if heads != self.num_kv_heads or width != 2 * self.head_size:
                raise RuntimeError(
                    "LMCache CPU shim: KV tensor shape "
                    f"{tuple(tensor.shape)} is not [blocks, {self.num_kv_heads} heads, block, 2 * {self.head_size}]"
                )
            if tensor.dtype != self.dtype:
                raise RuntimeError(f"LMCache CPU shim: KV dtype {tensor.dtype}, LMCache expects {self.dtype}")
            views.append(tensor.view(num_blocks, heads, 2, block_size, self.head_size))
            self.block_size = block_size
        self._views, self._views_source = views, source
        return views

    def _runs(self, kwargs: dict, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """Tokens start..end as runs (first, last + 1 relative to start, block, offset) of
        consecutive slots inside one block: each run is one strided copy per layer."""
        if "slot_mapping" not in kwargs:
            raise ValueError("LMCache CPU shim: 'slot_mapping' should be provided in kwargs")
        slots = kwargs["slot_mapping"][start:end].to("cpu", torch.long).tolist()
        runs = []
        index = 0
        while index < len(slots):
            slot = slots[index]
            if slot < 0:
                raise RuntimeError("LMCache CPU shim: negative slot in the range to copy")
            block, offset = divmod(slot, self.block_size)
            stop = index + 1
            while (
                stop < len(slots) and slots[stop] == slot + (stop - index) and offset + (stop - index) < self.block_size
            ):
                stop += 1
            runs.append((index, stop, block, offset))
            index = stop
        return runs

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """vLLM's paged cache (tokens start..end of the request) -> memory object."""
        self.initialize_kvcaches_ptr(**kwargs)
        views = self._layer_views()
        runs = self._runs(kwargs, start, end)
        count = end - start
        target = memory_obj.tensor
        if target is None:
            raise RuntimeError("LMCache CPU shim: memory object has no tensor")
        target = target[:, :, :count].view(2, self.num_layers, count, self.num_kv_heads, self.head_size)
        for layer, view in enumerate(views):
            for first, stop, block, offset in runs:
                # [heads, 2, tokens, head_size] in vLLM -> [2, tokens, heads, head_size] in LMCache.
                target[:, layer, first:stop].copy_(
                    view[block, :, :, offset : offset + stop - first].permute(1, 2, 0, 3)
                )
        memory_obj.metadata.fmt = self.kv_format
        _count("stored_tokens", count)

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """Memory object -> vLLM's paged cache, skipping tokens vLLM already has cached."""
        self.initialize_kvcaches_ptr(**kwargs)
        if memory_obj.metadata.fmt != self.kv_format:
            raise ValueError(f"LMCache CPU shim: memory object format {memory_obj.metadata.fmt}, expected KV_2LTD")
        views = self._layer_views()
        vllm_cached = int(kwargs.get("vllm_cached_tokens", 0) or 0)
        skip = min(end - start, max(0, vllm_cached - start))
        if skip == end - start:
            return
        runs = self._runs(kwargs, start + skip, end)
        count = end - start
        source = memory_obj.tensor[:, :, :count].view(2, self.num_layers, count, self.num_kv_heads, self.head_size)
        source = source[:, :, skip:]
        for layer, view in enumerate(views):
            for first, stop, block, offset in runs:
                view[block, :, :, offset : offset + stop - first].copy_(
                    source[:, layer, first:stop].permute(2, 0, 1, 3)
                )
        _count("loaded_tokens", count - skip)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs: Any) -> None:
        for memory_obj, start, end in zip(memory_objs or [], starts or [], ends or [], strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)


def _make_connector_class():
    from lmcache.v1.memory_management import MemoryFormat

    class CPUPagedKVConnector(_PagedKVCopier, _connector_base()):  # type: ignore[misc]  # LMCache's base, imported late (see install)
        """Copies KV between vLLM-CPU's paged per-layer tensors and LMCache KV_2LTD memory objects."""

        kv_format = MemoryFormat.KV_2LTD

    return CPUPagedKVConnector


def _count_disk_reads() -> None:
    """Wraps LocalDiskBackend's blocking reads to count chunks loaded from disk (behaviour unchanged)."""
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    original_get = LocalDiskBackend.get_blocking
    original_batched = LocalDiskBackend.batched_get_blocking

    def get_blocking(self, key):
        result = original_get(self, key)
        _count("disk_chunks_read" if result is not None else "disk_chunks_missed", 1)
        return result

    def batched_get_blocking(self, keys):
        if len(keys) <= 1:  # LMCache's own method goes through get_blocking (counted there)
            return original_batched(self, keys)
        results = original_batched(self, keys)
        found = sum(result is not None for result in results)
        _count("disk_chunks_read", found)
        _count("disk_chunks_missed", len(results) - found)
        return results

    LocalDiskBackend.get_blocking = get_blocking
    LocalDiskBackend.batched_get_blocking = batched_get_blocking


COUNTERS_FILE_ENV = "KVTIER_LMCACHE_SHIM_COUNTERS"  # prefix of the files where processes publish COUNTERS
COUNTERS_FILE_PERIOD_S = 0.25


def _publish_counters(prefix: str) -> None:
    """Writes COUNTERS to ``<prefix>.<pid>.json`` every COUNTERS_FILE_PERIOD_S (write, then rename: a
    reader never sees half a file). Under ``vllm serve`` LMCache's connector lives in two processes
    the benchmark cannot ask, the engine core (scheduler side) and its worker (the copies): one file
    per process, which the reader sums."""
    import json
    import os
    import time

    pid = os.getpid()
    path, temporary = f"{prefix}.{pid}.json", f"{prefix}.{pid}.tmp"

    def loop() -> None:
        while True:
            with open(temporary, "w") as handle:
                json.dump({**counters(), "pid": pid}, handle)
            os.replace(temporary, path)
            time.sleep(COUNTERS_FILE_PERIOD_S)

    threading.Thread(target=loop, name="kvtier-lmcache-shim-counters", daemon=True).start()


def _patch_lmcache_factory() -> None:
    global _installed
    if _installed:
        return
    import os

    if os.environ.get(COUNTERS_FILE_ENV):
        _publish_counters(os.environ[COUNTERS_FILE_ENV])
    import lmcache.v1.gpu_connector as factory_module
    from lmcache import torch_device_type
    from lmcache.utils import EngineType

    original_factory = factory_module.CreateGPUConnector
    connector_class = _make_connector_class()

    def create_connector(config, metadata, engine, layout_hints=None):
        if engine == EngineType.VLLM and torch_device_type == "cpu":
            if config.use_layerwise or config.enable_blending:
                raise ValueError("kvtier's LMCache CPU shim supports use_layerwise=False, enable_blending=False only")
            return connector_class.from_metadata(metadata)
        return original_factory(config, metadata, engine, layout_hints=layout_hints)

    factory_module.CreateGPUConnector = create_connector
    _count_disk_reads()
    _installed = True


def install() -> None:
    """Routes LMCache's connector factory to the CPU copy routine for vLLM on the CPU device.

    Call it in the engine process before the vLLM engine starts; idempotent. LMCache itself is
    imported only when vLLM creates its KV connector: importing it earlier loads numba/llvmlite,
    whose objects break vLLM-CPU's kernel-override scan of ``sys.modules`` at worker start
    (``'_lib_fn_wrapper' object has no attribute 'get'``)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if getattr(KVConnectorFactory, "_kvtier_lmcache_shim", False):
        return
    original_create = KVConnectorFactory.create_connector  # bound to the class

    def create_connector(cls, *args, **kwargs):
        _patch_lmcache_factory()
        return original_create(*args, **kwargs)

    # Patching vLLM's factory is what this shim is for.
    KVConnectorFactory.create_connector = classmethod(create_connector)  # type: ignore[method-assign,assignment]
    KVConnectorFactory._kvtier_lmcache_shim = True  # type: ignore[attr-defined]
