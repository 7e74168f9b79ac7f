"""The scheduler side: ``KvtierManager`` (vLLM's ``OffloadingManager``)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier import tiers
from kvtier._core import tenant_id
from kvtier.vllm.backend import StoreBackend
from kvtier.vllm.costs import LoadDecider
from kvtier.vllm.events import EventFeed
from kvtier.vllm.hints import is_retained, retained_tokens
from kvtier.vllm.load_store_spec import KvtierLoadStoreSpec
from kvtier.vllm.locations import Locations
from kvtier.vllm.metrics import StatsDeltaTracker
from kvtier.vllm.namespace import kvtier_key
from kvtier.vllm.options import INTEGRATION_OPTION_DEFAULTS

logger = logging.getLogger("kvtier.vllm")


# Tiers a block can vanish from between lookup and load (another host's evictor): never pinned.
REMOTE_TIERS = tiers.REMOTE

# How often the manager asks the store whether it tracks tenants (a split pool, tenant keys).
TENANCY_CHECK_S = 30.0
# Requests with a load prepared that the manager remembers (a request whose end vLLM never told
# is forgotten, oldest first, past this many).
MAX_LOADED_REQUESTS = 4096
# Rounds a pin (or the re-pin after a reattach) is tried while reattaches keep moving the engine's
# pins to a new client under it (another thread's failed call lets the client go at any time).
PIN_TRIES = 3

# store.locate_many() tier -> vLLM's cache-hit source (shared and unknown: external_unspecified).
_HIT_SOURCE_BY_TIER = {"dram": CacheHitSource.HOST, "nvme": CacheHitSource.DISK}


class KvtierManager(OffloadingManager):
    """Scheduler-side catalog access: every answer comes from the store's in-memory index."""

    def __init__(
        self,
        backend: StoreBackend,
        pin_lease_s: float = 300.0,
        admission: str = "all",
        admission_memory_blocks: int = 1 << 18,
        config_info: Mapping[str, str | int | float | bool] | None = None,
        pending_timeout_s: float = 2.0,
        load_policy: str = "auto",
        block_tokens: int = 16,
        load_wait_max_ratio: float = float(INTEGRATION_OPTION_DEFAULTS["load_wait_max_ratio"]),
    ):
        self._backend = backend
        self._config_info = dict(config_info or {})
        self._store = backend.store
        # Pins this engine holds, per request: a request releases only its own pins, never another
        # request's pin on the same block.
        self._pins: dict[str, Counter[bytes]] = {}
        # When each request took its pins. A request that never reaches complete_load (vLLM dropped
        # it between prepare_load and the load) would hold its pins for the engine's whole life and
        # fill the DRAM pool with unevictable blocks: past the lease they are released.
        self._pinned_at: dict[str, float] = {}
        self._pin_lease_s = pin_lease_s
        # The host service's client the pins are held on: a call that failed let go of the one that
        # took them, and the service released them with it (``_repin_after_reattach``).
        self._pins_epoch = self._client_epoch()
        self.pins_lost_at_reattach = 0
        # Plain route: per request, the pins its lookups took (``_hold``); its load takes them over,
        # the step's end releases the rest (a request vLLM did not schedule).
        self._held: dict[str, dict[bytes, None]] = {}  # in the order pinned
        self._being_stored: Counter[bytes] = Counter()
        # When each key began being stored: a request waits in HIT_PENDING for a store at most
        # ``pending_timeout_s`` (one stuck behind a frozen service turns into a miss, recomputed).
        self._store_began: dict[bytes, float] = {}
        self._pending_timeout_s = pending_timeout_s
        self.expired_pending = 0
        # "second_sight": keys computed once and not stored, oldest first (an LRU of key -> None).
        self._second_sight: OrderedDict[bytes, None] | None = OrderedDict() if admission == "second_sight" else None
        self._admission_memory_blocks = admission_memory_blocks
        self.not_admitted_blocks = 0
        self._prefetcher = backend.prefetcher
        self._locations = Locations(lambda store_keys: self._store.locate_many(store_keys), kvtier_key)
        # Set by KvtierConnector, which reports failed loads to vLLM (recomputed). Under vLLM's plain
        # OffloadingConnector a failed load stops the engine, so only blocks a pin holds (in DRAM or
        # on NVMe) are offered there: one held only by a remote tier can vanish before its load.
        self.recomputes_failed_loads = False
        # The tenant (kvtier._core.tenant_id of its cache_salt) of each running request that has a
        # salt, told by KvtierConnector; its stores and loads are charged to that tenant's share of
        # the DRAM pool (docs/tenants.md). Requests without a salt are the default tenant's.
        self._tenants: dict[str, bytes] = {}
        # Whether the store tracks tenants (its pool is split by tenant, or it seals blocks under
        # their tenant's key), asked at most every TENANCY_CHECK_S: naming tenants costs a call to
        # the host service per store and load, paid only where it counts.
        self._tenancy = False
        self._tenancy_checked_at = -TENANCY_CHECK_S
        self._stats = StatsDeltaTracker()
        self._stats.prime(backend)
        # Load or recompute (kvtier.vllm.costs): fed by KvtierConnector (step times, load times) and
        # the prefetcher (what NVMe and remote tiers deliver now).
        self.decider = LoadDecider(load_policy, block_tokens, load_wait_max_ratio)
        self._probe_keys: list[bytes] = []  # the hits last read aside to time a tier (``_probe_aside``)
        # Requests whose load was prepared (``_after_load``); those being requeued, with the keys
        # their requeued lookup pass has seen; and those requeued since, which recompute.
        self._loaded: OrderedDict[str, None] = OrderedDict()
        self._requeue: dict[str, set[bytes]] = {}
        self._recompute: set[str] = set()
        self.requeued_after_load = 0
        if self._prefetcher is not None:
            self._prefetcher.rates = self.decider.rates
            self.decider.queued_s = self._prefetcher.backlog_s

    @staticmethod
    def _allowed(req_context: ReqContext) -> bool:
        tier_filter = req_context.load_tier_filter
        return tier_filter.allows(Medium.CPU, Locality.LOCAL) or tier_filter.allows(Medium.STORAGE, Locality.LOCAL)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self._allowed(req_context):
            return LookupResult.MISS
        store_key = kvtier_key(key)
        after_load = self._after_load(req_context.req_id, store_key)
        if after_load is not None:
            return after_load
        try:
            tier = self._locations.tier_of(key, store_key, req_context)
        except Exception:
            logger.exception("kvtier: lookup failed; treating as a miss")
            return LookupResult.MISS
        # Without the prefetcher the worker's load reads a block from whatever tier holds it, and the
        # loads' measured rate (DRAM's) covers every tier: no per-tier rate exists to probe for.
        cost_tier = tier if tier is None or self._prefetcher is not None else "dram"
        answer = self.decider.answer(req_context.req_id, store_key, cost_tier)
        if answer == "retry":
            return LookupResult.RETRY
        if answer == "probe_aside":
            self._probe_aside(self.decider.take_probe(req_context.req_id))
            return LookupResult.MISS
        if answer == "decline" and (tier is not None or self.decider.policy == "never"):
            return LookupResult.MISS
        result = self._offer(store_key, tier)
        if (
            result is LookupResult.HIT
            and not self.recomputes_failed_loads
            and not self._hold(req_context, key, store_key)
        ):
            return LookupResult.MISS  # it left the host's tiers since it was located
        return result

    def _hold(self, req_context: ReqContext, key: OffloadKey, store_key: bytes) -> bool:
        """Under vLLM's plain OffloadingConnector, which stops the engine on a failed load: pins the
        block a lookup offers then, not at prepare_load later in the step (another engine's store
        could evict it in between), with the request's next blocks up to the first the host lacks,
        in the same call (``Locations.held_here``). False when the block left meanwhile. The pin
        counts as a use (evidence of reuse, S3-FIFO's touch): the prompt came back for it."""
        self._repin_after_reattach()
        held = self._held.get(req_context.req_id, {})
        if store_key in held:
            return True
        later = self._locations.held_here(req_context, key)
        keys = [store_key, *(key for key in later if key not in held)]
        pinned = self._pin_now(keys)
        held = self._held.setdefault(req_context.req_id, {})  # after a reattach, the one taken again
        held.update(dict.fromkeys(key for key, took_pin in zip(keys, pinned, strict=False) if took_pin))
        return store_key in held

    def _pin_now(self, keys: list[bytes]) -> list[bool]:
        """``pin_many`` (one flag per leading present key) on the client the engine's pins are on.
        A reattach around the call (the connection let the client go: a failed call, this thread's
        or another's) moves the engine's other pins to the new client (``_repin_after_reattach``);
        these are kept only if the client that took them is that one, else taken again there. The
        caller records them, reading its request's pins afresh."""
        for _ in range(PIN_TRIES):
            pinned, served = self._pin_many_served(keys)
            self._repin_after_reattach()
            if not any(pinned) or served == self._pins_epoch:
                return pinned
            if served is not None:  # a client let go since: its pins go with it, or are released here
                self._unpin_at([key for key, took in zip(keys, pinned, strict=False) if took], served)
        return []

    def _pin_many_served(self, keys: list[bytes]) -> tuple[list[bool], int | None]:
        """``pin_many``, with the epoch of the client that took the pins (None: a client let go
        before the call returned); no flag when the call failed (logged): its blocks are misses or
        their load fails. A store in this process has one client for good."""
        if not keys:
            return [], self._pins_epoch
        try:
            pin_many_served = getattr(self._store, "pin_many_served", None)
            if pin_many_served is None:
                return self._store.pin_many(keys), self._client_epoch()
            return pin_many_served(keys)
        except Exception:
            logger.exception("kvtier: pin failed")
            return [], None

    def _unpin_at(self, keys: list[bytes], epoch: int) -> None:
        """Releases pins the client of ``epoch`` took, if it is still attached (``unpin_many_at``)."""
        unpin_many_at = getattr(self._store, "unpin_many_at", None)
        if keys and unpin_many_at is not None:
            unpin_many_at(keys, epoch)

    def _after_load(self, req_id: str, store_key: bytes) -> LookupResult | None:
        """The answer to a lookup of a request vLLM looks up again after its load was prepared (the
        load failed whole, or the request was preempted), None for any other.

        Its first lookup pass is answered RETRY. vLLM looks such a request up from its queue of
        requests that hold KV blocks, though this one holds none any more; if its new load does not
        fit, vLLM's scheduler (0.32) stops at it every step, while the requests queued behind it,
        whose loads completed, hold the blocks it needs: the engine stalls for good (seen under
        load: four requests in flight, a bucket behind a 50 MB/s link). RETRY makes vLLM skip the
        request for a step and queue it again with the requests that hold nothing, behind those
        that do. From the next pass on it is a miss: the request recomputes, rather than load again
        what just failed (at 20 MB/s, behind a stuck transfer, 36 requests failed 1,066 loads that
        way)."""
        if req_id in self._recompute:
            return LookupResult.MISS
        seen = self._requeue.get(req_id)
        if seen is None:
            if req_id not in self._loaded:
                return None
            del self._loaded[req_id]
            self.requeued_after_load += 1
            self.decider.forget(req_id)
            self._requeue[req_id] = {store_key}
            return LookupResult.RETRY
        if store_key in seen:  # the next pass began: the request was requeued
            del self._requeue[req_id]
            if len(self._recompute) >= MAX_LOADED_REQUESTS:
                self._recompute.pop()  # a request whose end vLLM never told
            self._recompute.add(req_id)
            return LookupResult.MISS
        seen.add(store_key)
        return LookupResult.RETRY

    def _probe_aside(self, probe: list[tuple[bytes, str]]) -> None:
        """Reads a request's hits (key, tier) on a tier with no rate yet into DRAM in the background,
        which times the tier, while the request recomputes them. One probe at a time: its rate
        serves every request, and a slow link is not filled with probes."""
        prefetcher = self._prefetcher
        if prefetcher is None or not probe or prefetcher.in_flight(self._probe_keys):
            return
        self._probe_keys = [key for key, _ in probe]
        for key, tier in probe:
            prefetcher.lookup(key, tier)

    def _offer(self, store_key: bytes, tier: str | None) -> LookupResult:
        """A block the decider offers: a hit on ``tier`` (through the prefetcher below DRAM), or for
        ``tier`` None a block still being copied out of the engine, or a miss."""
        if tier is not None:
            # The store shows a block only once its bytes are complete, even if vLLM has not yet
            # been told that the store job finished.
            if tier != "dram" and self._prefetcher is not None:
                result = self._prefetcher.lookup(store_key, tier)
                if result is LookupResult.HIT and tier in REMOTE_TIERS and not self.recomputes_failed_loads:
                    return LookupResult.MISS  # its prefetch ended, yet no local tier holds it
                return result
            if tier in REMOTE_TIERS and not self.recomputes_failed_loads:
                return LookupResult.MISS
            return LookupResult.HIT
        if store_key in self._being_stored:
            # Still being copied out of the engine: the request waits a step for it instead of
            # recomputing what is about to be readable (a dropped store turns this into a miss).
            if time.monotonic() - self._store_began.get(store_key, 0.0) <= self._pending_timeout_s:
                return LookupResult.HIT_PENDING
            self.expired_pending += 1
        return LookupResult.MISS

    def _tracks_tenants(self) -> bool:
        now = time.monotonic()
        if now - self._tenancy_checked_at >= TENANCY_CHECK_S:
            self._tenancy_checked_at = now
            try:
                stats = self._store.stats()
                self._tenancy = "untracked_tenant_blocks" in stats or "tenant_keys" in stats
            except Exception:
                self._tenancy = False
        return self._tenancy

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """The tier a hit is served from, for vLLM's ``vllm:prompt_tokens_cached_by_source``.

        vLLM asks after ``prepare_load`` and before the load runs, so ``locate_many`` (memory only)
        still names the tier the worker will read. vLLM has no member for a shared filesystem; its
        ``external_unspecified`` is documented as the source of remote stores, so shared hits go
        there (``kvtier:block_hits{tier="shared"}`` and ``{tier="bucket"}`` count them exactly).
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
        self.decider.forget(req_context.req_id)
        self._loaded[req_context.req_id] = None
        while len(self._loaded) > MAX_LOADED_REQUESTS:
            self._loaded.popitem(last=False)
        store_keys = [kvtier_key(key) for key in keys]
        self._repin_after_reattach()
        request_pins = self._pins.setdefault(req_context.req_id, Counter())
        # The pins its lookups took (plain route) are the load's now; the other keys are pinned here.
        held = self._held.pop(req_context.req_id, {})
        to_pin = []
        for store_key in store_keys:
            if store_key in held:
                del held[store_key]
                request_pins[store_key] += 1
            else:
                to_pin.append(store_key)
        epoch = self._pins_epoch
        # One flag per present key: False for a block only in a remote tier (no pin taken).
        pinned = self._pin_now(to_pin)
        request_pins = self._pins.setdefault(req_context.req_id, Counter())  # a reattach took them again
        for store_key, took_pin in zip(to_pin, pinned, strict=False):  # flags for present keys only
            if took_pin:
                request_pins[store_key] += 1
        if self._pins_epoch == epoch:  # else they went with the old client
            self._unpin_held(held)  # located with the request's hits, not loaded
        now = time.monotonic()
        if request_pins:
            self._pinned_at[req_context.req_id] = now
        else:
            del self._pins[req_context.req_id]
        self._expire_pins(now)
        self._assign_tenant(store_keys, req_context)
        return KvtierLoadStoreSpec(store_keys)

    def _client_epoch(self) -> int:
        """The host service's client serving this engine's calls now (``ServiceConnection.client_epoch``);
        a store in this process keeps its pins for good (0)."""
        return int(getattr(self._store, "client_epoch", 0))

    def _repin_after_reattach(self) -> None:
        """After the connection let go of the client that held this engine's pins (a call failed or
        timed out; the service released them) and attached a new one: takes each request's pins
        again before any unpin, so that a block promised to a load stays put (under vLLM's plain
        OffloadingConnector a load that misses stops the engine) and an unpin never releases a pin
        another request took on the new client. A block gone meanwhile keeps no pin (counted)."""
        lost_before = self.pins_lost_at_reattach
        for _ in range(PIN_TRIES):  # a round a reattach interrupted is done again on the next client
            epoch = self._client_epoch()
            if epoch == self._pins_epoch:
                break
            self._pins_epoch = epoch
            self._repin_all(epoch)
        if self.pins_lost_at_reattach > lost_before:
            logger.warning(
                "kvtier: reattached with %d pin(s) lost (their blocks left the host's tiers meanwhile)",
                self.pins_lost_at_reattach - lost_before,
            )

    def _repin_all(self, epoch: int) -> None:
        """Takes every pin of the engine again on the client of ``epoch``."""
        for req_id, request_pins in list(self._pins.items()):
            # In prefix order: pins stop at the first absent key.
            kept = Counter(self._pin_again(list(request_pins.elements()), epoch))
            if kept:
                self._pins[req_id] = kept
            else:
                del self._pins[req_id]
                self._pinned_at.pop(req_id, None)
        for req_id, held in list(self._held.items()):
            self._held[req_id] = dict.fromkeys(self._pin_again(list(held), epoch))

    def _pin_again(self, keys: list[bytes], epoch: int) -> list[bytes]:
        """Pins ``keys`` on the client of ``epoch``: those it took (the others are counted lost).
        With no client attached (the call failed, a reattach under way) all are kept, uncounted:
        the next round, on the client attached then, takes them again. Taken by another client (a
        reattach during the round): released there, and the next round takes them again too (not
        twice on one client)."""
        pinned, served = self._pin_many_served(keys)
        if served is None and not pinned and not self._attached():
            return keys
        kept = [key for key, took_pin in zip(keys, pinned, strict=False) if took_pin]
        if kept and served is not None and served != epoch:
            self._unpin_at(kept, served)
        self.pins_lost_at_reattach += len(keys) - len(kept)
        return kept

    def _attached(self) -> bool:
        """Whether calls go to a host service now (a store in this process: always)."""
        return bool(getattr(self._store, "available", True))

    def _unpin_held(self, keys: Collection[bytes]) -> None:
        """Releases pins lookups took (plain route) that no load took over."""
        if keys and self._client_epoch() == self._pins_epoch:  # else they went with their client
            try:
                self._store.unpin_many(list(keys))
            except Exception:
                logger.exception("kvtier: unpin failed")

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
        if released and self._client_epoch() == self._pins_epoch:
            try:
                self._store.unpin_many(released)
            except Exception:
                logger.exception("kvtier: unpin failed")

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._repin_after_reattach()
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
        retained = self._retained(keys, req_context)
        if any(retained):
            self._note_retained([store_key for store_key, hinted in zip(store_keys, retained, strict=True) if hinted])
        keys_to_store: list[OffloadKey] = []
        store_keys_to_store: list[bytes] = []
        for key, store_key, is_present, hinted in zip(keys, store_keys, present, retained, strict=True):
            if is_present or store_key in self._being_stored or not (hinted or self._admit(store_key)):
                continue
            keys_to_store.append(key)
            store_keys_to_store.append(store_key)
        now = time.monotonic()
        for store_key in store_keys_to_store:
            self._being_stored[store_key] += 1
            self._store_began.setdefault(store_key, now)
        self._assign_tenant(store_keys_to_store, req_context)
        return PrepareStoreOutput(
            keys_to_store=keys_to_store,
            store_spec=KvtierLoadStoreSpec(store_keys_to_store),
            evicted_keys=[],
        )

    @staticmethod
    def _retained(keys: list[OffloadKey], req_context: ReqContext) -> list[bool]:
        """Per key, whether the request's retention hint covers its block (``hints.retained_tokens``:
        the whole request, or the blocks that end within its first N tokens, by the end position
        vLLM's scheduler records for each key)."""
        retained = retained_tokens(getattr(req_context, "kv_transfer_params", None))
        if retained == 0:
            return [False] * len(keys)
        position_of = getattr(req_context, "get_offload_key_position", lambda key: None)
        return [is_retained(position_of(key), retained) for key in keys]

    def _note_retained(self, store_keys: list[bytes]) -> None:
        """The request says its prompt will come back (``hints.retained_tokens``): its blocks have evidence of
        reuse when the worker stores them (told before the store job), and those stored already and
        kept in DRAM for want of it go below DRAM now."""
        try:
            self._store.note_retained(store_keys)
        except Exception:
            logger.exception("kvtier: passing a retention hint on failed; its blocks wait for evidence of reuse")

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
        store_keys = [kvtier_key(key) for key in keys]
        for store_key in store_keys:
            if self._being_stored.get(store_key, 0) > 0:
                self._being_stored[store_key] -= 1
                if self._being_stored[store_key] == 0:
                    del self._being_stored[store_key]
                    self._store_began.pop(store_key, None)
        events = self._event_feed()
        if events is not None:
            events.expect_stored(store_keys)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def note_cache_salt(self, req_id: str, cache_salt: str | None) -> None:
        """A new request and its ``cache_salt`` (KvtierConnector tells; vLLM's ``ReqContext`` has no salt)."""
        if cache_salt:
            self._tenants[req_id] = tenant_id(cache_salt)

    def on_request_finished(self, req_context: ReqContext) -> None:
        # No prepare_store or prepare_load follows for this request.
        self._tenants.pop(req_context.req_id, None)
        self._loaded.pop(req_context.req_id, None)
        self._requeue.pop(req_context.req_id, None)
        self._recompute.discard(req_context.req_id)
        self.decider.forget(req_context.req_id)
        self._locations.forget(req_context.req_id)
        self._unpin_held(self._held.pop(req_context.req_id, ()))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """The step's lookups are over: the next step locates blocks anew (``kvtier.vllm.locations``),
        and the blocks its lookups pinned for requests vLLM did not schedule are let go."""
        self._locations.step_ended()
        self._unpin_held([key for held in self._held.values() for key in held])
        self._held.clear()
        super().on_schedule_end(context)

    def _assign_tenant(self, store_keys: list[bytes], req_context: ReqContext) -> None:
        """Charges the blocks a salted request stores or loads to its tenant, and names the tenant
        whose key seals them at rest (before the worker's put or the read claims their slots: the
        store remembers the tenant until then)."""
        tenant = self._tenants.get(req_context.req_id)
        if tenant is None or not store_keys or not self._tracks_tenants():
            return
        try:
            self._store.assign_tenant(store_keys, tenant)
        except Exception:
            logger.exception("kvtier: assigning blocks to their tenant failed; they count as the default tenant's")

    def reset_cache(self) -> None:
        # kvtier is a persistent, possibly shared store: resetting one engine's connector does not
        # delete blocks other engines (or this engine after a restart) rely on.
        logger.info("kvtier: reset_cache ignored; kvtier keeps its blocks (remove the store directory to drop them)")
        self._being_stored.clear()
        self._store_began.clear()
        events = self._event_feed()
        if events is not None:
            events.restate()

    def get_stats(self) -> OffloadingConnectorStats | None:
        payload = self._stats.collect(self._backend)
        if payload is None:
            payload = OffloadingConnectorStats()  # the service is out of reach: the decisions still count
        self._stats.count_decisions(payload, self.decider.decisions)
        if payload.is_empty():
            return None
        return payload

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Blocks that became or stopped being loadable in kvtier's tiers, whichever engine on the
        host stored or evicted them (the host service's change log; ``kvtier.vllm.events``)."""
        events = self._event_feed()
        return events.take() if events is not None else ()

    def _event_feed(self) -> EventFeed | None:
        return self._backend.events

    def config_info(self) -> Sequence[Mapping[str, str | int | float | bool]]:
        """vLLM 0.33+ publishes this once as ``vllm:kv_offload_config_info`` (kvtier.vllm.options)."""
        return [self._config_info]

    def shutdown(self) -> None:
        held = [store_key for request_pins in self._pins.values() for store_key in request_pins.elements()]
        held += [store_key for keys in self._held.values() for store_key in keys]
        if held and self._client_epoch() == self._pins_epoch:  # else they went with their client
            with contextlib.suppress(Exception):
                self._store.unpin_many(held)
        self._pins.clear()
        self._held.clear()
        self._pinned_at.clear()
        self.decider.maybe_save(force=True)
        self._backend.release()
