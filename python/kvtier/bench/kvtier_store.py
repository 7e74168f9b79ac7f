"""Measure kvtier's Store on the benchmark's workload: store a prompt, then retrieve it cold.

This module owns the kvtier side of `kvtier bench io`. It runs in the benchmark's own process (the
store's I/O threads are in-process, so the process's CPU time from os.times() is the store's CPU time).

Store = ``put_many`` of every object of the prompt followed by ``flush`` (everything on NVMe and
synced). Cold retrieve = ``get_many`` of the whole prompt into a page-aligned destination, after the
page cache was dropped (root), with a store opened with a tiny DRAM tier (``dram_bytes``, default 0:
only the I/O staging slots) and, by default, closed and reopened in between (``reopen``), so that
not even the staging slots can serve a block. The store's stats tell how many blocks came from
NVMe and how many from DRAM, so a warm result cannot pass as a cold one.
"""

from __future__ import annotations

import os
import resource
import shutil
import time

from . import workload


class KvtierUnavailable(RuntimeError):
    """kvtier's Rust core is not importable; the message says how to build it."""


def load_store_class():
    try:
        import kvtier
    except ImportError as error:
        raise KvtierUnavailable(
            f"cannot import kvtier ({error}): build it into this interpreter with `maturin develop --release` "
            "in the repository root (or `pip install -e .`), or pass --no-kvtier"
        ) from error
    store_class = getattr(kvtier, "Store", None)
    if store_class is None:
        raise KvtierUnavailable(
            "kvtier.Store is missing (the Rust core kvtier._core is not built into this interpreter): run "
            "`maturin develop --release` in the repository root, or pass --no-kvtier"
        )
    return store_class


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, all threads (microsecond resolution)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def drop_page_cache() -> bool:
    """Write back and drop the page cache; True when it worked (needs root)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as control:
            control.write("3\n")
        return True
    except OSError:
        return False


def nvme_bytes_for(prompt_bytes: int, object_bytes: int) -> int:
    """Room for the prompt plus slack, in whole 256 MiB units, and never fewer than 4 regions.

    The store's default region is max(64 MiB, 8 slots + trailer), a slot being the object rounded up
    to 4 KiB plus a 4 KiB descriptor (docs/configuration.md); it refuses fewer than 2 regions."""
    page = workload.PAGE_BYTES
    slot_bytes = page + (object_bytes + page - 1) // page * page
    region_bytes = max(64 * workload.MIB, 8 * slot_bytes + 64 * workload.KIB)
    unit = 256 * workload.MIB
    wanted = max(int(prompt_bytes * 1.25) + unit, prompt_bytes + 4 * region_bytes)
    return (wanted + unit - 1) // unit * unit


def _stat_delta(after: dict, before: dict, name: str) -> int | None:
    if name in after and name in before:
        try:
            return int(after[name]) - int(before[name])
        except (TypeError, ValueError):
            return None
    return None


def open_store(store_class, directory: str, namespace: bytes, object_bytes: int, dram_bytes: int, nvme_bytes: int):
    return store_class.open(
        directory,
        namespace=namespace,
        object_bytes=object_bytes,
        dram_bytes=dram_bytes,
        nvme_bytes=nvme_bytes,
    )


def measure(
    layout: workload.PromptLayout,
    pool,
    directory: str,
    namespace: bytes,
    dram_bytes: int = 0,
    reopen: bool = False,
) -> dict:
    """Store then cold-retrieve one prompt; return GB/s, CPU seconds, hits per tier and correctness."""
    store_class = load_store_class()
    prompt_bytes = layout.object_bytes * layout.object_count
    nvme_bytes = nvme_bytes_for(prompt_bytes, layout.object_bytes)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory, exist_ok=True)

    keys = layout.keys()
    views = layout.object_views(pool)
    result: dict = {
        "system": "kvtier",
        "object_bytes": layout.object_bytes,
        "object_count": layout.object_count,
        "prompt_bytes": prompt_bytes,
        "dram_bytes": dram_bytes,
        "nvme_bytes": nvme_bytes,
        "reopened": reopen,
    }
    try:
        store = open_store(store_class, directory, namespace, layout.object_bytes, dram_bytes, nvme_bytes)
    except ValueError as error:
        if dram_bytes != 0 or "dram_bytes" not in str(error):
            raise
        # This build refuses a DRAM tier of 0 bytes: take the smallest sensible one and reopen the
        # store between store and retrieve so the retrieve is cold all the same.
        dram_bytes = 4 * layout.object_bytes
        reopen = True
        result.update(dram_bytes=dram_bytes, reopened=True, dram_bytes_fallback=str(error))
        store = open_store(store_class, directory, namespace, layout.object_bytes, dram_bytes, nvme_bytes)
    try:
        stats_before_store = store.stats()
        result["io_engine"] = stats_before_store.get("io_engine")
        result["direct_io"] = stats_before_store.get("direct_io")

        cpu_before = cpu_seconds()
        start = time.perf_counter()
        store.put_many(keys, views)
        store.flush()
        store_seconds = time.perf_counter() - start
        store_cpu_seconds = cpu_seconds() - cpu_before
        stats_after_store = store.stats()
        dropped_stores = _stat_delta(stats_after_store, stats_before_store, "dropped_stores") or 0
        result["store"] = {
            "seconds": store_seconds,
            "gbps": prompt_bytes / store_seconds / 1e9,
            "cpu_seconds": store_cpu_seconds,
            "dropped_stores": dropped_stores,
            "bytes_written_nvme": _stat_delta(stats_after_store, stats_before_store, "bytes_written_nvme"),
        }

        if reopen:
            store.close()
            store = None
            result["page_cache_dropped"] = drop_page_cache()
            start = time.perf_counter()
            store = open_store(store_class, directory, namespace, layout.object_bytes, dram_bytes, nvme_bytes)
            result["reopen_seconds"] = time.perf_counter() - start
            result["recovered_blocks"] = store.stats().get("recovered_blocks")
        else:
            result["page_cache_dropped"] = drop_page_cache()

        destination = workload.aligned_buffer(prompt_bytes)
        destination_views = [
            destination[index * layout.object_bytes : (index + 1) * layout.object_bytes]
            for index in range(layout.object_count)
        ]
        stats_before_retrieve = store.stats()
        cpu_before = cpu_seconds()
        start = time.perf_counter()
        found = list(store.get_many(keys, destination_views))
        retrieve_seconds = time.perf_counter() - start
        retrieve_cpu_seconds = cpu_seconds() - cpu_before
        stats_after_retrieve = store.stats()
        result["retrieve"] = {
            "seconds": retrieve_seconds,
            "gbps": prompt_bytes / retrieve_seconds / 1e9,
            "cpu_seconds": retrieve_cpu_seconds,
            "nvme_hits": _stat_delta(stats_after_retrieve, stats_before_retrieve, "nvme_hits"),
            "dram_hits": _stat_delta(stats_after_retrieve, stats_before_retrieve, "dram_hits"),
            "bytes_read_nvme": _stat_delta(stats_after_retrieve, stats_before_retrieve, "bytes_read_nvme"),
            "checksum_failures": _stat_delta(stats_after_retrieve, stats_before_retrieve, "checksum_failures"),
        }
        result["found_objects"] = sum(1 for ok in found if ok)
        result["missing_objects"] = len(found) - result["found_objects"]
        # Misses the store explains (stores it dropped under backpressure) are allowed; others are not.
        result["unexplained_missing_objects"] = max(0, result["missing_objects"] - dropped_stores)
        result["wrong_objects"] = workload.count_wrong_objects(layout, pool, destination_views, found)
        dram_hits = result["retrieve"]["dram_hits"]
        result["cold"] = not dram_hits
        result["stats"] = {key: value for key, value in stats_after_retrieve.items()}
        del destination_views, destination
    finally:
        if store is not None:
            store.close()
        shutil.rmtree(directory, ignore_errors=True)
    return result
