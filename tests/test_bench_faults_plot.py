"""``kvtier.bench.faults_plot``: the fault matrix's plot, from a results.json and the bench JSONs its rows
point at, built here in the shape ``kvtier bench faults`` writes them (no engine).

The series: request offsets from the row's first request, TTFT in ms, failed requests apart (a failed one
with no first token has no TTFT), the fault's window from ``started_at``/``ended_at`` (a kill: a line), or
for results from before those were recorded from ``started_after_load_s`` and ``seconds``, and the return
of the hits. The PNG: written by ``write_plot``, by ``main`` (the redraw command) and by ``plot_run``,
which warns instead of failing when there is nothing to draw.

Run: ``.venv/bin/python -m pytest tests/test_bench_faults_plot.py -v``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench import faults, faults_plot, faults_tiers, serve_points

T0 = 81234.5  # CLOCK_MONOTONIC seconds at a row's first request: what vllm bench serve's start_times hold
GAPS = [0.0, 2.4, 4.8, 7.1, 9.7, 12.1, 14.4, 17.0]  # --small's arrivals (docs/benchmarks.md)
TRACEBACK = "Traceback (most recent call last):\n  ...\naiohttp.client_exceptions.ServerDisconnectedError\n"


def bench_json(ttfts: list[float], errors: list[str] | None = None, t0: float = T0) -> dict[str, Any]:
    """A bench JSON as ``vllm bench serve --save-result --save-detailed`` writes it: the summary figures
    and one entry per request in each list (a failed request: ttft 0.0, its error's traceback)."""
    errors = errors or [""] * len(ttfts)
    return {
        "date": "20261203-101500", "backend": "openai", "model_id": "tiny", "num_prompts": len(ttfts),
        "request_rate": 0.4, "burstiness": 100.0, "max_concurrency": 4, "duration": 18.2,
        "completed": sum(not error for error in errors), "failed": sum(bool(error) for error in errors),
        "total_input_tokens": 4608, "total_output_tokens": 32, "request_throughput": 0.44,
        "output_throughput": 1.76, "mean_ttft_ms": 80.0, "p50_ttft_ms": 60.0, "p99_ttft_ms": 900.0,
        "input_lens": [576] * len(ttfts), "output_lens": [0 if error else 4 for error in errors],
        "ttfts": ttfts, "itls": [[0.01] * 3 for _ in ttfts], "latencies": [t + 0.03 for t in ttfts],
        "start_times": [t0 + gap for gap in GAPS[: len(ttfts)]], "queue_times": [0.0] * len(ttfts),
        "generated_texts": ["" if error else " a b c" for error in errors], "errors": errors,
    }  # fmt: skip


def record(row: str, bench_path: Path, fault: dict[str, Any] | None, p99: float) -> dict[str, Any]:
    """A row of results.json as ``faults.run_row`` stores it (``run_load``'s figures, the fault's timeline)."""
    found: dict[str, Any] = {
        "row": row, "problems": [], "server": {"command": ["vllm", "serve"], "log": "server.log"},
        "command": ["vllm", "bench", "serve"], "log": "bench.log", "completed": 8, "failed": 0,
        "duration_s": 18.2, "request_throughput": 0.44, "output_throughput": 1.76,
        "ttft_ms": {"p50": 60.0, "p90": 300.0, "p99": p99, "mean": 80.0}, "result_file": str(bench_path),
        "outputs": [" a b c"] * 8, "request_errors": [""] * 8,
    }  # fmt: skip
    if fault is not None:
        found |= {"fault": fault, "kvtier": {"dram_hits": 3, "nvme_hits": 0, "bucket_hits": 0, "shared_hits": 0}}
    return found


def fault_of(kind: str, start: float | None, end: float | None, hits_again_s: float | None = 1.5) -> dict[str, Any]:
    """``faults.inject``'s record: ``started_at``/``ended_at`` T0-based when given, else an old result's."""
    found: dict[str, Any] = {
        "kind": kind, "seconds": 5.0, "hits_again_s": hits_again_s, "hits_before": 2, "pid": 4242,
        "started_after_load_s": 6.0, "load_running_at_end": True, "tier_reads": None, "tier_counters": None,
    }  # fmt: skip
    if start is not None and end is not None:
        found |= {"load_seen_at": T0 + 0.15, "started_at": T0 + start, "ended_at": T0 + end}
    return found


def write_run(out: Path, rows: list[tuple[str, dict[str, Any], dict[str, Any] | None]]) -> dict[str, Any]:
    """A run's directory: each row's bench JSON where ``run_load`` puts it, and results.json."""
    records = []
    for row, bench, fault in rows:
        path = out / row / "bench" / f"{row}.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(bench))
        records.append(record(row, path, fault, p99=900.0 if fault else 70.0))
    faulted = [row for row, _, fault in rows if fault is not None]
    settings = {"preset": "tiny", "users": 4, "requests_per_user": 2, "request_rate": 0.4, "fault_s": 5.0}
    document = {"benchmark": "kvtier bench faults", "settings": settings | {"faults": faulted}, "rows": records}
    (out / "results.json").write_text(json.dumps(document, indent=2))
    return document


def standard_run(out: Path) -> dict[str, Any]:
    """vLLM alone twice, service-stop (one request failed, no first token; one slowed) and service-kill."""
    fast = [0.05] * 8
    stopped = bench_json([0.05, 0.05, 0.05, 0.9, 0.0, 0.05, 0.05, 0.05], ["", "", "", "", TRACEBACK, "", "", ""])
    return write_run(out, [
        ("vllm", bench_json(fast, t0=T0 - 500.0), None),
        ("vllm-2", bench_json(fast, t0=T0 - 250.0), None),
        ("service-stop", stopped, fault_of("service-stop", 6.05, 11.05)),
        ("service-kill", bench_json(fast, t0=T0), fault_of("service-kill", 6.1, 6.1, hits_again_s=None)),
    ])  # fmt: skip


def test_series_of_a_run(tmp_path):
    document = standard_run(tmp_path)
    references = faults_plot.reference_rows(document)  # from the plan's faults: it cannot import faults
    assert references == ["vllm", "vllm-2"] == [r["row"] for r in document["rows"] if faults.is_reference(r["row"])]
    series = {s.row: s for s in faults_plot.series_of(document, tmp_path)}
    assert list(series) == ["vllm", "vllm-2", "service-stop", "service-kill"]
    stop = series["service-stop"]
    assert stop.offsets_s == pytest.approx(GAPS)
    assert stop.ttft_ms == pytest.approx([50.0, 50.0, 50.0, 900.0, None, 50.0, 50.0, 50.0])
    assert stop.failed == [False, False, False, False, True, False, False, False]
    assert stop.window == pytest.approx((6.05, 11.05)) and not stop.approximate
    assert stop.hits_again_at == pytest.approx(12.55)
    assert stop.ttft_p99_ms == 900.0
    kill = series["service-kill"]
    assert kill.window == pytest.approx((6.1, 6.1)), "a kill is over at once: a line"
    assert kill.hits_again_at is None and not any(kill.failed)
    reference = series["vllm-2"]
    assert reference.window is None and reference.offsets_s == pytest.approx(GAPS), "each row on its own timeline"


def test_the_worst_ttft_in_each_fault_against_vllm_alones_in_the_same_window(tmp_path):
    """Issue 36 holds a fault to vLLM alone's TTFT plus one deadline: each fault row's worst TTFT among
    the requests that started in the fault (and how many failed), vLLM alone's first run's
    among its requests in the same window of its own run; a kill's window lasts until the hits came
    back, or ``KILL_WINDOW_S``."""
    document = standard_run(tmp_path)
    vllm = bench_json([0.05, 0.05, 0.05, 0.3, 0.2, 0.05, 0.05, 0.05], t0=T0 - 500.0)
    (tmp_path / "vllm" / "bench" / "vllm.json").write_text(json.dumps(vllm))
    faults_plot.note_in_fault_ttfts(document, tmp_path)
    rows = {record["row"]: record for record in document["rows"]}
    assert "in_fault_ttft_ms" not in rows["vllm"] and "in_fault_ttft_ms" not in rows["vllm-2"]
    # service-stop: 6.05-11.05 s holds requests 3 (7.1 s, 900 ms) and 4 (9.7 s, failed).
    # The same requests of vLLM alone: 300 ms for request 3, so it took 600 ms more.
    assert rows["service-stop"]["in_fault_ttft_ms"] == {
        "kvtier": 900.0,
        "failed": 1,
        "vllm_alone": pytest.approx(300.0),
        "excess": pytest.approx(600.0),
        "excess_at_s": pytest.approx(7.1),
    }
    # service-kill at 6.1 s, hits never back: until 26.1 s, requests 3 to 7 (none slower than vLLM
    # alone's same request: the first one as fast, request 5, is the most).
    assert rows["service-kill"]["in_fault_ttft_ms"] == {
        "kvtier": pytest.approx(50.0), "failed": 0, "vllm_alone": pytest.approx(300.0),
        "excess": pytest.approx(0.0), "excess_at_s": pytest.approx(12.1),
    }  # fmt: skip
    table = faults.table_rows(document["rows"])
    assert [line[8] for line in table] == ["-", "-", "900 (300), 1 failed; +600 at 7 s", "50 (300); +0 at 12 s"]


def test_at_capacity_the_request_the_fault_delayed_is_held_to_the_same_request_of_vllm_alone(tmp_path):
    """stop 66's run at 0.25 req/s: vLLM alone's slowest request in the fault's window (7.2 s) was
    another than the one the fault delayed (8.4 s against 4.0 s for the same request): worst against
    worst shows +1.2 s, the same request +4.4 s."""
    document = standard_run(tmp_path)
    alone = bench_json([0.05, 0.05, 0.05, 7.2, 4.0, 0.05, 0.05, 0.05], t0=T0 - 500.0)
    stopped = bench_json([0.05, 0.05, 0.05, 3.9, 8.4, 0.05, 0.05, 0.05])
    (tmp_path / "vllm" / "bench" / "vllm.json").write_text(json.dumps(alone))
    (tmp_path / "service-stop" / "bench" / "service-stop.json").write_text(json.dumps(stopped))
    faults_plot.note_in_fault_ttfts(document, tmp_path)
    worst = {record["row"]: record for record in document["rows"]}["service-stop"]["in_fault_ttft_ms"]
    assert worst["kvtier"] == pytest.approx(8400.0) and worst["vllm_alone"] == pytest.approx(7200.0)
    assert worst["excess"] == pytest.approx(4400.0) and worst["excess_at_s"] == pytest.approx(9.7)
    assert faults_plot.in_fault_cell({"in_fault_ttft_ms": worst}) == "8400 (7200); +4400 at 10 s"


def test_old_results_place_the_fault_after_the_first_request(tmp_path):
    """Results from before started_at/ended_at: the fault ``started_after_load_s`` after the first
    request, ``seconds`` long (a kill: none); marked approximate."""
    document = write_run(tmp_path, [
        ("vllm", bench_json([0.05] * 8), None),
        ("service-stop", bench_json([0.05] * 8), fault_of("service-stop", None, None)),
        ("service-kill", bench_json([0.05] * 8), fault_of("service-kill", None, None, hits_again_s=2.0)),
    ])  # fmt: skip
    series = {s.row: s for s in faults_plot.series_of(document, tmp_path)}
    assert series["service-stop"].window == pytest.approx((6.0, 11.0)) and series["service-stop"].approximate
    assert series["service-stop"].hits_again_at == pytest.approx(12.5)
    assert series["service-kill"].window == pytest.approx((6.0, 6.0)) and series["service-kill"].approximate
    assert series["service-kill"].hits_again_at == pytest.approx(8.0)


def test_times_on_another_clock_fall_back_and_a_fault_not_injected_has_no_window():
    """A load start far from the first request's (not the same clock) is not trusted: the old fields
    place the fault. A row whose load ended before the fault has neither a window nor a return."""
    bench = bench_json([0.05] * 8)
    fault = fault_of("service-stop", 6.05, 11.05) | {"load_seen_at": T0 + 3600.0}
    series = faults_plot.row_series(record("service-stop", Path("x"), fault, 900.0), bench)
    assert series is not None and series.window == pytest.approx((6.0, 11.0)) and series.approximate
    late = {"kind": "service-stop", "seconds": 5.0, "hits_again_s": None, "load_seen_at": T0 + 0.1}
    late["note"] = "the load ended before the fault started"
    series = faults_plot.row_series(record("service-stop", Path("x"), late, 900.0), bench)
    assert series is not None and series.window is None and series.hits_again_at is None
    assert faults_plot.row_series(record("vllm", Path("x"), None, 70.0), {"completed": 8}) is None


def test_a_moved_run_finds_its_bench_json_under_its_directory(tmp_path):
    document = standard_run(tmp_path / "run")
    (tmp_path / "run").rename(tmp_path / "moved")
    assert [s.row for s in faults_plot.series_of(document, tmp_path / "moved")][-1] == "service-kill"
    assert faults_plot.series_of(document, tmp_path / "elsewhere") == []


def test_plot_is_written_and_redrawn(tmp_path, capsys):
    document = standard_run(tmp_path)
    assert faults_plot.plot_run(document, tmp_path) == "faults.png"
    png = tmp_path / "faults.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert faults_plot.main([str(tmp_path), "--out", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 10_000
    assert "again.png" in capsys.readouterr().out


def test_nothing_to_draw_warns_and_never_fails(tmp_path, capsys):
    """A run whose fault rows did not measure: plot_run warns (the benchmark goes on), main exits 1."""
    document = standard_run(tmp_path)
    for row in document["rows"][2:]:
        (tmp_path / row["row"] / "bench" / f"{row['row']}.json").unlink()
    (tmp_path / "results.json").write_text(json.dumps(document))
    assert faults_plot.plot_run(document, tmp_path) is None
    assert "warning: no faults.png" in capsys.readouterr().err
    assert faults_plot.main([str(tmp_path)]) == 1 and not (tmp_path / "faults.png").exists()
    assert faults_plot.main([str(tmp_path / "missing")]) == 2


def test_four_fault_rows_draw_on_two_lines_of_panels(tmp_path):
    """More fault rows than a line holds (the rest of the grid hidden); old and new results mixed."""
    fast = bench_json([0.05] * 8)
    document = write_run(tmp_path, [
        ("vllm", fast, None),
        ("service-stop", fast, fault_of("service-stop", 6.05, 11.05)),
        ("nvme-read-errors", fast, fault_of("nvme-read-errors", None, None)),
        ("bucket-kill", fast, fault_of("bucket-kill", 6.0, 11.0, hits_again_s=3.2)),
        ("fuse-stop", bench_json([0.05] * 7 + [0.0], [""] * 7 + [TRACEBACK]), fault_of("fuse-stop", 6.0, 11.0)),
    ])  # fmt: skip
    assert faults_plot.write_plot(document, tmp_path, tmp_path / "four.png") is None
    assert (tmp_path / "four.png").stat().st_size > 10_000


def test_inject_times_the_fault_on_the_requests_clock(tmp_path, monkeypatch):
    """``faults.inject`` (stand-ins for the server's metrics and the service) records the load's start and
    the fault's on ``time.monotonic()``; requests timed with ``time.perf_counter()``, as vllm bench serve
    times them, place the window where the fault was: the same clock (CLOCK_MONOTONIC on Linux)."""
    queried = iter(range(1000))
    monkeypatch.setattr(serve_points, "cache_metrics", lambda urls: {"vllm_queried": float(next(queried))})
    monkeypatch.setattr(faults_tiers, "service_counters", lambda socket: None)
    monkeypatch.setattr(faults_tiers, "READS_SETTLE_S", 0.0)
    monkeypatch.setattr("kvtier.service.running_service", lambda socket: (4242, 0))
    hits = iter(range(1000))
    monkeypatch.setattr(faults, "service_now", lambda socket: (4242, {"dram_hits": next(hits), "nvme_hits": 0}))
    monkeypatch.setattr(faults, "POLL_S", 0.0)
    fault = faults.Fault("nvme-read-errors", tmp_path / "socket", tmp_path / "fail-reads")
    plan = {"fault_s": 0.5, "fault_after_s": 0.3}
    client = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    first_request = time.perf_counter()  # as vllm bench serve's start_times
    try:
        found: dict = {}
        faults.inject(fault, plan, "http://127.0.0.1:1", client, found)
    finally:
        client.kill()
        client.wait()
    info = found["fault"]
    assert info["load_seen_at"] <= info["started_at"] <= info["ended_at"] <= time.monotonic()
    assert info["started_at"] - info["load_seen_at"] == pytest.approx(plan["fault_after_s"], abs=0.1)
    assert info["ended_at"] - info["started_at"] == pytest.approx(plan["fault_s"], abs=0.1)
    bench = bench_json([0.05, 0.05], t0=first_request)
    series = faults_plot.row_series(record("nvme-read-errors", Path("x"), info, 900.0), bench)
    assert series is not None and series.window is not None and not series.approximate
    assert series.window[0] == pytest.approx(plan["fault_after_s"], abs=0.2)
    assert series.window[1] - series.window[0] == pytest.approx(plan["fault_s"], abs=0.1)
    assert series.hits_again_at is not None and series.hits_again_at >= series.window[1]
