"""`kvtier bench serve-summary`: several `kvtier bench serve` runs in one table, one plot and the
issue's targets checked on them.

Runs are grouped by their load: the concurrency of closed-loop runs, the request rate (and cap) of
``--workload mixed`` runs (``load_key``); runs under one load are repeats (other dataset seeds) and each
point reports the median with min and max. The targets (issue 23) are checked on the medians:

- at every number of users, each kvtier row's request throughput is at least vLLM alone's, and its
  TTFT p99 at most vLLM alone's;
- no collapse: up to the users whose prefixes kvtier's tiers hold (``capacity_users``: the row's
  DRAM + NVMe over one prefix's KV bytes), each kvtier row's throughput stays at least 0.9x its
  throughput at the smallest number of users (where every prompt fits vLLM's own cache).

Writes ``summary.md``, ``summary.json`` and ``summary.png`` into ``--out``; exits 1 when a target is
missed (the table says which), so a script can assert it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

NO_COLLAPSE_RATIO = 0.9


class SummaryError(ValueError):
    """An input that is not a `kvtier bench serve` run."""


BASELINE_ROW = "vllm"


def load_runs(paths: list[Path]) -> list[dict[str, Any]]:
    runs = []
    for path in paths:
        results = path / "results.json" if path.is_dir() else path
        try:
            document = json.loads(results.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise SummaryError(
                f"{results} is not the results.json of a `kvtier bench serve` run ({error}); "
                "give its output directory (--out) or its results.json"
            ) from error
        if not isinstance(document, dict) or "rows" not in document or "settings" not in document:
            raise SummaryError(f"{results} is JSON but not the results of a `kvtier bench serve` run")
        document["source"] = str(results)
        runs.append(document)
    return runs


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def load_key(settings: dict[str, Any]) -> int | str:
    """A run's load: its concurrency (closed loop, the key earlier runs had), or its request rate as
    text (open loop, ``--workload mixed``; with its cap on requests in flight, if any)."""
    rate = settings.get("request_rate")
    if not rate:
        return int(settings["concurrency"])
    burstiness = settings.get("burstiness") or 1.0
    text = f"{rate:g} req/s" + ("" if burstiness == 1.0 else f" burstiness {burstiness:g}")
    text += f", {settings['output_len']} out" if settings.get("output_len") else ""
    return text + (f", concurrency {settings['concurrency']}" if settings.get("concurrency") else "")


def load_heading(key: int | str) -> str:
    return f"Concurrency {key}" if isinstance(key, int) else f"Request rate {key}"


def load_order(item: tuple[int | str, Any]) -> tuple[int, int, str]:
    """Closed-loop loads first, by concurrency; then the rates (sorted() cannot compare int and str)."""
    key = item[0]
    return (0, key, "") if isinstance(key, int) else (1, 0, key)


def row_key(run: dict[str, Any], record: dict[str, Any]) -> tuple[str, str]:
    """A row's key and label: runs with vLLM's KV-event publisher on (``--kv-events``) are rows of
    their own, so that the cost of the events shows beside the same row without them."""
    if run["settings"].get("kv_events"):
        return f"{record['row']}+events", f"{record['label']}, KV events"
    return record["row"], record["label"]


def group_points(runs: list[dict[str, Any]]) -> dict[int | str, dict[str, dict[int, dict[str, Any]]]]:
    """load -> row -> users -> median/min/max of throughput and TTFT p99 over the runs."""
    grouped: dict[int | str, dict[str, dict[int, dict[str, list[float]]]]] = {}
    labels: dict[str, str] = {}
    for run in runs:
        concurrency = load_key(run["settings"])
        for record in run["rows"]:
            row, labels[row] = row_key(run, record)
            for point in record["points"]:
                if point.get("request_throughput") is None or point["ttft_ms"].get("p99") is None:
                    continue
                by_users = grouped.setdefault(concurrency, {}).setdefault(row, {})
                values = by_users.setdefault(point["users"], {"req_s": [], "ttft_p99_ms": []})
                values["req_s"].append(point["request_throughput"])
                values["ttft_p99_ms"].append(point["ttft_ms"]["p99"])
                tpot_p99 = (point.get("tpot_ms") or {}).get("p99")
                if tpot_p99 is not None:  # runs before TPOT was recorded have none
                    values.setdefault("tpot_p99_ms", []).append(tpot_p99)
    return {
        concurrency: {
            row: {users: {name: spread(v) for name, v in values.items()} | {"label": labels[row]}
                  for users, values in sorted(by_users.items())}
            for row, by_users in rows.items()
        }
        for concurrency, rows in grouped.items()
    }  # fmt: skip


def baseline_self_ratios(runs: list[dict[str, Any]]) -> dict[int | str, dict[int, dict[str, list[float]]]]:
    """load -> users -> the TTFT p99 and throughput of a run's last vLLM-alone row over its first, for
    runs that give that row twice (``--rows vllm,...,vllm``): the same server and load measured twice,
    this machine's noise and drift, against which a kvtier row's ratio to vLLM alone is read."""
    ratios: dict[int | str, dict[int, dict[str, list[float]]]] = {}
    for run in runs:
        baseline = [r for r in run["rows"] if r["row"] == BASELINE_ROW and not run["settings"].get("kv_events")]
        if len(baseline) < 2:
            continue
        first = {p["users"]: p for p in baseline[0]["points"] if p.get("request_throughput")}
        for point in baseline[-1]["points"]:
            earlier = first.get(point["users"])
            if earlier is None or not point.get("request_throughput"):
                continue
            values = ratios.setdefault(load_key(run["settings"]), {}).setdefault(
                point["users"], {"p99": [], "req_s": []}
            )
            values["p99"].append(point["ttft_ms"]["p99"] / earlier["ttft_ms"]["p99"])
            values["req_s"].append(point["request_throughput"] / earlier["request_throughput"])
    return ratios


def capacity_users(run: dict[str, Any], row: str) -> int | None:
    """How many users' prefixes the row's kvtier tiers hold (None: not a kvtier row)."""
    settings = run["settings"]
    if not row.startswith("kvtier") or not settings.get("kv_bytes_per_token"):
        return None
    tier_gib = settings["dram_gib"] + (settings["nvme_gib"] if "nvme" in row or "2x" in row else 0)
    return int(tier_gib * 2**30 // (settings["prefix_len"] * settings["kv_bytes_per_token"]))


def check_targets(points: dict[str, dict[int, dict[str, Any]]], capacities: dict[str, int | None]) -> list[dict]:
    """One verdict per kvtier row and number of users, on the medians."""
    baseline = points.get(BASELINE_ROW, {})
    verdicts = []
    for row, by_users in points.items():
        if row == BASELINE_ROW or not row.startswith("kvtier") or not by_users:  # the targets are kvtier's
            continue
        first_users = min(by_users)
        first_throughput = by_users[first_users]["req_s"]["median"]
        for users, values in by_users.items():
            throughput, p99 = values["req_s"]["median"], values["ttft_p99_ms"]["median"]
            verdict: dict[str, Any] = {"row": row, "users": users}
            if users in baseline:
                verdict["throughput_vs_vllm"] = throughput / baseline[users]["req_s"]["median"]
                verdict["p99_vs_vllm"] = p99 / baseline[users]["ttft_p99_ms"]["median"]
            capacity = capacities.get(row)
            if capacity is not None and users <= capacity:
                verdict["vs_first_users"] = throughput / first_throughput
            verdict["met"] = (
                verdict.get("throughput_vs_vllm", 1.0) >= 1.0
                and verdict.get("p99_vs_vllm", 1.0) <= 1.0
                and verdict.get("vs_first_users", 1.0) >= NO_COLLAPSE_RATIO
            )
            verdicts.append(verdict)
    return verdicts


def _cell(value: dict[str, float], digits: int) -> str:
    text = f"{value['median']:.{digits}f}"
    if value["n"] > 1:
        text += f" ({value['min']:.{digits}f}-{value['max']:.{digits}f})"
    return text


def _ratio(verdict: dict[str, Any], name: str) -> str:
    return f"{verdict[name]:.2f}x" if name in verdict else "-"


def markdown(summary: dict[str, Any]) -> str:
    lines = []
    for concurrency, points in sorted(summary["points"].items(), key=load_order):
        verdicts = {(v["row"], v["users"]): v for v in summary["verdicts"][concurrency]}
        runs = summary["runs_per_concurrency"][concurrency]
        lines += [
            f"\n{load_heading(concurrency)} ({runs} runs; median, (min-max)):\n",
            "| row | users | req/s | TTFT p99 ms | TPOT p99 ms | req/s vs vLLM | p99 vs vLLM | vs fewest users "
            "| targets |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for row, by_users in points.items():
            for users, values in by_users.items():
                verdict = verdicts.get((row, users), {})
                met = "-" if not verdict else ("met" if verdict["met"] else "**missed**")
                lines.append(
                    f"| {values['label']} | {users} | {_cell(values['req_s'], 2)} | {_cell(values['ttft_p99_ms'], 0)} "
                    f"| {_cell(values['tpot_p99_ms'], 0) if 'tpot_p99_ms' in values else '-'} "
                    f"| {_ratio(verdict, 'throughput_vs_vllm')} | {_ratio(verdict, 'p99_vs_vllm')} "
                    f"| {_ratio(verdict, 'vs_first_users')} | {met} |"
                )
        lines += _baseline_self_lines(summary["baseline_self"].get(concurrency, {}))
    return "\n".join(lines).lstrip("\n") + "\n"


def _baseline_self_lines(by_users: dict[int, dict[str, dict[str, float]]]) -> list[str]:
    """The noise reference under a load's table: vLLM alone against itself in the same runs."""
    if not by_users:
        return []
    parts = [
        f"{users} users: TTFT p99 {_cell(values['p99'], 3)}x, req/s {_cell(values['req_s'], 3)}x"
        for users, values in sorted(by_users.items())
    ]
    return [f"\nvLLM alone against itself (a run's last vLLM-alone row over its first): {'; '.join(parts)}."]


def write_plot(summary: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'kvtier[bench]'); no plot written"
    figure, (throughput_axis, ttft_axis) = plt.subplots(1, 2, figsize=(11, 4.5))
    styles = ["-", "--", ":", "-."]
    colors: dict[str, str] = {}  # one color per row, one line style per concurrency
    for index, (concurrency, points) in enumerate(sorted(summary["points"].items(), key=load_order)):
        for row, by_users in points.items():
            users = list(by_users)
            label = f"{next(iter(by_users.values()))['label']}, {load_heading(concurrency).lower()}"
            color = colors.setdefault(row, f"C{len(colors)}")
            style = {"linestyle": styles[index % len(styles)], "color": color, "marker": "o"}
            for axis, name in ((throughput_axis, "req_s"), (ttft_axis, "ttft_p99_ms")):
                medians = [by_users[u][name]["median"] for u in users]
                low = [by_users[u][name]["median"] - by_users[u][name]["min"] for u in users]
                high = [by_users[u][name]["max"] - by_users[u][name]["median"] for u in users]
                axis.errorbar(users, medians, yerr=[low, high], capsize=3, label=label, **style)
    for axis, label in ((throughput_axis, "requests / s (median, min-max)"), (ttft_axis, "TTFT p99 (ms)")):
        axis.set_ylim(bottom=0)
        axis.set_xlabel("users (one system prompt each)")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(summary["title"], fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    points = group_points(runs)
    capacities = {row_key(run, record)[0]: capacity_users(run, record["row"]) for run in runs for record in run["rows"]}
    runs_per_concurrency: dict[int | str, int] = {}
    for run in runs:
        concurrency = load_key(run["settings"])
        runs_per_concurrency[concurrency] = runs_per_concurrency.get(concurrency, 0) + 1
    settings = runs[0]["settings"]
    return {
        "sources": [run["source"] for run in runs],
        "title": (
            f"kvtier bench serve: {settings['preset']}, prefix {settings['prefix_len']} + question "
            f"{settings['suffix_len']} tokens, {settings['requests_per_user']} requests per user, "
            f"{settings.get('cpu_count')} CPU cores"
        ),
        "capacity_users": capacities,
        "runs_per_concurrency": runs_per_concurrency,
        "points": points,
        "verdicts": {concurrency: check_targets(by_row, capacities) for concurrency, by_row in points.items()},
        "baseline_self": {
            concurrency: {users: {name: spread(v) for name, v in values.items()} for users, values in by_users.items()}
            for concurrency, by_users in baseline_self_ratios(runs).items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvtier bench serve-summary",
        description="Several `kvtier bench serve` runs (repeats, concurrencies) in one table and plot, with the "
        "targets checked: kvtier >= vLLM alone in throughput, <= in TTFT p99, and no collapse (>= 0.9x).",
    )
    parser.add_argument("runs", nargs="+", type=Path, help="output directories (or results.json) of bench serve")
    parser.add_argument("--out", type=Path, required=True, help="where summary.md, .json and .png go")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.runs)
    except SummaryError as error:
        print(f"kvtier bench serve-summary: {error}", file=sys.stderr)
        return 2
    summary = summarize(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown(summary)
    (args.out / "summary.md").write_text(table)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    note = write_plot(summary, args.out / "summary.png")
    print(table)
    if note:
        print(f"note: {note}")
    missed = [v for verdicts in summary["verdicts"].values() for v in verdicts if not v["met"]]
    print(f"{len(missed)} target(s) missed" if missed else "every target met", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
