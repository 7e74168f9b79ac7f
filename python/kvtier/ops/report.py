"""``kvtier status`` and ``kvtier ls``: the reports as stable JSON objects, and as tables.

The JSON schemas are documented in docs/cli.md; each object carries ``"schema"``
(``kvtier.status/1``, ``kvtier.ls/1``). A field is added under the same schema version; a field
renamed, removed or changed in meaning bumps it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kvtier.ops import store_files
from kvtier.threads import start_thread
from kvtier.tiers import ALL as ALL_TIERS
from kvtier.tiers import label as tier_label

T = TypeVar("T")

STATUS_SCHEMA = "kvtier.status/1"
LS_SCHEMA = "kvtier.ls/1"


class OpsError(Exception):
    """The report cannot be made (exit status 1); the message names the fix."""


# --------------------------------------------------------------------------------------------
# Gathering
# --------------------------------------------------------------------------------------------


def resolve_socket(paths: Sequence[Path], socket: str | os.PathLike | None) -> Path:
    from kvtier.service import default_socket_path

    return Path(socket) if socket else default_socket_path([os.fspath(p) for p in paths])


def probe_service(socket: Path, timeout_ms: int = 2_000) -> dict[str, int] | None:
    """The summed stats of the service on ``socket``, or None when none answers there."""
    if not socket.exists():
        return None
    from kvtier.service import connect

    try:
        return dict(connect(socket, timeout_ms=timeout_ms).stats())
    except Exception:
        return None


def _service_pid(socket: Path) -> int | None:
    from kvtier.service import service_pid

    return service_pid(socket)


def _check_paths(paths: Sequence[Path]) -> list[Path]:
    resolved = []
    for path in paths:
        if not path.exists():
            raise OpsError(
                f"{path} does not exist: give the store directory the engines use (their `path` option, "
                "the directory `kvtier serve` was started with)"
            )
        if not path.is_dir():
            raise OpsError(
                f"{path} is not a directory: give the store directory (it holds one directory per namespace)"
            )
        resolved.append(path.resolve())
    return resolved


# How long a report waits for the store's files. On a frozen mount (a FUSE daemon stopped, an NFS
# server gone) a stat waits for as long as it stays frozen, and an operator asking what is wrong
# must get an answer: the service's view, which lives in memory.
FILES_WAIT_S = 5.0


def _within(work: Callable[[], T], wait_s: float) -> T | None:
    """``work()`` on a thread of its own, waited ``wait_s``: its value, its exception raised here, or
    None when it is still running (the thread is left to finish when the filesystem answers)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as error:
            outcome["error"] = error

    start_thread(run, "kvtier-files").join(wait_s)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _scan(resolved: Sequence[Path]) -> list[store_files.NamespaceDir]:
    holders = store_files.flock_holders()
    namespaces: list[store_files.NamespaceDir] = []
    for path in resolved:
        try:
            namespaces += store_files.scan(path, holders)
        except OSError as error:
            raise OpsError(f"cannot list {path}: {error.strerror} (run as the store's owner)") from None
    return namespaces


def _files(
    paths: Sequence[Path], socket_option: str | os.PathLike | None
) -> tuple[list[Path], Path, list[store_files.NamespaceDir], str | None]:
    """The checked paths, the socket and the namespaces on disk, within ``FILES_WAIT_S``; past it,
    the paths as given, the ``--socket`` and no namespaces, with a note saying so (without
    ``--socket`` the socket's name comes from the paths' real path: an error naming the fix)."""

    def gather() -> tuple[list[Path], Path, list[store_files.NamespaceDir]]:
        resolved = _check_paths(paths)
        return resolved, resolve_socket(resolved, socket_option), _scan(resolved)

    found = _within(gather, FILES_WAIT_S)
    if found is not None:
        return (*found, None)
    where = ", ".join(str(p) for p in paths)
    if socket_option is None:
        raise OpsError(
            f"{where} did not answer within {FILES_WAIT_S:g} s (a frozen or hung filesystem?); the service's "
            "socket is named from it: give --socket to see what the service tells"
        )
    note = (
        f"the store's files did not answer within {FILES_WAIT_S:g} s (a frozen or hung filesystem?): "
        "the service's view only"
    )
    return list(paths), Path(socket_option), [], note


def socket_named_from(paths: Sequence[Path]) -> Path:
    """The default socket of the store at ``paths`` (named from their real path), within
    ``FILES_WAIT_S``; an error naming the fix when the paths do not answer."""
    socket = _within(lambda: resolve_socket(paths, None), FILES_WAIT_S)
    if socket is None:
        where = ", ".join(str(p) for p in paths)
        raise OpsError(
            f"{where} did not answer within {FILES_WAIT_S:g} s (a frozen or hung filesystem?); the service's "
            "socket is named from it: give --socket"
        )
    return socket


def socket_of(paths: Sequence[Path], socket_option: str | os.PathLike | None) -> Path:
    """The service socket of the store at ``paths`` (checked), within ``FILES_WAIT_S``; past it the
    ``--socket`` given, or an error naming the fix (``_files``)."""
    return _files(paths, socket_option)[1]


def _gather(paths: Sequence[Path], socket_option: str | os.PathLike | None) -> dict[str, Any]:
    resolved, socket, namespaces, files_note = _files(paths, socket_option)
    stats = probe_service(socket)
    if stats is None and not namespaces:
        where = ", ".join(str(p) for p in resolved)
        raise OpsError(
            f"{where}: not a kvtier store (no namespace directory, <64 hex digits>/ holding LOCK or nvme.kvt) and "
            f"no service answers on {socket}: give the directory the engines use as `path`, or --socket of the "
            "service that serves it"
        )
    pid = _service_pid(socket) if stats is not None else None
    return {
        "paths": resolved,
        "socket": socket,
        "stats": stats,
        "pid": pid,
        "namespaces": namespaces,
        "files_note": files_note,
    }


def _namespace_json(ns: store_files.NamespaceDir, running: bool, service_pid: int | None) -> dict[str, Any]:
    if not running:
        open_in_service = None
    else:
        open_in_service = ns.locked_by_pid is not None and (service_pid is None or ns.locked_by_pid == service_pid)
    return {
        "path": str(ns.path),
        "digest": ns.digest,
        "directory": str(ns.directory),
        "device_file_bytes": ns.device_file_bytes,
        "geometry": ns.superblock.to_json() if ns.superblock else None,
        "error": ns.error,
        "locked_by_pid": ns.locked_by_pid,
        "open_in_service": open_in_service,
    }


def _service_json(gathered: dict[str, Any]) -> dict[str, Any]:
    return {"running": gathered["stats"] is not None, "pid": gathered["pid"]}


def ls_report(paths: Sequence[Path], socket: str | os.PathLike | None = None) -> dict[str, Any]:
    gathered = _gather(paths, socket)
    running = gathered["stats"] is not None
    return {
        "schema": LS_SCHEMA,
        "paths": [str(p) for p in gathered["paths"]],
        "socket": str(gathered["socket"]),
        "service": _service_json(gathered),
        "message": gathered["files_note"],
        "namespaces": [_namespace_json(ns, running, gathered["pid"]) for ns in gathered["namespaces"]],
    }


def _shared_facts(socket: Path) -> dict[str, int | None]:
    """Shared-tier usage (summed) and index age (the stalest namespace's) from the service's
    per-namespace values (protocol version 2); all None without a shared tier or from an older service."""
    from kvtier.service import connect

    facts: dict[str, int | None] = {"used_bytes": None, "capacity_bytes": None, "index_age_ms": None}
    try:
        namespaces = connect(socket, timeout_ms=2_000).namespaces()["namespaces"]
    except Exception:
        return facts
    for ns in namespaces:
        values = ns["values"]
        if "shared_index_age_ms" not in values:
            continue
        facts["used_bytes"] = (facts["used_bytes"] or 0) + int(values.get("shared_used_bytes", 0))
        facts["capacity_bytes"] = (facts["capacity_bytes"] or 0) + int(values.get("shared_capacity_bytes", 0))
        facts["index_age_ms"] = max(facts["index_age_ms"] or 0, int(values["shared_index_age_ms"]))
    return facts


def _rate(hits: int, lookups: int) -> float | None:
    return hits / lookups if lookups else None


def status_report(paths: Sequence[Path], socket: str | os.PathLike | None = None) -> dict[str, Any]:
    gathered = _gather(paths, socket)
    stats: dict[str, int] | None = gathered["stats"]
    running = stats is not None
    report: dict[str, Any] = {
        "schema": STATUS_SCHEMA,
        "paths": [str(p) for p in gathered["paths"]],
        "socket": str(gathered["socket"]),
        "service": _service_json(gathered),
        "message": gathered["files_note"]
        if running
        else f"no service running on {gathered['socket']}: showing what the files tell",
        "stats": stats,
        "lookups": None,
        "hit_rate": None,
        "tiers": None,
        "shared_index_age_ms": None,
        "writes": None,
        "tenants": None,
        "namespaces": [_namespace_json(ns, running, gathered["pid"]) for ns in gathered["namespaces"]],
    }
    if stats is not None:
        shared = _shared_facts(gathered["socket"])
        report["shared_index_age_ms"] = shared["index_age_ms"]
        get = lambda name: int(stats.get(name, 0))  # noqa: E731
        hits = {tier: get(f"{tier}_hits") for tier in ALL_TIERS}
        lookups = sum(hits.values()) + get("misses")
        report["lookups"] = lookups
        report["hit_rate"] = _rate(sum(hits.values()), lookups)
        # Every tier's hits; sizes where the tier has them (the bucket's are the object store's).
        report["tiers"] = {
            tier: {"used_bytes": None, "capacity_bytes": None, "blocks": None, "hits": hits[tier]} for tier in ALL_TIERS
        }
        for tier in ("dram", "nvme"):
            report["tiers"][tier].update(
                used_bytes=get(f"{tier}_used_bytes"),
                capacity_bytes=get(f"{tier}_capacity_bytes"),
                blocks=get(f"blocks_{tier}"),
            )
        report["tiers"]["shared"].update(used_bytes=shared["used_bytes"], capacity_bytes=shared["capacity_bytes"])
        for facts in report["tiers"].values():
            facts["hit_rate"] = _rate(facts["hits"], lookups)
        report["writes"] = writes_below_dram(stats)
        report["tenants"] = tenants_of(stats)
    return report


# Per tenant of the DRAM pool and, split too, the NVMe tier (docs/tenants.md): (JSON field, the
# service's value name before ``:<tenant>``).
TENANT_FIGURES = (
    ("dram_bytes", "tenant_dram_bytes"),
    ("dram_guaranteed_bytes", "tenant_dram_guaranteed_bytes"),
    ("dram_evictions", "tenant_dram_evictions"),
    ("dram_cap_bytes", "tenant_dram_cap_bytes"),
    ("nvme_bytes", "tenant_nvme_bytes"),
    ("nvme_reclaimed_regions", "tenant_nvme_reclaimed_regions"),
    ("shared_bytes", "tenant_shared_bytes"),
    ("shared_evicted_files", "tenant_shared_evicted_files"),
    ("bucket_bytes", "tenant_bucket_bytes"),
    ("bucket_evicted_segments", "tenant_bucket_evicted_segments"),
)


def tenants_of(stats: dict[str, int]) -> list[dict[str, Any]] | None:
    """The DRAM pool (and a split NVMe tier) per tenant (its label: the first bytes of the salt's
    hash, ``default`` for no salt), largest first; ``None`` when the pool is not split by tenant
    (``tenant_dram_share``)."""
    by_label: dict[str, dict[str, Any]] = {}
    for name, value in stats.items():
        figure, _, label = name.partition(":")
        for field, prefix in TENANT_FIGURES:
            if figure == prefix and label:
                by_label.setdefault(label, {"tenant": label})[field] = int(value)
    if not by_label:
        return None
    return sorted(by_label.values(), key=lambda t: (-t.get("dram_bytes", 0), t["tenant"]))


# Per tier below DRAM: (name, the counter of bytes written, of bytes read back).
WRITTEN_AND_READ = (
    ("nvme", "bytes_written_nvme", "bytes_read_nvme"),
    ("shared", "shared_bytes_written", "shared_bytes_read"),
    ("bucket", "bucket_bytes_written", "bucket_bytes_read"),
)
# What admission below DRAM did with stored blocks (docs/architecture.md, "Writes below DRAM").
ADMISSION_COUNTERS = (
    "writes_awaiting_reuse",
    "writes_admitted_on_reuse",
    "dropped_without_evidence",
    "dropped_behind_backlog",
    "nvme_write_budget_refusals",
    "remote_write_budget_refusals",
    "retained_by_hint",
)


def writes_below_dram(stats: dict[str, int]) -> dict[str, Any]:
    """Bytes written and read back per tier below DRAM, their ratio (write amplification: bytes
    written per byte read back, ``None`` before anything was read), each tier's write budget, and what
    admission did with stored blocks."""
    tiers = {}
    for tier, written_key, read_key in WRITTEN_AND_READ:
        written, read = int(stats.get(written_key, 0)), int(stats.get(read_key, 0))
        tiers[tier] = {
            "written_bytes": written,
            "read_bytes": read,
            "write_amplification": written / read if read else None,
        }
    for tier, facts in tiers.items():
        budget = int(stats.get(f"{tier}_write_budget_bytes_per_day", 0))
        facts["budget_bytes_per_day"] = budget or None
        facts["budget_left_bytes"] = int(stats.get(f"{tier}_write_budget_left_bytes", 0)) if budget else None
    return {"tiers": tiers, "admission": {name: int(stats.get(name, 0)) for name in ADMISSION_COUNTERS}}


# --------------------------------------------------------------------------------------------
# Tables (rich when installed, plain text otherwise)
# --------------------------------------------------------------------------------------------


def human_bytes(value: int | None) -> str:
    if value is None:
        return "-"
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if amount < 1024 or unit == "TiB":
            return f"{value} B" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    raise AssertionError("unreachable")


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.1f}%"


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


class Output:
    """Writes lines and tables to stdout, with rich when it is installed and ``plain`` is not asked."""

    def __init__(self, plain: bool = False) -> None:
        self.console: Any = None
        if not plain:
            try:
                from rich.console import Console
            except ImportError:
                pass
            else:
                # A pipe or a file gets whole tables (rich would squeeze them into 80 columns).
                self.console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)

    def line(self, text: str = "") -> None:
        if self.console is not None:
            self.console.print(text, markup=False)
        else:
            print(text)

    def table(self, title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], right: int = 1) -> None:
        """``right``: columns from this index on are right-aligned (numbers). A blank line comes first."""
        self.line()
        if self.console is not None:
            from rich import box
            from rich.table import Table

            table = Table(
                title=title,
                title_justify="left",
                box=box.SIMPLE_HEAD,
                show_edge=False,
                pad_edge=False,
                collapse_padding=True,
            )
            for index, header in enumerate(headers):
                table.add_column(header, justify="right" if index >= right else "left", no_wrap=True)
            for row in rows:
                table.add_row(*row)
            self.console.print(table)
            return
        widths = [max([len(header)] + [len(row[i]) for row in rows]) for i, header in enumerate(headers)]

        def fmt(cells: Sequence[str]) -> str:
            parts = [
                c.rjust(w) if i >= right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            ]
            return "  ".join(parts).rstrip()

        print(title)
        print(fmt(headers))
        print(fmt(["-" * w for w in widths]))
        for row in rows:
            print(fmt(row))


def _namespace_rows(namespaces: Sequence[dict[str, Any]], with_path: bool) -> tuple[list[str], list[list[str]]]:
    headers = ["namespace", *(["path"] if with_path else [])]
    headers += ["device file", "object", "regions", "store id", "open"]
    rows = []
    for ns in namespaces:
        geometry = ns["geometry"]
        if ns["open_in_service"] is None:
            open_text = f"pid {ns['locked_by_pid']}" if ns["locked_by_pid"] is not None else "-"
        else:
            open_text = "yes" if ns["open_in_service"] else "no"
        row = [ns["digest"][:16], *([ns["path"]] if with_path else [])]
        row += [
            human_bytes(ns["device_file_bytes"]) if ns["device_file_bytes"] is not None else "none",
            human_bytes(geometry["object_bytes"]) if geometry else "-",
            f"{geometry['region_count']} x {human_bytes(geometry['region_bytes'])}" if geometry else "-",
            geometry["store_id"] if geometry else "-",
            open_text,
        ]
        rows.append(row)
    return headers, rows


def _namespace_table(report: dict[str, Any], output: Output, title: str) -> None:
    namespaces = report["namespaces"]
    if not namespaces:
        output.line("no namespace directories yet (no engine has stored a block)")
        return
    headers, rows = _namespace_rows(namespaces, with_path=len(report["paths"]) > 1)
    output.table(title, headers, rows)
    notes = [f"  {ns['digest'][:16]}: {ns['error']}" for ns in namespaces if ns["error"]]
    notes += [
        f"  {ns['digest'][:16]}: no device file (a DRAM-only store, nvme_bytes=0)"
        for ns in namespaces
        if ns["device_file_bytes"] is None and not ns["error"]
    ]
    for note in notes:
        output.line(note)


def _service_line(report: dict[str, Any]) -> str:
    service = report["service"]
    if not service["running"]:
        return f"service: none running on {report['socket']}"
    pid = f"pid {service['pid']}" if service["pid"] is not None else "pid unknown"
    return f"service: running on {report['socket']} ({pid})"


def print_ls(report: dict[str, Any], output: Output) -> None:
    output.line(f"kvtier store {', '.join(report['paths'])}")
    output.line(_service_line(report))
    _namespace_table(report, output, f"{len(report['namespaces'])} namespace(s)")


def print_status(report: dict[str, Any], output: Output) -> None:
    output.line(f"kvtier store {', '.join(report['paths'])}")
    output.line(_service_line(report))
    stats = report["stats"]
    if stats is not None:
        tiers = report["tiers"]
        rows = []
        for name in ALL_TIERS:
            tier, label = tiers[name], tier_label(name)
            rows.append(
                [
                    label,
                    human_bytes(tier["used_bytes"]),
                    human_bytes(tier["capacity_bytes"]),
                    _cell(tier["blocks"]),
                    str(tier["hits"]),
                    _percent(tier["hit_rate"]),
                ]
            )
        rows.append(["all", "", "", "", str(report["lookups"] - stats.get("misses", 0)), _percent(report["hit_rate"])])
        output.table(
            f"tiers ({stats.get('service_namespaces', 0)} namespace(s) open, "
            f"{stats.get('service_connections', 0)} connection(s) counting this one)",
            ["tier", "used", "capacity", "blocks", "hits", "hit rate"],
            rows,
        )
        counters = [
            ("lookups", report["lookups"]),
            ("misses", stats.get("misses", 0)),
            ("puts", stats.get("puts", 0)),
            ("DRAM evictions", stats.get("dram_evictions", 0)),
            ("NVMe region evictions", stats.get("nvme_region_evictions", 0)),
            ("dropped stores", stats.get("dropped_stores", 0)),
            ("checksum failures", stats.get("checksum_failures", 0)),
            ("NVMe values that did not decrypt", stats.get("nvme_auth_failures", 0)),
            ("remote blocks that did not decrypt", stats.get("remote_decrypt_failures", 0)),
            ("I/O errors", stats.get("io_errors", 0)),
            ("pending fills", stats.get("service_pending_fills", 0)),
            ("pins held", stats.get("service_held_pins", 0)),
            ("load slots held", stats.get("service_held_load_slots", 0)),
            ("pins let go (lease)", stats.get("service_expired_pins", 0)),
            ("fills abandoned (deadline)", stats.get("service_expired_fills", 0)),
            ("reserves over a connection's cap", stats.get("service_capped_reserves", 0)),
            ("remote tiers sick now", stats.get("remote_tiers_sick", 0)),
            ("remote tier outages", stats.get("remote_tier_outages", 0)),
            ("lookups skipped (sick tier)", stats.get("remote_tier_lookups_skipped", 0)),
            ("remote reads given up (stalled)", stats.get("remote_reads_given_up", 0)),
            ("remote refreshes stalled", stats.get("remote_refreshes_stalled", 0)),
            ("NVMe sick now", stats.get("nvme_sick", 0)),
            ("NVMe outages", stats.get("nvme_outages", 0)),
            ("lookups skipped (sick NVMe)", stats.get("nvme_lookups_skipped", 0)),
            ("NVMe reads given up (hung)", stats.get("nvme_reads_given_up", 0)),
            ("NVMe off: no space at open", stats.get("nvme_off_no_space", 0)),
        ]
        if report.get("shared_index_age_ms") is not None:
            counters.append(("shared index age (ms)", report["shared_index_age_ms"]))
        output.table("counters", ["counter", "value"], [[name, str(value)] for name, value in counters])
        _writes_table(report["writes"], output)
        if report.get("tenants"):
            _tenants_table(report["tenants"], stats.get("untracked_tenant_blocks", 0), output)
    if report["message"]:
        output.line(report["message"])
    _namespace_table(report, output, f"{len(report['namespaces'])} namespace(s) on disk")


def _writes_table(writes: dict[str, Any], output: Output) -> None:
    rows = []
    for tier, _, _ in WRITTEN_AND_READ:
        t, label = writes["tiers"][tier], tier_label(tier)
        amplification = t["write_amplification"]
        budget = t.get("budget_bytes_per_day")
        rows.append(
            [
                label,
                human_bytes(t["written_bytes"]),
                human_bytes(t["read_bytes"]),
                "-" if amplification is None else f"{amplification:.2f}",
                "unbounded"
                if budget is None
                else f"{human_bytes(budget)}/day, {human_bytes(t['budget_left_bytes'])} left",
            ]
        )
    admission = writes["admission"]
    over_budget = admission["nvme_write_budget_refusals"] + admission["remote_write_budget_refusals"]
    output.table(
        f"writes below DRAM ({admission['writes_awaiting_reuse']} block(s) kept awaiting reuse, "
        f"{admission['writes_admitted_on_reuse']} written on reuse, {admission['retained_by_hint']} hinted, "
        f"{admission['dropped_without_evidence']} dropped "
        f"unused, {admission['dropped_behind_backlog']} behind a full write backlog, {over_budget} over budget)",
        ["tier", "written", "read back", "written per read", "write budget"],
        rows,
    )


def _tenants_table(tenants: list[dict[str, Any]], untracked: int, output: Output) -> None:
    rows = [
        [
            t["tenant"],
            human_bytes(t.get("dram_bytes", 0)),
            human_bytes(t.get("dram_guaranteed_bytes", 0)),
            str(t.get("dram_evictions", 0)),
            human_bytes(t.get("dram_cap_bytes")),
        ]
        for t in tenants
    ]
    header = ["tenant", "DRAM used", "guaranteed", "evictions", "cap"]
    if any("nvme_bytes" in t for t in tenants):
        header += ["NVMe used", "NVMe regions reclaimed"]
        for row, t in zip(rows, tenants, strict=True):
            row += [human_bytes(t.get("nvme_bytes", 0)), str(t.get("nvme_reclaimed_regions", 0))]
    if any("shared_bytes" in t for t in tenants):
        header += ["shared used", "shared files evicted"]
        for row, t in zip(rows, tenants, strict=True):
            row += [human_bytes(t.get("shared_bytes", 0)), str(t.get("shared_evicted_files", 0))]
    if any("bucket_bytes" in t for t in tenants):
        header += ["bucket used", "bucket segments evicted"]
        for row, t in zip(rows, tenants, strict=True):
            row += [human_bytes(t.get("bucket_bytes", 0)), str(t.get("bucket_evicted_segments", 0))]
    title = "DRAM pool by tenant (tenant: hash of its cache_salt)"
    if untracked:
        title += f", {untracked} block(s) of tenants past the first 64 counted as default"
    output.table(title, header, rows)


# --------------------------------------------------------------------------------------------
# kvtier ls --blocks
# --------------------------------------------------------------------------------------------

# Keys asked for per namespace; the service answers at most its change log's capacity (65,536).
LS_BLOCKS_MAX = 1 << 16


def namespace_blocks(socket: Path, max_blocks: int = LS_BLOCKS_MAX) -> dict[str, dict[str, Any]]:
    """The blocks each namespace the service has open holds, per tier (hex keys, sorted), keyed by
    digest. Read from the namespace's change log as a new follower reads it (``Op::Changes`` from
    cursor 0, docs/service.md): the store's residency as read at most 500 ms earlier, which is
    exactly the set the engines' KV events describe. ``truncated``: the namespace holds more than
    ``max_blocks`` block-tier entries and the lists are cut."""
    from kvtier.service import connect

    try:
        listing = connect(socket, timeout_ms=10_000).namespaces()["namespaces"]
    except Exception as error:
        raise OpsError(f"--blocks needs the running service, and none answers on {socket} ({error})") from None
    result: dict[str, dict[str, Any]] = {}
    for ns in listing:
        # A follower attaches to the namespace as one more rank-0 client of the same layout; its
        # connection closes when the client is dropped, at the end of this iteration.
        client = connect(socket, timeout_ms=60_000)
        client.hello(bytes(ns["description"]), int(ns["tp_size"]), 0, int(ns["slice_bytes"]))
        _reset, _next, changes = client.changes(0, max_blocks)
        del client
        tiers: dict[str, list[str]] = {"dram": [], "nvme": [], "shared": []}
        for key, tier, removed in changes:
            if not removed:
                tiers[tier].append(bytes(key).hex())
        result[ns["digest"]] = {
            "blocks": {tier: sorted(keys) for tier, keys in tiers.items()},
            "truncated": len(changes) >= max_blocks,
        }
    return result


def add_blocks(report: dict[str, Any]) -> dict[str, Any]:
    """``kvtier ls --blocks``: each namespace of ``report`` gains ``blocks`` (tier -> hex keys) and
    ``blocks_truncated``; both null for a namespace the service does not have open."""
    held = namespace_blocks(Path(report["socket"]))
    for ns in report["namespaces"]:
        entry = held.get(ns["digest"])
        ns["blocks"] = entry["blocks"] if entry else None
        ns["blocks_truncated"] = entry["truncated"] if entry else None
    return report


def print_blocks(report: dict[str, Any], output: Output) -> None:
    rows = [
        [ns["digest"][:16], *(str(len(ns["blocks"][tier])) for tier in ("dram", "nvme", "shared"))]
        for ns in report["namespaces"]
        if ns.get("blocks") is not None
    ]
    output.table("blocks per tier (service)", ["namespace", "dram", "nvme", "shared"], rows, right=3)
