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

from kvtier import _core, tiers
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
TIERS = ("dram", "nvme", "shared")
# Tiers a block is served from: the object tier's hits are counted apart from the shared filesystem's
# (``bucket_hits``, and per engine ``lookup_bucket``).
HIT_TIERS = tiers.ALL

# The families of each namespace, in the order a scrape lists them: (name, kind, the labels after
# ``namespace`` and ``model``, help).
NAMESPACE_FAMILIES: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("kvtier_hits", "counter", ("tier",), "Blocks served, per tier they were found in"),
    ("kvtier_misses", "counter", (), "Blocks asked for and not found (or failing verification)"),
    ("kvtier_lookups", "counter", (), "Blocks asked for: hits of every tier plus misses"),
    ("kvtier_used_bytes", "gauge", ("tier",), "Bytes in use per tier"),
    ("kvtier_capacity_bytes", "gauge", ("tier",), "Capacity per tier"),
    ("kvtier_blocks", "gauge", ("tier",), "Blocks held per tier"),
    ("kvtier_stored_bytes", "counter", (), "Value bytes accepted into the cache (stores)"),
    ("kvtier_loaded_bytes", "counter", (), "Value bytes served to engines (hits x block size)"),
    ("kvtier_read_bytes", "counter", ("tier",), "Bytes read from a tier below DRAM"),
    ("kvtier_written_bytes", "counter", ("tier",), "Bytes written to a tier below DRAM"),
    ("kvtier_evictions", "counter", ("tier",), "Evictions: DRAM blocks, NVMe regions, shared-tier files"),
    ("kvtier_dropped_stores", "counter", (), "Stores given up (no room, queue full, a rank that never came)"),
    ("kvtier_nvme_dropped_writes", "counter", (), "Blocks kept in DRAM only: no NVMe region to write"),
    (
        "kvtier_write_admission_blocks",
        "counter",
        ("result",),
        "Writes below DRAM (write_admission): stored blocks kept in DRAM awaiting reuse, written once reused, "
        "evicted unused (never written), refused by a write budget (nvme, remote)",
    ),
    ("kvtier_write_budget_bytes_per_day", "gauge", ("tier",), "A tier's write budget (absent: unbounded)"),
    ("kvtier_write_budget_left_bytes", "gauge", ("tier",), "Bytes the tier's write budget would take now"),
    (
        "kvtier_cancelled_writes",
        "counter",
        (),
        "Stores dropped before their NVMe write started: a load short of DRAM slots took their slot",
    ),
    ("kvtier_checksum_failures", "counter", (), "Block copies that failed verification (load or verify)"),
    (
        "kvtier_nvme_auth_failures",
        "counter",
        (),
        "Encrypted NVMe values that did not decrypt (another key, changed bytes, no key): counted misses",
    ),
    (
        "kvtier_remote_decrypt_failures",
        "counter",
        (),
        "Encrypted shared-filesystem and bucket blocks that did not decrypt (another key, changed bytes, no key)",
    ),
    ("kvtier_io_errors", "counter", (), "Failed reads and writes"),
    (
        "kvtier_queue_depth",
        "gauge",
        ("queue",),
        "Work waiting: pending_fills (blocks reserved, not all ranks committed)",
    ),
    ("kvtier_nvme_write_backlog_bytes", "gauge", (), "Bytes accepted into DRAM, not yet on NVMe"),
    ("kvtier_attached_connections", "gauge", (), "Engine connections attached to the namespace"),
    (
        "kvtier_held_blocks",
        "gauge",
        ("hold",),
        "Blocks engine connections hold now: pins (not evictable), load_slots (a load copies out of them)",
    ),
    (
        "kvtier_expired_holds",
        "counter",
        ("hold",),
        "Holds the service let go of: pins (silent past pin_lease_ms), fills (past reservation_timeout_ms)",
    ),
    (
        "kvtier_capped_reserves",
        "counter",
        (),
        "Blocks a reserve answered 'no room now' past half the pool held or asked for by one connection",
    ),
    (
        "kvtier_shared_index_age_seconds",
        "gauge",
        (),
        "Time since the shared-tier index last read the other writers' manifests",
    ),
    ("kvtier_shared_published_files", "counter", (), "Files this host published to the shared tier"),
    (
        "kvtier_remote_tier_outages",
        "counter",
        (),
        "Times a remote tier (shared filesystem, object store) turned sick: reads failed in a row",
    ),
    (
        "kvtier_remote_tier_lookups_skipped",
        "counter",
        (),
        "Lookups and reads of blocks only a sick remote tier holds: not offered, counted misses",
    ),
    ("kvtier_remote_tiers_sick", "gauge", (), "Remote tiers sick now (stepping aside for a back-off)"),
    (
        "kvtier_remote_reads_given_up",
        "counter",
        (),
        "Remote reads a load stopped waiting for (none finished within remote_read_stall_ms): counted misses",
    ),
    (
        "kvtier_remote_refreshes_stalled",
        "counter",
        (),
        "Remote tiers' index refreshes unanswered for the stall limit: each made its tier sick before a load met it",
    ),
    ("kvtier_nvme_outages", "counter", (), "Times the NVMe tier turned sick: reads failed in a row"),
    (
        "kvtier_nvme_lookups_skipped",
        "counter",
        (),
        "Lookups and reads of blocks only a sick NVMe tier holds: not offered, counted misses",
    ),
    ("kvtier_nvme_sick", "gauge", (), "1 while the NVMe tier is sick (stepping aside for a back-off)"),
    (
        "kvtier_nvme_reads_given_up",
        "counter",
        (),
        "NVMe reads a load stopped waiting for (none finished within nvme_read_stall_ms, a hung disk): counted misses",
    ),
    (
        "kvtier_nvme_off_no_space",
        "gauge",
        (),
        "1 when the store opened without its NVMe tier: no room on its filesystem for the device file",
    ),
    (
        "kvtier_shared_publish_blocks",
        "counter",
        ("result",),
        "Blocks not published at once: deferred (waited in the publisher's backlog, published later from DRAM), "
        "dropped (left DRAM before their turn, or the backlog was full), failed (writing the file failed)",
    ),
    (
        "kvtier_op_latency_seconds",
        "histogram",
        ("op",),
        "Service-side latency of ops: lookup (Locate, Pin), load (Acquire), reserve and commit (a store)",
    ),
    (
        "kvtier_nvme_request_bytes",
        "histogram",
        ("op",),
        "Sizes of the requests the NVMe tier submits (reads: block loads; writes: blocks and region trailers)",
    ),
    (
        "kvtier_nvme_requests",
        "counter",
        ("op", "order"),
        "NVMe requests by access order: sequential (starts where the device's previous request of the same op "
        "ended) or random",
    ),
    (
        "kvtier_engine_lookup_blocks",
        "counter",
        ("engine", "tier"),
        "Blocks an engine's scheduler looked up, by the tier that held them (none: a miss)",
    ),
    (
        "kvtier_engine_loaded_slices",
        "counter",
        ("engine", "result"),
        "Slices an engine's ranks loaded (a block counts once per rank): found, or missed",
    ),
    (
        "kvtier_engine_stored_slices",
        "counter",
        ("engine", "result"),
        "Slices an engine's ranks stored: accepted, or dropped (no room)",
    ),
    (
        "kvtier_engine_fallbacks",
        "counter",
        ("engine", "event"),
        "What an engine served at recompute because the service did not answer, as the engine reports "
        "it when the service answers again: failed_call (a service call answered with its miss), outage "
        "(the service stopped answering), given_up_load and given_up_store (jobs given up after a stall), "
        "skipped_load and skipped_store_block (answered at once while a call was stuck)",
    ),
    (
        "kvtier_engine_delayed_loads",
        "counter",
        ("engine", "cause"),
        "Loads an engine's worker held and then served late, as the engine reports it: reattach (under "
        "vLLM's plain OffloadingConnector, which stops the engine on a failed load, a load the service "
        "did not answer waits for the connection to reattach to a service started again)",
    ),
    (
        "kvtier_tenant_dram_bytes",
        "gauge",
        ("tenant",),
        "DRAM pool bytes a tenant's blocks hold (tenant: hash of its cache_salt; with tenant_dram_share)",
    ),
    ("kvtier_tenant_dram_guaranteed_bytes", "gauge", ("tenant",), "DRAM pool bytes guaranteed to a tenant"),
    ("kvtier_tenant_dram_evictions", "counter", ("tenant",), "A tenant's blocks evicted from the DRAM pool"),
    (
        "kvtier_tenant_dram_cap_bytes",
        "gauge",
        ("tenant",),
        "The most DRAM pool bytes a tenant holds (tenant_dram_max_share)",
    ),
    (
        "kvtier_tenant_nvme_bytes",
        "gauge",
        ("tenant",),
        "NVMe bytes of the regions that take a tenant's blocks (with tenant shares and tenant_shares_nvme)",
    ),
    (
        "kvtier_tenant_nvme_reclaimed_regions",
        "counter",
        ("tenant",),
        "A tenant's NVMe regions reclaimed to make room (its own oldest first when past its share)",
    ),
    (
        "kvtier_tenant_shared_bytes",
        "gauge",
        ("tenant",),
        "Bytes of a tenant's data files on the shared filesystem (with tenant shares and tenant_shares_shared_fs)",
    ),
    (
        "kvtier_tenant_shared_evicted_files",
        "counter",
        ("tenant",),
        "A tenant's shared-filesystem data files this process evicted (tenants past their shares or caps first)",
    ),
    (
        "kvtier_tenant_bucket_bytes",
        "gauge",
        ("tenant",),
        "Bytes of a tenant's segments in the bucket (with tenant shares, tenant_shares_bucket and a bucket budget)",
    ),
    (
        "kvtier_tenant_bucket_evicted_segments",
        "counter",
        ("tenant",),
        "A tenant's bucket segments this process evicted (tenants past their shares or caps first)",
    ),
)
# Per-tenant values, named ``<value>:<tenant>`` by the service: (family, value name).
TENANT_VALUES: tuple[tuple[str, str], ...] = (
    ("kvtier_tenant_dram_bytes", "tenant_dram_bytes"),
    ("kvtier_tenant_dram_guaranteed_bytes", "tenant_dram_guaranteed_bytes"),
    ("kvtier_tenant_dram_evictions", "tenant_dram_evictions"),
    ("kvtier_tenant_dram_cap_bytes", "tenant_dram_cap_bytes"),
    ("kvtier_tenant_nvme_bytes", "tenant_nvme_bytes"),
    ("kvtier_tenant_nvme_reclaimed_regions", "tenant_nvme_reclaimed_regions"),
    ("kvtier_tenant_shared_bytes", "tenant_shared_bytes"),
    ("kvtier_tenant_shared_evicted_files", "tenant_shared_evicted_files"),
    ("kvtier_tenant_bucket_bytes", "tenant_bucket_bytes"),
    ("kvtier_tenant_bucket_evicted_segments", "tenant_bucket_evicted_segments"),
)
# Values a family shows as the service reports them: (family, the labels after ``namespace`` and
# ``model``, the service's value name).
PLAIN_VALUES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("kvtier_misses", (), "misses"),
    ("kvtier_blocks", ("dram",), "blocks_dram"),
    ("kvtier_blocks", ("nvme",), "blocks_nvme"),
    ("kvtier_read_bytes", ("nvme",), "bytes_read_nvme"),
    ("kvtier_read_bytes", ("shared",), "shared_bytes_read"),
    ("kvtier_written_bytes", ("nvme",), "bytes_written_nvme"),
    ("kvtier_written_bytes", ("shared",), "shared_bytes_written"),
    ("kvtier_read_bytes", ("bucket",), "bucket_bytes_read"),
    ("kvtier_written_bytes", ("bucket",), "bucket_bytes_written"),
    ("kvtier_write_admission_blocks", ("awaiting_reuse",), "writes_awaiting_reuse"),
    ("kvtier_write_admission_blocks", ("admitted_on_reuse",), "writes_admitted_on_reuse"),
    ("kvtier_write_admission_blocks", ("dropped_without_evidence",), "dropped_without_evidence"),
    ("kvtier_write_admission_blocks", ("dropped_behind_backlog",), "dropped_behind_backlog"),
    ("kvtier_write_admission_blocks", ("budget_refused_nvme",), "nvme_write_budget_refusals"),
    ("kvtier_write_admission_blocks", ("budget_refused_remote",), "remote_write_budget_refusals"),
    ("kvtier_write_admission_blocks", ("retained_by_hint",), "retained_by_hint"),
    ("kvtier_evictions", ("dram",), "dram_evictions"),
    ("kvtier_evictions", ("nvme",), "nvme_region_evictions"),
    ("kvtier_evictions", ("shared",), "shared_evicted_files"),
    ("kvtier_dropped_stores", (), "dropped_stores"),
    ("kvtier_nvme_dropped_writes", (), "nvme_dropped_writes"),
    ("kvtier_cancelled_writes", (), "cancelled_writes"),
    ("kvtier_checksum_failures", (), "checksum_failures"),
    ("kvtier_nvme_auth_failures", (), "nvme_auth_failures"),
    ("kvtier_remote_decrypt_failures", (), "remote_decrypt_failures"),
    ("kvtier_io_errors", (), "io_errors"),
    ("kvtier_queue_depth", ("pending_fills",), "service_pending_fills"),
    ("kvtier_nvme_write_backlog_bytes", (), "nvme_write_backlog_bytes"),
    ("kvtier_attached_connections", (), "service_attached_connections"),
    ("kvtier_held_blocks", ("pins",), "service_held_pins"),
    ("kvtier_held_blocks", ("load_slots",), "service_held_load_slots"),
    ("kvtier_expired_holds", ("pins",), "service_expired_pins"),
    ("kvtier_expired_holds", ("fills",), "service_expired_fills"),
    ("kvtier_capped_reserves", (), "service_capped_reserves"),
    ("kvtier_remote_tier_outages", (), "remote_tier_outages"),
    ("kvtier_remote_tier_lookups_skipped", (), "remote_tier_lookups_skipped"),
    ("kvtier_remote_tiers_sick", (), "remote_tiers_sick"),
    ("kvtier_remote_reads_given_up", (), "remote_reads_given_up"),
    ("kvtier_remote_refreshes_stalled", (), "remote_refreshes_stalled"),
    ("kvtier_nvme_outages", (), "nvme_outages"),
    ("kvtier_nvme_lookups_skipped", (), "nvme_lookups_skipped"),
    ("kvtier_nvme_sick", (), "nvme_sick"),
    ("kvtier_nvme_reads_given_up", (), "nvme_reads_given_up"),
    ("kvtier_nvme_off_no_space", (), "nvme_off_no_space"),
)
# The shared tier's publishing counters (stores with a shared tier only): (result label, value name).
SHARED_PUBLISH_RESULTS = (
    ("deferred", "shared_deferred_publishes"),
    ("dropped", "shared_dropped_publishes"),
    ("failed", "shared_publish_errors"),
)
# What an engine reports of itself (``kvtier_core::service::ENGINE_FALLBACKS``, exported by the
# binding): what it served at recompute because the service did not answer.
ENGINE_FALLBACKS: tuple[str, ...] = tuple(_core.ENGINE_FALLBACKS)
# An engine's counters: (family, the labels after ``engine``, the engine's counter name).
ENGINE_VALUES: tuple[tuple[str, str, str], ...] = (
    *(("kvtier_engine_lookup_blocks", tier, f"lookup_{tier}") for tier in HIT_TIERS),
    ("kvtier_engine_lookup_blocks", "none", "lookup_miss"),
    ("kvtier_engine_loaded_slices", "found", "loaded_slices"),
    ("kvtier_engine_loaded_slices", "missed", "load_missed_slices"),
    ("kvtier_engine_stored_slices", "accepted", "stored_slices"),
    ("kvtier_engine_stored_slices", "dropped", "dropped_slices"),
    # event: the count's name in the singular (failed_call, outage, ..., skipped_store_block)
    *(("kvtier_engine_fallbacks", name.removesuffix("s"), name) for name in ENGINE_FALLBACKS),
    ("kvtier_engine_delayed_loads", "reattach", "loads_after_reattach"),
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


def new_families() -> dict[str, Any]:
    """The empty families of ``NAMESPACE_FAMILIES`` by name, in scrape order (prometheus_client objects)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}
    return {
        name: kinds[kind](name, doc, labels=["namespace", "model", *labels])
        for name, kind, labels, doc in NAMESPACE_FAMILIES
    }


def add_namespace(family: dict[str, Any], ns: dict[str, Any]) -> None:
    """Adds one namespace's samples to the families of ``new_families``."""
    v: dict[str, int] = dict(ns["values"])
    labels = [str(ns["digest"])[:16], model_of(bytes(ns["description"]))]
    object_bytes = int(ns["object_bytes"])
    all_hits = sum(v.get(f"{tier}_hits", 0) for tier in HIT_TIERS)
    for tier in HIT_TIERS:
        family["kvtier_hits"].add_metric([*labels, tier], v.get(f"{tier}_hits", 0))
    family["kvtier_lookups"].add_metric(labels, all_hits + v.get("misses", 0))
    for tier in TIERS:
        if f"{tier}_used_bytes" in v:  # a tier the store has
            family["kvtier_used_bytes"].add_metric([*labels, tier], v[f"{tier}_used_bytes"])
            family["kvtier_capacity_bytes"].add_metric([*labels, tier], v.get(f"{tier}_capacity_bytes", 0))
    family["kvtier_stored_bytes"].add_metric(labels, v.get("puts", 0) * object_bytes)
    family["kvtier_loaded_bytes"].add_metric(labels, all_hits * object_bytes)
    for name, more_labels, key in PLAIN_VALUES:
        family[name].add_metric([*labels, *more_labels], v.get(key, 0))
    if "shared_index_age_ms" in v:  # a store with a shared tier
        family["kvtier_shared_index_age_seconds"].add_metric(labels, v["shared_index_age_ms"] / 1000)
        family["kvtier_shared_published_files"].add_metric(labels, v.get("shared_files_published", 0))
        for result, key in SHARED_PUBLISH_RESULTS:
            family["kvtier_shared_publish_blocks"].add_metric([*labels, result], v.get(key, 0))
    for op in LATENCY_OPS:
        buckets = [(str(le / 1e6), float(v.get(f"latency_{op}_le_{le}", 0))) for le in LATENCY_BUCKETS_US]
        buckets.append(("+Inf", float(v.get(f"latency_{op}_count", 0))))
        family["kvtier_op_latency_seconds"].add_metric([*labels, op], buckets, v.get(f"latency_{op}_sum_us", 0) / 1e6)
    for engine, counts in ns.get("engines", []):
        for name, label, key in ENGINE_VALUES:
            family[name].add_metric([*labels, engine, label], counts.get(key, 0))
    add_nvme_requests(family, labels, v)
    add_tenants(family, labels, v)
    for tier in tiers.BELOW_DRAM:
        if v.get(f"{tier}_write_budget_bytes_per_day", 0):  # a bounded budget
            per_day, left = v[f"{tier}_write_budget_bytes_per_day"], v.get(f"{tier}_write_budget_left_bytes", 0)
            family["kvtier_write_budget_bytes_per_day"].add_metric([*labels, tier], per_day)
            family["kvtier_write_budget_left_bytes"].add_metric([*labels, tier], left)


def add_tenants(family: dict[str, Any], labels: list[str], v: dict[str, int]) -> None:
    """One namespace's DRAM pool per tenant (present only when the pool is split by tenant)."""
    for name, value in v.items():
        prefix, _, tenant = name.partition(":")
        for family_name, value_name in TENANT_VALUES:
            if prefix == value_name and tenant:
                family[family_name].add_metric([*labels, tenant], value)


def add_nvme_requests(family: dict[str, Any], labels: list[str], v: dict[str, int]) -> None:
    """The NVMe tier's requests of one namespace: their sizes, and how many were sequential."""
    for kind in ("read", "write"):
        sizes = io_request_buckets(v, kind)
        family["kvtier_nvme_request_bytes"].add_metric([*labels, kind], sizes, v.get(f"nvme_{kind}_request_bytes", 0))
        sequential = v.get(f"nvme_{kind}_sequential", 0)
        random = v.get(f"nvme_{kind}_requests", 0) - sequential
        family["kvtier_nvme_requests"].add_metric([*labels, kind, "sequential"], sequential)
        family["kvtier_nvme_requests"].add_metric([*labels, kind, "random"], random)


def families(namespaces: list[dict[str, Any]], stats: dict[str, int]) -> Iterator[Any]:
    """The metric families of one snapshot (prometheus_client objects)."""
    from prometheus_client.core import GaugeMetricFamily

    family = new_families()
    for ns in namespaces:
        add_namespace(family, ns)
    yield from family.values()
    for name, doc, value in (
        ("kvtier_service_connections", "Connections to the service now", stats.get("service_connections", 0)),
        ("kvtier_service_namespaces", "Namespaces the service has open", stats.get("service_namespaces", 0)),
        ("kvtier_up", "1: the service answered this scrape", 1),
    ):
        gauge = GaugeMetricFamily(name, doc)
        gauge.add_metric([], value)
        yield gauge


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
