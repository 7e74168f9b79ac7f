"""kvtier's threads in an engine's processes, named where the OS shows them.

Python (before 3.14) keeps a ``threading.Thread``'s name to itself: ``top -H``, ``ps -L``, ``py-spy``
and ``/proc/<pid>/task/*/comm`` show every thread of a vLLM process as the process. A thread started
with ``start_thread`` names its OS thread too (Linux keeps 15 bytes: ``kvtier-worker-j``), so an
operator sees which threads are kvtier's and ``kvtier bench serve`` counts their CPU
(``kvtier.bench.cpu_account``).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

_PR_SET_NAME = 15
# Linux's thread names hold 15 bytes and a NUL.
_OS_NAME_BYTES = 15


def _name_this_os_thread(name: str) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:_OS_NAME_BYTES], 0, 0, 0)
    except (AttributeError, OSError):  # no prctl (not Linux): the name stays Python's only
        pass


def start_thread(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """Starts a daemon thread running ``target(*args)``, named ``name`` in Python and in the OS."""

    def run() -> None:
        _name_this_os_thread(name)
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
