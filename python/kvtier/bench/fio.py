"""fio as the physical limit: O_DIRECT io_uring sequential read and write on a file beside the store.

This module owns running fio and reading its JSON. One measurement is a set of (block size, iodepth)
combinations chosen to put about the same number of bytes in flight as a store moving objects of a
given size; the best read and the best write of a set are that moment's physical limit, to which the
other systems of the same repeat are compared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import shutil
import subprocess

from . import workload


class FioError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class FioCombo:
    block_bytes: int
    iodepth: int
    jobs: int = 1  # threads, each with its own ring, over disjoint parts of the file

    @property
    def inflight_bytes(self) -> int:
        return self.block_bytes * self.iodepth * self.jobs

    def label(self) -> str:
        jobs = f" x{self.jobs} jobs" if self.jobs > 1 else ""
        return f"bs={workload.format_bytes(self.block_bytes)} qd={self.iodepth}{jobs}"


def fio_path() -> str | None:
    return shutil.which("fio")


def fio_version() -> str | None:
    path = fio_path()
    if not path:
        return None
    completed = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    return completed.stdout.strip() or None


def missing_fio_message() -> str:
    return "fio is not installed: install it (`apt-get install -y fio`) or pass --no-fio"


def combos_for(object_bytes: int, inflight_bytes: int) -> list[FioCombo]:
    """A few ways to keep ``inflight_bytes`` in flight: object-sized requests from one ring, 1 MiB
    requests from one ring, and 1 MiB requests from four threads (a virtio disk has one queue per
    vCPU, so one submitting thread may not reach the disk's limit)."""
    candidates = [
        FioCombo(object_bytes, max(1, inflight_bytes // object_bytes)),
        FioCombo(workload.MIB, max(1, inflight_bytes // workload.MIB)),
        FioCombo(workload.MIB, max(1, inflight_bytes // (4 * workload.MIB)), jobs=4),
    ]
    combos: list[FioCombo] = []
    for combo in candidates:
        if combo not in combos:
            combos.append(combo)
    return combos


def run_fio_job(filename: str, size_bytes: int, rw: str, combo: FioCombo, timeout_s: float = 600.0) -> dict:
    """Run one fio job (``combo.jobs`` threads over disjoint slices of ``size_bytes``); return bytes,
    seconds, GB/s and CPU core-seconds: fio's own usr+sys figures, and the rusage of the fio process."""
    path = fio_path()
    if not path:
        raise FioError(missing_fio_message())
    slice_bytes = size_bytes // combo.jobs // combo.block_bytes * combo.block_bytes
    slice_bytes = max(combo.block_bytes, slice_bytes)
    command = [
        path,
        "--name=kvtier-bench",
        f"--filename={filename}",
        f"--size={slice_bytes}",
        f"--offset_increment={slice_bytes}",
        f"--numjobs={combo.jobs}",
        f"--rw={rw}",
        f"--bs={combo.block_bytes}",
        f"--iodepth={combo.iodepth}",
        "--direct=1",
        "--ioengine=io_uring",
        "--thread",
        "--output-format=json",
    ]
    usage_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    usage_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if completed.returncode != 0:
        raise FioError(
            f"fio {rw} {combo.label()} on {filename} failed (exit {completed.returncode}): "
            f"{completed.stderr.strip() or completed.stdout.strip()[:500]}. If io_uring is disabled "
            "(sysctl kernel.io_uring_disabled) or O_DIRECT unsupported on this file system, pass --no-fio "
            "or use --dir on another file system"
        )
    text = completed.stdout
    # fio may print warnings before the JSON document.
    report = json.loads(text[text.index("{") :])
    direction_name = "read" if rw in ("read", "randread") else "write"
    io_bytes = 0
    runtime_s = 0.0
    reported_cpu_seconds = 0.0
    for job in report["jobs"]:
        direction = job[direction_name]
        io_bytes += direction["io_bytes"]
        runtime_s = max(runtime_s, direction["runtime"] / 1000.0)
        job_runtime_s = job.get("job_runtime", direction["runtime"]) / 1000.0
        reported_cpu_seconds += (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * job_runtime_s
    if runtime_s <= 0 or io_bytes <= 0:
        raise FioError(f"fio {rw} {combo.label()} moved no data: {text[:500]}")
    process_cpu_seconds = (usage_after.ru_utime - usage_before.ru_utime) + (
        usage_after.ru_stime - usage_before.ru_stime
    )
    return {
        "rw": rw,
        "block_bytes": combo.block_bytes,
        "iodepth": combo.iodepth,
        "jobs": combo.jobs,
        "inflight_bytes": combo.inflight_bytes,
        "bytes": io_bytes,
        "seconds": runtime_s,
        "gbps": io_bytes / runtime_s / 1e9,
        "cpu_seconds": reported_cpu_seconds,
        "process_cpu_seconds": process_cpu_seconds,
    }


DEFAULT_MAX_SIZE_BYTES = 4 * workload.GIB


def measure_limits(
    filename: str,
    size_bytes: int,
    object_bytes: int,
    inflight_bytes: int,
    max_size_bytes: int = DEFAULT_MAX_SIZE_BYTES,
) -> dict:
    """Write then read ``size_bytes`` (at most ``max_size_bytes``: enough for a steady rate) of
    ``filename`` with every combo; keep the best of each direction.

    The writes come first so the reads find written (not sparse) extents.
    """
    size_bytes = min(size_bytes, max_size_bytes)
    combos = combos_for(object_bytes, inflight_bytes)
    runs = []
    for rw in ("write", "read"):
        for combo in combos:
            runs.append(run_fio_job(filename, size_bytes, rw, combo))
    best_write = max((run for run in runs if run["rw"] == "write"), key=lambda run: run["gbps"])
    best_read = max((run for run in runs if run["rw"] == "read"), key=lambda run: run["gbps"])
    return {"runs": runs, "best_write": best_write, "best_read": best_read}


def remove_test_file(filename: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(filename)
