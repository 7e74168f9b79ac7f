"""The NVMe tier's I/O pattern (seed 002's experiment 6) from kvtier's own counters: request size
classes, sequential against random, read:write ratio.

The store counts every request its device queues submit (``nvme_read_*`` / ``nvme_write_*`` in
``Store.stats()``, the service's stats, and ``kvtier_nvme_request_bytes`` / ``kvtier_nvme_requests``
in Prometheus). A request is sequential when it starts where the same device's previous request of
the same kind ended. ``kvtier bench ttft`` reports the pattern of each kvtier phase of a real vLLM
run; ``tests/test_io_pattern.py`` checks the counters against the syscalls strace sees.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.ops.metrics import IO_SIZE_CLASSES

KINDS = ("read", "write")
# Size classes shown in reports: the counters' classes, merged where a KV workload has nothing.
REPORT_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("<=256K", ("4k", "16k", "64k", "256k")),
    ("<=4M", ("1m", "4m")),
    ("<=16M", ("16m",)),
    ("<=64M", ("64m",)),
    (">64M", ("gt_64m",)),
)


def pattern_of(stats: Mapping[str, Any]) -> dict[str, Any]:
    """Per kind (``read``, ``write``): requests, bytes, mean request bytes, sequential share, and
    requests per size class (keys as in ``REPORT_CLASSES``); plus the read:write byte ratio."""
    pattern: dict[str, Any] = {}
    for kind in KINDS:
        requests = int(stats.get(f"nvme_{kind}_requests", 0))
        request_bytes = int(stats.get(f"nvme_{kind}_request_bytes", 0))
        classes = {suffix: int(stats.get(f"nvme_{kind}s_le_{suffix}", 0)) for _, suffix in IO_SIZE_CLASSES}
        classes["gt_64m"] = int(stats.get(f"nvme_{kind}s_gt_64m", 0))
        pattern[kind] = {
            "requests": requests,
            "bytes": request_bytes,
            "mean_request_bytes": request_bytes / requests if requests else None,
            "sequential_share": int(stats.get(f"nvme_{kind}_sequential", 0)) / requests if requests else None,
            "classes": {label: sum(classes[s] for s in suffixes) for label, suffixes in REPORT_CLASSES},
        }
    written = pattern["write"]["bytes"]
    pattern["read_write_byte_ratio"] = pattern["read"]["bytes"] / written if written else None
    return pattern


def pattern_rows(patterns: Mapping[str, Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """A table: one row per (name, kind) with requests; header and rows as strings."""
    header = ["phase", "op", "requests", "MiB", "mean KiB", "sequential", *(label for label, _ in REPORT_CLASSES)]
    rows = []
    for name, pattern in patterns.items():
        for kind in KINDS:
            p = pattern[kind]
            if not p["requests"]:
                continue
            rows.append(
                [
                    name,
                    kind,
                    str(p["requests"]),
                    f"{p['bytes'] / 2**20:.0f}",
                    f"{p['mean_request_bytes'] / 1024:.0f}",
                    f"{100 * p['sequential_share']:.0f}%",
                    *(str(p["classes"][label]) for label, _ in REPORT_CLASSES),
                ]
            )
    return header, rows
