"""``kvtier bench admission``: what writing only what will be read saves, and what it costs.

Replays one request trace against a real store (in this process, DRAM over NVMe in a temporary
directory) once per ``write_admission`` policy (``all`` and ``reuse``, docs/architecture.md "Writes
below DRAM"), the way an engine's scheduler and workers use it: each request looks up its prefix,
pins what is there (a lookup's hit), loads it, unpins, and stores the blocks it had to compute. Most
requests are one-off prompts; a minority (``--reuse-share``) carry one of ``--documents`` long shared
prefixes (a system prompt, a document) followed by a question of their own. The DRAM pool is smaller
than the shared prefixes together, so a prefix comes back from NVMe or is computed again.

Per policy it reports NVMe bytes written, write amplification (bytes written per byte read back),
the hit rate (blocks served over blocks asked), blocks dropped without evidence, and the replay's
wall time. Then, with ``--budget-seconds``, it checks a write budget: policy ``all`` with
``write_budget_nvme_bytes_per_day`` set to a tenth of the rate ``all`` wrote at, the trace replayed
for that long, and the bytes written compared with what the budget allows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
import time
from typing import Any

import numpy as np

import kvtier

OBJECT_BYTES = 64 << 10
SLOT_BYTES = OBJECT_BYTES + 4096


def block_key(*parts: int) -> bytes:
    return hashlib.blake2b(b"/".join(str(p).encode() for p in parts), digest_size=32).digest()


def trace(
    requests: int, documents: int, reuse_share: float, prefix_blocks: int, own_blocks: int, seed: int
) -> list[list[bytes]]:
    """The block keys of each request, in order: a shared prefix (one of ``documents``) then blocks
    of its own for a share ``reuse_share`` of requests, only blocks of its own for the rest."""
    rng = random.Random(seed)
    out = []
    for r in range(requests):
        own = [block_key(1, r, i) for i in range(own_blocks)]
        if rng.random() < reuse_share:
            doc = rng.randrange(documents)
            out.append([block_key(0, doc, i) for i in range(prefix_blocks)] + own)
        else:
            out.append([block_key(1, r, own_blocks + i) for i in range(prefix_blocks)] + own)
    return out


def serve(store: Any, keys: list[bytes], value: np.ndarray, scratch: np.ndarray) -> int:
    """One request: look up, pin and load the hit prefix, store the rest. Returns blocks served."""
    hit = store.lookup_prefix(keys)
    if hit:
        pinned = store.pin_many(keys[:hit])
        found = store.get_many(keys[:hit], [scratch[i] for i in range(hit)])
        store.unpin_many([k for k, p in zip(keys[:hit], pinned, strict=False) if p])
        hit = sum(found)
    computed = keys[hit:]
    if computed:
        store.put_many(computed, [value] * len(computed))
    return hit


def open_store(directory: str, policy: str, extra: dict[str, Any], dram_mib: int, nvme_mib: int) -> Any:
    return kvtier.Store.open(
        directory,
        object_bytes=OBJECT_BYTES,
        namespace=b"bench-admission",
        dram_bytes=dram_mib << 20,
        nvme_bytes=nvme_mib << 20,
        write_admission=policy,
        write_budget_nvme_dwpd=0.0,
        **extra,
    )


def replay(policy: str, requests: list[list[bytes]], dram_mib: int, nvme_mib: int) -> dict[str, Any]:
    value = np.full(OBJECT_BYTES, 7, dtype=np.uint8)
    scratch = np.zeros((max(len(r) for r in requests), OBJECT_BYTES), dtype=np.uint8)
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-bench-admission-") as directory,
        open_store(directory, policy, {}, dram_mib, nvme_mib) as store,
    ):
        started = time.perf_counter()
        served = sum(serve(store, keys, value, scratch) for keys in requests)
        replay_s = time.perf_counter() - started
        store.flush()
        flushed_s = time.perf_counter() - started
        s = store.stats()
    asked = sum(len(r) for r in requests)
    written, read = s["bytes_written_nvme"], s["bytes_read_nvme"]
    return {
        "policy": policy,
        "nvme_bytes_written": written,
        "nvme_bytes_read": read,
        "write_amplification": written / read if read else None,
        "hit_rate": served / asked,
        "blocks_served": served,
        "blocks_asked": asked,
        "nvme_hits": s["nvme_hits"],
        "awaiting_reuse": s["writes_awaiting_reuse"],
        "admitted_on_reuse": s["writes_admitted_on_reuse"],
        "dropped_without_evidence": s["dropped_without_evidence"],
        "replay_s": replay_s,
        "replay_and_flush_s": flushed_s,
    }


def budget_run(
    requests: list[list[bytes]], bytes_per_s: float, seconds: float, burst_s: int, dram_mib: int, nvme_mib: int
) -> dict[str, Any]:
    """Policy ``all`` under a budget of ``bytes_per_s``, the trace replayed (new keys each lap) for
    ``seconds``: the bytes written against what the budget allows over that span."""
    value = np.full(OBJECT_BYTES, 7, dtype=np.uint8)
    scratch = np.zeros((max(len(r) for r in requests), OBJECT_BYTES), dtype=np.uint8)
    extra = {"write_budget_nvme_bytes_per_day": int(bytes_per_s * 86_400), "write_budget_burst_s": burst_s}
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-bench-admission-") as directory,
        open_store(directory, "all", extra, dram_mib, nvme_mib) as store,
    ):
        started = time.perf_counter()
        lap, served, asked = 0, 0, 0
        while time.perf_counter() - started < seconds:
            salt = lap.to_bytes(4, "little")
            for keys in requests:
                served += serve(
                    store, [hashlib.blake2b(salt + k, digest_size=32).digest() for k in keys], value, scratch
                )
                asked += len(keys)
                if time.perf_counter() - started >= seconds:
                    break
            lap += 1
        elapsed_s = time.perf_counter() - started
        store.flush()
        s = store.stats()
    written = s["bytes_written_nvme"]
    return {
        "budget_bytes_per_s": bytes_per_s,
        "seconds": elapsed_s,
        "burst_s": burst_s,
        "nvme_bytes_written": written,
        "written_bytes_per_s": written / elapsed_s,
        "written_over_rate": written / (bytes_per_s * elapsed_s),
        "bound_over_rate": (elapsed_s + burst_s) / elapsed_s,
        "refusals": s["nvme_write_budget_refusals"],
        "laps": lap,
        # Under a budget that binds, the blocks that come back go first (docs/architecture.md).
        "hit_rate": served / asked if asked else 0.0,
        "nvme_hits": s["nvme_hits"],
        "admitted_on_reuse": s["writes_admitted_on_reuse"],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench admission", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--documents", type=int, default=20, help="shared prefixes that recur")
    p.add_argument("--reuse-share", type=float, default=0.2, help="share of requests that carry a shared prefix")
    p.add_argument("--prefix-blocks", type=int, default=16)
    p.add_argument("--own-blocks", type=int, default=2)
    p.add_argument("--dram-mib", type=int, default=64, help="DRAM pool (64 KiB blocks)")
    p.add_argument("--nvme-mib", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--budget-seconds", type=float, default=0, help="also run the write-budget check this long (0: skip)"
    )
    p.add_argument("--budget-burst-s", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """min / median / max of the replay time; the counts are the same every repeat (one trace)."""
    times = sorted(r["replay_and_flush_s"] for r in runs)
    return {**runs[0], "replay_and_flush_s": {"min": times[0], "median": times[len(times) // 2], "max": times[-1]}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    requests = trace(args.requests, args.documents, args.reuse_share, args.prefix_blocks, args.own_blocks, args.seed)
    runs: dict[str, list[dict[str, Any]]] = {"all": [], "reuse": []}
    for _ in range(args.repeats):
        for policy in runs:  # alternated, so that drift over the run favors neither
            runs[policy].append(replay(policy, requests, args.dram_mib, args.nvme_mib))
    result: dict[str, Any] = {"args": vars(args), "policies": {p: summarize(r) for p, r in runs.items()}}
    all_, reuse = result["policies"]["all"], result["policies"]["reuse"]
    result["reuse_vs_all"] = {
        "nvme_bytes_written": reuse["nvme_bytes_written"] / max(1, all_["nvme_bytes_written"]),
        "hit_rate": reuse["hit_rate"] / all_["hit_rate"] if all_["hit_rate"] else None,
        "replay_time": reuse["replay_and_flush_s"]["median"] / all_["replay_and_flush_s"]["median"],
    }
    if args.budget_seconds > 0:
        rate = all_["nvme_bytes_written"] / all_["replay_and_flush_s"]["median"] / 10
        result["budget"] = budget_run(
            requests, rate, args.budget_seconds, args.budget_burst_s, args.dram_mib, args.nvme_mib
        )
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print_table(result)
    return 0


def print_table(result: dict[str, Any]) -> None:
    print("policy  NVMe written  read back  written/read  hit rate  dropped unused  replay+flush s (min/med/max)")
    for policy, r in result["policies"].items():
        t = r["replay_and_flush_s"]
        amp = "-" if r["write_amplification"] is None else f"{r['write_amplification']:.2f}"
        print(
            f"{policy:6}  {r['nvme_bytes_written'] / 2**20:9.0f} MiB  {r['nvme_bytes_read'] / 2**20:6.0f} MiB  "
            f"{amp:>12}  {r['hit_rate']:8.3f}  {r['dropped_without_evidence']:14}  "
            f"{t['min']:.2f}/{t['median']:.2f}/{t['max']:.2f}"
        )
    v = result["reuse_vs_all"]
    print(
        f"reuse / all: NVMe bytes written {v['nvme_bytes_written']:.3f}x, hit rate {v['hit_rate']:.3f}x, "
        f"time {v['replay_time']:.3f}x"
    )
    if "budget" in result:
        b = result["budget"]
        print(
            f"budget {b['budget_bytes_per_s'] / 2**20:.1f} MiB/s for {b['seconds']:.0f} s "
            f"(burst {b['burst_s']} s): wrote "
            f"{b['written_bytes_per_s'] / 2**20:.1f} MiB/s, {b['written_over_rate']:.3f}x the rate "
            f"(bound {b['bound_over_rate']:.3f}x), {b['refusals']} writes refused, stores never waited; "
            f"hit rate {b['hit_rate']:.3f} ({b['nvme_hits']} NVMe hits)"
        )


if __name__ == "__main__":
    sys.exit(main())
