"""The object-storage tier in `kvtier bench io --object`: publish and cold retrieve through a bucket.

For every segment size (``bucket_segment_bytes``) and repeat: store A (an empty local directory,
``nvme_bytes=0``, a DRAM tier that holds the prompt so that no block leaves DRAM before it is
published) publishes one prompt with ``put_many`` + ``flush`` (the flush waits until every segment
and its index object are PUT) and closes. Then, for every ``bucket_reads_in_flight``, a fresh store
B (another empty local directory, same bucket prefix and namespace) opens (it lists the prefix and
GETs the index objects once), checks that ``lookup_prefix`` covers the prompt, and is timed for one
``get_many`` of the whole prompt: the blocks come from the bucket, adjacent blocks of a segment with
one ranged GET (``bucket_get_max_bytes``, automatic: 4 blocks), compared byte for byte with what A
stored. B's listing period is set to the maximum so that no listing lands in the timed
window. Requests come from the tier's counters (``bucket_put_requests``, ``bucket_get_requests``,
``bucket_list_requests``): per GiB stored are A's during the publish, per GiB loaded are B's during
the ``get_many``; B's open (listing and index GETs) is reported apart. The prefix of a segment size
is deleted after its reads.

With a key file (``--encrypted``), every segment size and repeat runs twice, in clear and with
``encryption_key_file`` on both stores (A seals every value, B opens it in its DRAM slot), on prefixes
of their own; which runs first alternates by repeat. The summary keeps the clear figures where they
always were and adds ``encrypted`` (the same figures) and ``encryption_cost`` (encrypted time / clear
time, paired by repeat).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time

from . import kvtier_store, workload

DEFAULT_SEGMENT_MIB = "4,16,64"
DEFAULT_READS_IN_FLIGHT = "1,4,16,64"
DEFAULT_SIZE = "8k"
DEFAULT_KIND = "block16"
SMALL_SEGMENT_MIB = "4,16"
SMALL_READS_IN_FLIGHT = "1,8"
SMALL_SIZE = "1k"
READER_REFRESH_MS = 600_000  # the option's maximum: no listing during the timed get_many
REQUEST_TIMEOUT_MS = 30_000
VISIBLE_WAIT_S = 10.0


def slot_bytes_of(object_bytes: int) -> int:
    page = workload.PAGE_BYTES
    return page + -(-object_bytes // page) * page


def plan_sweep(prompt_tokens: int, kind: str, model: str, segment_mib: list[int], reads_in_flight: list[int]) -> dict:
    """The sweep's shape; raises ValueError (with the fix) for a segment that cannot hold one block."""
    object_kind, tokens_per_object = workload.parse_object_kind(kind)
    shape = workload.MODEL_SHAPES[model]
    object_bytes = tokens_per_object * shape.kv_bytes_per_token
    object_count = prompt_tokens // tokens_per_object
    if object_count == 0:
        raise ValueError(f"--object-size {prompt_tokens} tokens holds no whole {object_kind} object")
    slot_bytes = slot_bytes_of(object_bytes)
    for mib in segment_mib:
        if mib * workload.MIB < workload.PAGE_BYTES + slot_bytes:
            raise ValueError(
                f"a {mib} MiB segment cannot hold one {object_kind} block ({slot_bytes} bytes with its descriptor "
                "page, plus the 4 KiB segment header): use larger --object-segment-mib"
            )
    if not reads_in_flight or min(reads_in_flight) < 1 or max(reads_in_flight) > 1024:
        raise ValueError("--object-reads-in-flight values must be 1..1024 (bucket_reads_in_flight)")
    return {
        "model": model,
        "prompt_tokens": prompt_tokens,
        "object_kind": object_kind,
        "tokens_per_object": tokens_per_object,
        "object_bytes": object_bytes,
        "slot_bytes": slot_bytes,
        "object_count": object_count,
        "prompt_bytes": object_bytes * object_count,
        "segment_bytes": [mib * workload.MIB for mib in segment_mib],
        "reads_in_flight": reads_in_flight,
    }


def _open(store_class, directory: str, namespace: bytes, sweep: dict, **bucket_options):
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    return store_class.open(
        directory,
        namespace=namespace,
        object_bytes=sweep["object_bytes"],
        dram_bytes=(sweep["object_count"] + 8) * sweep["slot_bytes"],
        nvme_bytes=0,
        bucket_request_timeout_ms=REQUEST_TIMEOUT_MS,
        **bucket_options,
    )


def _delta(after: dict, before: dict, name: str) -> int:
    return int(after.get(name, 0)) - int(before.get(name, 0))


def measure_publish(store_class, layout, pool, directory: str, namespace: bytes, sweep: dict, options: dict) -> dict:
    """Store A: put_many + flush of the prompt into the bucket; rate and requests per GiB stored."""
    store = _open(store_class, directory, namespace, sweep, **options)
    try:
        before = store.stats()
        started = time.perf_counter()
        store.put_many(layout.keys(), layout.object_views(pool))
        store.flush()
        seconds = time.perf_counter() - started
        after = store.stats()
    finally:
        store.close()
        shutil.rmtree(directory, ignore_errors=True)
    dropped = _delta(after, before, "bucket_dropped_publishes") + _delta(after, before, "dropped_stores")
    published_bytes = (sweep["object_count"] - dropped) * sweep["object_bytes"]
    gibibytes = max(published_bytes, 1) / workload.GIB
    puts = _delta(after, before, "bucket_put_requests")
    return {
        "seconds": seconds,
        "gbps": published_bytes / seconds / 1e9,
        "published_bytes": published_bytes,
        "dropped_objects": dropped,
        "segments": _delta(after, before, "bucket_segments_published"),
        "bytes_written": _delta(after, before, "bucket_bytes_written"),
        "put_requests": puts,
        "list_requests": _delta(after, before, "bucket_list_requests"),
        "request_errors": _delta(after, before, "bucket_request_errors"),
        "puts_per_gib": puts / gibibytes,
    }


def _wait_visible(store, keys: list[bytes]) -> int:
    deadline = time.monotonic() + VISIBLE_WAIT_S
    visible = store.lookup_prefix(keys)
    while visible < len(keys) and time.monotonic() < deadline:
        time.sleep(0.05)
        visible = store.lookup_prefix(keys)
    return visible


def measure_cold_retrieve(
    store_class, layout, pool, directory: str, namespace: bytes, sweep: dict, options: dict, reads_in_flight: int
) -> dict:
    """Store B, fresh and empty: one get_many of the whole prompt from the bucket, verified."""
    started = time.perf_counter()
    store = _open(
        store_class,
        directory,
        namespace,
        sweep,
        bucket_reads_in_flight=reads_in_flight,
        bucket_refresh_ms=READER_REFRESH_MS,
        bucket_lease_ms=2 * READER_REFRESH_MS,  # the option's floor; no budget, so no lease is taken
        **options,
    )
    try:
        open_seconds = time.perf_counter() - started
        opened = store.stats()
        keys = layout.keys()
        visible = _wait_visible(store, keys)
        destination = workload.aligned_buffer(sweep["prompt_bytes"])
        views = [destination[i * layout.object_bytes : (i + 1) * layout.object_bytes] for i in range(len(keys))]
        before = store.stats()
        started = time.perf_counter()
        found = [bool(ok) for ok in store.get_many(keys, views)]
        seconds = time.perf_counter() - started
        after = store.stats()
        wrong = workload.count_wrong_objects(layout, pool, views, found)
    finally:
        store.close()
        shutil.rmtree(directory, ignore_errors=True)
    loaded_bytes = sum(found) * layout.object_bytes
    gets = _delta(after, before, "bucket_get_requests")
    return {
        "reads_in_flight": reads_in_flight,
        "open_seconds": open_seconds,
        "open_list_requests": int(opened.get("bucket_list_requests", 0)),
        "open_get_requests": int(opened.get("bucket_get_requests", 0)),
        "visible_objects": visible,
        "seconds": seconds,
        "gbps": loaded_bytes / seconds / 1e9,
        "loaded_bytes": loaded_bytes,
        "found_objects": sum(found),
        "missing_objects": len(found) - sum(found),
        "wrong_objects": wrong,
        "bucket_hits": _delta(after, before, "bucket_hits"),
        "dram_hits": _delta(after, before, "dram_hits"),
        "get_requests": gets,
        "list_requests": _delta(after, before, "bucket_list_requests"),
        "request_errors": _delta(after, before, "bucket_request_errors"),
        "verify_failures": _delta(after, before, "bucket_verify_failures"),
        "gets_per_gib": gets / max(loaded_bytes / workload.GIB, 1e-9),
    }


def _variants(repeat: int, key_file: str | None) -> list[dict]:
    """The store options of one repeat's variants: in clear, and with ``key_file`` encrypted too.
    Which goes first alternates by repeat, so that neither always finds the bucket and the disk warmer."""
    variants: list[dict] = [{}]
    if key_file:
        variants.append({"encryption_key_file": key_file})
    return variants if repeat % 2 == 0 else variants[::-1]


def _measure_point(store_class, layout, pool, scratch_dir: str, namespace: bytes, sweep: dict, options: dict, log):
    """One publish, then one cold retrieve per reads-in-flight value, on the prefix of ``options``."""
    point: dict = {"retrieves": []}
    point["publish"] = measure_publish(
        store_class, layout, pool, os.path.join(scratch_dir, "object-a"), namespace, sweep, options
    )
    published = point["publish"]
    log(
        f"publish {published['gbps']:.2f} GB/s, {published['segments']} segments, "
        f"{published['puts_per_gib']:.0f} PUTs/GiB, {published['dropped_objects']} dropped"
    )
    for in_flight in sweep["reads_in_flight"]:
        reader_dir = os.path.join(scratch_dir, "object-b")
        retrieved = measure_cold_retrieve(store_class, layout, pool, reader_dir, namespace, sweep, options, in_flight)
        point["retrieves"].append(retrieved)
        log(
            f"{in_flight} GETs in flight: retrieve {retrieved['gbps']:.2f} GB/s, "
            f"{retrieved['gets_per_gib']:.0f} GETs/GiB, wrong {retrieved['wrong_objects']}, "
            f"missing {retrieved['missing_objects']}"
        )
    return point


def run_sweep(sweep: dict, bucket, scratch_dir: str, repeats: int, seed: int, log, key_file: str | None = None) -> dict:
    """Every segment size x repeat (x variant: in clear, and encrypted with ``key_file``): one publish,
    then one cold retrieve per reads-in-flight value."""
    store_class = kvtier_store.load_store_class()
    pool_bytes = workload.pool_bytes_for(sweep["prompt_bytes"], sweep["object_bytes"])
    pool = workload.make_pool(pool_bytes, seed)
    shape = workload.MODEL_SHAPES[sweep["model"]]
    namespace = f"kvtier-bench-io/object/{sweep['model']}/{sweep['tokens_per_object']}".encode()
    points = []
    for repeat in range(repeats):
        for segment_bytes in sweep["segment_bytes"]:
            for sealing in _variants(repeat, key_file):
                encrypted = bool(sealing)
                sub_prefix = f"r{repeat}-seg{segment_bytes >> 20}m" + ("-enc" if encrypted else "")
                options = {**bucket.options(sub_prefix), "bucket_segment_bytes": segment_bytes, **sealing}
                seed_text = f"{seed}/object/{sub_prefix}"
                layout = workload.prompt_layout(
                    shape, sweep["prompt_tokens"], sweep["tokens_per_object"], seed_text, pool_bytes
                )
                label = f"[{repeat + 1}/{repeats}] object tier{' (encrypted)' if encrypted else ''}, "
                label += f"{segment_bytes >> 20} MiB segments"

                def log_point(line: str, label: str = label) -> None:
                    log(f"{label}: {line}")

                point = _measure_point(store_class, layout, pool, scratch_dir, namespace, sweep, options, log_point)
                point.update(repeat=repeat, segment_bytes=segment_bytes, encrypted=encrypted)
                point["deleted_objects"] = bucket.delete_prefix(sub_prefix)
                points.append(point)
    section: dict = {"sweep": sweep, "repeats": repeats, "encrypted": key_file is not None, "points": points}
    section["summary"] = summarize(sweep, [p for p in points if not p["encrypted"]])
    if key_file:
        section["summary"]["encrypted"] = summarize(sweep, [p for p in points if p["encrypted"]])
        section["summary"]["encryption_cost"] = encryption_cost(sweep, points)
    return section


def encryption_cost(sweep: dict, points: list[dict]) -> dict:
    """Encrypted time / clear time, paired by repeat: per segment size for the publish, per (segment
    size, reads in flight) for the cold retrieve (min, median, max over the repeats)."""
    by_key = {(p["repeat"], p["segment_bytes"], p["encrypted"]): p for p in points}
    publish, retrieve = {}, {}
    for segment_bytes in sweep["segment_bytes"]:
        pairs = [
            (by_key[(r, segment_bytes, False)], by_key[(r, segment_bytes, True)])
            for r in sorted({p["repeat"] for p in points})
            if (r, segment_bytes, False) in by_key and (r, segment_bytes, True) in by_key
        ]
        publish[str(segment_bytes)] = _spread(
            [enc["publish"]["seconds"] / clear["publish"]["seconds"] for clear, enc in pairs]
        )
        for index, in_flight in enumerate(sweep["reads_in_flight"]):
            ratios = [enc["retrieves"][index]["seconds"] / clear["retrieves"][index]["seconds"] for clear, enc in pairs]
            retrieve[f"{segment_bytes}/{in_flight}"] = _spread(ratios)
    return {"publish": publish, "retrieve": retrieve}


def _spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def summarize(sweep: dict, points: list[dict]) -> dict:
    """Per segment size: publish GB/s and PUTs/GiB; per (segment size, reads in flight): retrieve
    GB/s and GETs/GiB (min, median, max over the repeats)."""
    publish, retrieve = {}, {}
    for segment_bytes in sweep["segment_bytes"]:
        mine = [point for point in points if point["segment_bytes"] == segment_bytes]
        publish[str(segment_bytes)] = {
            "gbps": _spread([point["publish"]["gbps"] for point in mine]),
            "puts_per_gib": _spread([point["publish"]["puts_per_gib"] for point in mine]),
            "segments": _spread([point["publish"]["segments"] for point in mine]),
        }
        for in_flight in sweep["reads_in_flight"]:
            runs = [r for point in mine for r in point["retrieves"] if r["reads_in_flight"] == in_flight]
            retrieve[f"{segment_bytes}/{in_flight}"] = {
                "gbps": _spread([r["gbps"] for r in runs]),
                "gets_per_gib": _spread([r["gets_per_gib"] for r in runs]),
            }
    return {"publish": publish, "retrieve": retrieve}


def problems(section: dict) -> list[str]:
    """What makes the sweep's figures untrustworthy: wrong bytes, misses, dropped publishes, errors."""
    found = []
    for point in section["points"]:
        where = f"repeat {point['repeat']}, {point['segment_bytes'] >> 20} MiB segments"
        where += ", encrypted" if point.get("encrypted") else ""
        published = point["publish"]
        if published["dropped_objects"] or published["request_errors"]:
            found.append(
                f"object tier publish dropped {published['dropped_objects']} blocks "
                f"({published['request_errors']} request errors) at {where}"
            )
        for retrieved in point["retrieves"]:
            at = f"{where}, {retrieved['reads_in_flight']} in flight"
            if retrieved["wrong_objects"]:
                found.append(f"object tier returned wrong bytes for {retrieved['wrong_objects']} blocks at {at}")
            if retrieved["missing_objects"] or retrieved["bucket_hits"] != retrieved["found_objects"]:
                found.append(
                    f"object tier: {retrieved['missing_objects']} blocks missing, {retrieved['bucket_hits']} "
                    f"bucket hits for {retrieved['found_objects']} found at {at}"
                )
    return found


def _cell(spread: dict | None, digits: int = 2) -> str:
    if not spread:
        return "-"
    if spread["n"] == 1:
        return f"{spread['median']:.{digits}f}"
    return f"{spread['median']:.{digits}f} ({spread['min']:.{digits}f}-{spread['max']:.{digits}f})"


def table_lines(section: dict) -> list[str]:
    """Markdown tables of the sweep: publish per segment size, retrieve per segment size and GETs in flight."""
    sweep, summary = section["sweep"], section["summary"]
    in_flight = sweep["reads_in_flight"]
    lines = [
        f"Object tier: {workload.format_token_count(sweep['prompt_tokens'])} tokens of {sweep['model']} in "
        f"{sweep['object_count']} {sweep['object_kind']} blocks of {workload.format_bytes(sweep['object_bytes'])}, "
        f"{section['repeats']} repeat(s); GB/s median (min-max)",
        "",
        "| segment | publish GB/s | segments | PUTs per GiB stored |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for segment_bytes in sweep["segment_bytes"]:
        row = summary["publish"][str(segment_bytes)]
        lines.append(
            f"| {segment_bytes >> 20} MiB | {_cell(row['gbps'])} | {_cell(row['segments'], 0)} | "
            f"{_cell(row['puts_per_gib'], 0)} |"
        )
    lines += [
        "",
        "| cold retrieve GB/s | " + " | ".join(f"{n} in flight" for n in in_flight) + " | GETs per GiB loaded |",
        "| ---: |" + " ---: |" * (len(in_flight) + 1),
    ]
    for segment_bytes in sweep["segment_bytes"]:
        cells = [summary["retrieve"][f"{segment_bytes}/{n}"] for n in in_flight]
        gets = [cell["gets_per_gib"]["median"] for cell in cells if cell["gets_per_gib"]]
        lines.append(
            f"| {segment_bytes >> 20} MiB segments | "
            + " | ".join(_cell(cell["gbps"]) for cell in cells)
            + f" | {max(gets) if gets else 0:.0f} |"
        )
    if section.get("encrypted"):
        lines += encryption_table_lines(section)
    return lines


def encryption_table_lines(section: dict) -> list[str]:
    """Encryption's cost on the object tier: GB/s in clear and encrypted, and encrypted time / clear
    time paired by repeat, for the publish and every cold retrieve."""
    sweep, summary = section["sweep"], section["summary"]
    encrypted, cost = summary["encrypted"], summary["encryption_cost"]
    lines = [
        "",
        "Encryption at rest on the object tier (encryption_key_file): encrypted time / clear time paired by "
        "repeat, median (min-max)",
        "",
        "| segment | step | GB/s clear / encrypted | encrypted time, x clear |",
        "| ---: | :--- | ---: | ---: |",
    ]
    for segment_bytes in sweep["segment_bytes"]:
        size = str(segment_bytes)
        steps = [("publish", summary["publish"][size], encrypted["publish"][size], cost["publish"][size])]
        for n in sweep["reads_in_flight"]:
            at = f"{segment_bytes}/{n}"
            retrieve = (summary["retrieve"][at], encrypted["retrieve"][at], cost["retrieve"][at])
            steps.append((f"cold retrieve, {n} in flight", *retrieve))
        for step, clear, sealed, ratio in steps:
            lines.append(
                f"| {segment_bytes >> 20} MiB | {step} | {_cell(clear['gbps'])} / {_cell(sealed['gbps'])} | "
                f"{_cell(ratio)} |"
            )
    return lines


def write_plot(section: dict, path: str) -> str | None:
    """Publish GB/s per segment size, and cold-retrieve GB/s against GETs in flight per segment size
    (median, whiskers min-max). Returns None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'kvtier[bench]' or pip install matplotlib)"
    sweep, summary = section["sweep"], section["summary"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    labels = [f"{segment >> 20} MiB" for segment in sweep["segment_bytes"]]
    spreads = [summary["publish"][str(segment)]["gbps"] for segment in sweep["segment_bytes"]]
    medians = [s["median"] if s else 0 for s in spreads]
    errors = [
        [s["median"] - s["min"] if s else 0 for s in spreads],
        [s["max"] - s["median"] if s else 0 for s in spreads],
    ]
    left.bar(labels, medians, yerr=errors, capsize=3, color="#1f77b4")
    left.set_xlabel("segment object size (bucket_segment_bytes)")
    left.set_ylabel("GB/s (median, whiskers min-max)")
    left.set_title("publish: put_many + flush")
    for segment, label in zip(sweep["segment_bytes"], labels, strict=True):
        cells = [summary["retrieve"][f"{segment}/{n}"]["gbps"] for n in sweep["reads_in_flight"]]
        xs = [n for n, cell in zip(sweep["reads_in_flight"], cells, strict=True) if cell]
        ys = [cell["median"] for cell in cells if cell]
        low = [cell["median"] - cell["min"] for cell in cells if cell]
        high = [cell["max"] - cell["median"] for cell in cells if cell]
        right.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=3, label=f"{label} segments")
    right.set_xscale("log", base=2)
    right.set_xticks(sweep["reads_in_flight"], [str(n) for n in sweep["reads_in_flight"]])
    right.set_xlabel("GETs in flight (bucket_reads_in_flight)")
    right.set_title("cold retrieve: another store, empty local store")
    right.legend(fontsize=8)
    for axis in (left, right):
        axis.grid(alpha=0.3)
    figure.suptitle(
        f"kvtier bench io --object: {workload.format_token_count(sweep['prompt_tokens'])} tokens, "
        f"{sweep['object_kind']} {workload.format_bytes(sweep['object_bytes'])} blocks, "
        f"{section['repeats']} repeat(s), {os.cpu_count()} cores",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None
