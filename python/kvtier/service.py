"""The host service: ``kvtier serve`` and how engines find (or start) it.

One service per host and store path owns the stores (catalog, NVMe and shared tiers) and their DRAM
pools in shared memory (docs/architecture.md). Engines connect to its Unix socket; the first engine
that finds none running starts one (``ensure_service``), so nothing extra is needed to get going. It
can also run on its own (a systemd unit, a Kubernetes sidecar)::

    kvtier serve /mnt/nvme/kvtier --option dram_bytes=8589934592 --option nvme_bytes=68719476736

The socket defaults to ``$XDG_RUNTIME_DIR/kvtier/<digest of the store path>.sock`` (``/tmp/kvtier-<uid>/``
without ``XDG_RUNTIME_DIR``), so every engine configured with the same ``path`` finds the same service.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier._core import Service, ServiceClient
from kvtier.errors import ServiceError

DEFAULT_POOL_DIR = "/dev/shm"
# How long an engine waits for a service it started to answer.
SERVICE_START_TIMEOUT_S = 120.0
SERVICE_LOG_NAME = "service.log"


def _paths(path: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    if isinstance(path, (list, tuple)):
        return [os.path.realpath(os.fspath(p)) for p in path]
    return [os.path.realpath(os.fspath(path))]  # type: ignore[arg-type]  # a str or os.PathLike here


def default_socket_path(path: str | os.PathLike | Sequence[str | os.PathLike]) -> Path:
    """The socket of the service for the store at ``path`` (one or several directories)."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime_dir) / "kvtier" if runtime_dir else Path(f"/tmp/kvtier-{os.getuid()}")
    digest = hashlib.sha256("\0".join(_paths(path)).encode()).hexdigest()[:16]
    return base / f"{digest}.sock"


def connect(socket_path: str | os.PathLike, timeout_ms: int = 10_000) -> ServiceClient:
    return ServiceClient.connect(os.fspath(socket_path), timeout_ms)


def service_command(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    socket_path: str | os.PathLike,
    options: Mapping[str, Any],
    pool_dir: str = DEFAULT_POOL_DIR,
) -> list[str]:
    command = [sys.executable, "-m", "kvtier", "serve", *_paths(path), "--socket", os.fspath(socket_path)]
    command += ["--pool-dir", pool_dir]
    if options:
        command += ["--options-json", json.dumps(dict(options))]
    return command


def ensure_service(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    options: Mapping[str, Any] | None = None,
    socket_path: str | os.PathLike | None = None,
    pool_dir: str = DEFAULT_POOL_DIR,
    start_timeout_s: float = SERVICE_START_TIMEOUT_S,
) -> Path:
    """The socket of a running service for ``path``, starting one if none answers.

    Engines racing to start it take a lock next to the socket, so one service starts. A service
    started here runs in its own session and outlives the engine that started it; its log is
    ``service.log`` next to the socket. A running service keeps the options it was started with.
    """
    socket = Path(socket_path) if socket_path else default_socket_path(path)
    if _answers(socket):
        return socket
    socket.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(socket.with_suffix(".lock"), "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if _answers(socket):
            return socket
        log_path = socket.parent / SERVICE_LOG_NAME
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                service_command(path, socket, options or {}, pool_dir),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            if _answers(socket):
                return socket
            if process.poll() is not None:
                break
            time.sleep(0.05)
        with contextlib.suppress(Exception):
            if process.poll() is None:
                process.kill()
        raise ServiceError(
            f"kvtier service for {path} did not start (exit status {process.poll()}); its log "
            f"{log_path} ends with:\n{_tail(log_path)}"
        )


def _answers(socket: Path) -> bool:
    if not socket.exists():
        return False
    try:
        client = connect(socket, timeout_ms=2_000)
        client.stats()
        return True
    except Exception:
        return False


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def service_stats(socket_path: str | os.PathLike) -> dict[str, int]:
    """Counters and gauges of every store the service holds, summed."""
    return dict(connect(socket_path).stats())


# --------------------------------------------------------------------------------------------
# kvtier serve
# --------------------------------------------------------------------------------------------


def _parse_option(text: str) -> tuple[str, Any]:
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--option takes NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(raw)
    except json.JSONDecodeError:
        return name, raw


def usable_cores() -> set[int]:
    """Every core of this machine. Setting an affinity to it gives a thread every core its cgroup
    allows (the kernel intersects the two)."""
    return set(range(os.cpu_count() or 1))


def widen_affinity() -> None:
    """An engine's worker that starts the service runs bound to its OpenMP core, and a child inherits
    that binding: the service would then share one core with the engine's compute. Threads the
    service starts later inherit what is set here."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, usable_cores())


def main(argv: Sequence[str] | None = None) -> int:
    widen_affinity()
    parser = argparse.ArgumentParser(
        prog="kvtier serve",
        description="Run the kvtier host service for a store path until SIGTERM or SIGINT.",
    )
    parser.add_argument("path", nargs="+", help="store directories (the engines' `path`), striped")
    parser.add_argument("--socket", help="Unix socket to serve (default: derived from the path)")
    parser.add_argument("--pool-dir", default=DEFAULT_POOL_DIR, help="where the shared DRAM pools live (a tmpfs)")
    parser.add_argument(
        "--option", action="append", type=_parse_option, default=[], help="Store.open option NAME=VALUE"
    )
    parser.add_argument("--options-json", default="{}", help="Store.open options as a JSON object")
    parser.add_argument("--fill-timeout-ms", type=int, default=10_000, help="give up a rank's missing slice after this")
    parser.add_argument(
        "--host-dram-bytes",
        type=int,
        default=None,
        help="the most DRAM the pools of all models take together (default: no cap; each gets dram_bytes)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on 127.0.0.1:PORT/metrics (kvtier_* names, docs/cli.md)",
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    options = {**json.loads(args.options_json), **dict(args.option)}
    if args.host_dram_bytes is not None:
        options["host_dram_bytes"] = args.host_dram_bytes
    socket = Path(args.socket) if args.socket else default_socket_path(args.path)
    paths = args.path if len(args.path) > 1 else args.path[0]
    try:
        service = Service.start(os.fspath(socket), paths, args.pool_dir, args.fill_timeout_ms, **options)
    except Exception as error:
        print(f"kvtier serve: {error}", file=sys.stderr)
        return 1
    exporter = None
    if args.metrics_port is not None:
        from kvtier.ops.metrics import start_exporter

        try:
            exporter = start_exporter(socket, args.metrics_port)
        except RuntimeError as error:
            service.stop()
            print(f"kvtier serve: {error}", file=sys.stderr)
            return 1
        print(f"kvtier serve: metrics on http://127.0.0.1:{args.metrics_port}/metrics", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    pid_path = pid_file(socket)
    pid_path.write_text(f"{os.getpid()}\n")
    print(f"kvtier serve: serving {args.path} on {socket} (pid {os.getpid()})", flush=True)
    while not stop.wait(1.0):
        pass
    print("kvtier serve: stopping (flushing stores)", flush=True)
    if exporter is not None:
        exporter.shutdown()
    service.stop()
    with contextlib.suppress(OSError):
        pid_path.unlink()
    return 0


def pid_file(socket_path: str | os.PathLike) -> Path:
    """Where ``kvtier serve`` records its process id (next to its socket)."""
    return Path(socket_path).with_suffix(".pid")


def stop_service(socket_path: str | os.PathLike, timeout_s: float = 60) -> bool:
    """SIGTERM to the service on ``socket_path`` and a wait (bounded) while it flushes and exits;
    ``True`` once it is gone (or none recorded itself there)."""
    pid = service_pid(socket_path)
    if pid is None:
        return True
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _running(pid):
            return True
        time.sleep(0.1)
    return False


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs. A service this process started (``ensure_service``) is its child:
    once it exits it is reaped here, since an unreaped child still answers ``kill(pid, 0)``."""
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"  # exited; its parent has not reaped it yet


def service_pid(socket_path: str | os.PathLike) -> int | None:
    """The process id of the service on ``socket_path``, if one recorded it."""
    try:
        return int(pid_file(socket_path).read_text().strip())
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
