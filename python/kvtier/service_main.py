"""``kvtier serve``: the host service's process (``python -m kvtier serve``): starts the service on a
store path, optionally detached and with a Prometheus exporter, until SIGTERM/SIGINT or, for services
engines start, until idle.

It sits above ``kvtier.service`` (starting and reaching services) and ``kvtier.ops.metrics`` (the
exporter, which reaches the service through ``kvtier.service``), so that neither imports the other's
importer.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier._core import Service
from kvtier.errors import KvtierError
from kvtier.ops.metrics import start_exporter
from kvtier.service import (
    DEFAULT_POOL_DIR,
    ENGINE_JOB_TIMEOUT_DEFAULT_MS,
    ENGINE_PIN_LEASE_MAX_S,
    SERVICE_LOG_MAX_BYTES,
    default_socket_path,
    open_log,
    pid_file,
    pid_record,
    rotate_log,
    widen_affinity,
)


def _parse_option(text: str) -> tuple[str, Any]:
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--option takes NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(raw)
    except json.JSONDecodeError:
        return name, raw


def build_parser() -> argparse.ArgumentParser:
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
        "--reservation-timeout-ms",
        type=int,
        default=180_000,
        help="give up a store not committed by every rank this long after its first reserve (0: never; "
        "longer than the engines' job_timeout_ms)",
    )
    parser.add_argument(
        "--pin-lease-ms",
        type=int,
        default=600_000,
        help="let go of the pins of a connection silent this long, a frozen engine's (0: never; keep it longer "
        "than the engines' own pin lease, which is at most 540 s)",
    )
    parser.add_argument(
        "--host-dram-bytes",
        type=int,
        default=None,
        help="the most DRAM the pools of all models take together (default: no cap; each gets dram_bytes)",
    )
    parser.add_argument(
        "--idle-timeout-s",
        type=float,
        default=0.0,
        help="free a model's pool after this many seconds with no engine attached (0: never)",
    )
    parser.add_argument(
        "--exit-when-idle",
        action="store_true",
        help="exit once no model and no connection has been held for --idle-timeout-s (services engines start)",
    )
    parser.add_argument(
        "--detach",
        action="store_true",
        help="start the service in a session of its own, print its pid and return at once",
    )
    parser.add_argument(
        "--log-file",
        type=Path,
        default=None,
        help="append this service's output to this file, rotated to FILE.1 past --log-max-bytes "
        "(services engines start: service.log next to the socket)",
    )
    parser.add_argument(
        "--log-max-bytes",
        type=int,
        default=SERVICE_LOG_MAX_BYTES,
        help="rotate --log-file once it is larger than this (checked every second)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on 127.0.0.1:PORT/metrics (kvtier_* names, docs/cli.md)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    widen_affinity()
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.idle_timeout_s < 0 or (args.exit_when_idle and args.idle_timeout_s == 0):
        parser.error("--idle-timeout-s takes seconds > 0 with --exit-when-idle, >= 0 without")
    for flag, value in (
        ("--reservation-timeout-ms", args.reservation_timeout_ms),
        ("--pin-lease-ms", args.pin_lease_ms),
    ):
        if value < 0:
            parser.error(f"{flag} takes milliseconds >= 0 (0: never), got {value}")
    if args.detach:
        return _detach(list(argv) if argv is not None else sys.argv[1:])
    _warn_of_short_deadlines(args.reservation_timeout_ms, args.pin_lease_ms)
    if args.log_file is not None:
        open_log(args.log_file)
        rotate_log(args.log_file, args.log_max_bytes)
    log_with_times()
    options = {**json.loads(args.options_json), **dict(args.option)}
    # Engines attach to this service: a disk without room for a new model's NVMe tier must not keep
    # them from serving (the store opens DRAM only, with a warning), unless the operator says refuse.
    options.setdefault("nvme_without_space", "dram_only")
    if args.host_dram_bytes is not None:
        options["host_dram_bytes"] = args.host_dram_bytes
    socket = Path(args.socket) if args.socket else default_socket_path(args.path)
    paths = args.path if len(args.path) > 1 else args.path[0]
    try:
        service = Service.start(
            os.fspath(socket),
            paths,
            args.pool_dir,
            args.fill_timeout_ms,
            idle_timeout_ms=int(args.idle_timeout_s * 1000),
            reservation_timeout_ms=args.reservation_timeout_ms,
            pin_lease_ms=args.pin_lease_ms,
            **options,
        )
    except Exception as error:
        print(f"kvtier serve: {error}", file=sys.stderr)
        return 1
    return _serve(service, socket, args)


def log_with_times() -> None:
    """The service's log lines (its own and the core's) carry the time, the process and the level:
    several services append to one log, and a fault is traced by when each line was written. INFO
    keeps the changes of state (a tier sick or back, a namespace closed), not per-block lines."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s.%(msecs)03d %(process)d %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )


def _serve(service: Service, socket: Path, args: argparse.Namespace) -> int:
    """Serves with the exporter of --metrics-port until SIGTERM or SIGINT (or, with --exit-when-idle,
    until idle), then stops the service (which removes its socket and pid file). The exit status."""
    exporter = None
    if args.metrics_port is not None:
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
    pid_path.write_text(pid_record(os.getpid()))
    print(f"kvtier serve: serving {args.path} on {socket} (pid {os.getpid()})", flush=True)
    idle_limit_ms = int(args.idle_timeout_s * 1000) if args.exit_when_idle else None
    while not stop.wait(1.0):
        if args.log_file is not None:
            rotate_log(args.log_file, args.log_max_bytes)
        # Decided in one step with the service's accepting: an engine that connects meanwhile is
        # either counted (no exit) or finds no socket and starts a new service.
        if idle_limit_ms is not None and service.stop_if_idle(idle_limit_ms):
            print(f"kvtier serve: no engine for {args.idle_timeout_s:g} s; exiting", flush=True)
            break
    print("kvtier serve: stopping (flushing stores)", flush=True)
    if exporter is not None:
        exporter.shutdown()
    # The service removes its pid file with its socket (before it, under the socket path's lock), and
    # only while it names this process: a service started since may have written its own.
    try:
        service.stop()
    except KvtierError as error:
        # A store whose disk hung: what it had not written is lost (its log says which); the socket,
        # the pid file and the pools are gone all the same.
        print(f"kvtier serve: stopped, but a store did not close cleanly: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


def _warn_of_short_deadlines(reservation_timeout_ms: int, pin_lease_ms: int) -> None:
    """Warns (once: the detached child, not its parent) of a deadline that gives up what a live engine
    still relies on."""
    if 0 < pin_lease_ms <= ENGINE_PIN_LEASE_MAX_S * 1000:
        _warn(
            f"--pin-lease-ms {pin_lease_ms} is not longer than an engine's own pin lease (up to "
            f"{ENGINE_PIN_LEASE_MAX_S * 1000:.0f} ms): a pin a request still waits on may be let go, and under "
            "vLLM's plain OffloadingConnector that load then fails and stops the engine; keep it above "
            f"{ENGINE_PIN_LEASE_MAX_S * 1000:.0f} (the default is 600000)"
        )
    if 0 < reservation_timeout_ms <= ENGINE_JOB_TIMEOUT_DEFAULT_MS:
        _warn(
            f"--reservation-timeout-ms {reservation_timeout_ms} is not longer than the engines' job_timeout_ms "
            f"({ENGINE_JOB_TIMEOUT_DEFAULT_MS} by default): a store still being copied may be given up and "
            "dropped; keep it above the engines' job_timeout_ms (the default is 180000)"
        )


def _warn(message: str) -> None:
    print(f"kvtier serve: warning: {message}", file=sys.stderr, flush=True)


def _detach(argv: list[str]) -> int:
    """Starts ``kvtier serve`` (these arguments, less ``--detach``) in a session of its own, prints
    its pid, and returns: the service is then no child of whoever started this (an engine, whose
    shutdown kills its process tree). Its output goes where this process's stderr goes."""
    words = [word for word in argv if word != "--detach"]
    child = subprocess.Popen(
        [sys.executable, "-m", "kvtier", "serve", *words],
        stdin=subprocess.DEVNULL,
        stdout=sys.stderr.fileno(),
        stderr=sys.stderr.fileno(),
        start_new_session=True,
        close_fds=True,
    )
    print(f"kvtier serve: started pid {child.pid}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
