"""kvtier as the storage behind vLLM's OffloadingConnector (vLLM 0.32).

This package owns everything vLLM-specific:

- ``KvtierOffloadingSpec``: the ``OffloadingSpec`` named in ``kv_connector_extra_config``
  (``"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm"``).
- ``KvtierManager`` (scheduler side): lookups from the store's in-memory index, pins held from
  ``prepare_load`` to ``complete_load``, ``prepare_store`` skipping blocks already present.
- Workers (worker side) move engine blocks to and from the store with batched, asynchronous jobs
  (one kvtier object per engine block: that block's page in every layer): ``JobQueueWorker`` with a
  ``ServiceCopy`` or ``GpuDma`` transport (host service), ``KvtierWorker`` (in-process store).
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

The package follows vLLM's own seams (``vllm/v1/kv_offload/``: spec, load/store spec, manager,
worker). What it exports here is its public surface; the module path users configure stays
``kvtier.vllm``. Its modules in layers, lowest first; a module imports only modules of lower layers,
type-only imports included (``tests/test_tidy_python.py`` checks this list against the code):

1. ``options``, ``_registry``, ``load_store_spec``, ``idle_publish``, ``cores``, ``logs``, ``jobs``:
   the options, the registries' lock, what a job moves, KV events published by an idle engine core, the
   job thread's cores, kvtier's log lines through vLLM's handler, a worker's jobs and their results
1. ``hints``, ``store_probe``, ``locations``: what a request's ``kv_transfer_params`` tell kvtier;
   whether the store's directories answer (an engine's start waits for its store within limits);
   where a request's blocks are, located once per lookup pass
2. ``namespace``, ``costs``, ``local_store``: the engine's namespace, load or recompute, the
   in-process store (``host_service: false``)
3. ``connection``: this process's connection to the host service
4. ``transports``: how a host-service worker copies (CPU rows, GPU DMA)
5. ``prefetch``, ``events``, ``worker``: the scheduler's prefetcher and KV-event feed; the worker side
   (in-process, host service, GPU)
6. ``backend``: the store as the scheduler side sees it (``StoreBackend``, ``ServiceBackend``)
7. ``metrics``: kvtier's metrics on vLLM's ``/metrics``
8. ``manager``: the scheduler side (``KvtierManager``)
9. ``spec``: ``KvtierOffloadingSpec``, which vLLM builds in both processes
10. ``connector``, ``_testing``: ``KvtierConnector`` and ``kv_transfer_config``; what tests and
   benchmarks read of this process's integration (a private module, not exported here)
"""

from __future__ import annotations

from kvtier.vllm.backend import (
    ServiceBackend,
)
from kvtier.vllm.connection import (
    ServiceConnection,
)
from kvtier.vllm.connector import (
    KvtierConnector,
    kv_transfer_config,
)
from kvtier.vllm.load_store_spec import (
    KvtierLoadStoreSpec,
)
from kvtier.vllm.local_store import (
    LocalStore,
)
from kvtier.vllm.manager import (
    KvtierManager,
)
from kvtier.vllm.metrics import (
    kvtier_metric_definitions,
)
from kvtier.vllm.namespace import (
    canonical_placement,
    check_hash_algo,
    kvtier_key,
    model_fingerprint,
    namespace_description,
    namespace_digest,
    service_namespace_description,
)
from kvtier.vllm.options import (
    INTEGRATION_OPTION_DEFAULTS,
    SPEC_MODULE_PATH,
    SPEC_NAME,
    KvtierOptions,
    KvtierVllmConfigError,
)
from kvtier.vllm.prefetch import (
    Prefetcher,
)
from kvtier.vllm.spec import (
    KvtierOffloadingSpec,
)
from kvtier.vllm.transports import (
    GpuDma,
    ServiceCopy,
)
from kvtier.vllm.worker import (
    GpuServiceWorker,
    JobQueueWorker,
    KvtierWorker,
    ServiceWorker,
)

__all__ = [
    "INTEGRATION_OPTION_DEFAULTS",
    "SPEC_MODULE_PATH",
    "SPEC_NAME",
    "GpuDma",
    "GpuServiceWorker",
    "JobQueueWorker",
    "KvtierConnector",
    "KvtierLoadStoreSpec",
    "KvtierManager",
    "KvtierOffloadingSpec",
    "KvtierOptions",
    "KvtierVllmConfigError",
    "KvtierWorker",
    "LocalStore",
    "Prefetcher",
    "ServiceBackend",
    "ServiceConnection",
    "ServiceCopy",
    "ServiceWorker",
    "canonical_placement",
    "check_hash_algo",
    "kv_transfer_config",
    "kvtier_key",
    "kvtier_metric_definitions",
    "model_fingerprint",
    "namespace_description",
    "namespace_digest",
    "service_namespace_description",
]
