"""KV events for routers: what kvtier holds, per tier, as vLLM's ``OffloadingEvent`` stream.

vLLM publishes the events a manager yields from ``take_events()`` on its KV-event publisher
(``--kv-events-config``: ZMQ, ``BlockStored`` / ``BlockRemoved``), so prefix-aware routers (llm-d's
KV-cache indexer, Dynamo's KV router) see where a prefix lives. kvtier's blocks live in the host
service, which every engine on the host shares, and only the service knows what other engines
stored and what eviction, trim, quarantine or a restart removed. So the service keeps a change log
per namespace (``Op::Changes``, docs/service.md) and each engine's manager follows it here, on a
thread and a connection of its own, off the scheduler's path:

- the DRAM pool is vLLM's CPU medium, local (every engine on the host can load it);
- NVMe is the storage medium, local, owned by ``kvtier-nvme``;
- the shared tier is the storage medium, remote (any engine on any node can load it), owned by
  ``kvtier-shared``.

A follower that fell behind the service's bounded log (or a service that restarted and lost its
DRAM tier) gets a reset: it reports every block it had reported as removed, then the service's
current state as stored. Events wait for vLLM in a queue; if vLLM stops taking them, the queue
past ``MAX_PENDING_EVENTS`` is folded into its net effect (what routers were told against what the
log says now), so that no removal a router needs is dropped and memory stays bounded.

Only blocks whose kvtier key is the engine's own block hash (one KV-cache group, a 32-byte prefix
hash) can be named in vLLM's terms; others are skipped and counted.

vLLM 0.33's self-describing events (``self_describing_kv_events``) keep each stored block's tokens
from the scheduler's store until the last removal of that block from a tier that said it expects
one. kvtier reports a removal for every block it stops holding, in every tier, so its stored events
say ``removal_expected``. A store this engine asked for that never landed (dropped behind prefill,
refused by a full pool, a failed copy) has no stored event and would keep its snapshot in vLLM for
the engine's life: after the store completes, the feed reads a change log refreshed after that
moment (``SETTLE_AFTER_S``) and releases every such block with a ``metadata_only`` removal, which
frees the snapshot and tells routers nothing. vLLM 0.32 has neither field and keeps no snapshot;
there the feed only counts.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from kvtier.threads import start_thread
from kvtier.vllm.connection import ServiceConnection

logger = logging.getLogger("kvtier.vllm")

# (medium, locality, ownership) of each kvtier tier as the service names it.
TIER_MEDIA: dict[str, tuple[Medium, Locality, str | None]] = {
    "dram": (Medium.CPU, Locality.LOCAL, None),
    "nvme": (Medium.STORAGE, Locality.LOCAL, "kvtier-nvme"),
    "shared": (Medium.STORAGE, Locality.REMOTE, "kvtier-shared"),
}
# How often the feed reads the service's change log. The service reads the store into the log when
# a follower asks and the log is older than 0.5 s: a change reaches the feed within about 0.5 s plus
# two polls.
POLL_INTERVAL_S = 0.25
# Changes asked for per call; the service answers at most this many (a reset's snapshot too).
CHANGES_PER_CALL = 1 << 16
# Blocks named by the events held for vLLM between two take_events() calls. Past it (and past twice
# the blocks reported, so that folding halves the queue at least), the queue is folded into its net
# effect (``EventFeed._fold``).
MAX_PENDING_EVENTS = 1 << 20
# Completed stores waiting for the change log to say whether they landed; past it the oldest go
# unchecked (vLLM then keeps their snapshots until a cache reset, as it would without this check).
MAX_UNSETTLED_BLOCKS = 1 << 18
# A completed store is settled by a poll that starts at least this long after it. The service reads
# the store into a log only when a follower asks and the log is older than its 0.5 s refresh period
# (``REFRESH_PERIOD``), and another engine's feed (or ``kvtier ls --blocks``) may have just had it
# refreshed, before the store landed: only a log last refreshed more than 0.5 s before the poll is
# read again, so the poll sees every store that completed before that.
SETTLE_AFTER_S = 0.6
_EVENT_FIELDS = {field.name for field in dataclasses.fields(OffloadingEvent)}


def offloading_event(keys: list[OffloadKey], tier: str, removed: bool, **flags: bool) -> OffloadingEvent:
    """vLLM's event for kvtier's ``tier``; flags vLLM's version does not know (0.32) are left out."""
    medium, locality, ownership = TIER_MEDIA[tier]
    known = {name: value for name, value in flags.items() if name in _EVENT_FIELDS}
    return OffloadingEvent(keys=keys, medium=medium, removed=removed, locality=locality, ownership=ownership, **known)


@dataclasses.dataclass
class Queued:
    """An event waiting for vLLM, with the kvtier keys it names."""

    event: OffloadingEvent
    tier: str | None  # None: a ``metadata_only`` release, which routers never see
    keys: list[bytes]


# Changes of one batch: (tier, removed) -> [(kvtier key, vLLM's key)].
Batch = dict[tuple[str, bool], list[tuple[bytes, OffloadKey]]]


class EventFeed:
    """Follows the service's change log of one namespace; ``take()`` hands vLLM what changed since
    the last call. ``offload_key`` maps a kvtier key to vLLM's ``OffloadKey`` (``None``: not
    nameable)."""

    def __init__(
        self,
        connect: Callable[[], ServiceConnection],
        offload_key: Callable[[bytes], OffloadKey | None],
        poll_interval_s: float = POLL_INTERVAL_S,
        wake: Callable[[], None] | None = None,
    ):
        self._connect = connect
        self._offload_key = offload_key
        self._poll_interval_s = poll_interval_s
        # Called when a poll left events waiting: vLLM drains them only after a model step, so an
        # idle engine is asked to publish them (``kvtier.vllm.idle_publish``).
        self._wake = wake
        self._lock = threading.Lock()
        self._pending: list[Queued] = []
        self._pending_keys = 0
        # Per tier, the blocks the log says are there as far as the feed read it (what the events
        # queued so far tell), and the blocks routers were told of (the events vLLM took).
        self._reported: dict[str, set[bytes]] = {tier: set() for tier in TIER_MEDIA}
        self._delivered: dict[str, set[bytes]] = {tier: set() for tier in TIER_MEDIA}
        self._cursor = 0
        self._unsettled: list[tuple[float, bytes]] = []  # (time.monotonic() of its completion, key)
        self._restate_requested = False
        self.resets = 0
        self.folds = 0
        self.unnameable_keys = 0
        self.unlanded_store_blocks = 0
        self._stop = threading.Event()
        self._thread = start_thread(self._run, "kvtier-events")

    def take(self) -> list[OffloadingEvent]:
        with self._lock:
            queued, self._pending, self._pending_keys = self._pending, [], 0
            for item in queued:
                if item.tier is not None:
                    delivered = self._delivered[item.tier]
                    (delivered.difference_update if item.event.removed else delivered.update)(item.keys)
        return [item.event for item in queued]

    def expect_stored(self, keys: Iterable[bytes]) -> None:
        """Stores of these kvtier keys completed: the next poll releases those that did not land."""
        with self._lock:
            completed_at = time.monotonic()
            self._unsettled.extend((completed_at, key) for key in keys)
            overflow = len(self._unsettled) - MAX_UNSETTLED_BLOCKS
            if overflow > 0:
                del self._unsettled[:overflow]

    def restate(self) -> None:
        """vLLM cleared its caches and told routers ``AllBlocksCleared``, which drops kvtier's tiers
        from their index too, though kvtier still holds every block: the next poll states them
        again."""
        with self._lock:
            self._restate_requested = True

    def _run(self) -> None:
        connection: ServiceConnection | None = None
        while not self._stop.wait(self._poll_interval_s):
            if connection is None:
                try:
                    connection = self._connect()
                except Exception as error:
                    logger.warning("kvtier: KV events cannot reach the host service (%s); retrying", error)
                    continue
            self.poll_once(connection)
            with self._lock:
                waiting = bool(self._pending)
            if waiting and self._wake is not None:
                self._wake()
        if connection is not None:
            connection.close()

    def poll_once(self, connection: ServiceConnection) -> None:
        """Reads what changed since the cursor (every page of it) and queues the events; then
        settles the stores that completed ``SETTLE_AFTER_S`` before this poll began."""
        settled_before = time.monotonic() - SETTLE_AFTER_S
        with self._lock:
            ripe = next((i for i, (at, _) in enumerate(self._unsettled) if at > settled_before), len(self._unsettled))
            settling = self._unsettled[:ripe]
            del self._unsettled[:ripe]
            restate, self._restate_requested = self._restate_requested, False
        if restate:
            held = [(key, tier) for tier, keys in self._reported.items() for key in keys]
            for reported in self._reported.values():
                reported.clear()
            with self._lock:  # routers dropped every block with vLLM's AllBlocksCleared
                for delivered in self._delivered.values():
                    delivered.clear()
            self._queue([(key, tier, False) for key, tier in held])
        caught_up = self._read_changes(connection)
        if caught_up:
            self._release_unlanded([key for _, key in settling])
        else:
            with self._lock:
                self._unsettled[:0] = settling

    def _read_changes(self, connection: ServiceConnection) -> bool:
        """Whether the feed reached the end of the service's change log."""
        for _ in range(64):  # at most 64 pages a round; the rest waits for the next round
            answer = connection.call("changes", self._cursor, CHANGES_PER_CALL, default=None)
            if answer is None:
                return False
            reset, next_cursor, changes = answer
            if reset:
                self._reset()
            self._queue(changes)
            self._cursor = next_cursor
            if len(changes) < CHANGES_PER_CALL:
                return True
        return False

    def _release_unlanded(self, keys: list[bytes]) -> None:
        """The change log is read past these stores' completion: a key no tier reported never
        landed (or already left, and its removal went out)."""
        unlanded = {key for key in keys if not any(key in reported for reported in self._reported.values())}
        self.unlanded_store_blocks += len(unlanded)
        if not unlanded or "metadata_only" not in _EVENT_FIELDS:
            return
        offload_keys = [k for k in map(self._offload_key, unlanded) if k is not None]
        if offload_keys:
            event = offloading_event(offload_keys, "dram", True, metadata_only=True)
            with self._lock:
                self._pending.append(Queued(event, None, []))
                self._pending_keys += len(offload_keys)

    def _reset(self) -> None:
        """Everything reported so far is withdrawn; the snapshot that follows restates the rest."""
        self.resets += 1
        removed = [(key, tier, True) for tier, keys in self._reported.items() for key in keys]
        self._queue(removed)

    def _queue(self, changes: list[tuple[bytes, str, bool]]) -> None:
        """Queues vLLM's events for ``changes``, in the log's order. A page can span several log
        refreshes (another engine's feed or ``kvtier ls --blocks`` refreshed the log in between), so
        one block can be stored and removed again within it: events are cut into batches in which
        each (block, tier) changes at most once, and only inside a batch are changes grouped (a
        router applying the batch gets the same state in any order within it)."""
        queued: list[Queued] = []
        batch: Batch = {}
        changed: set[tuple[bytes, str]] = set()
        for key, tier, removed in changes:
            if not self._record(key, tier, removed):
                continue
            offload_key = self._offload_key(key)
            if offload_key is None:
                self.unnameable_keys += 1
                continue
            if (key, tier) in changed:
                queued += batch_events(batch)
                batch, changed = {}, set()
            changed.add((key, tier))
            batch.setdefault((tier, removed), []).append((key, offload_key))
        queued += batch_events(batch)
        with self._lock:
            self._pending.extend(queued)
            self._pending_keys += sum(len(item.keys) for item in queued)
            reported_blocks = sum(len(keys) for keys in self._reported.values())
            if self._pending_keys > max(MAX_PENDING_EVENTS, 2 * reported_blocks):
                self._fold()

    def _fold(self) -> None:
        """Holds the lock. vLLM stopped draining (a stuck scheduler, an engine that never steps):
        the queue becomes its net effect, what routers were told against what the log says now
        (removals first). Nothing a router needs is lost, and the queue stays within the blocks
        reported. Not a reset: vLLM's ``AllBlocksCleared`` carries no medium, and routers apply it
        to the GPU tier or to every tier of the engine (llm-d), not to kvtier's alone. Pending
        ``metadata_only`` releases are dropped (vLLM 0.33 then keeps those snapshots until a cache
        reset, as past ``MAX_UNSETTLED_BLOCKS``)."""
        self.folds += 1
        removals = {tier: self._delivered[tier] - self._reported[tier] for tier in TIER_MEDIA}
        stores = {tier: self._reported[tier] - self._delivered[tier] for tier in TIER_MEDIA}
        batch: Batch = {}
        for removed, keys_by_tier in ((True, removals), (False, stores)):
            for tier, keys in keys_by_tier.items():
                named = [(key, offload_key) for key in keys if (offload_key := self._offload_key(key)) is not None]
                if named:
                    batch[(tier, removed)] = named
        self._pending = batch_events(batch)
        self._pending_keys = sum(len(item.keys) for item in self._pending)

    def _record(self, key: bytes, tier: str, removed: bool) -> bool:
        """Whether this change is news to the router (a store of a block not reported in ``tier``,
        a removal of one that was); records it."""
        reported = self._reported.get(tier)
        if reported is None:
            return False
        if removed:
            if key not in reported:
                return False
            reported.discard(key)
        else:
            if key in reported:
                return False
            reported.add(key)
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def batch_events(batch: Batch) -> list[Queued]:
    """One event per (tier, removed) of a batch, removals first (the change log's own order)."""
    queued = []
    for (tier, removed), named in sorted(batch.items(), key=lambda item: not item[0][1]):
        # Every tier reports its removals (evictions, trims, quarantines, lost DRAM), so vLLM 0.33 may
        # keep a stored block's tokens until then.
        event = offloading_event([k for _, k in named], tier, removed, removal_expected=not removed)
        queued.append(Queued(event, tier, [key for key, _ in named]))
    return queued


def direct_offload_key(group_id: int) -> Callable[[bytes], Any]:
    """kvtier keys are the engine's own 32-byte block hashes for group 0 (``kvtier_key``); those
    map back to vLLM's ``OffloadKey``. A model whose offloaded group is another has folded keys,
    which cannot be named: its feed reports nothing (and counts them)."""
    from vllm.v1.kv_offload.base import make_offload_key

    if group_id != 0:
        return lambda key: None
    return lambda key: make_offload_key(key, 0)
