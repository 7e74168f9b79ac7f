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

from kvtier.service import ENGINE_PIN_LEASE_MAX_S, default_socket_dir, private_dir
from kvtier.vllm.backend import ServiceBackend
from kvtier.vllm.connection import ServiceConnection
from kvtier.vllm.costs import load_costs
from kvtier.vllm.events import EventFeed, direct_offload_key
from kvtier.vllm.idle_publish import idle_publisher_of_this_engine
from kvtier.vllm.local_store import acquire_store, find_engine_store
from kvtier.vllm.logs import follow_vllm_logging
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
        follow_vllm_logging()
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
        self._description: dict[str, Any] | None = None

    def _hash_algo(self) -> str | None:
        if self.vllm_config is None:
            return None
        return getattr(self.vllm_config.cache_config, "prefix_caching_hash_algo", None)

    def _service_connection(
        self,
        rank: int,
        labelled: bool = True,
        scheduler: bool = False,
        copies: bool = False,
        starts_service: bool = True,
    ) -> ServiceConnection:
        """``scheduler``: a connection of the engine-core process (lookups, pins, prefetches, events),
        whose calls hold up vLLM's engine loop: bounded by ``service_timeout_ms``. A worker's
        transfers run on its own job thread, bounded by ``job_timeout_ms``. ``copies``: a worker's
        connection, which faults the pool in at attach (the others never copy). ``starts_service``
        False: one that only follows a running service (the event feed)."""
        if self.config.worker_kv_bytes_per_block <= 0:
            raise KvtierVllmConfigError(
                "vLLM did not say how many KV bytes a worker holds per block (worker_kv_bytes_per_block); "
                "kvtier's host service needs it to size the shared pool's slices"
            )
        return ServiceConnection(
            self.options,
            self._service_description(),
            self.config.parallel.tp_size,
            rank,
            self.config.worker_kv_bytes_per_block,
            label=self._engine_label() if labelled else "",
            timeout_ms=self.options.service_timeout_ms if scheduler else self.options.job_timeout_ms,
            populate_pool=copies,
            starts_service=starts_service,
        )

    def _service_description(self) -> dict[str, Any]:
        """The host-service namespace, computed once per process: it fingerprints the model's weights
        (seconds for a large model). The prefetcher's and the event feed's connections open lazily,
        on a request's path: they must not hash the weights again there (issue 37, item 7). Once is
        also right: the engine serves the weights it loaded at start, whatever is on disk later."""
        if self._description is None:
            self._description = service_namespace_description(
                self.config,
                hash_algo=self._hash_algo(),
                model_revision=self._model_revision(),
                salt=self.options.namespace_salt,
                download_dir=self._download_dir(),
            )
        return self._description

    def _model_revision(self) -> str | None:
        return getattr(getattr(self.vllm_config, "model_config", None), "revision", None)

    def _download_dir(self) -> str | None:
        return getattr(getattr(self.vllm_config, "load_config", None), "download_dir", None)

    def _engine_label(self) -> str:
        return self.options.engine_label or str(getattr(self.config, "engine_id", "") or "")

    def get_manager(self) -> OffloadingManager:
        _log_route_once(self.vllm_config)
        if self.options.host_service:
            check_hash_algo(self._hash_algo())
            # Below the host service's own lease on a silent connection's pins (600 s,
            # ServiceConfig::pin_lease_ms): the service never lets go of a pin this engine relies on.
            pin_lease_s = min(max(60.0, 2 * self.options.job_timeout_ms / 1000), ENGINE_PIN_LEASE_MAX_S)
            # The prefetcher's reads are not the engine's loads: its connection stays out of the
            # per-engine counters. They run on its own thread, a chunk taking as long as its tier
            # needs (a slow link): bounded as a worker's calls, while a request waits for them only
            # as long as chunks keep ending (Prefetcher). The event feed's calls are the scheduler's;
            # its polls, made while the engine idles, never start a service stopped on purpose.
            prefetch_connection = lambda: self._service_connection(rank=0, labelled=False)  # noqa: E731
            feed_connection = lambda: self._service_connection(  # noqa: E731
                rank=0, labelled=False, scheduler=True, starts_service=False
            )
            pending_timeout_s = self.options.service_timeout_ms / 1000
            prefetcher = Prefetcher(prefetch_connection, pending_timeout_s) if self.options.prefetch else None
            # vLLM drains take_events() only when its KV-event publisher is on.
            events = None
            if getattr(self.config, "enable_kv_cache_events", False):
                idle = idle_publisher_of_this_engine()
                events = EventFeed(
                    feed_connection,
                    direct_offload_key(self.config.groups[0].group_id),
                    wake=idle.ask if idle is not None else None,
                )
            manager = KvtierManager(
                ServiceBackend(self._service_connection(rank=0, scheduler=True), prefetcher, events),
                pin_lease_s,
                self.options.admission,
                self.options.admission_memory_blocks,
                config_info=self.options.config_info(),
                pending_timeout_s=pending_timeout_s,
                load_policy=self.options.load_policy,
                block_tokens=self.config.groups[0].tokens_per_block,
                load_wait_max_ratio=self.options.load_wait_max_ratio,
            )
            self._learn_costs(manager)
            return manager
        local = find_engine_store(self.options, self.config.engine_id)
        if local is None:
            raise KvtierVllmConfigError(
                f"kvtier: the scheduler found no kvtier store opened by this engine's worker in this process "
                f"(pid {os.getpid()}). kvtier needs vLLM's scheduler and worker in one process: set "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0 in the environment and distributed_executor_backend='uni' "
                "(--distributed-executor-backend uni); CPU vLLM otherwise forces the multiprocess executor."
            )
        manager = KvtierManager(
            local,
            max(60.0, 2 * self.options.job_timeout_ms / 1000),
            self.options.admission,
            self.options.admission_memory_blocks,
            config_info=self.options.config_info(),
            load_policy=self.options.load_policy,
            block_tokens=self.config.groups[0].tokens_per_block,
            load_wait_max_ratio=self.options.load_wait_max_ratio,
        )
        self._learn_costs(manager)
        return manager

    def _learn_costs(self, manager: KvtierManager) -> None:
        """Starts the manager's load-or-recompute model from what the last engine of this model on
        this host learned (its costs file, next to the service sockets), and keeps it there."""
        decider = manager.decider
        decider.worker_block_bytes = self.config.worker_kv_bytes_per_block
        if decider.policy != "auto":
            return
        description = self._service_description()
        try:
            directory = private_dir(default_socket_dir())
        except Exception as error:  # no private place for it: learn from scratch, save nothing
            logger.warning("kvtier: no private directory for the costs file (%s); learning costs anew", error)
            return
        decider.costs_path = directory / f"costs-{namespace_digest(description).hex()[:32]}.json"
        if load_costs(decider, decider.costs_path):
            logger.info("kvtier: load-or-recompute model restored from %s", decider.costs_path)

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
            return self._service_worker(group_refs, tensors, layer_buffers, page_bytes)
        description = namespace_description(
            self.config,
            page_bytes_per_layer=page_bytes_per_layer,
            hash_algo=self._hash_algo(),
            model_revision=self._model_revision(),
            salt=self.options.namespace_salt,
            download_dir=self._download_dir(),
        )
        namespace = namespace_digest(description)
        local = acquire_store(self.options, self.config.engine_id, namespace, description, object_bytes)
        return KvtierWorker(local, layer_buffers, page_bytes, self.options.job_timeout_ms)

    def _service_worker(
        self, group_refs: Any, tensors: list[torch.Tensor], layer_buffers: list[Any], page_bytes: int
    ) -> OffloadingWorker:
        """This rank's worker in the host-service layout: its connection, then a GPU or CPU worker."""
        on_gpu = tensors[0].device.type == "cuda"
        object_bytes = page_bytes * len(tensors)
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

            return GpuServiceWorker(
                connection, rank_tensors(tensors), self.options.job_timeout_ms, self.options.service_timeout_ms
            )
        return ServiceWorker(
            connection,
            layer_buffers,
            page_bytes,
            self.options.job_timeout_ms,
            defer_stores=self.options.defer_stores,
            deferred_store_max_blocks=self.options.deferred_store_max_blocks,
            stall_timeout_ms=self.options.service_timeout_ms,
        )
