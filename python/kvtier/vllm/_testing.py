"""What tests and benchmarks read of this process's kvtier integration. A private module: an engine
never needs these, and a public name is one users may come to rely on (``tests/test_tidy_python.py``
checks that no public module of ``kvtier.vllm`` offers them).

- ``service_connections()``: this process's open connections to host services (the manager's,
  each rank's), e.g. to find and stop the service an engine started.
- ``wait_for_stores(timeout_s)``: waits until every service worker of this process has handed the
  stores vLLM gave it to the service.
- ``open_stores()``: the in-process stores (``host_service: false``) open in this process.

Each reads a registry kept beside its objects (``connection``, ``worker``, ``local_store``).
"""

from __future__ import annotations

import time

from kvtier.vllm import connection, local_store, worker
from kvtier.vllm._registry import registry_lock


def service_connections() -> list[connection.ServiceConnection]:
    """This process's open connections to host services (the manager's, each rank's)."""
    with registry_lock:
        return list(connection._service_connections)


def wait_for_stores(timeout_s: float) -> bool:
    """Waits until every JobQueueWorker in this process has handed every store vLLM gave it to the
    service (or dropped it); False on timeout. Stores go in idle windows, so the engine must be idle."""
    with registry_lock:
        workers = list(worker._service_workers)
    deadline = time.monotonic() + timeout_s
    return all(w.wait_stores_done(deadline) for w in workers)


def open_stores() -> list[local_store.LocalStore]:
    """The kvtier stores open in this process (``host_service: false``)."""
    with registry_lock:
        return list(local_store._stores.values())
