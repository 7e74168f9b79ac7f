"""``KvtierOffloadingSpec``: the spec vLLM's ``OffloadingConnector`` builds, and the vLLM config it
derives the namespace from."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvtier.vllm.connection import ServiceBackend, ServiceConnection
from kvtier.vllm.events import EventFeed, direct_offload_key
from kvtier.vllm.local_store import acquire_store, find_engine_store
from kvtier.vllm.manager import KvtierManager
from kvtier.vllm.metrics import kvtier_metric_definitions
from kvtier.vllm.namespace import (
    canonical_placement,
    check_hash_algo,
    namespace_description,
    namespace_digest,
    rank_independent_objects,
    service_namespace_description,
)
from kvtier.vllm.options import CONFIG_INFO_KEYS, KvtierOptions, KvtierVllmConfigError
from kvtier.vllm.prefetch import Prefetcher
from kvtier.vllm.worker import GpuServiceWorker, KvtierWorker, ServiceWorker

logger = logging.getLogger("kvtier.vllm")


_constructing = threading.local()


# How far up the stack the spec looks for the connector that is building it.
_CONNECTOR_FRAME_DEPTH = 12


def _current_vllm_config() -> Any | None:
    """The vLLM config of the engine whose connector is building this spec.

    vLLM hands a spec only the ``OffloadingConfig``, which lacks what the namespace needs (the prefix
    hash algorithm, the model revision). ``KvtierConnector`` passes the config on; under vLLM's plain
    ``OffloadingConnector`` the spec is built inside that connector's ``__init__``, whose
    ``vllm_config`` argument is on the stack. vLLM's process-wide "current" config is the last
    resort: the engine-core process does not set it while it builds the scheduler's connector, so
    relying on it alone gave the scheduler and the workers different namespaces (no hit ever).
    """
    config = getattr(_constructing, "vllm_config", None)
    if config is not None:
        return config
    frame: Any = sys._getframe(1)
    for _ in range(_CONNECTOR_FRAME_DEPTH):
        if frame is None:
            break
        candidate = frame.f_locals.get("vllm_config")
        if type(candidate).__name__ == "VllmConfig":
            return candidate
        frame = frame.f_back
    try:
        from vllm.config import get_current_vllm_config_or_none

        return get_current_vllm_config_or_none()
    except ImportError:
        return None


_route_logged = False


def _log_route_once(vllm_config: Any) -> None:
    """Says once per process which connector route this engine takes, and what the plain one lacks."""
    global _route_logged
    if _route_logged:
        return
    _route_logged = True
    connector = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector", None)
    if connector == "KvtierConnector":
        return
    logger.warning(
        "kvtier: running under vLLM's %s with kvtier's spec: hits are the same as with KvtierConnector, but a "
        "block that fails verification cannot be recomputed (vLLM stops the engine rather than use it) and "
        "stores are not held back during prefill steps. Set kv_connector='KvtierConnector' with "
        "kv_connector_module_path='kvtier.vllm' for both",
        connector,
    )


def refuse_sleep_mode(vllm_config: Any) -> None:
    """Sleep mode frees and remaps the KV-cache memory that kvtier's workers copy blocks into and out
    of, and vLLM's offloading connector does not re-register it on wake-up: a load after a wake-up
    would write pages that no longer belong to the KV cache."""
    if getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False):
        raise KvtierVllmConfigError(
            "kvtier does not support vLLM's sleep mode (it frees and remaps the KV cache that kvtier copies "
            "blocks into): start the engine without enable_sleep_mode (--enable-sleep-mode), or without kvtier"
        )


class KvtierOffloadingSpec(OffloadingSpec):
    """kvtier as an OffloadingSpec; options come from kv_connector_extra_config."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return kvtier_metric_definitions()

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """vLLM 0.33+: the labels of ``vllm:kv_offload_config_info`` the manager fills."""
        return CONFIG_INFO_KEYS

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        self.options = KvtierOptions.from_extra_config(config.extra_config)
        self.vllm_config = _current_vllm_config()
        if self.vllm_config is None:
            raise KvtierVllmConfigError(
                "kvtier: the spec was built outside a vLLM connector (no vLLM config found), so it cannot derive "
                "the namespace every process of the engine must share. Configure it through vLLM's "
                '"kv_connector": "KvtierConnector" (kvtier.vllm.kv_transfer_config) or "OffloadingConnector" '
                "with spec_name/spec_module_path"
            )
        refuse_sleep_mode(self.vllm_config)
        if self.blocks_per_chunk != 1:
            raise KvtierVllmConfigError(
                f"kvtier stores one object per engine block; remove block_size/blocks_per_chunk from "
                f"kv_connector_extra_config (got blocks_per_chunk={self.blocks_per_chunk})"
            )
        if len(config.groups) != 1:
            raise KvtierVllmConfigError(
                f"kvtier.vllm supports models with one KV-cache group (plain full attention); this model has "
                f"{len(config.groups)}"
            )
        parallel = config.parallel
        if not self.options.host_service and parallel.world_size != 1:
            raise KvtierVllmConfigError(
                f"with host_service=False the store lives in the engine's process, so kvtier supports one "
                f"worker per engine (TP=PP=1); this engine has world_size={parallel.world_size}. Leave "
                "host_service on (the default) for tensor parallelism"
            )
        if parallel.pp_size != 1 or parallel.pcp_size != 1 or parallel.dcp_size != 1:
            raise KvtierVllmConfigError(
                f"kvtier supports tensor parallelism but not pipeline or context parallelism yet (pp_size="
                f"{parallel.pp_size}, pcp_size={parallel.pcp_size}, dcp_size={parallel.dcp_size}): each stage "
                "would hold a different part of a block. Run with pipeline_parallel_size=1"
            )
        self._connection: ServiceConnection | None = None

    def _hash_algo(self) -> str | None:
        if self.vllm_config is None:
            return None
        return getattr(self.vllm_config.cache_config, "prefix_caching_hash_algo", None)

    def _service_connection(self, rank: int, labelled: bool = True, copies: bool = False) -> ServiceConnection:
        if self.config.worker_kv_bytes_per_block <= 0:
            raise KvtierVllmConfigError(
                "vLLM did not say how many KV bytes a worker holds per block (worker_kv_bytes_per_block); "
                "kvtier's host service needs it to size the shared pool's slices"
            )
        description = service_namespace_description(
            self.config,
            hash_algo=self._hash_algo(),
            model_revision=getattr(getattr(self.vllm_config, "model_config", None), "revision", None),
            salt=self.options.namespace_salt,
        )
        return ServiceConnection(
            self.options,
            description,
            self.config.parallel.tp_size,
            rank,
            self.config.worker_kv_bytes_per_block,
            label=self._engine_label() if labelled else "",
            populate_pool=copies,
        )

    def _engine_label(self) -> str:
        return self.options.engine_label or str(getattr(self.config, "engine_id", "") or "")

    def get_manager(self) -> OffloadingManager:
        _log_route_once(self.vllm_config)
        if self.options.host_service:
            check_hash_algo(self._hash_algo())
            pin_lease_s = max(60.0, 2 * self.options.job_timeout_ms / 1000)
            # The prefetcher's reads are not the engine's loads: its connection stays out of the
            # per-engine counters.
            prefetch_connection = lambda: self._service_connection(rank=0, labelled=False)  # noqa: E731
            prefetcher = Prefetcher(prefetch_connection) if self.options.prefetch else None
            # vLLM drains take_events() only when its KV-event publisher is on.
            events = None
            if getattr(self.config, "enable_kv_cache_events", False):
                events = EventFeed(prefetch_connection, direct_offload_key(self.config.groups[0].group_id))
            return KvtierManager(
                ServiceBackend(self._service_connection(rank=0), prefetcher, events),
                pin_lease_s,
                self.options.admission,
                self.options.admission_memory_blocks,
                config_info=self.options.config_info(),
            )
        shared = find_engine_store(self.options, self.config.engine_id)
        if shared is None:
            raise KvtierVllmConfigError(
                f"kvtier: the scheduler found no kvtier store opened by this engine's worker in this process "
                f"(pid {os.getpid()}). kvtier needs vLLM's scheduler and worker in one process: set "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0 in the environment and distributed_executor_backend='uni' "
                "(--distributed-executor-backend uni); CPU vLLM otherwise forces the multiprocess executor."
            )
        return KvtierManager(
            shared,
            max(60.0, 2 * self.options.job_timeout_ms / 1000),
            self.options.admission,
            self.options.admission_memory_blocks,
            config_info=self.options.config_info(),
        )

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        check_hash_algo(self._hash_algo())
        (group_refs,) = kv_caches.group_data_refs
        tensors: list[torch.Tensor] = []
        page_bytes_per_layer: list[int] = []
        seen_tensors: set[int] = set()
        for ref in group_refs:
            if ref.tensor_idx in seen_tensors:
                raise KvtierVllmConfigError("kvtier.vllm does not support layers that share KV-cache memory")
            seen_tensors.add(ref.tensor_idx)
            canonical = kv_caches.tensors[ref.tensor_idx]
            tensor = canonical.tensor
            if tensor.device.type not in ("cpu", "cuda"):
                raise KvtierVllmConfigError(
                    f"kvtier.vllm moves KV caches on CUDA GPUs or in host memory, not on {tensor.device}"
                )
            if not tensor.is_contiguous():
                raise KvtierVllmConfigError(
                    "kvtier.vllm needs each layer's KV cache as one contiguous (num_blocks, page_bytes) tensor; "
                    f"got strides {tensor.stride()}"
                )
            tensors.append(tensor)
            page_bytes_per_layer.append(int(tensor.shape[1]))
        on_gpu = tensors[0].device.type == "cuda"
        if on_gpu and not self.options.host_service:
            raise KvtierVllmConfigError(
                "kvtier moves a GPU KV cache through the host service only; remove host_service=false from "
                "kv_connector_extra_config"
            )
        if len(set(page_bytes_per_layer)) != 1:
            raise KvtierVllmConfigError(
                f"kvtier.vllm needs equal page sizes in every layer, got {sorted(set(page_bytes_per_layer))}"
            )
        page_bytes = page_bytes_per_layer[0]
        object_bytes = page_bytes * len(tensors)
        layer_buffers = [] if on_gpu else [tensor.numpy() for tensor in tensors]
        if self.options.host_service:
            if object_bytes != self.config.worker_kv_bytes_per_block:
                raise KvtierVllmConfigError(
                    f"this rank's KV cache holds {object_bytes} bytes per block but vLLM reports "
                    f"worker_kv_bytes_per_block={self.config.worker_kv_bytes_per_block}; kvtier cannot size its "
                    "slices (an unsupported KV-cache layout)"
                )
            connection = self._service_connection(rank=self.config.parallel.rank, copies=True)
            if rank_independent_objects(self.config):
                connection.set_placement(canonical_placement(group_refs, page_bytes))
            if on_gpu:
                from kvtier.gpu.transfers import rank_tensors

                return GpuServiceWorker(connection, rank_tensors(tensors), self.options.job_timeout_ms)
            return ServiceWorker(
                connection,
                layer_buffers,
                page_bytes,
                self.options.job_timeout_ms,
                defer_stores=self.options.defer_stores,
                deferred_store_max_blocks=self.options.deferred_store_max_blocks,
            )
        description = namespace_description(
            self.config,
            page_bytes_per_layer=page_bytes_per_layer,
            hash_algo=self._hash_algo(),
            model_revision=getattr(getattr(self.vllm_config, "model_config", None), "revision", None),
            salt=self.options.namespace_salt,
        )
        namespace = namespace_digest(description)
        shared = acquire_store(self.options, self.config.engine_id, namespace, description, object_bytes)
        return KvtierWorker(shared, layer_buffers, page_bytes, self.options.job_timeout_ms)
