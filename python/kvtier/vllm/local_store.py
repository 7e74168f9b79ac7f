"""The one-process layout (``host_service: false``): a kvtier.Store opened in the engine's own
process, shared by its manager and worker."""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from kvtier.vllm._registry import registry_lock
from kvtier.vllm.options import KvtierOptions, KvtierVllmConfigError

logger = logging.getLogger("kvtier.vllm")

# Job results nobody claims (their worker shut down) kept at most.
MAX_UNCLAIMED_JOB_RESULTS = 10_000


@dataclass
class LocalStore:
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

    # What backend.StoreBackend asks of a store beside it, neither of which this layout has: a load
    # reads whatever tier holds its blocks itself, and no host service keeps a change log to follow.
    @property
    def prefetcher(self) -> None:
        return None

    @property
    def events(self) -> None:
        return None

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


# The stores open in this process (under ``registry_lock``; tests read them through
# ``kvtier.vllm._testing.open_stores``).
_stores: dict[tuple[str, bytes], LocalStore] = {}
_stores_by_engine: dict[tuple[str, str], LocalStore] = {}


def _open_store(path: Any, **options: Any) -> Any:
    import kvtier  # the Rust core; imported late so that this module imports without it

    return kvtier.Store.open(path, **options)


def acquire_store(
    options: KvtierOptions, engine_id: str, namespace: bytes, description: dict[str, Any], object_bytes: int
) -> LocalStore:
    key = (options.registry_path, namespace)
    with registry_lock:
        local = _stores.get(key)
        if local is None:
            store = _open_store(options.path, namespace=namespace, object_bytes=object_bytes, **options.store_options)
            local = LocalStore(
                store=store,
                path=options.registry_path,
                namespace=namespace,
                description=description,
                object_bytes=object_bytes,
            )
            _stores[key] = local
            logger.info(
                "kvtier: opened store %s namespace %s (object %d bytes) for %s",
                options.path,
                namespace.hex()[:16],
                object_bytes,
                description.get("model"),
            )
        elif local.object_bytes != object_bytes:
            raise KvtierVllmConfigError(
                f"kvtier store {options.path} is open in this process with {local.object_bytes}-byte objects; "
                f"this engine needs {object_bytes}"
            )
        local.users += 1
        local.engine_ids.add(engine_id)
        _stores_by_engine[(options.registry_path, engine_id)] = local
        return local


def find_engine_store(options: KvtierOptions, engine_id: str) -> LocalStore | None:
    with registry_lock:
        local = _stores_by_engine.get((options.registry_path, engine_id))
        if local is not None:
            local.users += 1
        return local


def release_store(local: LocalStore) -> None:
    with registry_lock:
        local.users -= 1
        if local.users > 0:
            return
        _stores.pop((local.path, local.namespace), None)
        for engine_id in local.engine_ids:
            _stores_by_engine.pop((local.path, engine_id), None)
    try:
        local.store.close()
    except Exception:  # closing is best effort at shutdown
        logger.exception("kvtier: closing store %s failed", local.path)
