"""kvtier's metrics on vLLM's /metrics: definitions, deltas between steps, Prometheus lines."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

from kvtier import tiers
from kvtier.vllm.backend import StoreBackend

_LATENCY_BUCKETS_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# kvtier counter name -> (stats() key, label values)
_COUNTER_SOURCES: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "kvtier:block_hits": [(f"{tier}_hits", (tier,)) for tier in tiers.ALL],
    "kvtier:block_misses": [("misses", ())],
    "kvtier:bytes_read": [("bytes_read_nvme", ("nvme",)), ("shared_bytes_read", ("shared",))],
    "kvtier:bytes_written": [("bytes_written_nvme", ("nvme",)), ("shared_bytes_written", ("shared",))],
    "kvtier:bytes_copied": [("bytes_copied_in", ("in",)), ("bytes_copied_out", ("out",))],
    "kvtier:block_puts": [("puts", ())],
    "kvtier:evictions": [("dram_evictions", ("dram",)), ("nvme_region_evictions", ("nvme_region",))],
    "kvtier:dropped_stores": [
        ("dropped_stores", ("backpressure",)),
        ("nvme_dropped_writes", ("nvme_write",)),
        # A load short of DRAM slots took the slot of a block whose NVMe write had not started.
        ("cancelled_writes", ("load_first",)),
        # Blocks not published to the shared tier: they left DRAM while waiting in the publisher's
        # backlog, or writing the file failed (filesystem full, directory removed, ...).
        ("shared_dropped_publishes", ("shared_queue",)),
        ("shared_publish_errors", ("shared_publish_error",)),
    ],
    "kvtier:slot_wait_timeouts": [("slot_wait_timeouts", ())],
    "kvtier:checksum_failures": [("checksum_failures", ())],
    "kvtier:io_errors": [("io_errors", ())],
}
_GAUGE_SOURCES: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "kvtier:used_bytes": [("dram_used_bytes", ("dram",)), ("nvme_used_bytes", ("nvme",))],
    "kvtier:capacity_bytes": [("dram_capacity_bytes", ("dram",)), ("nvme_capacity_bytes", ("nvme",))],
    "kvtier:blocks": [("blocks_dram", ("dram",)), ("blocks_nvme", ("nvme",))],
}


def kvtier_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    return {
        "kvtier:block_hits": OffloadingCounterMetadata("Blocks served by kvtier, per tier.", ("tier",)),
        "kvtier:block_misses": OffloadingCounterMetadata("Blocks asked of kvtier and not found or not verified."),
        "kvtier:bytes_read": OffloadingCounterMetadata("Bytes kvtier read from a storage tier.", ("tier",)),
        "kvtier:bytes_written": OffloadingCounterMetadata("Bytes kvtier wrote to a storage tier.", ("tier",)),
        "kvtier:bytes_copied": OffloadingCounterMetadata(
            "Bytes copied between engine blocks and kvtier (in = stored, out = loaded).", ("direction",)
        ),
        "kvtier:block_puts": OffloadingCounterMetadata("Blocks accepted by kvtier for storing."),
        "kvtier:evictions": OffloadingCounterMetadata("Evictions (DRAM blocks, NVMe regions).", ("tier",)),
        "kvtier:dropped_stores": OffloadingCounterMetadata(
            "Stores dropped (a cache miss later): under backpressure, NVMe writes given up, or blocks not "
            "published to the shared tier.",
            ("reason",),
        ),
        "kvtier:slot_wait_timeouts": OffloadingCounterMetadata("Jobs that waited slot_wait_ms for a DRAM slot."),
        "kvtier:checksum_failures": OffloadingCounterMetadata(
            "Blocks that failed verification on load (served as misses)."
        ),
        "kvtier:io_errors": OffloadingCounterMetadata("I/O errors seen by kvtier (the affected blocks are misses)."),
        "kvtier:failed_load_blocks": OffloadingCounterMetadata(
            "Engine blocks whose load from kvtier failed and that vLLM recomputed."
        ),
        "kvtier:load_decisions": OffloadingCounterMetadata(
            "Hit blocks per tier and what the load-or-recompute model chose for them: load, load_busy (loaded "
            "only because the engine runs other requests, which a recompute would slow), recompute, "
            "recompute_wait (declined only by load_wait_max_ratio: the load would keep the request waiting "
            "longer than that many recomputes), probe "
            "(a local tier of unknown rate, loaded to time it), probe_aside (a few blocks of a remote tier of "
            "unknown rate, read in the background to time it and recomputed) or untrained (loaded: no prefill "
            "timings yet).",
            ("tier", "choice"),
        ),
        "kvtier:used_bytes": OffloadingGaugeMetadata("Bytes used per tier.", ("tier",)),
        "kvtier:capacity_bytes": OffloadingGaugeMetadata("Capacity per tier in bytes.", ("tier",)),
        "kvtier:blocks": OffloadingGaugeMetadata("Blocks held per tier.", ("tier",)),
        "kvtier:load_seconds": OffloadingHistogramMetadata(
            "Time from submitting a load job to kvtier to its completion.", buckets=_LATENCY_BUCKETS_SECONDS
        ),
        "kvtier:store_seconds": OffloadingHistogramMetadata(
            "Time from submitting a store job to kvtier to its completion.", buckets=_LATENCY_BUCKETS_SECONDS
        ),
    }


class StatsDeltaTracker:
    """Turns the store's cumulative stats() counters into increments for vLLM's stats payload."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def prime(self, shared: StoreBackend) -> None:
        """Starts counting from the store's counters now: an engine that attaches to a store (or a
        host service) that already served others reports only what happens from then on."""
        with contextlib.suppress(Exception):
            stats = shared.store.stats()
            self._last = {key: int(value) for key, value in stats.items() if isinstance(value, int)}

    def count_decisions(self, payload: OffloadingConnectorStats, decisions: Mapping[tuple[str, str], int]) -> None:
        """The load-or-recompute decisions since the last call (``LoadDecider.decisions``)."""
        for (tier, choice), value in list(decisions.items()):
            name = f"decision:{tier}:{choice}"
            increment = value - self._last.get(name, 0)
            self._last[name] = value
            if increment > 0:
                payload.increase_counter("kvtier:load_decisions", increment, (tier, choice))

    def collect(self, shared: StoreBackend) -> OffloadingConnectorStats | None:
        try:
            stats = shared.store.stats()
        except Exception:
            return None
        payload = OffloadingConnectorStats()
        for metric_name, sources in _COUNTER_SOURCES.items():
            for stats_key, labels in sources:
                value = int(stats.get(stats_key, 0))
                increment = value - self._last.get(stats_key, 0)
                self._last[stats_key] = value
                if increment > 0:
                    payload.increase_counter(metric_name, increment, labels)
        for metric_name, sources in _GAUGE_SOURCES.items():
            for stats_key, labels in sources:
                if stats_key in stats:
                    payload.set_gauge(metric_name, int(stats[stats_key]), labels)
        observations, worker_counters = shared.take_observations()
        for kind, seconds in observations:
            payload.observe_histogram(f"kvtier:{kind}_seconds", seconds)
        if worker_counters.get("load_failed_blocks"):
            payload.increase_counter("kvtier:failed_load_blocks", worker_counters["load_failed_blocks"])
        return payload


def prometheus_lines_from_stats(stats: Mapping[str, Any], prefix: str = "kvtier_") -> str:
    """A Prometheus text exposition of a store's stats() (for tools that read a store directly)."""
    lines = []
    for metric_name, sources in {**_COUNTER_SOURCES, **_GAUGE_SOURCES}.items():
        name = prefix + metric_name.split(":", 1)[1]
        for stats_key, labels in sources:
            if stats_key not in stats:
                continue
            label_text = ""
            if labels:
                label_name = {"kvtier:bytes_copied": "direction", "kvtier:dropped_stores": "reason"}.get(
                    metric_name, "tier"
                )
                label_text = f'{{{label_name}="{labels[0]}"}}'
            lines.append(f"{name}{label_text} {int(stats[stats_key])}")
    return "\n".join(lines) + "\n"
