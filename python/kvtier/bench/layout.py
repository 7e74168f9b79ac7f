"""``kvtier bench layout``: time to first token in vLLM's default layout, across engines, in one run.

Two engines (A and B, vLLM defaults: multiprocess engine core and executor) share one store path, so
one kvtier host service and one DRAM pool. For each repeat, with a fresh prompt of ``--length``
tokens on the ``kv8b`` model (the KV cache of Llama-3-8B), it measures:

- recompute: A computes the prompt (a kvtier miss, which also stores the prefix);
- same-engine DRAM hit: A again after resetting vLLM's prefix cache;
- cross-engine DRAM hit: B, which never saw the prompt, restores it from the shared pool;
- A again without resetting vLLM's prefix cache (vLLM's own cache, and kvtier for what it lacks);
- NVMe hit: A after other prompts pushed the prefix out of the DRAM pool (the row names the tier
  the service's counters say served it);
- with ``--tp2``: a TP=2 engine's recompute and DRAM hit;
- unless ``--no-baseline``: an engine without kvtier computes the same prompt (what a kvtier miss
  costs against no offloading) and hits vLLM's own prefix cache (what a DRAM hit costs against it);
- with ``--no-defer``: a third kvtier engine with ``defer_stores=false`` computes the same prompt
  (what holding stores back during prefill saves);
- this process's memcpy rate (numpy, 256 MiB copies), to put a DRAM hit's copy in proportion.

TTFT is the wall time of one ``generate`` with ``max_tokens=1``, each after ``ENGINE_QUIET_S`` of quiet
(``kvtier.engine_process``: another engine's busy poll would otherwise compete for the cores).
Figures are min / median / max over repeats; compare rows of one run only (this machine's speed
varies from run to run). Writes ``layout.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier import service as kvtier_service
from kvtier.engine_process import ENGINE_QUIET_S, TOKENS_PER_BLOCK, EngineProcess
from kvtier.models import PRESETS, warn_about_slow_bf16


def _length(text: str) -> int:
    text = text.lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


class Run:
    def __init__(self, args: argparse.Namespace, store_dir: Path, log_dir: Path):
        self.args = args
        self.tokens = _length(args.length)
        self.store_dir, self.log_dir = store_dir, log_dir
        kv_bytes = PRESETS[args.model].kv_bytes_per_token * self.tokens
        self.store = {
            "dram_bytes": int(args.dram_gib * (1 << 30)),
            "nvme_bytes": max(8 << 30, 8 * kv_bytes),
        }
        # Enough other prompts to push one prompt's blocks out of the DRAM pool (FIFO-like eviction).
        self.flood_prompts = max(2, int(self.store["dram_bytes"] * 1.5 / kv_bytes) + 1)
        self.socket = kvtier_service.default_socket_path(store_dir)
        self.rows: dict[str, list[float]] = {}
        self.served_by: dict[str, list[str]] = {}
        self.checks: list[str] = []

    def engine(self, name: str, tp_size: int = 1, kvtier: bool = True, **options: Any) -> EngineProcess:
        cache_gib = max(2, int(3 * PRESETS[self.args.model].kv_bytes_per_token * self.tokens / (1 << 30)) + 1)
        spec = {
            "model": self.args.model,
            "tp_size": tp_size,
            "max_model_len": self.tokens + 512,
            "chunk_tokens": self.args.chunk_tokens,
            "store": {**self.store, **options},
            "kvtier": kvtier,
        }
        print(f"[layout] starting engine {name} (TP={tp_size}) ...", flush=True)
        engine = EngineProcess(
            self.store_dir, self.log_dir / f"engine-{name}.log", spec, env={"VLLM_CPU_KVCACHE_SPACE": str(cache_gib)}
        )
        # A prompt of the full length first, then a question on it (a prefix-cache hit): a vLLM
        # engine's first request at a context length it has not seen pays one-time set-up (lazy
        # initialisation, buffers sized by the context) that belongs to neither a hit nor a
        # recompute. Measured here before this warm-up: B's first cross-engine hit at 8K took
        # 2.2 s, its second 0.4 s; A had computed an 8K prompt before its own hit. Neither
        # request reads anything from kvtier (a prompt of its own, salted per engine).
        engine.generate(seed=7_000 + zlib.crc32(name.encode()) % 1000, tokens=self.tokens, max_tokens=1)
        engine.generate(seed=7_000 + zlib.crc32(name.encode()) % 1000, tokens=self.tokens, max_tokens=1)
        print(f"[layout] engine {name} ready in {engine.start_seconds:.0f} s (warmed up)", flush=True)
        return engine

    def stats(self) -> dict[str, int]:
        if not self.socket.exists():
            return {}  # no kvtier engine has started the service yet (the baseline engine runs first)
        return kvtier_service.service_stats(self.socket)

    def measure(self, row: str, engine: EngineProcess, seed: int, expect_cached: int | None) -> dict:
        # Engines here share the cores: the last one to serve must have stopped polling first.
        time.sleep(ENGINE_QUIET_S)
        before = self.stats()
        result = engine.generate(seed, self.tokens, max_tokens=1)
        after = self.stats()
        tiers = [t for t in ("dram", "nvme", "shared") if after.get(f"{t}_hits", 0) > before.get(f"{t}_hits", 0)]
        self.rows.setdefault(row, []).append(result["seconds"])
        self.served_by.setdefault(row, []).append("+".join(tiers) or "-")
        if expect_cached is not None and result["cached"] < expect_cached:
            self.checks.append(f"{row}: {result['cached']} cached tokens, expected {expect_cached}")
        print(f"[layout] {row}: {result['seconds']:.3f} s, cached {result['cached']}, tiers {tiers}", flush=True)
        return result

    def settle(self, engine: EngineProcess, limit_s: float = 120) -> None:
        """Engine steps until the service has taken every store: no fill pending and, for a second,
        no new block, no NVMe write and no drop (a rank waiting for room waits on NVMe writes)."""
        deadline = time.monotonic() + limit_s
        last = None
        while time.monotonic() < deadline:
            engine.call(op="settle")
            stats = self.stats()
            activity = tuple(stats.get(name, 0) for name in ("puts", "bytes_written_nvme", "dropped_stores"))
            if stats.get("service_pending_fills", 0) == 0 and activity == last:
                return
            last = activity
            time.sleep(1.0)
        self.checks.append(f"stores still in flight after {limit_s:.0f} s")

    def full_blocks(self) -> int:
        return self.tokens // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK

    def side_engine(self, name: str, repeat: Callable[[EngineProcess, int], None], **spec: Any) -> None:
        engine = self.engine(name, **spec)
        try:
            for r in range(self.args.repeats):
                repeat(engine, r)
        finally:
            engine.stop()

    def baseline_repeat(self, base: EngineProcess, r: int) -> None:
        """The prompt A computes in repeat ``r``, on an engine without kvtier."""
        seed = 1000 * (r + 1)
        self.measure("recompute, no kvtier", base, seed, None)
        # vLLM computes at least the prompt's last token, so its own cache serves one block less.
        self.measure("vLLM prefix-cache hit, no kvtier", base, seed, self.full_blocks() - TOKENS_PER_BLOCK)

    def nodefer_repeat(self, nodefer: EngineProcess, r: int) -> None:
        # A prompt of its own, so that it is a miss; settled, so its stores do not run beside the
        # next measurement.
        self.measure("kvtier miss, defer_stores=false", nodefer, 1000 * (r + 1) + 500, None)
        self.settle(nodefer)

    def repeat(self, a: EngineProcess, b: EngineProcess, r: int) -> None:
        seed = 1000 * (r + 1)
        self.measure("recompute (kvtier miss, stores the prefix)", a, seed, None)
        self.settle(a)
        a.call(op="reset")
        self.measure("same-engine DRAM hit", a, seed, self.full_blocks())
        b.call(op="reset")
        self.measure("cross-engine DRAM hit", b, seed, self.full_blocks())
        # Without a reset; vLLM may still ask kvtier for part of it (the "served by" column says).
        self.measure("A again, no prefix-cache reset", a, seed, self.full_blocks())
        for flood in range(self.flood_prompts):
            a.generate(seed + 1 + flood, self.tokens, max_tokens=1)
            self.settle(a)
            # Read back once too: the pool keeps blocks that were read back ahead of blocks seen
            # once, so only blocks read back after the prompt's own hits push it out.
            a.call(op="reset")
            a.generate(seed + 1 + flood, self.tokens, max_tokens=1)
        a.call(op="reset")
        self.measure("NVMe hit (pushed out of the DRAM pool)", a, seed, self.full_blocks())

    def run(self) -> dict:
        self.memcpy_gbps = memcpy_gbps()
        print(f"[layout] memcpy: {self.memcpy_gbps:.1f} GB/s (numpy, 256 MiB copies, median of 5)", flush=True)
        sides: list[tuple[str, Callable[[EngineProcess, int], None], dict[str, Any]]] = []
        if not self.args.no_baseline:
            sides.append(("base", self.baseline_repeat, {"kvtier": False}))
        if self.args.no_defer:
            sides.append(("nodefer", self.nodefer_repeat, {"defer_stores": False}))
        if not self.args.together:
            # One engine at a time besides A and B: each holds its KV cache and, with kvtier, a
            # mapping of the pool (four at 8K outgrew 24 GiB with other work on the machine).
            for name, repeat, spec in sides:
                self.side_engine(name, repeat, **spec)
            sides = []
        running = [(self.engine(name, **spec), repeat) for name, repeat, spec in sides]
        a, b = self.engine("a"), self.engine("b")
        try:
            for r in range(self.args.repeats):
                # With --together each repeat measures every engine back to back: a slow spell of
                # the machine then lands on the rows it is to be compared with.
                for engine, repeat in running:
                    repeat(engine, r)
                self.repeat(a, b, r)
        finally:
            b.stop()
            for engine, _ in running:
                engine.stop()
        if self.args.tp2:
            a.stop()
            t = self.engine("tp2", tp_size=2)
            try:
                for r in range(self.args.repeats):
                    seed = 50_000 + r
                    self.measure("TP=2 recompute", t, seed, None)
                    self.settle(t)
                    t.call(op="reset")
                    self.measure("TP=2 DRAM hit", t, seed, self.full_blocks())
            finally:
                t.stop()
        else:
            a.stop()
        return self.summary()

    def summary(self) -> dict:
        rows = {
            row: {
                "min_s": min(v),
                "median_s": statistics.median(v),
                "max_s": max(v),
                "samples_s": v,
                "served_by": self.served_by[row],
            }
            for row, v in self.rows.items()
        }
        return {
            "model": self.args.model,
            "tokens": self.tokens,
            "kv_bytes": PRESETS[self.args.model].kv_bytes_per_token * self.full_blocks(),
            "memcpy_gbps": self.memcpy_gbps,
            "repeats": self.args.repeats,
            "chunk_tokens": self.args.chunk_tokens,
            "store": self.store,
            "rows": rows,
            "failed_checks": self.checks,
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        }


def memcpy_gbps(copy_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """This process's single-threaded copy rate between two preallocated, touched buffers."""
    import numpy as np

    source = np.ones(copy_bytes, dtype=np.uint8)
    destination = np.zeros(copy_bytes, dtype=np.uint8)
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(destination, source)
        rates.append(copy_bytes / (time.perf_counter() - started) / 1e9)
    return statistics.median(rates)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier bench layout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", default="8k", help="prompt tokens (8k, 16k, 2048, ...)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--model", default="kv8b", choices=sorted(PRESETS))
    parser.add_argument("--dram-gib", type=float, default=1.25, help="the shared DRAM pool")
    parser.add_argument("--tp2", action="store_true", help="also a TP=2 engine's recompute and DRAM hit")
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=2048,
        help="prompt tokens per engine step (vLLM's max_num_batched_tokens; 2048 is `vllm serve`'s CPU default)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the engine without kvtier")
    parser.add_argument("--no-defer", action="store_true", help="add an engine with defer_stores=false")
    parser.add_argument(
        "--together",
        action="store_true",
        help="run the baseline and no-defer engines beside A and B, interleaved per repeat (more memory)",
    )
    parser.add_argument("--out", default="bench-results/layout", help="directory for layout.json")
    args = parser.parse_args(list(argv) if argv is not None else None)
    warn_about_slow_bf16(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvtier-layout-") as scratch:
        store_dir = Path(scratch) / "store"
        run = Run(args, store_dir, out)
        try:
            result = run.run()
        finally:
            kvtier_service.stop_service(run.socket)
    (out / "layout.json").write_text(json.dumps(result, indent=2))
    print(
        f"\n{args.model}, {result['tokens']} tokens ({result['kv_bytes'] / 2**30:.2f} GiB of KV), {args.repeats} "
        f"repeat(s), memcpy {result['memcpy_gbps']:.1f} GB/s: TTFT in seconds (min / median / max)"
    )
    for row, figures in result["rows"].items():
        print(
            f"  {row:<44} {figures['min_s']:7.3f} {figures['median_s']:7.3f} {figures['max_s']:7.3f}"
            f"   served by {','.join(figures['served_by'])}"
        )
    for check in result["failed_checks"]:
        print(f"  CHECK FAILED: {check}")
    print(f"(written to {out / 'layout.json'})")
    return 1 if result["failed_checks"] else 0


if __name__ == "__main__":
    sys.exit(main())
