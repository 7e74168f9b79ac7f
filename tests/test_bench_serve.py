"""``kvtier bench serve`` (issue 23, item 4): serving under load with vLLM's own ``vllm bench serve``.

Fast tests (no server): the plan's sizes, the load generator's command, the parsing of its saved
JSON, and the round-robin proxy of the two-server rows against two small HTTP servers.
The slow test runs ``kvtier bench serve --small`` end to end with the rows ``vllm`` and
``kvtier-dram`` (tiny model, real ``vllm serve`` and ``vllm bench serve``) and checks the JSON.

Run: ``.venv/bin/python -m pytest tests/test_bench_serve.py -v`` (add ``-m slow`` for the run).
"""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from kvtier.bench import serve


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


@pytest.mark.parametrize("argv", [["--users", "0"], ["--rows", "nope"], ["--concurrency", "0"]])
def test_bad_arguments(argv):
    with pytest.raises(serve.BenchError):
        plan_of(*argv)


def test_store_options_per_row():
    plan = plan_of("--dram-gib", "2", "--nvme-gib", "8")
    assert serve.store_options("kvtier-dram", plan) == {"dram_bytes": 2 << 30, "nvme_bytes": 0}
    assert serve.store_options("kvtier-nvme", plan) == {"dram_bytes": 2 << 30, "nvme_bytes": 8 << 30}
    assert serve.store_options("kvtier-2x-private", plan) == {"dram_bytes": 1 << 30, "nvme_bytes": 4 << 30}
    root = Path("/stores")
    assert serve.row_stores("vllm", root) == []
    shared = serve.row_stores("kvtier-2x-shared", root)
    assert len(shared) == 2 and shared[0] == shared[1]
    private = serve.row_stores("kvtier-2x-private", root)
    assert len(set(private)) == 2


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
    assert value("--percentile-metrics") == "ttft,e2el"
    assert value("--metric-percentiles") == "50,90,99"
    assert "--ignore-eos" in command and "--save-result" in command


def test_parse_result():
    saved = {
        "completed": 8, "failed": 0, "duration": 4.0, "request_throughput": 2.0, "output_throughput": 8.0,
        "total_input_tokens": 4608, "total_output_tokens": 32,
        "p50_ttft_ms": 100.0, "p90_ttft_ms": 150.0, "p99_ttft_ms": 199.0, "mean_ttft_ms": 110.0,
        "p50_e2el_ms": 120.0, "p90_e2el_ms": 170.0, "p99_e2el_ms": 220.0, "mean_e2el_ms": 130.0,
    }  # fmt: skip
    point = serve.parse_result(saved)
    assert point["request_throughput"] == 2.0 and point["completed"] == 8
    assert point["ttft_ms"] == {"p50": 100.0, "p90": 150.0, "p99": 199.0, "mean": 110.0}
    assert point["e2el_ms"]["p99"] == 220.0
    document = {
        "settings": {},
        "rows": [
            {"label": "x", "points": [{"users": 2, **point, "kvtier": {"dram_hits": 3, "nvme_hits": 0, "puts": 9}}]},
            {"label": "y", "points": []},
        ],
    }
    rows = serve.table_rows(document)
    assert rows[0][:4] == ["x", "2", "8", "2.00"] and rows[0][-3:] == ["3", "0", "9"]
    assert rows[1][2] == "not measured"


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


# --------------------------------------------------------------------------------------------
# end to end (slow)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_serve_small_end_to_end(tmp_path):
    try:
        import vllm  # noqa: F401
    except Exception as import_error:  # pragma: no cover - depends on the environment
        pytest.skip(f"vllm is not importable ({import_error!r})")
    out = tmp_path / "serve"
    command = [sys.executable, "-m", "kvtier", "bench", "serve", "--small", "--rows", "vllm,kvtier-dram"]
    completed = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=3600)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    document = json.loads((out / "results.json").read_text())
    assert not document["problems"]
    rows = {record["row"]: record for record in document["rows"]}
    assert set(rows) == {"vllm", "kvtier-dram"}
    users = document["settings"]["users"]
    for record in rows.values():
        assert [point["users"] for point in record["points"]] == users
        for point in record["points"]:
            assert point["completed"] == point["users"] * document["settings"]["requests_per_user"]
            assert point["failed"] == 0
            assert point["request_throughput"] > 0 and point["output_throughput"] > 0
            assert all(point["ttft_ms"][f"p{p}"] > 0 for p in (50, 90, 99))
            assert "bench" in point["command"] and "prefix_repetition" in point["command"]
    assert all("kvtier" not in point for point in rows["vllm"]["points"])
    # Users repeat (2 requests each) and vLLM's own cache holds 12 blocks: kvtier serves repeats.
    assert sum(point["kvtier"]["dram_hits"] for point in rows["kvtier-dram"]["points"]) > 0
    assert (out / "serve.png").exists() and (out / "table.md").exists()
