"""Where a request's blocks are, asked of the store once per lookup pass rather than once per block.

vLLM's offloading scheduler asks the manager about a request one block at a time, from the first block
its own cache lacks, every step while the request waits (for a decision, a prefetch, a load). Each
answer took a call to the host service (``locate_many`` of one key, about 13 µs there and as much in
Python): a 32K-token prompt in 16-token blocks cost about 2,000 calls, tens of milliseconds of the
engine's scheduling, every step it waited. Once a pass has found a block held, the next block it
asks about locates the request's later blocks too, in one call, from the positions vLLM's
scheduler records for the request's keys (``ReqContext.get_offload_key_position``); the rest of
the pass is answered from that (a block not held is asked again: three calls for a pass of hits then a
miss, one for a request with nothing stored). What was located is kept until the step ends
(``Locations.step_ended``, from the manager's ``on_schedule_end``): a later step asks again. Without
positions (another vLLM), each block is located on its own, as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier import tiers

# The most keys one call locates: the rest of a 64K-token prompt in 16-token blocks.
LOCATE_AHEAD_KEYS = 4096
# What was located is asked again after this long even if no step end was told (a vLLM that never
# calls ``on_schedule_end``): a pass takes milliseconds.
MAX_AGE_S = 0.5

Tier = str | None


@dataclass
class _Pass:
    """What one request's lookups located this step, and the furthest position asked."""

    tiers: dict[bytes, Tier] = field(default_factory=dict)
    missed: set[bytes] = field(default_factory=set)  # located, not held: asked again, not ahead
    last_position: int = -1
    located_at: float = field(default_factory=time.monotonic)


class Locations:
    """Answers ``tier_of`` for a request's blocks within one scheduler step (module docs)."""

    def __init__(self, locate_many: Callable[[list[bytes]], list[Tier]], store_key_of: Callable[[Any], bytes]):
        self._locate_many = locate_many
        self._store_key_of = store_key_of
        self._passes: dict[str, _Pass] = {}
        self.calls = 0  # calls to the store, for tests and the curious

    def tier_of(self, key: Any, store_key: bytes, req_context: Any) -> Tier:
        """The tier that holds ``key``'s block (``store_key``), or None. Raises what ``locate_many`` raises."""
        located = self._passes.get(req_context.req_id)
        if located is not None and time.monotonic() - located.located_at > MAX_AGE_S:
            located = None
            del self._passes[req_context.req_id]
        if located is not None and store_key in located.tiers:
            return located.tiers[store_key]
        position = _position(req_context, key)
        ahead: list[bytes] = []
        # Ahead only once the pass found a block held: a request with nothing stored (most new
        # prompts) costs one key's call, and a pass scanned from its end (sliding window) too.
        if position is not None and located is not None and located.tiers and position > located.last_position:
            ahead = self._keys_after(req_context, position, located)
        store_keys = [store_key, *ahead]
        tiers = self._locate_many(store_keys)
        self.calls += 1
        assert len(tiers) == len(store_keys), (len(tiers), len(store_keys))
        if located is None:
            located = self._passes[req_context.req_id] = _Pass()
        # A miss is asked again: a block may land meanwhile (a store job of this step's engine).
        for located_key, tier in zip(store_keys, tiers, strict=True):
            if tier is None:
                located.missed.add(located_key)
            else:
                located.tiers[located_key] = tier
        if position is not None:
            located.last_position = max(located.last_position, position)
        return tiers[0]

    def _keys_after(self, req_context: Any, position: int, located: _Pass | None) -> list[bytes]:
        """The request's keys past ``position`` not located yet this step, in their order."""
        positions = getattr(req_context, "_offload_key_positions", None)
        if not isinstance(positions, Mapping):
            return []
        ahead = []
        for key, end in positions.items():
            if isinstance(end, int) and end > position:
                store_key = self._store_key_of(key)
                if located is None or (store_key not in located.tiers and store_key not in located.missed):
                    ahead.append(store_key)
                    if len(ahead) >= LOCATE_AHEAD_KEYS:
                        break
        return ahead

    def held_here(self, req_context: Any, key: Any) -> list[bytes]:
        """The request's blocks after ``key``'s, in the order of their positions, up to the first one
        this step did not locate in this host's tiers (DRAM, NVMe): vLLM's lookup pass stops at its
        first miss, so these are the blocks it may load next. The manager pins them together under
        vLLM's plain connector. Empty without positions (another vLLM)."""
        located = self._passes.get(req_context.req_id)
        position = _position(req_context, key)
        positions = getattr(req_context, "_offload_key_positions", None)
        if located is None or position is None or not isinstance(positions, Mapping):
            return []
        later = sorted(
            (end, self._store_key_of(k)) for k, end in positions.items() if isinstance(end, int) and end > position
        )
        run: list[bytes] = []
        for _, store_key in later[:LOCATE_AHEAD_KEYS]:
            if located.tiers.get(store_key) in (None, *tiers.REMOTE):
                break
            run.append(store_key)
        return run

    def forget(self, req_id: str) -> None:
        self._passes.pop(req_id, None)

    def step_ended(self) -> None:
        """What was located is only as good as the step it was asked in."""
        self._passes.clear()


def _position(req_context: Any, key: Any) -> int | None:
    position_of = getattr(req_context, "get_offload_key_position", None)
    if position_of is None:
        return None
    position = position_of(key)
    return position if isinstance(position, int) else None
