"""Tables and progress of ``kvtier inspect``, ``kvtier verify`` and ``kvtier trim``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvtier.ops.maintenance import ProgressFn
from kvtier.ops.report import Output, human_bytes


def _service_line(report: dict[str, Any]) -> str:
    service = report["service"]
    if service["running"]:
        pid = f" (pid {service['pid']})" if service["pid"] else ""
        return f"service: running on {report['socket']}{pid}"
    return f"service: none running on {report['socket']}: working on the store's files"


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


@contextmanager
def progress_reporter(enabled: bool, what: str) -> Iterator[ProgressFn | None]:
    """A rich progress bar on stderr (one task per namespace), when ``enabled`` and rich is there."""
    if not enabled:
        yield None
        return
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
    except ImportError:
        yield None
        return
    columns = (
        TextColumn(f"{what} {{task.description}}"),
        BarColumn(),
        MofNCompleteColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    tasks: dict[str, Any] = {}
    with Progress(*columns, console=Console(file=sys.stderr), transient=False) as bar:

        def update(digest: str, done: int, total: int, bytes_read: int) -> None:
            if digest not in tasks:
                tasks[digest] = bar.add_task(digest[:16], total=total)
            # TransferSpeedColumn shows the speed of `completed`; blocks stand in for it here.
            bar.update(tasks[digest], completed=done, total=total)

        yield update


def print_inspect(report: dict[str, Any], plain: bool) -> None:
    out = Output(plain=plain)
    ns = report["namespace"]
    d = ns["description"]
    out.line(f"kvtier namespace {ns['digest']}")
    out.line(_service_line(report) if ns["source"] == "service" else "source: the store's files (opened here)")
    out.line()
    if d.get("text") is not None:
        out.line(f"description  {d['text']}")
    else:
        parallel = d.get("parallel") or {}
        layout = ", ".join(f"{k}={v}" for k, v in parallel.items()) if isinstance(parallel, dict) else str(parallel)
        for label, value in (
            ("model", d.get("model")),
            ("fingerprint", d.get("model_fingerprint")),
            ("engine", d.get("engine")),
            ("dtype", d.get("dtype")),
            ("layout", d.get("layout")),
            ("object layout", d.get("object_layout")),
            ("parallel", layout or None),
            ("tokens/block", ", ".join(str(t) for t in d.get("tokens_per_block") or []) or None),
            ("layers", d.get("layers")),
        ):
            out.line(f"{label:<14}{_cell(value)}")
    out.line(f"{'block bytes':<14}{human_bytes(ns['object_bytes'])} (slot {human_bytes(ns['slot_bytes'])})")
    rows = [
        [
            tier.upper() if tier == "dram" else "NVMe",
            _cell(t["blocks"]),
            human_bytes(t["used_bytes"]),
            human_bytes(t["capacity_bytes"]),
        ]
        for tier, t in ns["tiers"].items()
    ]
    out.table("tiers", ["tier", "blocks", "used", "capacity"], rows)
    out.line()
    before = " (or earlier: recovered from disk at open)"
    out.line(f"blocks        {_cell(ns['blocks'])}")
    out.line(f"oldest block  {_cell(ns['oldest_block'])}{before if ns['oldest_block_before_open'] else ''}")
    out.line(f"newest block  {_cell(ns['newest_block'])}{before if ns['newest_block_before_open'] else ''}")
    hits = ns["hits"]
    if any(v is not None for v in hits.values()):
        out.line(
            "hits          "
            + ", ".join(f"{k.replace('_hits', '')} {_cell(v)}" for k, v in hits.items() if k != "misses")
            + f"; misses {_cell(hits['misses'])}; checksum failures {_cell(ns['checksum_failures'])}"
        )


def print_verify(report: dict[str, Any], plain: bool) -> None:
    out = Output(plain=plain)
    out.line(f"kvtier verify {' '.join(report['paths'])}")
    out.line(_service_line(report))
    rows = [
        [
            r["digest"][:16],
            _cell(r["model"]),
            r["source"],
            str(r["checked_dram"]),
            str(r["checked_nvme"]),
            str(r["checked_shared"]),
            str(r["bad_blocks"]),
            human_bytes(r["bytes_read"]),
            f"{r['seconds']:.1f} s",
        ]
        for r in report["namespaces"]
    ]
    out.table(
        f"{len(rows)} namespace(s) checked",
        ["namespace", "model", "from", "DRAM", "NVMe", "shared", "bad", "read", "time"],
        rows,
        right=3,
    )
    for r in report["namespaces"]:
        for bad in r["bad"]:
            state = "quarantined" if bad["quarantined"] else "changed under the scrub: nothing to quarantine"
            out.line(f"bad: {r['digest'][:16]} block {bad['key'][:16]}… {bad['tier']}: {bad['reason']} ({state})")
    for skipped in report["skipped"]:
        out.line(f"skipped {skipped['digest'][:16]}: {skipped['reason']}")
    out.line()
    if report["ok"]:
        out.line(f"ok: {report['checked_copies']} copies checked, none bad")
    else:
        out.line(
            f"BAD: {report['bad_blocks']} bad block copies found and quarantined (loads miss them; engines "
            "recompute): check the disk (dmesg, smartctl) and the DRAM pool's host"
        )


def print_trim(report: dict[str, Any], plain: bool) -> None:
    out = Output(plain=plain)
    out.line(f"kvtier trim {' '.join(report['paths'])} ({report['mode']}={report['value']})")
    out.line(_service_line(report))
    rows = [
        [
            r["digest"][:16],
            _cell(r["model"]),
            r["source"],
            str(r["dram_blocks"]),
            str(r["nvme_blocks"]),
            str(r["regions_freed"]),
            human_bytes(r["nvme_bytes"]),
            str(r["skipped_in_use"]),
        ]
        for r in report["namespaces"]
    ]
    out.table(
        f"{len(rows)} namespace(s)",
        ["namespace", "model", "from", "DRAM blocks", "NVMe blocks", "regions", "NVMe freed", "in use (kept)"],
        rows,
        right=3,
    )
    for skipped in report["skipped"]:
        out.line(f"skipped {skipped['digest'][:16]}: {skipped['reason']}")
    out.line()
    out.line(
        f"removed {report['removed_blocks']} block copies, freed {human_bytes(report['freed_nvme_bytes'])} of NVMe"
    )
