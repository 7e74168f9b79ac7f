"""The plot of ``kvtier bench faults`` (issue 36: "table and plot"): each request's TTFT over the run,
per fault row, against vLLM alone's, with the fault's window and the return of kvtier's hits.

The table gives a row's TTFT percentiles and failed requests; the plot shows *when* they happened: which
requests the fault slowed or failed, and whether TTFT came back to vLLM alone's once the hits did. One
panel per fault row (a shared, logarithmic TTFT axis): the row's requests as points, its failed ones as
red crosses (at their TTFT when they had a first token, else at the panel's foot), every run of vLLM
alone in grey behind them, the fault shaded (a kill, over at once, a line), a dashed line where the hits
came back. Times are seconds since the row's first request.

Both clocks are CLOCK_MONOTONIC on Linux: ``vllm bench serve``'s per-request ``start_times`` (its bench
JSON, ``--save-detailed``) are ``time.perf_counter()``, and the fault's ``started_at`` and ``ended_at``
(``faults.inject``) are ``time.monotonic()``. Results from before those were recorded place the fault
``started_after_load_s`` after the first request, lasting ``seconds``: the server sees the first request
within a poll (0.2 s) of its start.

Run ``python -m kvtier.bench.faults_plot RESULTS_DIR [--out PNG]`` to redraw a finished run (default
``RESULTS_DIR/faults.png``); ``kvtier bench faults`` writes it at its end.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INSTANT_FAULTS = ("service-kill",)  # over at once: the return is timed from the kill itself
CLOCK_SLACK_S = 30.0  # the server sees the first request this soon after it was sent, or the clocks differ
PLOT_NAME = "faults.png"
COLUMNS = 3  # panels per line of the figure
KILL_WINDOW_S = 20.0  # "during" a kill whose hits never came back: this long after it


@dataclass
class RowSeries:
    """One row's requests on the row's own timeline (seconds since its first request started).

    ``ttft_ms`` is None for a request that never had a first token (failed before it). ``window``: the
    fault's start and end (equal for a kill), None when no fault was injected; ``approximate`` when it
    comes from ``started_after_load_s`` and ``seconds`` (results without ``started_at``), or when the
    recorded times did not fit the requests'. ``hits_again_at``: when kvtier served a hit again."""

    row: str
    offsets_s: list[float]
    ttft_ms: list[float | None]
    failed: list[bool]
    window: tuple[float, float] | None = None
    approximate: bool = False
    hits_again_at: float | None = None
    ttft_p99_ms: float | None = None


def reference_rows(document: dict[str, Any]) -> list[str]:
    """The runs of vLLM alone: the rows not among the plan's faults (``faults.is_reference``'s ``vllm``,
    ``vllm-2``, ...), read from the document so that this module need not import ``faults``, which
    imports it."""
    faulted = set(document.get("settings", {}).get("faults", []))
    return [record["row"] for record in document.get("rows", []) if record["row"] not in faulted]


def fault_window(fault: dict[str, Any], first_start: float) -> tuple[tuple[float, float] | None, bool]:
    """The fault's (start, end) in seconds since the first request, and whether it is approximate.

    From ``started_at``/``ended_at`` when the load's start (``load_seen_at``) fits the first request's
    (the same clock); else from ``started_after_load_s`` after the first request, ``seconds`` long (a
    kill: no length). None when the fault never started (the load ended first)."""
    seen = fault.get("load_seen_at")
    exact = "started_at" in fault and "ended_at" in fault
    if exact and (seen is None or -1.0 <= seen - first_start <= CLOCK_SLACK_S):
        return (fault["started_at"] - first_start, fault["ended_at"] - first_start), False
    if fault.get("started_after_load_s") is None:
        return None, False
    start = float(fault["started_after_load_s"])
    length = 0.0 if fault.get("kind") in INSTANT_FAULTS else float(fault.get("seconds") or 0.0)
    return (start, start + length), True


def row_series(record: dict[str, Any], bench: dict[str, Any]) -> RowSeries | None:
    """One row's series from its results record and its bench JSON (``start_times``, ``ttfts``,
    ``errors``: one entry per request, in the order sent); None without per-request times."""
    starts = bench.get("start_times") or []
    if not starts:
        return None
    ttfts = bench.get("ttfts") or [0.0] * len(starts)
    errors = bench.get("errors") or [""] * len(starts)
    first = min(starts)
    series = RowSeries(
        row=record["row"],
        offsets_s=[start - first for start in starts],
        ttft_ms=[ttft * 1000.0 if ttft and ttft > 0 else None for ttft in ttfts],
        failed=[bool(error) for error in errors],
        ttft_p99_ms=(record.get("ttft_ms") or {}).get("p99"),
    )
    fault = record.get("fault") or {}
    series.window, series.approximate = fault_window(fault, first) if fault else (None, False)
    if series.window is not None and fault.get("hits_again_s") is not None:
        series.hits_again_at = series.window[1] + float(fault["hits_again_s"])
    return series


def bench_json(record: dict[str, Any], results_dir: Path) -> dict[str, Any] | None:
    """The row's bench JSON: at its ``result_file``, or where ``faults.run_load`` puts it under
    ``results_dir`` (a run's directory copied or moved since); None when neither exists."""
    row = record["row"]
    for path in (record.get("result_file"), results_dir / row / "bench" / f"{row}.json"):
        if path is not None and Path(path).is_file():
            loaded: dict[str, Any] = json.loads(Path(path).read_text())
            return loaded
    return None


def series_of(document: dict[str, Any], results_dir: Path) -> list[RowSeries]:
    """Every measured row's series, in the document's order (rows without a bench JSON left out)."""
    found = []
    for record in document.get("rows", []):
        bench = bench_json(record, results_dir)
        series = row_series(record, bench) if bench is not None else None
        if series is not None:
            found.append(series)
    return found


def worst_in_window_ms(series: RowSeries, window: tuple[float, float]) -> tuple[float | None, int]:
    """The worst TTFT among the requests that started in ``window`` that had a first token, and how
    many of them failed."""
    inside = [i for i, at in enumerate(series.offsets_s) if window[0] <= at <= window[1]]
    ttfts = [series.ttft_ms[i] for i in inside if not series.failed[i]]
    worst = max((ttft for ttft in ttfts if ttft is not None), default=None)
    return worst, sum(series.failed[i] for i in inside)


def worst_excess_ms(
    series: RowSeries, reference: RowSeries | None, window: tuple[float, float]
) -> tuple[float | None, float | None]:
    """The most a request that started in ``window`` took over vLLM alone's TTFT of the same request,
    and when it started. Every row sends the same prompts in the same order at the same arrivals, so
    the i-th request of each is the same one; the worst TTFT of each row in the window may be two
    different requests (at capacity vLLM alone's slowest can hide the one the fault delayed). None
    without a reference of as many requests."""
    if reference is None or len(reference.ttft_ms) != len(series.ttft_ms):
        return None, None
    excess: tuple[float, float] | None = None
    for index, at in enumerate(series.offsets_s):
        mine, alone = series.ttft_ms[index], reference.ttft_ms[index]
        if not window[0] <= at <= window[1] or series.failed[index] or mine is None or alone is None:
            continue
        if excess is None or mine - alone > excess[0]:
            excess = (mine - alone, at)
    return excess if excess is not None else (None, None)


def note_in_fault_ttfts(document: dict[str, Any], results_dir: Path) -> None:
    """Sets each fault row's ``in_fault_ttft_ms``: the worst TTFT among its requests that started
    during the fault (and how many of them failed), and vLLM alone's among its own that started in the
    same window of its run (both in seconds since the first request), what issue 36 holds a fault to
    (vLLM alone's plus one deadline). A kill's window lasts until the hits came back, or
    ``KILL_WINDOW_S``."""
    found = {series.row: series for series in series_of(document, results_dir)}
    references = reference_rows(document)
    reference = found.get(references[0]) if references else None
    for record in document.get("rows", []):
        series = found.get(record["row"])
        if series is None or series.window is None or series.row in references:
            continue
        start, end = series.window
        if end <= start:
            end = series.hits_again_at if series.hits_again_at is not None else start + KILL_WINDOW_S
        worst, failed = worst_in_window_ms(series, (start, end))
        alone = worst_in_window_ms(reference, (start, end))[0] if reference is not None else None
        excess, excess_at = worst_excess_ms(series, reference, (start, end))
        record["in_fault_ttft_ms"] = {
            "kvtier": worst, "failed": failed, "vllm_alone": alone, "excess": excess, "excess_at_s": excess_at,
        }  # fmt: skip


def in_fault_cell(record: dict[str, Any]) -> str:
    """The table's cell of ``in_fault_ttft_ms``: "kvtier's (vLLM alone's)" in ms, failed requests, and
    the most a request took over vLLM alone's same request, with when it started ("+4420 at 40 s")."""
    worst = record.get("in_fault_ttft_ms")
    if not worst:
        return "-"
    kvtier, alone = (_ms(worst.get(name)).removesuffix(" ms") for name in ("kvtier", "vllm_alone"))
    failed = f", {worst['failed']} failed" if worst.get("failed") else ""
    excess = worst.get("excess")  # results from before it lack it
    over = "" if excess is None else f"; {excess:+.0f} at {worst['excess_at_s']:.0f} s"
    return f"{kvtier} ({alone}){failed}{over}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _values(ttfts: list[float | None]) -> list[float]:
    return [math.nan if ttft is None else ttft for ttft in ttfts]


def draw_requests(axis: Any, series: RowSeries, references: list[RowSeries]) -> None:
    """vLLM alone's requests in grey (every run), the row's in blue, its failed ones as red crosses: at
    their TTFT when they had a first token, else at the panel's foot (no TTFT to place them by)."""
    for index, reference in enumerate(references):
        label = "vLLM alone" if index == 0 else None
        axis.scatter(
            reference.offsets_s, _values(reference.ttft_ms), s=45, facecolors="none", edgecolors="0.55", label=label
        )  # hollow: the row's points show through where they match
    rows = list(zip(series.offsets_s, series.ttft_ms, series.failed, strict=False))
    good = [(x, t) for x, t, bad in rows if not bad]
    axis.scatter([x for x, _ in good], _values([t for _, t in good]), s=22, color="tab:blue", label="kvtier")
    timed = [(x, t) for x, t, bad in rows if bad and t is not None]
    untimed = [x for x, t, bad in rows if bad and t is None]
    if timed:
        axis.scatter([x for x, _ in timed], [t for _, t in timed], marker="x", s=40, color="red", label="failed")
    if untimed:
        foot = axis.get_xaxis_transform()  # x in seconds, y in the panel's height
        label = "failed, no first token"
        axis.scatter(untimed, [0.03] * len(untimed), marker="x", s=40, color="red", transform=foot, label=label)


def draw_fault(axis: Any, series: RowSeries) -> None:
    """The fault shaded (a kill, over at once: a line), and a dashed line where kvtier's hits came back."""
    if series.window is not None:
        start, end = series.window
        label = "fault (approx.)" if series.approximate else "fault"
        if end > start:
            axis.axvspan(start, end, color="tab:orange", alpha=0.2, label=label)
        else:
            axis.axvline(start, color="tab:orange", linewidth=2, label=label)
    if series.hits_again_at is not None:
        axis.axvline(series.hits_again_at, color="tab:green", linestyle="--", label="hits again")


def label_panel(axis: Any, series: RowSeries, baseline_p99_ms: float | None, first_column: bool) -> None:
    """The panel's title (the row's TTFT p99 against vLLM alone's: the table's figures), log TTFT axis, legend."""
    axis.set_title(f"{series.row}: TTFT p99 {_ms(series.ttft_p99_ms)} (vLLM alone {_ms(baseline_p99_ms)})", fontsize=9)
    axis.set_yscale("log")
    axis.set_xlabel("s since the row's first request")
    axis.tick_params(labelbottom=True)  # shared x hides them above another panel, and a last line may be short
    if first_column:
        axis.set_ylabel("TTFT (ms)")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=7, loc="best")


def draw(series: list[RowSeries], references: list[RowSeries], settings: dict[str, Any], path: Path) -> None:
    """The figure: one panel per fault row (shared log TTFT axis), titled with the row's TTFT p99 against
    vLLM alone's; saved as a PNG at ``path``. matplotlib is imported here, so importing this module is cheap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(COLUMNS, len(series))
    lines = math.ceil(len(series) / columns)
    figure, axes = plt.subplots(
        lines, columns, figsize=(5 * columns, 3.8 * lines), sharex=True, sharey=True, squeeze=False
    )
    baseline = references[0].ttft_p99_ms if references else None
    for index, axis in enumerate(axes.flat):
        if index < len(series):
            draw_requests(axis, series[index], references)
            draw_fault(axis, series[index])
            label_panel(axis, series[index], baseline, index % columns == 0)
        else:
            axis.set_visible(False)
    if any(failed and ttft is None for row in series for failed, ttft in zip(row.failed, row.ttft_ms, strict=False)):
        low, high = axes.flat[0].get_ylim()  # shared: room at every panel's foot for the failed without a TTFT
        axes.flat[0].set_ylim(low / 3, high)
    figure.suptitle(
        f"kvtier bench faults: {settings.get('preset')}, {settings.get('users')} users x "
        f"{settings.get('requests_per_user')} requests at {settings.get('request_rate', 0):.2f} req/s, "
        f"faults of {settings.get('fault_s', 0):g} s",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_plot(document: dict[str, Any], results_dir: Path, path: Path) -> str | None:
    """Draws the run's plot at ``path``: None when written, else why not (no fault row measured,
    matplotlib missing)."""
    names = reference_rows(document)
    every = series_of(document, results_dir)
    references = [series for series in every if series.row in names]
    faulted = [series for series in every if series.row not in names]
    if not faulted:
        return "no fault row has per-request times (bench JSON with start_times); no plot written"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed (pip install 'kvtier[bench]'); no plot written"
    draw(faulted, references, document.get("settings", {}), path)
    return None


def plot_run(document: dict[str, Any], out_dir: Path) -> str | None:
    """``kvtier bench faults``'s last step: ``out_dir/faults.png``, its name when written. A plot that
    cannot be drawn prints a warning: it never fails the benchmark, whose results are already written."""
    try:
        why_not = write_plot(document, out_dir, out_dir / PLOT_NAME)
    except Exception as error:  # a plotting bug must not cost the run
        why_not = f"{type(error).__name__}: {error}"
    if why_not:
        print(f"kvtier bench faults: warning: no {PLOT_NAME}: {why_not}", file=sys.stderr)
        return None
    return PLOT_NAME


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.bench.faults_plot", description="Redraws the plot of a kvtier bench faults run."
    )
    parser.add_argument("results_dir", help="the run's --out directory (its results.json)")
    parser.add_argument("--out", help=f"the PNG to write (default RESULTS_DIR/{PLOT_NAME})")
    args = parser.parse_args(argv)
    results_dir = Path(args.results_dir)
    try:
        document = json.loads((results_dir / "results.json").read_text())
    except (OSError, ValueError) as error:
        print(f"faults_plot: cannot read {results_dir / 'results.json'}: {error}", file=sys.stderr)
        return 2
    path = Path(args.out) if args.out else results_dir / PLOT_NAME
    why_not = write_plot(document, results_dir, path)
    if why_not:
        print(f"faults_plot: {why_not}", file=sys.stderr)
        return 1
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
