"""`kvtier bench faults`: a fault matrix under load (issue 36, item 5).

vLLM's own load client (``vllm bench serve``, the prefix_repetition dataset, as ``kvtier bench serve``
runs it: ``kvtier.bench.serve``'s commands, servers and result parsing) against an OpenAI server
(``vllm serve``) with kvtier (``KvtierConnector``, DRAM over NVMe, as bench serve's ``kvtier-nvme``
row), and a fault injected mid-run; the same load against vLLM alone first, as the reference.

Rows (each a fresh server, stopped after it, with its store removed):

- ``vllm``: vLLM alone, no fault. Its generated texts are the reference outputs.
- ``service-stop``: kvtier's host service SIGSTOPped (``kvtier.service.service_pid``), then SIGCONT:
  a hung service (a stalled disk, a debugger, a frozen container).
- ``service-kill``: the host service SIGKILLed; nothing restarts it from outside: the engine's
  connection reconnects and starts a new service on the store (``service_restarted`` records the new
  process id).
- ``nvme-read-errors``: the row's store directory (its NVMe tier's files) on a FUSE passthrough
  (``kvtier.bench.slowmount``) whose reads fail with EIO while a flag file exists; the flag is there
  during the fault. The row's DRAM tier is cut to a few blocks so that repeats are read from NVMe.
- ``nvme-stop``: the same passthrough under the NVMe tier's files, its FUSE daemon SIGSTOPped for the
  fault: a hung disk (its O_DIRECT reads wait in the kernel; ``nvme_read_stall_ms``). DRAM cut as above.
- ``nvme-full``: the row's store directory on a filesystem of its own that a filler file fills for the
  fault (``kvtier.bench.faults_disk``); DRAM cut as for the read errors.
- ``bucket-stop``, ``bucket-kill``, ``fuse-stop``: the S3 gateway (Ceph's radosgw on 127.0.0.1) stopped
  or killed, the shared filesystem's FUSE daemon stopped, with the row's hits coming from that tier
  (``kvtier.bench.faults_tiers``, which says how).

The load: ``--users`` users, ``--requests-per-user`` requests each, sent at a steady rate (gamma
arrivals of burstiness ``BURSTINESS``: nearly even gaps) so that they spread over ``--fault-after-s`` +
``--fault-s`` + ``--after-s`` seconds, with at most ``--concurrency`` in flight, greedy
(``--temperature 0``). The fault starts ``--fault-after-s`` seconds after the server saw the first
request (vLLM's prefix-cache query counter moved) and lasts ``--fault-s`` seconds.

Per row: failed requests (vllm bench serve's ``failed``), wrong outputs (each request's generated text
against vLLM alone's for the same request: the same seed gives the same prompts in the same order),
request and output throughput, TTFT p50/p99, and the seconds from the fault's end until kvtier served
a hit again (its service's ``dram_hits`` + ``nvme_hits`` rose, or for a remote tier's fault that tier's
own hits; a service started anew counts from 0), and the reads of the faulted tier from the fault's start
to a second after its end (``faults_tiers.TIER_READS``): a row whose fault touched no read of its tier
says so (in the table and a note), since it then checked nothing of that tier.
An output that differs is then checked token by token (``kvtier.bench.faults_ties``) against vLLM
alone's greedy path from a fresh server, one request at a time: one that left it only where the top
tokens nearly tie (``--tie-nats``) is cleared as a near tie, not counted as wrong.
A row with a failed request or a wrong output is a problem: the command exits 1.

Output (``--out DIR``): ``results.json``, ``table.md`` (also printed), ``faults.png`` (each request's TTFT
over the run per fault row against vLLM alone's, the fault shaded: ``kvtier.bench.faults_plot``, which
redraws it from a finished run's directory), ``logs/`` and ``bench/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvtier.bench import (
    faults_disk,
    faults_plot,
    faults_tiers,
    faults_ties,
    serve,
    serve_plan,
    serve_points,
    serve_servers,
)
from kvtier.bench.faults_args import BURSTINESS as BURSTINESS
from kvtier.bench.faults_args import FAULTS as FAULTS
from kvtier.bench.faults_args import FaultError, build_parser, make_plan
from kvtier.bench.faults_tiers import DISK_FULL, NVME_STOP, READ_ERRORS, TIER_FAULTS
from kvtier.bench.faults_ties import BASELINE_ROW, is_reference, unstable_requests, wrong_cell, wrong_outputs
from kvtier.bench.ttft import markdown_table

NVME_STALL_MS = 1000  # the nvme-stop row's nvme_read_stall_ms (docs/reliability.md, "The NVMe tier")
READ_ERROR_DRAM_SLOTS = 4  # the NVMe rows' DRAM tier: a few blocks (I/O staging), not a prefix
HIT_COLUMNS = ("dram_hits", "nvme_hits", "bucket_hits", "shared_hits")  # kvtier's hits over a row's load
KVTIER_ROW = "kvtier-nvme"  # bench serve's row whose store options the fault rows use (DRAM over NVMe)
POLL_S = 0.2
LOAD_START_TIMEOUT_S = 300  # the load client's start (it imports vLLM, tokenizes the dataset)
TABLE_HEADER = [
    "row", "requests", "failed", "wrong outputs", "req/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
    "worst TTFT in fault ms (vLLM alone's; most over same request)", "hits again after fault (s)", "kvtier DRAM hits",
    "NVMe hits", "bucket/shared hits", "tier reads in fault", "engine fallbacks (calls / loads / store blocks)",
]  # fmt: skip
NO_TIER_READ = "0: none touched"  # the table's cell for a fault that touched no read of its tier


# --------------------------------------------------------------------------------------------
# faults
# --------------------------------------------------------------------------------------------


def service_now(socket: Path) -> tuple[int | None, dict[str, int] | None]:
    """(the service's pid, its counters: ``faults_tiers.STATS``), each None while it does not answer."""
    from kvtier.service import running_service

    found = running_service(socket)
    return (found[0] if found else None), faults_tiers.service_counters(socket)


def hits_of(kind: str, counters: dict[str, int] | None) -> int | None:
    """The hits whose rise means kvtier serves again after this fault (``faults_tiers.hit_counters``)."""
    return None if counters is None else sum(counters[name] for name in faults_tiers.hit_counters(kind))


class Fault:
    """One fault on a row's host service, its NVMe tier or its remote tier: ``start()``, ``end()``;
    ``release()`` undoes what is left (a stopped process continued, a killed gateway started again, the
    read-error flag removed, the filler gone) whatever happened. ``flag``: the read-error mount's flag
    file (``nvme-read-errors``); ``target``: a remote tier's process (``faults_tiers.Gateway`` or
    ``MountDaemon``); ``disk``: the ``nvme-full`` row's filesystem (``faults_disk.SmallDisk``).
    ``pid``: the process the fault hit; ``service_pid``: the service's then."""

    def __init__(
        self, kind: str, socket: Path, flag: Path | None = None, target: Any = None, disk: Any = None
    ):  # fmt: skip
        self.kind, self.socket, self.flag, self.disk = kind, socket, flag, disk
        self.tier = faults_tiers.TierFault(kind, target) if target is not None else None
        self.pid: int | None = None
        self.service_pid: int | None = None
        self.stopped = False

    def start(self) -> None:
        from kvtier.service import running_service

        found = running_service(self.socket)
        if found is None:
            raise FaultError(f"no kvtier service runs on {self.socket} to inject {self.kind} into")
        self.pid = self.service_pid = found[0]
        if self.tier is not None:  # a remote tier's process, or the NVMe mount's daemon (nvme-stop)
            self.tier.start()
            self.pid = self.tier.pid
        elif self.kind == "service-stop":
            os.kill(self.pid, signal.SIGSTOP)
            self.stopped = True
        elif self.kind == "service-kill":
            os.kill(self.pid, signal.SIGKILL)
        elif self.kind == READ_ERRORS and self.flag is not None:
            self.flag.touch()
        elif self.kind == DISK_FULL and self.disk is not None:
            self.disk.fill()
        else:
            raise FaultError(
                f"unknown fault {self.kind} (or {READ_ERRORS} without its flag, {self.kind} without its tier or disk)"
            )

    def end(self) -> None:
        self.release()

    def release(self) -> None:
        if self.stopped and self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
            self.stopped = False
        if self.flag is not None:
            self.flag.unlink(missing_ok=True)
        if self.disk is not None:
            self.disk.drain()
        if self.tier is not None:
            self.tier.release()


def read_error_mount(plan: dict[str, Any], row_dir: Path) -> Any:
    """The ``nvme-read-errors`` row's store directory (its NVMe tier's files) on a FUSE passthrough
    (``kvtier.bench.slowmount``, no rate limit) whose reads fail with EIO while ``row_dir/fail-reads``
    exists; started."""
    return faults_tiers.passthrough_mount(row_dir, "nvme-source", "store", row_dir / "fail-reads")


def row_mount(plan: dict[str, Any], row: str, row_dir: Path) -> Any:
    """The NVMe rows' store directory, started: a read-error passthrough (also ``nvme-stop``'s, whose
    daemon the fault stops), or a filesystem of its own to fill (``nvme-full``); None for the other rows."""
    if row in (READ_ERRORS, NVME_STOP):
        return read_error_mount(plan, row_dir)
    if row != DISK_FULL:
        return None
    disk = faults_disk.SmallDisk(row_dir, row_dir / "store", faults_disk.disk_bytes(plan["nvme_gib"]))
    try:
        disk.start()
    except BaseException:
        disk.close()
        raise
    return disk


def row_options(plan: dict[str, Any], row: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The plan and the extra store options of one row: the NVMe rows' DRAM tier cut to its
    ``READ_ERROR_DRAM_SLOTS`` staging slots (no ``dram_bytes``), so that repeats are read from NVMe; a
    remote tier's row as ``faults_tiers.row_options`` says."""
    if row in TIER_FAULTS:
        return faults_tiers.row_options(plan, row)
    if row not in (READ_ERRORS, NVME_STOP, DISK_FULL):
        return plan, {}
    extra = {"nvme_read_stall_ms": NVME_STALL_MS} if row == NVME_STOP else {}  # the default, pinned for the row
    return {**plan, "dram_gib": 0.0}, {"staging_slots": READ_ERROR_DRAM_SLOTS, **extra}


def engine_notes(log_path: Path, limit: int = 10) -> list[str]:
    """The engine's own lines about kvtier's host service in its log (calls failed: serving misses;
    reattached: serving hits again), the first ``limit``."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    marks = ("kvtier: host service", "kvtier: reattached", "kvtier: read of block")
    # Whole lines: vLLM's handler writes them with the process, level and time (kvtier.vllm.logs).
    return [line.strip()[:300] for line in text.splitlines() if any(mark in line for mark in marks)][:limit]


def wait_for_load(url: str, before: float, client: subprocess.Popen, timeout_s: float) -> float:
    """Waits until the server has seen the load's first request (vLLM's prefix-cache queries moved);
    returns the time (monotonic). The client exiting first ends the wait too."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and client.poll() is None:
        metrics = serve_points.cache_metrics([url])
        if metrics is not None and metrics["vllm_queried"] > before:
            return time.monotonic()
        time.sleep(POLL_S)
    return time.monotonic()


def inject(fault: Fault, plan: dict[str, Any], url: str, client: subprocess.Popen, record: dict[str, Any]) -> None:
    """The fault timeline of one row while its load runs: wait for the load, the fault for ``fault_s``,
    then the hits' return (polled until they rise or the load ends) and the faulted tier's reads from
    the fault's start to ``READS_SETTLE_S`` after its end. Fills ``record["fault"]``, with the load's start
    and the fault's start and end on ``time.monotonic()`` (``load_seen_at``, ``started_at``, ``ended_at``):
    CLOCK_MONOTONIC on Linux, the clock of vllm bench serve's per-request ``start_times``
    (``time.perf_counter()``), so that ``faults_plot`` places the fault among the requests."""
    before = (serve_points.cache_metrics([url]) or {}).get("vllm_queried", 0.0)
    load_seen = wait_for_load(url, before, client, LOAD_START_TIMEOUT_S)
    info: dict[str, Any] = {"kind": fault.kind, "seconds": plan["fault_s"], "hits_again_s": None}
    info["load_seen_at"] = round(load_seen, 3)
    record["fault"] = info
    time.sleep(max(0.0, load_seen + plan["fault_after_s"] - time.monotonic()))
    if client.poll() is not None:
        info["note"] = "the load ended before the fault started"
        return
    counters_before = faults_tiers.service_counters(fault.socket)
    info["hits_before"] = hits_of(fault.kind, counters_before)
    fault.start()
    started = time.monotonic()
    info["pid"], info["started_after_load_s"] = fault.pid, round(started - load_seen, 2)
    info["started_at"] = round(started, 3)
    if fault.disk is not None:
        info["free_bytes_after_fill"] = fault.disk.free_after_fill
    if fault.kind != "service-kill":  # a kill is over at once: the return is timed from it
        time.sleep(plan["fault_s"])
    ended = time.monotonic()  # a killed gateway's restart is part of the return
    info["ended_at"] = round(ended, 3)
    fault.end()
    if fault.tier is not None and fault.tier.restarted_pid is not None:
        info["gateway_restarted"] = fault.tier.restarted_pid
        info["gateway_restart_s"] = round(time.monotonic() - ended, 2)
    info["load_running_at_end"] = client.poll() is None
    reads = TierReads(fault.kind, counters_before, ended + faults_tiers.READS_SETTLE_S)
    info["hits_again_s"] = wait_for_hits(fault, client, info, reads)
    if info["hits_again_s"] is not None:
        info["hits_again_s"] = round(info["hits_again_s"] - ended, 2)
    if "reattached_at" in info:  # a killed service's successor: when the engine attached to it
        info["reattached_s"] = round(info["reattached_at"] - ended, 2)
    time.sleep(max(0.0, reads.at - time.monotonic()))
    reads.note(faults_tiers.service_counters(fault.socket))
    info["tier_reads"], info["tier_counters"] = reads.reads, reads.counters


class TierReads:
    """The faulted tier's reads from the fault's start (``before``: the service's counters then) to
    ``at`` (a second after its end: the reads the fault held have finished), taken once."""

    def __init__(self, kind: str, before: dict[str, int] | None, at: float):
        self.names, self.before, self.at = faults_tiers.read_counters(kind), before, at
        self.reads: int | None = None
        self.counters: dict[str, int] | None = None
        self.taken = not self.names  # the service's own faults: no tier of their own

    def note(self, counters: dict[str, int] | None) -> None:
        if self.taken or time.monotonic() < self.at:
            return
        self.taken = True
        self.reads = faults_tiers.delta(self.before, counters, self.names)
        if self.before is not None and counters is not None:
            self.counters = {name: counters[name] - self.before[name] for name in faults_tiers.STATS}


def wait_for_hits(fault: Fault, client: subprocess.Popen, info: dict[str, Any], reads: TierReads) -> float | None:
    """Polls the service until its hits rise (the time, monotonic) or the load ends (None); notes the
    tier's reads on the way. A service other than the faulted row's (restarted after a kill) counts
    from 0."""
    base: int | None = None
    while True:
        pid, counters = service_now(fault.socket)
        reads.note(counters)
        hits = hits_of(fault.kind, counters)
        if pid is not None and pid != fault.service_pid:
            info["service_restarted"] = pid
            base = 0
            if "reattached_at" not in info and faults_tiers.engines_attached(fault.socket):
                info["reattached_at"] = round(time.monotonic(), 3)
        elif base is None:
            base = hits
        if hits is not None and base is not None and hits > base:
            return time.monotonic()
        if client.poll() is not None:
            return None
        time.sleep(POLL_S)


# --------------------------------------------------------------------------------------------
# rows
# --------------------------------------------------------------------------------------------


def run_load(plan: dict[str, Any], row: str, url: str, out_dir: Path, fault: Fault | None, timeout_s: int) -> dict:
    """The load of one row (vllm bench serve as bench serve runs it) with the fault injected from a
    thread; the point's figures, the fault's timeline and the per-request outputs."""
    result_dir = out_dir / "bench"
    result_dir.mkdir(parents=True, exist_ok=True)
    model_dir = Path(plan["model_dir"])
    users, seed = plan["users"], plan["seed"]
    command = serve_points.bench_command(plan, url, plan["preset"], model_dir, users, seed, result_dir, f"{row}.json")
    log_path = result_dir / f"{row}.log"
    record: dict[str, Any] = {"command": command, "log": str(log_path)}
    errors: list[BaseException] = []
    with log_path.open("w") as log:
        client = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        injector = None
        if fault is not None:

            def timeline() -> None:
                try:
                    inject(fault, plan, url, client, record)
                except BaseException as error:  # reported by the row, after the load
                    errors.append(error)
                    fault.release()

            injector = threading.Thread(target=timeline, daemon=True)
            injector.start()
        try:
            returncode = client.wait(timeout=timeout_s)
        finally:
            if client.poll() is None:
                client.kill()
                client.wait()
            if injector is not None:
                injector.join(timeout=plan["fault_s"] + 30)
            if fault is not None:
                fault.release()
    if errors:
        raise errors[0]
    result_path = result_dir / f"{row}.json"
    if returncode != 0 or not result_path.exists():
        tail = log_path.read_text(errors="replace")[-2000:]
        raise serve_plan.BenchError(f"vllm bench serve failed (exit {returncode}) for {row}; {log_path}:\n{tail}")
    result = json.loads(result_path.read_text())
    record.update(serve_points.parse_result(result), result_file=str(result_path))
    record["outputs"] = result.get("generated_texts") or []
    record["request_errors"] = result.get("errors") or []
    record["input_lens"] = result.get("input_lens") or []
    return record


def run_row(
    plan: dict[str, Any], row: str, out_dir: Path, timeout_s: int, started: float, tiers: faults_tiers.Tiers
) -> dict[str, Any]:
    """One row: a fresh server (vLLM alone, or with kvtier on a store of its own), warmed up, the load
    with the row's fault; then the server, the service, the row's mount and the store gone. ``tiers``:
    the remote tiers (gateway, FUSE mount) of the rows that fault one."""
    from kvtier.service import default_socket_path

    row_dir = out_dir / row
    stores = [] if is_reference(row) else [row_dir / "store"]
    sockets = [default_socket_path(store) for store in stores]
    record: dict[str, Any] = {"row": row, "problems": []}
    server = mount = None
    record["service_log_from"] = faults_tiers.service_log_size(sockets[0]) if sockets else 0
    try:
        mount = row_mount(plan, row, row_dir)
        this_plan, options = row_options(plan, row)
        target = None
        if row in TIER_FAULTS:
            tier_options, target = tiers.open(row, row_dir)
            options.update(tier_options)
        server, log_path, _ = serve_servers.start_server(
            this_plan, KVTIER_ROW if stores else BASELINE_ROW, 0, row_dir, stores, [], options
        )  # fmt: skip
        record["server"] = {"command": serve_servers.command_of(server.process), "log": str(log_path)}
        progress(started, f"{row}: server healthy after {server.wait_healthy():.0f} s")
        serve_servers.warm_up(server, plan)
        flag = mount.fail_reads_flag if row == READ_ERRORS else None
        disk = mount if row == DISK_FULL else None
        target = faults_tiers.MountDaemon(mount) if row == NVME_STOP else target
        fault = Fault(row, sockets[0], flag, target, disk) if stores else None
        counters_before = faults_tiers.service_counters(sockets[0]) if sockets else None
        progress(started, f"{row}: load of {plan['users'] * plan['requests_per_user']} requests")
        record.update(run_load(plan, row, server.url, row_dir, fault, timeout_s))
        record["kvtier"] = load_hits(row, counters_before, sockets)
        record["engine_fallbacks"] = faults_tiers.engine_fallbacks(sockets[0]) if sockets else None
        progress(started, f"{row}: {record.get('completed')} completed, {record.get('failed')} failed")
    except Exception as error:
        record["problems"].append(f"{type(error).__name__}: {error}")
        print(f"kvtier bench faults: {row}: {error}", file=sys.stderr, flush=True)
    finally:
        tear_down_row(record, server, sockets, mount, tiers, row_dir, stores)
    return record


def load_hits(row: str, before: dict[str, int] | None, sockets: list[Path]) -> dict[str, int] | None:
    """kvtier's hits per tier over the row's load (a killed service's counters start again from 0)."""
    after = faults_tiers.service_counters(sockets[0]) if sockets else None
    if after is None:
        return None
    start = before if before is not None and row != "service-kill" else {}
    return {name: after[name] - start.get(name, 0) for name in HIT_COLUMNS}


def tear_down_row(
    record: dict[str, Any],
    server: Any,
    sockets: list[Path],
    mount: Any,
    tiers: faults_tiers.Tiers,
    row_dir: Path,
    stores: list[Path],
) -> None:
    """The row's server, service, mounts and store gone; what is left is a problem of the row."""
    from kvtier.service import stop_service

    if server is not None:
        server.stop()
        record["engine_notes"] = engine_notes(server.log_path)
    for socket in sockets:
        if not stop_service(socket):
            record["problems"].append(f"the kvtier service on {socket} did not stop")
        faults_tiers.keep_service_log(socket, record.pop("service_log_from", 0), row_dir / "logs")
    if mount is not None:
        mount.close()
        if os.path.ismount(mount.mountpoint):
            record["problems"].append(f"the row's mount {mount.mountpoint} is still mounted")
    record["problems"] += tiers.close_row(record["row"])
    for store in (*stores, row_dir / "nvme-source", row_dir / "shared-source", row_dir / "shared"):
        if not os.path.ismount(store):
            shutil.rmtree(store, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# judging and report
# --------------------------------------------------------------------------------------------


def judge(rows: list[dict[str, Any]], cleared: dict[str, frozenset[int]] | None = None) -> list[str]:
    """Counts each row's wrong outputs against the first row's (vLLM alone), leaving out the requests
    the runs of vLLM alone disagree on and the row's ``cleared`` ones (near ties), and lists the
    problems: a failed request, a wrong output, a fault not injected while the load ran, a row that did
    not run. Fills ``wrong_outputs`` (and ``near_ties``) per row."""
    reference = rows[0].get("outputs") if rows else None
    unstable = unstable_requests(rows)
    problems = []
    for record in rows:
        outputs = record.get("outputs")
        ties = (cleared or {}).get(record["row"], frozenset())
        if ties:
            record["near_ties"] = len(ties)
        if reference is not None and outputs is not None:
            errors = record.get("request_errors") or []
            record["wrong_outputs"] = wrong_outputs(reference, outputs, errors, unstable | ties)
        problems += [f"{record['row']}: {problem}" for problem in record.get("problems", [])]
        if record.get("failed"):
            problems.append(f"{record['row']}: {record['failed']} requests failed")
        if record.get("wrong_outputs"):
            problems.append(f"{record['row']}: {record['wrong_outputs']} outputs differ from vLLM alone's")
        if not is_reference(record["row"]) and "completed" in record and "pid" not in (record.get("fault") or {}):
            why = (record.get("fault") or {}).get("note", "no fault timeline")
            problems.append(f"{record['row']}: the fault was not injected under load ({why})")
        if "completed" not in record and not record.get("problems"):
            problems.append(f"{record['row']}: not measured")
    return problems


def tie_check(
    plan: dict[str, Any], rows: list[dict[str, Any]], args: argparse.Namespace, out_dir: Path, started: float
) -> tuple[dict[str, frozenset[int]], dict[str, Any] | None]:
    """The near-tie check (kvtier.bench.faults_ties) of the outputs that differ from vLLM alone's, on a
    server of its own; nothing to check, or --no-tie-check: nothing cleared and no record."""
    todo = faults_ties.differing(rows, unstable_requests(rows))
    if not todo or args.no_tie_check:
        return {}, None
    count = sum(len(found) for found in todo.values())
    progress(started, f"near-tie check of {count} outputs that differ from vLLM alone's")
    try:
        return faults_ties.run_check(plan, rows, todo, out_dir, args.tie_nats)
    except Exception as error:  # the check only clears: without it every difference stays wrong
        return {}, {"problems": [f"the near-tie check failed ({type(error).__name__}: {error}): nothing cleared"]}


def untouched(rows: list[dict[str, Any]]) -> list[str]:
    """Notes (not problems: the load decides when repeats come) for each row whose fault touched no read
    of its tier: such a row checked the rest of the engine under the fault, not the tier's failure."""
    notes = []
    for record in rows:
        fault = record.get("fault") or {}
        if fault.get("tier_reads") == 0:
            notes.append(
                f"{record['row']}: the fault touched no read of its tier (no load of a block it held began "
                "during the fault): the row checked nothing of that tier's failure"
            )
    return notes


def tier_reads_cell(record: dict[str, Any]) -> str:
    fault = record.get("fault") or {}
    if record["row"] not in faults_tiers.TIER_OF or not fault:
        return "-"
    reads = fault.get("tier_reads")
    cell = "unknown" if reads is None else (NO_TIER_READ if reads == 0 else str(reads))
    counters = fault.get("tier_counters")
    if record["row"] == DISK_FULL and counters:  # a full disk is about writes: did the NVMe tier's go on?
        written_mib = counters["bytes_written_nvme"] / (1 << 20)
        cell += f"; {written_mib:.0f} MiB written, {counters['io_errors']} I/O errors"
    return cell


def fallbacks_cell(record: dict[str, Any]) -> str:
    """Service calls that failed (and, in parentheses, those answered unsent while the service stepped
    aside), loads and store blocks the engine gave up or skipped (recomputed or not stored), as it
    reported them by the end of the load."""
    counts = record.get("engine_fallbacks")
    if not counts:
        return "-"
    loads = counts["given_up_loads"] + counts["skipped_loads"]
    stores = counts["given_up_stores"] + counts["skipped_store_blocks"]
    unsent = counts.get("stepped_aside_calls", 0)  # results of runs before the split lack it
    calls = f"{counts['failed_calls']} (+{unsent} unsent)" if unsent else str(counts["failed_calls"])
    return f"{calls} / {loads} / {stores}"


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    lines = []
    for record in rows:
        ttft = record.get("ttft_ms") or {}
        fault = record.get("fault") or {}
        hits = record.get("kvtier") or {}
        reference = is_reference(record["row"])
        again = "-" if reference else _number(fault.get("hits_again_s"), 1)
        if not reference and fault and fault.get("hits_again_s") is None:
            again = "not during the run"
        if fault.get("reattached_s") is not None:
            again += f" (reattached {fault['reattached_s']:.1f})"
        label = f"kvtier, {record['row']}"
        if reference:
            label = "vLLM alone" if record["row"] == BASELINE_ROW else f"vLLM alone, run {record['row'].split('-')[-1]}"
        lines.append([
            label,
            str(record.get("completed", "-")), str(record.get("failed", "-")), wrong_cell(record),
            _number(record.get("request_throughput")), _number(record.get("output_throughput"), 1),
            _number(ttft.get("p50"), 0), _number(ttft.get("p99"), 0), faults_plot.in_fault_cell(record), again,
            str(hits.get("dram_hits", "-")), str(hits.get("nvme_hits", "-")),
            str(hits.get("bucket_hits", 0) + hits.get("shared_hits", 0)) if hits else "-", tier_reads_cell(record),
            fallbacks_cell(record),
        ])  # fmt: skip
    return lines


def progress(started: float, message: str) -> None:
    print(f"[faults {time.monotonic() - started:6.0f} s] {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.recheck:
        return recheck(Path(args.recheck).absolute(), args)
    try:
        plan = make_plan(args)
        serve_points.check_vllm_command()
    except (FaultError, serve_plan.BenchError, ValueError) as error:
        print(f"kvtier bench faults: {error}", file=sys.stderr)
        return 2
    from kvtier.models import ensure_bench_model

    out_dir = Path(args.out or tempfile.mkdtemp(prefix="kvtier-bench-faults-")).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    plan["model_dir"] = str(ensure_bench_model(plan["preset"]))
    started = time.monotonic()
    document: dict[str, Any] = {"benchmark": "kvtier bench faults", "settings": plan, "rows": []}
    print(
        f"kvtier bench faults: {plan['preset']}, {plan['users']} users x {plan['requests_per_user']} requests at "
        f"{plan['request_rate']:.2f} req/s, faults {', '.join(plan['faults'])} of {plan['fault_s']:g} s\n"
        f"results {out_dir}",
        flush=True,
    )
    with serve.own_runtime_dir(), faults_tiers.Tiers(plan, lambda message: progress(started, message)) as tiers:
        for row in plan["rows"]:
            document["rows"].append(run_row(plan, row, out_dir, args.point_timeout_s, started, tiers))
            (out_dir / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    return finish(document, args, out_dir, started)


def recheck(out_dir: Path, args: argparse.Namespace) -> int:
    """``--recheck DIR``: the outputs of a finished run judged again (the near-tie check with this
    run's ``--tie-nats``), its table and results rewritten."""
    path = out_dir / "results.json"
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        print(f"kvtier bench faults: --recheck: cannot read {path} ({error})", file=sys.stderr)
        return 2
    for record in document["rows"]:
        record.pop("near_ties", None)
        saved = Path(record.get("result_file") or out_dir / "missing")
        if "input_lens" not in record and saved.exists():  # a run from before they were kept
            record["input_lens"] = json.loads(saved.read_text()).get("input_lens") or []
    return finish(document, args, out_dir, time.monotonic())


def finish(document: dict[str, Any], args: argparse.Namespace, out_dir: Path, started: float) -> int:
    """The run's judgement (outputs checked for near ties), notes, table, plot and results."""
    plan = document["settings"]
    with serve.own_runtime_dir():
        cleared, document["tie_check"] = tie_check(plan, document["rows"], args, out_dir, started)
    document["problems"] = judge(document["rows"], cleared)
    document["problems"] += (document["tie_check"] or {}).get("problems", [])
    document["notes"] = untouched(document["rows"])
    unstable = unstable_requests(document["rows"])
    document["unstable_requests"] = sorted(unstable)
    if unstable:
        document["notes"].append(
            f"{len(unstable)} of {plan['users'] * plan['requests_per_user']} requests gave different outputs in the "
            "runs of vLLM alone: left out of wrong outputs (the model's greedy choices nearly tie)"
        )
    faults_plot.note_in_fault_ttfts(document, out_dir)
    table = markdown_table(TABLE_HEADER, table_rows(document["rows"]))
    (out_dir / "table.md").write_text(table + "\n")
    document["plot"] = faults_plot.plot_run(document, out_dir)  # None, with a warning, when not drawn
    (out_dir / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    print(table)
    for line in [f"note: {note}" for note in document["notes"]] + [f"problem: {p}" for p in document["problems"]]:
        print(line)
    plot = f", plot: {out_dir / document['plot']}" if document["plot"] else ""
    print(f"results: {out_dir / 'results.json'}{plot}")
    return 1 if document["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
