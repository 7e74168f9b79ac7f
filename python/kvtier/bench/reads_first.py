"""``kvtier bench reads-first``: does a load from NVMe wait behind stores? Tail latency of NVMe hits
taken right after heavy stores, against the same hits on a quiet store, a DRAM hit, and fio.

Starts a real host service on a store directory on this disk (``--dir``), and two clients: an engine
that stores, an engine that loads (their own connections, their own mappings of the pool). Each round:

1. the storer stores the round's target blocks, then ``--flood`` times the pool's size of other
   blocks, so that the targets are on NVMe only and the pool is full of blocks still being written;
2. **after stores**: the loader loads the targets at once, while the storer keeps storing (a thread);
3. **quiet**: the storer stops, the store is flushed, other targets (pushed out the same way) load;
4. **DRAM**: the quiet targets load again, now from the pool.

Every load is checked byte for byte. Prints min / median / p99 / max per condition over the rounds
and fio's best O_DIRECT read of the same bytes; ``--json`` writes them. The figures are for this
machine at this moment: compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvtier._core import Service, ServiceClient

NAMESPACE = b"kvtier-bench-reads-first"


def block(index: int, slice_bytes: int) -> np.ndarray:
    """Block ``index``'s bytes: cheap to make, and different in every block and every page."""
    value = np.full(slice_bytes, index % 251, dtype=np.uint8)
    value[::4096] = np.arange(len(value[::4096]), dtype=np.uint64).astype(np.uint8) ^ (index & 0xFF)
    value[:8] = np.frombuffer(index.to_bytes(8, "little"), dtype=np.uint8)
    return value


def key(index: int) -> bytes:
    return index.to_bytes(8, "little") * 4


class Bench:
    def __init__(self, args: argparse.Namespace, directory: str):
        self.args = args
        self.slice_bytes = args.block_mib << 20
        self.pool_blocks = args.dram_mib // args.block_mib
        self.hit_blocks = args.hit_mib // args.block_mib
        self.socket = os.path.join(directory, "kvtier.sock")
        self.service = Service.start(
            self.socket,
            os.path.join(directory, "store"),
            directory,
            30_000,
            dram_bytes=args.dram_mib << 20,
            nvme_bytes=args.nvme_gib << 30,
            region_bytes=64 << 20,
            loads_cancel_queued_writes=not args.keep_queued_writes,
        )
        self.storer = self.client()
        self.loader = self.client()
        self.loader.set_copy_threads(args.copy_threads)
        self.next_index = 0
        self.misses: dict[str, int] = {}
        # One engine block buffer per client: numpy rows the clients copy in and out of.
        self.source = np.zeros((1, self.slice_bytes), dtype=np.uint8)
        # Written once here: np.zeros memory is mapped lazily, and an engine's KV cache is resident,
        # so the first load must not pay the page faults of its destination.
        self.destination = np.full((self.hit_blocks, self.slice_bytes), 0xFF, dtype=np.uint8)

    def client(self) -> ServiceClient:
        client = ServiceClient.connect(self.socket, 120_000)
        client.hello(NAMESPACE, 1, 0, self.slice_bytes)
        client.populate_pool()  # as an engine's worker does: copies measured without page faults
        return client

    def store(self, count: int, stop: threading.Event | None = None) -> list[int]:
        indices = []
        for _ in range(count):
            if stop is not None and stop.is_set():
                break
            index = self.next_index
            self.next_index += 1
            self.source[0] = block(index, self.slice_bytes)
            if not self.storer.store_blocks([key(index)], [self.source], [0])[0]:
                raise RuntimeError(f"the service dropped the store of block {index}; give it more NVMe or DRAM")
            indices.append(index)
        return indices

    def load(self, indices: list[int], condition: str) -> float:
        """Seconds to load the blocks; a block not found is counted as a miss of ``condition``."""
        keys = [key(i) for i in indices]
        started = time.perf_counter()
        found = self.loader.load_blocks(keys, [self.destination], list(range(len(indices))))
        seconds = time.perf_counter() - started
        self.misses[condition] = self.misses.get(condition, 0) + found.count(False)
        for row, index in enumerate(indices):
            if found[row] and not np.array_equal(self.destination[row], block(index, self.slice_bytes)):
                raise RuntimeError(f"block {index} came back with wrong bytes")
        return seconds

    def push_out(self) -> None:
        """Stores enough other blocks that earlier ones leave the pool (NVMe only)."""
        self.store(int(self.pool_blocks * self.args.flood))

    def round(self) -> dict[str, float]:
        hot = self.store(self.hit_blocks)
        quiet = self.store(self.hit_blocks)
        self.push_out()
        located = self.loader.locate_many([key(i) for i in hot + quiet])
        if set(located) != {"nvme"}:
            raise RuntimeError(f"targets not on NVMe only before the loads: {sorted(set(map(str, located)))}")
        stop = threading.Event()
        writer = threading.Thread(target=self.store, args=(10 * self.pool_blocks, stop), daemon=True)
        writer.start()
        after_stores = self.load(hot, "after_stores")
        stop.set()
        writer.join()
        self.storer.flush()
        time.sleep(0.5)
        return {"after_stores": after_stores, "quiet": self.load(quiet, "quiet"), "dram": self.load(quiet, "dram")}

    def close(self) -> None:
        self.service.stop()


def fio_floor(directory: str, read_bytes: int, block_bytes: int) -> dict | None:
    from kvtier.bench import fio

    if fio.fio_path() is None:
        return None
    path = str(Path(directory) / "floor.fio")
    fio.run_fio_job(path, read_bytes, "write", fio.FioCombo(block_bytes, 8))
    runs = [fio.run_fio_job(path, read_bytes, "read", fio.FioCombo(block_bytes, depth)) for depth in (8, 32)]
    return max(runs, key=lambda run: run["gbps"])


def spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "min_s": ordered[0],
        "median_s": statistics.median(ordered),
        "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max_s": ordered[-1],
    }


def run(args: argparse.Namespace) -> dict:
    base = args.dir or None
    with tempfile.TemporaryDirectory(prefix="kvtier-reads-first-", dir=base) as directory:
        bench = Bench(args, directory)
        samples: dict[str, list[float]] = {"after_stores": [], "quiet": [], "dram": []}
        try:
            for number in range(args.rounds):
                figures = bench.round()
                for name, seconds in figures.items():
                    samples[name].append(seconds)
                print(
                    f"[reads-first] round {number + 1}/{args.rounds}: "
                    + ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in figures.items()),
                    flush=True,
                )
            stats = dict(bench.storer.stats())
        finally:
            bench.close()
        hit_bytes = bench.hit_blocks * bench.slice_bytes
        floor = fio_floor(directory, hit_bytes, bench.slice_bytes)
    return {
        "hit_bytes": hit_bytes,
        "block_bytes": bench.slice_bytes,
        "pool_bytes": args.dram_mib << 20,
        "rounds": args.rounds,
        "copy_threads": args.copy_threads,
        "loads_cancel_queued_writes": not args.keep_queued_writes,
        "loads": {name: spread(values) for name, values in samples.items()},
        "missed_blocks": {name: bench.misses.get(name, 0) for name in samples},
        "fio_read": floor,
        "service": {
            name: stats.get(name)
            for name in ("slot_wait_timeouts", "dropped_stores", "cancelled_writes", "nvme_hits", "misses", "puts")
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier bench reads-first", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds (the p99 is over these)")
    parser.add_argument("--block-mib", type=int, default=16, help="block size (16 MiB: 128 tokens of Llama-3-8B)")
    parser.add_argument("--hit-mib", type=int, default=512, help="bytes of one hit")
    parser.add_argument("--dram-mib", type=int, default=1280, help="the service's DRAM pool")
    parser.add_argument("--nvme-gib", type=int, default=16, help="the service's NVMe tier")
    parser.add_argument("--flood", type=float, default=1.5, help="blocks stored after the targets, in pools")
    parser.add_argument("--copy-threads", type=int, default=2, help="threads the loader copies with")
    parser.add_argument(
        "--keep-queued-writes",
        action="store_true",
        help="loads short of DRAM slots wait for queued NVMe writes instead of taking their slots "
        "(loads_cancel_queued_writes=False: the behaviour before 2026-11-26, to compare)",
    )
    parser.add_argument("--dir", help="where the store lives (default: the system's temporary directory)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.hit_mib * 2 > args.dram_mib:
        parser.error("--hit-mib must be at most half of --dram-mib (two targets are loaded per round)")
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    floor = result["fio_read"]
    print(
        f"\nNVMe hits of {result['hit_bytes'] >> 20} MiB ({result['rounds']} rounds), seconds: min / median / p99 / max"
    )
    for name, figures in result["loads"].items():
        missed = result["missed_blocks"][name]
        print(
            f"  {name:<13} {figures['min_s']:7.3f} {figures['median_s']:7.3f} {figures['p99_s']:7.3f}"
            f" {figures['max_s']:7.3f}" + (f"   MISSED {missed} blocks" if missed else "")
        )
    if floor:
        floor_s = result["hit_bytes"] / (floor["gbps"] * 1e9)
        target = result["loads"]["dram"]["median_s"] + 1.1 * floor_s
        print(f"  fio read      {floor_s:7.3f}  ({floor['gbps']:.2f} GB/s, best of depth 8 and 32)")
        holds = result["loads"]["after_stores"]["p99_s"] <= target and not any(result["missed_blocks"].values())
        print(
            f"  target: p99 after stores <= DRAM median + 1.1 x fio = {target:.3f} s: {'holds' if holds else 'MISSED'}"
        )
    print(f"  service: {result['service']}")
    # Every target was stored and the NVMe tier had room: a block not found is a load that lost to
    # the stores around it.
    return 1 if any(result["missed_blocks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
