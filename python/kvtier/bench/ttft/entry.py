"""`kvtier bench ttft`'s entry point, ``main(argv)``: the plan, the phases in order, the report and
the output files (results.json, report.md, plots); ``--run-phase`` hands over to the engine phase."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.bench import bucket
from kvtier.bench.ttft.engine_phase import lmcache_config, run_phase, shared_store_dir
from kvtier.bench.ttft.orchestrate import launch_phase, run_lmcache_phase, shared_row_failures, summarize
from kvtier.bench.ttft.plan import BenchError, build_parser, make_plan
from kvtier.bench.ttft.report import print_report, write_plots


def open_object_bucket(plan: dict, stack: contextlib.ExitStack, notes: list[str]) -> None:
    """The kvtier_object row's bucket, open until ``stack`` closes: ``plan["object"]`` gets its
    ``bucket_url`` and ``bucket_endpoint``; the credentials are in this process's environment, which
    every engine process and its host service inherit (never in the plan, which is written to logs/)."""
    if not plan["object"]:
        return
    row = plan["object"]
    target = stack.enter_context(
        bucket.open_bucket(row["given_url"], row["given_endpoint"], row["osd_bytes"], progress_line)
    )
    row.update(bucket_url=target.url(), bucket_endpoint=target.endpoint)
    where = "the local RADOS gateway (radosgw.sh)" if target.self_hosted else "the given bucket"
    segment = row["segment_bytes"] or "the default"
    notes.append(f"kvtier_object: {target.url()} at {target.endpoint}, {where}, bucket_segment_bytes {segment}")


def progress_line(message: str) -> None:
    print(message, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.run_phase:
        return run_phase(args.run_phase)
    try:
        plan = make_plan(args)
    except BenchError as error:
        print(f"kvtier bench ttft: {error}", file=sys.stderr)
        return 2
    out_dir = Path(plan["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    temporary_store = args.store_dir is None
    store_root = Path(args.store_dir) if args.store_dir else Path(tempfile.mkdtemp(prefix="kvtier-bench-ttft-"))
    store_root.mkdir(parents=True, exist_ok=True)
    plan["store_dir"] = str(store_root / "kvtier")
    plan["example_dir"] = str(store_root / "example-connector")
    from kvtier.bench.layout import memcpy_gbps

    # The copy rate a DRAM hit's restore is judged against (issue 14), measured in this run.
    plan["memcpy_gbps"] = memcpy_gbps()
    print(f"memcpy: {plan['memcpy_gbps']:.1f} GB/s (numpy, 256 MiB copies, median of 5)", flush=True)
    notes: list[str] = []
    if os.geteuid() != 0:
        notes.append("not root: the page cache could not be dropped; disk hits may be served from the page cache")
    needed_bytes = plan["nvme_bytes"] + (
        sum(plan["lengths"]) * plan["kv_bytes_per_token"] if plan["example_connector"] else 0
    )
    if plan["disk_floor"]:
        needed_bytes += max(plan["lengths"]) // plan["block_tokens"] * plan["slot_bytes"]
    needed_bytes += int(plan["lmcache_disk_gib"] * 2**30) if plan["lmcache_available"] else 0
    # kvtier_shared: node A's local store, and one node B store at a time (removed after its phase).
    needed_bytes += 2 * plan["nvme_bytes"] if plan["shared"] else 0
    needed_bytes += 2 * plan["nvme_bytes"] if plan["object"] else 0  # the same for kvtier_object
    free_bytes = shutil.disk_usage(store_root).free
    if needed_bytes > free_bytes * 0.9:
        print(
            f"kvtier bench ttft: the store needs {needed_bytes / 2**30:.1f} GiB on {store_root} but only "
            f"{free_bytes / 2**30:.1f} GiB are free; use fewer --lengths/--repeats or another --store-dir",
            file=sys.stderr,
        )
        return 2
    print(
        f"kvtier bench ttft: preset {plan['preset']} ({plan['kv_bytes_per_token'] >> 10} KiB KV per token), "
        f"lengths {plan['lengths']}, hit rates {plan['hit_rates']} at {plan['hit_rate_length']} tokens, "
        f"{plan['repeats']} repeats\nstore {store_root} (kvtier DRAM {plan['dram_bytes'] / 2**30:.2f} GiB, "
        f"NVMe {plan['nvme_bytes'] / 2**30:.1f} GiB), vLLM KV cache {plan['kvcache_space_gib']} GiB\nresults {out_dir}",
        flush=True,
    )
    phases: list[tuple[str, str, Any]] = []
    for repeat in range(plan["repeats"]):
        phases.append(("baseline", f"baseline-r{repeat}", repeat))
        phases += [("kvtier_store", f"kvtier_store-{n}-r{repeat}", ["length", n, repeat]) for n in plan["lengths"]]
        phases += [("kvtier_store", f"kvtier_store-hit{h}-r{repeat}", ["rate", h, repeat]) for h in plan["hit_rates"]]
    phases.append(("kvtier_nvme", "kvtier_nvme", None))
    if plan["shared"]:
        phases.append(("kvtier_shared_store", "kvtier_shared_store", None))
        phases += [
            ("kvtier_shared_load", f"kvtier_shared_load-{n}-r{r}", [n, r])
            for r in range(plan["repeats"])
            for n in plan["lengths"]
        ]
        notes.append(
            f"kvtier_shared: node A published through {plan['shared']['store_root']}, node B read through "
            f"{plan['shared']['load_root']}"
            + (f", shared_file_bytes {plan['shared']['file_bytes']}" if plan["shared"]["file_bytes"] else "")
        )
    if plan["object"]:
        phases.append(("kvtier_object_store", "kvtier_object_store", None))
        phases += [
            ("kvtier_object_load", f"kvtier_object_load-{n}-r{r}", [n, r])
            for r in range(plan["repeats"])
            for n in plan["lengths"]
        ]
    if plan["example_connector"]:
        phases.append(("example_connector", "example_connector", None))
    else:
        notes.append("ExampleConnector skipped (--skip-example-connector)")
    if plan["lmcache_available"]:
        plan["lmcache_dir"] = str(store_root / "lmcache-disk")
        plan["lmcache_config_file"] = str((out_dir / "lmcache-config.yaml").absolute())
        Path(plan["lmcache_dir"]).mkdir(parents=True, exist_ok=True)
        # JSON is YAML: LMCache reads this file with yaml.safe_load.
        Path(plan["lmcache_config_file"]).write_text(json.dumps(lmcache_config(plan), indent=2) + "\n")
        phases.append(("lmcache_disk", "lmcache_disk", None))
        notes.append(
            f"LMCache: LMCacheConnectorV1 with its local disk backend through kvtier's CPU copy shim "
            f"({plan['lmcache_python']}; chunks of {plan['lmcache_chunk_tokens']} tokens, CPU cache off, "
            f"config {plan['lmcache_config_file']})"
        )
        skipped = [length for length in plan["lengths"] if length not in plan["lmcache_lengths"]]
        if skipped:
            notes.append(
                f"LMCache: lengths {skipped} are not whole {plan['lmcache_chunk_tokens']}-token chunks: not measured"
            )
    else:
        notes.append(plan["lmcache_not_measured"])
    started = time.time()
    measurements: list[dict] = []
    phase_info: dict[str, Any] = {}
    exit_code = 0
    bucket_stack = contextlib.ExitStack()
    try:
        for index, (phase, run_name, item) in enumerate(phases):
            if phase == "kvtier_object_store":
                # Up only for its phases: an idle Ceph cluster still takes CPU from the other rows.
                open_object_bucket(plan, bucket_stack, notes)
            print(
                f"[{time.time() - started:6.0f} s] phase {index + 1} of {len(phases)}: {run_name}"
                f" ({len(phases) - index - 1} after it)",
                flush=True,
            )
            if phase == "lmcache_disk":
                records = run_lmcache_phase(plan, args.phase_timeout_s, notes)
            else:
                records = launch_phase({**plan, "item": item}, phase, args.phase_timeout_s, run_name)
            if phase == "kvtier_shared_store":
                shutil.rmtree(shared_store_dir(plan, "a"), ignore_errors=True)  # the shared tier has its own copy
            elif phase == "kvtier_shared_load":
                shutil.rmtree(shared_store_dir(plan, f"b-{item[0]}-r{item[1]}"), ignore_errors=True)
            elif phase == "kvtier_object_store":
                shutil.rmtree(shared_store_dir(plan, "object-a"), ignore_errors=True)  # the bucket has its copy
            elif phase == "kvtier_object_load":
                shutil.rmtree(shared_store_dir(plan, f"object-b-{item[0]}-r{item[1]}"), ignore_errors=True)
                if not any(later[0] == "kvtier_object_load" for later in phases[index + 1 :]):
                    bucket_stack.close()
            for record in records:
                kind = record.pop("kind")
                if kind == "measure":
                    measurements.append({"phase": run_name, **record})
                else:
                    phase_info.setdefault(run_name, {})[kind] = record
    except (BenchError, bucket.BucketUnavailable) as error:
        print(f"kvtier bench ttft: {error}", file=sys.stderr)
        notes.append(f"incomplete: {str(error).splitlines()[0]}")
        exit_code = 1
    finally:
        bucket_stack.close()  # the run's prefix deleted, or the local gateway torn down
        if temporary_store:
            shutil.rmtree(store_root, ignore_errors=True)
        else:
            for node in store_root.glob("shared-node-*"):
                shutil.rmtree(node, ignore_errors=True)
        if plan["shared"]:
            # The run's subdirectory of the shared directory (through node A's view), so that a
            # network filesystem sized for one run's blocks is empty again.
            shutil.rmtree(plan["shared"]["store_root"], ignore_errors=True)
    if not measurements:
        return exit_code or 1
    summary = summarize(plan, measurements)
    for config in ("kvtier_shared", "kvtier_object"):
        failures = shared_row_failures(plan, summary, measurements, config)
        if failures:
            notes += [f"{config} FAILED: {failure}" for failure in failures]
            exit_code = 1
    markdown = print_report(plan, summary, notes, phase_info)
    plots = write_plots(plan, summary, out_dir)
    result = {
        "benchmark": "kvtier bench ttft",
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": time.time() - started,
        "machine": {"cpu_count": os.cpu_count(), "gpu": False, "root": os.geteuid() == 0},
        "plan": plan,
        "phases": phase_info,
        "measurements": measurements,
        "summary": summary,
        "notes": notes,
        "plots": plots,
    }
    (out_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "report.md").write_text(markdown)
    print(
        f"wrote {out_dir / 'results.json'}, {out_dir / 'report.md'}" + "".join(f", {out_dir / name}" for name in plots)
    )
    return exit_code
