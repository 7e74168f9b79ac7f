"""Stage 1 of the GPU run (``scripts/gpu_run.sh``, docs/gpu.md): the machine's facts and the GPU
path's first contact with CUDA, in well under two minutes, before any figure is measured.

- facts: kernel (some lent machines run under gVisor), Python, torch and CUDA versions, the driver,
  ``/dev/shm``'s size, the memlock limit;
- the disk under ``--dir``: whether ``io_uring`` and ``O_DIRECT`` work there, and which I/O engine
  kvtier's store picks;
- pinning: ``cudaHostRegister`` of a 256 MiB mapping of a ``/dev/shm`` file (as the service's pool);
- executors: every candidate's self-test on kvtier's side stream, and the one ``choose`` picks;
- one round trip of 256 MiB of a Llama-3-8B NHD cache through the real service (GPU→DRAM, then
  DRAM→GPU into other block ids), compared byte for byte;
- a store's phases timed apart (reserve, the copies, the service's commit, which checksums every
  byte), with and without an NVMe tier, and the commit of bytes the CPU wrote rather than the DMA:
  where a store's time goes when it runs below the copy engine's rate.

Every check is recorded whether it passed or failed, and ``stage1.json`` in ``--out`` is rewritten
after each one, so a run cut off here still tells what broke first.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtier.bench import gpu as bench
from kvtier.gpu.device import PinnedRange, pool_view, side_for
from kvtier.gpu.executors import CopyJob, gpu_candidates, run_on, self_test
from kvtier.gpu.layouts import MODELS, fill_random, paged_cache
from kvtier.gpu.plan import CopyPlan
from kvtier.gpu.transfers import BlockTransfers

ROUND_TRIP_MIB = 256
# The commit's checksum threads tried in ``store_phases`` (besides the default).
CHECKSUM_THREADS = (1, 4, 16)
_IO_URING_SETUP = 425  # the system call's number on x86-64 and arm64


def facts(device: torch.device) -> dict[str, Any]:
    shm = shutil.disk_usage(bench.SHM_DIR) if bench.SHM_DIR.is_dir() else None
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    out: dict[str, Any] = {
        "kernel": platform.release(),
        "proc_version": Path("/proc/version").read_text().strip() if Path("/proc/version").exists() else None,
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
        "dev_shm_bytes": shm.total if shm else None,
        "dev_shm_free_bytes": shm.free if shm else None,
        "memlock_limit": ["unlimited" if v == resource.RLIM_INFINITY else v for v in memlock],
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        out.update({"gpu": properties.name, "gpu_memory_bytes": properties.total_memory})
        version = ctypes.c_int()
        libcuda = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
        out["driver_cuda_version"] = version.value if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0 else None
    return out


def io_uring() -> dict[str, Any]:
    """Whether the kernel accepts ``io_uring_setup`` (gVisor may not)."""
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)
    fd = libc.syscall(_IO_URING_SETUP, 4, params)
    if fd < 0:
        code = ctypes.get_errno()
        return {"ok": False, "errno": code, "error": os.strerror(code)}
    os.close(fd)
    return {"ok": True}


def o_direct(directory: Path) -> dict[str, Any]:
    """One aligned O_DIRECT write and read of 1 MiB in ``directory``, compared."""
    path = directory / "o-direct-check.bin"
    buffer, back = mmap.mmap(-1, 1 << 20), mmap.mmap(-1, 1 << 20)
    buffer.write(os.urandom(1 << 20))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
        try:
            os.pwrite(fd, buffer, 0)
            os.preadv(fd, [back], 0)
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return {"ok": buffer[:] == back[:], "directory": str(directory)}


def store_engine(directory: Path) -> dict[str, Any]:
    """The I/O engine and O_DIRECT use kvtier's store chose on this disk (after its self-tests)."""
    from kvtier import Store

    path = Path(tempfile.mkdtemp(prefix="store-check-", dir=directory))
    try:
        store = Store.open(
            str(path), namespace=b"gpu-check", object_bytes=1 << 20, dram_bytes=64 << 20, nvme_bytes=256 << 20
        )
        stats = store.stats()
        store.close()
        return {"io_engine": stats.get("io_engine"), "direct_io": stats.get("direct_io")}
    finally:
        shutil.rmtree(path, ignore_errors=True)


def registration(device: torch.device, nbytes: int) -> dict[str, Any]:
    """``cudaHostRegister`` of a shared mapping of a /dev/shm file, as the service's pool is."""
    if device.type != "cuda":
        return {"skipped": "host tensors need no registration"}
    directory = bench.pool_directory(nbytes)
    try:
        with open(directory / "pool", "w+b") as file:
            file.truncate(nbytes)
            mapping = mmap.mmap(file.fileno(), nbytes)
            address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
            started = time.perf_counter()
            pinned = PinnedRange(address, nbytes, 1 << 20)
            register_s = time.perf_counter() - started
            ok = pinned.pinned
            pinned.close()
            torch.zeros(1, device=device).add_(1)  # a kernel launch after it: no stale runtime error
            del address
            return {"pinned": ok, "bytes": nbytes, "register_s": round(register_s, 4)}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def executors(device: torch.device) -> dict[str, Any]:
    """Every GPU candidate's self-test on kvtier's side stream; the first that passes is used."""
    if device.type != "cuda":
        return {"skipped": "host tensors use memmove"}
    side = side_for(device)
    plan = CopyPlan([4096, 4096], [(0, 0, 8192)], 8192)
    results: dict[str, Any] = {"side_stream": hex(side.stream.cuda_stream)}  # type: ignore[union-attr]
    for label, make in gpu_candidates(device, plan):
        try:
            self_test(make(), device, side)
            results[label] = "ok"
        except Exception as error:
            results[label] = f"{type(error).__name__}: {error}"
    results["chosen"] = next((label for label in results if results[label] == "ok"), None)
    return results


def round_trip(device: torch.device, work: Path, mib: float) -> dict[str, Any]:
    """``mib`` of Llama-3-8B NHD blocks of 16 tokens through the real service and back, compared."""
    model = MODELS["llama-3-8b"]
    block_bytes = model.token_bytes(torch.bfloat16) * 16
    blocks = max(2, int(mib * (1 << 20)) // block_bytes)
    source = paged_cache(model, "nhd", blocks, 16, device)
    restored = paged_cache(model, "nhd", blocks, 16, device)
    fill_random(source, seed=5)
    fill_random(restored, seed=6)
    directory = Path(tempfile.mkdtemp(prefix="round-trip-", dir=work))
    host = None
    try:
        nvme_bytes = max(256 << 20, 4 * blocks * block_bytes)
        host = bench.Host(directory, block_bytes, 2 * blocks * (block_bytes + 8192), nvme_bytes)
        client = host.client()
        keys, ids = bench.keys_for("stage1", 0, blocks), list(range(blocks))
        with BlockTransfers(source.rows) as storer, BlockTransfers(restored.rows) as loader:
            storer.bind(client)
            loader.bind(client)
            store_s, _, stored = bench.timed(device, lambda: storer.store(client, keys, ids))
            load_s, _, found = bench.timed(device, lambda: loader.load(client, keys, ids[::-1]))
            wrong = bench.compare(source, ids, restored, ids[::-1])
            executor, pinned = storer.executor.name if storer.executor else None, storer.pool_pinned
            errors = storer.counters.errors + loader.counters.errors
        job = blocks * block_bytes
        return {
            "bytes": job,
            "stored": sum(stored),
            "found": sum(found),
            "blocks": blocks,
            "wrong_blocks": wrong,
            "ok": wrong == 0 and sum(stored) == sum(found) == blocks,
            "executor": executor,
            "pinned_pool": pinned,
            "gpu_to_dram_gbps": round(job / store_s / 1e9, 2),
            "dram_to_gpu_gbps": round(job / load_s / 1e9, 2),
            "errors": errors,
        }
    finally:
        if host is not None:
            host.stop()
        shutil.rmtree(directory, ignore_errors=True)


def store_phases(device: torch.device, work: Path, mib: float, repeats: int = 4) -> dict[str, Any]:
    """Milliseconds of each phase of a store of ``mib`` of Llama-3-8B blocks, one commit for the
    whole job: reserve, the copies (issued and waited for), the commit. ``cpu_written``: the commit
    of the same number of slots filled by the CPU (memset), to tell a slow checksum from slow reads
    of bytes the DMA just wrote. With an NVMe tier (``nvme``) and without (``dram_only``), and
    without one at other ``checksum_threads``."""
    model = MODELS["llama-3-8b"]
    block_bytes = model.token_bytes(torch.bfloat16) * 16
    blocks = max(2, int(mib * (1 << 20)) // block_bytes)
    source = paged_cache(model, "nhd", blocks, 16, device)
    fill_random(source, seed=7)
    out: dict[str, Any] = {"bytes": blocks * block_bytes, "blocks": blocks}
    nvme_bytes = max(256 << 20, 2 * (repeats + 1) * blocks * block_bytes)
    setups = [("nvme", nvme_bytes, 0), ("dram_only", 0, 0)]
    setups += [(f"dram_only_checksum_threads_{threads}", 0, threads) for threads in CHECKSUM_THREADS]
    for label, nvme, threads in setups:
        directory = Path(tempfile.mkdtemp(prefix="store-phases-", dir=work))
        host = None
        try:
            dram_bytes = 2 * (repeats + 1) * blocks * (block_bytes + 8192)
            host = bench.Host(directory, block_bytes, dram_bytes, nvme, checksum_threads=threads)
            out[label] = _phases(device, host, source, repeats)
        finally:
            if host is not None:
                host.stop()
            shutil.rmtree(directory, ignore_errors=True)
    return out


def _phases(device: torch.device, host: Any, source: Any, repeats: int) -> dict[str, Any]:
    client = host.client()
    pool = client.pool()
    blocks = source.rows[0].shape[0]
    ms: dict[str, list[float]] = {"reserve": [], "copy": [], "commit": [], "cpu_written_commit": []}
    with BlockTransfers(source.rows) as storer:
        storer.bind(client)
        assert storer.plan is not None and storer.executor is not None, "bound"
        view = pool_view(int(pool["address"]), int(pool["bytes"]))
        for repeat in range(2 * repeats):
            keys = bench.keys_for("phases", repeat, blocks)
            bench.synchronize(device)
            started = time.perf_counter()
            offsets = [offset for _, offset in client.reserve_many(keys)]
            reserved = time.perf_counter()
            if repeat % 2 == 0:
                job = CopyJob(
                    storer.plan, storer.tensors, list(range(blocks)), offsets, view, int(pool["address"]), True
                )
                run_on(storer.side, storer.executor, job)
            else:
                for offset in offsets:
                    ctypes.memset(int(pool["address"]) + offset, repeat, int(pool["object_bytes"]))
            copied = time.perf_counter()
            assert all(client.commit_many(keys)), "every reserved block commits"
            committed = time.perf_counter()
            if repeat % 2 == 0:
                ms["reserve"].append((reserved - started) * 1e3)
                ms["copy"].append((copied - reserved) * 1e3)
                ms["commit"].append((committed - copied) * 1e3)
            else:
                ms["cpu_written_commit"].append((committed - copied) * 1e3)
            client.flush()
    return {"ms": {key: [round(v, 2) for v in values] for key, values in ms.items()}, "executor": storer.executor.name}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dir", default=None, help="the disk under test (the store's NVMe tier in stage 2)")
    parser.add_argument("--out", default="bench-gpu")
    parser.add_argument("--small", action="store_true", help="an 8 MiB round trip (the CPU rehearsal)")
    args, _ = parser.parse_known_args(argv)  # stage 2's arguments are passed to both stages
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvtier-gpu-check-", dir=args.dir))
    document: dict[str, Any] = {"device": str(device)}
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("facts", lambda: facts(device)),
        ("io_uring", io_uring),
        ("o_direct", lambda: o_direct(work)),
        ("store_engine", lambda: store_engine(work)),
        ("registration", lambda: registration(device, ROUND_TRIP_MIB << 20)),
        ("executors", lambda: executors(device)),
        ("round_trip", lambda: round_trip(device, work, 8 if args.small else ROUND_TRIP_MIB)),
        ("store_phases", lambda: store_phases(device, work, 8 if args.small else ROUND_TRIP_MIB)),
    ]
    try:
        for name, step in steps:
            started = time.perf_counter()
            try:
                document[name] = step()
            except Exception as error:
                document[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-2000:]}
            document[name + "_s"] = round(time.perf_counter() - started, 3)
            print(f"[stage 1] {name}: {json.dumps(document[name])[:400]}", flush=True)
            (out / "stage1.json").write_text(json.dumps(document, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if document["round_trip"].get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
