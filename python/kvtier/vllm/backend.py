"""What the scheduler side needs of its store: ``StoreBackend``, and the host service's ``ServiceBackend``.

``KvtierManager`` and its metrics take any ``StoreBackend``. Two meet it: ``ServiceBackend`` (the
store lives in the host service: a connection, with the prefetcher and the event feed that follow
the service on connections of their own) and ``local_store.LocalStore`` (the store in the engine's
own process, ``host_service: false``), which does so by shape alone, so neither layout's module
needs the other's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier.vllm.connection import ServiceConnection
from kvtier.vllm.events import EventFeed
from kvtier.vllm.prefetch import Prefetcher


class BlockIndex(Protocol):
    """The store's calls the scheduler makes: each answered from the store's in-memory index."""

    def contains_many(self, keys: list[bytes]) -> list[bool]: ...

    def locate_many(self, keys: list[bytes]) -> list[str | None]: ...

    def pin_many(self, keys: list[bytes]) -> list[bool]: ...

    def unpin_many(self, keys: list[bytes]) -> None: ...

    def assign_tenant(self, keys: list[bytes], tenant: bytes) -> None: ...

    def note_retained(self, keys: list[bytes]) -> None: ...

    def stats(self) -> Mapping[str, Any]: ...


class StoreBackend(Protocol):
    """A store as ``KvtierManager`` holds it, in either layout."""

    @property
    def store(self) -> BlockIndex: ...

    @property
    def prefetcher(self) -> Prefetcher | None:
        """Reads hits below DRAM into the pool before their load; None where loads read every tier."""
        ...

    @property
    def events(self) -> EventFeed | None:
        """The KV events of the store's tiers; None where nothing follows a change log."""
        ...

    def take_observations(self) -> tuple[list[tuple[str, float]], Counter]:
        """Job latencies and worker counters observed since the last call (for vLLM's stats)."""
        ...

    def release(self) -> None:
        """The manager is done with the store (its engine shuts down)."""
        ...


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
