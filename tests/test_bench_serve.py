"""``kvtier bench serve`` (issue 23, item 4): serving under load with vLLM's own ``vllm bench serve``.

Fast tests (no server): the plan's sizes (closed loop and the mixed workload at a request rate), the
load generator's command, the parsing of its saved JSON, vLLM's /metrics counters, the LMCache rows'
configuration, their skip without LMCache's venv and the check that a cache row hits, and the
round-robin proxy of the two-server rows against two small HTTP servers.
The vLLM-alone row's flow (a server with no kvtier, its points with no kvtier counters) against a
fake server. The slow tests run ``kvtier bench serve --small`` end to end: the row ``kvtier-dram`` in
CI (tiny model, real ``vllm serve`` and ``vllm bench serve``) and check the JSON; the rows ``vllm``
and ``kvtier-dram`` together, and the mixed workload's small run on ``vllm`` alone, with
KVTIER_FULL_TESTS=1; the LMCache row's small run when its venv exists.

Run: ``.venv/bin/python -m pytest tests/test_bench_serve.py -v`` (add ``-m slow`` for the run).
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvtier.bench import serve, serve_plan


def plan_of(*argv: str) -> dict:
    return serve.make_plan(serve.build_parser().parse_args(list(argv)))


def test_sizes_full_and_small():
    full = plan_of()
    assert (full["preset"], full["users"], full["requests_per_user"], full["concurrency"]) == (
        "kv8b",
        [4, 12, 32],
        3,
        4,
    )
    assert (full["prefix_len"], full["suffix_len"], full["output_len"]) == (2048, 64, 16)
    assert (full["dram_gib"], full["nvme_gib"], full["vllm_blocks"]) == (2.0, 8.0, None)
    assert full["rows"] == ["vllm", "kvtier-dram", "kvtier-nvme"]
    small = plan_of("--small", "--users", "3", "--rows", "vllm,kvtier-dram", "--two-servers")
    assert (small["preset"], small["users"], small["prefix_len"], small["concurrency"]) == ("tiny", [3], 512, 2)
    assert small["rows"] == ["vllm", "kvtier-dram", "kvtier-2x-shared", "kvtier-2x-private"]
    assert small["max_model_len"] >= 512 + 64 + 4
    assert "--num-gpu-blocks-override" in serve.server_args(small)
    assert plan_of("--prefix-len", "4k")["prefix_len"] == 4096


def test_kv_events_are_counted_per_point():
    assert plan_of("--kv-events")["kv_events"] and not plan_of()["kv_events"]
    args = serve.events_args("ipc:///tmp/x.ipc")
    assert args[0] == "--kv-events-config" and json.loads(args[1])["endpoint"] == "ipc:///tmp/x.ipc"
    before = {"events": 10, "bytes": 1000, "by_medium": {"GPU": 10}}
    after = {"events": 70, "bytes": 9000, "by_medium": {"GPU": 30, "CPU": 30, "STORAGE": 10}}
    delta = serve.events_delta(before, after, {"completed": 20, "duration_s": 4.0})
    assert delta["events"] == 60 and delta["events_per_request"] == 3.0
    assert delta["kvtier_events_per_request"] == 2.0 and delta["by_medium"] == {"GPU": 20, "CPU": 30, "STORAGE": 10}
    assert delta["bytes_per_s"] == 2000.0
    point = {"request_throughput": 1.0, "output_throughput": 2.0, "ttft_ms": {"p50": 1, "p90": 2, "p99": 3}}
    assert "KV events 3.0 per request (2.0 kvtier's), 2.0 KB/s" in serve.point_line({**point, "kv_events": delta})


def test_mixed_workload_arrives_at_a_rate():
    mixed = plan_of("--workload", "mixed")
    assert (mixed["users"], mixed["requests_per_user"], mixed["output_len"]) == ([4, 12, 20], 2, 64)
    assert (mixed["request_rate"], mixed["burstiness"], mixed["concurrency"]) == (0.4, 1.0, None)
    assert mixed["preset"] == "kv8b" and mixed["prefix_len"] == 2048
    command = serve.bench_command(mixed, "http://h:1", "kv8b", Path("/m"), 4, 7, Path("/r"), "x.json")
    assert command[command.index("--request-rate") + 1] == "0.4"
    assert command[command.index("--burstiness") + 1] == "1"
    assert "--max-concurrency" not in command, "an open loop: no cap on requests in flight"
    assert command[command.index("--prefix-repetition-output-len") + 1] == "64"
    assert serve.load_text(mixed) == "0.4 req/s (Poisson)"
    small = plan_of("--workload", "mixed", "--small")
    assert (small["preset"], small["request_rate"], small["output_len"], small["concurrency"]) == (
        "tiny",
        4.0,
        16,
        None,
    )
    both = plan_of("--workload", "mixed", "--request-rate", "2", "--burstiness", "0.5", "--concurrency", "8")
    command = serve.bench_command(both, "http://h:1", "kv8b", Path("/m"), 4, 7, Path("/r"), "x.json")
    assert command[command.index("--max-concurrency") + 1] == "8"
    assert command[command.index("--request-rate") + 1] == "2" and command[command.index("--burstiness") + 1] == "0.5"
    assert serve.load_text(both) == "2 req/s (burstiness 0.5), concurrency 8"
    closed = plan_of()
    assert closed["request_rate"] is None and closed["burstiness"] is None and closed["workload"] == "closed"
    assert "--request-rate" not in serve.bench_command(closed, "u", "m", Path("/m"), 4, 7, Path("/r"), "x.json")


@pytest.mark.parametrize(
    "argv",
    [
        ["--users", "0"], ["--rows", "nope"], ["--concurrency", "0"], ["--request-rate", "0"],
        ["--workload", "mixed", "--burstiness", "0"],
    ],
)  # fmt: skip
def test_bad_arguments(argv):
    with pytest.raises(serve.BenchError):
        plan_of(*argv)


def test_store_options_per_row():
    plan = plan_of("--dram-gib", "2", "--nvme-gib", "8")
    store = Path("/stores/row")
    assert serve.store_options("kvtier-dram", plan, store) == {"dram_bytes": 2 << 30, "nvme_bytes": 0}
    assert serve.store_options("kvtier-nvme", plan, store) == {"dram_bytes": 2 << 30, "nvme_bytes": 8 << 30}
    assert serve.store_options("kvtier-2x-private", plan, store) == {"dram_bytes": 1 << 30, "nvme_bytes": 4 << 30}
    root = Path("/stores")
    # The shared-tier row: DRAM over the shared filesystem tier (no NVMe), its root beside the local
    # store, inside the row's directory (removed with it).
    (local,) = serve.row_stores("kvtier-shared", root)
    assert local == root / "kvtier-shared" / "local"
    assert serve.store_options("kvtier-shared", plan, local) == {
        "dram_bytes": 2 << 30,
        "nvme_bytes": 0,
        "shared_root": str(root / "kvtier-shared" / "shared"),
    }
    assert "kvtier-shared" not in plan_of()["rows"] and plan_of("--rows", "kvtier-shared")["rows"] == ["kvtier-shared"]
    assert serve.row_stores("vllm", root) == []
    shared = serve.row_stores("kvtier-2x-shared", root)
    assert len(shared) == 2 and shared[0] == shared[1]
    private = serve.row_stores("kvtier-2x-private", root)
    assert len(set(private)) == 2


def test_two_servers_bind_to_their_own_share_of_the_cores(monkeypatch):
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    assert [serve.core_share(n, 2) for n in (0, 1)] == ["0,1", "2,3"]
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: {0, 1})
    assert [serve.core_share(n, 2) for n in (0, 1)] == ["0", "1"]
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: {3})
    assert serve.core_share(0, 2) is None and serve.core_share(0, 1) is None


def test_bench_command():
    plan = plan_of("--small")
    command = serve.bench_command(plan, "http://h:1", "tiny", Path("/m"), 4, 7, Path("/r"), "x.json")
    assert command[command.index("bench") : command.index("bench") + 2] == ["bench", "serve"]

    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert value("--dataset-name") == "prefix_repetition"
    assert value("--prefix-repetition-num-prefixes") == "4"
    assert value("--num-prompts") == str(4 * plan["requests_per_user"])
    assert value("--max-concurrency") == "2"
    assert value("--seed") == "7"
    assert value("--tokenizer") == "/m"
    assert value("--percentile-metrics") == "ttft,tpot,itl,e2el"
    assert value("--metric-percentiles") == "50,90,99"
    assert "--ignore-eos" in command and "--save-result" in command


def test_parse_result():
    saved = {
        "completed": 8, "failed": 0, "duration": 4.0, "request_throughput": 2.0, "output_throughput": 8.0,
        "total_input_tokens": 4608, "total_output_tokens": 32,
        "p50_ttft_ms": 100.0, "p90_ttft_ms": 150.0, "p99_ttft_ms": 199.0, "mean_ttft_ms": 110.0,
        "p50_e2el_ms": 120.0, "p90_e2el_ms": 170.0, "p99_e2el_ms": 220.0, "mean_e2el_ms": 130.0,
        "p50_tpot_ms": 60.0, "p99_tpot_ms": 75.0, "p50_itl_ms": 58.0, "p99_itl_ms": 140.0,
    }  # fmt: skip
    point = serve.parse_result(saved)
    assert point["request_throughput"] == 2.0 and point["completed"] == 8
    assert point["ttft_ms"] == {"p50": 100.0, "p90": 150.0, "p99": 199.0, "mean": 110.0}
    assert point["e2el_ms"]["p99"] == 220.0
    assert point["tpot_ms"]["p50"] == 60.0 and point["itl_ms"]["p99"] == 140.0
    counters = {"dram_hits": 3, "nvme_hits": 0, "shared_hits": 1, "puts": 9}
    counters |= {"bytes_written_nvme": 3 << 20, "dropped_without_evidence": 2, "retained_by_hint": 5}
    published = counters | {"bucket_put_requests": 4, "bucket_bytes_written": 8 << 20}
    document = {
        "settings": {"publish_bucket_rows": ["kvtier-nvme"]},
        "rows": [
            {
                "label": "x",
                "points": [
                    {"users": 2, **point, "kvtier": counters},
                ],
            },
            {"label": "y", "points": []},
            {"row": "kvtier-nvme", "label": "z", "points": [{"users": 2, **point, "kvtier": published}]},
        ],
    }
    rows = serve.table_rows(document)
    assert all(len(row) == len(serve.TABLE_HEADER) for row in rows), "a cell per column"
    assert rows[0][:4] == ["x", "2", "8", "2.00"]
    assert rows[0][-10:] == ["3", "0", "1", "9", "3", "2", "5", "-", "-", "-"], "no bucket: no bucket figures"
    assert rows[2][-3:] == ["4", "8", "-"], "a publishing row's PUTs and MiB written"
    assert "bucket PUTs 4 (8 MiB)" in serve.point_line({"users": 2, **point, "kvtier": published})
    assert rows[0][serve.TABLE_HEADER.index("TPOT p50/p99 ms")] == "60/75"
    assert rows[0][serve.TABLE_HEADER.index("ITL p50/p99 ms")] == "58/140"
    assert rows[1][2] == "not measured"
    assert "TPOT p50/p99 60/75 ms, ITL p50/p99 58/140 ms" in serve.point_line(point)


def test_lmcache_rows_without_their_venv_are_skipped_with_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(serve_plan, "repo_root", lambda: tmp_path)  # a checkout without .venv-lmcache-vllm
    plan = plan_of("--rows", "vllm,lmcache,lmcache-disk")
    assert plan["rows"] == ["vllm", "lmcache", "lmcache-disk"] and plan["lmcache_python"] is None
    assert "scripts/install_lmcache_vllm.sh" in plan["lmcache_not_measured"]
    record = serve.run_row(plan, "lmcache", tmp_path, 60, 0.0)
    assert record["points"] == [] and record["problems"] == [] and not record["servers"]
    assert record["skipped"].startswith("LMCache not measured: no .venv-lmcache-vllm")
    row = serve.table_rows({"rows": [record]})[0]
    assert row[0] == "LMCache CPU + CPU copy shim" and "install_lmcache_vllm.sh" in row[2]
    with pytest.raises(serve.BenchError, match="not an executable"):
        plan_of("--rows", "lmcache", "--lmcache-python", str(tmp_path / "nope"))
    (tmp_path / ".venv-lmcache-vllm" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-lmcache-vllm" / "bin" / "python").symlink_to(sys.executable)
    found = plan_of("--rows", "lmcache")
    assert found["lmcache_python"] == str(tmp_path / ".venv-lmcache-vllm" / "bin" / "python")
    assert found["lmcache_not_measured"] is None
    assert "lmcache_python" not in plan_of(), "no LMCache row: no interpreter looked up"


def test_shim_counters_sum_the_server_processes(tmp_path):
    prefix = tmp_path / "lmcache-lmcache-counters"
    assert serve.shim_counters(prefix) is None, "nothing written yet"
    scheduler = {"loaded_tokens": 0, "stored_tokens": 0, "disk_chunks_read": 0, "disk_chunks_missed": 0, "pid": 1}
    worker = {"loaded_tokens": 512, "stored_tokens": 1024, "disk_chunks_read": 2, "disk_chunks_missed": 0, "pid": 2}
    (tmp_path / "lmcache-lmcache-counters.1.json").write_text(json.dumps(scheduler))
    (tmp_path / "lmcache-lmcache-counters.2.json").write_text(json.dumps(worker))
    (tmp_path / "lmcache-lmcache-disk-counters.3.json").write_text(json.dumps(worker))  # another row's
    assert serve.shim_counters(prefix) == {k: v for k, v in worker.items() if k != "pid"}
    assert serve.row_stores("lmcache", Path("/stores")) == [], "no kvtier store, no kvtier service"


def test_lmcache_config_is_sized_like_kvtier():
    plan = plan_of("--dram-gib", "2", "--nvme-gib", "8")
    cpu = serve.lmcache_config("lmcache", plan, Path("/d"))
    assert cpu["local_cpu"] and cpu["max_local_cpu_size"] == pytest.approx(2 * 2**30 / 1e9)
    assert "local_disk" not in cpu and cpu["chunk_size"] == 256 and not cpu["use_layerwise"]
    disk = serve.lmcache_config("lmcache-disk", plan, Path("/d"))
    assert disk["local_disk"] == "/d" and disk["max_local_disk_size"] == pytest.approx(8 * 2**30 / 1e9)


def test_a_cache_row_without_hits_is_a_problem(tmp_path):
    def record(points):
        return {"points": points}

    shim = {"loaded_tokens": 0, "stored_tokens": 512, "disk_chunks_read": 0, "disk_chunks_missed": 0}
    assert "never ran" in serve.row_hit_problems("lmcache", record([{"users": 2}]), None)[0]
    assert "no hit" in serve.row_hit_problems("lmcache", record([{"lmcache": shim}]), None)[0]
    hit = {**shim, "loaded_tokens": 256}
    assert serve.row_hit_problems("lmcache", record([{"lmcache": shim}, {"lmcache": hit}]), None) == []
    log = tmp_path / "server.log"
    log.write_text("INFO ok\nWARNING LMCache runs in degraded mode (recompute)\n")
    assert "degraded mode" in serve.row_hit_problems("lmcache-disk", record([{"lmcache": hit}]), log)[0]
    zero = {"dram_hits": 0, "nvme_hits": 0, "puts": 9}
    assert "kvtier served no hit" in serve.row_hit_problems("kvtier-dram", record([{"kvtier": zero}]), None)[0]
    assert serve.row_hit_problems("kvtier-nvme", record([{"kvtier": {**zero, "nvme_hits": 1}}]), None) == []
    assert serve.row_hit_problems("kvtier-shared", record([{"kvtier": {**zero, "shared_hits": 1}}]), None) == []
    assert serve.row_hit_problems("vllm", record([{"users": 2}]), None) == []
    assert serve.row_hit_problems("kvtier-dram", record([{"users": 2}]), None) == [], "no counters: not judged"


METRICS = b"""# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 1024.0
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 4096.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny"} 512.0
vllm:external_prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7e9
vllm:external_prefix_cache_queries_total{engine="0",model_name="tiny"} 3072.0
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
"""


class _Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(METRICS)))
        self.end_headers()
        self.wfile.write(METRICS)

    def log_message(self, *args):
        pass


def test_cache_metrics_sum_vllm_counters_over_servers():
    servers = []
    for _ in range(2):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    try:
        totals = serve.cache_metrics([f"http://127.0.0.1:{s.server_address[1]}" for s in servers])
    finally:
        for server in servers:
            server.shutdown()
    assert totals == {"vllm_queried": 8192, "vllm_hits": 2048, "connector_queried": 6144, "connector_hits": 1024}
    assert serve.cache_metrics(["http://127.0.0.1:1"]) is None, "no server: no figures, not zeros"


class _Upstream(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self._answer(b'{"data": [{"id": "m", "root": "m"}]}', "application/json")

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        name = self.server.name.encode()  # type: ignore[attr-defined]
        self._answer(b"data: " + name + b" " + body + b"\n\ndata: [DONE]\n\n", "text/event-stream")

    def _answer(self, payload: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def test_round_robin_proxy(tmp_path):
    upstreams = []
    for name in ("a", "b"):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
        server.name = name  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        upstreams.append(server)
    proxy = serve.Proxy([f"http://127.0.0.1:{s.server_address[1]}" for s in upstreams], tmp_path / "proxy.log")
    try:
        answers = []
        for index in range(4):
            request = urllib.request.Request(
                f"{proxy.url}/v1/completions", data=json.dumps({"i": index}).encode(), method="POST"
            )
            with urllib.request.urlopen(request, timeout=10) as answer:
                answers.append(answer.read().decode())
        assert [text.split()[1] for text in answers] == ["a", "b", "a", "b"]
        assert all(f'"i": {index}' in text for index, text in enumerate(answers))
    finally:
        proxy.stop()
        for server in upstreams:
            server.shutdown()


class _FakeServer:
    """An OpenAIServer stand-in: the arguments it was given, and the calls a row makes."""

    made: ClassVar[list[_FakeServer]] = []

    def __init__(self, model_dir, preset, log_path, transfer, args, env, vllm=None):
        self.transfer, self.args, self.env, self.url = transfer, args, env, "http://127.0.0.1:9"
        self.process: subprocess.CompletedProcess[str] = subprocess.CompletedProcess(["vllm", "serve"], 0)
        self.process.pid = os.getpid()  # type: ignore[attr-defined]  # whose CPU the point reads
        self.calls: list[str] = []
        _FakeServer.made.append(self)

    def wait_healthy(self) -> float:
        self.calls.append("healthy")
        return 1.0

    def complete(self, prompt, max_tokens):
        self.calls.append("complete")

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset")

    def stop(self) -> int:
        self.calls.append("stop")
        return 0


def test_the_vllm_row_runs_a_server_without_kvtier_and_reads_no_kvtier_counters(tmp_path, monkeypatch):
    """The vLLM-alone row without a server (its real run: test_bench_serve_small_end_to_end_both_rows
    and the mixed workload's, with KVTIER_FULL_TESTS=1): no --kv-transfer-config, no store, no service
    read or stopped, and its points carry no kvtier counters."""
    import types

    import kvtier.openai_server

    _FakeServer.made = []
    monkeypatch.setattr(kvtier.openai_server, "OpenAIServer", _FakeServer)
    # kvtier.vllm imports vLLM (seconds to a minute): a stand-in whose config must not be asked for.
    no_kvtier: Any = types.ModuleType("kvtier.vllm")
    no_kvtier.kv_transfer_config = lambda *a, **k: pytest.fail("the vllm row built a kv-transfer config")
    monkeypatch.setitem(sys.modules, "kvtier.vllm", no_kvtier)
    points = []

    def fake_run_point(plan, row, index, users, base_url, model_dir, out_dir, timeout_s):
        points.append((row, users, base_url))
        figures = {"request_throughput": 1.0, "output_throughput": 2.0, "ttft_ms": {"p50": 1, "p90": 2, "p99": 3}}
        return {"users": users, "completed": users * plan["requests_per_user"], "failed": 0, **figures}

    monkeypatch.setattr(serve, "run_point", fake_run_point)
    monkeypatch.setattr(serve, "cache_metrics", lambda urls: None)
    monkeypatch.setattr(serve, "service_counters", lambda sockets: pytest.fail("the vllm row read kvtier's counters"))
    plan = plan_of("--small", "--rows", "vllm", "--users", "2,4")
    plan["model_dir"] = str(tmp_path / "model")
    record = serve.run_row(plan, "vllm", tmp_path, 60, 0.0)
    assert not record["problems"], record["problems"]
    (server,) = _FakeServer.made
    assert server.transfer is None and "--kv-transfer-config" not in server.args
    assert server.args == serve.server_args(plan) and "--enforce-eager" in server.args
    assert server.calls[:3] == ["healthy", "complete", "complete"] and server.calls[-1] == "stop"
    assert points == [("vllm", 2, server.url), ("vllm", 4, server.url)]
    assert [point["users"] for point in record["points"]] == [2, 4]
    assert all("kvtier" not in point and "load_decisions" not in point for point in record["points"])
    assert record["servers"][0]["command"][:2] == ["vllm", "serve"]
    assert not (tmp_path / "stores").exists()


# --------------------------------------------------------------------------------------------
# end to end (slow)
# --------------------------------------------------------------------------------------------


CPU_BLOCK_TOKENS = 128  # vLLM's block on CPU: one kvtier block
SLOT_HEADER_BYTES = 4096  # a kvtier block's header on NVMe (docs/format.md)


def _run_small(tmp_path: Path, rows: list[str], workload: str = "closed") -> tuple[dict, Path]:
    """``kvtier bench serve --small`` with ``rows`` and one point (4 users) of --small's two: its
    results.json, checked for what every row's points must have, and its output directory."""
    _require_vllm()
    out = tmp_path / "serve"
    command = [sys.executable, "-m", "kvtier", "bench", "serve", "--small", "--rows", ",".join(rows)]
    command += ["--users", "4", "--workload", workload]
    completed = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=3600)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    document = json.loads((out / "results.json").read_text())
    assert not document["problems"]
    assert [(r["row"], r["occurrence"]) for r in document["rows"]] == [(row, 1) for row in rows]
    assert Path(document["rows"][0]["servers"][0]["log"]).parent == out / "logs"
    users = document["settings"]["users"]
    for record in document["rows"]:
        assert [point["users"] for point in record["points"]] == users
        for point in record["points"]:
            returning = point["users"] * document["settings"]["requests_per_user"]
            assert point["completed"] == returning + point.get("one_off_requests", 0)
            assert point["failed"] == 0
            assert point["request_throughput"] > 0 and point["output_throughput"] > 0
            assert all(point["ttft_ms"][f"p{p}"] > 0 for p in (50, 90, 99))
            dataset = "prefix_repetition" if workload == "closed" else "custom"
            assert "bench" in point["command"] and dataset in point["command"]
    assert (out / "serve.png").exists() and (out / "table.md").exists()
    return document, out


def _kvtier_dram_served_repeats(document: dict, row: str = "kvtier-dram") -> None:
    # Users repeat (2 requests each) and vLLM's own cache holds 12 blocks: kvtier serves repeats.
    (record,) = [record for record in document["rows"] if record["row"] == row]
    assert sum(point["kvtier"]["dram_hits"] for point in record["points"]) > 0
    # The CPU account read the real processes: the server's tree, and kvtier's threads in it (the
    # worker's job thread and watchdog, the connections' hang-up watch at least); the tiny model's
    # copies and service may take less than a tick (10 ms).
    cpu = [point["cpu_s"] for point in record["points"]]
    assert all(c["server_s"] > 0 and c["engine_kvtier_threads"] >= 3 for c in cpu), cpu


@pytest.mark.slow
def test_bench_serve_longtail_small_end_to_end_with_retention_hints(tmp_path):
    """A kvtier row end to end (one server, vLLM's own client): the long-tail workload's reuse row,
    whose returning users' requests carry kvtier's retention hint in their body (``--retain-hints``,
    through ``kvtier.bench.vllm_client``). The hint travels vLLM's OpenAI server, its scheduler's
    ``kv_transfer_params`` and the host service: the hinted prefixes are written to NVMe at first
    sight, and nothing else is (the one-off prompts' blocks and the users' questions stay in DRAM,
    unwritten). The closed
    workload's kvtier row runs in the test below (KVTIER_FULL_TESTS=1), the vLLM-alone row's flow is
    checked against a fake server above; a row run twice is summed up in
    tests/test_bench_serve_summary.py."""
    document, _ = _run_small(tmp_path, ["kvtier-nvme-reuse"], workload="longtail")
    _kvtier_dram_served_repeats(document, "kvtier-nvme-reuse")
    (point,) = document["rows"][0]["points"]
    counters, settings = point["kvtier"], document["settings"]
    assert counters["retained_by_hint"] > 0, "the hint reached the service"
    # The preset's bytes per token are float32's; vLLM's default dtype on CPU may halve them.
    slots = [CPU_BLOCK_TOKENS * settings["kv_bytes_per_token"] // halves + SLOT_HEADER_BYTES for halves in (1, 2)]
    (slot_bytes,) = [slot for slot in slots if counters["bytes_written_nvme"] % slot == 0]
    written_blocks = counters["bytes_written_nvme"] // slot_bytes
    prefix_blocks = settings["prefix_len"] // CPU_BLOCK_TOKENS
    # The hint covers each user's prefix ("retain": prefix_len): the blocks of its questions and of the
    # one-off prompts wait for evidence. One has it: vLLM's client sends its first request twice (its
    # initial test run), a user's at this seed, so that request's question block is stored twice.
    assert point["users"] * prefix_blocks <= written_blocks <= point["users"] * prefix_blocks + 1, counters


@pytest.mark.slow
@pytest.mark.full
def test_bench_serve_small_end_to_end(tmp_path):
    """The closed workload's kvtier row end to end (one server, one `vllm bench serve`). Full only
    since the long-tail row above runs in CI (one server each: CI's time budget)."""
    document, _ = _run_small(tmp_path, ["kvtier-dram"])
    _kvtier_dram_served_repeats(document)


@pytest.mark.slow
@pytest.mark.full
def test_bench_serve_small_end_to_end_both_rows(tmp_path):
    """vLLM alone and kvtier-dram in one run, as docs/benchmarks.md compares them. Full only: the vLLM row
    is one more server and one more `vllm bench serve` (110 s of 288 here, on 2 busy cores)."""
    document, _ = _run_small(tmp_path, ["vllm", "kvtier-dram"])
    (vllm_row,) = [record for record in document["rows"] if record["row"] == "vllm"]
    assert all("kvtier" not in point for point in vllm_row["points"])
    _kvtier_dram_served_repeats(document)


def _require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except Exception as import_error:  # pragma: no cover - depends on the environment
        pytest.skip(f"vllm is not importable ({import_error!r})")


@pytest.mark.slow
@pytest.mark.full
def test_bench_serve_mixed_workload_small(tmp_path):
    """The mixed workload end to end on vLLM alone (one server): requests at a rate, decode metrics.
    Full only (about 140 s): its arrival schedule and options are checked without a server above."""
    _require_vllm()
    out = tmp_path / "mixed"
    command = [sys.executable, "-m", "kvtier", "bench", "serve", "--small", "--workload", "mixed", "--rows", "vllm"]
    completed = subprocess.run(
        [*command, "--users", "2", "--out", str(out)], capture_output=True, text=True, timeout=900
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    document = json.loads((out / "results.json").read_text())
    assert document["settings"]["workload"] == "mixed" and not document["problems"]
    (point,) = document["rows"][0]["points"]
    assert point["completed"] == 2 * 2 and point["failed"] == 0
    assert "--request-rate" in point["command"] and "--max-concurrency" not in point["command"]
    saved = json.loads(Path(point["result_file"]).read_text())
    assert saved["request_rate"] == 4.0 and saved["burstiness"] == 1.0
    assert point["total_output_tokens"] == 4 * 16
    assert all(point[f"{metric}_ms"]["p99"] > 0 for metric in ("ttft", "tpot", "itl"))
    assert point["cache_tokens"]["vllm_queried"] > 0, "vLLM's /metrics were read before and after the point"


@pytest.mark.slow
def test_bench_serve_lmcache_row_small(tmp_path):
    """LMCache's CPU row under `vllm serve` through the shim, when LMCache's venv is installed: its
    shim must have copied tokens into vLLM (hits), as vLLM's connector counter must say."""
    venv_python = serve.repo_root() / serve.LMCACHE_VENV / "bin" / "python"
    if not venv_python.exists():
        pytest.skip(f"no {serve.LMCACHE_VENV} (bash {serve.LMCACHE_INSTALL})")
    out = tmp_path / "lmcache"
    command = [sys.executable, "-m", "kvtier", "bench", "serve", "--small", "--rows", "lmcache", "--users", "4"]
    completed = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=1800)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    document = json.loads((out / "results.json").read_text())
    (point,) = document["rows"][0]["points"]
    assert point["failed"] == 0 and point["lmcache"]["loaded_tokens"] > 0
    assert point["cache_tokens"]["connector_hits"] > 0


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.radosgw
def test_bench_serve_slow_link_small(tmp_path):
    """`kvtier bench serve --slow-link` end to end at CI size (Ceph's RADOS gateway, root): vLLM alone, node
    A publishing, then always-load and kvtier's choice through a 4 MB/s link; no problem (node A published,
    always-load loaded from the bucket, kvtier's choice counted decisions) and the choice judged. Full only:
    the gateway and four servers."""
    _require_vllm()
    from kvtier.bench import bucket

    reason = bucket.missing_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "slow"
    command = [sys.executable, "-m", "kvtier", "bench", "serve", "--small", "--slow-link", "4", "--users", "4"]
    completed = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=3600)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    document = json.loads((out / "results.json").read_text())
    assert [r["row"] for r in document["rows"]] == [
        "vllm", "kvtier-object-publish", "kvtier-object-always@4", "kvtier-object-auto@4",
    ]  # fmt: skip
    rows = {record["row"]: record for record in document["rows"]}
    (always,) = rows["kvtier-object-always@4"]["points"]
    (auto,) = rows["kvtier-object-auto@4"]["points"]
    assert always["kvtier"]["bucket_hits"] > 0 and always["failed"] == 0 and auto["failed"] == 0
    assert auto["load_decisions"], "kvtier's choice counted its decisions"
    (judged,) = document["slow_link"]
    assert judged["users"] == 4 and judged["auto_over_best"] is not None


@pytest.mark.slow
@pytest.mark.full
def test_bench_serve_slow_mount_small(tmp_path):
    """`kvtier bench serve --slow-mount` end to end at CI size (FUSE): vLLM alone, node A publishing into
    the run's shared directory, then always-load and kvtier's choice through a 4 MB/s mount of it; no
    problem (node A published, always-load loaded from the shared tier, kvtier's choice counted decisions),
    the choice judged, and the mount and its directory gone. Full only: four servers."""
    _require_vllm()
    from kvtier.bench import slowmount

    reason = slowmount.missing_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "slow"
    command = [sys.executable, "-m", "kvtier", "bench", "serve", "--small", "--slow-mount", "4", "--users", "4"]
    completed = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=3600)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    document = json.loads((out / "results.json").read_text())
    assert [r["row"] for r in document["rows"]] == [
        "vllm", "kvtier-mount-publish", "kvtier-mount-always@4", "kvtier-mount-auto@4",
    ]  # fmt: skip
    rows = {record["row"]: record for record in document["rows"]}
    (always,) = rows["kvtier-mount-always@4"]["points"]
    (auto,) = rows["kvtier-mount-auto@4"]["points"]
    assert always["kvtier"]["shared_hits"] > 0 and always["failed"] == 0 and auto["failed"] == 0
    assert auto["load_decisions"], "kvtier's choice counted its decisions"
    (judged,) = document["slow_link"]
    assert judged["tier"] == "shared" and judged["users"] == 4 and judged["auto_over_best"] is not None
    assert not (out / "slow-mount").exists(), "the shared directory and the mount point went with the run"


def test_the_long_tail_publishing_to_a_bucket(tmp_path, monkeypatch):
    """--publish-bucket: the long tail's kvtier rows publish to a bucket beside NVMe, each under a prefix
    of its own (a row never reads another's blocks), with room in a local gateway for every block of
    every prompt; the bucket's PUTs and bytes written are read with the other counters."""
    import contextlib

    from kvtier.bench import bucket, serve_slow

    rows = "vllm,kvtier-nvme,kvtier-nvme-reuse"
    plan = plan_of("--workload", "longtail", "--small", "--rows", rows, "--publish-bucket")
    assert plan["publish_bucket_rows"] == ["kvtier-nvme", "kvtier-nvme-reuse"]
    assert plan["bucket_osd_bytes"] > 1 << 30
    assert {"bucket_put_requests", "bucket_bytes_written"} <= set(serve_plan.OBJECT_COUNTERS)
    for wrong in (["--publish-bucket"], ["--workload", "longtail", "--rows", "vllm,kvtier-dram", "--publish-bucket"]):
        with pytest.raises(serve.BenchError, match="--publish-bucket"):
            plan_of(*wrong)
    with pytest.raises(serve.BenchError, match="--bucket-url"):
        plan_of("--workload", "longtail", "--bucket-url", "s3://b")
    opened: list[int] = []

    @contextlib.contextmanager
    def fake_open(url, endpoint, osd_bytes, log):
        opened.append(osd_bytes)
        yield bucket.Bucket("b", "run", "http://127.0.0.1:1", "us-east-1", self_hosted=True)

    monkeypatch.setattr(bucket, "open_bucket", fake_open)
    with serve_slow.SlowTierRows(plan, tmp_path, lambda _: None) as objects:
        assert objects.options("vllm") == {}
        assert objects.options("kvtier-nvme") == {
            "bucket_url": "s3://b/run/kvtier-nvme",
            "bucket_endpoint": "http://127.0.0.1:1",
        }
        assert objects.options("kvtier-nvme-reuse")["bucket_url"] == "s3://b/run/kvtier-nvme-reuse"
    assert opened == [plan["bucket_osd_bytes"]], "one gateway for the run"
