"""The one-process layout (``host_service: false``): a kvtier.Store opened in the engine's own
process, shared by its manager and worker."""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import kvtier.vllm.store_probe as store_probe
from kvtier.threads import start_thread
from kvtier.vllm._registry import registry_lock
from kvtier.vllm.options import KvtierOptions, KvtierVllmConfigError
from kvtier.vllm.store_probe import StoreProbe, store_directories

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


class StoreNotOpen(RuntimeError):
    """The store's open has not finished (its filesystem does not answer): nothing is stored yet."""


class _Opening:
    """``_open_store`` on a thread of its own, and its outcome."""

    def __init__(self, path: Any, options: dict[str, Any]) -> None:
        self.done = threading.Event()
        self.store: Any = None
        self.error: Exception | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._in_background = False  # the start stopped waiting for it

        def open_it() -> None:
            try:
                store = _open_store(path, **options)
            except Exception as error:
                with self._lock:
                    self.error, in_background = error, self._in_background
                self.done.set()
                if in_background:
                    logger.error("kvtier: the store %s did not open (%s); serving misses (recompute)", path, error)
                return
            with self._lock:
                closed, in_background, self.store = self._closed, self._in_background, store
            self.done.set()
            if closed:
                store.close()  # its engine shut down while it opened
            elif in_background:
                logger.warning("kvtier: the store %s opened after the engine started; serving its hits", path)

        start_thread(open_it, "kvtier-open")

    def go_on_in_background(self) -> bool:
        """Whether it was still opening; if so, from now on it says when it is done."""
        with self._lock:
            self._in_background = not self.done.is_set()
            return self._in_background

    def close(self) -> None:
        with self._lock:
            self._closed = True
            store = self.store
        if store is not None:
            store.close()


class OpeningStore:
    """Stands in for a kvtier.Store whose open outlasted the engine's start (a store on a frozen
    mount): until the open finishes, lookups miss and stores are not stored (``StoreNotOpen``);
    then every call goes to the store."""

    def __init__(self, opening: _Opening) -> None:
        self._opening = opening

    @property
    def opened(self) -> Any:
        return self._opening.store

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        store = self.opened
        return store.contains_many(keys) if store is not None else [False] * len(keys)

    def locate_many(self, keys: list[bytes]) -> list[str | None]:
        store = self.opened
        return store.locate_many(keys) if store is not None else [None] * len(keys)

    def pin_many(self, keys: list[bytes]) -> list[bool]:
        store = self.opened
        return store.pin_many(keys) if store is not None else []  # one flag per present key: none

    def unpin_many(self, keys: list[bytes]) -> None:
        store = self.opened
        if store is not None:  # a pin taken since the open; none before it
            store.unpin_many(keys)

    def assign_tenant(self, keys: list[bytes], tenant: bytes) -> None:
        store = self.opened
        if store is not None:
            store.assign_tenant(keys, tenant)

    def note_retained(self, keys: list[bytes]) -> None:
        store = self.opened
        if store is not None:
            store.note_retained(keys)

    def stats(self) -> dict[str, Any]:
        store = self.opened
        return store.stats() if store is not None else {}

    def poll(self) -> list[Any]:
        store = self.opened
        return store.poll() if store is not None else []

    def close(self) -> None:
        self._opening.close()

    def __getattr__(self, name: str) -> Any:
        """The rest (transfers, waits): the store's, once it is open."""
        store = self.opened
        if store is None:
            raise StoreNotOpen(f"kvtier: the store is still opening ({name} not done; its filesystem does not answer)")
        return getattr(store, name)


# The store's real path (``registry_path``) by its path as configured: the scheduler's and the
# worker's options name one store by it, and resolving it again on a frozen mount would wait.
_registry_paths: dict[str, str] = {}


def _registry_path(options: KvtierOptions) -> tuple[str, str]:
    """The store's key in this process's registry, and why it is not its real path ("": it is). The
    real path is resolved on a thread of its own, waited ``STORE_PROBE_WAIT_S``: on a frozen mount
    resolving it waits for as long as the mount does; past the wait the absolute path stands in."""
    configured = os.pathsep.join(store_directories(options.path))
    with registry_lock:
        known = _registry_paths.get(configured)
    if known is not None:
        return known, ""
    resolved: list[str] = []
    resolving = start_thread(lambda: resolved.append(options.registry_path), "kvtier-realpath")
    resolving.join(store_probe.STORE_PROBE_WAIT_S)
    why_not = "" if resolved else StoreProbe.silence_of(configured)
    key = resolved[0] if resolved else os.pathsep.join(map(os.path.abspath, store_directories(options.path)))
    with registry_lock:
        return _registry_paths.setdefault(configured, key), why_not


def _open_within_start(options: KvtierOptions, store_options: dict[str, Any], why_not: str) -> Any:
    """The store, opened on a thread and waited as an engine's first attach to a host service is
    (``store_probe``): an open that fails within the wait raises; one that has not finished by then
    goes on in the background behind an ``OpeningStore``. ``why_not``: the store's directory is
    known not to answer already, so nothing is waited."""
    opening = _Opening(options.path, store_options)
    if not why_not:
        timed_out = f"the store did not open within {store_probe.ATTACH_AT_START_WAIT_S:g} s at start"
        why_not = store_probe.wait_at_start(opening.done, store_directories(options.path), timed_out, lambda: "")
    if opening.go_on_in_background():
        logger.error("kvtier: %s; serving misses (recompute) until it opens", why_not)
        return OpeningStore(opening)
    if opening.error is not None:
        raise opening.error
    return opening.store


def acquire_store(
    options: KvtierOptions, engine_id: str, namespace: bytes, description: dict[str, Any], object_bytes: int
) -> LocalStore:
    registry_path, silent = _registry_path(options)
    key = (registry_path, namespace)
    with registry_lock:
        local = _stores.get(key)
        if local is None:
            store_options = {"namespace": namespace, "object_bytes": object_bytes, **options.store_options}
            store = _open_within_start(options, store_options, silent)
            local = LocalStore(
                store=store,
                path=registry_path,
                namespace=namespace,
                description=description,
                object_bytes=object_bytes,
            )
            _stores[key] = local
            if not isinstance(store, OpeningStore):  # one still opening said so
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
        return _add_user(local, engine_id)


def _add_user(local: LocalStore, engine_id: str) -> LocalStore:
    """Holds ``registry_lock``."""
    local.users += 1
    local.engine_ids.add(engine_id)
    _stores_by_engine[(local.path, engine_id)] = local
    return local


def find_engine_store(options: KvtierOptions, engine_id: str) -> LocalStore | None:
    registry_path, _ = _registry_path(options)
    with registry_lock:
        local = _stores_by_engine.get((registry_path, engine_id))
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
