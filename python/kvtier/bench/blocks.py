"""``kvtier bench blocks``: TTFT against the engine's block size (seed 002's experiment 3).

kvtier stores one object per engine block, so the engine's block size is kvtier's chunk size: a
larger block means fewer, larger objects and I/O requests. For each block size this runs ``kvtier
bench ttft`` (experiment 1 at one prompt length: recompute, vLLM's prefix cache, a kvtier miss, DRAM
and NVMe hits, fio reading the same bytes; its own engines, store and service), then puts the rows
side by side with the I/O pattern of the NVMe hits (requests and their mean size, from kvtier's
counters). Writes ``results.json``, ``report.md`` and ``ttft_vs_block.png`` in ``--out``; each block
size's full ``kvtier bench ttft`` output is in ``--out``/block-N.

With ``--shared-root-store PATH --shared-root-load PATH`` (two mounts of one shared filesystem, e.g.
GlusterFS: ``scripts/distfs/bench_filesystems.py --only exp3``) each run also measures ttft's
``kvtier_shared`` row (node A's engine publishes, a fresh engine on node B with an empty local store
reads every block from the shared tier), so each block size gets the local NVMe hit and the shared
hit side by side. ``--shared-file-bytes 64MiB,256MiB,1GiB`` then sweeps the shared tier's grouping
(``shared_file_bytes``: blocks per published file) at one block size (``--file-bytes-block``), one
more ``kvtier bench ttft`` per size (in ``--out``/block-N-file-SIZE; a size equal to the store's
default at a block size already swept reuses that run), reported as its own table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.bench import io_pattern, ttft

DEFAULT_BLOCKS = "64,128,256,512,1024"
SMALL_BLOCKS = "64,256"
CONFIGS = ("recompute", "vllm_prefix", "kvtier_miss", "kvtier_dram", "kvtier_nvme", "disk_floor", "kvtier_shared")
PREFIX = "[blocks] "
DEFAULT_SHARED_FILE_BYTES = 256 << 20  # the store's shared_file_bytes default (docs/configuration.md)


def parse_blocks(text: str) -> list[int]:
    blocks = sorted({int(part) for part in text.split(",") if part.strip()})
    if not blocks or any(b < ttft.CPU_BLOCK_MULTIPLE or b % ttft.CPU_BLOCK_MULTIPLE for b in blocks):
        raise ttft.BenchError(f"--block-tokens: positive multiples of {ttft.CPU_BLOCK_MULTIPLE}, e.g. {DEFAULT_BLOCKS}")
    return blocks


def parse_file_bytes(text: str) -> list[int]:
    from kvtier.ops.maintenance import parse_size

    try:
        sizes = sorted({parse_size(part) for part in text.split(",") if part.strip()})
    except ValueError as error:
        raise ttft.BenchError(f"--shared-file-bytes: {error}") from None
    if not sizes:
        raise ttft.BenchError("--shared-file-bytes: give sizes, e.g. 64MiB,256MiB,1GiB")
    return sizes


def size_label(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return str(size)


def run_one(
    args: argparse.Namespace, block: int, length: int, out_dir: Path, file_bytes: int | None = None
) -> dict[str, Any]:
    """One ``kvtier bench ttft`` run at this block size (and shared file size); its results.json."""
    argv = ["--lengths", str(length), "--hit-rate-length", "0", "--skip-lmcache", "--skip-example-connector"]
    argv += ["--block-tokens", str(block), "--out", str(out_dir)]
    if args.shared_root_store:
        argv += ["--shared-root-store", args.shared_root_store, "--shared-root-load", args.shared_root_load]
    if file_bytes:
        argv += ["--shared-file-bytes", str(file_bytes)]
    if args.small:
        argv.append("--small")
    if args.preset:
        argv += ["--preset", args.preset]
    if args.repeats:
        argv += ["--repeats", str(args.repeats)]
    if args.store_dir:
        argv += ["--store-dir", str(Path(args.store_dir) / out_dir.name)]
    code = ttft.main(argv)
    results = out_dir / "results.json"
    if not results.exists():
        raise ttft.BenchError(f"kvtier bench ttft at block size {block} wrote no results (exit {code})")
    return json.loads(results.read_text())


def row_of(block: int, length: int, result: dict[str, Any]) -> dict[str, Any]:
    """Median TTFT (ms) per configuration, and the NVMe hits' read pattern."""
    experiment1 = result["summary"]["experiment1"]
    row: dict[str, Any] = {"block_tokens": block, "object_bytes": result["plan"]["kv_bytes_per_token"] * block}
    for config in CONFIGS:
        spread = experiment1.get(config, {}).get(str(length), {}).get("ttft_s")
        row[f"{config}_ms"] = spread["median"] * 1e3 if spread else None
    shared = experiment1.get("kvtier_shared", {}).get(str(length), {}).get("ttft_s")
    row["kvtier_shared_min_ms"] = shared["min"] * 1e3 if shared else None
    row["kvtier_shared_max_ms"] = shared["max"] * 1e3 if shared else None
    row["kvtier_shared_n"] = shared["n"] if shared else 0
    shared_plan = result["plan"].get("shared") or {}
    publisher = result["phases"].get("kvtier_shared_store", {}).get("store_stats", {})
    row["shared_file_bytes"] = shared_plan.get("file_bytes") or (DEFAULT_SHARED_FILE_BYTES if shared_plan else None)
    row["shared_files_per_prompt"] = (
        publisher["shared_files_published"] / shared_plan["prompts"]
        if shared_plan and "shared_files_published" in publisher
        else None
    )
    nvme_stats = result["phases"].get("kvtier_nvme", {}).get("store_stats", {})
    reads = io_pattern.pattern_of(nvme_stats)["read"]
    row["nvme_read_requests"] = reads["requests"]
    row["nvme_mean_read_kib"] = reads["mean_request_bytes"] / 1024 if reads["mean_request_bytes"] else None
    row["nvme_read_sequential"] = reads["sequential_share"]
    problems = {problem for entry in experiment1.values() for problem in entry.get(str(length), {}).get("problems", [])}
    # ttft's own verdicts on the run (a shared hit not read from the shared tier, a phase that failed).
    problems |= {note for note in result.get("notes", []) if note.startswith(("kvtier_shared FAILED", "incomplete"))}
    row["problems"] = sorted(problems)
    return row


def shared_cell(row: dict[str, Any]) -> str:
    """The shared hit's median (min-max) in ms."""
    if row.get("kvtier_shared_ms") is None:
        return "-"
    return f"{row['kvtier_shared_ms']:.0f} ({row['kvtier_shared_min_ms']:.0f}-{row['kvtier_shared_max_ms']:.0f})"


def report(
    rows: list[dict[str, Any]], length: int, file_rows: list[dict[str, Any]] | None = None, file_block: int = 0
) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    shared = any(r.get("kvtier_shared_ms") is not None for r in rows)
    header = ["block (tokens)", "object", "recompute", "vLLM prefix hit", "kvtier miss", "DRAM hit", "NVMe hit"]
    header += ["shared hit (min-max)", "shared / NVMe"] if shared else []
    header += ["fio read", "NVMe - DRAM over fio", "reads per NVMe hit run", "mean read", "sequential"]
    lines = []
    for r in rows:
        dram, nvme, fio = r["kvtier_dram_ms"], r["kvtier_nvme_ms"], r["disk_floor_ms"]
        over_fio = f"{(nvme - dram) / fio:.2f}" if None not in (dram, nvme, fio) and fio else "-"
        mean_read = f"{r['nvme_mean_read_kib'] / 1024:.2f} MiB" if r["nvme_mean_read_kib"] else "-"
        sequential = "-" if r["nvme_read_sequential"] is None else f"{100 * r['nvme_read_sequential']:.0f}%"
        cells = [str(r["block_tokens"]), f"{r['object_bytes'] / 2**20:.2f} MiB"]
        cells += [ms(r[f"{c}_ms"]) for c in CONFIGS[:5]]
        if shared:
            ratio = f"{r['kvtier_shared_ms'] / nvme:.2f}" if r.get("kvtier_shared_ms") and nvme else "-"
            cells += [shared_cell(r), ratio]
        cells += [ms(fio), over_fio]
        cells += [str(r["nvme_read_requests"]), mean_read, sequential]
        lines.append(cells)
    title = f"### TTFT vs the engine's block size at {length} tokens (ms, medians; experiment 3)"
    text = [title, "", ttft.markdown_table(header, lines), ""]
    if file_rows:
        title = f"### Shared-tier hit vs shared_file_bytes at {file_block}-token blocks, {length} tokens (ms)"
        header = ["shared_file_bytes", "files per prompt", "shared hit median", "min", "max", "n", "NVMe hit median"]
        header += ["shared / NVMe"]
        lines = []
        for r in file_rows:
            per_prompt = r.get("shared_files_per_prompt")
            nvme, hit = r["kvtier_nvme_ms"], r.get("kvtier_shared_ms")
            files = "-" if per_prompt is None else f"{per_prompt:.1f}"
            spread = [
                ms(r.get("kvtier_shared_min_ms")),
                ms(r.get("kvtier_shared_max_ms")),
                str(r.get("kvtier_shared_n")),
            ]
            ratio = f"{hit / nvme:.2f}" if hit and nvme else "-"
            lines.append([size_label(r["shared_file_bytes"]), files, ms(hit), *spread, ms(nvme), ratio])
        text += [title, "", ttft.markdown_table(header, lines), ""]
    labelled = [(f"block {r['block_tokens']}", r) for r in rows]
    labelled += [
        (f"block {r['block_tokens']}, shared_file_bytes {size_label(r['shared_file_bytes'])}", r)
        for r in file_rows or []
        if not any(r is row for row in rows)  # a reused run is listed once
    ]
    text += [f"- {label}: " + "; ".join(r["problems"]) for label, r in labelled if r["problems"]]
    return "\n".join(text) + "\n"


def plot(rows: list[dict[str, Any]], length: int, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    blocks = [r["block_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 5))
    curves = (
        ("kvtier_dram", "kvtier DRAM hit"),
        ("kvtier_nvme", "kvtier NVMe hit"),
        ("kvtier_shared", "kvtier shared-tier hit (node B, empty local store)"),
        ("disk_floor", "fio read of the same bytes"),
        ("vllm_prefix", "vLLM prefix-cache hit"),
    )
    for config, label in curves:
        measured = [r for r in rows if r.get(f"{config}_ms") is not None]
        if not measured:
            continue
        x, y = [r["block_tokens"] for r in measured], [r[f"{config}_ms"] for r in measured]
        if config == "kvtier_shared":  # min-max of the repeats as error bars
            low = [r[f"{config}_ms"] - r[f"{config}_min_ms"] for r in measured]
            high = [r[f"{config}_max_ms"] - r[f"{config}_ms"] for r in measured]
            ax.errorbar(x, y, yerr=[low, high], marker="o", capsize=3, label=label + " (min-max)")
        else:
            ax.plot(x, y, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(blocks, [str(b) for b in blocks])
    ax.set_xlabel("engine block size (tokens) = kvtier object")
    ax.set_ylabel("TTFT (ms, median)")
    ax.set_title(f"TTFT vs block size, {length}-token prompt")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, fontsize=8)  # below: clear of the curves
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier bench blocks", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--block-tokens", default=None, help=f"block sizes (default {DEFAULT_BLOCKS}; --small: {SMALL_BLOCKS})"
    )
    parser.add_argument("--length", default=None, help="prompt length in tokens (default 8k; --small: 1k)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per point (default 2; --small: 1)")
    parser.add_argument("--preset", default=None, help="model preset (default kv8b; tiny with --small)")
    parser.add_argument("--small", action="store_true", help="CI size: tiny model, 1K tokens, blocks 64 and 256")
    parser.add_argument("--out", help="output directory (default bench-results/blocks-<timestamp>)")
    parser.add_argument("--store-dir", help="where each run's store lives (default: temporary directories)")
    parser.add_argument(
        "--shared-root-store", metavar="PATH",
        help="with --shared-root-load: each run also measures a shared-tier hit (ttft's kvtier_shared row); "
        "node A's view of the shared directory",
    )  # fmt: skip
    parser.add_argument("--shared-root-load", metavar="PATH", help="node B's view of the same directory")
    parser.add_argument(
        "--shared-file-bytes", metavar="SIZES",
        help="with the shared roots: also sweep the shared tier's shared_file_bytes (e.g. 64MiB,256MiB,1GiB) "
        "at --file-bytes-block, one kvtier bench ttft per size",
    )  # fmt: skip
    parser.add_argument(
        "--file-bytes-block", type=int, default=None, help="block size of the --shared-file-bytes sweep (default 256)"
    )
    return parser


@dataclasses.dataclass(frozen=True)
class Sweep:
    """The block sizes at one prompt length, and the shared_file_bytes sweep (``file_sizes``, maybe none)
    at one block size."""

    blocks: list[int]
    length: int
    file_sizes: list[int]
    file_block: int

    def runs(self) -> list[tuple[int, int | None]]:
        """(block, shared_file_bytes or None: the default), in order; a file size equal to the default
        at a block size of the sweep is that run."""
        runs: list[tuple[int, int | None]] = [(block, None) for block in self.blocks]
        runs += [
            (self.file_block, size)
            for size in self.file_sizes
            if not (size == DEFAULT_SHARED_FILE_BYTES and self.file_block in self.blocks)
        ]
        return runs


def parse_sweep(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Sweep:
    """The sweep of the command line; a usage error (exit 2) when it does not fit together."""
    try:
        blocks = parse_blocks(args.block_tokens or (SMALL_BLOCKS if args.small else DEFAULT_BLOCKS))
        length = ttft.parse_tokens(args.length or ("1k" if args.small else "8k"))
        if bool(args.shared_root_store) != bool(args.shared_root_load):
            raise ttft.BenchError("--shared-root-store and --shared-root-load go together")
        file_sizes = parse_file_bytes(args.shared_file_bytes) if args.shared_file_bytes else []
        if file_sizes and not args.shared_root_store:
            raise ttft.BenchError("--shared-file-bytes needs --shared-root-store and --shared-root-load")
        file_block = parse_blocks(str(args.file_bytes_block or 256))[0]
        if any(length % block for block in [*blocks, *([file_block] if file_sizes else [])]):
            raise ttft.BenchError(f"--length {length} must be a multiple of every block size {blocks}")
        return Sweep(blocks, length, file_sizes, file_block)
    except ttft.BenchError as error:
        parser.error(str(error))


def run_sweep(
    args: argparse.Namespace, sweep: Sweep, out_dir: Path
) -> dict[tuple[int, int | None], dict[str, Any]] | None:
    """One ``kvtier bench ttft`` per run of the sweep, with a progress line each: the rows by (block,
    shared_file_bytes or None); None when a run failed (said on stderr)."""
    runs = sweep.runs()
    by_run: dict[tuple[int, int | None], dict[str, Any]] = {}
    durations: list[float] = []
    for i, (block, size) in enumerate(runs):
        left = f", about {statistics.mean(durations) * (len(runs) - i):.0f} s left" if durations else ""
        name = f"block-{block}" + (f"-file-{size_label(size)}" if size else "")
        print(f"{PREFIX}{name} ({i + 1} of {len(runs)}{left}): kvtier bench ttft", flush=True)
        began = time.time()
        try:
            result = run_one(args, block, sweep.length, out_dir / name, size)
        except ttft.BenchError as error:
            print(f"kvtier bench blocks: {error}", file=sys.stderr)
            return None
        durations.append(time.time() - began)
        by_run[(block, size)] = row_of(block, sweep.length, result)
    return by_run


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.repeats is None:
        args.repeats = 1 if args.small else 2
    sweep = parse_sweep(parser, args)
    length, file_block = sweep.length, sweep.file_block
    out_dir = Path(args.out or f"bench-results/blocks-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    by_run = run_sweep(args, sweep, out_dir)
    if by_run is None:
        return 1
    rows = [by_run[(block, None)] for block in sweep.blocks]
    file_rows = [by_run.get((file_block, size)) or by_run[(file_block, None)] for size in sweep.file_sizes]
    markdown = report(rows, length, file_rows, file_block)
    print(markdown)
    plots = ["ttft_vs_block.png"] if plot(rows, length, out_dir / "ttft_vs_block.png") else []
    document = {
        "benchmark": "kvtier bench blocks",
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "duration_s": time.time() - started,
        "length_tokens": length,
        "rows": rows,
        "file_bytes_block": file_block if sweep.file_sizes else None,
        "file_rows": file_rows,
        "plots": plots,
    }
    (out_dir / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    (out_dir / "report.md").write_text(markdown)
    print(f"wrote {out_dir / 'results.json'}, {out_dir / 'report.md'}" + "".join(f", {out_dir / p}" for p in plots))
    return 0 if all(not r["problems"] for r in [*rows, *file_rows]) else 1


if __name__ == "__main__":
    sys.exit(main())
