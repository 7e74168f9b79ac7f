"""Seed 002's experiments 4 and 5 for kvtier (issue 12, item 3).

Experiment 4, filesystem type: ext4, xfs, f2fs and btrfs, each made with mkfs on a loop file on this
disk (loop device with direct I/O, so the host's page cache does not flatter it), mounted, and
measured in the same run with ``kvtier bench io`` (kvtier store and cold retrieve GB/s, against fio
on the same filesystem).

With ``--ttft-length 8k`` each filesystem also gets ``kvtier bench ttft`` at that prompt length with
its store on the filesystem: the NVMe hit's time to first token through vLLM, beside recompute,
kvtier's DRAM hit and fio reading the same bytes there (the loop file grows to hold the store).

Experiment 5, local against network storage: the shared tier's retrieve latency (one block per get,
cold: page cache dropped before every pass) with node A publishing and node B reading, on a local
directory, on GlusterFS (default and strict caching) and on CephFS (scripts/distfs/*.sh bring them up
on 127.0.0.1 and tear them down). Median, p99 and GB/s per target; every block checked byte for byte.

With ``--ttft-length 8k`` experiment 5 also measures time to first token through vLLM per target:
``kvtier bench ttft --shared-root-store <node A's mount> --shared-root-load <node B's mount>`` (the
``kvtier_shared`` row: node A's engine publishes each prompt to the shared tier, then a fresh engine
and service with an empty local store on node B reads every block from there, page cache dropped), in
the same run as recompute and the local NVMe hit (``kvtier_nvme``), ``--ttft-repeats`` prompts each.
Median, p99, min and max per target and the ratios to the same run's NVMe hit and recompute go into
``results.json`` (``exp5_ttft``), ``report.md`` and ``exp5-ttft.png``. The CephFS OSD (memstore, in RAM)
is sized to hold the run's prompts (``KVTIER_CEPH_OSD_BYTES``, unless set).

Experiment 3 on a shared filesystem (``--only exp3``, not part of the default run): per target of
``--targets`` (default caching only unless ``--exp3-modes default,strict``), ``kvtier bench blocks
--shared-root-store <node A's mount> --shared-root-load <node B's mount>`` at ``--exp3-blocks`` and
``--ttft-length`` (default 8k) with ``--ttft-repeats``: TTFT of the local NVMe hit and of the shared-tier
hit per engine block size, and ``--exp3-file-bytes`` sweeps the shared tier's ``shared_file_bytes`` at
256-token blocks. Its output is in ``--out``/exp3-<target>/ (results.json, report.md,
ttft_vs_block.png), its rows in ``results.json`` (``exp3``) and ``report.md``.

Usage (root): ``.venv/bin/python scripts/distfs/bench_filesystems.py [--out DIR] [--small]
[--only exp3|exp4|exp5] [--filesystems ext4,xfs,f2fs,btrfs] [--targets local,glusterfs,cephfs]``.
Writes ``results.json``, ``report.md`` and ``exp4.png`` / ``exp5.png`` into ``--out``
(default ``bench-results/fs-<timestamp>``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent.parent
DISTFS = REPO / "scripts" / "distfs"


def log(msg: str) -> None:
    print(f"[bench-fs {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


# ---- experiment 4 ----

MKFS = {
    "ext4": ["mkfs.ext4", "-q", "-F"],
    "xfs": ["mkfs.xfs", "-q", "-f"],
    "f2fs": ["mkfs.f2fs", "-q", "-f"],
    "btrfs": ["mkfs.btrfs", "-q", "-f"],
}


def kernel_supports(fs: str) -> bool:
    return any(line.split()[-1] == fs for line in Path("/proc/filesystems").read_text().splitlines() if line.strip())


def exp4_ttft(fs: str, mnt: Path, out: Path, length: str, repeats: int) -> dict[str, Any]:
    """``kvtier bench ttft`` at one length with its store on ``mnt``: median TTFT (ms) per row."""
    from kvtier.bench import blocks, ttft

    case_out = out / f"exp4-{fs}-ttft"
    log(f"exp4 {fs}: kvtier bench ttft --lengths {length} with the store on {mnt}")
    argv = [str(REPO / ".venv/bin/kvtier"), "bench", "ttft", "--lengths", length, "--repeats", str(repeats)]
    argv += ["--hit-rate-length", "0", "--skip-lmcache", "--skip-example-connector"]
    argv += ["--store-dir", str(mnt / "ttft-store"), "--out", str(case_out)]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True)
    results_file = case_out / "results.json"
    if done.returncode != 0 or not results_file.exists():
        return {"error": f"kvtier bench ttft exited {done.returncode}: {done.stderr[-2000:]}"}
    result = json.loads(results_file.read_text())
    tokens = ttft.parse_lengths(length)[0]
    row = blocks.row_of(int(result["plan"].get("block_tokens", 128)), tokens, result)
    row.update({"length": tokens, "repeats": repeats, "seconds": time.monotonic() - started})
    row["results"] = str(results_file)
    log(
        f"exp4 {fs}: TTFT at {tokens} tokens: NVMe hit {row['kvtier_nvme_ms']:.0f} ms, DRAM hit "
        f"{row['kvtier_dram_ms']:.0f} ms, recompute {row['recompute_ms']:.0f} ms, fio {row['disk_floor_ms']:.0f} ms"
    )
    return row


def exp4_one(
    fs: str, work: Path, out: Path, size_gib: int, bench_args: list[str], ttft_length: str = "", ttft_repeats: int = 2
) -> dict[str, Any]:
    if shutil.which(MKFS[fs][0]) is None:
        return {"fs": fs, "skipped": f"{MKFS[fs][0]} missing: apt-get install {fs}-progs/tools (scripts/setup.sh)"}
    if not kernel_supports(fs):
        return {"fs": fs, "skipped": f"this kernel has no {fs} (not in /proc/filesystems, no modules to load)"}
    image = work / f"{fs}.img"
    mnt = work / f"mnt-{fs}"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(size_gib << 30)
    loop = run(["losetup", "--direct-io=on", "-f", "--show", str(image)]).stdout.strip()
    try:
        run([*MKFS[fs], loop])
        run(["mount", loop, str(mnt)])
        try:
            case_out = out / f"exp4-{fs}"
            log(f"exp4 {fs}: kvtier bench io on {loop} ({size_gib} GiB loop file, direct I/O)")
            started = time.monotonic()
            done = subprocess.run(
                [str(REPO / ".venv/bin/kvtier"), "bench", "io", "--dir", str(mnt), "--out", str(case_out), *bench_args],
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                return {"fs": fs, "error": f"kvtier bench io exited {done.returncode}: {done.stderr[-2000:]}"}
            results = json.loads((case_out / "results.json").read_text())
            (case,) = results["cases"]
            summary = case["summary"]
            row = {
                "fs": fs,
                "loop": loop,
                "size_gib": size_gib,
                "seconds": time.monotonic() - started,
                "object": f"{case['object_kind']} ({case['object_bytes'] >> 20} MiB)",
                "prompt_tokens": case["prompt_tokens"],
                "wrong_objects": results["wrong_objects"]["kvtier"],
                "results": str(case_out / "results.json"),
            }
            for name in ("kvtier_store", "kvtier_retrieve", "fio_write", "fio_read"):
                row[name] = summary[name]["gbps"]
            log(
                f"exp4 {fs}: store {row['kvtier_store']['median']:.2f} GB/s, retrieve "
                f"{row['kvtier_retrieve']['median']:.2f} GB/s, fio write {row['fio_write']['median']:.2f}, "
                f"read {row['fio_read']['median']:.2f} GB/s (medians)"
            )
            if ttft_length:
                row["ttft"] = exp4_ttft(fs, mnt, out, ttft_length, ttft_repeats)
            return row
        finally:
            subprocess.run(["umount", str(mnt)], capture_output=True)
    finally:
        subprocess.run(["losetup", "-d", loop], capture_output=True)
        image.unlink(missing_ok=True)


# ---- experiment 5 ----

BLOCK_BYTES = 2 << 20  # a 16-token engine block of Llama-3-8B (128 KiB per token)


def block_key(i: int) -> bytes:
    return hashlib.sha256(f"exp5-{i}".encode()).digest()


def block_value(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def exp5_one(name: str, node_a: Path, node_b: Path, local: Path, blocks: int, passes: int) -> dict[str, Any]:
    import kvtier

    def open_store(sub: str, shared: Path) -> kvtier.Store:
        return kvtier.Store.open(
            str(local / sub),
            object_bytes=BLOCK_BYTES,
            namespace="exp5",
            dram_bytes=8 * (BLOCK_BYTES + 4096),  # the minimum; reads cycle through far more blocks
            nvme_bytes=0,
            shared_root=str(node_a if sub == "a" else node_b),
            shared_staleness_ms=100,
            shared_file_bytes=64 << 20,
        )

    keys = [block_key(i) for i in range(blocks)]
    values = [block_value(i) for i in range(blocks)]
    a = open_store("a", node_a)
    started = time.monotonic()
    a.put_many(keys, values)
    a.flush()
    publish_s = time.monotonic() - started
    b = open_store("b", node_b)
    deadline = time.monotonic() + 30
    while b.lookup_prefix(keys) < blocks:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: node B indexed {b.lookup_prefix(keys)} of {blocks} blocks after 30 s")
        time.sleep(0.02)
    latencies: list[float] = []
    wrong = misses = 0
    out = np.zeros(BLOCK_BYTES, np.uint8)
    hits_before = b.stats()["shared_hits"]
    read_seconds = 0.0
    for _ in range(passes):
        drop_caches()
        for k, want in zip(keys, values, strict=True):
            t0 = time.perf_counter()
            ok = b.get_many([k], [out])[0]
            dt = time.perf_counter() - t0
            read_seconds += dt
            if not ok:
                misses += 1
                continue
            latencies.append(dt)
            wrong += int(not np.array_equal(out, want))
    shared_hits = b.stats()["shared_hits"] - hits_before
    a.close()
    b.close()
    lat = np.array(latencies) * 1e3
    row = {
        "target": name,
        "blocks": blocks,
        "block_bytes": BLOCK_BYTES,
        "passes": passes,
        "publish_seconds": publish_s,
        "publish_gbps": blocks * BLOCK_BYTES / publish_s / 1e9,
        "reads": len(latencies) + misses,
        "shared_hits": shared_hits,
        "misses": misses,
        "wrong": wrong,
        "latency_ms": {
            "median": float(np.median(lat)),
            "p99": float(np.percentile(lat, 99)),
            "min": float(lat.min()),
            "max": float(lat.max()),
        },
        "retrieve_gbps": len(latencies) * BLOCK_BYTES / read_seconds / 1e9,
    }
    log(
        f"exp5 {name}: retrieve median {row['latency_ms']['median']:.2f} ms, p99 {row['latency_ms']['p99']:.2f} ms, "
        f"{row['retrieve_gbps']:.2f} GB/s; {shared_hits} shared hits, {misses} misses, {wrong} wrong"
    )
    return row


def exp5_ttft(
    name: str, node_a: Path, node_b: Path, store_dir: Path, out: Path, ttft: dict[str, Any]
) -> dict[str, Any]:
    """``kvtier bench ttft`` with the kvtier_shared row (node A publishes through ``node_a``, node B
    reads through ``node_b``) beside recompute and the local NVMe hit of the same run."""
    from kvtier.bench import ttft as ttft_bench

    slug = name.replace(" (", "-").replace(" caching)", "").replace(" ", "-")
    case_out = out / f"exp5-{slug}-ttft"
    argv = [str(REPO / ".venv/bin/kvtier"), "bench", "ttft", "--lengths", ttft["length"]]
    argv += ["--repeats", str(ttft["repeats"]), "--hit-rate-length", "0", "--skip-lmcache", "--skip-example-connector"]
    argv += ["--no-disk-floor", "--shared-root-store", str(node_a), "--shared-root-load", str(node_b)]
    argv += ["--store-dir", str(store_dir), "--out", str(case_out)] + (["--small"] if ttft["small"] else [])
    log(f"exp5 {name}: kvtier bench ttft --lengths {ttft['length']} --repeats {ttft['repeats']} (shared: {node_a})")
    started = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)  # its NVMe files; the next target makes its own
    (out / f"exp5-{slug}-ttft.log").write_text(done.stdout + done.stderr)
    results_file = case_out / "results.json"
    row: dict[str, Any] = {"target": name, "command": " ".join(argv[1:]), "seconds": time.monotonic() - started}
    if not results_file.exists():
        row["error"] = f"kvtier bench ttft exited {done.returncode} without results: {done.stderr[-2000:]}"
        return row
    row.update(exp5_ttft_figures(name, results_file, ttft_bench.parse_tokens(ttft["length"])))
    if done.returncode != 0 and "error" not in row:
        row["error"] = f"kvtier bench ttft exited {done.returncode}: {done.stderr[-1000:]}"
    return row


def exp5_ttft_figures(name: str, results_file: Path, length: int) -> dict[str, Any]:
    """An experiment 5 TTFT row's figures from the results.json of its ``kvtier bench ttft`` run."""
    result = json.loads(results_file.read_text())
    row: dict[str, Any] = {"length": length, "repeats": result["plan"]["repeats"], "results": str(results_file)}
    for config in ("recompute", "kvtier_nvme", "kvtier_shared"):
        values = [
            m["ttft_s"] * 1e3 for m in result["measurements"] if m["config"] == config and m["length_tokens"] == length
        ]
        row[config] = ms_spread(values)
    # The NVMe phase times every prompt in one engine process; each shared-tier hit is the first
    # kvtier request of a fresh engine and service. The NVMe phase's first request is the like case.
    first_nvme = [m for m in result["measurements"] if m["config"] == "kvtier_nvme" and m["length_tokens"] == length]
    row["kvtier_nvme_first_ms"] = first_nvme[0]["ttft_s"] * 1e3 if first_nvme else None
    shared = [m for m in result["measurements"] if m["config"] == "kvtier_shared"]
    row["shared_blocks"] = [m["kvtier"]["shared_hits"] for m in shared]
    row["expected_blocks"] = length // int(result["plan"]["block_tokens"])
    outputs = result["summary"]["outputs_vs_recompute"].get("kvtier_shared", {})
    row["same_token"] = f"{outputs.get('same_token', 0)}/{outputs.get('compared', 0)}"
    row["max_logprob_diff"] = outputs.get("max_logprob_diff")
    row["publish"] = [
        {k: v for k, v in record.items() if k != "kind"}
        for record in [result["phases"].get("kvtier_shared_store", {}).get("shared_publish")]
        if record
    ]
    failures = [note for note in result["notes"] if "FAILED" in note or note.startswith("incomplete")]
    if failures or row["kvtier_shared"] is None:
        row["error"] = "; ".join(failures) or "no shared-tier hit measured"
    shared_ms, nvme_ms, recompute_ms = (
        row[c]["median"] if row[c] else None for c in ("kvtier_shared", "kvtier_nvme", "recompute")
    )
    nvme_first_ms = row["kvtier_nvme_first_ms"]
    row["shared_over_nvme"] = shared_ms / nvme_ms if shared_ms and nvme_ms else None
    row["shared_over_nvme_first"] = shared_ms / nvme_first_ms if shared_ms and nvme_first_ms else None
    row["shared_over_recompute"] = shared_ms / recompute_ms if shared_ms and recompute_ms else None
    if shared_ms:
        log(
            f"exp5 {name}: TTFT at {length} tokens: shared-tier hit {shared_ms:.0f} ms (median of "
            f"{row['kvtier_shared']['n']}), local NVMe hit {nvme_ms or 0:.0f} ms, "
            f"recompute {recompute_ms or 0:.0f} ms; "
            f"blocks from the shared tier {row['shared_blocks']} of {row['expected_blocks']}"
        )
    return row


def first_spread(row: dict[str, Any]) -> dict[str, float] | None:
    """The NVMe phase's first request as a spread of one (for the table and the plot)."""
    first = row.get("kvtier_nvme_first_ms")
    return ms_spread([first]) if first is not None else None


def ms_spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "median": float(np.median(values)),
        "p99": float(np.percentile(values, 99)),
        "min": float(min(values)),
        "max": float(max(values)),
        "n": len(values),
    }


def ceph_osd_bytes(ttft: dict[str, Any] | None) -> int:
    """The memstore OSD's size: 2 GiB, or enough for one TTFT run's prompts (the run removes them
    when it ends; the default and strict runs share the cluster) below 60 % of the OSD."""
    if not ttft:
        return 2 << 30
    from kvtier.bench import ttft as ttft_bench
    from kvtier.models import PRESETS

    kv_bytes = PRESETS["tiny" if ttft["small"] else "kv8b"].kv_bytes_per_token
    prompt_bytes = ttft_bench.parse_tokens(ttft["length"]) * kv_bytes * 1.05
    needed = ttft["repeats"] * prompt_bytes + (512 << 20)  # + experiment 5's own blocks
    return max(2 << 30, int(needed / 0.6) // (1 << 30) * (1 << 30) + (1 << 30))


def exp5(
    targets: list[str], work: Path, blocks: int, passes: int, out: Path, ttft: dict[str, Any] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Experiment 5's get latency rows, and with ``ttft`` its TTFT rows, per target."""
    rows: list[dict[str, Any]] = []
    ttft_rows: list[dict[str, Any]] = []
    for target in targets:
        if target == "local":
            d = work / "local-shared"
            d.mkdir()
            rows.append(exp5_one("local disk", d, d, work / "local-stores", blocks, passes))
            if ttft:
                ttft_rows.append(exp5_ttft("local disk", d, d, work / "ttft-local", out, ttft))
            continue
        state = Path(f"/tmp/kvtier-distfs/bench-{target}")
        script = DISTFS / f"{target}.sh"
        log(f"exp5: bringing up {target}")
        env = dict(os.environ)
        if target == "cephfs":
            env.setdefault("KVTIER_CEPH_OSD_BYTES", str(ceph_osd_bytes(ttft)))
        up = subprocess.run(["bash", str(script), "up", str(state)], capture_output=True, text=True, env=env)
        try:
            if up.returncode != 0:
                rows.append({"target": target, "skipped": up.stderr.strip()[-500:]})
                if ttft:
                    ttft_rows.append({"target": target, "error": "not up: " + up.stderr.strip()[-500:]})
                continue
            mounts = dict(line.split("=", 1) for line in up.stdout.split() if "=" in line)
            for mode in ("default", "strict"):
                a, b = Path(mounts[f"{mode}-a"]) / f"exp5-{mode}", Path(mounts[f"{mode}-b"]) / f"exp5-{mode}"
                a.mkdir()
                time.sleep(1.1)  # past default attribute caches: node B sees the directory
                name = f"{target} ({mode} caching)"
                rows.append(exp5_one(name, a, b, work / f"{target}-{mode}", blocks, passes))
                if ttft:
                    ttft_rows.append(exp5_ttft(name, a, b, work / f"ttft-{target}-{mode}", out, ttft))
        finally:
            subprocess.run(["bash", str(script), "down", str(state)], capture_output=True, text=True)
    return rows, ttft_rows


@contextlib.contextmanager
def shared_target(target: str, work: Path, env: dict[str, str] | None = None) -> Iterator[dict[str, Path]]:
    """Node A's and node B's view of a shared directory per caching mode (``default-a``, ``default-b``,
    ``strict-a``, ``strict-b``; a local directory is its own two views): brings the target up with
    scripts/distfs/<target>.sh and always tears it down. Raises RuntimeError if it does not come up."""
    if target == "local":
        d = work / "local-shared"
        d.mkdir(exist_ok=True)
        yield {f"{mode}-{node}": d for mode in ("default", "strict") for node in "ab"}
        return
    state = Path(f"/tmp/kvtier-distfs/bench-{target}")
    script = DISTFS / f"{target}.sh"
    log(f"bringing up {target}")
    try:
        up = subprocess.run(["bash", str(script), "up", str(state)], capture_output=True, text=True, env=env)
        if up.returncode != 0:
            raise RuntimeError(f"{target} not up: " + up.stderr.strip()[-500:])
        yield {name: Path(path) for name, path in (line.split("=", 1) for line in up.stdout.split() if "=" in line)}
    finally:
        down = subprocess.run(["bash", str(script), "down", str(state)], capture_output=True, text=True)
        log(f"{target} torn down (exit {down.returncode})")


def exp3(targets: list[str], modes: list[str], work: Path, out: Path, sweep: dict[str, Any]) -> list[dict[str, Any]]:
    """``kvtier bench blocks`` with the shared tier on each target and caching mode: one row each."""
    rows: list[dict[str, Any]] = []
    for target in targets:
        try:
            with shared_target(target, work) as mounts:
                for mode in modes if target != "local" else ["default"]:
                    name = "local disk" if target == "local" else f"{target} ({mode} caching)"
                    a, b = mounts[f"{mode}-a"] / f"exp3-{mode}", mounts[f"{mode}-b"] / f"exp3-{mode}"
                    a.mkdir(exist_ok=True)
                    time.sleep(1.1)  # past default attribute caches: node B sees the directory
                    rows.append(exp3_one(name, a, b, work / f"exp3-store-{target}-{mode}", out, sweep))
        except RuntimeError as error:
            rows.append({"target": target, "error": str(error)})
    return rows


def exp3_one(
    name: str, node_a: Path, node_b: Path, store_dir: Path, out: Path, sweep: dict[str, Any]
) -> dict[str, Any]:
    slug = name.replace(" (", "-").replace(" caching)", "").replace(" ", "-")
    case_out = out / f"exp3-{slug}"
    argv = [str(REPO / ".venv/bin/kvtier"), "bench", "blocks", "--length", sweep["length"]]
    argv += ["--repeats", str(sweep["repeats"])] + (["--block-tokens", sweep["blocks"]] if sweep["blocks"] else [])
    argv += ["--shared-root-store", str(node_a), "--shared-root-load", str(node_b)]
    argv += ["--shared-file-bytes", sweep["file_bytes"]] if sweep["file_bytes"] else []
    argv += ["--store-dir", str(store_dir), "--out", str(case_out)] + (["--small"] if sweep["small"] else [])
    log(f"exp3 {name}: {' '.join(argv[1:])}")
    started = time.monotonic()
    with (out / f"exp3-{slug}.log").open("w") as log_file:
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert child.stdout is not None
            for line in child.stdout:  # the runs print progress: pass it on, and keep it
                log_file.write(line)
                if line.startswith(("[blocks]", "kvtier bench", "[ttft")) or " phase " in line:
                    print(f"  exp3 {slug}: {line.rstrip()}", flush=True)
            code = child.wait()
        finally:
            if child.poll() is None:  # interrupted: stop the sweep before the filesystem goes down
                child.send_signal(signal.SIGINT)  # its finally blocks stop the engine phase it runs
                try:
                    child.wait(60)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
            shutil.rmtree(store_dir, ignore_errors=True)
    row: dict[str, Any] = {"target": name, "command": " ".join(argv[1:]), "seconds": time.monotonic() - started}
    results_file = case_out / "results.json"
    if not results_file.exists():
        row["error"] = f"kvtier bench blocks exited {code} without results (log: exp3-{slug}.log)"
        return row
    document = json.loads(results_file.read_text())
    row.update({"results": str(results_file), "rows": document["rows"], "file_rows": document.get("file_rows", [])})
    row["report"] = (case_out / "report.md").read_text() if (case_out / "report.md").exists() else ""
    row["plot"] = f"exp3-{slug}/ttft_vs_block.png" if "ttft_vs_block.png" in document.get("plots", []) else None
    if code != 0:
        row["error"] = f"kvtier bench blocks exited {code} (its report lists the problems)"
    return row


# ---- report ----


def plot(results: dict[str, Any], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows4 = [r for r in results.get("exp4", []) if "kvtier_store" in r]
    if rows4:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = ["kvtier_store", "kvtier_retrieve", "fio_write", "fio_read"]
        width = 0.2
        for j, n in enumerate(names):
            ax.bar(
                [i + j * width for i in range(len(rows4))],
                [r[n]["median"] for r in rows4],
                width,
                label=n.replace("_", " "),
            )
        ax.set_xticks([i + 1.5 * width for i in range(len(rows4))], [r["fs"] for r in rows4])
        ax.set_ylabel("GB/s (median)")
        ax.set_title("Experiment 4: filesystem type (loop file, direct I/O)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "exp4.png", dpi=120)
    rows5 = [r for r in results.get("exp5", []) if "latency_ms" in r]
    if rows5:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        xs = range(len(rows5))
        ax.bar([x - 0.2 for x in xs], [r["latency_ms"]["median"] for r in rows5], 0.4, label="median")
        ax.bar([x + 0.2 for x in xs], [r["latency_ms"]["p99"] for r in rows5], 0.4, label="p99")
        ax.set_xticks(list(xs), [r["target"].replace(" (", "\n(") for r in rows5], fontsize=7)
        ax.set_ylabel("ms per 2 MiB block")
        ax.set_title("Experiment 5: shared-tier cold retrieve latency, node B")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "exp5.png", dpi=120)
    rows5t = [r for r in results.get("exp5_ttft", []) if r.get("kvtier_shared")]
    if rows5t:
        fig, ax = plt.subplots(figsize=(8, 4.8))
        xs = list(range(len(rows5t)))
        series = (("recompute", "recompute (same run)", "0.6"), ("kvtier_nvme", "local NVMe hit (same run)", "C0"),
                  ("kvtier_nvme_first", "local NVMe hit, first request of its engine", "C9"),
                  ("kvtier_shared", "shared-tier hit (node B, fresh engine each)", "C3"))  # fmt: skip
        width = 0.2
        for j, (config, label, color) in enumerate(series):
            spreads = [r.get(config) if config != "kvtier_nvme_first" else first_spread(r) for r in rows5t]
            medians = [sp["median"] if sp else 0 for sp in spreads]
            errors = [
                [sp["median"] - sp["min"] if sp else 0 for sp in spreads],
                [sp["max"] - sp["median"] if sp else 0 for sp in spreads],
            ]
            ax.bar(
                [x + (j - 1.5) * width for x in xs], medians, width, yerr=errors, capsize=3, label=label, color=color
            )
        ax.set_xticks(xs, [r["target"].replace(" (", "\n(") for r in rows5t], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (ms), median with min-max")
        length = rows5t[0]["length"]
        ax.set_title(f"Experiment 5 through vLLM: TTFT of a {length}-token prompt, every block from the shared tier")
        ax.title.set_fontsize(9)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
        fig.tight_layout()
        fig.savefig(out / "exp5-ttft.png", dpi=120)


def report(results: dict[str, Any], out: Path) -> str:
    lines = [f"# Filesystem experiments ({results['started_at']})", "", f"Command: `{' '.join(results['argv'])}`", ""]
    if "exp4" in results:
        lines += [
            "## Experiment 4: filesystem type",
            "",
            "Loop file on this machine's disk, `losetup --direct-io=on`, mkfs defaults; "
            f"`kvtier bench io {' '.join(results['bench_io_args'])}` on each (GB/s, min / median / max).",
            "",
            "| fs | kvtier store | kvtier retrieve | fio write | fio read | wrong |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in results["exp4"]:
            if "kvtier_store" not in r:
                lines.append(f"| {r['fs']} | {r.get('skipped') or r.get('error')} | | | | |")
                continue

            def cell(s: dict[str, float]) -> str:
                return f"{s['min']:.2f} / **{s['median']:.2f}** / {s['max']:.2f}"

            lines.append(
                f"| {r['fs']} | {cell(r['kvtier_store'])} | {cell(r['kvtier_retrieve'])} | {cell(r['fio_write'])} | "
                f"{cell(r['fio_read'])} | {r['wrong_objects']} |"
            )
        lines += ["", "![exp4](exp4.png)", ""]
        ttft_rows = [r for r in results["exp4"] if "ttft" in r]
        if ttft_rows:
            lines += [
                "TTFT through vLLM with the store on each filesystem (`kvtier bench ttft`, ms, median):",
                "",
                "| fs | tokens | recompute | kvtier DRAM hit | kvtier NVMe hit | fio read, same bytes | NVMe reads |",
                "| --- | --- | --- | --- | --- | --- | --- |",
            ]
            for r in ttft_rows:
                t = r["ttft"]
                if "error" in t:
                    lines.append(f"| {r['fs']} | {t['error'][:200]} | | | | | |")
                    continue

                def ms(value: float | None) -> str:
                    return f"{value:.0f}" if value is not None else "-"

                lines.append(
                    f"| {r['fs']} | {t['length']} | {ms(t['recompute_ms'])} | {ms(t['kvtier_dram_ms'])} | "
                    f"{ms(t['kvtier_nvme_ms'])} | {ms(t['disk_floor_ms'])} | {t['nvme_read_requests']} |"
                )
            lines.append("")
    if "exp5" in results:
        lines += [
            "## Experiment 5: local disk against GlusterFS against CephFS",
            "",
            "Node A publishes 2 MiB blocks; node B (its own mount) gets them one per call, page cache dropped "
            "before each pass; latency of `get_many([key])`.",
            "",
            "| target | median ms | p99 ms | GB/s | reads | misses | wrong | publish GB/s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in results["exp5"]:
            if "latency_ms" not in r:
                lines.append(f"| {r['target']} | skipped: {r.get('skipped')} | | | | | | |")
                continue
            m = r["latency_ms"]
            lines.append(
                f"| {r['target']} | {m['median']:.2f} | {m['p99']:.2f} | {r['retrieve_gbps']:.2f} | {r['reads']} | "
                f"{r['misses']} | {r['wrong']} | {r['publish_gbps']:.2f} |"
            )
        lines += ["", "![exp5](exp5.png)", ""]
    if results.get("exp5_ttft"):
        lines += exp5_ttft_report(results["exp5_ttft"])
    for r in results.get("exp3", []):
        lines += [f"## Experiment 3 with the shared tier on {r['target']}", ""]
        lines += [f"`kvtier {r['command']}` ({r['seconds']:.0f} s)", ""] if "command" in r else []
        lines += [f"**Failed:** {r['error']}", ""] if "error" in r else []
        # kvtier bench blocks' report, its headings one level down; its plot
        lines += [line.replace("### ", "#### ", 1) for line in r.get("report", "").splitlines()]
        lines += ["", f"![exp3 {r['target']}]({r['plot']})", ""] if r.get("plot") else []
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text


def exp5_ttft_report(rows: list[dict[str, Any]]) -> list[str]:
    measured = [r for r in rows if r.get("length")]
    length = measured[0]["length"] if measured else "?"
    lines = [
        f"### Experiment 5 through vLLM: TTFT of a shared-tier hit ({length} tokens)",
        "",
        "One `kvtier bench ttft` run per target: node A's engine publishes each prompt to the shared tier "
        "through its mount; a fresh engine and service on node B (its own mount, empty local store, page "
        "cache dropped) reads every block from the shared tier. Recompute and the local NVMe hit are from "
        "the same run: the NVMe phase times its prompts in one engine process, so its first request (a fresh "
        "engine and service, as every shared-tier hit is) is shown apart. ms; p99 over so few repeats is "
        "close to the max.",
        "",
        "| target | shared hit median | p99 | min | max | n | local NVMe hit median | NVMe hit, first of its engine "
        "| recompute median | shared / NVMe | shared / NVMe first | shared / recompute | blocks from shared tier "
        "| same token |",
        "|" + " --- |" * 14,
    ]

    def ms(spread: dict[str, float] | None, key: str = "median") -> str:
        return f"{spread[key]:.0f}" if spread else "-"

    def ratio(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "-"

    for r in rows:
        shared = r.get("kvtier_shared")
        if not shared:
            lines.append(f"| {r['target']} | error: {str(r.get('error'))[:300]} |" + " |" * 12)
            continue
        blocks = ", ".join(str(b) for b in r["shared_blocks"]) + f" of {r['expected_blocks']} each"
        lines.append(
            f"| {r['target']} | {ms(shared)} | {ms(shared, 'p99')} | {ms(shared, 'min')} | {ms(shared, 'max')} | "
            f"{shared['n']} | {ms(r.get('kvtier_nvme'))} | {ms(first_spread(r))} | "
            f"{ms(r.get('recompute'))} | {ratio(r['shared_over_nvme'])} | {ratio(r['shared_over_nvme_first'])} | "
            f"{ratio(r['shared_over_recompute'])} | {blocks} | {r['same_token']} |"
        )
        if r.get("error"):
            lines.append(f"| {r['target']} | error: {r['error'][:300]} |" + " |" * 12)
    return [*lines, "", "![exp5-ttft](exp5-ttft.png)", ""]


def rereport(out: Path) -> int:
    results = json.loads((out / "results.json").read_text())
    for row in results.get("exp5_ttft", []):
        if row.get("results") and Path(row["results"]).exists():
            row.update(exp5_ttft_figures(row["target"], Path(row["results"]), row["length"]))
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out)
    print(report(results, out))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "bench-results" / f"fs-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--only", choices=["exp3", "exp4", "exp5"], help="exp3 runs only when named")
    p.add_argument("--filesystems", default="ext4,xfs,f2fs,btrfs")
    p.add_argument("--targets", default="local,glusterfs,cephfs")
    p.add_argument("--small", action="store_true", help="CI size: 2 GiB loop files, --small bench io, 32 blocks")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--blocks", type=int, default=128)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()), help="where the loop files go")
    p.add_argument(
        "--ttft-length",
        default="",
        help="also kvtier bench ttft at this prompt length: exp4 per filesystem (store on it), exp5 per target "
        "(a shared-tier hit through vLLM beside recompute and the local NVMe hit of the same run)",
    )
    p.add_argument("--ttft-repeats", type=int, default=2, help="prompts per TTFT run (exp3, exp4 and exp5)")
    p.add_argument("--exp3-blocks", default="", help="exp3: engine block sizes (default: kvtier bench blocks')")
    p.add_argument(
        "--exp3-file-bytes", default=None,
        help="exp3: shared_file_bytes sweep at 256-token blocks (default 64MiB,256MiB,1GiB; --small: 2MiB,8MiB; "
        "'' skips it)",
    )  # fmt: skip
    p.add_argument("--exp3-modes", default="default", help="exp3: caching modes of a network target (default,strict)")
    p.add_argument(
        "--rereport",
        type=Path,
        metavar="DIR",
        help="measure nothing: recompute experiment 5's TTFT rows of an earlier --out DIR from the kvtier bench "
        "ttft results.json files they name, and rewrite its results.json, report.md and plots",
    )
    args = p.parse_args()
    if args.rereport:
        return rereport(args.rereport)
    if os.geteuid() != 0:
        print("needs root (loop devices, mounts, dropping the page cache)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    bench_args = (
        ["--small", "--objects", "chunk256", "--no-lmcache"]  # one case, as the full run
        if args.small
        else ["--sizes", "8k", "--objects", "chunk256", "--repeats", str(args.repeats), "--no-lmcache"]
    )
    results: dict[str, Any] = {
        "benchmark": "scripts/distfs/bench_filesystems.py",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "argv": sys.argv,
        "kernel": os.uname().release,
        "cpu_count": os.cpu_count(),
        "bench_io_args": bench_args,
    }
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-fs-", dir=args.work))
    # A kill runs the finally blocks too: the filesystems are torn down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if args.only == "exp3":
            file_bytes = args.exp3_file_bytes
            sweep = {
                "length": args.ttft_length or ("1k" if args.small else "8k"),
                "repeats": 1 if args.small and "--ttft-repeats" not in sys.argv else args.ttft_repeats,
                "blocks": args.exp3_blocks,
                "file_bytes": ("2MiB,8MiB" if args.small else "64MiB,256MiB,1GiB")
                if file_bytes is None
                else file_bytes,
                "small": args.small,
            }
            results["exp3"] = exp3(args.targets.split(","), args.exp3_modes.split(","), work, args.out, sweep)
        if args.only in (None, "exp4"):
            results["exp4"] = []
            for fs in args.filesystems.split(","):
                # --small: bench io --small's largest case takes about 1.4 GB.
                size_gib = 2 if args.small else (24 if args.ttft_length else 6)
                row = exp4_one(fs, work, args.out, size_gib, bench_args, args.ttft_length, args.ttft_repeats)
                results["exp4"].append(row)
                (args.out / "results.json").write_text(json.dumps(results, indent=2))
        if args.only in (None, "exp5"):
            blocks = 32 if args.small else args.blocks
            ttft = (
                {"length": args.ttft_length, "repeats": args.ttft_repeats, "small": args.small}
                if args.ttft_length
                else None
            )
            results["exp5"], ttft_rows = exp5(args.targets.split(","), work, blocks, args.passes, args.out, ttft)
            if ttft:
                results["exp5_ttft"] = ttft_rows
    finally:
        shutil.rmtree(work, ignore_errors=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out)
    print(report(results, args.out))
    log(f"results: {args.out / 'results.json'}, report: {args.out / 'report.md'}")
    wrong = sum(r.get("wrong", 0) for r in results.get("exp5", [])) + sum(
        r.get("wrong_objects", 0) for r in results.get("exp4", [])
    )
    failed = [r["fs"] for r in results.get("exp4", []) if "error" in r or "error" in r.get("ttft", {})]
    failed += [f"exp5 TTFT {r['target']}" for r in results.get("exp5_ttft", []) if "error" in r]
    failed += [f"exp3 {r['target']}" for r in results.get("exp3", []) if "error" in r]
    if failed:
        log(f"failed on {', '.join(failed)} (the report's rows say why)")
    return 1 if wrong or failed else 0


if __name__ == "__main__":
    sys.exit(main())
