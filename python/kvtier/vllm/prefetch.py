"""The scheduler's prefetcher: NVMe and remote-tier hits read into the DRAM pool before the load."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from vllm.v1.kv_offload.base import (
    LookupResult,
)

from kvtier import tiers
from kvtier.threads import start_thread
from kvtier.vllm.connection import ServiceConnection
from kvtier.vllm.costs import TierRates

logger = logging.getLogger("kvtier.vllm")


# Blocks per prefetch call: a chunk that ends shows the prefetcher progresses (a request waits in
# HIT_PENDING while it does, and is recomputed once it stalls), and times its tier.
CHUNK_BLOCKS = 16
# The tiers a prefetch reads from, the likely fastest first (locate_many's names).
TIERS_BELOW_DRAM = tiers.BELOW_DRAM


class Prefetcher:
    """Reads blocks that lookups found on NVMe or in a remote tier into the service's DRAM pool,
    on a thread and a connection of its own (a prefetch of a long prefix takes a while; lookups on the
    manager's connection must not wait behind it).

    Each key is prefetched once, in chunks of ``CHUNK_BLOCKS``: lookups answer HIT_PENDING while it
    is in flight (a miss once no chunk ended for the pending timeout) and HIT after it ended,
    whatever became of it (a block evicted again before its load is read by the load itself).
    Ended prefetches are remembered for ``REMEMBER_S``, with the tier the block came from, so that
    vLLM's hit-source metric names NVMe or the remote tier, not the DRAM the load copied from."""

    REMEMBER_S = 120.0

    def __init__(self, connect: Callable[[], ServiceConnection], pending_timeout_s: float = 2.0):
        self._connect = connect
        self._connection: ServiceConnection | None = None
        self._cv = threading.Condition()
        self._queue: list[bytes] = []
        self._in_flight: dict[bytes, str] = {}  # key -> tier it is read from
        self._since: dict[bytes, float] = {}  # key -> when its prefetch was asked for
        # A request waits in HIT_PENDING at most this long: a prefetch stuck behind a frozen service
        # or a stalled tier turns into a miss (recompute) instead of holding the request.
        self._pending_timeout_s = pending_timeout_s
        self._progress_at = time.monotonic()  # when a chunk last started or ended
        self._chunk_tier: str | None = None  # the slowest tier of the chunk being read, if any
        self.expired_pending = 0
        # Where what each tier delivers now is recorded (the manager's load-or-recompute rates).
        self.rates: TierRates | None = None
        self._ended: dict[bytes, tuple[str, float]] = {}  # key -> (origin tier, when)
        self._stopping = False
        self.prefetched_blocks = 0
        self._thread = start_thread(self._run, "kvtier-prefetch")

    def lookup(self, key: bytes, tier: str) -> LookupResult:
        """For a key the service holds on ``tier`` (NVMe or shared), not in DRAM."""
        with self._cv:
            if key in self._ended:
                return LookupResult.HIT
            if key not in self._in_flight:
                self._in_flight[key] = tier
                self._since[key] = time.monotonic()
                self._queue.append(key)
                self._cv.notify_all()
            elif self._stalled(key):
                self.expired_pending += 1
                return LookupResult.MISS
            return LookupResult.HIT_PENDING

    def in_flight(self, keys: list[bytes]) -> bool:
        """Whether any of ``keys`` is still being read."""
        with self._cv:
            return any(key in self._in_flight for key in keys)

    def backlog_s(self) -> float:
        """Seconds the blocks queued or being read take at their tiers' recent rates (a tier with no
        rate yet: none): a load of another request's blocks below DRAM waits behind them."""
        rates = self.rates
        if rates is None:
            return 0.0
        with self._cv:
            tiers = list(self._in_flight.values())
        per_block = {tier: rates.seconds_per_block(tier) or 0.0 for tier in set(tiers)}
        return sum(per_block[tier] for tier in tiers)

    def _stalled(self, key: bytes) -> bool:
        """Holds ``_cv``. Whether ``key`` waited past the timeout with no chunk of any prefetch
        ended meanwhile: a stalled tier or service, not a slow tier that still delivers (its loads
        are the load-or-recompute model's to judge)."""
        now = time.monotonic()
        timeout_s = self._pending_timeout_s
        return now - self._since[key] > timeout_s and now - self._progress_at > self._chunk_limit_s()

    def _chunk_limit_s(self) -> float:
        """Holds ``_cv``. How long the chunk being read may take before the prefetcher counts as
        stalled: the pending timeout, or three times what a chunk of its tier takes at the tier's
        measured rate (a slow link still delivers one). The tier read now, not the slowest known: a
        slow bucket's rate must not let a hung NVMe read hold requests for a minute."""
        rates, tier = self.rates, self._chunk_tier
        per_block = rates.seconds_per_block(tier) if rates is not None and tier is not None else None
        return max(self._pending_timeout_s, 3 * CHUNK_BLOCKS * (per_block or 0.0))

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
            readable = self._readable_blocks()
            for first in range(0, len(batch), CHUNK_BLOCKS):
                chunk = batch[first : first + CHUNK_BLOCKS]
                if first < readable:
                    self._prefetch(chunk)
                self._end(chunk)

    def _prefetch(self, chunk: list[bytes]) -> None:
        started = time.monotonic()
        with self._cv:
            self._progress_at = started
            self._chunk_tier = self._slowest_tier(chunk)
        if self._connection is not None:
            found = self._connection.call("prefetch", chunk, default=None)
            read = [key for key, ok in zip(chunk, found or [], strict=False) if ok]
            self.prefetched_blocks += len(read)
            if read:  # a call that failed timed the failure, and a block gone meanwhile no read
                self._record_rate(read, time.monotonic() - started)

    def _end(self, chunk: list[bytes]) -> None:
        """The chunk's prefetch ended, whatever became of it: its lookups answer HIT from now on."""
        now = time.monotonic()
        with self._cv:
            self._progress_at = now
            self._chunk_tier = None
            for key in chunk:
                self._ended[key] = (self._in_flight.pop(key, "nvme"), now)
                self._since.pop(key, None)
            self._forget_older_than(now - self.REMEMBER_S)

    def _readable_blocks(self) -> int:
        """Half the pool: a longer prefetch would evict its own first blocks before the load copies
        them (the rest of a batch is left to the load, which reads them itself)."""
        client = self._connection.live_client() if self._connection is not None else None
        try:
            return max(1, int(client.pool()["slot_count"]) // 2) if client is not None else 1 << 30
        except Exception:
            return 1 << 30

    def _record_rate(self, batch: list[bytes], seconds: float) -> None:
        """What the batch's tier delivered, queueing included (a mixed batch: the last of its tiers
        in ``TIERS_BELOW_DRAM``, the one likely slowest, counts them all)."""
        if self.rates is None or not batch:
            return
        with self._cv:
            slowest = self._slowest_tier(batch)
        self.rates.observe(slowest, len(batch), seconds)

    def _slowest_tier(self, keys: list[bytes]) -> str:
        """Holds ``_cv``. The last of the keys' tiers in ``TIERS_BELOW_DRAM`` (the one likely slowest)."""
        tiers = {self._in_flight.get(key, "nvme") for key in keys}
        return max(tiers, key=lambda tier: TIERS_BELOW_DRAM.index(tier) if tier in TIERS_BELOW_DRAM else 0)

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
