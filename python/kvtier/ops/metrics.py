"""Prometheus metrics of the host service (``kvtier serve --metrics-port N``), and the snapshot that
``kvtier top`` reads.

Every scrape asks the service over its own socket (the ``Namespaces`` and ``Stats`` ops, protocol
version 2) and turns the per-namespace values into metric families; nothing is cached between
scrapes. Labels: ``namespace`` (the digest's first 16 hex digits), ``model`` (from the namespace
description), ``tier`` (dram, nvme, shared), ``op`` (lookup, load, reserve, commit), ``engine`` (the
``kvtier_engine_*`` families: the label an engine gave its connections, ``engine_label`` in vLLM).
The metric names and their meaning are listed in docs/cli.md ("Metrics").
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from typing import Any

from kvtier.service import connect

# The service's latency buckets, in microseconds (crates/kvtier-core/src/service/latency.rs).
LATENCY_BUCKETS_US = (
    50,
    100,
    250,
    500,
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
)
LATENCY_OPS = ("lookup", "load", "reserve", "commit")
# The NVMe tier's request size classes (upper bounds in bytes, crates/kvtier-core/src/stats.rs
# IO_SIZE_CLASSES) and the suffixes of their counters.
IO_SIZE_CLASSES: tuple[tuple[int, str], ...] = (
    (4 << 10, "4k"),
    (16 << 10, "16k"),
    (64 << 10, "64k"),
    (256 << 10, "256k"),
    (1 << 20, "1m"),
    (4 << 20, "4m"),
    (16 << 20, "16m"),
    (64 << 20, "64m"),
)


def io_request_buckets(values: dict[str, int], kind: str) -> list[tuple[str, float]]:
    """Cumulative Prometheus buckets of the NVMe tier's request sizes; ``kind`` is ``read`` or ``write``."""
    buckets, cumulative = [], 0
    for le, suffix in IO_SIZE_CLASSES:
        cumulative += values.get(f"nvme_{kind}s_le_{suffix}", 0)
        buckets.append((str(float(le)), float(cumulative)))
    buckets.append(("+Inf", float(values.get(f"nvme_{kind}_requests", 0))))
    return buckets


def model_of(description: bytes) -> str:
    try:
        parsed = json.loads(description)
    except (ValueError, UnicodeDecodeError):
        return description[:40].decode(errors="replace")
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return str(model) if model is not None else "unknown"


class ServiceSnapshot:
    """Reads the service's per-namespace values and summed stats over one reused connection."""

    def __init__(self, socket: str | os.PathLike, timeout_ms: int = 5_000) -> None:
        self.socket = socket
        self.timeout_ms = timeout_ms
        self._client: Any = None
        self._lock = threading.Lock()

    def read(self) -> tuple[list[dict[str, Any]], dict[str, int]]:
        with self._lock:
            for attempt in (0, 1):
                try:
                    if self._client is None or not self._client.connected:
                        self._client = connect(self.socket, timeout_ms=self.timeout_ms)
                    listing = self._client.namespaces()
                    stats = dict(self._client.stats())
                    namespaces = list(listing["namespaces"])
                    for ns in namespaces:
                        ns["engines"] = self._engines(str(ns["digest"]))
                    return namespaces, stats
                except Exception:
                    self._client = None
                    if attempt == 1:
                        raise
        raise AssertionError("unreachable")

    def _engines(self, digest: str) -> list[tuple[str, dict[str, int]]]:
        """The namespace's per-engine counters; none from a service of an older kvtier."""
        try:
            return [(label, dict(values)) for label, values in self._client.engines(digest)]
        except Exception as error:
            if "unknown request opcode" in str(error):
                return []
            raise


def families(namespaces: list[dict[str, Any]], stats: dict[str, int]) -> Iterator[Any]:
    """The metric families of one snapshot (prometheus_client objects)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    ns_labels = ["namespace", "model"]
    tier_labels = [*ns_labels, "tier"]

    def counter(name: str, doc: str, labels: list[str]) -> Any:
        return CounterMetricFamily(name, doc, labels=labels)

    def gauge(name: str, doc: str, labels: list[str]) -> Any:
        return GaugeMetricFamily(name, doc, labels=labels)

    hits = counter("kvtier_hits", "Blocks served, per tier they were found in", tier_labels)
    misses = counter("kvtier_misses", "Blocks asked for and not found (or failing verification)", ns_labels)
    lookups = counter("kvtier_lookups", "Blocks asked for: hits of every tier plus misses", ns_labels)
    used = gauge("kvtier_used_bytes", "Bytes in use per tier", tier_labels)
    capacity = gauge("kvtier_capacity_bytes", "Capacity per tier", tier_labels)
    blocks = gauge("kvtier_blocks", "Blocks held per tier", tier_labels)
    stored = counter("kvtier_stored_bytes", "Value bytes accepted into the cache (stores)", ns_labels)
    loaded = counter("kvtier_loaded_bytes", "Value bytes served to engines (hits x block size)", ns_labels)
    read = counter("kvtier_read_bytes", "Bytes read from a tier below DRAM", tier_labels)
    written = counter("kvtier_written_bytes", "Bytes written to a tier below DRAM", tier_labels)
    evictions = counter("kvtier_evictions", "Evictions: DRAM blocks, NVMe regions, shared-tier files", tier_labels)
    drops = counter("kvtier_dropped_stores", "Stores given up (no room, queue full, a rank that never came)", ns_labels)
    nvme_drops = counter("kvtier_nvme_dropped_writes", "Blocks kept in DRAM only: no NVMe region to write", ns_labels)
    cancelled = counter(
        "kvtier_cancelled_writes",
        "Stores dropped before their NVMe write started: a load short of DRAM slots took their slot",
        ns_labels,
    )
    checksum = counter("kvtier_checksum_failures", "Block copies that failed verification (load or verify)", ns_labels)
    io_errors = counter("kvtier_io_errors", "Failed reads and writes", ns_labels)
    queue = gauge(
        "kvtier_queue_depth",
        "Work waiting: pending_fills (blocks reserved, not all ranks committed)",
        [*ns_labels, "queue"],
    )
    backlog = gauge("kvtier_nvme_write_backlog_bytes", "Bytes accepted into DRAM, not yet on NVMe", ns_labels)
    attached = gauge("kvtier_attached_connections", "Engine connections attached to the namespace", ns_labels)
    staleness = gauge(
        "kvtier_shared_index_age_seconds",
        "Time since the shared-tier index last read the other writers' manifests",
        ns_labels,
    )
    shared_files = counter("kvtier_shared_published_files", "Files this host published to the shared tier", ns_labels)
    shared_publish = counter(
        "kvtier_shared_publish_blocks",
        "Blocks not published at once: deferred (waited in the publisher's backlog, published later from DRAM), "
        "dropped (left DRAM before their turn, or the backlog was full), failed (writing the file failed)",
        [*ns_labels, "result"],
    )
    latency = HistogramMetricFamily(
        "kvtier_op_latency_seconds",
        "Service-side latency of ops: lookup (Locate, Pin), load (Acquire), reserve and commit (a store)",
        labels=[*ns_labels, "op"],
    )
    io_sizes = HistogramMetricFamily(
        "kvtier_nvme_request_bytes",
        "Sizes of the requests the NVMe tier submits (reads: block loads; writes: blocks and region trailers)",
        labels=[*ns_labels, "op"],
    )
    io_order = counter(
        "kvtier_nvme_requests",
        "NVMe requests by access order: sequential (starts where the device's previous request of the same op "
        "ended) or random",
        [*ns_labels, "op", "order"],
    )
    engine_labels = [*ns_labels, "engine"]
    engine_lookups = counter(
        "kvtier_engine_lookup_blocks",
        "Blocks an engine's scheduler looked up, by the tier that held them (none: a miss)",
        [*engine_labels, "tier"],
    )
    engine_loads = counter(
        "kvtier_engine_loaded_slices",
        "Slices an engine's ranks loaded (a block counts once per rank): found, or missed",
        [*engine_labels, "result"],
    )
    engine_stores = counter(
        "kvtier_engine_stored_slices",
        "Slices an engine's ranks stored: accepted, or dropped (no room)",
        [*engine_labels, "result"],
    )
    for ns in namespaces:
        v: dict[str, int] = dict(ns["values"])
        labels = [str(ns["digest"])[:16], model_of(bytes(ns["description"]))]
        object_bytes = int(ns["object_bytes"])
        all_hits = 0
        for tier in ("dram", "nvme", "shared"):
            count = v.get(f"{tier}_hits", 0)
            all_hits += count
            hits.add_metric([*labels, tier], count)
        misses.add_metric(labels, v.get("misses", 0))
        lookups.add_metric(labels, all_hits + v.get("misses", 0))
        for tier in ("dram", "nvme", "shared"):
            if f"{tier}_used_bytes" in v:
                used.add_metric([*labels, tier], v[f"{tier}_used_bytes"])
                capacity.add_metric([*labels, tier], v.get(f"{tier}_capacity_bytes", 0))
        blocks.add_metric([*labels, "dram"], v.get("blocks_dram", 0))
        blocks.add_metric([*labels, "nvme"], v.get("blocks_nvme", 0))
        stored.add_metric(labels, v.get("puts", 0) * object_bytes)
        loaded.add_metric(labels, all_hits * object_bytes)
        read.add_metric([*labels, "nvme"], v.get("bytes_read_nvme", 0))
        read.add_metric([*labels, "shared"], v.get("shared_bytes_read", 0))
        written.add_metric([*labels, "nvme"], v.get("bytes_written_nvme", 0))
        written.add_metric([*labels, "shared"], v.get("shared_bytes_written", 0))
        evictions.add_metric([*labels, "dram"], v.get("dram_evictions", 0))
        evictions.add_metric([*labels, "nvme"], v.get("nvme_region_evictions", 0))
        evictions.add_metric([*labels, "shared"], v.get("shared_evicted_files", 0))
        drops.add_metric(labels, v.get("dropped_stores", 0))
        nvme_drops.add_metric(labels, v.get("nvme_dropped_writes", 0))
        cancelled.add_metric(labels, v.get("cancelled_writes", 0))
        checksum.add_metric(labels, v.get("checksum_failures", 0))
        io_errors.add_metric(labels, v.get("io_errors", 0))
        queue.add_metric([*labels, "pending_fills"], v.get("service_pending_fills", 0))
        backlog.add_metric(labels, v.get("nvme_write_backlog_bytes", 0))
        attached.add_metric(labels, v.get("service_attached_connections", 0))
        if "shared_index_age_ms" in v:
            staleness.add_metric(labels, v["shared_index_age_ms"] / 1000)
            shared_files.add_metric(labels, v.get("shared_files_published", 0))
            for result, name in (
                ("deferred", "shared_deferred_publishes"),
                ("dropped", "shared_dropped_publishes"),
                ("failed", "shared_publish_errors"),
            ):
                shared_publish.add_metric([*labels, result], v.get(name, 0))
        for op in LATENCY_OPS:
            count = v.get(f"latency_{op}_count", 0)
            buckets = [(str(le / 1e6), float(v.get(f"latency_{op}_le_{le}", 0))) for le in LATENCY_BUCKETS_US]
            buckets.append(("+Inf", float(count)))
            latency.add_metric([*labels, op], buckets, v.get(f"latency_{op}_sum_us", 0) / 1e6)
        for engine, counts in ns.get("engines", []):
            at = [*labels, engine]
            for tier in ("dram", "nvme", "shared"):
                engine_lookups.add_metric([*at, tier], counts.get(f"lookup_{tier}", 0))
            engine_lookups.add_metric([*at, "none"], counts.get("lookup_miss", 0))
            engine_loads.add_metric([*at, "found"], counts.get("loaded_slices", 0))
            engine_loads.add_metric([*at, "missed"], counts.get("load_missed_slices", 0))
            engine_stores.add_metric([*at, "accepted"], counts.get("stored_slices", 0))
            engine_stores.add_metric([*at, "dropped"], counts.get("dropped_slices", 0))
        for kind in ("read", "write"):
            io_sizes.add_metric([*labels, kind], io_request_buckets(v, kind), v.get(f"nvme_{kind}_request_bytes", 0))
            sequential = v.get(f"nvme_{kind}_sequential", 0)
            io_order.add_metric([*labels, kind, "sequential"], sequential)
            io_order.add_metric([*labels, kind, "random"], v.get(f"nvme_{kind}_requests", 0) - sequential)
    yield from (hits, misses, lookups, used, capacity, blocks, stored, loaded, read, written, evictions)
    yield from (drops, nvme_drops, cancelled, checksum, io_errors, queue, backlog, attached, staleness, shared_files)
    yield from (shared_publish, latency)
    yield from (io_sizes, io_order, engine_lookups, engine_loads, engine_stores)
    service_connections = GaugeMetricFamily("kvtier_service_connections", "Connections to the service now")
    service_connections.add_metric([], stats.get("service_connections", 0))
    service_namespaces = GaugeMetricFamily("kvtier_service_namespaces", "Namespaces the service has open")
    service_namespaces.add_metric([], stats.get("service_namespaces", 0))
    up = GaugeMetricFamily("kvtier_up", "1: the service answered this scrape")
    up.add_metric([], 1)
    yield from (service_connections, service_namespaces, up)


class ServiceCollector:
    """A prometheus_client collector that reads the service at every scrape."""

    def __init__(self, socket: str | os.PathLike) -> None:
        self.snapshot = ServiceSnapshot(socket)

    def describe(self) -> list[Any]:
        return []  # unchecked collector: families depend on what the service has open

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            namespaces, stats = self.snapshot.read()
        except Exception:
            up = GaugeMetricFamily("kvtier_up", "1: the service answered this scrape")
            up.add_metric([], 0)
            yield up
            return
        yield from families(namespaces, stats)


def start_exporter(socket: str | os.PathLike, port: int, host: str = "127.0.0.1") -> Any:
    """Serves ``/metrics`` on ``host:port`` (127.0.0.1: only this host scrapes it). Returns the
    server (``shutdown()`` stops it)."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as error:
        raise RuntimeError(
            "--metrics-port needs prometheus-client: pip install prometheus-client (or 'kvtier[ops]')"
        ) from error
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(socket))
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        raise RuntimeError(
            f"cannot serve metrics on {host}:{port} ({error.strerror}): choose a free port with --metrics-port"
        ) from None
    return server
