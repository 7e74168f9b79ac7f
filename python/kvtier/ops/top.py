"""``kvtier top``: a live terminal view of the running host service (rich).

Every interval it reads the service's per-namespace values (the ``Namespaces`` op) and shows rates
over the last interval: hit rate per tier, GB/s stored and loaded, NVMe reads and writes, queue
depths, drops, load latency, the busiest namespaces, and per engine (the label each engine gives its
connections) its lookups, hit rate and the slices its ranks moved. ``q`` or Ctrl-C quits.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvtier.ops.metrics import ENGINE_FALLBACKS, HIT_TIERS, LATENCY_BUCKETS_US, TIERS, ServiceSnapshot, model_of
from kvtier.ops.report import OpsError, human_bytes, socket_of
from kvtier.tiers import label as tier_label


def _quantile(before: dict[str, int], after: dict[str, int], op: str, q: float) -> float | None:
    """The q-quantile (ms) of an op's latency over the interval, from the histogram's buckets."""
    total = after.get(f"latency_{op}_count", 0) - before.get(f"latency_{op}_count", 0)
    if total <= 0:
        return None
    for le in LATENCY_BUCKETS_US:
        key = f"latency_{op}_le_{le}"
        if after.get(key, 0) - before.get(key, 0) >= q * total:
            return le / 1000
    return float("inf")


def _rate(value: float) -> str:
    return f"{value / 1e9:.2f}GB/s" if value >= 1e8 else f"{value / 1e6:.1f}MB/s"


def _pct(part: float, whole: float) -> str:
    return "-" if whole <= 0 else f"{100 * part / whole:.1f}%"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return ">1000" if value == float("inf") else f"{value:g}"


def frame(
    socket: Path,
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
    stats: dict[str, int],
    seconds: float,
) -> Any:
    """One screen: rich renderables (a Group)."""
    from rich.console import Group

    old = {ns["digest"]: dict(ns["values"]) for ns in before}
    rows = []
    sums: dict[str, float] = {}
    for ns in after:
        summed, row = _namespace_interval(ns, old.get(ns["digest"], {}), seconds)
        for key, value in summed:
            sums[key] = sums.get(key, 0) + value
        rows.append(row)
    return Group(
        _header(socket, stats, seconds),
        _tiers_table(sums, seconds),
        _flow_table(sums),
        _namespaces_table(rows),
        _engines_table(before, after, seconds),
    )


def _namespace_interval(
    ns: dict[str, Any], was: dict[str, int], seconds: float
) -> tuple[list[tuple[str, float]], tuple[float, list[str]]]:
    """One namespace over the interval: what it adds to the sums of all namespaces, and its row of
    the top namespaces with the bytes per second it moved (the busiest come first)."""
    v = dict(ns["values"])

    def delta(name: str) -> float:
        return float(v.get(name, 0) - was.get(name, 0))

    object_bytes = int(ns["object_bytes"])
    hits = {t: delta(f"{t}_hits") for t in HIT_TIERS}
    lookups = sum(hits.values()) + delta("misses")
    loaded = sum(hits.values()) * object_bytes / seconds
    stored = delta("puts") * object_bytes / seconds
    summed = [
        *((f"hits_{t}", hits[t]) for t in HIT_TIERS),
        ("lookups", lookups),
        ("loaded", loaded),
        ("stored", stored),
        ("nvme_read", delta("bytes_read_nvme") / seconds),
        ("nvme_written", delta("bytes_written_nvme") / seconds),
        ("dropped", delta("dropped_stores")),
        ("nvme_dropped", delta("nvme_dropped_writes")),
        ("pending_fills", v.get("service_pending_fills", 0)),
        ("backlog", v.get("nvme_write_backlog_bytes", 0)),
        ("checksum_failures", v.get("checksum_failures", 0)),
        *((f"used_{t}", v.get(f"{t}_used_bytes", 0)) for t in TIERS),
        *((f"capacity_{t}", v.get(f"{t}_capacity_bytes", 0)) for t in TIERS),
    ]
    row = [
        str(ns["digest"])[:16],
        model_of(bytes(ns["description"]))[:32],
        f"{lookups / seconds:.0f}",
        _pct(sum(hits.values()), lookups),
        _rate(loaded),
        _rate(stored),
        _ms(_quantile(was, v, "load", 0.5)),
        _ms(_quantile(was, v, "load", 0.99)),
        str(v.get("service_attached_connections", 0)),
    ]
    return summed, (loaded + stored, row)


def _header(socket: Path, stats: dict[str, int], seconds: float) -> Any:
    from rich.text import Text

    return Text(
        f"kvtier top  {socket}  {time.strftime('%H:%M:%S')}  every {seconds:.1f} s  "
        f"connections {stats.get('service_connections', 0)}  namespaces {stats.get('service_namespaces', 0)}"
        "   (q quits)",
        style="bold",
    )


def _tiers_table(sums: dict[str, float], seconds: float) -> Any:
    """Hit rate and hits per second of each tier, with what it holds (all namespaces together)."""
    from rich import box
    from rich.table import Table

    tiers = Table(title="tiers (last interval)", title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("tier", "hit rate", "hits/s", "used", "capacity"):
        tiers.add_column(name, justify="left" if name == "tier" else "right")
    lookups = sums.get("lookups", 0)
    for t in HIT_TIERS:
        capacity = sums.get(f"capacity_{t}", 0)
        tiers.add_row(
            tier_label(t),
            _pct(sums.get(f"hits_{t}", 0), lookups),
            f"{sums.get(f'hits_{t}', 0) / seconds:.0f}",
            human_bytes(int(sums.get(f"used_{t}", 0))) if capacity else "-",
            human_bytes(int(capacity)) if capacity else "-",
        )
    all_hits = sum(sums.get(f"hits_{t}", 0) for t in HIT_TIERS)
    tiers.add_row("all", _pct(all_hits, lookups), f"{all_hits / seconds:.0f}", "", "")
    return tiers


def _flow_table(sums: dict[str, float]) -> Any:
    """Bytes per second in and out, and what waits or was dropped (all namespaces together)."""
    from rich import box
    from rich.table import Table

    flow = Table(title="throughput and queues", title_justify="left", box=box.SIMPLE_HEAD)
    for name in (
        "stored (in)",
        "loaded (out)",
        "NVMe write",
        "NVMe read",
        "pending fills",
        "NVMe backlog",
        "drops",
        "checksum fails",
    ):
        flow.add_column(name, justify="right", no_wrap=True)
    flow.add_row(
        _rate(sums.get("stored", 0)),
        _rate(sums.get("loaded", 0)),
        _rate(sums.get("nvme_written", 0)),
        _rate(sums.get("nvme_read", 0)),
        f"{sums.get('pending_fills', 0):.0f}",
        human_bytes(int(sums.get("backlog", 0))),
        f"{sums.get('dropped', 0) + sums.get('nvme_dropped', 0):.0f}",
        f"{sums.get('checksum_failures', 0):.0f}",
    )
    return flow


def _namespaces_table(rows: list[tuple[float, list[str]]]) -> Any:
    """The ten busiest namespaces (rows of ``_namespace_interval``)."""
    from rich import box
    from rich.table import Table

    top = Table(title="top namespaces", title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("namespace", "model", "lookups/s", "hit rate", "out", "in", "load p50 ms", "load p99 ms", "conns"):
        top.add_column(name, justify="left" if name in ("namespace", "model") else "right", no_wrap=True)
    for _, row in sorted(rows, key=lambda r: -r[0])[:10]:
        top.add_row(*row)
    if not rows:
        top.add_row("(no namespace open: no engine has attached yet)", "", "", "", "", "", "", "", "")
    return top


def _engines_table(before: list[dict[str, Any]], after: list[dict[str, Any]], seconds: float) -> Any:
    """Per engine and namespace over the interval, busiest first (idle engines too, at the end)."""
    from rich import box
    from rich.table import Table

    old = {(ns["digest"], label): counts for ns in before for label, counts in ns.get("engines", [])}
    rows = []
    for ns in after:
        for label, counts in ns.get("engines", []):
            was = old.get((ns["digest"], label), {})

            def delta(name: str, now: dict[str, int] = counts, was: dict[str, int] = was) -> float:
                return float(now.get(name, 0) - was.get(name, 0))

            hits = sum(delta(f"lookup_{t}") for t in HIT_TIERS)
            lookups = hits + delta("lookup_miss")
            moved = delta("loaded_slices") + delta("stored_slices")
            # what the engine served at recompute because the service did not answer (reported late)
            fallbacks = sum(delta(name) for name in ENGINE_FALLBACKS)
            rows.append(
                (
                    lookups + moved,
                    [
                        label[:40],
                        str(ns["digest"])[:16],
                        f"{lookups / seconds:.0f}",
                        _pct(hits, lookups),
                        f"{delta('loaded_slices') / seconds:.0f}",
                        f"{delta('load_missed_slices') / seconds:.0f}",
                        f"{delta('stored_slices') / seconds:.0f}",
                        f"{delta('dropped_slices') / seconds:.0f}",
                        f"{fallbacks:.0f}",
                    ],
                )
            )
    table = Table(title="engines", title_justify="left", box=box.SIMPLE_HEAD)
    columns = (
        "engine", "namespace", "lookups/s", "hit rate", "loads/s", "load misses/s", "stores/s", "drops/s", "fallbacks",
    )  # fmt: skip
    for name in columns:
        table.add_column(name, justify="left" if name in ("engine", "namespace") else "right", no_wrap=True)
    for _, row in sorted(rows, key=lambda r: -r[0])[:10]:
        table.add_row(*row)
    if not rows:
        table.add_row("(no engine has named itself: engine_label, docs/vllm.md)", *[""] * (len(columns) - 1))
    return table


@contextlib.contextmanager
def _keys() -> Iterator[Any]:
    """Yields a function returning pressed keys (non-blocking); cbreak mode on a terminal."""
    if not sys.stdin.isatty():

        def wait(timeout: float) -> str:
            time.sleep(timeout)
            return ""

        yield wait
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def read(timeout: float) -> str:
        ready, _, _ = select.select([fd], [], [], timeout)
        return os.read(fd, 16).decode(errors="ignore") if ready else ""

    try:
        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run(paths: Sequence[Path], socket_option: str | os.PathLike | None, interval: float, once: bool) -> None:
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        raise OpsError("kvtier top needs rich: pip install rich (or 'kvtier[ops]')") from None
    socket = socket_of(paths, socket_option)
    snapshot = ServiceSnapshot(socket)
    try:
        before, _ = snapshot.read()
    except Exception as error:
        raise OpsError(
            f"no service answers on {socket} ({error}): kvtier top shows a running service; start one with "
            "`kvtier serve PATH` (engines start it themselves), or give its --socket"
        ) from None
    taken = time.monotonic()
    console = Console(width=None if sys.stdout.isatty() else 160)  # a pipe: whole tables, not 80 columns
    if once:
        time.sleep(interval)
        after, stats = snapshot.read()
        console.print(frame(socket, before, after, stats, max(time.monotonic() - taken, 1e-3)))
        return
    with _keys() as keys, Live(console=console, auto_refresh=False, screen=False) as live:
        while True:
            pressed = keys(interval)
            if "q" in pressed.lower():
                return
            try:
                after, stats = snapshot.read()
            except Exception as error:
                raise OpsError(f"the service on {socket} stopped answering ({error})") from None
            now = time.monotonic()
            live.update(frame(socket, before, after, stats, max(now - taken, 1e-3)), refresh=True)
            before, taken = after, now
