"""``kvtier bench lookup``: round-trip latency of the host service's scheduler-side calls.

Starts a real service (its own socket, a DRAM-only store in a temporary directory), stores blocks
through a real client, then times ``Locate`` (what vLLM's ``lookup`` costs per call) and ``Pin`` +
``Unpin`` batches over the Unix socket, and prints p50 / p99 / max per batch size (JSON with
``--json``). Figures are for the machine it runs on; compare them within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

import numpy as np

from kvtier._core import Service, ServiceClient

SLICE_BYTES = 4096


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def measure(batch_sizes: Sequence[int], calls: int, stored_blocks: int) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        socket = os.path.join(directory, "kvtier.sock")
        service = Service.start(
            socket, os.path.join(directory, "store"), directory, 30_000, dram_bytes=64 << 20, nvme_bytes=0
        )
        try:
            client = ServiceClient.connect(socket, 10_000)
            client.hello(b"bench-lookup", 1, 0, SLICE_BYTES)
            keys = [i.to_bytes(8, "little") * 4 for i in range(stored_blocks)]
            layer = np.zeros((stored_blocks, SLICE_BYTES), dtype=np.uint8)
            assert all(client.store_blocks(keys, [layer], list(range(stored_blocks))))
            results = {}
            for batch in batch_sizes:
                locate, pin = [], []
                for call in range(calls):
                    start_key = (call * batch) % max(1, stored_blocks - batch)
                    chunk = keys[start_key : start_key + batch]
                    started = time.perf_counter()
                    client.locate_many(chunk)
                    locate.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    client.pin_many(chunk)
                    client.unpin_many(chunk)
                    pin.append(time.perf_counter() - started)
                results[str(batch)] = {
                    name: {
                        "p50_us": _percentile(samples, 0.50) * 1e6,
                        "p99_us": _percentile(samples, 0.99) * 1e6,
                        "max_us": max(samples) * 1e6,
                        "mean_us": statistics.fmean(samples) * 1e6,
                    }
                    for name, samples in (("locate", locate), ("pin_unpin", pin))
                }
            return {"calls_per_batch_size": calls, "stored_blocks": stored_blocks, "batches": results}
        finally:
            service.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier bench lookup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,32,512", help="keys per call, comma-separated")
    parser.add_argument("--calls", type=int, default=2000, help="calls per batch size")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(list(argv) if argv is not None else None)
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    result = measure(sizes, args.calls, stored_blocks=max(sizes) * 2)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"host service round trips over a Unix socket, {args.calls} calls per batch size")
    print(f"{'keys':>6} {'call':<10} {'p50 µs':>9} {'p99 µs':>9} {'max µs':>9}")
    for size, calls in result["batches"].items():
        for name, figures in calls.items():
            print(f"{size:>6} {name:<10} {figures['p50_us']:9.1f} {figures['p99_us']:9.1f} {figures['max_us']:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
