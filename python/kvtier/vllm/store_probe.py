"""Whether a store's directories answer: ``StoreProbe``, and how long an engine's start waits on them.

Both layouts open a store at an engine's start, the host service at the engine's first hello and the
one-process layout in the engine itself. On a frozen mount (a FUSE daemon stopped, an NFS server gone)
that open waits for as long as the mount does; the start waits for it within limits, then the engine
serves misses and takes the store up once it opens.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from kvtier.threads import start_thread

# How long an engine's start waits for its store (its first attach to the host service, or its own
# open): past it the engine starts serving misses and takes the store up once it answers.
ATTACH_AT_START_WAIT_S = 30.0
# While it waits, the start looks this often for a reason the open cannot finish soon.
START_CHECK_INTERVAL_S = 0.5
# A store directory that has not answered a lookup for this long is taken for a frozen or hung
# filesystem: the start stops waiting for an open that waits on it.
STORE_PROBE_WAIT_S = 5.0


class StoreProbe:
    """Looks up a name no cache holds in each store directory, on a thread of its own: unlike a
    stat of a known path (which the kernel's attribute cache may answer), the lookup waits for the
    filesystem itself. A directory that does not answer keeps the thread until it does."""

    def __init__(self, directories: list[str]) -> None:
        self.started = time.monotonic()
        self.waiting_on: str | None = directories[0] if directories else None
        self._answered = threading.Event()

        def probe() -> None:
            for directory in directories:
                self.waiting_on = directory
                with contextlib.suppress(OSError):  # any answer (no such file, most likely) will do
                    os.stat(os.path.join(directory, f".kvtier-probe-{uuid.uuid4().hex}"))
            self.waiting_on = None
            self._answered.set()

        start_thread(probe, "kvtier-probe")

    def answered(self) -> bool:
        return self._answered.is_set()

    def unanswered_after(self, wait_s: float) -> bool:
        """Whether a directory has not answered for ``wait_s`` since the probe started."""
        return not self._answered.is_set() and time.monotonic() - self.started >= wait_s

    def silence(self) -> str:
        """What the probe found, for a log line: the directory that did not answer."""
        return self.silence_of(self.waiting_on)

    @staticmethod
    def silence_of(directory: str | None) -> str:
        return (
            f"the store directory {directory} did not answer within {STORE_PROBE_WAIT_S:g} s at start (a frozen "
            "or hung filesystem?)"
        )


# The probe of each set of store directories still waiting for an answer, by the directories: a
# second start in this process (the scheduler's connection after the worker's, on the frozen mount
# the first found) takes it up instead of waiting STORE_PROBE_WAIT_S again. Under ``_probes_lock``.
_probes: dict[tuple[str, ...], StoreProbe] = {}
_probes_lock = threading.Lock()


def probe_of(directories: list[str]) -> StoreProbe:
    """A probe of ``directories``: the one under way in this process if it has not been answered yet
    (counted from its own start), else a new one."""
    with _probes_lock:
        probe = _probes.get(tuple(directories))
        if probe is None or probe.answered():
            probe = _probes[tuple(directories)] = StoreProbe(directories)
        return probe


def store_directories(path: Any) -> list[str]:
    """The store's directories (``path``: one, or a list)."""
    paths = path if isinstance(path, (list, tuple)) else [path]
    return [os.fspath(each) for each in paths]


def wait_at_start(
    done: threading.Event,
    directories: list[str],
    timed_out: str,
    in_vain: Callable[[], str],
    silence_note: str = "",
    limit_s: float | None = None,
) -> str:
    """Waits for ``done`` (an open, a first attach), ``limit_s`` at most (``ATTACH_AT_START_WAIT_S``
    by default), and less once it is known to wait in vain: ``in_vain()`` names a reason (a stopped
    service), or a store directory does not answer a lookup for ``STORE_PROBE_WAIT_S`` (said with
    ``silence_note`` after it), counted from an earlier start's probe still unanswered in this
    process (``probe_of``). Returns why it stopped waiting (``timed_out`` past the limit), or "" once
    ``done`` is set."""
    deadline = time.monotonic() + (ATTACH_AT_START_WAIT_S if limit_s is None else limit_s)
    probe: StoreProbe | None = None
    while not done.wait(max(0.0, min(START_CHECK_INTERVAL_S, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            return timed_out
        why_not = in_vain()
        if why_not:
            return why_not
        if probe is None:
            probe = probe_of(directories)
        if probe.unanswered_after(STORE_PROBE_WAIT_S):
            return probe.silence() + silence_note
    return ""
