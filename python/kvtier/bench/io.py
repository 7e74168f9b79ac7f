"""`kvtier bench io`: kvtier's store and cold retrieve against the disk's physical limit and LMCache.

This module owns the benchmark's command line and its run loop (each system's entry and measurement:
``kvtier.bench.io_systems``). One run measures, interleaved and repeated, for every (model shape,
prompt size, object kind) case:

- fio: O_DIRECT io_uring write then read of a file in the same directory as the store, at the same
  bytes in flight (a couple of block size / iodepth combinations; the best of each is the limit);
- kvtier: ``put_many`` + ``flush`` of the prompt's objects, then a cold ``get_many`` (store closed and
  reopened, page cache dropped when root, tiny DRAM tier, verified byte for byte against what was stored);
- LMCache's LocalDiskBackend on the same bytes, in its own interpreter (optional);
- with ``--shared``: kvtier's shared-filesystem tier on a directory beside fio's file: store A publishes
  the prompt (put_many + flush), store B (another local directory, same root and namespace) waits until
  the blocks are visible and reads them cold; files and metadata operations per GB; and, once per run,
  the latency of lookup_prefix / contains_many for 10,000 keys present in the shared index;
- with ``--encrypted``: kvtier again with encryption at rest (a throwaway key file), and with
  ``--shared`` too, the shared-filesystem tier again with the key on both stores; each paired with the
  same system in clear by repeat (``encryption_cost_*``, ``shared_encryption_cost_*``: encrypted time
  over clear time);
- with ``--object``: kvtier's object-storage tier (S3) on a bucket (``--bucket-url``, or Ceph's RADOS
  gateway on 127.0.0.1 brought up and torn down by the benchmark): publish GB/s and cold retrieve
  GB/s from another, empty store, with the segment size and the GETs in flight swept, and the
  requests per GiB stored and loaded (``kvtier.bench.object_tier``). With ``--no-kvtier --no-fio
  --no-lmcache`` only this sweep runs; with ``--encrypted`` too, every point again with the key on
  both stores (``encryption_cost``: encrypted time over clear time, paired by repeat).

It prints a table, writes ``results.json``, ``table.txt`` and ``io.png`` to the output directory and
exits non-zero (3) if kvtier ever returned wrong bytes. ``--small`` is the CI size: a few seconds of
I/O, and it also fails (4) on results that are not sane (unexplained misses, errors, zero rates).
An ``--object`` sweep that failed or could not run (no bucket, an error, blocks missing or dropped)
fails the run (4) at any size, with the reason: its figures would be missing or wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import sys
import time
import traceback

from . import bucket, fio, kvtier_store, lmcache_client, object_tier, report, workload
from .io_systems import (
    Rig,
    fio_system,
    kvtier_encrypted_system,
    kvtier_object_system,
    kvtier_shared_encrypted_system,
    kvtier_shared_system,
    kvtier_system,
    log,
    measure_lookup,
    measure_trial,
    start_lmcache,
)

DEFAULT_SIZES = "8k,32k,64k"
DEFAULT_OBJECTS = "block16,block128,chunk256"
DEFAULT_MODELS = "llama3-8b"
DEFAULT_REPEATS = 3
SMALL_SIZES = "1k"
SMALL_OBJECTS = "block16,chunk256"
SMALL_REPEATS = 2
DEFAULT_FIO_INFLIGHT_BYTES = 64 * workload.MIB

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_WRONG_BYTES = 3
EXIT_NOT_SANE = 4


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier bench io",
        description="Store and cold-retrieve KV blocks of real model shapes with kvtier, against fio "
        "(the disk's limit, same run) and LMCache's LocalDiskBackend.",
    )
    parser.add_argument(
        "--dir",
        help="directory on the disk under test; the store, fio's file and LMCache's "
        "files go in a scratch folder inside it, removed afterwards "
        "(default: ./bench-results/io-scratch)",
    )
    parser.add_argument("--out", help="output directory (default: bench-results/io-<timestamp>/)")
    parser.add_argument("--sizes", help=f"prompt sizes in tokens, comma-separated (default: {DEFAULT_SIZES})")
    parser.add_argument(
        "--objects", help=f"object kinds: blockN (engine block of N tokens) or chunkN (default: {DEFAULT_OBJECTS})"
    )
    parser.add_argument(
        "--models",
        default=None,
        help=f"model shapes, comma-separated, from {', '.join(workload.MODEL_SHAPES)} (default: {DEFAULT_MODELS})",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        help=f"repeats of every measurement (default: {DEFAULT_REPEATS}, --small: {SMALL_REPEATS})",
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help=f"CI size: {SMALL_SIZES} tokens, {SMALL_OBJECTS}, {SMALL_REPEATS} repeats; fails on insane results",
    )
    parser.add_argument("--no-fio", action="store_true", help="skip fio (no ratios to the disk's limit)")
    parser.add_argument("--no-lmcache", action="store_true", help="skip LMCache")
    parser.add_argument("--no-kvtier", action="store_true", help="skip kvtier (measure only fio and LMCache)")
    parser.add_argument(
        "--shared",
        action="store_true",
        help="also measure kvtier's shared-filesystem tier "
        "(publish, visibility, cold retrieve from another store, files per GB, lookup latency "
        "of 10,000 keys) on a directory beside fio's file (on with --small)",
    )
    add_object_arguments(parser)
    parser.add_argument(
        "--lmcache-python", help="interpreter with lmcache installed (default: .venv-lmcache/bin/python when it exists)"
    )
    parser.add_argument(
        "--fio-inflight-mib",
        type=int,
        default=DEFAULT_FIO_INFLIGHT_BYTES // workload.MIB,
        help="bytes in flight for fio, in MiB (default: %(default)s)",
    )
    add_store_arguments(parser)
    parser.add_argument("--seed", type=int, default=20240601, help="seed of the block data (default: %(default)s)")
    return parser


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    """How kvtier's own store is opened for the run."""
    parser.add_argument(
        "--dram-bytes",
        type=int,
        default=0,
        help="kvtier DRAM tier for the benchmark store (default: 0, so gets come from NVMe)",
    )
    parser.add_argument(
        "--encrypted",
        action="store_true",
        help="also measure kvtier with encryption at rest (encryption_key_file, a throwaway key), beside the "
        "store in clear in the same run (system kvtier_encrypted; with --shared, also the shared-filesystem "
        "tier, system kvtier_shared_encrypted; with --object, every point of the object sweep again with the "
        "key on both stores, paired by repeat)",
    )
    parser.add_argument(
        "--keep-open",
        action="store_true",
        help="keep the kvtier store open between store and retrieve (default: close and reopen "
        "it, so no block can be served from DRAM; either way the page cache is dropped)",
    )


def add_object_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--object",
        action="store_true",
        help="also sweep kvtier's object-storage (S3) tier: publish and cold retrieve from another store, "
        "segment size x GETs in flight, requests per GiB (docs/object-tier.md)",
    )
    bucket.add_arguments(parser, "--object")
    parser.add_argument(
        "--object-size",
        help=f"prompt of the object sweep in tokens (default {object_tier.DEFAULT_SIZE}; "
        f"--small {object_tier.SMALL_SIZE})",
    )
    parser.add_argument(
        "--object-kind", default=object_tier.DEFAULT_KIND, help="object kind of the object sweep (default: %(default)s)"
    )
    parser.add_argument(
        "--object-segment-mib",
        help=f"bucket_segment_bytes values in MiB (default {object_tier.DEFAULT_SEGMENT_MIB}; "
        f"--small {object_tier.SMALL_SEGMENT_MIB})",
    )
    parser.add_argument(
        "--object-reads-in-flight",
        help=f"bucket_reads_in_flight values (default {object_tier.DEFAULT_READS_IN_FLIGHT}; "
        f"--small {object_tier.SMALL_READS_IN_FLIGHT})",
    )
    parser.add_argument("--object-repeats", type=int, help="repeats of the object sweep (default: 3; --small: 1)")


def object_options(args: argparse.Namespace, model: str) -> dict | None:
    """The object sweep's plan from the command line (None without --object)."""
    if not args.object:
        if args.bucket_url or args.bucket_endpoint:
            raise ValueError("--bucket-url and --bucket-endpoint go with --object")
        return None
    repeats = args.object_repeats if args.object_repeats is not None else (1 if args.small else 3)
    if repeats < 1:
        raise ValueError("--object-repeats must be at least 1")
    small = args.small
    segments = args.object_segment_mib or (object_tier.SMALL_SEGMENT_MIB if small else object_tier.DEFAULT_SEGMENT_MIB)
    in_flight = args.object_reads_in_flight or (
        object_tier.SMALL_READS_IN_FLIGHT if small else object_tier.DEFAULT_READS_IN_FLIGHT
    )
    size = args.object_size or (object_tier.SMALL_SIZE if small else object_tier.DEFAULT_SIZE)
    sweep = object_tier.plan_sweep(
        workload.parse_token_count(size),
        args.object_kind,
        model,
        [int(part) for part in _split(segments)],
        [int(part) for part in _split(in_flight)],
    )
    return {
        "sweep": sweep,
        "repeats": repeats,
        "encrypted": bool(args.encrypted),
        "bucket_url": args.bucket_url,
        "bucket_endpoint": args.bucket_endpoint,
    }


def run_object_tier(options: dict, errors: list[dict]) -> dict | None:
    """The object sweep in a scratch folder of its own, on the run's bucket; None when it could not run
    (the reason is in ``errors``)."""
    plan = options["object"]
    sweep = plan["sweep"]
    scratch = os.path.join(options["scratch_dir"], "object")
    # The memstore OSD (RAM) holds one segment size's prompt at a time (deleted, then collected, after it).
    osd_bytes = 2 * sweep["prompt_bytes"] + workload.GIB
    try:
        with bucket.open_bucket(plan["bucket_url"], plan["bucket_endpoint"], osd_bytes, log) as target:
            key_file = workload.throwaway_key_file(options["scratch_dir"], "object.key") if plan["encrypted"] else None
            section = object_tier.run_sweep(sweep, target, scratch, plan["repeats"], options["seed"], log, key_file)
            section["bucket"] = {"endpoint": target.endpoint, "self_hosted": target.self_hosted, "url": target.url()}
    except bucket.BucketUnavailable as error:
        errors.append({"system": "kvtier_object", "case": "bucket", "error": str(error)})
        log(f"object tier: not measured: {error}")
        return None
    except Exception as error:  # record and go on: the rest of the run's figures stand
        errors.append({"system": "kvtier_object", "case": "sweep", "error": f"{type(error).__name__}: {error}"})
        log(f"object tier FAILED: {type(error).__name__}: {error}")
        if options["small"]:
            traceback.print_exc()
        return None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    section["problems"] = object_tier.problems(section)
    for line in object_tier.table_lines(section):
        log(line)
    return section


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def resolve_options(args: argparse.Namespace) -> dict:
    sizes_text = args.sizes or (SMALL_SIZES if args.small else DEFAULT_SIZES)
    objects_text = args.objects or (SMALL_OBJECTS if args.small else DEFAULT_OBJECTS)
    models_text = args.models or DEFAULT_MODELS
    repeats = args.repeats if args.repeats is not None else (SMALL_REPEATS if args.small else DEFAULT_REPEATS)
    if repeats < 1:
        raise ValueError("--repeats must be at least 1")
    models = _split(models_text)
    for model in models:
        if model not in workload.MODEL_SHAPES:
            raise ValueError(f"unknown model {model!r} in --models: use one of {', '.join(workload.MODEL_SHAPES)}")
    sizes = [workload.parse_token_count(size) for size in _split(sizes_text)]
    objects = [workload.parse_object_kind(kind) for kind in _split(objects_text)]
    if not sizes or not objects:
        raise ValueError("--sizes and --objects need at least one value each")
    started = datetime.datetime.now()
    out_dir = args.out or os.path.join("bench-results", f"io-{started.strftime('%Y%m%d-%H%M%S')}")
    base_dir = os.path.abspath(args.dir or os.path.join("bench-results", "io-scratch"))
    return {
        "models": models,
        "sizes": sizes,
        "objects": objects,
        "repeats": repeats,
        "small": args.small,
        "out_dir": os.path.abspath(out_dir),
        "scratch_dir": os.path.join(base_dir, f"kvtier-bench-io-{os.getpid()}"),
        "created_base_dir": not os.path.exists(base_dir),
        "use_fio": not args.no_fio,
        "use_lmcache": not args.no_lmcache,
        "use_kvtier": not args.no_kvtier,
        "use_shared": (args.shared or args.small) and not args.no_kvtier,
        "use_encrypted": args.encrypted and not args.no_kvtier,
        "lmcache_python": args.lmcache_python,
        "fio_inflight_bytes": args.fio_inflight_mib * workload.MIB,
        "dram_bytes": args.dram_bytes,
        "reopen": not args.keep_open,
        "seed": args.seed,
        "started": started,
        "object": object_options(args, models[0]),
        "regular": not (args.no_kvtier and args.no_fio and args.no_lmcache),
    }


def build_cases(options: dict) -> list[dict]:
    cases = []
    for model in options["models"]:
        shape = workload.MODEL_SHAPES[model]
        for prompt_tokens in options["sizes"]:
            for object_kind, tokens_per_object in options["objects"]:
                object_count = prompt_tokens // tokens_per_object
                if object_count == 0:
                    log(f"skipping {object_kind} at {prompt_tokens} tokens: the prompt holds no whole object")
                    continue
                object_bytes = tokens_per_object * shape.kv_bytes_per_token
                cases.append(
                    {
                        "model": model,
                        "prompt_tokens": prompt_tokens,
                        "object_kind": object_kind,
                        "tokens_per_object": tokens_per_object,
                        "object_bytes": object_bytes,
                        "object_count": object_count,
                        "prompt_bytes": object_bytes * object_count,
                        "repeats": [],
                    }
                )
    if not cases:
        raise ValueError("no case to run: every prompt size is smaller than every object")
    return cases


def check_resources(options: dict, cases: list[dict], pool_bytes: int) -> None:
    """Fail early, with the fix, when the disk or the memory cannot hold the largest case."""
    largest_prompt_bytes = max(case["prompt_bytes"] for case in cases)
    os.makedirs(options["scratch_dir"], exist_ok=True)
    free_disk_bytes = shutil.disk_usage(options["scratch_dir"]).free
    # fio's file + kvtier's store (with slack) + LMCache's files never coexist beyond this.
    needed_disk_bytes = int(largest_prompt_bytes * 2.5) + workload.GIB
    if free_disk_bytes < needed_disk_bytes:
        raise ValueError(
            f"{options['scratch_dir']} has {free_disk_bytes / 1e9:.1f} GB free, the largest case needs about "
            f"{needed_disk_bytes / 1e9:.1f} GB: free space, pick another --dir, or use smaller --sizes"
        )
    available_memory_bytes = _available_memory_bytes()
    # The data pool here and in the LMCache runner, plus one prompt of destination buffers (kvtier's
    # destination and LMCache's staging pool are never allocated at the same time).
    needed_memory_bytes = largest_prompt_bytes + 2 * pool_bytes + workload.GIB
    if options.get("use_shared"):
        needed_memory_bytes += largest_prompt_bytes  # the reading store's DRAM tier holds the prompt
    if available_memory_bytes and available_memory_bytes < needed_memory_bytes:
        raise ValueError(
            f"{available_memory_bytes / 1e9:.1f} GB of memory available, the largest case needs about "
            f"{needed_memory_bytes / 1e9:.1f} GB: use smaller --sizes (or --no-lmcache)"
        )


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def environment_info(options: dict) -> dict:
    info = {
        "hostname": platform.node(),
        "kernel": platform.release(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "is_root": os.geteuid() == 0,
        "scratch_dir": options["scratch_dir"],
    }
    try:
        import kvtier

        info["kvtier_version"] = getattr(kvtier, "__version__", None)
    except ImportError:
        info["kvtier_version"] = None
    return info


def run(options: dict) -> dict:
    """Run every case, interleaved over repeats; return the results document (also written to disk)."""
    # --object with --no-kvtier --no-fio --no-lmcache: only the object sweep (which makes its own data).
    cases = build_cases(options) if options["regular"] else []
    pool_bytes = max((workload.pool_bytes_for(case["prompt_bytes"], case["object_bytes"]) for case in cases), default=0)
    if cases:
        check_resources(options, cases, pool_bytes)
    document = new_document(options, cases, pool_bytes)
    systems = document["systems"]
    systems["kvtier"] = kvtier_system(options)
    systems["kvtier_encrypted"] = kvtier_encrypted_system(options)
    systems["kvtier_shared"] = kvtier_shared_system(options)
    systems["kvtier_shared_encrypted"] = kvtier_shared_encrypted_system(options)
    systems["kvtier_object"] = kvtier_object_system(options)
    systems["fio"] = fio_system(options)
    lmcache_session = start_lmcache(options, systems)

    os.makedirs(options["out_dir"], exist_ok=True)
    os.makedirs(options["scratch_dir"], exist_ok=True)
    fio_file = os.path.join(options["scratch_dir"], "fio-testfile")
    if cases:
        log(f"generating {workload.format_bytes(pool_bytes)} of block data ...")
    pool = workload.make_pool(pool_bytes, options["seed"]) if cases else None

    systems_run = ("fio", "kvtier", "kvtier_encrypted", "kvtier_shared", "kvtier_shared_encrypted", "lmcache")
    enabled = [name for name in systems_run if systems[name]["enabled"]]
    rig = Rig(options, document, pool_bytes, pool, fio_file, lmcache_session, enabled)
    run_started = time.perf_counter()
    try:
        for repeat in range(options["repeats"]):
            for case_index, case in enumerate(cases):
                measure_trial(rig, repeat, case_index, case)
        if "kvtier_shared" in enabled:
            measure_lookup(rig)
        if options["object"]:
            document["object_tier"] = run_object_tier(options, document["errors"])
    finally:
        clean_up(options, lmcache_session, fio_file)
    document["elapsed_seconds"] = time.perf_counter() - run_started
    summarize(document, cases)
    return document


def new_document(options: dict, cases: list[dict], pool_bytes: int) -> dict:
    """The results document before any measurement: the run's settings, models and environment."""
    models = {
        model: {
            field: getattr(workload.MODEL_SHAPES[model], field)
            for field in ("name", "num_layers", "num_kv_heads", "head_dim", "dtype_bytes")
        }
        | {"kv_bytes_per_token": workload.MODEL_SHAPES[model].kv_bytes_per_token}
        for model in options["models"]
    }
    return {
        "benchmark": "kvtier bench io",
        "schema_version": 1,
        "started_at": options["started"].isoformat(timespec="seconds"),
        "argv": list(sys.argv),
        "small": options["small"],
        "repeats": options["repeats"],
        "seed": options["seed"],
        "pool_bytes": pool_bytes,
        "fio_inflight_bytes": options["fio_inflight_bytes"],
        "models": models,
        "environment": environment_info(options),
        "systems": {},
        "errors": [],
        "cases": cases,
    }


def clean_up(options: dict, lmcache_session: lmcache_client.LMCacheSession | None, fio_file: str) -> None:
    """Stop LMCache's runner and remove every file the run made (the outputs stay)."""
    if lmcache_session is not None:
        lmcache_session.close()
    fio.remove_test_file(fio_file)
    shutil.rmtree(options["scratch_dir"], ignore_errors=True)
    if options["created_base_dir"]:
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(options["scratch_dir"]))  # the default folder we made, if empty


def summarize(document: dict, cases: list[dict]) -> None:
    """Each case's summary and targets, the run's wrong objects, sanity problems and targets met."""
    for case in cases:
        case["summary"] = report.summarize_case(case)
        case["targets"] = report.evaluate_targets(case)
    document["wrong_objects"] = {
        system: sum(case["summary"]["wrong_objects"][system] for case in cases) for system in report.SYSTEMS
    }
    object_section = document.get("object_tier") or {"points": []}
    document["wrong_objects"]["kvtier_object"] = sum(
        retrieved["wrong_objects"] for point in object_section["points"] for retrieved in point["retrieves"]
    )
    document["sanity_problems"] = sanity_problems(document) + object_section.get("problems", [])
    all_checks = [
        dict(check, case=f"{case['model']} {case['prompt_tokens']} {case['object_kind']}")
        for case in cases
        for check in case["targets"]
    ]
    document["targets_summary"] = {
        "met": sum(1 for check in all_checks if check["met"]),
        "missed": [check for check in all_checks if not check["met"]],
        "note": "figures to print against, not asserts; compare ratios from one run (the disk is noisy)",
    }


def sanity_problems(document: dict) -> list[str]:
    """Things that make the run's figures untrustworthy (used by --small to fail)."""
    problems = []
    for error in document["errors"]:
        problems.append(f"{error['system']} failed in {error['case']}: {error['error']}")
    for case in document["cases"]:
        name = f"{case['model']} {case['prompt_tokens']} tokens {case['object_kind']}"
        for sample in case["repeats"]:
            for system, label in (
                ("kvtier_shared", "kvtier shared tier"),
                ("kvtier_shared_encrypted", "kvtier shared tier (encrypted)"),
            ):
                if sample.get(system):
                    problems += _shared_problems(sample[system], label, name)
            for system, label in (("kvtier", "kvtier"), ("kvtier_encrypted", "kvtier (encrypted)")):
                if sample.get(system):
                    problems += _kvtier_problems(sample[system], label, name)
            for system in report.SYSTEMS:
                measured = sample.get(system)
                for operation in ("store", "retrieve"):
                    gbps = ((measured or {}).get(operation) or {}).get("gbps")
                    if measured and not (gbps and gbps > 0 and gbps < 1000):
                        problems.append(f"{system} {operation} rate {gbps} GB/s is not sane in {name}")
    return problems


def _shared_problems(measured: dict, label: str, name: str) -> list[str]:
    """A shared-tier sample's problems: blocks published but not found, wrong bytes, blocks B did not see."""
    problems = []
    if measured.get("unexplained_missing_objects"):
        problems.append(f"{label} missed {measured['unexplained_missing_objects']} published objects in {name}")
    if measured.get("wrong_objects"):
        problems.append(f"{label} returned wrong bytes for {measured['wrong_objects']} objects in {name}")
    published = (measured.get("store") or {}).get("published_objects")
    if measured.get("visible_objects") != published:
        problems.append(
            f"{label}: store B saw {measured.get('visible_objects')} of {published} published objects in {name}"
        )
    return problems


def _kvtier_problems(measured: dict, label: str, name: str) -> list[str]:
    """A local-tier sample's problems: unexplained misses, wrong bytes, a warm retrieve, dropped stores."""
    problems = []
    if measured.get("unexplained_missing_objects"):
        problems.append(
            f"{label} missed {measured['unexplained_missing_objects']} stored objects "
            f"(not dropped under backpressure) in {name}"
        )
    if measured.get("wrong_objects"):
        problems.append(f"{label} returned wrong bytes for {measured['wrong_objects']} objects in {name}")
    if measured.get("cold") is False:
        problems.append(
            f"{label} retrieve in {name} was served from DRAM (not cold): "
            "drop --keep-open or use a smaller --dram-bytes"
        )
    if measured.get("store", {}).get("dropped_stores"):
        problems.append(
            f"{label} dropped {measured['store']['dropped_stores']} stores under "
            f"backpressure in {name}, so its store rate overstates: raise --dram-bytes"
        )
    return problems


def write_outputs(document: dict, out_dir: str) -> dict:
    paths = {
        "json": os.path.join(out_dir, "results.json"),
        "table": os.path.join(out_dir, "table.txt"),
        "plot": os.path.join(out_dir, "io.png"),
    }
    plain_table = report.render_table(document) if document["cases"] else ""
    plot_problem = report.write_plot(document, paths["plot"]) if document["cases"] else None
    if plot_problem:
        log(f"note: no plot: {plot_problem}")
    if plot_problem or not document["cases"]:
        paths.pop("plot")
    if document.get("object_tier"):
        object_table = "\n".join(object_tier.table_lines(document["object_tier"]))
        plain_table = f"{plain_table}\n\n{object_table}" if plain_table else object_table
        paths["object_plot"] = os.path.join(out_dir, "io-object.png")
        object_plot_problem = object_tier.write_plot(document["object_tier"], paths["object_plot"])
        if object_plot_problem:
            log(f"note: no object-tier plot: {object_plot_problem}")
            paths.pop("object_plot")
    document["outputs"] = paths
    with open(paths["table"], "w") as handle:
        handle.write(plain_table + "\n")
    with open(paths["json"], "w") as handle:
        json.dump(document, handle, indent=1, default=str)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        options = resolve_options(args)
        document = run(options)
    except (ValueError, kvtier_store.KvtierUnavailable) as error:
        log(f"kvtier bench io: {error}")
        return EXIT_USAGE
    paths = write_outputs(document, options["out_dir"])
    for system, info in document["systems"].items():
        if not info.get("enabled"):
            log(f"{system}: skipped ({info.get('skipped_reason')})")
    summary = document["targets_summary"]
    if summary["met"] or summary["missed"]:
        log(f"kvtier targets: {summary['met']} met, {len(summary['missed'])} missed (figures, not asserts)")
    plots = ", ".join(paths[name] for name in ("plot", "object_plot") if name in paths)
    log(f"results: {paths['json']}" + (f", plots: {plots}" if plots else ""))
    wrong = document["wrong_objects"]
    if any(count for system, count in wrong.items() if system != "lmcache"):
        log(
            f"FAIL: kvtier returned wrong bytes for {wrong['kvtier']} objects (encrypted: "
            f"{wrong['kvtier_encrypted']}; shared tier: {wrong['kvtier_shared']}, encrypted: "
            f"{wrong['kvtier_shared_encrypted']}; object tier: {wrong['kvtier_object']})"
        )
        return EXIT_WRONG_BYTES
    object_failures = object_tier_failures(document)
    if document["sanity_problems"]:
        for problem in document["sanity_problems"]:
            failed = options["small"] or problem in object_failures
            log(f"{'FAIL' if failed else 'warning'}: {problem}")
        if options["small"] or object_failures:
            return EXIT_NOT_SANE
    return EXIT_OK


def object_tier_failures(document: dict) -> list[str]:
    """The sanity problems of the ``--object`` sweep (it failed, found no bucket, or missed or dropped
    blocks): these fail the run at any size, the others only at ``--small``."""
    object_section = document.get("object_tier") or {}
    failures = [
        f"{error['system']} failed in {error['case']}: {error['error']}"
        for error in document["errors"]
        if error["system"] == "kvtier_object"
    ]
    return failures + list(object_section.get("problems", []))


if __name__ == "__main__":
    sys.exit(main())
