"""`kvtier bench faults`'s arguments and plan: the faults it knows, its full and CI sizes, the command
line, and the plan every row runs (``kvtier.bench.faults`` runs it)."""

from __future__ import annotations

import argparse
from typing import Any

from kvtier.bench import faults_tiers, faults_ties, serve_plan
from kvtier.bench.faults_tiers import DISK_FULL, NVME_STOP, READ_ERRORS, TIER_FAULTS
from kvtier.bench.faults_ties import BASELINE_ROW
from kvtier.bench.ttft import parse_tokens

FAULTS = ("service-stop", "service-kill", READ_ERRORS, NVME_STOP, DISK_FULL, *TIER_FAULTS)
DEFAULT_FAULTS = ("service-stop", "service-kill")
BURSTINESS = 100.0  # gamma shape of the arrival gaps: nearly even
FULL = {
    "preset": "kv8b", "users": 8, "requests_per_user": 3, "concurrency": 4, "prefix_len": 2048, "suffix_len": 64,
    "output_len": 16, "dram_gib": 2.0, "nvme_gib": 8.0, "vllm_blocks": None, "fault_after_s": 3.0, "after_s": 12.0,
}  # fmt: skip
# CI size: the tiny model, vLLM's own KV cache cut to a few blocks so that kvtier serves the repeats.
# The fault from 6 s, the load 9 s past its end: with --fault-s 5 the same 0.40 req/s as before (arrivals
# at about 0, 2.4, 4.8, 7.1, 9.7, 12.1, 14.4, 17.0 s), and the fault (6 s to 11 s) covers the 9.7-s
# request, the one repeat vLLM's own 12 blocks no longer hold (seed 0's order: its prefix was last sent
# at 2.4 s), so kvtier serves it from the faulted tier. From 3 s (the full size's start) it ended before.
SMALL = {
    "preset": "tiny", "users": 4, "requests_per_user": 2, "concurrency": 4, "prefix_len": 512, "suffix_len": 64,
    "output_len": 4, "dram_gib": 0.25, "nvme_gib": 1.0, "vllm_blocks": 12, "fault_after_s": 6.0, "after_s": 9.0,
}  # fmt: skip


class FaultError(RuntimeError):
    """A fault could not be injected (no service to signal), or the arguments are wrong."""


# --------------------------------------------------------------------------------------------
# arguments and plan
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier bench faults",
        description="Faults under load: vllm bench serve against vllm serve with kvtier (DRAM+NVMe) while a fault "
        "is injected mid-run (the host service stopped or killed, NVMe read errors, a hung NVMe disk; the S3 gateway "
        "stopped or killed, "
        "the shared filesystem's FUSE daemon stopped, each with the row's hits read from that tier), against vLLM "
        "alone under the same load: failed requests, wrong outputs (greedy, against vLLM alone's), throughput, TTFT, "
        "time until kvtier hits again, reads of the faulted tier during the fault.",
    )
    parser.add_argument("--small", action="store_true", help="CI size: tiny model, 4 users x 2 requests")
    parser.add_argument(
        "--faults", default=",".join(DEFAULT_FAULTS),
        help=f"comma-separated, from {', '.join(FAULTS)} (default {','.join(DEFAULT_FAULTS)}; {READ_ERRORS}, "
        f"{NVME_STOP} and fuse-stop need FUSE: kvtier.bench.slowmount; {DISK_FULL} needs root, mkfs.ext4 and a "
        "loop device; "
        "bucket-stop and bucket-kill need root and Ceph's radosgw, "
        "brought up on 127.0.0.1 by scripts/distfs/radosgw.sh, ports KVTIER_RGW_PORT and KVTIER_CEPH_MON_PORT)",
    )  # fmt: skip
    parser.add_argument("--fault-s", type=float, default=20.0, help="how long each fault lasts (default 20)")
    parser.add_argument(
        "--fault-after-s", type=float,
        help="fault start after the load's start (default 3; --small: 6, so that the fault covers the repeat that "
        "kvtier serves from its tier)",
    )  # fmt: skip
    parser.add_argument(
        "--after-s", type=float, help="seconds of load after the fault's end (default 12; --small: 9)"
    )  # fmt: skip
    parser.add_argument("--preset", help="model preset of kvtier.models (default kv8b; --small: tiny)")
    parser.add_argument("--users", type=int, help="users, one system prompt each (default 8; --small: 4)")
    parser.add_argument("--requests-per-user", type=int, help="requests per user (default 3; --small: 2)")
    parser.add_argument("--concurrency", type=int, help="at most this many requests in flight (default 4)")
    parser.add_argument("--prefix-len", help="tokens of each user's system prompt (default 2k; --small: 512)")
    parser.add_argument("--suffix-len", help="tokens of each question (default 64)")
    parser.add_argument("--output-len", type=int, help="tokens generated per request (default 16; --small: 4)")
    parser.add_argument("--request-rate", type=float, help="requests/s (default: the requests spread over the run)")
    parser.add_argument("--dram-gib", type=float, help="kvtier's DRAM tier, GiB (default 2; --small: 0.25)")
    parser.add_argument("--nvme-gib", type=float, help="kvtier's NVMe tier, GiB (default 8; --small: 1)")
    parser.add_argument("--vllm-blocks", type=int, help="vLLM's own KV cache in blocks (--small: 12)")
    parser.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE, GiB")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (the same in every row)")
    parser.add_argument(
        "--reference-runs", type=int, default=1,
        help="runs of vLLM alone (default 1). With 2 or more, a request whose greedy output differs between them "
        "(a model whose top tokens nearly tie, as the random-weight presets' do under CPU batching) is unstable: "
        "left out of every row's wrong outputs, and counted",
    )  # fmt: skip
    parser.add_argument(
        "--tie-nats", type=float, default=faults_ties.DEFAULT_TIE_NATS,
        help="an output that differs from vLLM alone's is cleared as a near tie when, at each token where it "
        "leaves vLLM alone's greedy path (from a fresh server, one request at a time), it took a top-"
        f"{faults_ties.TOP_LOGPROBS} token at most this many nats below the path's (default "
        f"{faults_ties.DEFAULT_TIE_NATS}; kvtier.bench.faults_ties)",
    )  # fmt: skip
    parser.add_argument(
        "--no-tie-check", action="store_true", help="count every output that differs as wrong (no near-tie check)"
    )  # fmt: skip
    parser.add_argument(
        "--recheck", metavar="DIR", help="judge a finished run's outputs again (near-tie check), rewriting its table"
    )  # fmt: skip
    parser.add_argument("--out", help="output directory (default: a new temporary directory)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG", help="one more vllm serve arg")
    parser.add_argument("--bench-arg", action="append", default=[], metavar="ARG", help="one more bench serve arg")
    parser.add_argument("--point-timeout-s", type=int, default=3600, help="limit per row's load")
    parser.add_argument(
        "--rgw-state-dir", default=faults_tiers.DEFAULT_RGW_STATE_DIR,
        help=f"state directory of the bucket rows' gateway (default {faults_tiers.DEFAULT_RGW_STATE_DIR}; removed)",
    )  # fmt: skip
    return parser


def parse_faults(text: str) -> list[str]:
    faults = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [fault for fault in faults if fault not in FAULTS]
    if unknown:
        raise FaultError(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}")
    if not faults:
        raise FaultError("--faults names no fault")
    return faults


def make_plan(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting of the run (a plan kvtier.bench.serve's commands and servers take), defaults filled in."""
    sizes = SMALL if args.small else FULL

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return sizes[name] if value is None else value

    plan: dict[str, Any] = {name: pick(name) for name in sizes}
    fault_after_s, after_s = plan.pop("fault_after_s"), plan.pop("after_s")
    for name in ("prefix_len", "suffix_len"):
        plan[name] = parse_tokens(str(plan[name]))
    if min(plan["users"], plan["requests_per_user"], plan["concurrency"], plan["output_len"]) < 1:
        raise FaultError("--users, --requests-per-user, --concurrency and --output-len must be at least 1")
    if args.reference_runs < 1:
        raise FaultError("--reference-runs must be at least 1 (vLLM alone is every row's reference)")
    references = [BASELINE_ROW, *(f"{BASELINE_ROW}-{run}" for run in range(2, args.reference_runs + 1))]
    if args.fault_s <= 0 or fault_after_s < 0 or after_s < 0:
        raise FaultError("--fault-s must be above 0, --fault-after-s and --after-s at least 0")
    requests = plan["users"] * plan["requests_per_user"]
    span_s = fault_after_s + args.fault_s + after_s
    rate = args.request_rate if args.request_rate is not None else requests / span_s
    if rate <= 0:
        raise FaultError("--request-rate must be above 0")
    plan.update(
        faults=parse_faults(args.faults), fault_s=args.fault_s, fault_after_s=fault_after_s,
        after_s=after_s, request_rate=rate, burstiness=BURSTINESS, vllm_kv_gib=args.vllm_kv_gib,
        seed=args.seed, server_args=list(args.server_arg), small=args.small, workload="faults", kv_events=False,
        bench_args=["--temperature", "0", *args.bench_arg],
        rows=[*references, *parse_faults(args.faults)],
    )  # fmt: skip
    plan["max_model_len"] = plan["prefix_len"] + plan["suffix_len"] + plan["output_len"] + serve_plan.MODEL_LEN_MARGIN
    if any(fault in TIER_FAULTS for fault in plan["faults"]):
        plan["rgw_state_dir"] = args.rgw_state_dir
        plan["bucket_osd_bytes"] = osd_bytes(plan)
    return plan


def osd_bytes(plan: dict[str, Any]) -> int:
    """The local gateway's memstore OSD (RAM): every bucket row's prefixes, with room."""
    from kvtier.bench.serve_slow import osd_bytes as object_rows_osd_bytes
    from kvtier.models import PRESETS

    kv_bytes = PRESETS[plan["preset"]].kv_bytes_per_token if plan["preset"] in PRESETS else None
    rows = sum(fault.startswith("bucket-") for fault in plan["faults"])
    return object_rows_osd_bytes([plan["users"]] * rows, plan["prefix_len"] + plan["suffix_len"], kv_bytes)
