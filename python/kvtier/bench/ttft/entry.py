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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from kvtier.bench import bucket, workload
from kvtier.bench.ttft.engine_phase import lmcache_config, run_phase, shared_store_dir
from kvtier.bench.ttft.orchestrate import launch_phase, run_lmcache_phase, shared_row_failures, summarize
from kvtier.bench.ttft.plan import BenchError, build_parser, make_plan
from kvtier.bench.ttft.report import print_report, write_plots
from kvtier.bench.ttft.slow_rows import (
    SLOW_PHASES,
    SlowLinks,
    node_store_name,
    slow_link_failures,
    slow_link_markdown,
    slow_link_phases,
    summarize_slow_link,
)


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


class Phase(NamedTuple):
    """One engine phase of the run: ``name`` says what runs (launch_phase's phase), ``run_name`` names
    its log and its measurements, ``item`` is the phase's point (None for a phase that runs them all)."""

    name: str
    run_name: str
    item: Any


@dataclass
class PhaseResults:
    """What the phases gave: the timed runs, each phase's other records by kind, and the exit code so far."""

    measurements: list[dict] = field(default_factory=list)
    phase_info: dict[str, Any] = field(default_factory=dict)
    exit_code: int = 0

    def add(self, run_name: str, records: list[dict]) -> None:
        for record in records:
            kind = record.pop("kind")
            if kind == "measure":
                self.measurements.append({"phase": run_name, **record})
            else:
                self.phase_info.setdefault(run_name, {})[kind] = record


def main(argv: list[str] | None = None) -> int:
    """`kvtier bench ttft`: 0, 1 when a phase failed or a remote-tier row cannot be trusted, 2 when the
    options or the free disk space do not allow the run."""
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
    # The engines' runtime directory (XDG_RUNTIME_DIR): short, so that socket paths fit.
    plan["runtime_dir"] = tempfile.mkdtemp(prefix="kvtier-ttft-run-")
    if plan["encrypted"]:
        plan["encrypted_store_dir"] = str(store_root / "kvtier-encrypted")
        # The run's runtime directory is removed with the run; only the key's path is in the plan.
        plan["encryption_key_file"] = workload.throwaway_key_file(plan["runtime_dir"])
    from kvtier.bench.layout import memcpy_gbps

    # The copy rate a DRAM hit's restore is judged against (issue 14), measured in this run.
    plan["memcpy_gbps"] = memcpy_gbps()
    print(f"memcpy: {plan['memcpy_gbps']:.1f} GB/s (numpy, 256 MiB copies, median of 5)", flush=True)
    notes: list[str] = []
    if os.geteuid() != 0:
        notes.append("not root: the page cache could not be dropped; disk hits may be served from the page cache")
    if not disk_space_suffices(plan, store_root):
        if temporary_store:
            shutil.rmtree(store_root, ignore_errors=True)
        shutil.rmtree(plan["runtime_dir"], ignore_errors=True)
        return 2
    print_intro(plan, store_root, out_dir)
    phases = phase_list(plan, store_root, out_dir, notes)
    started = time.time()
    try:
        results = run_phases(plan, phases, args.phase_timeout_s, started, notes)
    finally:
        remove_stores(plan, store_root, temporary_store)
        shutil.rmtree(plan["runtime_dir"], ignore_errors=True)
    if not results.measurements:
        return results.exit_code or 1
    return write_outputs(plan, results, notes, out_dir, argv, started)


def disk_space_needed_bytes(plan: dict) -> int:
    """Bytes the run's stores take at most on the store's disk, all rows together."""
    needed_bytes = plan["nvme_bytes"] + (
        sum(plan["lengths"]) * plan["kv_bytes_per_token"] if plan["example_connector"] else 0
    )
    if plan["disk_floor"]:
        needed_bytes += max(plan["lengths"]) // plan["block_tokens"] * plan["slot_bytes"]
    needed_bytes += int(plan["lmcache_disk_gib"] * 2**30) if plan["lmcache_available"] else 0
    # kvtier_shared: node A's local store, and one node B store at a time (removed after its phase).
    needed_bytes += 2 * plan["nvme_bytes"] if plan["shared"] else 0
    needed_bytes += 2 * plan["nvme_bytes"] if plan["object"] else 0  # the same for kvtier_object
    needed_bytes += plan["nvme_bytes"] if plan.get("encrypted") else 0  # kvtier_nvme_encrypted's own store
    return needed_bytes


def disk_space_suffices(plan: dict, store_root: Path) -> bool:
    """Whether the stores fit on ``store_root``'s disk (with a tenth to spare); says so on stderr if not."""
    needed_bytes = disk_space_needed_bytes(plan)
    free_bytes = shutil.disk_usage(store_root).free
    if needed_bytes > free_bytes * 0.9:
        print(
            f"kvtier bench ttft: the store needs {needed_bytes / 2**30:.1f} GiB on {store_root} but only "
            f"{free_bytes / 2**30:.1f} GiB are free; use fewer --lengths/--repeats or another --store-dir",
            file=sys.stderr,
        )
        return False
    return True


def print_intro(plan: dict, store_root: Path, out_dir: Path) -> None:
    print(
        f"kvtier bench ttft: preset {plan['preset']} ({plan['kv_bytes_per_token'] >> 10} KiB KV per token), "
        f"lengths {plan['lengths']}, hit rates {plan['hit_rates']} at {plan['hit_rate_length']} tokens, "
        f"{plan['repeats']} repeats\nstore {store_root} (kvtier DRAM {plan['dram_bytes'] / 2**30:.2f} GiB, "
        f"NVMe {plan['nvme_bytes'] / 2**30:.1f} GiB), vLLM KV cache {plan['kvcache_space_gib']} GiB\nresults {out_dir}",
        flush=True,
    )


def phase_list(plan: dict, store_root: Path, out_dir: Path, notes: list[str]) -> list[Phase]:
    """Every phase of the run, in order; the LMCache phase's directory and config file are made here."""
    phases: list[Phase] = []
    lengths, hit_rates = plan["lengths"], plan["hit_rates"]
    for repeat in range(plan["repeats"]):
        phases.append(Phase("baseline", f"baseline-r{repeat}", repeat))
        phases += [Phase("kvtier_store", f"kvtier_store-{n}-r{repeat}", ["length", n, repeat]) for n in lengths]
        phases += [Phase("kvtier_store", f"kvtier_store-hit{h}-r{repeat}", ["rate", h, repeat]) for h in hit_rates]
    phases.append(Phase("kvtier_nvme", "kvtier_nvme", None))
    if plan["encrypted"]:
        phases += [Phase("kvtier_nvme_encrypted_store", "kvtier_nvme_encrypted_store", None),
                   Phase("kvtier_nvme_encrypted", "kvtier_nvme_encrypted", None)]  # fmt: skip
        notes.append(f"kvtier_nvme_encrypted: encryption_key_file {plan['encryption_key_file']} (a throwaway key), "
                     f"store {plan['encrypted_store_dir']}")  # fmt: skip
    if plan["shared"]:
        phases += remote_row_phases(plan, "kvtier_shared")
        phases += [Phase(*phase) for phase in slow_link_phases(plan, "shared")]
        notes.append(
            f"kvtier_shared: node A published through {plan['shared']['store_root']}, node B read through "
            f"{plan['shared']['load_root']}"
            + (f", shared_file_bytes {plan['shared']['file_bytes']}" if plan["shared"]["file_bytes"] else "")
        )
    if plan["object"]:
        phases += object_row_phases(plan)
        phases += [Phase(*phase) for phase in slow_link_phases(plan, "object")]
    if plan["example_connector"]:
        phases.append(Phase("example_connector", "example_connector", None))
    else:
        notes.append("ExampleConnector skipped (--skip-example-connector)")
    if plan["lmcache_available"]:
        phases.append(lmcache_phase(plan, store_root, out_dir, notes))
    else:
        notes.append(plan["lmcache_not_measured"])
    return phases


def remote_row_phases(plan: dict, config: str) -> list[Phase]:
    """A remote-tier row (kvtier_shared, kvtier_object): node A's store phase, which computes every
    prompt, then one load phase of node B per prompt ([length, repeat])."""
    loads = [
        Phase(f"{config}_load", f"{config}_load-{n}-r{r}", [n, r])
        for r in range(plan["repeats"])
        for n in plan["lengths"]
    ]
    return [Phase(f"{config}_store", f"{config}_store", None), *loads]


def object_row_phases(plan: dict) -> list[Phase]:
    """kvtier_object's phases and, with ``--encrypted``, kvtier_object_encrypted's: both nodes A first,
    then the two rows' loads of each prompt one after the other, so that neither row always runs on
    a machine warmer (or busier) than the other's."""
    clear = remote_row_phases(plan, "kvtier_object")
    if not plan["encrypted"]:
        return clear
    sealed = remote_row_phases(plan, "kvtier_object_encrypted")
    loads = [phase for pair in zip(clear[1:], sealed[1:], strict=True) for phase in pair]
    return [clear[0], sealed[0], *loads]


def lmcache_phase(plan: dict, store_root: Path, out_dir: Path, notes: list[str]) -> Phase:
    """The lmcache_disk phase, its disk directory and config file made and its notes added."""
    plan["lmcache_dir"] = str(store_root / "lmcache-disk")
    plan["lmcache_config_file"] = str((out_dir / "lmcache-config.yaml").absolute())
    Path(plan["lmcache_dir"]).mkdir(parents=True, exist_ok=True)
    # JSON is YAML: LMCache reads this file with yaml.safe_load.
    Path(plan["lmcache_config_file"]).write_text(json.dumps(lmcache_config(plan), indent=2) + "\n")
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
    return Phase("lmcache_disk", "lmcache_disk", None)


def run_phases(plan: dict, phases: list[Phase], timeout_s: int, started: float, notes: list[str]) -> PhaseResults:
    """Runs the phases in order, one engine process each; the first failure ends the run (a note and
    exit code 1). The object row's bucket is up only from its store phase to its last load phase, and
    each slow link only for its speed's phases."""
    results = PhaseResults()
    object_phases = ("kvtier_object_load", "kvtier_object_encrypted_load", SLOW_PHASES["object"])
    object_loads = [index for index, phase in enumerate(phases) if phase.name in object_phases]
    bucket_stack = contextlib.ExitStack()
    links = SlowLinks(plan, progress_line)
    try:
        for index, phase in enumerate(phases):
            if phase.name == "kvtier_object_store":
                # Up only for its phases: an idle Ceph cluster still takes CPU from the other rows.
                open_object_bucket(plan, bucket_stack, notes)
            print(
                f"[{time.time() - started:6.0f} s] phase {index + 1} of {len(phases)}: {phase.run_name}"
                f" ({len(phases) - index - 1} after it)",
                flush=True,
            )
            records = phase_records(links.plan_for(phase.name, phase.item, plan), phase, timeout_s, notes)
            links.after_phase(phase.name)
            remove_node_store(plan, phase)
            if object_loads and index == object_loads[-1]:
                links.close()
                bucket_stack.close()
            results.add(phase.run_name, records)
    except (BenchError, bucket.BucketUnavailable) as error:
        print(f"kvtier bench ttft: {error}", file=sys.stderr)
        notes.append(f"incomplete: {str(error).splitlines()[0]}")
        results.exit_code = 1
    finally:
        links.close()
        bucket_stack.close()  # the run's prefix deleted, or the local gateway torn down
    return results


def phase_records(plan: dict, phase: Phase, timeout_s: int, notes: list[str]) -> list[dict]:
    """One phase run in its own process: its records (measurements and the phase's other facts)."""
    if phase.name == "lmcache_disk":
        return run_lmcache_phase(plan, timeout_s, notes)
    return launch_phase({**plan, "item": phase.item}, phase.name, timeout_s, phase.run_name)


def remove_node_store(plan: dict, phase: Phase) -> None:
    """After a phase of a remote-tier row, the local store of its node: node A's once the shared tier
    (or the bucket) has its own copy, each node B's once timed."""
    if phase.name == "kvtier_shared_store":
        node = "a"
    elif phase.name == "kvtier_shared_load":
        node = f"b-{phase.item[0]}-r{phase.item[1]}"
    elif phase.name == "kvtier_object_store":
        node = "object-a"
    elif phase.name == "kvtier_object_load":
        node = f"object-b-{phase.item[0]}-r{phase.item[1]}"
    elif phase.name == "kvtier_object_encrypted_store":
        node = "object-enc-a"
    elif phase.name == "kvtier_object_encrypted_load":
        node = f"object-enc-b-{phase.item[0]}-r{phase.item[1]}"
    elif phase.name in SLOW_PHASES.values():
        node = node_store_name(phase.name, phase.item)
    else:
        return
    shutil.rmtree(shared_store_dir(plan, node), ignore_errors=True)


def remove_stores(plan: dict, store_root: Path, temporary_store: bool) -> None:
    """The run's stores: all of a temporary store directory, else the remote-tier rows' node stores and
    the encrypted row's store."""
    if temporary_store:
        shutil.rmtree(store_root, ignore_errors=True)
    else:
        for node in store_root.glob("shared-node-*"):
            shutil.rmtree(node, ignore_errors=True)
        if plan.get("encrypted_store_dir"):  # unreadable once the run's key is gone with its runtime directory
            shutil.rmtree(plan["encrypted_store_dir"], ignore_errors=True)
    if plan["shared"]:
        # The run's subdirectory of the shared directory (through node A's view), so that a
        # network filesystem sized for one run's blocks is empty again.
        shutil.rmtree(plan["shared"]["store_root"], ignore_errors=True)


def write_outputs(
    plan: dict, results: PhaseResults, notes: list[str], out_dir: Path, argv: list[str] | None, started: float
) -> int:
    """The summary and its checks, the report (stdout, report.md), the plots and results.json; the exit code."""
    summary = summarize(plan, results.measurements)
    exit_code = results.exit_code
    for config in ("kvtier_shared", "kvtier_object", "kvtier_object_encrypted"):
        failures = shared_row_failures(plan, summary, results.measurements, config)
        if failures:
            notes += [f"{config} FAILED: {failure}" for failure in failures]
            exit_code = 1
    summary["slow_link"] = summarize_slow_link(plan, results.measurements, summary)
    failures = slow_link_failures(plan, results.measurements)
    if failures:
        notes += [f"slow link FAILED: {failure}" for failure in failures]
        exit_code = 1
    slow_lines = slow_link_markdown(plan, summary["slow_link"], summary)
    if slow_lines:
        print("\n".join(slow_lines))
    markdown = print_report(plan, summary, notes, results.phase_info) + "\n".join(slow_lines)
    plots = write_plots(plan, summary, out_dir)
    result = {
        "benchmark": "kvtier bench ttft",
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": time.time() - started,
        "machine": {"cpu_count": os.cpu_count(), "gpu": False, "root": os.geteuid() == 0},
        "plan": plan,
        "phases": results.phase_info,
        "measurements": results.measurements,
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
