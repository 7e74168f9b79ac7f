"""``kvtier serve`` as an operator runs it, in its own process, for tests: a store, its socket, the
options, a metrics port on 127.0.0.1; scraped and stopped with SIGTERM."""

from __future__ import annotations

import signal
import socket as socketlib
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServedStore:
    """``kvtier serve ROOT/store --socket ROOT/svc.sock --pool-dir ROOT --metrics-port PORT`` with
    ``options``, ready (its socket there and its metrics answering) when the constructor returns."""

    def __init__(self, root: Path, options: dict[str, Any], start_timeout_s: float = 60) -> None:
        self.path = root / "store"
        self.socket = root / "svc.sock"
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvtier", "serve", str(self.path), "--socket", str(self.socket)]
            + [f"--option={name}={value}" for name, value in options.items()]
            + ["--pool-dir", str(root), "--metrics-port", str(self.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + start_timeout_s
        while not self.socket.exists() or not self._scrape_ok():
            assert self.process.poll() is None, self.process.communicate()[0]
            assert time.monotonic() < deadline, "kvtier serve did not start"
            time.sleep(0.2)

    def _scrape_ok(self) -> bool:
        try:
            self.scrape()
            return True
        except OSError:
            return False

    def scrape(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as reply:
            return str(reply.read().decode())

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)


def engine_counts(socket: str | Path, label: str) -> dict[str, int]:
    """The service's counters of the engine named ``label`` (in its only namespace), as ``kvtier top``
    and the metrics read them; empty when it has none."""
    from kvtier.ops.metrics import ServiceSnapshot

    (namespace,), _ = ServiceSnapshot(socket).read()
    return dict(namespace.get("engines", [])).get(label, {})
