"""CPU time a `kvtier bench serve` point cost, from ``/proc``: where throughput on a shared machine is
too noisy to show a few percent, the CPU kvtier takes from the engine is not.

Per point, in core-seconds:

- ``server_s``: every process of the row's ``vllm serve`` servers (the API server, its engine core and
  workers), kvtier's code inside them included;
- ``engine_kvtier_threads_s``: the threads of those processes that kvtier started (named ``kvtier*``:
  the workers' copy jobs, the prefetcher, the event feed, the Rust core's threads of an in-process
  store). A lower bound of kvtier's share there: its lookups and stores called on vLLM's own threads
  count as vLLM's;
- ``service_s``: the host service's process (``kvtier serve``), all of it kvtier's.

A thread that ended during the point is in its process's figure but not in the thread figure.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_PROC = Path("/proc")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
KVTIER_THREAD_PREFIX = "kvtier"


def _stat(path: Path) -> tuple[str, int, int] | None:
    """``(comm, ppid, utime + stime in ticks)`` from a ``stat`` file; None once it is gone."""
    try:
        text = path.read_text()
    except OSError:  # the process or thread ended
        return None
    # The name sits in parentheses and may hold any byte, ")" too: the fields follow the last ")".
    name_end = text.rfind(")")
    fields = text[name_end + 2 :].split()
    # fields[0] is the state (stat's field 3): ppid is field 4, utime 14, stime 15.
    return text[text.find("(") + 1 : name_end], int(fields[1]), int(fields[11]) + int(fields[12])


def process_tree(roots: Iterable[int]) -> list[int]:
    """``roots`` and every live descendant of theirs."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (stat := _stat(entry / "stat")) is not None:
            children.setdefault(stat[1], []).append(int(entry.name))
    found, todo = [], [pid for pid in roots if (_PROC / str(pid)).exists()]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return sorted(set(found))


def _process_ticks(pids: Iterable[int]) -> int:
    return sum(stat[2] for pid in pids if (stat := _stat(_PROC / str(pid) / "stat")) is not None)


def _kvtier_threads(pids: Iterable[int]) -> tuple[int, int]:
    """How many of the processes' threads are kvtier's, and their CPU ticks."""
    count = ticks = 0
    for pid in pids:
        try:
            tasks = list((_PROC / str(pid) / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            stat = _stat(task / "stat")
            if stat is not None and stat[0].startswith(KVTIER_THREAD_PREFIX):
                count, ticks = count + 1, ticks + stat[2]
    return count, ticks


def snapshot(server_pids: Iterable[int], service_pids: Iterable[int]) -> dict[str, float]:
    """The CPU seconds used so far by the servers' process trees, kvtier's threads in them, and the
    services' processes; and how many kvtier threads the servers run now (``engine_kvtier_threads``)."""
    servers = process_tree(server_pids)
    threads, thread_ticks = _kvtier_threads(servers)
    return {
        "server_s": _process_ticks(servers) / _TICKS_PER_S,
        "engine_kvtier_threads_s": thread_ticks / _TICKS_PER_S,
        "service_s": _process_ticks(service_pids) / _TICKS_PER_S,
        "engine_kvtier_threads": threads,
    }


def delta(before: dict[str, float], after: dict[str, float], requests: int) -> dict[str, Any]:
    """A point's CPU seconds (``after - before``) and each per request; the kvtier threads at its end."""
    used = {name: round(max(0.0, after[name] - before[name]), 3) for name in before if name.endswith("_s")}
    per_request = {name: round(value / max(1, requests), 4) for name, value in used.items()}
    return {**used, "engine_kvtier_threads": after["engine_kvtier_threads"], "per_request": per_request}
