"""`kvtier bench serve-summary`: medians over repeats, the issue's targets judged on them, a missed
target named in the table and in the exit status. Runs are `kvtier bench serve` documents written
here with chosen figures (the real runs take 15 minutes each; tests/test_bench_serve.py runs one)."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.bench import serve_summary

SETTINGS = {
    "preset": "kv8b", "prefix_len": 2048, "suffix_len": 64, "requests_per_user": 3, "cpu_count": 2,
    "kv_bytes_per_token": 131072, "dram_gib": 2.0, "nvme_gib": 8.0,
}  # fmt: skip


def point(users: int, req_s: float, p99_ms: float) -> dict:
    return {"users": users, "request_throughput": req_s, "ttft_ms": {"p50": 1.0, "p90": 1.0, "p99": p99_ms}}


def run(tmp_path: Path, name: str, concurrency: int, rows: dict[str, list[tuple[int, float, float]]]) -> Path:
    document = {
        "settings": {**SETTINGS, "concurrency": concurrency},
        "rows": [
            {"row": row, "label": row, "points": [point(*p) for p in points], "problems": []}
            for row, points in rows.items()
        ],
    }
    directory = tmp_path / name
    directory.mkdir()
    (directory / "results.json").write_text(json.dumps(document))
    return directory


def test_repeats_give_medians_and_every_target_is_judged(tmp_path):
    first = run(tmp_path, "a", 4, {"vllm": [(4, 1.0, 5000), (32, 0.5, 11000)],
                                   "kvtier-nvme": [(4, 1.2, 4800), (32, 1.1, 6000)]})  # fmt: skip
    second = run(tmp_path, "b", 4, {"vllm": [(4, 1.0, 5200), (32, 0.4, 12000)],
                                    "kvtier-nvme": [(4, 1.0, 4000), (32, 1.0, 5000)]})  # fmt: skip
    third = run(tmp_path, "c", 4, {"vllm": [(4, 0.9, 5100), (32, 0.6, 10000)],
                                   "kvtier-nvme": [(4, 1.1, 4500), (32, 1.05, 7000)]})  # fmt: skip
    out = tmp_path / "summary"
    assert serve_summary.main([str(first), str(second), str(third), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    nvme_32 = summary["points"]["4"]["kvtier-nvme"]["32"]
    assert nvme_32["req_s"] == {"median": 1.05, "min": 1.0, "max": 1.1, "n": 3}
    assert summary["capacity_users"]["kvtier-nvme"] == 40  # 10 GiB over 256 MiB per prefix
    verdict = next(v for v in summary["verdicts"]["4"] if v["users"] == 32)
    assert round(verdict["vs_first_users"], 3) == round(1.05 / 1.1, 3)
    assert "1.05 (1.00-1.10)" in (out / "summary.md").read_text()


def test_a_collapse_or_a_slower_kvtier_is_a_missed_target(tmp_path):
    collapsed = run(tmp_path, "c8", 8, {"vllm": [(4, 1.0, 5000), (12, 0.5, 9000), (32, 0.4, 11000)],
                                        "kvtier-nvme": [(4, 1.2, 4800), (12, 1.0, 6000), (32, 0.8, 6000)],
                                        "kvtier-dram": [(4, 0.9, 4000), (12, 0.6, 9500), (32, 0.3, 8000)]})  # fmt: skip
    out = tmp_path / "summary"
    assert serve_summary.main([str(collapsed), "--out", str(out)]) == 1
    verdicts = {(v["row"], v["users"]): v for v in json.loads((out / "summary.json").read_text())["verdicts"]["8"]}
    assert not verdicts[("kvtier-nvme", 32)]["met"], "0.8 / 1.2 = 0.67x of the 4-user throughput"
    assert round(verdicts[("kvtier-nvme", 12)]["vs_first_users"], 2) == 0.83, "1.0 / 1.2: under 0.9x"
    assert not verdicts[("kvtier-nvme", 12)]["met"]
    assert verdicts[("kvtier-nvme", 4)]["met"]
    assert not verdicts[("kvtier-dram", 4)]["met"], "slower than vLLM alone"
    assert not verdicts[("kvtier-dram", 12)]["met"], "TTFT p99 above vLLM alone's"
    assert "vs_first_users" not in verdicts[("kvtier-dram", 32)], "32 prefixes do not fit 2 GiB: no collapse check"
    assert "**missed**" in (out / "summary.md").read_text()


def test_mixed_runs_group_by_rate_apart_from_closed_loop_runs(tmp_path):
    closed = run(tmp_path, "c4", 4, {"vllm": [(4, 1.0, 5000)], "kvtier-nvme": [(4, 1.1, 4900)]})
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    tpot = {"p50": 60.0, "p90": 70.0, "p99": 80.0}
    document = {
        "settings": {**SETTINGS, "concurrency": None, "request_rate": 0.4, "burstiness": 1.0, "output_len": 64},
        "rows": [
            {"row": "vllm", "label": "vllm", "points": [point(4, 0.38, 9000) | {"tpot_ms": tpot}], "problems": []},
            {"row": "kvtier-nvme", "label": "kvtier-nvme", "points": [point(4, 0.39, 3000)], "problems": []},
            {"row": "lmcache", "label": "lmcache", "points": [point(4, 0.2, 20000)], "problems": []},
        ],
    }
    (mixed / "results.json").write_text(json.dumps(document))
    out = tmp_path / "summary"
    assert serve_summary.main([str(closed), str(mixed), "--out", str(out)]) == 0, "LMCache is shown, not judged"
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["points"]) == {"4", "0.4 req/s, 64 out"}
    assert summary["points"]["0.4 req/s, 64 out"]["vllm"]["4"]["tpot_p99_ms"]["median"] == 80.0
    assert {v["row"] for v in summary["verdicts"]["0.4 req/s, 64 out"]} == {"kvtier-nvme"}
    table = (out / "summary.md").read_text()
    assert table.index("Concurrency 4") < table.index("Request rate 0.4 req/s, 64 out (1 runs")
    assert "| vllm | 4 | 0.38 | 9000 | 80 |" in table


def test_runs_with_kv_events_are_rows_of_their_own(tmp_path):
    without = run(tmp_path, "off", 4, {"kvtier-nvme": [(4, 1.0, 5000)]})
    with_events = run(tmp_path, "on", 4, {"kvtier-nvme": [(4, 0.9, 5500)]})
    document = json.loads((with_events / "results.json").read_text())
    document["settings"]["kv_events"] = True
    (with_events / "results.json").write_text(json.dumps(document))
    out = tmp_path / "summary"
    serve_summary.main([str(without), str(with_events), "--out", str(out)])
    points = json.loads((out / "summary.json").read_text())["points"]["4"]
    assert points["kvtier-nvme"]["4"]["req_s"]["median"] == 1.0
    assert points["kvtier-nvme+events"]["4"]["req_s"]["median"] == 0.9
    assert "| kvtier-nvme, KV events | 4 | 0.90 |" in (out / "summary.md").read_text()


def test_vllm_alone_twice_in_a_run_is_pooled_and_gives_the_noise_reference(tmp_path):
    document = {
        "settings": {**SETTINGS, "concurrency": 4},
        "rows": [
            {"row": "vllm", "label": "vLLM alone", "points": [point(4, 1.0, 5000)], "problems": [], "occurrence": 1},
            {"row": "kvtier-dram", "label": "kvtier DRAM", "points": [point(4, 1.2, 4700)], "problems": []},
            {"row": "vllm", "label": "vLLM alone", "points": [point(4, 1.1, 4500)], "problems": [], "occurrence": 2},
        ],
    }
    directory = tmp_path / "sandwich"
    directory.mkdir()
    (directory / "results.json").write_text(json.dumps(document))
    out = tmp_path / "summary"
    assert serve_summary.main([str(directory), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["points"]["4"]["vllm"]["4"]["ttft_p99_ms"]["median"] == 4750  # both vLLM-alone rows pooled
    assert summary["baseline_self"]["4"]["4"]["p99"]["median"] == 0.9  # the last over the first
    assert "vLLM alone against itself" in (out / "summary.md").read_text()
    single = run(tmp_path, "single", 4, {"vllm": [(4, 1.0, 5000)], "kvtier-dram": [(4, 1.2, 4700)]})
    assert serve_summary.baseline_self_ratios(serve_summary.load_runs([single])) == {}


def test_a_path_that_is_not_a_run_is_a_clear_error(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text("kvtier bench serve (closed): kv8b\n")
    other = tmp_path / "other.json"
    other.write_text("[1, 2]")
    for path in (log, other, tmp_path / "missing"):
        assert serve_summary.main([str(path), "--out", str(tmp_path / "summary")]) == 2
        assert "not the results" in capsys.readouterr().err
