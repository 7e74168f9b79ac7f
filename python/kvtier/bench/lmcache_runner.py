"""Measure LMCache's LocalDiskBackend (store, then cold retrieve) on the benchmark's workload.

Runs inside the interpreter that has LMCache (by default `.venv-lmcache/bin/python`, made by
`scripts/install_lmcache.sh`), never inside the kvtier process: it uses only lmcache, torch, numpy
and the numpy-only sibling module `workload.py`, imported by file path.

Two modes:
- one shot, for a person: ``python lmcache_runner.py --dir /data/bench --prompt-tokens 8192
  --tokens-per-object 256`` prints one JSON result;
- ``--serve``: reads one JSON request per line on stdin and answers one JSON line on stdout, so the
  benchmark pays torch's import once and interleaves LMCache with fio and kvtier in one run.

What is measured: LMCache's disk tier alone. Store = ``batched_submit_put_task`` of already filled
memory objects until every write's completion callback ran (LMCache does not fsync). Retrieve =
``batched_get_blocking`` of every key into LMCache's CPU staging pool, after dropping the page cache
when allowed. The staging pool is page-aligned (an anonymous mmap): LMCache's O_DIRECT mode needs
that, and with a plain ``torch.empty`` pool its writes fail inside a worker thread and a store never
completes; the timeout below turns such a hang into an error message.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import os
import resource
import shutil
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
# Run as a script, Python puts this directory first on sys.path, where kvtier.bench's module names
# could shadow others; load the one sibling needed by path instead.
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != HERE]

import numpy as np  # noqa: E402


def _load_sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"kvtier_bench_{name}", os.path.join(HERE, f"{name}.py"))
    assert spec is not None and spec.loader is not None, f"cannot load {name}.py beside {__file__}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


workload = _load_sibling("workload")  # numpy only

STAGING_SLACK_BYTES = 64 * workload.MIB


def _redirect_stdout_to_stderr():
    """LMCache logs to stdout; keep stdout for our JSON answers only."""
    answer_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    return os.fdopen(answer_fd, "w", buffering=1)


class LMCacheDiskHarness:
    """One LMCache LocalDiskBackend over a fresh directory, with a page-aligned staging pool."""

    def __init__(self, directory: str, disk_bytes: int, staging_bytes: int, use_odirect: bool, io_threads: int | None):
        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        self.torch = torch
        extra_config: dict[str, bool | int] = {"use_odirect": use_odirect}
        if io_threads:
            extra_config["disk_io_threads"] = io_threads
        config = LMCacheEngineConfig(
            chunk_size=256,
            local_cpu=False,
            max_local_cpu_size=staging_bytes / 1e9,
            local_disk=directory,
            max_local_disk_size=disk_bytes / 1e9,
            extra_config=extra_config,
        )
        self.staging_array = workload.aligned_buffer(staging_bytes)
        staging_tensor = torch.from_numpy(self.staging_array)
        allocator = TensorMemoryAllocator(staging_tensor, align_bytes=workload.PAGE_BYTES)
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="lmcache-bench-loop", daemon=True)
        self.loop_thread.start()
        self.cpu_backend = LocalCPUBackend(config, memory_allocator=allocator, dst_device="cpu")
        self.disk_backend = LocalDiskBackend(config, self.loop, self.cpu_backend, dst_device="cpu")

    def close(self) -> None:
        try:
            self.disk_backend.close()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.loop_thread.join(timeout=10)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, all threads (microsecond resolution)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


_pool_cache: dict[tuple[int, int], np.ndarray] = {}


def get_pool(pool_bytes: int, seed: int) -> np.ndarray:
    key = (pool_bytes, seed)
    if key not in _pool_cache:
        _pool_cache.clear()
        gc.collect()
        _pool_cache[key] = workload.make_pool(pool_bytes, seed)
    return _pool_cache[key]


def _prompt_layout(request: dict, shape):
    return workload.prompt_layout(
        shape,
        request["prompt_tokens"],
        request["tokens_per_object"],
        key_salt=request["key_salt"],
        pool_bytes=request["pool_bytes"],
        start_slot=request.get("start_slot", 0),
    )


def _cache_engine_keys(key_class, layout, dtype) -> list:
    """LMCache's key (``key_class``: its CacheEngineKey) for each object of the prompt: the chunk hash
    is the first 8 bytes of ours."""
    return [
        key_class(
            model_name="kvtier-bench",
            world_size=1,
            worker_id=0,
            chunk_hash=int.from_bytes(key[:8], "little"),
            dtype=dtype,
        )
        for key in layout.keys()  # noqa: SIM118 (PromptLayout.keys() is a method returning a list, not a dict)
    ]


def _filled_memory_objects(harness: LMCacheDiskHarness, views: list, kv_shape, dtype, memory_format) -> list:
    """LMCache memory objects in ``memory_format`` holding the prompt (the engine->CPU copy; not timed)."""
    memory_objs = []
    for view in views:
        memory_obj = harness.cpu_backend.allocate(kv_shape, dtype, memory_format)
        if memory_obj is None:
            raise RuntimeError("LMCache staging pool exhausted while filling the prompt")
        np.frombuffer(memory_obj.byte_array, dtype=np.uint8)[:] = view
        memory_objs.append(memory_obj)
    return memory_objs


def _timed_store(harness: LMCacheDiskHarness, keys: list, memory_objs: list, timeout_s: float) -> dict:
    """batched_submit_put_task of every object, timed until the last write's completion callback ran;
    then the memory objects are released."""
    remaining = [len(keys)]
    all_written = threading.Event()
    lock = threading.Lock()

    def on_written(_key) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                all_written.set()

    cpu_before = cpu_seconds()
    start = time.perf_counter()
    harness.disk_backend.batched_submit_put_task(keys, memory_objs, on_complete_callback=on_written)
    if not all_written.wait(timeout_s):
        raise RuntimeError(
            f"LMCache store did not complete within {timeout_s:.0f} s ({remaining[0]} of {len(keys)} writes "
            "pending): with use_odirect its staging pool must be page-aligned; see the LMCache log above"
        )
    store_seconds = time.perf_counter() - start
    store_cpu_seconds = cpu_seconds() - cpu_before
    for memory_obj in memory_objs:
        memory_obj.ref_count_down()
    memory_objs.clear()
    return {"seconds": store_seconds, "cpu_seconds": store_cpu_seconds}


def _timed_cold_retrieve(harness: LMCacheDiskHarness, keys: list, layout, pool: np.ndarray) -> dict:
    """batched_get_blocking of every key: seconds, CPU seconds, which objects came back and how many were wrong."""
    cpu_before = cpu_seconds()
    start = time.perf_counter()
    loaded = harness.disk_backend.batched_get_blocking(keys)
    retrieve_seconds = time.perf_counter() - start
    retrieve_cpu_seconds = cpu_seconds() - cpu_before
    found = [memory_obj is not None for memory_obj in loaded]
    received = [
        np.frombuffer(memory_obj.byte_array, dtype=np.uint8) if memory_obj is not None else None
        for memory_obj in loaded
    ]
    wrong = workload.count_wrong_objects(layout, pool, received, found)
    del received
    for memory_obj in loaded:
        if memory_obj is not None:
            memory_obj.ref_count_down()
    return {"seconds": retrieve_seconds, "cpu_seconds": retrieve_cpu_seconds, "found": found, "wrong": wrong}


def measure(request: dict) -> dict:
    """Store then cold-retrieve one prompt through LocalDiskBackend; return GB/s, CPU and correctness."""
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    shape = workload.ModelShape(**request["shape"])
    layout = _prompt_layout(request, shape)
    pool = get_pool(request["pool_bytes"], request["seed"])
    directory = request["dir"]
    use_odirect = request.get("use_odirect", True)
    prompt_bytes = layout.object_bytes * layout.object_count
    timeout_s = request.get("timeout_s") or max(120.0, prompt_bytes / 100e6)

    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory, exist_ok=True)
    harness = LMCacheDiskHarness(
        directory,
        disk_bytes=prompt_bytes * 2 + workload.GIB,
        staging_bytes=prompt_bytes + STAGING_SLACK_BYTES,
        use_odirect=use_odirect,
        io_threads=request.get("io_threads"),
    )
    result: dict = {
        "system": "lmcache",
        "use_odirect": use_odirect,
        "object_bytes": layout.object_bytes,
        "object_count": layout.object_count,
        "prompt_bytes": prompt_bytes,
        "io_threads": harness.disk_backend._read_thread_pool._max_workers,
    }
    try:
        kv_shape = torch.Size([2, shape.num_layers, request["tokens_per_object"], shape.num_kv_heads * shape.head_dim])
        dtype = {2: torch.bfloat16, 4: torch.float32, 1: torch.uint8}[shape.dtype_bytes]
        keys = _cache_engine_keys(CacheEngineKey, layout, dtype)
        views = layout.object_views(pool)
        memory_objs = _filled_memory_objects(harness, views, kv_shape, dtype, MemoryFormat.KV_2LTD)
        store = _timed_store(harness, keys, memory_objs, timeout_s)
        result["store"] = {
            "seconds": store["seconds"],
            "gbps": prompt_bytes / store["seconds"] / 1e9,
            "cpu_seconds": store["cpu_seconds"],
        }

        result["page_cache_dropped"] = workload.drop_page_cache()
        retrieve = _timed_cold_retrieve(harness, keys, layout, pool)
        found = retrieve["found"]
        result["retrieve"] = {
            "seconds": retrieve["seconds"],
            "gbps": prompt_bytes / retrieve["seconds"] / 1e9,
            "cpu_seconds": retrieve["cpu_seconds"],
        }
        result["found_objects"] = sum(found)
        result["missing_objects"] = len(found) - sum(found)
        result["wrong_objects"] = retrieve["wrong"]
    finally:
        harness.close()
        del harness
        gc.collect()
        shutil.rmtree(directory, ignore_errors=True)
    return result


def lmcache_version() -> str:
    try:
        from importlib.metadata import version

        return version("lmcache")
    except Exception:  # pragma: no cover - informational only
        return "unknown"


def serve(answer_stream) -> int:
    import torch

    hello = {"ready": True, "lmcache_version": lmcache_version(), "torch_version": torch.__version__}
    answer_stream.write(json.dumps(hello) + "\n")
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        request = json.loads(line)
        if request.get("op") == "quit":
            break
        try:
            answer = {"ok": True, "result": measure(request)}
        except Exception as error:  # report, keep serving
            traceback.print_exc()
            answer = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        answer_stream.write(json.dumps(answer) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help="answer JSON requests on stdin, one per line")
    parser.add_argument("--dir", help="directory for LMCache's files (one shot)")
    parser.add_argument("--model", default="llama3-8b", choices=sorted(workload.MODEL_SHAPES))
    parser.add_argument("--prompt-tokens", default="8k")
    parser.add_argument("--tokens-per-object", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-odirect", action="store_true", help="buffered I/O instead of O_DIRECT")
    args = parser.parse_args(argv)

    answer_stream = _redirect_stdout_to_stderr()
    if args.serve:
        return serve(answer_stream)
    if not args.dir:
        parser.error("--dir is required without --serve")
    shape = workload.MODEL_SHAPES[args.model]
    prompt_tokens = workload.parse_token_count(args.prompt_tokens)
    object_bytes = args.tokens_per_object * shape.kv_bytes_per_token
    request = {
        "shape": {f.name: getattr(shape, f.name) for f in workload.dataclasses.fields(shape)},
        "prompt_tokens": prompt_tokens,
        "tokens_per_object": args.tokens_per_object,
        "seed": args.seed,
        "key_salt": "one-shot",
        "pool_bytes": workload.pool_bytes_for(prompt_tokens * shape.kv_bytes_per_token, object_bytes),
        "dir": os.path.join(args.dir, "lmcache-disk"),
        "use_odirect": not args.no_odirect,
    }
    answer_stream.write(json.dumps(measure(request), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
