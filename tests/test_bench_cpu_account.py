"""`kvtier bench serve`'s CPU account (``kvtier.bench.cpu_account``) on real processes: a parent whose
child burns CPU on a thread named as kvtier names its threads, and one named otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from kvtier.bench import cpu_account

# A parent (waits), its child: told to go, a thread named "kvtier-test" and one named "other" each burn
# about BURN_S of CPU, then the child sleeps until killed.
BURN_S = 0.6
CHILD = textwrap.dedent(
    f"""
    import ctypes, sys, threading, time
    sys.stdin.readline()
    burnt = threading.Barrier(3)
    def burn(name):
        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME: the thread's comm
        end = time.thread_time() + {BURN_S}
        while time.thread_time() < end:
            pass
        burnt.wait()
        time.sleep(60)  # alive when counted, as kvtier's threads are
    for name in (b"kvtier-test", b"other"):
        threading.Thread(target=burn, args=(name,), daemon=True).start()
    burnt.wait()
    print("burnt", flush=True)
    time.sleep(60)
    """
)


def test_a_process_tree_and_its_kvtier_threads_are_counted_apart():
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {CHILD!r}])"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the child goes with the parent's group
    )
    assert parent.stdin is not None and parent.stdout is not None
    try:
        deadline = time.monotonic() + 30
        while len(tree := cpu_account.process_tree([parent.pid])) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert parent.pid in tree and len(tree) == 2, tree
        child = next(pid for pid in tree if pid != parent.pid)
        before = cpu_account.snapshot([parent.pid], [child])
        parent.stdin.write("go\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "burnt"
        used = cpu_account.delta(before, cpu_account.snapshot([parent.pid], [child]), requests=2)
        # The kvtier thread's burn alone; the tree's and the child's, both threads' (ticks are 10 ms).
        assert BURN_S - 0.15 <= used["engine_kvtier_threads_s"] <= BURN_S + 0.25, used
        assert used["server_s"] >= 2 * BURN_S - 0.3 and used["service_s"] >= 2 * BURN_S - 0.3, used
        assert used["per_request"]["server_s"] == round(used["server_s"] / 2, 4)
        assert used["engine_kvtier_threads"] == 1, used
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_a_gone_process_counts_nothing():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert cpu_account.process_tree([process.pid]) == []
    assert cpu_account.snapshot([process.pid], [process.pid]) == {
        "server_s": 0.0,
        "engine_kvtier_threads_s": 0.0,
        "service_s": 0.0,
        "engine_kvtier_threads": 0,
    }


def test_kvtiers_python_threads_carry_their_name_in_the_os():
    """What the account counts as kvtier's threads in an engine: ``kvtier.threads.start_thread`` names
    the OS thread (Python's own name stays in Python before 3.14)."""
    from kvtier.threads import start_thread

    ready, done = threading.Event(), threading.Event()

    def wait() -> None:
        ready.set()
        done.wait(30)

    thread = start_thread(wait, "kvtier-worker-jobs")
    try:
        assert ready.wait(30) and thread.native_id is not None
        comm = Path(f"/proc/self/task/{thread.native_id}/comm").read_text().strip()
        assert comm == "kvtier-worker-jobs"[:15] and comm.startswith(cpu_account.KVTIER_THREAD_PREFIX)
        assert thread.name == "kvtier-worker-jobs" and thread.daemon
    finally:
        done.set()
        thread.join(30)
