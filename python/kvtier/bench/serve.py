"""`kvtier bench serve`: serving under load, seed 001's scalability experiment (issue 23, item 4).

Throughput and time to first token against the number of users, measured with vLLM's own load
generator (``vllm bench serve``, run as a subprocess; its saved JSON is parsed) against OpenAI
servers (``vllm serve`` through ``kvtier.openai_server.OpenAIServer``) with vLLM's defaults, apart
from ``--max-model-len`` (sized to the prompts), ``--enforce-eager`` (graph capture on CPU takes
minutes) and, where asked, ``--num-gpu-blocks-override`` (``--vllm-blocks``).

Workload: vLLM's ``prefix_repetition`` dataset, "a system prompt per user plus a question": users =
``--prefix-repetition-num-prefixes``, each user's prefix ``--prefix-len`` random tokens, each request
that prefix plus ``--suffix-len`` fresh random tokens, ``--output-len`` tokens out (``--ignore-eos``:
the dataset does not set it, unlike ``random``, and a random model would stop early), ``--num-prompts``
= users x ``--requests-per-user``. The dataset builds each user's requests one after the other and
then shuffles the whole list (``random.shuffle`` seeded by ``--seed``; ``--disable-shuffle`` is not
passed), so a user's requests arrive spread over the run, interleaved with other users'. It needs no
``--random-*`` option (its lengths are its own ``--prefix-repetition-*`` options). ``vllm bench serve``
sends the requests as fast as ``--max-concurrency`` allows (``--request-rate`` inf, its default), and
reports percentiles of TTFT, time per output token, inter-token latency and end-to-end latency
(``--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99``). With its defaults
(``--ready-check-timeout-sec 0``, ``--num-warmups 0``) it sends no request before the timed ones, and
it leaves sampling to the server's defaults.

``--workload mixed`` is seed 001's mixed workload scaled to this machine: the same dataset, a longer
decode (64 tokens out), 2 requests per user, and requests arriving at ``--request-rate`` (0.4 req/s;
``--burstiness`` 1: Poisson arrivals) with no cap on requests in flight, an open loop: a server slower
than the offered load builds a queue, which shows in TTFT. The reasoning behind the rate is at
``MIXED`` below. ``--request-rate`` and ``--concurrency`` also combine (both caps apply).

Rows (each one server, or two, started fresh for the row and stopped after it; one row at a time):

- ``vllm``: vLLM alone (no ``--kv-transfer-config``).
- ``kvtier-dram``: ``KvtierConnector``, DRAM only (``nvme_bytes=0``), ``--dram-gib``.
- ``kvtier-nvme``: ``KvtierConnector``, ``--dram-gib`` of DRAM over ``--nvme-gib`` of NVMe.
- ``kvtier-shared`` (not in the default rows): ``KvtierConnector``, ``--dram-gib`` of DRAM over the
  shared-filesystem tier (``shared_root``, no NVMe tier): a directory of the output's disk standing in
  for the POSIX filesystem replicas share (its capacity is the filesystem's, by the tier's
  watermarks). Its hits are ``shared_hits``.
- ``kvtier-2x-shared`` and ``kvtier-2x-private`` (``--two-servers``): two servers behind a
  round-robin proxy, either on one store path (one host service, one shared pool) or on two store
  paths (two services, two private pools, each with half of ``--dram-gib`` and ``--nvme-gib``, so
  that the host gives kvtier the same memory in both rows). ``vllm bench serve`` takes one
  ``--base-url`` (and one ``--host``/``--port``), and no installed tool round-robins requests, so
  this module runs a small aiohttp reverse proxy (``--run-proxy``, a child process): each
  ``/v1/completions`` request goes to the next server in turn, as a cache-unaware load balancer does,
  so a user's later requests often land on the server that did not compute its prefix. (Two ``vllm
  bench serve`` processes with the same seed, one per server, would send every request to both
  servers: each server would see every user, private pools would hit as well as a shared one, and
  the comparison would measure nothing.) The offered load (``--concurrency``) is the same as for one
  server.
- ``lmcache`` and ``lmcache-disk``: LMCache 0.5.6's vLLM connector (``LMCacheConnectorV1``,
  ``kv_both``), its CPU cache sized like kvtier's DRAM (``--dram-gib``), on ``lmcache-disk`` also its
  local disk backend sized like kvtier's NVMe (``--nvme-gib``), chunks of 256 tokens. ``vllm serve``
  runs from LMCache's own venv (``scripts/install_lmcache_vllm.sh``; ``--lmcache-python``) through
  ``kvtier.bench.lmcache_serve``, which installs kvtier's CPU copy shim (``lmcache_cpu_shim``: LMCache
  has no CPU data mover) in the engine-core and worker processes. The shim publishes its counters
  (tokens copied into and out of vLLM, chunks read from disk) to a file per process that each point
  reads (summed); a row whose shim never
  ran, or loaded no token, or whose log shows LMCache's degraded mode, is a problem. Without the venv
  the rows are skipped with the reason and the install command.
- ``kvtier-object-always`` and ``kvtier-object-auto`` (with ``--slow-link MB/S,...``): a fresh server
  reading a bucket through a slow link, which ``kvtier-object-publish`` (node A, added before them)
  filled by running every point first; per link speed, always-load and kvtier's choice
  (``kvtier.bench.serve_slow``, which says how). ``kvtier-mount-always`` and ``kvtier-mount-auto``
  (with ``--slow-mount MB/S,...``): the same with the shared-filesystem tier read through a slow
  FUSE mount of the directory ``kvtier-mount-publish`` filled.

Points: for each ``--users`` value, one ``vllm bench serve`` run on the row's server(s), kept across
the points of the row (as a deployment keeps its servers). Before each point vLLM's own prefix cache
is reset, and each point uses its own dataset seed (``--seed`` + the point's index; the same seeds
in every row, so rows see the same prompts), so prompts never repeat across points: a point's hits
come from its own users' repeats, while kvtier's pool still holds the earlier points' blocks (a full
pool, as in production). Each server is first warmed up with two requests of its own (a prompt of
the point's shape and a question on it), then its prefix cache is reset.

vLLM's own prefix-cache counters (``/metrics``: ``prefix_cache_hits`` and
``external_prefix_cache_hits``, the tokens a connector said it holds) are read before and after each
point in every row (``cache_tokens``). kvtier counters: the host service's ``dram_hits``,
``nvme_hits`` (blocks loaded, each counted once at the tier it came from: a block the prefetch read
from NVMe counts in ``nvme_hits`` only) and ``puts`` (blocks stored), read with ``service_stats``
right before and right after each point (stores still queued when the load generator returns count
in the next point). After each row its servers
are stopped (SIGTERM) and then its services (``kvtier service stop``), and its store directories
removed, so nothing stays in ``/dev/shm``.

``--kv-events`` turns vLLM's KV-event publisher on in every server (ZMQ on an ``ipc://`` endpoint in
the output directory) and subscribes to it with ``kvtier.kv_index.KvEventIndex``, as a router would:
each point then records its events (in all, per request, per medium: vLLM's GPU blocks and kvtier's
``CPU``/``STORAGE`` tiers) and the bytes per second of the stream. The cost of emitting them is the
difference to the same run without the flag.

Output (``--out DIR``, default a new temporary directory, printed at the end): ``results.json``
(settings, every point with the exact ``vllm serve`` and ``vllm bench serve`` commands, vLLM's
saved result), ``table.md`` (also printed), ``serve.png`` (request throughput, TTFT p99 and TPOT p99
against users, one line per row), ``logs/`` (server logs) and ``bench/`` (``vllm bench serve``'s own JSON and
output per point).

The benchmark's modules: ``serve_plan`` (the rows, workloads and sizes, the command line, the plan),
``serve_servers`` (each row's servers and the round-robin proxy), ``serve_points`` (a point's `vllm
bench serve` run and the counters around it), ``serve_report`` (progress lines, table, plot) and
``serve_slow`` (the slow-link rows); this module runs the rows, one after the other, and ``main``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier import tiers
from kvtier.bench import cpu_account, serve_slow
from kvtier.bench.serve_plan import (
    EVENTS_SETTLE_S,
    LMCACHE_ROWS,
    ROW_LABELS,
    SERVER_ENV,
    SHIM_COUNTERS,
    TWO_SERVER_ROWS,
    BenchError,
    build_parser,
    load_text,
    make_plan,
)
from kvtier.bench.serve_points import (
    cache_metrics,
    check_vllm_command,
    events_delta,
    run_point,
    service_counters,
    shim_counters,
    subscribe,
)
from kvtier.bench.serve_report import TABLE_HEADER, point_line, slow_link_section, table_rows, write_plot
from kvtier.bench.serve_servers import Proxy, command_of, events_args, row_stores, run_proxy, start_server, warm_up
from kvtier.bench.ttft import lmcache_log_problem, markdown_table

# isort: split
# Known as kvtier.bench.serve's before serve.py was split (issue 38): the tests still reach them here.
from kvtier.bench.serve_points import bench_command as bench_command
from kvtier.bench.serve_points import parse_result as parse_result
from kvtier.bench.serve_servers import core_share as core_share
from kvtier.bench.serve_servers import lmcache_config as lmcache_config
from kvtier.bench.serve_servers import server_args as server_args
from kvtier.bench.serve_servers import store_options as store_options
from kvtier.bench.ttft import LMCACHE_INSTALL as LMCACHE_INSTALL
from kvtier.bench.ttft import LMCACHE_VENV as LMCACHE_VENV
from kvtier.bench.ttft import repo_root as repo_root

# --------------------------------------------------------------------------------------------
# rows
# --------------------------------------------------------------------------------------------


def progress(started: float, message: str) -> None:
    print(f"[serve {time.monotonic() - started:6.0f} s] {message}", flush=True)


def row_hit_problems(row: str, record: dict[str, Any], server_log: Path | None) -> list[str]:
    """A row that claims a cache must show hits: kvtier's counters, LMCache's shim (tokens copied into
    vLLM) and LMCache's log (degraded mode)."""
    points = record["points"]
    # kvtier's choice may recompute every hit (a slow tier): its own check is that it decided (serve_slow).
    if row == "vllm" or not points or serve_slow.is_auto_row(row):
        return []
    problems = []
    if row in LMCACHE_ROWS:
        loaded = sum(point.get("lmcache", {}).get("loaded_tokens", 0) for point in points)
        if not any("lmcache" in point for point in points):
            problems.append(
                "kvtier's LMCache CPU copy shim never ran in the engine process (no counters): LMCache had no "
                "data mover and recomputed everything; see the server log"
            )
        elif loaded == 0:
            problems.append("LMCache served no hit: its shim copied 0 tokens into vLLM over every point")
        logged = lmcache_log_problem(server_log.read_text(errors="replace")) if server_log else None
        if logged:
            problems.append(f"LMCache's log reports a failure: {logged}")
    elif any("kvtier" in point for point in points) and not any(
        any(point.get("kvtier", {}).get(f"{tier}_hits") for tier in tiers.ALL) for point in points
    ):
        problems.append("kvtier served no hit (DRAM, NVMe and shared hits 0 at every point)")
    return problems


def measure_point(
    plan: dict[str, Any], row: str, index: int, users: int, base_url: str, out_dir: Path, timeout_s: int, probes: dict
) -> dict[str, Any]:
    """One point with the row's counters read right before and right after it: kvtier's service,
    vLLM's prefix-cache metrics, the LMCache shim's, the KV events."""
    from kvtier.service import socket_peer_pid

    sockets, urls, counters_path, events = probes["sockets"], probes["urls"], probes["shim"], probes["events"]
    before = service_counters(sockets) if sockets else None
    metrics_before = cache_metrics(urls)
    shim_before = shim_counters(counters_path)
    events_before = events.counts() if events is not None else None
    decisions_before = serve_slow.load_decisions(urls) if sockets else None
    service_pids = [pid for socket in sockets if (pid := socket_peer_pid(socket)) is not None]
    cpu_before = cpu_account.snapshot(probes["server_pids"], service_pids)
    point = run_point(plan, row, index, users, base_url, Path(plan["model_dir"]), out_dir, timeout_s)
    cpu_after = cpu_account.snapshot(probes["server_pids"], service_pids)
    point["cpu_s"] = cpu_account.delta(cpu_before, cpu_after, int(point.get("completed") or 0))
    after = service_counters(sockets) if sockets else None
    if before is not None and after is not None:
        point["kvtier"] = {name: after[name] - before[name] for name in after}
        # kvtier's load-or-recompute decisions in blocks per tier and choice (kvtier:load_decisions).
        point["load_decisions"] = serve_slow.decisions_delta(decisions_before, serve_slow.load_decisions(urls))
    metrics_after = cache_metrics(urls)
    if metrics_before is not None and metrics_after is not None:
        point["cache_tokens"] = {name: int(metrics_after[name] - metrics_before[name]) for name in metrics_after}
    shim_after = shim_counters(counters_path)
    if shim_after is not None:
        start = shim_before or dict.fromkeys(SHIM_COUNTERS, 0)
        point["lmcache"] = {name: shim_after[name] - start[name] for name in SHIM_COUNTERS}
    if events is not None and events_before is not None:
        time.sleep(EVENTS_SETTLE_S)  # the last steps' events, and kvtier's next change-log poll
        point["kv_events"] = events_delta(events_before, events.counts(), point)
    return point


def row_title(row: str) -> str:
    """A row's label; a slow tier row's with its speed."""
    rate = serve_slow.row_rate(row)
    label = ROW_LABELS[serve_slow.row_base(row)]
    return label if rate is None else f"{label}, {rate:g} MB/s"


def run_row(plan: dict[str, Any], row: str, out_dir: Path, timeout_s: int, started: float, objects: Any = None) -> dict:
    """One row: its server(s) started, warmed up, every point measured, then all of it stopped and
    removed. ``objects``: the slow tier rows' tier and slow path (serve_slow.SlowTierRows)."""
    from kvtier.service import default_socket_path, stop_service

    record: dict[str, Any] = {"row": row, "label": row_title(row), "servers": [], "points": [], "problems": []}
    if row in LMCACHE_ROWS and plan.get("lmcache_not_measured"):
        record["skipped"] = f"LMCache {plan['lmcache_not_measured']}"
        progress(started, f"{row}: {record['skipped']}")
        return record
    stores = row_stores(row, out_dir / "stores")
    server_count = 2 if row in TWO_SERVER_ROWS else 1
    sockets = sorted({default_socket_path(store) for store in stores})
    servers: list[Any] = []
    proxy: Proxy | None = None
    endpoints = [f"ipc://{out_dir}/events-{row}-{n}.ipc" for n in range(server_count)] if plan["kv_events"] else []
    probes: dict[str, Any] = {
        "sockets": sockets,
        "urls": [],
        "server_pids": [],
        "shim": None,
        "events": subscribe(endpoints),
    }
    log_path = None
    try:
        options = objects.options(row) if objects is not None else {}
        for number in range(server_count):
            extra = events_args(endpoints[number]) if endpoints else []
            server, log_path, probes["shim"] = start_server(plan, row, number, out_dir, stores, extra, options)
            servers.append(server)
            record["servers"].append({"command": command_of(server.process), "log": str(log_path), "url": server.url})
            seconds = server.wait_healthy()  # one after the other: two engines never start at the same time
            progress(started, f"{row}: server {number + 1} of {server_count} healthy after {seconds:.0f} s")
            warm_up(server, plan)
        probes["urls"] = [server.url for server in servers]
        probes["server_pids"] = [server.process.pid for server in servers]
        base_url = servers[0].url
        if len(servers) > 1:
            proxy = Proxy([s.url for s in servers], out_dir / "logs" / f"proxy-{row}.log")
            base_url = proxy.url
            record["proxy"] = {"command": command_of(proxy.process), "url": proxy.url}
        for index, users in enumerate(plan["users"]):
            for server in servers:
                server.reset_prefix_cache()
            progress(started, f"{row}: {users} users, {users * plan['requests_per_user']} requests")
            point = measure_point(plan, row, index, users, base_url, out_dir, timeout_s, probes)
            record["points"].append(point)
            if point.get("failed"):
                record["problems"].append(f"{users} users: {point['failed']} requests failed")
            progress(started, f"{row}: {users} users: {point_line(point)}")
    except Exception as error:
        record["problems"].append(f"{type(error).__name__}: {error}")
        print(f"kvtier bench serve: {row}: {error}", file=sys.stderr, flush=True)
    finally:
        if proxy is not None:
            proxy.stop()
        for server in servers:
            server.stop()
        if probes["events"] is not None:
            probes["events"].close()
        for socket in sockets:
            if not stop_service(socket):
                record["problems"].append(f"the kvtier service on {socket} did not stop")
        for store in {*stores, out_dir / "stores" / row}:
            shutil.rmtree(store, ignore_errors=True)
    record["problems"] += row_hit_problems(row, record, log_path) + serve_slow.row_problems(row, record["points"])
    return record


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def run_rows(plan: dict[str, Any], document: dict[str, Any], out_dir: Path, timeout_s: int, started: float) -> None:
    """Runs the rows in order into ``document``, writing results.json after each (a partial run keeps
    its rows). A row given twice (vLLM alone first and last: drift over the run favors no row) runs
    again in a directory of its own; serve-summary pools its points with the first run's."""
    occurrences: dict[str, int] = {}
    with serve_slow.SlowTierRows(plan, out_dir, lambda message: progress(started, message)) as objects:
        for row in plan["rows"]:
            occurrence = occurrences[row] = occurrences.get(row, 0) + 1
            row_dir = out_dir if occurrence == 1 else out_dir / f"{row}-{occurrence}"
            row_dir.mkdir(parents=True, exist_ok=True)
            record = run_row(plan, row, row_dir, timeout_s, started, objects)
            objects.row_done(row, record)
            record["occurrence"] = occurrence
            document["rows"].append(record)
            (out_dir / "results.json").write_text(json.dumps(document, indent=2) + "\n")


@contextlib.contextmanager
def own_runtime_dir() -> Iterator[None]:
    """The run's servers and services get a runtime directory of their own (XDG_RUNTIME_DIR: their
    sockets, and the costs files the engines leave each other for load or recompute), so that no costs
    file of another run or engine of the model on this host steers this run's choices; removed after."""
    saved = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="kvtier-serve-run-")
    try:
        yield
    finally:
        shutil.rmtree(os.environ["XDG_RUNTIME_DIR"], ignore_errors=True)
        if saved is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = saved


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.run_proxy:
        return run_proxy(int(args.run_proxy[0]), args.run_proxy[1:])
    try:
        plan = make_plan(args)
    except (BenchError, ValueError) as error:
        print(f"kvtier bench serve: {error}", file=sys.stderr)
        return 2
    from kvtier.models import PRESETS, ensure_bench_model

    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="kvtier-bench-serve-"))
    out_dir = out_dir.absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        check_vllm_command()
    except BenchError as error:
        print(f"kvtier bench serve: {error}", file=sys.stderr)
        return 1
    model_dir = ensure_bench_model(plan["preset"])
    plan["model_dir"] = str(model_dir)
    kv_bytes = PRESETS[plan["preset"]].kv_bytes_per_token if plan["preset"] in PRESETS else None
    settings = dict(plan)
    settings.update(
        model_dir=str(model_dir),
        kv_bytes_per_token=kv_bytes,
        cpu_count=os.cpu_count(),
        server_env={**SERVER_ENV, "VLLM_CPU_KVCACHE_SPACE": str(plan["vllm_kv_gib"])},
    )
    document: dict[str, Any] = {
        "benchmark": "kvtier bench serve",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "settings": settings,
        "rows": [],
    }
    prefix_mib = f", {plan['prefix_len'] * kv_bytes / 2**20:.0f} MiB of KV per prefix" if kv_bytes else ""
    print(
        f"kvtier bench serve ({plan['workload']}): {plan['preset']}, users {plan['users']}, "
        f"{plan['requests_per_user']} requests per user, {load_text(plan)}, prefix {plan['prefix_len']} + question "
        f"{plan['suffix_len']} tokens"
        f"{prefix_mib}, {plan['output_len']} output tokens; rows {', '.join(plan['rows'])}\nresults {out_dir}",
        flush=True,
    )
    results_path = out_dir / "results.json"
    with own_runtime_dir():
        run_rows(plan, document, out_dir, args.point_timeout_s, started)
    table = markdown_table(TABLE_HEADER, table_rows(document)) + slow_link_section(document)
    (out_dir / "table.md").write_text(table + "\n")
    print(table)
    problems = [f"{record['row']}: {problem}" for record in document["rows"] for problem in record["problems"]]
    plot_note = write_plot(document, out_dir / "serve.png")
    document["plot"] = None if plot_note else "serve.png"
    document["problems"] = problems
    results_path.write_text(json.dumps(document, indent=2) + "\n")
    for problem in problems:
        print(f"problem: {problem}")
    for record in document["rows"]:
        if record.get("skipped"):
            print(f"note: {record['row']}: {record['skipped']}")
    if plot_note:
        print(f"note: {plot_note}")
    print(f"results: {results_path}" + ("" if plot_note else f", plot: {out_dir / 'serve.png'}"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
