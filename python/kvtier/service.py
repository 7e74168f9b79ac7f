"""The host service: ``kvtier serve`` and how engines find (or start) it.

One service per host and store path owns the stores (catalog, NVMe and shared tiers) and their DRAM
pools in shared memory (docs/architecture.md). Engines connect to its Unix socket; the first engine
that finds none running starts one (``ensure_service``), so nothing extra is needed to get going. It
can also run on its own (a systemd unit, a Kubernetes sidecar)::

    kvtier serve /mnt/nvme/kvtier --option dram_bytes=8589934592 --option nvme_bytes=68719476736

The socket defaults to ``$XDG_RUNTIME_DIR/kvtier/<digest of the store path>.sock`` (``/tmp/kvtier-<uid>/``
without ``XDG_RUNTIME_DIR``), so every engine configured with the same ``path`` finds the same service.

A service an engine starts is detached from it (``--detach``: its parent exits at once, so it is no
descendant of any engine process, and vLLM's shutdown, which kills its engine's whole process tree,
never reaches it). It frees a model's pool once no engine has been attached to it for
``--idle-timeout-s`` and then exits (``--exit-when-idle``), removing its socket and pool files.
``kvtier service stop PATH`` stops one at once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import signal
import socket as socketlib
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier._core import ServiceClient
from kvtier.errors import ServiceError

DEFAULT_POOL_DIR = "/dev/shm"
# How long an engine waits for a service it started to answer.
SERVICE_START_TIMEOUT_S = 120.0
SERVICE_LOG_NAME = "service.log"
# A service's log is rotated (to service.log.1) past this size: it lives next to the socket, in
# $XDG_RUNTIME_DIR (a tmpfs of a few hundred MiB at most) or /tmp, and services of every store path
# with that socket directory append to it, start after start, for months.
SERVICE_LOG_MAX_BYTES = 8 << 20
# The longest an engine holds a pin on its own (twice its job timeout, at most this): the service's
# lease on a silent connection's pins (`kvtier serve --pin-lease-ms`, 600 s) stays longer.
ENGINE_PIN_LEASE_MAX_S = 540.0
# An engine's default deadline on one transfer job (its `job_timeout_ms`): the service's reservation
# deadline (`kvtier serve --reservation-timeout-ms`, 180 s) stays longer.
ENGINE_JOB_TIMEOUT_DEFAULT_MS = 120_000
# A service started on demand frees a model's pool after this long with no engine attached, and
# exits once it holds none: long enough for an engine restart to find its blocks in DRAM.
DEFAULT_IDLE_TIMEOUT_S = 300.0
# How long `_answers` waits for a service that accepted the connection to answer `Stats`. A service
# busy opening a namespace still answers at once (the open runs outside its locks).
ANSWER_TIMEOUT_MS = 10_000
# The protocol's Stats request (docs/service.md): what `_answers` sends as its probe.
_STATS_OP = 10


def _paths(path: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    if isinstance(path, (list, tuple)):
        return [os.path.realpath(os.fspath(p)) for p in path]
    return [os.path.realpath(os.fspath(path))]  # type: ignore[arg-type]  # a str or os.PathLike here


def default_socket_dir() -> Path:
    """Where the services' sockets are by default (the store path names the file, not the directory:
    this does not look at the store, whose filesystem may be frozen)."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime_dir) / "kvtier" if runtime_dir else Path(f"/tmp/kvtier-{os.getuid()}")


def default_socket_path(path: str | os.PathLike | Sequence[str | os.PathLike]) -> Path:
    """The socket of the service for the store at ``path`` (one or several directories), named from
    their real paths (which resolving looks at: on a frozen mount it waits as long as the mount)."""
    digest = hashlib.sha256("\0".join(_paths(path)).encode()).hexdigest()[:16]
    return default_socket_dir() / f"{digest}.sock"


def connect(socket_path: str | os.PathLike, timeout_ms: int = 10_000) -> ServiceClient:
    return ServiceClient.connect(os.fspath(socket_path), timeout_ms)


def service_command(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    socket_path: str | os.PathLike,
    options: Mapping[str, Any],
    pool_dir: str = DEFAULT_POOL_DIR,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    log_path: Path | None = None,
) -> list[str]:
    """The command an engine starts a service with: detached, freeing idle pools, exiting when idle,
    keeping its own log (rotated) when ``log_path`` is given."""
    # Absolute, not resolved: the socket is named already, and resolving a path on a frozen mount
    # waits for as long as the mount does (an engine starting its service would wait with it).
    if isinstance(path, (list, tuple)):
        store_paths = [os.path.abspath(os.fspath(p)) for p in path]
    else:
        store_paths = [os.path.abspath(os.fspath(path))]  # type: ignore[arg-type]  # a str or os.PathLike here
    command = [sys.executable, "-m", "kvtier", "serve", *store_paths, "--socket", os.fspath(socket_path)]
    command += ["--pool-dir", pool_dir, "--detach", "--exit-when-idle", "--idle-timeout-s", str(idle_timeout_s)]
    if log_path is not None:
        command += ["--log-file", os.fspath(log_path)]
    if options:
        command += ["--options-json", json.dumps(dict(options))]
    return command


def private_dir(directory: Path) -> Path:
    """Creates ``directory`` (0700) or checks the one there: a real directory (no symlink), owned by
    this user, that no one else can write (the service's own check on its socket directory). Anything
    else is refused before a file is opened in it: in a shared /tmp, another user could have made it,
    to have the engine append to a file of theirs."""
    with contextlib.suppress(FileExistsError):
        directory.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        os.mkdir(directory, 0o700)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        kind = "a directory"
        if stat.S_ISLNK(info.st_mode):
            kind = "a symlink"
        elif not stat.S_ISDIR(info.st_mode):
            kind = "not a directory"
        raise ServiceError(
            f"{directory} is {kind} owned by uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):o}; kvtier "
            f"keeps its service socket there and needs a directory of uid {os.geteuid()} closed to others "
            "(no group or other write bit). "
            f"Remove it, set XDG_RUNTIME_DIR, or set service_socket to a path in a private directory"
        )
    return directory


def _open_private(path: Path, flags: int) -> int:
    """A file descriptor for ``path`` in a private directory: never through a symlink, created 0600."""
    try:
        return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ServiceError(
                f"{path} is a symlink; kvtier never writes through one there. Remove it and start again"
            ) from None
        raise


def _lock_start(lock_path: Path, wait_s: float) -> int:
    """The engines' lock on starting the service of a socket, held (flock) on the file at ``lock_path``.
    A stopping service removes the file while it holds the lock (so that lock files do not pile up),
    so a lock taken on a file no longer at the path is let go and taken on the file there now.
    Waited ``wait_s`` at most: a holder that never lets go (a process stopped while starting the
    service) must not hold an engine's reconnects for good."""
    deadline = time.monotonic() + wait_s
    while True:
        fd = _open_private(lock_path, os.O_WRONLY | os.O_APPEND)
        try:
            _flock_within(fd, lock_path, deadline)
            held = os.fstat(fd)
            with contextlib.suppress(FileNotFoundError):
                there = os.stat(lock_path, follow_symlinks=False)
                if (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino):
                    return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _flock_within(fd: int, lock_path: Path, deadline: float) -> None:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise ServiceError(
                    f"another process has held {lock_path} (starting the kvtier service) for too long; if none "
                    "is starting it, find the holder with `fuser` and stop it"
                ) from None
            time.sleep(0.05)


def ensure_service(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    options: Mapping[str, Any] | None = None,
    socket_path: str | os.PathLike | None = None,
    pool_dir: str = DEFAULT_POOL_DIR,
    start_timeout_s: float = SERVICE_START_TIMEOUT_S,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
) -> Path:
    """The socket of a running service for ``path``, starting one if none answers.

    Engines racing to start it take a lock next to the socket, so one service starts. A service
    started here is detached from this process (no engine's shutdown reaches it), frees a model's
    pool after ``idle_timeout_s`` with no engine attached and then exits; its log is ``service.log``
    next to the socket. A running service keeps the options it was started with.
    """
    socket = Path(socket_path) if socket_path else default_socket_path(path)
    if _answers(socket):
        return socket
    private_dir(socket.parent)
    # A holder of the lock waits for its own start at most start_timeout_s.
    lock_fd = _lock_start(socket.with_suffix(".lock"), start_timeout_s + 10)
    try:
        if _answers(socket):
            return socket
        log_path = socket.parent / SERVICE_LOG_NAME
        command = service_command(path, socket, options or {}, pool_dir, idle_timeout_s, log_path)
        pid = _start_detached(command, log_path)
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            # Its pid file is written just after the socket answers: callers may read it at once.
            if _answers(socket) and service_pid(socket) == pid:
                return socket
            if pid is None or not _running(pid):
                break
            time.sleep(0.05)
        if pid is not None and _running(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        raise ServiceError(
            f"kvtier service for {path} did not start within {start_timeout_s:.0f} s (pid {pid}); its log "
            f"{log_path} ends with:\n{_tail(log_path)}"
        )
    finally:
        os.close(lock_fd)


def _start_detached(command: list[str], log_path: Path) -> int | None:
    """Runs ``command`` (a ``kvtier serve --detach``) and returns the service's pid: the command
    forks the service into a session of its own and exits, so the service is nobody's child."""
    log_fd = _open_private(log_path, os.O_WRONLY | os.O_APPEND)
    try:
        launcher = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log_fd,
            close_fds=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(log_fd)
    match = launcher.stdout.decode(errors="replace").strip().rpartition(" ")[2]
    return int(match) if launcher.returncode == 0 and match.isdigit() else None


def _answers(socket: Path) -> bool:
    """Whether a service of this user serves ``socket``: it answers a Stats request, or accepted the
    connection and is slow to answer (busy: starting a second one would only be refused). A
    connection closed or reset unanswered is a service on its way out (its idle exit reset the
    queue it was in): not answering, so the caller starts a new one."""
    if not socket.exists():
        return False
    probe = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    try:
        probe.settimeout(ANSWER_TIMEOUT_MS / 1000)
        probe.connect(os.fspath(socket))
        if _peer_credentials(probe)[1] != os.geteuid():
            return False
        probe.sendall(struct.pack("<IB", 1, _STATS_OP))
        return probe.recv(1) != b""
    except TimeoutError:
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _peer_credentials(connected: socketlib.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = connected.getsockopt(socketlib.SOL_SOCKET, socketlib.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def open_log(path: Path) -> None:
    """Points this process's stdout and stderr (fds 1 and 2: Python's output and the core's log
    lines) at ``path``: appended, created 0600, never through a symlink."""
    fd = _open_private(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def rotate_log(path: Path, max_bytes: int = SERVICE_LOG_MAX_BYTES) -> None:
    """Keeps the log this process writes (fd 2, opened by ``open_log``) under ``max_bytes``: past it,
    ``path`` becomes ``path.1`` (replacing the one before) and a new ``path`` is opened. Services of
    other store paths append to the same file: the rename is done under an flock of it, and a
    process whose file another one rotated (``path`` names another file now) opens the new one.
    A rotation that fails (the directory gone, a symlink planted) leaves the log as it is."""
    with contextlib.suppress(OSError, ServiceError):
        _rotate_log(path, max_bytes)


def _rotate_log(path: Path, max_bytes: int) -> None:
    try:
        current = os.fstat(2)
        at_path = os.lstat(path)
    except FileNotFoundError:
        open_log(path)
        return
    if (at_path.st_dev, at_path.st_ino) != (current.st_dev, current.st_ino):
        open_log(path)
        return
    if current.st_size <= max_bytes:
        return
    fcntl.flock(2, fcntl.LOCK_EX)
    try:
        at_path = os.lstat(path)
        if (at_path.st_dev, at_path.st_ino) == (current.st_dev, current.st_ino):
            os.replace(path, path.with_name(path.name + ".1"))
    finally:
        fcntl.flock(2, fcntl.LOCK_UN)
    open_log(path)


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


def pid_file(socket_path: str | os.PathLike) -> Path:
    """Where ``kvtier serve`` records its process id (next to its socket)."""
    return Path(socket_path).with_suffix(".pid")


def stop_service(socket_path: str | os.PathLike, timeout_s: float = 60) -> bool:
    """SIGTERM to the service on ``socket_path`` and a wait (bounded) while it flushes and exits;
    ``True`` once it is gone (or none runs there). Only a process shown to be that service is
    signalled (``running_service``): a pid file left by a service that was killed may name an
    unrelated process of this user by now."""
    found = running_service(socket_path)
    if found is None:
        return True
    pid, started = found
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _running(pid) or process_start_time(pid) != started:
            return True
        time.sleep(0.1)
    return False


def running_service(socket_path: str | os.PathLike) -> tuple[int, int] | None:
    """``(pid, start time)`` of the live service on ``socket_path``, or None. The process listening
    on the socket (its peer credentials) is the service; when the socket does not answer (removed
    or its directory replaced), a pid file whose recorded start time matches the process with that
    pid. A pid alone proves nothing: pids are reused, and a service killed by the OOM killer leaves
    its pid file behind."""
    pid = socket_peer_pid(socket_path)
    if pid is None:
        pid, recorded = _pid_record(socket_path)
        if pid is None or not _is_service_process(pid, recorded):
            return None
    started = process_start_time(pid)
    return None if started is None else (pid, started)


def socket_peer_pid(socket_path: str | os.PathLike) -> int | None:
    """The pid of the process of this user listening on ``socket_path`` (SO_PEERCRED), or None
    when nothing of this user answers there."""
    probe = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(os.fspath(socket_path))
        pid, uid = _peer_credentials(probe)
    except OSError:
        return None
    finally:
        probe.close()
    return pid if uid == os.geteuid() and pid > 0 else None


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat field 22): with the pid, what
    names one process for good. None when no such process runs."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, or a debugger's trap: /proc/PID/stat state T or t): it
    answers nothing until something continues it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _is_service_process(pid: int, recorded_start: int | None) -> bool:
    """Whether ``pid`` is the process a pid file recorded: the same start time, or, for a pid file
    of an older kvtier (no start time), a ``kvtier serve`` of this user."""
    if recorded_start is not None:
        return process_start_time(pid) == recorded_start
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return False
    return owner == os.geteuid() and b"serve" in words and any(b"kvtier" in word for word in words)


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
    """The process id the service on ``socket_path`` recorded in its pid file, if any (not proof
    that it still runs: ``running_service`` checks)."""
    return _pid_record(socket_path)[0]


def pid_record(pid: int) -> str:
    """What ``kvtier serve`` writes to its pid file: its pid and its start time."""
    return f"{pid} {process_start_time(pid)}\n"


def _pid_record(socket_path: str | os.PathLike) -> tuple[int | None, int | None]:
    """``(pid, start time)`` from the pid file; the start time is None in a pid file of an older
    kvtier (the pid alone)."""
    try:
        words = pid_file(socket_path).read_text().split()
        return int(words[0]), int(words[1]) if len(words) > 1 else None
    except (OSError, ValueError, IndexError):
        return None, None
