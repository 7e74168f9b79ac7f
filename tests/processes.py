"""Helpers for tests that freeze processes on purpose (SIGSTOP), as an operator or a fault would."""

from __future__ import annotations

import time
from pathlib import Path


def wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Until every thread of ``pid`` is stopped: a signal is delivered asynchronously, and a thread
    running on another core may still answer a request sent right after ``kill``."""
    deadline = time.monotonic() + timeout_s
    while True:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in tasks]
        if all(state in ("T", "t") for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.005)
