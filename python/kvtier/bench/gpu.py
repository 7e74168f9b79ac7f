"""``kvtier bench gpu``: the GPU data path against its limits, with PyTorch and kvtier only (no vLLM).

For each model shape, engine block size and vLLM GPU layout (``kvtier.gpu.layouts``) it builds a
paged KV cache on the device, runs a host service in this process (DRAM pool, NVMe tier in
``--dir``) and, through the worker's own transfers (``kvtier.gpu.transfers.BlockTransfers``):

- stores a job of blocks GPU→DRAM and restores them DRAM→GPU into other block ids (``--repeats``
  times, new keys each time), comparing every byte;
- restarts the service (the blocks are then on NVMe only) and restores them NVMe→GPU, pipelined,
  comparing every byte again;
- measures the limits in the same run: one pinned ``copy_`` of the same bytes each way, and O_DIRECT
  reads of a file of the same size on the same disk (threads issuing block-sized ``preadv``; fio's
  figure too when fio is installed);
- reports GB/s, the ratios to the limits, and CPU core-seconds per GB (``getrusage`` of this
  process, which runs the service as well).

Writes ``gpu.json`` in ``--out``. ``--device cpu --small`` runs the same path on host tensors (CI
does, to keep the harness working); only a CUDA run says anything about a GPU.
"""

from __future__ import annotations

import argparse
import functools
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

    def __init__(self, directory: Path, object_bytes: int, dram_bytes: int, nvme_bytes: int):
        self.directory, self.object_bytes = directory, object_bytes
        self.dram_bytes, self.nvme_bytes = dram_bytes, nvme_bytes
        # Under /tmp/kvtier-<uid>/ (or $XDG_RUNTIME_DIR): a socket path beside a deep --dir could
        # pass the 108 bytes a Unix socket's path may have.
        self.socket = str(default_socket_path(directory / "store"))
        self.service: Any = None
        self.start()

    def start(self) -> None:
        self.service = Service.start(
            self.socket,
            str(self.directory / "store"),
            str(self.directory),
            30_000,
            dram_bytes=self.dram_bytes,
            nvme_bytes=self.nvme_bytes,
        )

    def client(self) -> Any:
        client = ServiceClient.connect(self.socket, 600_000)
        client.hello(b"kvtier-bench-gpu", 1, 0, self.object_bytes)
        return client

    def restart(self) -> None:
        self.service.stop()
        self.start()

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()
            self.service = None


def keys_for(case: str, repeat: int, count: int) -> list[bytes]:
    return [f"{case}|{repeat}|{i}".encode().ljust(32, b".")[:32] for i in range(count)]


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
    # Restores land in other block ids: reversed order.
    source_ids, restored_ids = list(range(blocks)), list(reversed(range(blocks)))
    directory = Path(tempfile.mkdtemp(prefix="case-", dir=work))
    # Room for every repeat's blocks at once, so that no store waits for NVMe writes to free slots.
    dram_bytes = (args.repeats + 1) * (job_bytes + blocks * 8192)
    host = Host(directory, block_bytes, dram_bytes, nvme_bytes=2 * (args.repeats + 1) * job_bytes + (256 << 20))
    result: dict[str, Any] = {"case": name, "model": model.name, "layout": layout, "block_tokens": block_tokens}
    result.update({"blocks": blocks, "block_bytes": block_bytes, "job_bytes": job_bytes, "tensors": len(source.rows)})
    try:
        client = host.client()
        storer, loader = BlockTransfers(source.rows), BlockTransfers(restored.rows)
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
        client.flush()
        host.restart()  # the DRAM pool is gone: every block is on NVMe only
        client = host.client()
        loader.bind(client)  # the new pool mapping, pinned before the clock starts
        for repeat in range(args.repeats):
            keys = keys_for(name, repeat, blocks)
            measure("nvme_to_gpu", "nvme", functools.partial(loader.load, client, keys, restored_ids))
            wrong["nvme"] = max(wrong["nvme"], compare(source, source_ids, restored, restored_ids))
            fill_random(restored, seed=31 + repeat)
        result["executor"] = storer.executor.name if storer.executor else None
        result["pinned_pool"] = storer.pool_pinned
        result["gbps"] = {key: summary(values) for key, values in rates.items()}
        result["cpu_core_s_per_gb"] = {key: summary(values) for key, values in cpu.items()}
        result["wrong_blocks"], result["missing_blocks"] = wrong, missing
        result["load_rounds"] = loader.counters.load_rounds
        result["limits"] = {"pinned_copy": pinned_copy_gbps(device, job_bytes, args.repeats)}
        result["limits"]["direct_read"] = direct_read_gbps(directory, job_bytes, block_bytes, args.repeats)
        if not args.skip_fio:
            result["limits"]["fio_read"] = fio_read_gbps(directory, job_bytes, block_bytes)
        result["ratios"] = ratios(result)
        storer.close()
        loader.close()
    finally:
        host.stop()
        shutil.rmtree(directory, ignore_errors=True)
    return result


def ordering_check(device: torch.device, work: Path) -> dict[str, Any]:
    """A store submitted right after the engine's stream was told to write the blocks (and is still
    busy: a chain of kernels runs first) must copy the written bytes, not what was there before; a
    load must land after earlier writes to its blocks. On the host every copy is synchronous, so
    this checks the GPU's event ordering only with ``--device cuda``."""
    model = ModelShape("ordering", layers=4, kv_heads=8, head_dim=128)
    cache = paged_cache(model, "nhd", 64, 16, device)
    for row in cache.rows:
        row.zero_()
    directory = Path(tempfile.mkdtemp(prefix="ordering-", dir=work))
    host = Host(directory, cache.block_bytes, 64 * (cache.block_bytes + 8192), 256 << 20)
    try:
        client = host.client()
        transfers = BlockTransfers(cache.rows)
        transfers.bind(client)
        busy = torch.ones((2048, 2048), device=device)
        for _ in range(
            20 if device.type == "cuda" else 1
        ):  # keeps the engine's stream busy for a while before the writes below
            busy = busy @ busy / 2048
        for index, row in enumerate(cache.rows):
            row.fill_(index + 1)
        ready = transfers.ready_marker()
        keys = keys_for("ordering", 0, 64)
        stored = transfers.store(client, keys, list(range(64)), ready)
        for row in cache.rows:  # later writes to the same blocks must not reach the stored copies
            row.fill_(0xEE)
        synchronize(device)
        back = paged_cache(model, "nhd", 64, 16, device)
        found = BlockTransfers(back.rows).load(client, keys, list(range(64)))
        wrong = sum(int((row != index + 1).any(dim=1).sum()) for index, row in enumerate(back.rows))
        return {"stored": sum(stored), "found": sum(found), "blocks": 64, "wrong_pages": wrong, "ok": wrong == 0}
    finally:
        host.stop()
        shutil.rmtree(directory, ignore_errors=True)


def ratios(result: dict[str, Any]) -> dict[str, float]:
    """Medians over medians: kvtier's rate over the limit measured on the same bytes in this run."""
    gbps, limits = result["gbps"], result["limits"]
    disk = limits["direct_read"]["gbps"]["median"]
    fio = limits.get("fio_read")
    if fio and "gbps" in fio:
        disk = max(disk, fio["gbps"])
    return {
        "gpu_to_dram_vs_pinned_copy": gbps["gpu_to_dram"]["median"] / limits["pinned_copy"]["to_host"]["median"],
        "dram_to_gpu_vs_pinned_copy": gbps["dram_to_gpu"]["median"] / limits["pinned_copy"]["to_device"]["median"],
        "nvme_to_gpu_vs_disk_read": gbps["nvme_to_gpu"]["median"] / disk,
    }


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update({"gpu": properties.name, "gpu_memory_bytes": properties.total_memory, "cuda": torch.version.cuda})
        info["driver"] = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None
    return info


def verdict(cases: list[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    exact = all(not any(c["wrong_blocks"].values()) and not any(c["missing_blocks"].values()) for c in cases)
    out: dict[str, Any] = {"bytes_identical_everywhere": exact}
    if device.type == "cuda":
        out["dram_targets_met"] = all(
            c["ratios"]["gpu_to_dram_vs_pinned_copy"] >= TARGET_DRAM_RATIO
            and c["ratios"]["dram_to_gpu_vs_pinned_copy"] >= TARGET_DRAM_RATIO
            for c in cases
        )
        out["nvme_target_met"] = all(c["ratios"]["nvme_to_gpu_vs_disk_read"] >= TARGET_NVME_RATIO for c in cases)
    return out


def print_table(cases: list[dict[str, Any]]) -> None:
    header = f"{'case':34} {'exec':24} {'G->D':>7} {'D->G':>7} {'N->G':>7} {'pin<-':>7} {'pin->':>7} {'disk':>7}  ok"
    print(header)
    for c in cases:
        g, lim = c["gbps"], c["limits"]
        row = f"{c['case']:34} {str(c['executor'])[:24]:24}"
        row += f" {g['gpu_to_dram']['median']:7.2f} {g['dram_to_gpu']['median']:7.2f}"
        row += f" {g['nvme_to_gpu']['median']:7.2f} {lim['pinned_copy']['to_host']['median']:7.2f}"
        row += f" {lim['pinned_copy']['to_device']['median']:7.2f} {lim['direct_read']['gbps']['median']:7.2f}"
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kvtier bench gpu: --device cuda but torch sees no GPU; use --device cpu for the CPU run")
    models = SMALL_MODELS if args.small else {name: MODELS[name] for name in args.models.split(",") if name}
    if args.small:
        args.job_mib = min(args.job_mib, 2)
    wanted_layouts = {layout for layout in args.layouts.split(",") if layout}
    block_sizes = [int(b) for b in args.block_tokens.split(",") if b]
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-gpu-", dir=args.dir))
    cases = []
    ordering: dict[str, Any] = {}
    try:
        log("ordering: a store submitted while the engine's stream still writes the blocks")
        ordering = ordering_check(device, work)
        for model in models.values():
            for layout in layouts_for(model):
                if wanted_layouts and layout not in wanted_layouts:
                    continue
                for block_tokens in block_sizes:
                    log(f"{model.name} {layout} block {block_tokens}")
                    cases.append(run_case(args, model, block_tokens, layout, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    document = {
        "command": "kvtier bench gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": str(device),
        "machine": machine(device),
        "job_mib": args.job_mib,
        "repeats": args.repeats,
        "targets": {"dram_vs_pinned_copy": TARGET_DRAM_RATIO, "nvme_vs_disk_read": TARGET_NVME_RATIO},
        "ordering": ordering,
        "cases": cases,
        "verdict": {**verdict(cases, device), "ordering_ok": bool(ordering.get("ok"))},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(document, indent=2) + "\n")
    print_table(cases)
    log(f"verdict {document['verdict']}; wrote {out / 'gpu.json'}")
    return 0 if document["verdict"]["bytes_identical_everywhere"] and document["verdict"]["ordering_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
