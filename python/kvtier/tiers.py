"""The tiers a block is served from, from the core's table (``kvtier_core::TIER_ROWS``).

Every tier list on the Python side (lookups, prefetch, metrics, ``kvtier status`` and ``top``) is
derived from here, so a tier the core adds reaches them all without a copy to keep in step.
"""

from __future__ import annotations

from kvtier import _core

# Every tier in load order (a block held by several is read from the first), and which are remote.
_ROWS: tuple[tuple[str, bool], ...] = tuple((str(name), bool(remote)) for name, remote in _core.TIERS)

ALL: tuple[str, ...] = tuple(name for name, _ in _ROWS)
# Tiers a block can vanish from between lookup and load (another host's evictor): never pinned.
REMOTE: frozenset[str] = frozenset(name for name, remote in _ROWS if remote)
# The tiers a prefetch reads into DRAM from, the likely fastest first.
BELOW_DRAM: tuple[str, ...] = ALL[1:]

# How reports print a tier's name; a tier not named here prints as its name.
_LABELS = {"dram": "DRAM", "nvme": "NVMe"}


def label(tier: str) -> str:
    """A tier's name as the reports print it (``DRAM``, ``NVMe``, ``shared``, ``bucket``)."""
    return _LABELS.get(tier, tier)


assert ALL[:2] == ("dram", "nvme"), f"the core's tiers start {ALL[:2]}: DRAM and NVMe first"
