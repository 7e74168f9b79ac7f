"""What tests and benchmarks read of this process's kvtier integration, kept out of ``kvtier.vllm``'s
public names: an engine never needs them, and a name there is one users may come to rely on.

- ``service_connections()``: this process's open connections to host services (the manager's,
  each rank's), e.g. to find and stop the service an engine started.
- ``wait_for_stores(timeout_s)``: waits until every service worker of this process has handed the
  stores vLLM gave it to the service.
- ``open_stores()``: the in-process stores (``host_service: false``) open in this process.

Each reads a registry kept beside its objects (``connection``, ``worker``, ``local_store``).
"""

from __future__ import annotations

from kvtier.vllm.connection import service_connections
from kvtier.vllm.local_store import open_stores
from kvtier.vllm.worker import wait_for_stores

__all__ = ["open_stores", "service_connections", "wait_for_stores"]
