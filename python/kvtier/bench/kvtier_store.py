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

import hashlib
import os
import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


@dataclass
class TimedCall:
    """One timed call on a store: wall and CPU seconds, the store's stats around it, and what it returned."""

    seconds: float
    cpu_seconds: float
    stats_before: dict
    stats_after: dict
    returned: Any

    def delta(self, name: str) -> int | None:
        return _stat_delta(self.stats_after, self.stats_before, name)


def _timed_call(store, call: Callable[[], Any]) -> TimedCall:
    """Run ``call`` between two reads of the store's stats; time only the call itself."""
    stats_before = store.stats()
    cpu_before = cpu_seconds()
    start = time.perf_counter()
    returned = call()
    seconds = time.perf_counter() - start
    call_cpu_seconds = cpu_seconds() - cpu_before
    return TimedCall(seconds, call_cpu_seconds, stats_before, store.stats(), returned)


def _put_and_flush(store, keys: list, views: list) -> None:
    store.put_many(keys, views)
    store.flush()


def _destination_views(layout: workload.PromptLayout, prompt_bytes: int) -> list:
    """One page-aligned destination for the whole prompt, as one view per object."""
    destination = workload.aligned_buffer(prompt_bytes)
    return [
        destination[index * layout.object_bytes : (index + 1) * layout.object_bytes]
        for index in range(layout.object_count)
    ]


def open_store(
    store_class,
    directory: str,
    namespace: bytes,
    object_bytes: int,
    dram_bytes: int,
    nvme_bytes: int,
    store_options: dict | None = None,
):
    return store_class.open(
        directory,
        namespace=namespace,
        object_bytes=object_bytes,
        dram_bytes=dram_bytes,
        nvme_bytes=nvme_bytes,
        **(store_options or {}),
    )


def _open_with_dram_fallback(open_with_dram: Callable[[int], Any], dram_bytes: int, object_bytes: int, result: dict):
    """Open with ``dram_bytes``; return the store, the DRAM bytes it got and whether it fell back.

    A build that refuses a DRAM tier of 0 bytes gets the smallest sensible one (4 objects) instead, noted
    in ``result``; the caller then reopens the store between store and retrieve so the retrieve is cold
    all the same."""
    try:
        return open_with_dram(dram_bytes), dram_bytes, False
    except ValueError as error:
        if dram_bytes != 0 or "dram_bytes" not in str(error):
            raise
        dram_bytes = 4 * object_bytes
        result.update(dram_bytes=dram_bytes, reopened=True, dram_bytes_fallback=str(error))
        return open_with_dram(dram_bytes), dram_bytes, True


def _store_summary(put: TimedCall, prompt_bytes: int) -> dict:
    return {
        "seconds": put.seconds,
        "gbps": prompt_bytes / put.seconds / 1e9,
        "cpu_seconds": put.cpu_seconds,
        "dropped_stores": put.delta("dropped_stores") or 0,
        "bytes_written_nvme": put.delta("bytes_written_nvme"),
    }


def _cold_retrieve(store, layout: workload.PromptLayout, pool, keys: list, dropped_stores: int) -> dict:
    """get_many of the whole prompt into a fresh destination: timing, hits per tier and correctness."""
    views = _destination_views(layout, layout.object_bytes * layout.object_count)
    get = _timed_call(store, lambda: list(store.get_many(keys, views)))
    found = get.returned
    found_objects = sum(1 for ok in found if ok)
    retrieve = {
        "seconds": get.seconds,
        "gbps": layout.object_bytes * layout.object_count / get.seconds / 1e9,
        "cpu_seconds": get.cpu_seconds,
        "nvme_hits": get.delta("nvme_hits"),
        "dram_hits": get.delta("dram_hits"),
        "bytes_read_nvme": get.delta("bytes_read_nvme"),
        "checksum_failures": get.delta("checksum_failures"),
    }
    return {
        "retrieve": retrieve,
        "found_objects": found_objects,
        "missing_objects": len(found) - found_objects,
        # Misses the store explains (stores it dropped under backpressure) are allowed; others are not.
        "unexplained_missing_objects": max(0, len(found) - found_objects - dropped_stores),
        "wrong_objects": workload.count_wrong_objects(layout, pool, views, found),
        "cold": not retrieve["dram_hits"],
        "stats": {key: value for key, value in get.stats_after.items()},
    }


def measure(
    layout: workload.PromptLayout,
    pool,
    directory: str,
    namespace: bytes,
    dram_bytes: int = 0,
    reopen: bool = False,
    store_options: dict | None = None,
) -> dict:
    """Store then cold-retrieve one prompt; return GB/s, CPU seconds, hits per tier and correctness.
    ``store_options``: more options of the store (``encryption_key_file``)."""
    store_class = load_store_class()
    prompt_bytes = layout.object_bytes * layout.object_count
    nvme_bytes = nvme_bytes_for(prompt_bytes, layout.object_bytes)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory, exist_ok=True)

    def open_with_dram(dram: int):
        return open_store(store_class, directory, namespace, layout.object_bytes, dram, nvme_bytes, store_options)

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
    store, dram_bytes, fell_back = _open_with_dram_fallback(open_with_dram, dram_bytes, layout.object_bytes, result)
    reopen = reopen or fell_back
    try:
        put = _timed_call(store, lambda: _put_and_flush(store, keys, views))
        result["io_engine"] = put.stats_before.get("io_engine")
        result["direct_io"] = put.stats_before.get("direct_io")
        result["store"] = _store_summary(put, prompt_bytes)

        if reopen:
            store.close()
            store = None
            result["page_cache_dropped"] = workload.drop_page_cache()
            start = time.perf_counter()
            store = open_with_dram(dram_bytes)
            result["reopen_seconds"] = time.perf_counter() - start
            result["recovered_blocks"] = store.stats().get("recovered_blocks")
        else:
            result["page_cache_dropped"] = workload.drop_page_cache()

        result.update(_cold_retrieve(store, layout, pool, keys, result["store"]["dropped_stores"]))
    finally:
        if store is not None:
            store.close()
        shutil.rmtree(directory, ignore_errors=True)
    return result


# ------------------------------------------------------------------------------ shared-filesystem tier

SHARED_FILE_BYTES = 256 * workload.MIB
LOOKUP_KEY_COUNT = 10_000
LOOKUP_OBJECT_BYTES = 4096
LOOKUP_CALLS = 20


def publish_queue_bytes() -> int:
    """The store's shared publish queue in bytes: the default of the option ``shared_publish_queue_bytes``
    (read from ``kvtier.options()``, the core's option table), which these benchmarks leave unset. The
    put path never waits for the publisher and drops the blocks that do not fit (shared_dropped_publishes)."""
    import kvtier

    return next(o["default"] for o in kvtier.options() if o["name"] == "shared_publish_queue_bytes")


def shared_file_bytes_for(prompt_bytes: int, object_bytes: int) -> int:
    """256 MiB files (the default), or the prompt's size when smaller; always >= one block + 8 KiB."""
    page = workload.PAGE_BYTES
    slot_bytes = page + (object_bytes + page - 1) // page * page
    return max(min(SHARED_FILE_BYTES, prompt_bytes + 2 * page), slot_bytes + 2 * page)


def shared_layout_counts(namespace_dir: str) -> dict:
    """Files and directories under one namespace directory of the shared root, by kind."""
    counts = {
        "data_files": 0,
        "manifest_files": 0,
        "tmp_files": 0,
        "other_files": 0,
        "directories": 0,
        "data_file_bytes": 0,
    }
    for parent, directories, files in os.walk(namespace_dir):
        counts["directories"] += len(directories)
        kind = os.path.basename(parent)
        for name in files:
            if name.endswith(".kvs") and os.path.basename(os.path.dirname(parent)) == "data":
                counts["data_files"] += 1
                counts["data_file_bytes"] += os.path.getsize(os.path.join(parent, name))
            elif kind == "manifests":
                counts["manifest_files"] += 1
            elif kind == "tmp":
                counts["tmp_files"] += 1
            else:
                counts["other_files"] += 1
    counts["files"] = counts["data_files"] + counts["manifest_files"] + counts["tmp_files"] + counts["other_files"]
    return counts


def _open_shared(
    store_class,
    directory: str,
    namespace: bytes,
    object_bytes: int,
    dram_bytes: int,
    shared_root: str,
    shared_file_bytes: int,
    store_options: dict | None = None,
):
    return store_class.open(
        directory,
        namespace=namespace,
        object_bytes=object_bytes,
        dram_bytes=dram_bytes,
        nvme_bytes=0,
        shared_root=shared_root,
        shared_file_bytes=shared_file_bytes,
        **(store_options or {}),
    )


def _shared_result_header(layout: workload.PromptLayout, file_bytes: int, dram_a: int, dram_b: int) -> dict:
    return {
        "system": "kvtier_shared",
        "object_bytes": layout.object_bytes,
        "object_count": layout.object_count,
        "prompt_bytes": layout.object_bytes * layout.object_count,
        "shared_file_bytes": file_bytes,
        "a_dram_bytes": dram_a,
        "b_dram_bytes": dram_b,
        "b_dram_bytes_note": "B's DRAM tier holds the prompt: with fewer DRAM slots than blocks, get_many "
        "served only about a slot count of blocks from the shared tier and missed the rest",
        "nvme_bytes": 0,
    }


def _publish_summary(put: TimedCall, layout: workload.PromptLayout) -> dict:
    """Store A's put_many + flush: what it published to the shared tier, and how fast."""
    dropped_stores = put.delta("dropped_stores") or 0
    dropped_publishes = put.delta("shared_dropped_publishes") or 0
    published_objects = layout.object_count - dropped_stores - dropped_publishes
    published_bytes = published_objects * layout.object_bytes
    return {
        "seconds": put.seconds,
        "gbps": published_bytes / put.seconds / 1e9,
        "offered_gbps": layout.object_bytes * layout.object_count / put.seconds / 1e9,
        "bytes": published_bytes,
        "published_objects": published_objects,
        "cpu_seconds": put.cpu_seconds,
        "dropped_stores": dropped_stores,
        "shared_files_published": put.delta("shared_files_published"),
        "shared_bytes_written": put.delta("shared_bytes_written"),
        "shared_dropped_publishes": dropped_publishes,
        "shared_publish_errors": put.delta("shared_publish_errors"),
        "how": "one put_many of the whole prompt + flush; gbps = bytes of the blocks published (prompt minus "
        "shared_dropped_publishes: the put path never waits for the publish queue "
        f"(shared_publish_queue_bytes, default {publish_queue_bytes() // workload.MIB} MiB) and drops "
        "what does not fit) / seconds; offered_gbps = prompt bytes / seconds",
    }


def _published_files(shared_root: str, published_bytes: int) -> dict:
    """The files and directories the publish left under the shared root, also per GB published."""
    namespace_dirs = [entry for entry in os.listdir(shared_root) if os.path.isdir(os.path.join(shared_root, entry))]
    counts = shared_layout_counts(os.path.join(shared_root, namespace_dirs[0])) if namespace_dirs else {}
    gigabytes = max(published_bytes, 1) / 1e9
    return dict(
        counts,
        files_per_gb=counts.get("files", 0) / gigabytes,
        data_files_per_gb=counts.get("data_files", 0) / gigabytes,
        directory_entries_per_gb=(counts.get("files", 0) + counts.get("directories", 0)) / gigabytes,
        counted_how="os.walk of <shared_root>/<namespace hex>/ after A was flushed and closed: files = data "
        "files (data/<xx>/*.kvs) + manifests + temporaries + others (lease); directory entries = "
        "files + directories; per GB = per 1e9 bytes published",
    )


def _publish_metadata_ops(files_published: int | None, published_bytes: int) -> dict:
    """The filesystem metadata operations the publish took, inferred from the count of published files."""
    published = files_published or 0
    gigabytes = max(published_bytes, 1) / 1e9
    return {
        "file_creates": published,
        "renames": published,
        "directory_fsyncs": published,
        "manifest_appends": published,
        "unlinks": 0,
        "total": 4 * published,
        "total_per_gb": 4 * published / gigabytes,
        "counted_how": "inferred from the writer's shared_files_published (not traced): per published file "
        "one exclusive create of tmp/<writer>-<seq>.tmp, one rename into data/<xx>/, one "
        "fsync of the directory and one O_APPEND publish record (+ fdatasync) in the "
        "writer's manifest; no unlink on the publish path; one-time directory and manifest "
        "creation at open are not counted",
    }


def _wait_until_visible(store_b, keys: list, expected: int, open_start: float, timeout_s: float, result: dict) -> list:
    """Poll B's contains_many every 1 ms until it shows ``expected`` blocks or ``timeout_s`` passed since
    ``open_start`` (the start of B's open); record how long that took and return what B shows."""
    present = list(store_b.contains_many(keys))
    result["visible_at_open"] = sum(1 for ok in present if ok)
    while sum(present) < expected and time.perf_counter() - open_start < timeout_s:
        time.sleep(0.001)
        present = list(store_b.contains_many(keys))
    result["visibility_seconds"] = time.perf_counter() - open_start
    result["visible_objects"] = sum(1 for ok in present if ok)
    result["visible_prefix"] = store_b.lookup_prefix(keys)
    result["visibility_how"] = (
        "from the start of B's Store.open until contains_many shows every published block (prompt minus "
        "dropped publishes), polled every 1 ms; it includes B's open (manifest replay and populating B's "
        "DRAM arena, b_open_seconds); visible_at_open = blocks B saw right after open"
    )
    return present


def _retrieve_visible(store_b, layout: workload.PromptLayout, pool, keys: list, present: list, published: dict) -> dict:
    """get_many of the blocks B sees into a fresh destination: timing, hits per tier and correctness."""
    wanted = [index for index, ok in enumerate(present) if ok]
    views = _destination_views(layout, layout.object_bytes * layout.object_count)
    get = _timed_call(store_b, lambda: list(store_b.get_many([keys[i] for i in wanted], [views[i] for i in wanted])))
    found = [False] * layout.object_count
    for index, ok in zip(wanted, get.returned, strict=True):
        found[index] = bool(ok)
    found_objects = sum(1 for ok in found if ok)
    explained_missing = published["dropped_stores"] + published["shared_dropped_publishes"]
    retrieve = {
        "seconds": get.seconds,
        "gbps": len(wanted) * layout.object_bytes / get.seconds / 1e9,
        "objects": len(wanted),
        "bytes": len(wanted) * layout.object_bytes,
        "cpu_seconds": get.cpu_seconds,
        "shared_hits": get.delta("shared_hits"),
        "shared_misses": get.delta("shared_misses"),
        "dram_hits": get.delta("dram_hits"),
        "shared_bytes_read": get.delta("shared_bytes_read"),
        "checksum_failures": get.delta("checksum_failures"),
    }
    return {
        "retrieve": retrieve,
        "found_objects": found_objects,
        "missing_objects": len(found) - found_objects,
        "unexplained_missing_objects": max(0, len(found) - found_objects - explained_missing),
        "wrong_objects": workload.count_wrong_objects(layout, pool, views, found),
        "cold": not retrieve["dram_hits"],
    }


def measure_shared(
    layout: workload.PromptLayout,
    pool,
    directory: str,
    namespace: bytes,
    visibility_timeout_s: float = 10.0,
    store_options: dict | None = None,
) -> dict:
    """Publish one prompt to the shared tier from store A, read it cold from store B (same root and namespace).

    A: nvme_bytes=0, a small DRAM tier, put_many + flush (flush closes, syncs, renames and lists every
    partly filled shared file). B: another local directory, nvme_bytes=0, opened after A was closed and
    the page cache dropped; timed until lookup_prefix covers the prompt, then get_many (every block from
    the shared files, verified byte for byte). B's DRAM tier holds the prompt: a get_many of more blocks
    than B has DRAM slots misses the excess in this build (see ``b_dram_bytes_note``).
    ``store_options``: more options of both stores (``encryption_key_file``, never under ``directory``'s
    shared root: the store refuses a key there)."""
    store_class = load_store_class()
    prompt_bytes = layout.object_bytes * layout.object_count
    page = workload.PAGE_BYTES
    slot_bytes = page + (layout.object_bytes + page - 1) // page * page
    shared_root = os.path.join(directory, "shared")
    dir_a, dir_b = os.path.join(directory, "store-a"), os.path.join(directory, "store-b")
    shutil.rmtree(directory, ignore_errors=True)
    for path in (shared_root, dir_a, dir_b):
        os.makedirs(path, exist_ok=True)
    file_bytes = shared_file_bytes_for(prompt_bytes, layout.object_bytes)
    dram_a = 8 * slot_bytes
    dram_b = (layout.object_count + 8) * slot_bytes

    def open_on_shared_root(store_dir: str, dram_bytes: int):
        return _open_shared(
            store_class, store_dir, namespace, layout.object_bytes, dram_bytes, shared_root, file_bytes, store_options
        )

    keys = layout.keys()
    views = layout.object_views(pool)
    result = _shared_result_header(layout, file_bytes, dram_a, dram_b)
    result["encrypted"] = bool((store_options or {}).get("encryption_key_file"))
    store_a = store_b = None
    try:
        store_a = open_on_shared_root(dir_a, dram_a)
        put = _timed_call(store_a, lambda: _put_and_flush(store_a, keys, views))
        published = result["store"] = _publish_summary(put, layout)
        store_a.close()
        store_a = None
        result["files"] = _published_files(shared_root, published["bytes"])
        result["metadata_ops"] = _publish_metadata_ops(published["shared_files_published"], published["bytes"])

        result["page_cache_dropped"] = workload.drop_page_cache()
        start = time.perf_counter()
        store_b = open_on_shared_root(dir_b, dram_b)
        result["b_open_seconds"] = time.perf_counter() - start
        expected = published["published_objects"]
        present = _wait_until_visible(store_b, keys, expected, start, visibility_timeout_s, result)
        result.update(_retrieve_visible(store_b, layout, pool, keys, present, published))
    finally:
        for store in (store_a, store_b):
            if store is not None:
                store.close()
        shutil.rmtree(directory, ignore_errors=True)
    return result


def _lookup_keys(key_count: int) -> list[bytes]:
    """Chained 32-byte keys, like a prompt's (see workload.PromptLayout.keys), under their own salt."""
    parent = hashlib.sha256(b"kvtier-bench-io/lookup").digest()
    keys = []
    for index in range(key_count):
        parent = hashlib.sha256(parent + index.to_bytes(8, "little")).digest()
        keys.append(parent)
    return keys


def _publish_lookup_blocks(writer, keys: list, views: list, slot_bytes: int, result: dict) -> None:
    start = time.perf_counter()
    batch = publish_queue_bytes() // 2 // slot_bytes  # one flush per batch: no publish is dropped
    for first in range(0, len(keys), batch):
        writer.put_many(keys[first : first + batch], views[first : first + batch])
        writer.flush()
    result["dropped_publishes"] = writer.stats().get("shared_dropped_publishes")
    result["publish_seconds"] = time.perf_counter() - start


def _min_median_max(values: list[float]) -> dict:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return {
        "min": ordered[0],
        "median": ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2,
        "max": ordered[-1],
        "n": len(ordered),
    }


def _time_lookup_call(call: Callable[[list], Any], keys: list, calls: int) -> dict:
    """Wall time of ``calls`` calls with every key (after one warm call), per call and per key."""
    call(keys)  # warm
    micros = []
    for _ in range(calls):
        start = time.perf_counter()
        call(keys)
        micros.append((time.perf_counter() - start) * 1e6)
    per_call = _min_median_max(micros)
    return {
        "us_per_call": per_call,
        "us_per_key": {key: (value / len(keys) if key != "n" else value) for key, value in per_call.items()},
    }


def measure_shared_lookup(
    directory: str, namespace: bytes, calls: int = LOOKUP_CALLS, key_count: int = LOOKUP_KEY_COUNT
) -> dict:
    """Time lookup_prefix and contains_many of ``key_count`` keys present only in the shared index.

    A tiny writer publishes ``key_count`` blocks of 4 KiB once; a reader store (nvme_bytes=0, no block in
    its DRAM) opens on the same root and namespace and is timed ``calls`` times per call kind."""
    store_class = load_store_class()
    shared_root = os.path.join(directory, "shared")
    shutil.rmtree(directory, ignore_errors=True)
    for name in ("shared", "writer", "reader"):
        os.makedirs(os.path.join(directory, name), exist_ok=True)
    keys = _lookup_keys(key_count)
    values = workload.make_pool(key_count * LOOKUP_OBJECT_BYTES, seed=key_count)
    views = [values[i * LOOKUP_OBJECT_BYTES : (i + 1) * LOOKUP_OBJECT_BYTES] for i in range(key_count)]
    slot_bytes = workload.PAGE_BYTES + LOOKUP_OBJECT_BYTES
    result: dict = {"key_count": key_count, "object_bytes": LOOKUP_OBJECT_BYTES, "calls": calls}

    def open_on_shared_root(name: str, dram_bytes: int):
        store_dir = os.path.join(directory, name)
        return _open_shared(
            store_class, store_dir, namespace, LOOKUP_OBJECT_BYTES, dram_bytes, shared_root, SHARED_FILE_BYTES
        )

    writer = reader = None
    try:
        writer = open_on_shared_root("writer", 64 * slot_bytes)
        _publish_lookup_blocks(writer, keys, views, slot_bytes, result)
        writer.close()
        writer = None
        reader = open_on_shared_root("reader", 8 * slot_bytes)
        deadline = time.perf_counter() + 30.0
        while reader.lookup_prefix(keys) < key_count and time.perf_counter() < deadline:
            time.sleep(0.001)
        result["present"] = reader.lookup_prefix(keys)
        result["present_contains"] = sum(1 for ok in reader.contains_many(keys) if ok)
        for name, call in (("lookup_prefix", reader.lookup_prefix), ("contains_many", reader.contains_many)):
            result[name] = _time_lookup_call(call, keys, calls)
        result["timed"] = (
            "wall time of one Python call with the 10,000-key list (includes the binding's "
            "conversion of the keys), reader store that holds none of the blocks in DRAM"
        )
    finally:
        for store in (writer, reader):
            if store is not None:
                store.close()
        shutil.rmtree(directory, ignore_errors=True)
    return result
