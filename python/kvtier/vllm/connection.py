"""This process's connections to the host service, and the registries benchmarks and tests read."""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.vllm._registry import registry_lock
from kvtier.vllm.namespace import namespace_digest
from kvtier.vllm.options import KvtierOptions

if TYPE_CHECKING:
    from kvtier.vllm.events import EventFeed
    from kvtier.vllm.prefetch import Prefetcher
    from kvtier.vllm.worker import JobQueueWorker

logger = logging.getLogger("kvtier.vllm")


# A lost connection is retried at most this often, in the background: a call never waits for it.
RECONNECT_INTERVAL_S = 1.0

# Every ServiceConnection this process opened and has not closed (for the benchmarks and tests).
_service_connections: weakref.WeakSet[ServiceConnection] = weakref.WeakSet()


def service_connections() -> list[ServiceConnection]:
    """This process's open connections to host services (the manager's, each rank's)."""
    with registry_lock:
        return list(_service_connections)


# Every JobQueueWorker of this process (for the benchmarks: a worker in this process holds stores
# back, so "stored" means its queue is empty, not only that the service took what it was sent).
_service_workers: weakref.WeakSet[JobQueueWorker] = weakref.WeakSet()


def wait_for_stores(timeout_s: float) -> bool:
    """Waits until every JobQueueWorker in this process has handed every store vLLM gave it to the
    service (or dropped it); False on timeout. Stores go in idle windows, so the engine must be idle."""
    with registry_lock:
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
        populate_pool: bool = False,
    ):
        self._options = options
        self._label = label[:128]
        # A worker copies through the pool: it faults it in at each attach. The scheduler side never
        # copies, and faulting in a pool of tens of GiB would cost each of its connections seconds
        # and the page tables of the whole pool.
        self._populate_pool = populate_pool
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
        with registry_lock:
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
        if self._populate_pool:
            client.populate_pool()
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
        with registry_lock:
            _service_connections.discard(self)


@dataclass
class ServiceBackend:
    """What KvtierManager needs from its store when the store lives in the host service."""

    store: ServiceConnection
    prefetcher: Prefetcher | None = None
    events: EventFeed | None = None

    def take_observations(self) -> tuple[list[tuple[str, float]], Counter]:
        # Job latencies are observed in the worker processes; they reach vLLM as transfer times.
        return [], Counter()

    def release(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.events is not None:
            self.events.close()
        self.store.close()
