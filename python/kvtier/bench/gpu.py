"""``kvtier bench gpu``: the GPU data path against its limits, with PyTorch and kvtier only (no vLLM).

For each model shape, engine block size and vLLM GPU layout (``kvtier.gpu.layouts``) it builds a
paged KV cache on the device, runs a host service in this process (DRAM pool in ``/dev/shm`` as in
production, whatever ``--dir`` is: a file mapping on a disk filesystem cannot be pinned long-term;
NVMe tier in ``--dir``) and, through the worker's own transfers (``kvtier.gpu.transfers.BlockTransfers``):

- stores a job of blocks GPU→DRAM and restores them DRAM→GPU into other block ids (``--repeats``
  times, new keys each time), comparing every byte;
- restarts the service (the blocks are then on NVMe only) and restores them NVMe→GPU, pipelined,
  comparing every byte again;
- measures the limits in the same run: one pinned ``copy_`` of the same bytes each way, and O_DIRECT
  reads of a file of the same size on the same disk (threads issuing block-sized ``preadv``; fio's
  figure too when fio is installed);
- reports GB/s, the ratios to the limits, and CPU core-seconds per GB (``getrusage`` of this
  process, which runs the service as well).

Cases run most informative first (the first model's first layout and block size, then MLA, then
the rest); ``gpu.json`` in ``--out`` is rewritten after the ordering check and after every case, so a
run cut off by its time limit still leaves what it measured, and ``--budget-s`` skips the cases that
would not finish in time. ``--device cpu --small`` runs the same path on host tensors (CI does, to
keep the harness working); only a CUDA run says anything about a GPU.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import mmap
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvtier._core import Service, ServiceClient
from kvtier.gpu.device import pool_view
from kvtier.gpu.executors import CopyJob, gpu_candidates, run_on, self_test
from kvtier.gpu.layouts import MODELS, ModelShape, PagedCache, fill_random, layouts_for, paged_cache
from kvtier.gpu.transfers import BlockTransfers
from kvtier.service import default_socket_path

SMALL_MODELS = {
    "small": ModelShape("small", layers=4, kv_heads=2, head_dim=32),
    "small-mla": ModelShape("small-mla", layers=3, kv_heads=1, head_dim=0, latent=72),
}
DIRECT_ALIGN = 4096
DISK_READ_THREADS = 8
TARGET_DRAM_RATIO = 0.9
TARGET_NVME_RATIO = 0.85
# The pool's filesystem: tmpfs, which the driver pins long-term, as the service's own default.
SHM_DIR = Path("/dev/shm")
# The ordering check's busy kernel: about 0.3 s of an H100's clock before the writes it orders.
BUSY_CYCLES = 600_000_000


def log(message: str) -> None:
    print(f"[bench gpu] {message}", flush=True)


class Cpu:
    """CPU time of this process (every thread: the job's and the in-process service's)."""

    def __init__(self) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.started = usage.ru_utime + usage.ru_stime

    def seconds(self) -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime - self.started


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, action: Callable[[], Any]) -> tuple[float, float, Any]:
    """Wall seconds, CPU seconds and the result of ``action`` (the device drained before and after)."""
    synchronize(device)
    cpu = Cpu()
    started = time.perf_counter()
    result = action()
    synchronize(device)
    return time.perf_counter() - started, cpu.seconds(), result


def summary(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


class Host:
    """A host service in this process for one case, restartable over the same store."""

    def __init__(self, directory: Path, object_bytes: int, dram_bytes: int, nvme_bytes: int, **options: Any):
        self.directory, self.object_bytes = directory, object_bytes
        self.dram_bytes, self.nvme_bytes = dram_bytes, nvme_bytes
        self.options = options  # more store options (``kvtier.options()``)
        self.pool_dir = pool_directory(dram_bytes)
        # Under /tmp/kvtier-<uid>/ (or $XDG_RUNTIME_DIR): a socket path beside a deep --dir could
        # pass the 108 bytes a Unix socket's path may have.
        self.socket = str(default_socket_path(directory / "store"))
        self.service: Any = None
        self.start()

    def start(self) -> None:
        self.service = Service.start(
            self.socket,
            str(self.directory / "store"),
            str(self.pool_dir),
            30_000,
            dram_bytes=self.dram_bytes,
            nvme_bytes=self.nvme_bytes,
            **self.options,
        )

    def client(self) -> Any:
        client = ServiceClient.connect(self.socket, 600_000)
        client.hello(b"kvtier-bench-gpu", 1, 0, self.object_bytes)
        client.populate_pool()  # as an engine's worker does: copies measured without page faults
        return client

    def restart(self) -> None:
        self.service.stop()
        self.start()

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()
            self.service = None
        shutil.rmtree(self.pool_dir, ignore_errors=True)


def pool_directory(pool_bytes: int) -> Path:
    """A directory of ours in /dev/shm for one service's pool (removed by ``Host.stop``)."""
    base = SHM_DIR if SHM_DIR.is_dir() else None
    if base is not None and shutil.disk_usage(base).free < pool_bytes + (64 << 20):
        free = shutil.disk_usage(base).free
        raise SystemExit(
            f"kvtier bench gpu: /dev/shm has {free / 2**30:.1f} GiB free, the pool needs {pool_bytes / 2**30:.1f} GiB: "
            "grow it (as root: mount -o remount,size=32g /dev/shm) or pass a smaller --job-mib"
        )
    return Path(tempfile.mkdtemp(prefix="kvtier-bench-gpu-pool-", dir=base))


def keys_for(case: str, repeat: int, count: int) -> list[bytes]:
    """``count`` distinct 32-byte block keys for one repeat of a case. Hashed: the first GPU run cut
    readable names to 32 bytes, and every case whose name ran past that stored one block under all
    its keys (its "wrong bytes" were the benchmark's, not kvtier's)."""
    keys = [hashlib.blake2b(f"{case}|{repeat}|{i}".encode(), digest_size=32).digest() for i in range(count)]
    assert len(set(keys)) == count, "block keys must be distinct"
    return keys


def compare(source: PagedCache, source_ids: Sequence[int], restored: PagedCache, restored_ids: Sequence[int]) -> int:
    """Blocks whose bytes differ (0 when the restore is exact), compared on the device."""
    wrong = 0
    for src_row, dst_row in zip(source.rows, restored.rows, strict=True):
        a = src_row[torch.tensor(list(source_ids), device=src_row.device)]
        b = dst_row[torch.tensor(list(restored_ids), device=dst_row.device)]
        wrong = max(wrong, int((a != b).any(dim=1).sum()))
    return wrong


def pinned_copy_gbps(device: torch.device, nbytes: int, repeats: int) -> dict[str, dict[str, float]]:
    """One ``copy_`` of ``nbytes`` between pinned host memory and the device, each way."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out: dict[str, list[float]] = {"to_host": [], "to_device": []}
    host.copy_(on_device)  # first touch and lazy initialization stay out of the timings
    on_device.copy_(host)
    for _ in range(repeats):
        seconds, _, _ = timed(device, lambda: host.copy_(on_device, non_blocking=True))
        out["to_host"].append(nbytes / seconds / 1e9)
        seconds, _, _ = timed(device, lambda: on_device.copy_(host, non_blocking=True))
        out["to_device"].append(nbytes / seconds / 1e9)
    return {direction: summary(values) for direction, values in out.items()}


def direct_read_gbps(directory: Path, nbytes: int, request_bytes: int, repeats: int) -> dict[str, Any]:
    """O_DIRECT reads of a ``nbytes`` file beside the store: ``DISK_READ_THREADS`` threads, each
    reading its share in ``request_bytes`` requests into its own aligned buffer."""
    request_bytes = max(DIRECT_ALIGN, request_bytes // DIRECT_ALIGN * DIRECT_ALIGN)
    requests = max(1, nbytes // request_bytes)
    path = directory / "direct-read-limit.bin"
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags, 0o600)
    try:
        chunk = mmap.mmap(-1, request_bytes)
        chunk.write(os.urandom(min(request_bytes, 1 << 20)) * (request_bytes // min(request_bytes, 1 << 20)))
        for index in range(requests):
            os.pwrite(fd, chunk, index * request_bytes)
        os.fsync(fd)
        rates = []
        for _ in range(repeats):

            def reader(thread: int) -> None:
                buffer = mmap.mmap(-1, request_bytes)
                for index in range(thread, requests, DISK_READ_THREADS):
                    os.preadv(fd, [buffer], index * request_bytes)

            threads = [threading.Thread(target=reader, args=(t,)) for t in range(DISK_READ_THREADS)]
            started = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            rates.append(requests * request_bytes / (time.perf_counter() - started) / 1e9)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return {
        "gbps": summary(rates),
        "request_bytes": request_bytes,
        "threads": DISK_READ_THREADS,
        "file_bytes": requests * request_bytes,
    }


def fio_read_gbps(directory: Path, nbytes: int, request_bytes: int) -> dict[str, Any] | None:
    if shutil.which("fio") is None:
        return None
    from kvtier.bench import fio

    filename = str(directory / "fio-limit.bin")
    try:
        limits = fio.measure_limits(filename, nbytes, request_bytes, 64 * request_bytes)
    except Exception as error:
        return {"error": str(error)}
    finally:
        fio.remove_test_file(filename)
    return {"gbps": limits["best_read"]["gbps"], "run": limits["best_read"]}


def run_case(args: argparse.Namespace, model: ModelShape, block_tokens: int, layout: str, work: Path) -> dict[str, Any]:
    device = torch.device(args.device)
    name = f"{model.name}/{layout}/block{block_tokens}"
    block_bytes = model.token_bytes(torch.bfloat16) * block_tokens
    blocks = max(2, int(args.job_mib * (1 << 20)) // block_bytes)
    job_bytes = blocks * block_bytes
    source = paged_cache(model, layout, blocks, block_tokens, device)
    restored = paged_cache(model, layout, blocks, block_tokens, device)
    fill_random(source, seed=11)
    fill_random(restored, seed=12)
    directory = Path(tempfile.mkdtemp(prefix="case-", dir=work))
    # Room for every repeat's blocks at once, so that no store waits for NVMe writes to free slots.
    dram_bytes = (args.repeats + 1) * (job_bytes + blocks * 8192)
    result: dict[str, Any] = {"case": name, "model": model.name, "layout": layout, "block_tokens": block_tokens}
    result.update({"blocks": blocks, "block_bytes": block_bytes, "job_bytes": job_bytes, "tensors": len(source.rows)})
    host = None
    try:
        host = Host(directory, block_bytes, dram_bytes, nvme_bytes=2 * (args.repeats + 1) * job_bytes + (256 << 20))
        result["pool_dir"] = str(host.pool_dir.parent)
        # Closed (unpinned) on every way out, before the service and the clients' mappings go.
        with BlockTransfers(source.rows) as storer, BlockTransfers(restored.rows) as loader:
            result.update(measure_phases(args, device, host, (storer, loader), (source, restored), name))
        result["limits"] = {"pinned_copy": pinned_copy_gbps(device, job_bytes, args.repeats)}
        try:
            result["limits"]["direct_read"] = direct_read_gbps(directory, job_bytes, block_bytes, args.repeats)
        except OSError as error:  # no O_DIRECT on this filesystem (tmpfs, some gVisor mounts)
            result["limits"]["direct_read"] = {"error": str(error)}
        if not args.skip_fio:
            result["limits"]["fio_read"] = fio_read_gbps(directory, job_bytes, block_bytes)
        result["ratios"] = ratios(result)
    finally:
        if host is not None:
            host.stop()
        shutil.rmtree(directory, ignore_errors=True)
    return result


def measure_phases(
    args: argparse.Namespace,
    device: torch.device,
    host: Host,
    transfers: tuple[BlockTransfers, BlockTransfers],
    caches: tuple[PagedCache, PagedCache],
    name: str,
) -> dict[str, Any]:
    """GPU→DRAM stores and DRAM→GPU restores, then NVMe→GPU restores after a restart; every byte
    compared. Restores land in other block ids (reversed order)."""
    (storer, loader), (source, restored) = transfers, caches
    blocks = source.rows[0].shape[0]
    job_bytes = blocks * source.block_bytes
    source_ids, restored_ids = list(range(blocks)), list(reversed(range(blocks)))
    client = host.client()
    storer.bind(client)
    loader.bind(client)
    rates: dict[str, list[float]] = {"gpu_to_dram": [], "dram_to_gpu": [], "nvme_to_gpu": []}
    cpu: dict[str, list[float]] = {key: [] for key in rates}
    wrong: dict[str, int] = {"dram": 0, "nvme": 0}
    missing: dict[str, int] = {"store": 0, "dram": 0, "nvme": 0}

    def measure(phase: str, miss_kind: str, action: Callable[[], list[bool]]) -> None:
        seconds, cpu_s, moved = timed(device, action)
        missing[miss_kind] += moved.count(False)
        rates[phase].append(job_bytes / seconds / 1e9)
        cpu[phase].append(cpu_s / (job_bytes / 1e9))

    for repeat in range(args.repeats):
        keys = keys_for(name, repeat, blocks)
        measure("gpu_to_dram", "store", functools.partial(storer.store, client, keys, source_ids))
        measure("dram_to_gpu", "dram", functools.partial(loader.load, client, keys, restored_ids))
        wrong["dram"] = max(wrong["dram"], compare(source, source_ids, restored, restored_ids))
        fill_random(restored, seed=13 + repeat)
    others = other_executor_loads(device, loader, (source, restored), client, name, args.repeats)
    store_copies = store_copy_rates(device, storer, source, client, args.repeats)
    client.flush()
    host.restart()  # the DRAM pool is gone: every block is on NVMe only
    client = host.client()
    loader.bind(client)  # the new pool mapping, pinned before the clock starts
    for repeat in range(args.repeats):
        keys = keys_for(name, repeat, blocks)
        measure("nvme_to_gpu", "nvme", functools.partial(loader.load, client, keys, restored_ids))
        wrong["nvme"] = max(wrong["nvme"], compare(source, source_ids, restored, restored_ids))
        fill_random(restored, seed=31 + repeat)
    return {
        "executor": storer.executor.name if storer.executor else None,
        "pinned_pool": storer.pool_pinned and loader.pool_pinned,
        "gbps": {key: summary(values) for key, values in rates.items()},
        "cpu_core_s_per_gb": {key: summary(values) for key, values in cpu.items()},
        "wrong_blocks": wrong,
        "missing_blocks": missing,
        "dram_to_gpu_other_executors": others,
        "gpu_to_dram_copy_only": store_copies,
        "load_rounds": loader.counters.load_rounds,
        "errors": storer.counters.errors + loader.counters.errors,
    }


def store_copy_rates(
    device: torch.device, chosen: BlockTransfers, source: PagedCache, client: Any, repeats: int
) -> dict[str, Any]:
    """GB/s of a store's copies alone (reserved slots, the copies issued and waited for, then the
    slots given back: no commit, no checksum), through the chosen executor and every other that
    passes its self-test: which copies a store fastest, apart from the service's commit."""
    if chosen.plan is None or chosen.executor is None:
        return {}
    pool = client.pool()
    view = pool_view(int(pool["address"]), int(pool["bytes"]))
    blocks = source.rows[0].shape[0]
    executors: list[Any] = [chosen.executor]
    out: dict[str, Any] = {}
    for label, make in gpu_candidates(device, chosen.plan):
        try:
            executor = make()
            if executor.name != chosen.executor.name:
                self_test(executor, device, chosen.side)
                executors.append(executor)
        except Exception as error:
            out[label] = {"error": f"{type(error).__name__}: {error}"}
    for executor in executors:
        rates = []
        for repeat in range(repeats):
            keys = keys_for(f"copy-only/{executor.name}", repeat, blocks)
            client.flush()  # the NVMe backlog drained: every block gets a slot now
            replies = client.reserve_many(keys)
            if any(kind != "fill" for kind, _ in replies):
                client.abort_many(keys)
                out[executor.name] = {"error": f"no slot for some blocks: {sorted({kind for kind, _ in replies})}"}
                break
            offsets = [offset for _, offset in replies]
            job = CopyJob(chosen.plan, source.rows, list(range(blocks)), offsets, view, int(pool["address"]), True)
            seconds, _, _ = timed(device, functools.partial(run_on, chosen.side, executor, job))
            client.abort_many(keys)
            rates.append(blocks * source.block_bytes / seconds / 1e9)
        if rates:
            out[executor.name] = {"gbps": summary(rates)}
    return out


def other_executor_loads(
    device: torch.device,
    chosen: BlockTransfers,
    caches: tuple[PagedCache, PagedCache],
    client: Any,
    name: str,
    repeats: int,
) -> dict[str, Any]:
    """DRAM→GPU restores of the same blocks through every other executor that passes its self-test
    (the chosen one's are ``gbps.dram_to_gpu``). The first GPU run (H200) restored 64 KiB pages at
    0.67x pinned copies with ``cuMemcpyBatchAsync`` and 256 KiB pages at 0.9x: whether staged copies
    (one DMA per block, gathers on the GPU) do better on small pages is what this records."""
    if chosen.plan is None or chosen.executor is None:
        return {}
    source, restored = caches
    ids = list(range(source.rows[0].shape[0]))
    out: dict[str, Any] = {}
    for label, make in gpu_candidates(device, chosen.plan):
        try:
            executor = make()
            if executor.name == chosen.executor.name:
                continue
            self_test(executor, device, chosen.side)
        except Exception as error:
            out[label] = {"error": f"{type(error).__name__}: {error}"}
            continue
        rates, wrong = [], 0
        with BlockTransfers(restored.rows, executor=executor, side=chosen.side) as loader:
            loader.bind(client)
            for repeat in range(repeats):
                load = functools.partial(loader.load, client, keys_for(name, repeat, len(ids)), ids[::-1])
                seconds, _, found = timed(device, load)
                rates.append(len(ids) * source.block_bytes / seconds / 1e9 if all(found) else 0.0)
                wrong = max(wrong, compare(source, ids, restored, ids[::-1]))
                fill_random(restored, seed=41 + repeat)
        out[executor.name] = {"gbps": summary(rates), "wrong_blocks": wrong}
    return out


def keep_busy(device: torch.device) -> None:
    """Queues about 0.3 s of work on the current (engine) stream, so that writes queued next are
    still pending when the transfers are handed the job."""
    if device.type == "cuda":
        torch.cuda._sleep(BUSY_CYCLES)


def ordering_check(device: torch.device, work: Path) -> dict[str, Any]:
    """A store submitted while the engine's stream is still busy and about to write the blocks must
    copy the written bytes, not what was there before; a load submitted while the engine's stream
    is about to overwrite its destination (vLLM zeroes reused blocks) must land after that write.
    On the host every copy is synchronous, so this checks the GPU's event ordering only with
    ``--device cuda``."""
    model = ModelShape("ordering", layers=4, kv_heads=8, head_dim=128)
    cache, back = paged_cache(model, "nhd", 64, 16, device), paged_cache(model, "nhd", 64, 16, device)
    for row in [*cache.rows, *back.rows]:
        row.zero_()
    directory = Path(tempfile.mkdtemp(prefix="ordering-", dir=work))
    host = None
    try:
        host = Host(directory, cache.block_bytes, 64 * (cache.block_bytes + 8192), 256 << 20)
        client = host.client()
        keys, ids = keys_for("ordering", 0, 64), list(range(64))
        with BlockTransfers(cache.rows) as storer, BlockTransfers(back.rows) as loader:
            storer.bind(client)
            loader.bind(client)
            keep_busy(device)
            for index, row in enumerate(cache.rows):
                row.fill_(index + 1)
            started = time.perf_counter()
            stored = storer.store(client, keys, ids, storer.ready_marker())
            store_s = time.perf_counter() - started
            for row in cache.rows:  # later writes to the same blocks must not reach the stored copies
                row.fill_(0xEE)
            synchronize(device)
            keep_busy(device)
            for row in back.rows:
                row.fill_(0x55)
            found = loader.load(client, keys, ids, loader.ready_marker())
            synchronize(device)
        wrong = sum(int((row != index + 1).any(dim=1).sum()) for index, row in enumerate(back.rows))
        ok = wrong == 0 and sum(stored) == sum(found) == 64
        return {"stored": sum(stored), "found": sum(found), "blocks": 64, "wrong_pages": wrong, "ok": ok} | (
            {"store_waited_s": round(store_s, 3)} if device.type == "cuda" else {}
        )
    finally:
        if host is not None:
            host.stop()
        shutil.rmtree(directory, ignore_errors=True)


def ratios(result: dict[str, Any]) -> dict[str, float]:
    """Medians over medians: kvtier's rate over the limit measured on the same bytes in this run."""
    gbps, limits = result["gbps"], result["limits"]
    disks = [limits["direct_read"]["gbps"]["median"]] if "gbps" in limits["direct_read"] else []
    fio = limits.get("fio_read")
    if fio and "gbps" in fio:
        disks.append(fio["gbps"])
    return {
        "gpu_to_dram_vs_pinned_copy": gbps["gpu_to_dram"]["median"] / limits["pinned_copy"]["to_host"]["median"],
        "dram_to_gpu_vs_pinned_copy": gbps["dram_to_gpu"]["median"] / limits["pinned_copy"]["to_device"]["median"],
        "nvme_to_gpu_vs_disk_read": gbps["nvme_to_gpu"]["median"] / max(disks) if disks else float("nan"),
    }


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update({"gpu": properties.name, "gpu_memory_bytes": properties.total_memory, "cuda": torch.version.cuda})
        info["driver"] = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None
    return info


def verdict(cases: list[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    exact = all(
        "error" not in c and not any(c["wrong_blocks"].values()) and not any(c["missing_blocks"].values())
        for c in cases
    )
    out: dict[str, Any] = {"bytes_identical_everywhere": exact}
    cases = [c for c in cases if "error" not in c]
    if device.type == "cuda" and cases:
        out["dram_targets_met"] = all(
            c["ratios"]["gpu_to_dram_vs_pinned_copy"] >= TARGET_DRAM_RATIO
            and c["ratios"]["dram_to_gpu_vs_pinned_copy"] >= TARGET_DRAM_RATIO
            for c in cases
        )
        # NaN (no disk limit measured) compares false: the target is not met, not assumed.
        out["nvme_target_met"] = all(c["ratios"]["nvme_to_gpu_vs_disk_read"] >= TARGET_NVME_RATIO for c in cases)
    return out


def print_table(cases: list[dict[str, Any]]) -> None:
    header = f"{'case':34} {'exec':24} {'G->D':>7} {'D->G':>7} {'N->G':>7} {'pin<-':>7} {'pin->':>7} {'disk':>7}  ok"
    print(header)
    for c in cases:
        if "error" in c:
            print(f"{c['case']:34} failed: {c['error']}")
            continue
        g, lim = c["gbps"], c["limits"]
        row = f"{c['case']:34} {str(c['executor'])[:24]:24}"
        row += f" {g['gpu_to_dram']['median']:7.2f} {g['dram_to_gpu']['median']:7.2f}"
        row += f" {g['nvme_to_gpu']['median']:7.2f} {lim['pinned_copy']['to_host']['median']:7.2f}"
        disk = lim["direct_read"]["gbps"]["median"] if "gbps" in lim["direct_read"] else float("nan")
        row += f" {lim['pinned_copy']['to_device']['median']:7.2f} {disk:7.2f}"
        ok = not any(c["wrong_blocks"].values()) and not any(c["missing_blocks"].values())
        print(row + ("  yes" if ok else "  NO"))
    print("GB/s, medians; G->D store, D->G and N->G restores; pin: pinned copy_ limits; disk: O_DIRECT reads")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier bench gpu", description=__doc__.split("\n\n")[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device, help=f"cuda or cpu (default here: {default_device})")
    parser.add_argument("--models", default="llama-3-8b,qwen3-32b,deepseek-v3-mla", help=f"of {', '.join(MODELS)}")
    parser.add_argument("--block-tokens", default="16,64", help="engine block sizes")
    parser.add_argument("--layouts", default="", help="vLLM layouts to run (default: every layout of each model)")
    parser.add_argument("--job-mib", type=float, default=1024, help="bytes per job (one store, one restore)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="store and disk-limit files here (the NVMe under test)")
    parser.add_argument("--out", default="bench-gpu", help="directory for gpu.json")
    parser.add_argument("--skip-fio", action="store_true", help="no fio limit even where fio is installed")
    parser.add_argument("--small", action="store_true", help="tiny shapes and jobs (CI, --device cpu)")
    parser.add_argument(
        "--budget-s", type=float, default=0, help="skip the cases that would end past this many seconds (0: none)"
    )
    return parser


def ordered_cases(args: argparse.Namespace, models: dict[str, ModelShape]) -> list[tuple[ModelShape, str, int]]:
    """Every (model, layout, block size) asked for, the most informative first: the first model's
    first layout at the first block size (Llama-3-8B, NHD, 16 by default), then the first MLA case,
    then the rest in order."""
    wanted = {layout for layout in args.layouts.split(",") if layout}
    block_sizes = [int(b) for b in args.block_tokens.split(",") if b]
    cases = [
        (model, layout, block)
        for model in models.values()
        for layout in layouts_for(model)
        if not wanted or layout in wanted
        for block in block_sizes
    ]
    first_mla = next((c for c in cases if c[0].latent), None)
    leaders = [c for c in (cases[0] if cases else None, first_mla) if c is not None]
    return list(dict.fromkeys(leaders)) + [c for c in cases if c not in leaders]


def write_document(out: Path, document: dict[str, Any]) -> None:
    """Replaces gpu.json whole (a reader never sees half a file)."""
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "gpu.json.partial"
    partial.write_text(json.dumps(document, indent=2) + "\n")
    os.replace(partial, out / "gpu.json")


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kvtier bench gpu: --device cuda but torch sees no GPU; use --device cpu for the CPU run")
    models = SMALL_MODELS if args.small else {name: MODELS[name] for name in args.models.split(",") if name}
    if args.small:
        args.job_mib = min(args.job_mib, 2)
    out = Path(args.out)
    document: dict[str, Any] = {
        "command": "kvtier bench gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": str(device),
        "machine": machine(device),
        "job_mib": args.job_mib,
        "repeats": args.repeats,
        "targets": {"dram_vs_pinned_copy": TARGET_DRAM_RATIO, "nvme_vs_disk_read": TARGET_NVME_RATIO},
        "ordering": {},
        "cases": [],
        "skipped_cases": [],
        "complete": False,
    }
    cases: list[dict[str, Any]] = document["cases"]
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-gpu-", dir=args.dir))
    try:
        log("ordering: a store and a load submitted while the engine's stream still writes their blocks")
        document["ordering"] = ordering_check(device, work)
        write_document(out, document)
        longest_s = 0.0
        for model, layout, block_tokens in ordered_cases(args, models):
            name = f"{model.name}/{layout}/block{block_tokens}"
            if args.budget_s and time.monotonic() - started + 1.2 * longest_s > args.budget_s:
                document["skipped_cases"].append(name)
                continue
            log(f"{model.name} {layout} block {block_tokens}")
            case_started = time.monotonic()
            try:
                case = run_case(args, model, block_tokens, layout, work)
            except Exception as error:  # the next cases still run: one failure must not cost the others
                case = {"case": name, "error": f"{type(error).__name__}: {error}"}
            case["seconds"] = round(time.monotonic() - case_started, 2)
            longest_s = max(longest_s, case["seconds"])
            cases.append(case)
            document["verdict"] = {**verdict(cases, device), "ordering_ok": bool(document["ordering"].get("ok"))}
            write_document(out, document)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    document["verdict"] = {**verdict(cases, device), "ordering_ok": bool(document["ordering"].get("ok"))}
    document["complete"] = not document["skipped_cases"]
    document["seconds"] = round(time.monotonic() - started, 1)
    write_document(out, document)
    print_table(cases)
    log(f"verdict {document['verdict']}; skipped {document['skipped_cases']}; wrote {out / 'gpu.json'}")
    return 0 if document["verdict"]["bytes_identical_everywhere"] and document["verdict"]["ordering_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
