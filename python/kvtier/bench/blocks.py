"""``kvtier bench blocks``: TTFT against the engine's block size (seed 002's experiment 3).

kvtier stores one object per engine block, so the engine's block size is kvtier's chunk size: a
larger block means fewer, larger objects and I/O requests. For each block size this runs ``kvtier
bench ttft`` (experiment 1 at one prompt length: recompute, vLLM's prefix cache, a kvtier miss, DRAM
and NVMe hits, fio reading the same bytes; its own engines, store and service), then puts the rows
side by side with the I/O pattern of the NVMe hits (requests and their mean size, from kvtier's
counters). Writes ``results.json``, ``report.md`` and ``ttft_vs_block.png`` in ``--out``; each block
size's full ``kvtier bench ttft`` output is in ``--out``/block-N.

Not covered: the shared tier's grouping and GlusterFS (the sweep runs on the local NVMe tier).
"""

from __future__ import annotations

import argparse
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
CONFIGS = ("recompute", "vllm_prefix", "kvtier_miss", "kvtier_dram", "kvtier_nvme", "disk_floor")
PREFIX = "[blocks] "


def parse_blocks(text: str) -> list[int]:
    blocks = sorted({int(part) for part in text.split(",") if part.strip()})
    if not blocks or any(b < ttft.CPU_BLOCK_MULTIPLE or b % ttft.CPU_BLOCK_MULTIPLE for b in blocks):
        raise ttft.BenchError(f"--block-tokens: positive multiples of {ttft.CPU_BLOCK_MULTIPLE}, e.g. {DEFAULT_BLOCKS}")
    return blocks


def run_one(args: argparse.Namespace, block: int, length: int, out_dir: Path) -> dict[str, Any]:
    """One ``kvtier bench ttft`` run at this block size; its results.json."""
    argv = ["--lengths", str(length), "--hit-rate-length", "0", "--skip-lmcache", "--skip-example-connector"]
    argv += ["--block-tokens", str(block), "--out", str(out_dir)]
    if args.small:
        argv.append("--small")
    if args.preset:
        argv += ["--preset", args.preset]
    if args.repeats:
        argv += ["--repeats", str(args.repeats)]
    if args.store_dir:
        argv += ["--store-dir", str(Path(args.store_dir) / f"block-{block}")]
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
    nvme_stats = result["phases"].get("kvtier_nvme", {}).get("store_stats", {})
    reads = io_pattern.pattern_of(nvme_stats)["read"]
    row["nvme_read_requests"] = reads["requests"]
    row["nvme_mean_read_kib"] = reads["mean_request_bytes"] / 1024 if reads["mean_request_bytes"] else None
    row["nvme_read_sequential"] = reads["sequential_share"]
    row["problems"] = sorted(
        {problem for entry in experiment1.values() for problem in entry.get(str(length), {}).get("problems", [])}
    )
    return row


def report(rows: list[dict[str, Any]], length: int) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    header = ["block (tokens)", "object", "recompute", "vLLM prefix hit", "kvtier miss", "DRAM hit", "NVMe hit"]
    header += ["fio read", "NVMe - DRAM over fio", "reads per NVMe hit run", "mean read", "sequential"]
    lines = []
    for r in rows:
        dram, nvme, fio = r["kvtier_dram_ms"], r["kvtier_nvme_ms"], r["disk_floor_ms"]
        over_fio = f"{(nvme - dram) / fio:.2f}" if None not in (dram, nvme, fio) and fio else "-"
        mean_read = f"{r['nvme_mean_read_kib'] / 1024:.2f} MiB" if r["nvme_mean_read_kib"] else "-"
        sequential = "-" if r["nvme_read_sequential"] is None else f"{100 * r['nvme_read_sequential']:.0f}%"
        cells = [str(r["block_tokens"]), f"{r['object_bytes'] / 2**20:.2f} MiB"]
        cells += [ms(r[f"{c}_ms"]) for c in CONFIGS[:5]] + [ms(fio), over_fio]
        cells += [str(r["nvme_read_requests"]), mean_read, sequential]
        lines.append(cells)
    title = f"### TTFT vs the engine's block size at {length} tokens (ms, medians; experiment 3)"
    text = [title, "", ttft.markdown_table(header, lines), ""]
    for r in rows:
        if r["problems"]:
            text.append(f"- block {r['block_tokens']}: " + "; ".join(r["problems"]))
    return "\n".join(text) + "\n"


def plot(rows: list[dict[str, Any]], length: int, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    blocks = [r["block_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    curves = (
        ("kvtier_dram", "kvtier DRAM hit"),
        ("kvtier_nvme", "kvtier NVMe hit"),
        ("disk_floor", "fio read of the same bytes"),
        ("vllm_prefix", "vLLM prefix-cache hit"),
    )
    for config, label in curves:
        points = [(b, r[f"{config}_ms"]) for b, r in zip(blocks, rows, strict=True) if r[f"{config}_ms"] is not None]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(blocks, [str(b) for b in blocks])
    ax.set_xlabel("engine block size (tokens) = kvtier object")
    ax.set_ylabel("TTFT (ms, median)")
    ax.set_title(f"TTFT vs block size, {length}-token prompt")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
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
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.repeats is None:
        args.repeats = 1 if args.small else 2
    try:
        blocks = parse_blocks(args.block_tokens or (SMALL_BLOCKS if args.small else DEFAULT_BLOCKS))
        length = ttft.parse_tokens(args.length or ("1k" if args.small else "8k"))
        if any(length % block for block in blocks):
            raise ttft.BenchError(f"--length {length} must be a multiple of every block size {blocks}")
    except ttft.BenchError as error:
        parser.error(str(error))
    out_dir = Path(args.out or f"bench-results/blocks-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rows: list[dict[str, Any]] = []
    durations: list[float] = []
    for i, block in enumerate(blocks):
        left = f", about {statistics.mean(durations) * (len(blocks) - i):.0f} s left" if durations else ""
        print(f"{PREFIX}block size {block} ({i + 1} of {len(blocks)}{left}): kvtier bench ttft", flush=True)
        began = time.time()
        try:
            result = run_one(args, block, length, out_dir / f"block-{block}")
        except ttft.BenchError as error:
            print(f"kvtier bench blocks: {error}", file=sys.stderr)
            return 1
        durations.append(time.time() - began)
        rows.append(row_of(block, length, result))
    markdown = report(rows, length)
    print(markdown)
    plots = ["ttft_vs_block.png"] if plot(rows, length, out_dir / "ttft_vs_block.png") else []
    document = {
        "benchmark": "kvtier bench blocks",
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "duration_s": time.time() - started,
        "length_tokens": length,
        "rows": rows,
        "plots": plots,
    }
    (out_dir / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    (out_dir / "report.md").write_text(markdown)
    print(f"wrote {out_dir / 'results.json'}, {out_dir / 'report.md'}" + "".join(f", {out_dir / p}" for p in plots))
    return 0 if all(not r["problems"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
