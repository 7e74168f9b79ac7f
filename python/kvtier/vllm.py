"""kvtier as the storage behind vLLM's OffloadingConnector (vLLM 0.32).

This module owns everything vLLM-specific:

- ``KvtierOffloadingSpec``: the ``OffloadingSpec`` named in ``kv_connector_extra_config``
  (``"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm"``).
- ``KvtierManager`` (scheduler side): lookups from the store's in-memory index, pins held from
  ``prepare_load`` to ``complete_load``, ``prepare_store`` skipping blocks already present.
- ``KvtierWorker`` (worker side): moves engine blocks to and from the store with batched,
  asynchronous jobs (one kvtier object per engine block: that block's page in every layer).
- ``KvtierConnector``: an ``OffloadingConnector`` that can report a failed load to vLLM, which then
  recomputes the affected blocks. Plain ``OffloadingConnector`` cannot (vLLM 0.32 asserts every
  transfer succeeded), so with it a failed load stops the engine rather than serving wrong bytes.
- The namespace: a digest of the model identity (path, fingerprint of config and weight files), KV
  dtype, layout, tokens per block, layers, parallel layout and the prefix-hash algorithm.
- Metrics: vLLM's ``vllm:kv_offload_*`` transfer metrics (bytes and seconds, from the worker's
  transfer results; with ``KvtierConnector`` also the older ``vllm:kv_offload_total_*`` ones per
  ``transfer_type``) and kvtier's own (``kvtier:*``: hits per tier, misses, bytes, evictions,
  dropped stores, checksum failures, capacity, load/store latency), emitted through the connector's
  metric hooks so they appear on vLLM's ``/metrics``.

Process layout (docs/architecture.md): the store lives in the host service (``kvtier serve``, one per
host and ``path``, started by the first engine that needs it). The manager (engine-core process) asks
it over a Unix socket; each rank's worker maps the service's shared DRAM pool and copies its own slice
of every block in and out. So vLLM's defaults work (multiprocess engine core, the multiprocess
executor, tensor parallelism), and every engine on the host with the same ``path`` shares one pool:
a prefix that one engine computed is a DRAM hit for the others, and outlives engine restarts.
``host_service: false`` keeps the store inside the engine's process instead (one process only:
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``distributed_executor_backend="uni"``, TP=1).

Recommended configuration::

    KVTransferConfig(
        kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm", kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm",
            "path": "/mnt/nvme/kvtier", "dram_bytes": 4 << 30, "nvme_bytes": 64 << 30,
        },
    )

Every ``kvtier.Store.open`` option is accepted in ``kv_connector_extra_config`` under its own name
(``path`` is required); see :data:`INTEGRATION_OPTION_DEFAULTS` for the few options of this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import sys
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
    CANONICAL_FORMAT_VERSION as CANONICAL_PAGE_FORMAT_VERSION,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.metrics.cache_hit_source import CacheHitSource

logger = logging.getLogger("kvtier.vllm")

SPEC_NAME = "KvtierOffloadingSpec"
SPEC_MODULE_PATH = "kvtier.vllm"
NAMESPACE_FORMAT_VERSION = 1

# Keys of kv_connector_extra_config that vLLM's OffloadingConnector itself reads.
VLLM_OFFLOADING_OPTION_NAMES = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "blocks_per_chunk",
        "block_size",
        "canonical_layout",
        "offload_prompt_only",
        "self_describing_kv_events",
        # vLLM 0.33: bytes a step may load synchronously (expedited loads).
        "sync_load_budget_bytes",
    }
)

INTEGRATION_OPTION_DEFAULTS: dict[str, Any] = {
    # Longest a worker waits for a store job that vLLM must fence before reusing its blocks.
    "job_timeout_ms": 120_000,
    # Extra string mixed into the namespace (for example a deployment name); "" = none.
    "namespace_salt": "",
    # Serve through the host service (one per host and path, shared by every engine; started on
    # demand). False: the store lives in the engine's own process, which needs vLLM's one-process
    # layout (VLLM_ENABLE_V1_MULTIPROCESSING=0, distributed_executor_backend="uni", TP=1).
    "host_service": True,
    # The service's Unix socket; "" = derived from `path` (kvtier.service.default_socket_path).
    "service_socket": "",
    # Where the service puts its shared-memory DRAM pools.
    "pool_dir": "/dev/shm",
    # For a service this engine starts: a model's pool is freed after this many seconds with no
    # engine attached (an engine restart within it still finds its blocks in DRAM), and the service
    # exits once it holds none.
    "service_idle_timeout_s": 300,
    # For a service this engine starts: the most DRAM the pools of all models on the host take
    # together; 0 = no host cap (each model's pool is dram_bytes).
    "host_dram_bytes": 0,
    # Longest a scheduler-side call to the service (lookup, pin) waits before it counts as a miss.
    "service_timeout_ms": 5_000,
    # Hold store copies while the engine runs a forward pass with prompt tokens in it (they compete
    # with prefill for the same cores and memory bandwidth); they run between steps, in decode steps
    # and when the engine idles. Needs kv_connector="KvtierConnector".
    "defer_stores": True,
    # Most blocks a worker holds back that way; a store job that would exceed it is dropped (counted).
    "deferred_store_max_blocks": 4096,
    # A lookup that finds a block on NVMe or in the shared tier has the service read it into the DRAM
    # pool in the background and answers HIT_PENDING until it is there: the request waits without
    # holding up the engine's step, and its load is then a DRAM copy.
    "prefetch": True,
    # Which computed blocks are stored: "all", or "second_sight" (a block is stored the second time
    # this engine computes it, so a prompt seen once costs no store).
    "admission": "all",
    # How many block keys "second_sight" remembers (least recently seen forgotten first).
    "admission_memory_blocks": 1 << 18,
    # This engine's name in the service's per-engine counters (kvtier_engine_* metrics); "" = vLLM's
    # engine_id (kv_transfer_config.engine_id: random per start unless set).
    "engine_label": "",
}

ADMISSION_POLICIES = ("all", "second_sight")

# Prefix-hash algorithms whose block hashes are the same in every process.
STABLE_HASH_ALGOS = frozenset({"sha256", "sha256_cbor"})
SEEDED_HASH_ALGOS = frozenset({"xxhash", "xxhash_cbor"})


class KvtierVllmConfigError(ValueError):
    """The vLLM configuration cannot be served by kvtier; the message says what to change."""


# --------------------------------------------------------------------------------------------
# Keys and namespace
# --------------------------------------------------------------------------------------------

KVTIER_KEY_BYTES = 32


def kvtier_key(offload_key: OffloadKey) -> bytes:
    """The 32-byte kvtier key of a vLLM offload key (block hash + 4-byte KV-cache group index).

    A sha256 block hash of group 0 is used as is (the key is the engine's chained prefix hash);
    any other hash length or group is folded into 32 bytes with sha256.
    """
    block_hash, group_bytes = offload_key[:-4], offload_key[-4:]
    if len(block_hash) == KVTIER_KEY_BYTES and group_bytes == b"\0\0\0\0":
        return bytes(block_hash)
    return hashlib.sha256(b"kvtier.vllm.key\0" + bytes(offload_key)).digest()


def model_fingerprint(model: str, revision: str | None = None) -> str:
    """sha256 over the model's config.json, its safetensors index and the full contents of its weight files.

    Contents, not sizes or timestamps: a model rewritten in place (a fine-tune saved over the old
    weights) must never be served the old model's KV blocks, and two replicas holding the same weights
    under different paths or copy times must share them. For a model that is not a local directory (a
    hub name), the name and revision stand in.

    Every call reads and hashes every weight file; nothing is cached. A cache needs a key that no
    rewrite can keep, and file metadata is not one: size and mtime survive a same-tick rewrite on a
    filesystem with coarse timestamps (and ``os.utime`` or a copy tool can put an old mtime back),
    ctime has the same granularity, and the inode survives any in-place write. A cache would also save
    nothing where it matters: a server process starts one engine and fingerprints once. The cost, on
    this machine's 2 cores (sha256 with SHA-NI, 8 MiB reads): 0.8 s per GiB from the page cache,
    1.1 s per GiB from disk, so about 15 s for a 16 GB (8B bf16) model at engine start, beside the
    time vLLM takes to load the same bytes.
    """
    model_dir = Path(model)
    digest = hashlib.sha256()
    if not model_dir.is_dir():
        digest.update(f"hub:{model}@{revision or 'main'}".encode())
        return digest.hexdigest()
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise KvtierVllmConfigError(f"model directory {model_dir} has no config.json; kvtier fingerprints it")
    digest.update(b"config.json\0" + config_path.read_bytes())
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        digest.update(b"index\0" + index_path.read_bytes())
    for weight_path in sorted(model_dir.glob("*.safetensors")):
        size_bytes, content = _file_sha256(weight_path)
        digest.update(f"{weight_path.name}\0{size_bytes}\0{content}\0".encode())
    return digest.hexdigest()


def _file_sha256(path: Path) -> tuple[int, str]:
    """(bytes read, sha256 of those bytes) of a file, read now (never from a cache)."""
    digest = hashlib.sha256()
    size_bytes = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
            size_bytes += len(chunk)
    return size_bytes, digest.hexdigest()


def check_hash_algo(hash_algo: str | None) -> None:
    """Refuses prefix-hash algorithms whose hashes differ between processes.

    kvtier persists blocks under their hashes; a hash seeded per process would never hit after a
    restart and, shared between replicas, would make keys meaningless.
    """
    if hash_algo is None or hash_algo in STABLE_HASH_ALGOS:
        return
    if hash_algo in SEEDED_HASH_ALGOS:
        if os.environ.get("PYTHONHASHSEED") not in (None, "", "random"):
            return
        raise KvtierVllmConfigError(
            f"prefix_caching_hash_algo={hash_algo!r} seeds block hashes per process unless PYTHONHASHSEED "
            "is set, so blocks kvtier persists could never be found again. Use "
            "--prefix-caching-hash-algo sha256 (the default) or sha256_cbor, or export the same "
            "PYTHONHASHSEED for every engine process."
        )
    raise KvtierVllmConfigError(
        f"prefix_caching_hash_algo={hash_algo!r} is unknown to kvtier; use sha256 (the default) or sha256_cbor"
    )


def namespace_description(
    config: OffloadingConfig,
    *,
    page_bytes_per_layer: list[int],
    hash_algo: str | None,
    model_revision: str | None = None,
    salt: str = "",
) -> dict[str, Any]:
    """Everything that must match for a stored block to be valid in this engine."""
    parallel = config.parallel
    return {
        "format": NAMESPACE_FORMAT_VERSION,
        "engine": "vllm",
        # A local model is identified by its contents alone, so replicas that mount the same weights
        # at different paths share blocks; a hub model by its name and revision.
        "model": config.model.name if not Path(config.model.name).is_dir() else "local",
        "model_fingerprint": model_fingerprint(config.model.name, model_revision),
        "kv_dtype": config.model.dtype,
        "kv_cache_layout": config.kv_cache_layout,
        "canonical_layout": config.canonical_layout,
        "groups": [
            {"tokens_per_block": group.tokens_per_block, "layers": list(group.layer_names)} for group in config.groups
        ],
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "page_bytes_per_layer": page_bytes_per_layer,
        "prefix_caching_hash_algo": hash_algo,
        "parallel": {
            "tp_size": parallel.tp_size,
            "pp_size": parallel.pp_size,
            "pcp_size": parallel.pcp_size,
            "dcp_size": parallel.dcp_size,
            "world_size": parallel.world_size,
            "rank": parallel.rank,
        },
        "salt": salt,
    }


def rank_independent_objects(config: OffloadingConfig) -> bool:
    """Whether this engine stores blocks in the rank-independent ("canonical") object layout, which
    engines of every TP size share: vLLM certifies that each rank's KV pages are a head shard of one
    full-attention page (no MLA, no replicated or per-token-head-scaled KV, no context parallelism).
    Each rank checks its layers' certified mappings again before it places a byte (fail closed)."""
    parallel = config.parallel
    return bool(getattr(parallel, "is_parallelism_agnostic", False)) and parallel.world_size == parallel.tp_size


def service_namespace_description(
    config: OffloadingConfig, *, hash_algo: str | None, model_revision: str | None = None, salt: str = ""
) -> dict[str, Any]:
    """The namespace of the host-service layout, the same in the scheduler and in every rank.

    Rank-independent layout (``rank_independent_objects``): a block object is the full page of
    every layer, in layer order, each page as vLLM's canonical mapping lays it out (all KV heads);
    rank r of any TP size writes and reads its heads there, so the TP size is not part of the
    namespace and engines of different TP sizes share blocks.

    Otherwise a block object holds every rank's slice in rank order (each slice: the rank's page of
    every layer, in layer order), so the rank is not part of it; the tensor-parallel size is, since
    it decides what a slice holds.
    """
    description = namespace_description(
        config, page_bytes_per_layer=[], hash_algo=hash_algo, model_revision=model_revision, salt=salt
    )
    del description["page_bytes_per_layer"]
    del description["parallel"]["rank"]
    if rank_independent_objects(config):
        del description["parallel"]["tp_size"]
        del description["parallel"]["world_size"]
        description["object_layout"] = f"canonical layer pages v{CANONICAL_PAGE_FORMAT_VERSION}"
        description["object_bytes"] = config.worker_kv_bytes_per_block * config.parallel.tp_size
        return description
    description["object_layout"] = "rank-major slices of layer pages"
    description["slice_bytes"] = config.worker_kv_bytes_per_block
    return description


def canonical_placement(refs: list[Any], page_bytes: int) -> list[tuple[int, int, int]]:
    """Where this rank's slice (its page of each layer, in layer order) lies in a rank-independent
    block object: ``(slice_offset, object_offset, len)`` runs, from vLLM's certified per-layer
    canonical page mappings. Raises when a layer has none: the scheduler put this engine in a
    namespace shared across TP sizes, and opaque per-rank bytes must not land there."""
    runs: list[tuple[int, int, int]] = []
    object_base = 0
    for layer_index, ref in enumerate(refs):
        mapping = getattr(ref, "mapping", None)
        if (
            mapping is None
            or not mapping.parallelism_agnostic
            or mapping.num_writers != 1
            or mapping.local_page_size_bytes != page_bytes
        ):
            raise KvtierVllmConfigError(
                f"kvtier: vLLM declared this engine's KV layout parallelism-agnostic, but layer {layer_index} has "
                f"no certified canonical mapping ({mapping!r}, page {page_bytes} bytes); kvtier will not store "
                "rank-dependent bytes in a namespace shared across TP sizes. Report this layout to kvtier, and set "
                "namespace_salt to keep this engine's blocks apart meanwhile"
            )
        local_base = layer_index * page_bytes
        for run in mapping.runs:
            for fragment in range(run.num_fragments):
                runs.append(
                    (
                        local_base + run.local_offset + fragment * run.local_stride,
                        object_base + run.canonical_offset + fragment * run.canonical_stride,
                        run.fragment_size,
                    )
                )
        object_base += mapping.canonical_page_size_bytes
    runs.sort()
    return runs


def namespace_digest(description: Mapping[str, Any]) -> bytes:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).digest()


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KvtierOptions:
    path: str
    store_options: dict[str, Any]
    job_timeout_ms: int
    namespace_salt: str
    host_service: bool = True
    service_socket: str = ""
    pool_dir: str = "/dev/shm"
    service_idle_timeout_s: float = 300.0
    host_dram_bytes: int = 0
    service_timeout_ms: int = 5_000
    defer_stores: bool = True
    deferred_store_max_blocks: int = 4096
    prefetch: bool = True
    admission: str = "all"
    admission_memory_blocks: int = 1 << 18
    engine_label: str = ""

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any]) -> KvtierOptions:
        path = extra_config.get("path")
        if not path:
            raise KvtierVllmConfigError(
                'kv_connector_extra_config needs "path": the kvtier store directory (for example a local '
                "NVMe mount), or a list of directories to stripe over"
            )
        store_options = {
            name: value
            for name, value in extra_config.items()
            if name != "path" and name not in VLLM_OFFLOADING_OPTION_NAMES and name not in INTEGRATION_OPTION_DEFAULTS
        }
        for reserved in ("namespace", "object_bytes"):
            if reserved in store_options:
                raise KvtierVllmConfigError(
                    f'kv_connector_extra_config must not set "{reserved}": kvtier.vllm derives it from the '
                    'vLLM configuration (use "namespace_salt" to separate deployments)'
                )
        job_timeout_ms = int(extra_config.get("job_timeout_ms", INTEGRATION_OPTION_DEFAULTS["job_timeout_ms"]))
        if job_timeout_ms <= 0:
            raise KvtierVllmConfigError('"job_timeout_ms" must be a positive number of milliseconds')
        option = lambda name: extra_config.get(name, INTEGRATION_OPTION_DEFAULTS[name])  # noqa: E731
        service_timeout_ms = int(option("service_timeout_ms"))
        if service_timeout_ms <= 0:
            raise KvtierVllmConfigError('"service_timeout_ms" must be a positive number of milliseconds')
        admission = str(option("admission"))
        if admission not in ADMISSION_POLICIES:
            raise KvtierVllmConfigError(
                f'"admission" must be one of {", ".join(ADMISSION_POLICIES)}, not {admission!r}'
            )
        admission_memory_blocks = int(option("admission_memory_blocks"))
        if admission_memory_blocks <= 0:
            raise KvtierVllmConfigError('"admission_memory_blocks" must be a positive number of blocks')
        host_dram_bytes = int(option("host_dram_bytes"))
        if host_dram_bytes < 0:
            raise KvtierVllmConfigError('"host_dram_bytes" must be >= 0 (0: no host cap)')
        service_idle_timeout_s = float(option("service_idle_timeout_s"))
        if service_idle_timeout_s <= 0:
            raise KvtierVllmConfigError('"service_idle_timeout_s" must be a positive number of seconds')
        deferred_store_max_blocks = int(option("deferred_store_max_blocks"))
        if deferred_store_max_blocks < 0:
            raise KvtierVllmConfigError('"deferred_store_max_blocks" must be >= 0 (0: drop every store held back)')
        return cls(
            path=path,
            store_options=store_options,
            job_timeout_ms=job_timeout_ms,
            namespace_salt=str(option("namespace_salt")),
            host_service=bool(option("host_service")),
            service_socket=str(option("service_socket")),
            pool_dir=str(option("pool_dir")),
            service_idle_timeout_s=service_idle_timeout_s,
            host_dram_bytes=host_dram_bytes,
            service_timeout_ms=service_timeout_ms,
            defer_stores=bool(option("defer_stores")),
            deferred_store_max_blocks=deferred_store_max_blocks,
            prefetch=bool(option("prefetch")),
            admission=admission,
            admission_memory_blocks=admission_memory_blocks,
            engine_label=str(option("engine_label")),
        )

    def service_options(self) -> dict[str, Any]:
        """What a service this engine starts is started with: the store options, and the host cap."""
        if self.host_dram_bytes:
            return {**self.store_options, "host_dram_bytes": self.host_dram_bytes}
        return dict(self.store_options)

    def socket_path(self) -> Path:
        from kvtier.service import default_socket_path

        return Path(self.service_socket) if self.service_socket else default_socket_path(self.path)

    @property
    def registry_path(self) -> str:
        paths = self.path if isinstance(self.path, (list, tuple)) else [self.path]
        return os.pathsep.join(os.path.realpath(os.fspath(p)) for p in paths)


MAX_UNCLAIMED_JOB_RESULTS = 10_000
# Bytes per store_blocks call of a service worker (at least one block): between two calls a load or
# a prefill step may come first. 16 MiB is one block of an 8B model (128 tokens), a few ms to copy;
# a call's round trips to the service cost tens of microseconds.
STORE_BATCH_BYTES = 16 << 20
# Threads that copy a large load out of the pool while the engine has no forward pass running.
LOAD_COPY_THREADS = min(4, os.cpu_count() or 1)

# --------------------------------------------------------------------------------------------
# Process-wide store registry (the manager and the worker of an engine share one store)
# --------------------------------------------------------------------------------------------


@dataclass
class SharedStore:
    """One open kvtier.Store and what the engines of this process share through it."""

    store: Any
    path: str
    namespace: bytes
    description: dict[str, Any]
    object_bytes: int
    users: int = 0
    engine_ids: set[str] = field(default_factory=set)
    # Worker -> manager: latency observations, drained into vLLM stats by the manager.
    _observations_lock: threading.Lock = field(default_factory=threading.Lock)
    _latency_observations: list[tuple[str, float]] = field(default_factory=list)
    _worker_counters: Counter = field(default_factory=Counter)
    # Job completions: store.poll() reports every job of the store, whichever engine submitted it.
    _jobs_lock: threading.Lock = field(default_factory=threading.Lock)
    _job_ids: Any = field(default_factory=lambda: itertools.count(1))
    _finished_jobs: dict[int, list[bool]] = field(default_factory=dict)

    def next_job_id(self) -> int:
        with self._jobs_lock:
            return next(self._job_ids)

    def take_finished(self, job_ids: Collection[int]) -> dict[int, list[bool]]:
        """Results of the given jobs that have finished (polling the store once)."""
        with self._jobs_lock:
            for job_id, found in self.store.poll():
                self._finished_jobs[job_id] = list(found)
            if len(self._finished_jobs) > MAX_UNCLAIMED_JOB_RESULTS:
                # Results nobody claims (their worker shut down): keep the newest ones only.
                for stale_job_id in sorted(self._finished_jobs)[: len(self._finished_jobs) - MAX_UNCLAIMED_JOB_RESULTS]:
                    del self._finished_jobs[stale_job_id]
            return {job_id: self._finished_jobs.pop(job_id) for job_id in job_ids if job_id in self._finished_jobs}

    def wait_job(self, job_id: int, timeout_ms: int) -> list[bool]:
        with self._jobs_lock:
            if job_id in self._finished_jobs:
                return self._finished_jobs.pop(job_id)
        return list(self.store.wait(job_id, timeout_ms=timeout_ms))

    @property
    def namespace_hex(self) -> str:
        return self.namespace.hex()

    def release(self) -> None:
        release_store(self)

    def record_job(self, kind: str, seconds: float, failed_blocks: int) -> None:
        with self._observations_lock:
            if len(self._latency_observations) < 100_000:
                self._latency_observations.append((kind, seconds))
            if failed_blocks:
                self._worker_counters[f"{kind}_failed_blocks"] += failed_blocks

    def take_observations(self) -> tuple[list[tuple[str, float]], Counter]:
        with self._observations_lock:
            observations, self._latency_observations = self._latency_observations, []
            counters, self._worker_counters = self._worker_counters, Counter()
        return observations, counters


_registry_lock = threading.Lock()
_stores: dict[tuple[str, bytes], SharedStore] = {}
_stores_by_engine: dict[tuple[str, str], SharedStore] = {}


def _open_store(path: Any, **options: Any) -> Any:
    import kvtier  # the Rust core; imported late so that this module imports without it

    return kvtier.Store.open(path, **options)


def acquire_store(
    options: KvtierOptions, engine_id: str, namespace: bytes, description: dict[str, Any], object_bytes: int
) -> SharedStore:
    key = (options.registry_path, namespace)
    with _registry_lock:
        shared = _stores.get(key)
        if shared is None:
            store = _open_store(options.path, namespace=namespace, object_bytes=object_bytes, **options.store_options)
            shared = SharedStore(
                store=store,
                path=options.registry_path,
                namespace=namespace,
                description=description,
                object_bytes=object_bytes,
            )
            _stores[key] = shared
            logger.info(
                "kvtier: opened store %s namespace %s (object %d bytes) for %s",
                options.path,
                namespace.hex()[:16],
                object_bytes,
                description.get("model"),
            )
        elif shared.object_bytes != object_bytes:
            raise KvtierVllmConfigError(
                f"kvtier store {options.path} is open in this process with {shared.object_bytes}-byte objects; "
                f"this engine needs {object_bytes}"
            )
        shared.users += 1
        shared.engine_ids.add(engine_id)
        _stores_by_engine[(options.registry_path, engine_id)] = shared
        return shared


def find_engine_store(options: KvtierOptions, engine_id: str) -> SharedStore | None:
    with _registry_lock:
        shared = _stores_by_engine.get((options.registry_path, engine_id))
        if shared is not None:
            shared.users += 1
        return shared


def release_store(shared: SharedStore) -> None:
    with _registry_lock:
        shared.users -= 1
        if shared.users > 0:
            return
        _stores.pop((shared.path, shared.namespace), None)
        for engine_id in shared.engine_ids:
            _stores_by_engine.pop((shared.path, engine_id), None)
    try:
        shared.store.close()
    except Exception:  # closing is best effort at shutdown
        logger.exception("kvtier: closing store %s failed", shared.path)


def open_stores() -> list[SharedStore]:
    """The kvtier stores open in this process (for tests, the demo and diagnostics)."""
    with _registry_lock:
        return list(_stores.values())


# --------------------------------------------------------------------------------------------
# The host service: one connection per engine process (scheduler or rank)
# --------------------------------------------------------------------------------------------

# A lost connection is retried at most this often, in the background: a call never waits for it.
RECONNECT_INTERVAL_S = 1.0

# Every ServiceConnection this process opened and has not closed (for the benchmarks and tests).
_service_connections: weakref.WeakSet[ServiceConnection] = weakref.WeakSet()


def service_connections() -> list[ServiceConnection]:
    """This process's open connections to host services (the manager's, each rank's)."""
    with _registry_lock:
        return list(_service_connections)


# Every ServiceWorker of this process (for the benchmarks: a worker in this process holds stores
# back, so "stored" means its queue is empty, not only that the service took what it was sent).
_service_workers: weakref.WeakSet[ServiceWorker] = weakref.WeakSet()


def wait_for_stores(timeout_s: float) -> bool:
    """Waits until every ServiceWorker in this process has handed every store vLLM gave it to the
    service (or dropped it); False on timeout. Stores go in idle windows, so the engine must be idle."""
    with _registry_lock:
        workers = list(_service_workers)
    deadline = time.monotonic() + timeout_s
    return all(worker.wait_stores_done(deadline) for worker in workers)


class ServiceConnection:
    """This process's connection to the host service, attached to the engine's namespace.

    Every call is bounded by the connection's timeout and never raises: a dead or unreachable
    service answers with the call's miss (nothing present, nothing pinned, no transfer), counted in
    ``failed_calls`` and logged once per outage. A lost connection is re-established in the
    background, starting the service again when none answers (its NVMe tier is recovered), so the
    engine keeps serving through a service restart and then reattaches.
    """

    def __init__(
        self,
        options: KvtierOptions,
        description: Mapping[str, Any],
        tp_size: int,
        rank: int,
        slice_bytes: int,
        label: str = "",
    ):
        self._options = options
        self._label = label[:128]
        self._description = json.dumps(description, sort_keys=True).encode()
        self._tp_size, self._rank, self._slice_bytes = tp_size, rank, slice_bytes
        self._placement: list[tuple[int, int, int]] | None = None
        self._lock = threading.Lock()
        self._client: Any = None
        self._reconnecting = False
        self._last_attempt = 0.0
        self._outage_logged = False
        self.failed_calls = 0
        self.namespace = namespace_digest(description)
        self._client = self._connect(start_timeout_s=None)
        with _registry_lock:
            _service_connections.add(self)

    @property
    def socket_path(self) -> Path:
        return self._options.socket_path()

    def _connect(self, start_timeout_s: float | None) -> Any:
        from kvtier.service import SERVICE_START_TIMEOUT_S, connect, ensure_service

        socket = ensure_service(
            self._options.path,
            self._options.service_options(),
            socket_path=self._options.socket_path(),
            pool_dir=self._options.pool_dir,
            start_timeout_s=start_timeout_s or SERVICE_START_TIMEOUT_S,
            idle_timeout_s=self._options.service_idle_timeout_s,
        )
        client = connect(socket, timeout_ms=max(self._options.job_timeout_ms, self._options.service_timeout_ms))
        client.hello(self._description, self._tp_size, self._rank, self._slice_bytes)
        if self._placement is not None:
            client.set_placement(self._placement)
        if self._label:
            try:
                client.set_label(self._label)
            except Exception as error:  # a service of an older kvtier: no per-engine counters, still serving
                logger.warning("kvtier: the host service keeps no per-engine counters (%s)", error)
        return client

    def set_placement(self, runs: list[tuple[int, int, int]]) -> None:
        """Places this rank's slice in each block object by ``runs`` (``canonical_placement``), now
        and after every reconnect. A placement the service's object size refuses raises: the engine
        must not start storing under another layout."""
        self._placement = runs
        with self._lock:
            client = self._client
        if client is not None:
            client.set_placement(runs)

    def _reconnect_in_background(self) -> None:
        with self._lock:
            now = time.monotonic()
            if self._reconnecting or now - self._last_attempt < RECONNECT_INTERVAL_S:
                return
            self._reconnecting, self._last_attempt = True, now

        def attempt() -> None:
            try:
                client = self._connect(start_timeout_s=None)
            except Exception as error:
                logger.warning("kvtier: the host service is still unreachable (%s); serving misses", error)
                client = None
            with self._lock:
                self._reconnecting = False
                if client is not None:
                    self._client = client
                    self._outage_logged = False
                    logger.info("kvtier: reattached to the host service")

        threading.Thread(target=attempt, name="kvtier-reconnect", daemon=True).start()

    def call(self, method: str, *args: Any, default: Any = None) -> Any:
        client = self.live_client()
        if client is None:
            return default
        try:
            return getattr(client, method)(*args)
        except Exception as error:
            self.failed_calls += 1
            if not self._outage_logged:
                self._outage_logged = True
                logger.error("kvtier: host service call %s failed (%s); serving misses until it is back", method, error)
            if not client.connected:
                self._reconnect_in_background()
            return default

    def count_failed_call(self) -> None:
        self.failed_calls += 1

    def live_client(self) -> Any:
        """The connected client, for a caller that drives the two-phase calls itself (the GPU
        worker); None while the service is unreachable (a reconnect is under way then)."""
        client = self._client
        if client is None or not client.connected:
            self.failed_calls += 1
            self._reconnect_in_background()
            return None
        return client

    # The store-like interface KvtierManager uses.
    def contains_many(self, keys: list[bytes]) -> list[bool]:
        return [tier is not None for tier in self.locate_many(keys)]

    def locate_many(self, keys: list[bytes]) -> list[str | None]:
        return self.call("locate_many", keys, default=[None] * len(keys))

    def pin_many(self, keys: list[bytes]) -> list[bool]:
        return self.call("pin_many", keys, default=[])

    def unpin_many(self, keys: list[bytes]) -> None:
        self.call("unpin_many", keys)

    def stats(self) -> dict[str, int]:
        stats = dict(self.call("stats", default={}))
        stats["service_failed_calls"] = self.failed_calls
        return stats

    def flush(self) -> None:
        """Waits until every store the service accepted for this namespace is on NVMe."""
        self.call("flush")

    def close(self) -> None:
        """Drops the connection: the service releases whatever it still held for this process."""
        with self._lock:
            self._client = None
            self._last_attempt = float("inf")  # no reconnecting after close
        with _registry_lock:
            _service_connections.discard(self)


@dataclass
class ServiceBackend:
    """What KvtierManager needs from its store when the store lives in the host service."""

    store: ServiceConnection
    prefetcher: Prefetcher | None = None

    def take_observations(self) -> tuple[list[tuple[str, float]], Counter]:
        # Job latencies are observed in the worker processes; they reach vLLM as transfer times.
        return [], Counter()

    def release(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.store.close()


class Prefetcher:
    """Reads blocks that lookups found on NVMe or in the shared tier into the service's DRAM pool,
    on a thread and a connection of its own (a prefetch of a long prefix takes a while; lookups on the
    manager's connection must not wait behind it).

    Each key is prefetched once: lookups answer HIT_PENDING while it is in flight and HIT after it
    ended, whatever became of it (a block evicted again before its load is read by the load itself).
    Ended prefetches are remembered for ``REMEMBER_S``, with the tier the block came from, so that
    vLLM's hit-source metric names NVMe or the shared tier, not the DRAM the load copied from."""

    REMEMBER_S = 120.0

    def __init__(self, connect: Callable[[], ServiceConnection]):
        self._connect = connect
        self._connection: ServiceConnection | None = None
        self._cv = threading.Condition()
        self._queue: list[bytes] = []
        self._in_flight: dict[bytes, str] = {}  # key -> tier it is read from
        self._ended: dict[bytes, tuple[str, float]] = {}  # key -> (origin tier, when)
        self._stopping = False
        self.prefetched_blocks = 0
        self._thread = threading.Thread(target=self._run, name="kvtier-prefetch", daemon=True)
        self._thread.start()

    def lookup(self, key: bytes, tier: str) -> LookupResult:
        """For a key the service holds on ``tier`` (NVMe or shared), not in DRAM."""
        with self._cv:
            if key in self._ended:
                return LookupResult.HIT
            if key not in self._in_flight:
                self._in_flight[key] = tier
                self._queue.append(key)
                self._cv.notify_all()
            return LookupResult.HIT_PENDING

    def origin(self, key: bytes) -> str | None:
        with self._cv:
            ended = self._ended.get(key)
            return ended[0] if ended is not None else self._in_flight.get(key)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                batch, self._queue = self._queue, []
            if self._connection is None:
                try:
                    self._connection = self._connect()
                except Exception:
                    logger.exception("kvtier: the prefetcher cannot reach the host service; loads read storage")
            if self._connection is not None:
                found = self._connection.call("prefetch", batch, default=None)
                self.prefetched_blocks += sum(1 for ok in found or [] if ok)
            now = time.monotonic()
            with self._cv:
                for key in batch:
                    self._ended[key] = (self._in_flight.pop(key, "nvme"), now)
                self._forget_older_than(now - self.REMEMBER_S)

    def _forget_older_than(self, cutoff: float) -> None:
        """Holds ``_cv``. Ended entries are in the order they ended."""
        for key, (_, when) in list(self._ended.items()):
            if when >= cutoff:
                break
            del self._ended[key]

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=5)
        if self._connection is not None:
            self._connection.close()


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------

_LATENCY_BUCKETS_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# kvtier counter name -> (stats() key, label values)
_COUNTER_SOURCES: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "kvtier:block_hits": [("dram_hits", ("dram",)), ("nvme_hits", ("nvme",)), ("shared_hits", ("shared",))],
    "kvtier:block_misses": [("misses", ())],
    "kvtier:bytes_read": [("bytes_read_nvme", ("nvme",)), ("shared_bytes_read", ("shared",))],
    "kvtier:bytes_written": [("bytes_written_nvme", ("nvme",)), ("shared_bytes_written", ("shared",))],
    "kvtier:bytes_copied": [("bytes_copied_in", ("in",)), ("bytes_copied_out", ("out",))],
    "kvtier:block_puts": [("puts", ())],
    "kvtier:evictions": [("dram_evictions", ("dram",)), ("nvme_region_evictions", ("nvme_region",))],
    "kvtier:dropped_stores": [
        ("dropped_stores", ("backpressure",)),
        ("nvme_dropped_writes", ("nvme_write",)),
        # A load short of DRAM slots took the slot of a block whose NVMe write had not started.
        ("cancelled_writes", ("load_first",)),
        # Blocks not published to the shared tier: they left DRAM while waiting in the publisher's
        # backlog, or writing the file failed (filesystem full, directory removed, ...).
        ("shared_dropped_publishes", ("shared_queue",)),
        ("shared_publish_errors", ("shared_publish_error",)),
    ],
    "kvtier:slot_wait_timeouts": [("slot_wait_timeouts", ())],
    "kvtier:checksum_failures": [("checksum_failures", ())],
    "kvtier:io_errors": [("io_errors", ())],
}
_GAUGE_SOURCES: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "kvtier:used_bytes": [("dram_used_bytes", ("dram",)), ("nvme_used_bytes", ("nvme",))],
    "kvtier:capacity_bytes": [("dram_capacity_bytes", ("dram",)), ("nvme_capacity_bytes", ("nvme",))],
    "kvtier:blocks": [("blocks_dram", ("dram",)), ("blocks_nvme", ("nvme",))],
}


def kvtier_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    return {
        "kvtier:block_hits": OffloadingCounterMetadata("Blocks served by kvtier, per tier.", ("tier",)),
        "kvtier:block_misses": OffloadingCounterMetadata("Blocks asked of kvtier and not found or not verified."),
        "kvtier:bytes_read": OffloadingCounterMetadata("Bytes kvtier read from a storage tier.", ("tier",)),
        "kvtier:bytes_written": OffloadingCounterMetadata("Bytes kvtier wrote to a storage tier.", ("tier",)),
        "kvtier:bytes_copied": OffloadingCounterMetadata(
            "Bytes copied between engine blocks and kvtier (in = stored, out = loaded).", ("direction",)
        ),
        "kvtier:block_puts": OffloadingCounterMetadata("Blocks accepted by kvtier for storing."),
        "kvtier:evictions": OffloadingCounterMetadata("Evictions (DRAM blocks, NVMe regions).", ("tier",)),
        "kvtier:dropped_stores": OffloadingCounterMetadata(
            "Stores dropped (a cache miss later): under backpressure, NVMe writes given up, or blocks not "
            "published to the shared tier.",
            ("reason",),
        ),
        "kvtier:slot_wait_timeouts": OffloadingCounterMetadata("Jobs that waited slot_wait_ms for a DRAM slot."),
        "kvtier:checksum_failures": OffloadingCounterMetadata(
            "Blocks that failed verification on load (served as misses)."
        ),
        "kvtier:io_errors": OffloadingCounterMetadata("I/O errors seen by kvtier (the affected blocks are misses)."),
        "kvtier:failed_load_blocks": OffloadingCounterMetadata(
            "Engine blocks whose load from kvtier failed and that vLLM recomputed."
        ),
        "kvtier:used_bytes": OffloadingGaugeMetadata("Bytes used per tier.", ("tier",)),
        "kvtier:capacity_bytes": OffloadingGaugeMetadata("Capacity per tier in bytes.", ("tier",)),
        "kvtier:blocks": OffloadingGaugeMetadata("Blocks held per tier.", ("tier",)),
        "kvtier:load_seconds": OffloadingHistogramMetadata(
            "Time from submitting a load job to kvtier to its completion.", buckets=_LATENCY_BUCKETS_SECONDS
        ),
        "kvtier:store_seconds": OffloadingHistogramMetadata(
            "Time from submitting a store job to kvtier to its completion.", buckets=_LATENCY_BUCKETS_SECONDS
        ),
    }


class StatsDeltaTracker:
    """Turns the store's cumulative stats() counters into increments for vLLM's stats payload."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def prime(self, shared: SharedStore | ServiceBackend) -> None:
        """Starts counting from the store's counters now: an engine that attaches to a store (or a
        host service) that already served others reports only what happens from then on."""
        with contextlib.suppress(Exception):
            stats = shared.store.stats()
            self._last = {key: int(value) for key, value in stats.items() if isinstance(value, int)}

    def collect(self, shared: SharedStore | ServiceBackend) -> OffloadingConnectorStats | None:
        try:
            stats = shared.store.stats()
        except Exception:
            return None
        payload = OffloadingConnectorStats()
        for metric_name, sources in _COUNTER_SOURCES.items():
            for stats_key, labels in sources:
                value = int(stats.get(stats_key, 0))
                increment = value - self._last.get(stats_key, 0)
                self._last[stats_key] = value
                if increment > 0:
                    payload.increase_counter(metric_name, increment, labels)
        for metric_name, sources in _GAUGE_SOURCES.items():
            for stats_key, labels in sources:
                if stats_key in stats:
                    payload.set_gauge(metric_name, int(stats[stats_key]), labels)
        observations, worker_counters = shared.take_observations()
        for kind, seconds in observations:
            payload.observe_histogram(f"kvtier:{kind}_seconds", seconds)
        if worker_counters.get("load_failed_blocks"):
            payload.increase_counter("kvtier:failed_load_blocks", worker_counters["load_failed_blocks"])
        return payload


def prometheus_lines_from_stats(stats: Mapping[str, Any], prefix: str = "kvtier_") -> str:
    """A Prometheus text exposition of a store's stats() (for tools that read a store directly)."""
    lines = []
    for metric_name, sources in {**_COUNTER_SOURCES, **_GAUGE_SOURCES}.items():
        name = prefix + metric_name.split(":", 1)[1]
        for stats_key, labels in sources:
            if stats_key not in stats:
                continue
            label_text = ""
            if labels:
                label_name = {"kvtier:bytes_copied": "direction", "kvtier:dropped_stores": "reason"}.get(
                    metric_name, "tier"
                )
                label_text = f'{{{label_name}="{labels[0]}"}}'
            lines.append(f"{name}{label_text} {int(stats[stats_key])}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Scheduler side
# --------------------------------------------------------------------------------------------


class KvtierLoadStoreSpec(LoadStoreSpec):
    """The kvtier keys of a load or store job, in the order of the engine blocks of the job."""

    def __init__(self, keys: list[bytes]):
        self.keys = keys

    def __repr__(self) -> str:
        return f"KvtierLoadStoreSpec({len(self.keys)} blocks)"


# store.locate_many() tier -> vLLM's cache-hit source (shared and unknown: external_unspecified).
_HIT_SOURCE_BY_TIER = {"dram": CacheHitSource.HOST, "nvme": CacheHitSource.DISK}


class KvtierManager(OffloadingManager):
    """Scheduler-side catalog access: every answer comes from the store's in-memory index."""

    def __init__(
        self,
        shared: SharedStore | ServiceBackend,
        pin_lease_s: float = 300.0,
        admission: str = "all",
        admission_memory_blocks: int = 1 << 18,
    ):
        self._shared = shared
        self._store = shared.store
        # Pins this engine holds, per request: a request releases only its own pins, never another
        # request's pin on the same block.
        self._pins: dict[str, Counter[bytes]] = {}
        # When each request took its pins. A request that never reaches complete_load (vLLM dropped
        # it between prepare_load and the load) would hold its pins for the engine's whole life and
        # fill the DRAM pool with unevictable blocks: past the lease they are released.
        self._pinned_at: dict[str, float] = {}
        self._pin_lease_s = pin_lease_s
        self._being_stored: Counter[bytes] = Counter()
        # "second_sight": keys computed once and not stored, oldest first (an LRU of key -> None).
        self._second_sight: OrderedDict[bytes, None] | None = OrderedDict() if admission == "second_sight" else None
        self._admission_memory_blocks = admission_memory_blocks
        self.not_admitted_blocks = 0
        self._prefetcher = shared.prefetcher if isinstance(shared, ServiceBackend) else None
        self._stats = StatsDeltaTracker()
        self._stats.prime(shared)

    @staticmethod
    def _allowed(req_context: ReqContext) -> bool:
        tier_filter = req_context.load_tier_filter
        return tier_filter.allows(Medium.CPU, Locality.LOCAL) or tier_filter.allows(Medium.STORAGE, Locality.LOCAL)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self._allowed(req_context):
            return LookupResult.MISS
        store_key = kvtier_key(key)
        try:
            tier = self._store.locate_many([store_key])[0]
        except Exception:
            logger.exception("kvtier: lookup failed; treating as a miss")
            return LookupResult.MISS
        if tier is not None:
            # The store shows a block only once its bytes are complete, even if vLLM has not yet
            # been told that the store job finished.
            if tier != "dram" and self._prefetcher is not None:
                return self._prefetcher.lookup(store_key, tier)
            return LookupResult.HIT
        if store_key in self._being_stored:
            # Still being copied out of the engine: the request waits a step for it instead of
            # recomputing what is about to be readable (a dropped store turns this into a miss).
            return LookupResult.HIT_PENDING
        return LookupResult.MISS

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """The tier a hit is served from, for vLLM's ``vllm:prompt_tokens_cached_by_source``.

        vLLM asks after ``prepare_load`` and before the load runs, so ``locate_many`` (memory only)
        still names the tier the worker will read. vLLM has no member for a shared filesystem; its
        ``external_unspecified`` is documented as the source of remote stores, so shared hits go
        there (``kvtier:block_hits{tier="shared"}`` counts them exactly).
        """
        store_key = kvtier_key(key)
        origin = self._prefetcher.origin(store_key) if self._prefetcher is not None else None
        try:
            tier = origin or self._store.locate_many([store_key])[0]
        except Exception:
            logger.exception("kvtier: locating a block failed; reporting its hit source as unspecified")
            return CacheHitSource.EXTERNAL_UNSPECIFIED
        return _HIT_SOURCE_BY_TIER.get(tier or "", CacheHitSource.EXTERNAL_UNSPECIFIED)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        store_keys = [kvtier_key(key) for key in keys]
        try:
            # One flag per present key: False for a block only in the shared tier (no pin taken).
            pinned = self._store.pin_many(store_keys)
        except Exception:
            logger.exception("kvtier: pin failed; the load will fail and vLLM will recompute")
            pinned = []
        request_pins = self._pins.setdefault(req_context.req_id, Counter())
        for store_key, took_pin in zip(store_keys, pinned, strict=False):  # flags for present keys only
            if took_pin:
                request_pins[store_key] += 1
        now = time.monotonic()
        if request_pins:
            self._pinned_at[req_context.req_id] = now
        else:
            del self._pins[req_context.req_id]
        self._expire_pins(now)
        return KvtierLoadStoreSpec(store_keys)

    def _expire_pins(self, now: float) -> None:
        stale = [req_id for req_id, since in self._pinned_at.items() if now - since > self._pin_lease_s]
        if not stale:
            return
        released = [key for req_id in stale for key in self._pins.pop(req_id, Counter()).elements()]
        for req_id in stale:
            del self._pinned_at[req_id]
        logger.warning(
            "kvtier: %d request(s) held %d pins for over %.0f s without completing their load; released",
            len(stale),
            len(released),
            self._pin_lease_s,
        )
        if released:
            try:
                self._store.unpin_many(released)
            except Exception:
                logger.exception("kvtier: unpin failed")

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        request_pins = self._pins.get(req_context.req_id)
        if request_pins is None:
            return
        to_unpin = []
        for key in keys:
            store_key = kvtier_key(key)
            if request_pins.get(store_key, 0) > 0:
                request_pins[store_key] -= 1
                if request_pins[store_key] == 0:
                    del request_pins[store_key]
                to_unpin.append(store_key)
        if not request_pins:
            del self._pins[req_context.req_id]
            self._pinned_at.pop(req_context.req_id, None)
        if to_unpin:
            try:
                self._store.unpin_many(to_unpin)
            except Exception:
                logger.exception("kvtier: unpin failed")

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        store_keys = [kvtier_key(key) for key in keys]
        try:
            present = self._store.contains_many(store_keys)
        except Exception:
            logger.exception("kvtier: store unavailable; not offloading")
            return None
        keys_to_store: list[OffloadKey] = []
        store_keys_to_store: list[bytes] = []
        for key, store_key, is_present in zip(keys, store_keys, present, strict=True):
            if is_present or store_key in self._being_stored or not self._admit(store_key):
                continue
            keys_to_store.append(key)
            store_keys_to_store.append(store_key)
        for store_key in store_keys_to_store:
            self._being_stored[store_key] += 1
        return PrepareStoreOutput(
            keys_to_store=keys_to_store,
            store_spec=KvtierLoadStoreSpec(store_keys_to_store),
            evicted_keys=[],
        )

    def _admit(self, store_key: bytes) -> bool:
        """Whether to store a block this engine just computed (``admission``)."""
        seen = self._second_sight
        if seen is None:
            return True
        if store_key in seen:
            del seen[store_key]
            return True
        seen[store_key] = None
        if len(seen) > self._admission_memory_blocks:
            seen.popitem(last=False)
        self.not_admitted_blocks += 1
        return False

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        for key in keys:
            store_key = kvtier_key(key)
            if self._being_stored.get(store_key, 0) > 0:
                self._being_stored[store_key] -= 1
                if self._being_stored[store_key] == 0:
                    del self._being_stored[store_key]

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def reset_cache(self) -> None:
        # kvtier is a persistent, possibly shared store: resetting one engine's connector does not
        # delete blocks other engines (or this engine after a restart) rely on.
        logger.info("kvtier: reset_cache ignored; kvtier keeps its blocks (remove the store directory to drop them)")
        self._being_stored.clear()

    def get_stats(self) -> OffloadingConnectorStats | None:
        payload = self._stats.collect(self._shared)
        if payload is None or payload.is_empty():
            return None
        return payload

    def shutdown(self) -> None:
        held = [store_key for request_pins in self._pins.values() for store_key in request_pins.elements()]
        if held:
            with contextlib.suppress(Exception):
                self._store.unpin_many(held)
        self._pins.clear()
        self._pinned_at.clear()
        self._shared.release()


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


@dataclass
class _Job:
    vllm_job_id: int
    is_load: bool
    block_ids: list[int]
    started_ns: int
    # GPU workers: an event on the engine's stream at submission; the job's copies wait for it.
    ready: Any = None


class KvtierWorker(OffloadingWorker):
    """Moves engine blocks to and from kvtier. One kvtier object per engine block: the block's page
    in every layer, in layer order (the store gathers and scatters; no Python loop per block)."""

    def __init__(self, shared: SharedStore, layer_buffers: list[np.ndarray], page_bytes: int, job_timeout_ms: int):
        self._shared = shared
        self._store = shared.store
        self._layers = layer_buffers
        self._page_bytes = page_bytes
        self._object_bytes = page_bytes * len(layer_buffers)
        self._job_timeout_ms = job_timeout_ms
        self._in_flight: dict[int, _Job] = {}
        self._finished: list[TransferResult] = []
        self._failed_load_block_ids: set[int] = set()
        # Set by KvtierConnector: failed loads are reported to vLLM, which recomputes them.
        self.can_report_load_failures = False

    # -- submission -------------------------------------------------------------------------

    def _submit(self, vllm_job_id: int, is_load: bool, keys: list[bytes], block_ids: list[int]) -> bool:
        if len(keys) != len(block_ids):
            raise RuntimeError(
                f"kvtier: job {vllm_job_id} has {len(keys)} keys for {len(block_ids)} engine blocks; "
                "kvtier needs blocks_per_chunk=1 and one KV-cache group"
            )
        started_ns = time.monotonic_ns()
        if not keys:
            self._finished.append(TransferResult(vllm_job_id, True, 0, 0.0))
            return True
        store_job_id = self._shared.next_job_id()
        job = _Job(vllm_job_id, is_load, block_ids, started_ns)
        try:
            if is_load:
                self._store.submit_get_blocks(store_job_id, keys, self._layers, block_ids)
            else:
                self._store.submit_put_blocks(store_job_id, keys, self._layers, block_ids)
        except Exception:
            logger.exception("kvtier: submitting %s job %d failed", "load" if is_load else "store", vllm_job_id)
            self._complete(job, [False] * len(keys))
            return True
        self._in_flight[store_job_id] = job
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, KvtierLoadStoreSpec), f"unexpected store spec {type(dst_spec).__name__}"
        return self._submit(job_id, False, dst_spec.keys, src_spec.block_ids.tolist())

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        # vLLM 0.33 passes expedited=True for a load a step waits on; every kvtier load already goes
        # before any store, so it needs nothing more here.
        assert isinstance(src_spec, KvtierLoadStoreSpec), f"unexpected load spec {type(src_spec).__name__}"
        return self._submit(job_id, True, src_spec.keys, dst_spec.block_ids.tolist())

    # -- completion -------------------------------------------------------------------------

    def _complete(self, job: _Job, found: list[bool]) -> None:
        seconds = (time.monotonic_ns() - job.started_ns) / 1e9
        first_failure = next((index for index, ok in enumerate(found) if not ok), len(found))
        moved_blocks = first_failure if job.is_load else sum(1 for ok in found if ok)
        success = True
        if job.is_load and first_failure < len(found):
            # Every block from the first failure on is invalid: later blocks of a prefix are
            # useless without it, and vLLM truncates the request there anyway.
            failed_block_ids = job.block_ids[first_failure:]
            if self.can_report_load_failures:
                self._failed_load_block_ids.update(failed_block_ids)
            else:
                logger.error(
                    "kvtier: %d of %d blocks of load job %d failed (missing or failed verification). "
                    "vLLM's OffloadingConnector cannot recompute a failed load, so the engine will stop "
                    "instead of using wrong KV data. Use kv_connector='KvtierConnector' with "
                    "kv_connector_module_path='kvtier.vllm' to recompute such blocks instead.",
                    len(failed_block_ids),
                    len(found),
                    job.vllm_job_id,
                )
                success = False
        self._record_job("load" if job.is_load else "store", seconds, len(found) - first_failure if job.is_load else 0)
        self._finished.append(TransferResult(job.vllm_job_id, success, moved_blocks * self._object_bytes, seconds))

    def _record_job(self, kind: str, seconds: float, failed_blocks: int) -> None:
        self._shared.record_job(kind, seconds, failed_blocks)

    def step_begins(self, prefill_tokens: int) -> None:
        """A forward pass starts (the in-process store's own threads do not hold stores back)."""

    def step_ends(self) -> None:
        """The forward pass ended."""

    def _drain_store(self) -> None:
        if not self._in_flight:
            return
        for store_job_id, found in self._shared.take_finished(list(self._in_flight)).items():
            self._complete(self._in_flight.pop(store_job_id), found)

    def get_finished(self) -> list[TransferResult]:
        self._drain_store()
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        waiting = {store_job_id for store_job_id, job in self._in_flight.items() if job.vllm_job_id in job_ids}
        for store_job_id in waiting:
            job = self._in_flight.get(store_job_id)
            if job is None:
                continue
            try:
                found = self._shared.wait_job(store_job_id, self._job_timeout_ms)
            except Exception as error:
                # Returning would let vLLM overwrite blocks kvtier may still be reading.
                raise RuntimeError(
                    f"kvtier: job {job.vllm_job_id} did not finish within job_timeout_ms={self._job_timeout_ms} "
                    f"({error}); raise job_timeout_ms or check the store's device"
                ) from error
            if self._in_flight.pop(store_job_id, None) is not None:
                self._complete(job, found)

    def take_failed_load_block_ids(self) -> set[int]:
        failed, self._failed_load_block_ids = self._failed_load_block_ids, set()
        return failed

    def shutdown(self) -> None:
        for store_job_id in list(self._in_flight):
            with contextlib.suppress(Exception):
                self._shared.wait_job(store_job_id, self._job_timeout_ms)
        self._in_flight.clear()
        release_store(self._shared)


@dataclass
class _StoreWork:
    """A store job the worker thread copies in batches, so that a load or a prefill step can come
    between two batches."""

    job: _Job
    keys: list[bytes]
    found: list[bool]
    copied: int = 0

    @property
    def remaining(self) -> int:
        return len(self.keys) - self.copied


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        return set()


def _usable_cores() -> set[int]:
    from kvtier.service import usable_cores

    return usable_cores()


def _set_affinity(cores: set[int]) -> None:
    """Binds the calling thread (only it: pid 0 is the thread on Linux). An empty set: no change."""
    if not cores:
        return
    try:
        os.sched_setaffinity(0, cores)
    except (OSError, AttributeError) as error:
        logger.debug("kvtier: binding the worker's job thread to cores %s failed: %s", sorted(cores), error)


class ServiceWorker(KvtierWorker):
    """A rank's worker in the host-service layout: copies its own slice of each block between its
    KV cache and the service's shared pool, on a thread of its own, so that vLLM's step never waits
    for a transfer it did not ask to wait for.

    Loads go first: a queued load is taken before the next batch of any store. Stores are held back
    while the engine runs a forward pass with prompt tokens in it (``defer_stores``): on a CPU engine
    a copy beside the prefill's OpenMP threads takes a core from one of them, and all the others wait
    for it at every barrier. A store vLLM must fence (``wait``) goes at once, and one that would make
    the held-back backlog exceed ``deferred_store_max_blocks`` is dropped and counted."""

    def __init__(
        self,
        connection: ServiceConnection,
        layer_buffers: list[np.ndarray],
        page_bytes: int,
        job_timeout_ms: int,
        defer_stores: bool = True,
        deferred_store_max_blocks: int = 4096,
    ):
        self._connection = connection
        self._layers = layer_buffers
        self._page_bytes = page_bytes
        self._object_bytes = page_bytes * len(layer_buffers)
        self._job_timeout_ms = job_timeout_ms
        self._defer_stores = defer_stores
        self._deferred_store_max_blocks = deferred_store_max_blocks
        self._finished: list[TransferResult] = []
        self._failed_load_block_ids: set[int] = set()
        self.can_report_load_failures = False
        self._cv = threading.Condition()
        self._loads: list[tuple[_Job, list[bytes]]] = []
        self._stores: list[_StoreWork] = []
        self._pending: set[int] = set()  # vLLM job ids queued or running
        self._urgent: set[int] = set()  # store jobs vLLM waits for: never held back
        self._prefill_running = False
        self._forward_running = False
        self._copy_threads = 1  # what the connection copies loads with now
        self._stopping = False
        # The cores vLLM bound this worker's compute to (this constructor runs on its main thread,
        # after the binding) and the others: stores are copied on a spare core when there is one.
        self._compute_cores = _affinity()
        self._spare_cores = _usable_cores() - self._compute_cores if self._compute_cores else set()
        # Counters (read by tests and the benchmark): stores held back by a prefill step, and blocks
        # dropped because the held-back backlog was full.
        self.deferred_store_jobs = 0
        self.dropped_store_blocks = 0
        self._thread = threading.Thread(target=self._run, name="kvtier-worker-jobs", daemon=True)
        self._thread.start()
        with _registry_lock:
            _service_workers.add(self)

    def _record_job(self, kind: str, seconds: float, failed_blocks: int) -> None:
        pass  # the transfer time reaches vLLM's metrics through TransferResult

    def wait_stores_done(self, deadline: float) -> bool:
        """Waits (until the monotonic ``deadline``) for the store queue to empty; False on timeout."""
        with self._cv:
            while self._stores:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    # -- the engine's steps (called by KvtierConnector) ------------------------------------------

    def step_begins(self, prefill_tokens: int) -> None:
        """A forward pass starts; ``prefill_tokens`` of it are prompt tokens (0 for a decode step)."""
        with self._cv:
            self._forward_running = True
            self._prefill_running = self._defer_stores and prefill_tokens > 0
            self._cv.notify_all()

    def step_ends(self) -> None:
        with self._cv:
            self._forward_running = False
            self._prefill_running = False
            self._cv.notify_all()

    # -- submission ------------------------------------------------------------------------------

    def _submit(self, vllm_job_id: int, is_load: bool, keys: list[bytes], block_ids: list[int]) -> bool:
        if len(keys) != len(block_ids):
            raise RuntimeError(
                f"kvtier: job {vllm_job_id} has {len(keys)} keys for {len(block_ids)} engine blocks; "
                "kvtier needs blocks_per_chunk=1 and one KV-cache group"
            )
        job = _Job(vllm_job_id, is_load, block_ids, time.monotonic_ns(), self._ready_marker())
        with self._cv:
            if not keys:
                self._finished.append(TransferResult(vllm_job_id, True, 0, 0.0))
                return True
            if is_load:
                self._loads.append((job, keys))
            elif self._defer_stores and self._backlog_blocks() + len(keys) > self._deferred_store_max_blocks:
                self._drop_store(job, keys)
                return True
            else:
                self._stores.append(_StoreWork(job, keys, [False] * len(keys)))
            self._pending.add(vllm_job_id)
            self._cv.notify_all()
        return True

    def _ready_marker(self) -> Any:
        """Runs on the engine's thread at submission (GPU workers record an event there)."""
        return None

    def _backlog_blocks(self) -> int:
        return sum(work.remaining for work in self._stores)

    def _drop_store(self, job: _Job, keys: list[bytes]) -> None:
        """Holds ``_cv``. The newest job goes, not the oldest: older ones hold earlier prefix blocks."""
        if self.dropped_store_blocks == 0:
            logger.warning(
                "kvtier: %d store blocks are held back behind prefill steps (deferred_store_max_blocks=%d); "
                "dropping new stores until they drain (raise the option, or set defer_stores=false)",
                self._backlog_blocks(),
                self._deferred_store_max_blocks,
            )
        self.dropped_store_blocks += len(keys)
        self._complete(job, [False] * len(keys))

    # -- the job thread --------------------------------------------------------------------------

    def _next_work(self) -> tuple[_Job, list[bytes]] | _StoreWork | None:
        """Holds ``_cv``; waits for work it may do now. None when stopping with nothing left."""
        counted_deferral = False
        while True:
            if self._loads:
                return self._loads.pop(0)
            if self._stores:
                work = self._stores[0]
                if not self._prefill_running or self._stopping or work.job.vllm_job_id in self._urgent:
                    return work
                if not counted_deferral and work.copied == 0:
                    self.deferred_store_jobs += 1
                    counted_deferral = True
            elif self._stopping:
                return None
            self._cv.wait()

    def _run(self) -> None:
        _set_affinity(self._spare_cores)
        while True:
            with self._cv:
                work = self._next_work()
            if work is None:
                return
            if isinstance(work, _StoreWork):
                self._store_batch(work)
                continue
            job, keys = work
            self._finish(job, self._load(job, keys))

    def _load(self, job: _Job, keys: list[bytes]) -> list[bool]:
        spread = self._spread_load()
        found = self._connection.call("load_blocks", keys, self._layers, job.block_ids, default=None)
        if spread:
            _set_affinity(self._spare_cores)
        return list(found) if found is not None else [False] * len(keys)

    def _store(self, job: _Job, keys: list[bytes], block_ids: list[int]) -> list[bool]:
        found = self._connection.call("store_blocks", keys, self._layers, block_ids, default=None)
        return list(found) if found is not None else [False] * len(keys)

    def _spread_load(self) -> bool:
        """While no forward pass runs the engine waits for this load, so every core copies it (the
        job thread's binding widens for the copy; True if it did). Beside a forward pass one thread
        copies, on a spare core if there is one."""
        idle = not self._forward_running
        threads = LOAD_COPY_THREADS if idle else 1
        if threads != self._copy_threads:
            self._connection.call("set_copy_threads", threads)
            self._copy_threads = threads
        if idle and self._spare_cores:
            _set_affinity(self._spare_cores | self._compute_cores)
            return True
        return False

    def _store_batch(self, work: _StoreWork) -> None:
        batch = slice(work.copied, work.copied + max(1, STORE_BATCH_BYTES // self._object_bytes))
        work.found[batch] = self._store(work.job, work.keys[batch], work.job.block_ids[batch])
        keys = work.keys[batch]
        with self._cv:
            work.copied += len(keys)
            if work.remaining > 0:
                return
            self._stores.remove(work)
        self._finish(work.job, work.found)

    def _finish(self, job: _Job, found: list[bool]) -> None:
        with self._cv:
            self._complete(job, found)
            self._pending.discard(job.vllm_job_id)
            self._urgent.discard(job.vllm_job_id)
            self._cv.notify_all()

    # -- vLLM's side -----------------------------------------------------------------------------

    def get_finished(self) -> list[TransferResult]:
        with self._cv:
            finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        deadline = time.monotonic() + self._job_timeout_ms / 1000
        with self._cv:
            # vLLM is about to reuse these jobs' engine blocks: a held-back store goes now.
            self._urgent |= self._pending & job_ids
            self._cv.notify_all()
            while self._pending & job_ids:
                left = deadline - time.monotonic()
                if left <= 0:
                    # Returning would let vLLM overwrite blocks kvtier may still be copying.
                    raise RuntimeError(
                        f"kvtier: jobs {sorted(self._pending & job_ids)} did not finish within "
                        f"job_timeout_ms={self._job_timeout_ms}; raise job_timeout_ms or check the host service"
                    )
                self._cv.wait(left)

    def take_failed_load_block_ids(self) -> set[int]:
        with self._cv:
            failed, self._failed_load_block_ids = self._failed_load_block_ids, set()
        return failed

    def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=self._job_timeout_ms / 1000)
        self._connection.close()


class GpuServiceWorker(ServiceWorker):
    """A rank whose KV cache is on a GPU: the same job queue, with the copies done by the GPU's
    DMA engine (``kvtier.gpu``): stores reserve pool slots, copy on a side stream after the engine's
    event, wait for their own event and commit; loads acquire rounds and copy each while the service
    reads the next one from NVMe. The engine's stream is never synchronized. No CPU copy threads are
    involved, so stores need not be held back behind prefill (``defer_stores`` is off)."""

    def __init__(self, connection: ServiceConnection, rows: list[torch.Tensor], job_timeout_ms: int):
        from kvtier.gpu.transfers import BlockTransfers

        # Failed service calls of the transfers count as the connection's (metrics, logs).
        self.transfers = BlockTransfers(rows, on_failed_call=connection.count_failed_call)
        client = connection.live_client()
        if client is not None:
            try:
                self.transfers.bind(client)  # pins the pool and picks the executor: fails at start-up
            except Exception as error:
                raise KvtierVllmConfigError(f"kvtier cannot move this rank's GPU KV cache: {error}") from error
        super().__init__(connection, rows, int(rows[0].shape[1]), job_timeout_ms, defer_stores=False)  # type: ignore[arg-type]
        self._object_bytes = sum(int(r.shape[1]) for r in rows)

    def _ready_marker(self) -> Any:
        return self.transfers.ready_marker()

    def _spread_load(self) -> bool:
        return False

    def _load(self, job: _Job, keys: list[bytes]) -> list[bool]:
        return self.transfers.load(self._connection.live_client(), keys, job.block_ids, job.ready)

    def _store(self, job: _Job, keys: list[bytes], block_ids: list[int]) -> list[bool]:
        return self.transfers.store(self._connection.live_client(), keys, block_ids, job.ready)

    def shutdown(self) -> None:
        super().shutdown()
        self.transfers.close()


# --------------------------------------------------------------------------------------------
# Spec and connector
# --------------------------------------------------------------------------------------------

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


class KvtierOffloadingSpec(OffloadingSpec):
    """kvtier as an OffloadingSpec; options come from kv_connector_extra_config."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return kvtier_metric_definitions()

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

    def _service_connection(self, rank: int, labelled: bool = True) -> ServiceConnection:
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
            return KvtierManager(
                ServiceBackend(self._service_connection(rank=0), prefetcher),
                pin_lease_s,
                self.options.admission,
                self.options.admission_memory_blocks,
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
            connection = self._service_connection(rank=self.config.parallel.rank)
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


def prefill_tokens(scheduler_output: Any) -> int:
    """Prompt tokens a step computes: every request scheduled for more than one token (a decode step
    schedules one per request)."""
    return sum(n for n in scheduler_output.num_scheduled_tokens.values() if n > 1)


def _fill_spec_defaults(vllm_config: Any) -> None:
    transfer_config = vllm_config.kv_transfer_config
    if transfer_config.kv_connector_extra_config is None:
        transfer_config.kv_connector_extra_config = {}
    extra_config = transfer_config.kv_connector_extra_config
    extra_config.setdefault("spec_name", SPEC_NAME)
    extra_config.setdefault("spec_module_path", SPEC_MODULE_PATH)


class KvtierConnector(OffloadingConnector):
    """OffloadingConnector that reports failed kvtier loads to vLLM, which recomputes those blocks.

    It also defaults ``spec_name``/``spec_module_path`` to kvtier's spec and sets vLLM's
    ``kv_load_failure_policy`` to ``recompute`` (kvtier is a cache: a block that fails verification
    is a miss, never an error for the request).
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any):
        _fill_spec_defaults(vllm_config)
        transfer_config = vllm_config.kv_transfer_config
        if getattr(transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            logger.info("kvtier: setting kv_load_failure_policy=recompute (a failed load is recomputed)")
            transfer_config.kv_load_failure_policy = "recompute"
        _constructing.vllm_config = vllm_config
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            _constructing.vllm_config = None

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        worker = self._kvtier_worker()
        if worker is not None:
            worker.can_report_load_failures = True

    def _kvtier_worker(self) -> KvtierWorker | None:
        connector_worker = self.connector_worker
        worker = getattr(connector_worker, "worker", None) if connector_worker is not None else None
        return worker if isinstance(worker, KvtierWorker) else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._kvtier_worker()
        return worker.take_failed_load_block_ids() if worker is not None else set()

    # The worker holds stores back during prefill steps: the scheduler says how many prompt tokens
    # each step computes. vLLM binds a step's metadata before its forward pass and calls
    # wait_for_save after it (start_load_kv too comes after it, unless a load must finish first).

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        metadata = super().build_connector_meta(scheduler_output)
        metadata.kvtier_prefill_tokens = prefill_tokens(scheduler_output)  # type: ignore[attr-defined]
        return metadata

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        worker = self._kvtier_worker()
        if worker is not None:
            worker.step_begins(getattr(connector_metadata, "kvtier_prefill_tokens", 0))

    def wait_for_save(self) -> None:
        super().wait_for_save()
        worker = self._kvtier_worker()
        if worker is not None:
            worker.step_ends()

    def clear_connector_metadata(self) -> None:
        # The step is over even on a path that skipped wait_for_save.
        super().clear_connector_metadata()
        worker = self._kvtier_worker()
        if worker is not None:
            worker.step_ends()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's offloading metrics, with its older ``transfer_type`` ones fed too.

        vLLM 0.32 counts every transfer the worker reports (bytes and seconds per load and store) in
        ``vllm:kv_offload_{load,store}_{bytes,time}``, but its older metrics
        (``vllm:kv_offload_total_bytes``, ``vllm:kv_offload_total_time``, ``vllm:kv_offload_size``,
        label ``transfer_type``) only for its own CPU spec, so with kvtier they stayed at zero while
        GBs moved. They are fed from the same figures here: ``CPU_to_GPU`` = loads from kvtier,
        ``GPU_to_CPU`` = stores into kvtier.
        """
        _fill_spec_defaults(vllm_config)
        prom_metrics = super().build_prom_metrics(vllm_config, *args, **kwargs)
        if hasattr(prom_metrics, "_observe_deprecated_metrics"):
            prom_metrics._observe_deprecated_metrics = True
        else:  # a vLLM other than 0.32: its own transfer metrics still count kvtier's transfers
            logger.warning(
                "kvtier: this vLLM's offload metrics have no switch for the transfer_type ones; "
                "vllm:kv_offload_total_* may stay at zero (read vllm:kv_offload_load_bytes and "
                "vllm:kv_offload_store_bytes)"
            )
        return prom_metrics


def kv_transfer_config(path: str | os.PathLike, **store_options: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` dict that plugs kvtier into vLLM (for ``LLM(kv_transfer_config=...)``
    via ``KVTransferConfig(**...)`` or ``--kv-transfer-config`` as JSON)."""
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": SPEC_MODULE_PATH,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": SPEC_NAME,
            "spec_module_path": SPEC_MODULE_PATH,
            "path": os.fspath(path),
            **store_options,
        },
    }
