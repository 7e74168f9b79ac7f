"""The host service's life as engines see it: started detached (no engine's process tree holds it),
it frees an idle model's pool, exits when it holds none and leaves no file behind; a service that
starts removes what dead ones left; `kvtier service stop` stops one; and the directory the engine
keeps its socket, lock and log in is checked before anything is opened there (issue 23, item 2;
issue 24, item 3). Real services over real sockets, no vLLM.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier import service as kvtier_service
from kvtier.errors import ServiceError

SLICE_BYTES = 64 << 10


def _pool_files(pool_dir: Path) -> list[str]:
    return sorted(p.name for p in pool_dir.iterdir() if p.suffix == ".pool")


def _parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _wait(condition, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_a_service_an_engine_starts_is_detached_frees_idle_pools_and_exits_leaving_nothing(tmp_path):
    pool_dir = tmp_path / "shm"
    pool_dir.mkdir()
    socket = tmp_path / "run" / "kvtier.sock"
    started = kvtier_service.ensure_service(
        tmp_path / "store", {"dram_bytes": 4 << 20, "nvme_bytes": 0}, socket, str(pool_dir), idle_timeout_s=1.5
    )
    pid = kvtier_service.service_pid(started)
    assert pid is not None
    try:
        # Not our child, nor in our session: killing this process's tree (what vLLM's shutdown does
        # to an engine) cannot reach it.
        assert _parent_pid(pid) != os.getpid()
        assert os.getsid(pid) != os.getsid(0)
        client = kvtier_service.connect(started)
        client.hello(b"model", 1, 0, SLICE_BYTES)
        assert len(_pool_files(pool_dir)) == 1
        time.sleep(2.5)
        assert kvtier_service._running(pid) and len(_pool_files(pool_dir)) == 1, "an attached model was freed"
        del client
        assert _wait(lambda: not _pool_files(pool_dir), 10), "the idle model's pool stayed"
        assert _wait(lambda: not kvtier_service._running(pid), 10), "the idle service did not exit"
        assert not socket.exists() and not kvtier_service.pid_file(socket).exists()
        # the engines' start lock and the path lock go too: a pair per store path piled up
        assert sorted(p.name for p in socket.parent.iterdir() if p.name != "service.log") == []
    finally:
        kvtier_service.stop_service(started)


def test_a_service_killed_and_started_again_takes_over_the_dead_ones_pool(tmp_path):
    """What an engine's connection does after a SIGKILL: it lets go of the dead client (unmapping
    the pool) and starts a new service within a second or two. The new one takes the dead one's pool
    over (the same file: no gigabytes zeroed beside a busy engine, none left behind); before, the
    new one was allocated and zeroed beside it, and a dead pool younger than 30 s (as here) stayed in
    /dev/shm until some later start. The blocks the dead one held are kept (DRAM only here): a load
    an engine was promised before the kill still finds them; before, every slot was freed."""
    pool_dir = tmp_path / "shm"
    pool_dir.mkdir()
    socket = tmp_path / "run" / "kvtier.sock"
    options = {"dram_bytes": 4 << 20, "nvme_bytes": 0}
    started = kvtier_service.ensure_service(tmp_path / "store", options, socket, str(pool_dir))
    try:
        client = kvtier_service.connect(started)
        client.hello(b"model", 1, 0, SLICE_BYTES)
        keys = [bytes([i]) * 32 for i in range(1, 5)]
        layer = np.arange(len(keys) * SLICE_BYTES, dtype=np.uint32).astype(np.uint8).reshape(len(keys), SLICE_BYTES)
        assert all(client.store_blocks(keys, [layer], list(range(len(keys)))))
        [dead_pool] = _pool_files(pool_dir)
        dead_inode = (pool_dir / dead_pool).stat().st_ino
        pid = kvtier_service.service_pid(started)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert _wait(lambda: not kvtier_service._answers(started), 10)
        del client
        again = kvtier_service.connect(
            kvtier_service.ensure_service(tmp_path / "store", options, socket, str(pool_dir))
        )
        again.hello(b"model", 1, 0, SLICE_BYTES)
        [pool] = _pool_files(pool_dir)
        assert pool != dead_pool and (pool_dir / pool).stat().st_ino == dead_inode, "the dead pool was not taken over"
        out = np.zeros_like(layer)
        assert again.load_blocks(keys, [out], list(range(len(keys)))) == [True] * len(keys), "the dead pool's blocks"
        assert np.array_equal(out, layer)
        del again
    finally:
        kvtier_service.stop_service(started)
    assert not _pool_files(pool_dir)


def test_kvtier_service_stop_stops_the_service_of_a_path_and_says_when_none_runs(tmp_path):
    pool_dir = tmp_path / "shm"
    pool_dir.mkdir()
    socket = tmp_path / "run" / "kvtier.sock"
    kvtier_service.ensure_service(tmp_path / "store", {"dram_bytes": 4 << 20, "nvme_bytes": 0}, socket, str(pool_dir))
    kvtier_service.connect(socket).hello(b"model", 1, 0, SLICE_BYTES)
    pid = kvtier_service.service_pid(socket)
    assert pid is not None
    command = [sys.executable, "-m", "kvtier", "service", "stop", str(tmp_path / "store"), "--socket", str(socket)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"stopped pid {pid}" in done.stdout
    assert not kvtier_service._running(pid) and not _pool_files(pool_dir) and not socket.exists()
    again = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "no service" in again.stdout


def _service_stop(store: Path, socket: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvtier", "service", "stop", str(store), "--socket", str(socket)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_service_stop_never_signals_a_process_a_stale_pid_file_names(tmp_path):
    """Issue 37, item 8: the service was killed (the OOM killer) and left its pid file; the pid now
    belongs to an unrelated process of this user. `kvtier service stop` used to SIGTERM it. Pid
    files of this kvtier (pid and start time) and of older ones (the pid alone) are both checked."""
    socket = tmp_path / "run" / "kvtier.sock"
    socket.parent.mkdir(mode=0o700)
    unrelated = subprocess.Popen(["sleep", "120"])
    try:
        for record in (f"{unrelated.pid}\n", f"{unrelated.pid} 1\n"):
            kvtier_service.pid_file(socket).write_text(record)
            done = _service_stop(tmp_path / "store", socket)
            assert done.returncode == 0, done.stderr
            assert "no service runs" in done.stdout and f"names pid {unrelated.pid}" in done.stdout, done.stdout
            assert kvtier_service.stop_service(socket, timeout_s=1)
            time.sleep(0.2)
            assert unrelated.poll() is None, f"the unrelated process was signalled (pid file {record!r})"
    finally:
        unrelated.kill()
        unrelated.wait()


def test_service_stop_finds_a_live_service_whose_socket_was_removed(tmp_path):
    """The socket is the first witness (its listener's peer credentials); a service whose socket
    file was removed is still found through its pid file, whose start time proves it is the one."""
    pool_dir = tmp_path / "shm"
    pool_dir.mkdir()
    socket = tmp_path / "run" / "kvtier.sock"
    kvtier_service.ensure_service(tmp_path / "store", {"dram_bytes": 4 << 20, "nvme_bytes": 0}, socket, str(pool_dir))
    pid = kvtier_service.service_pid(socket)
    assert pid is not None and kvtier_service.running_service(socket) == (pid, kvtier_service.process_start_time(pid))
    socket.unlink()
    done = _service_stop(tmp_path / "store", socket)
    assert done.returncode == 0 and f"stopped pid {pid}" in done.stdout, done.stdout + done.stderr
    assert not kvtier_service._running(pid)


def test_an_engine_that_attaches_as_the_idle_service_exits_gets_a_service(tmp_path):
    """Issue 37, item 12 (a suspect, confirmed): the service decides it has been idle long enough
    and exits; an engine attaches at that moment (`ensure_service`, then connect and Hello, as a
    ServiceConnection does). It found the socket still there and counted the dying service as
    answering, then its connect or Hello failed: a failed engine start. The service now decides
    to exit and removes its socket in one step with its accepting (a connection already queued is
    closed unanswered), and the engine starts a new service."""
    pool_dir = tmp_path / "shm"
    pool_dir.mkdir()
    socket = tmp_path / "run" / "kvtier.sock"
    options = {"dram_bytes": 4 << 20, "nvme_bytes": 0}
    kvtier_service.ensure_service(tmp_path / "store", options, socket, str(pool_dir), idle_timeout_s=1.0)
    first = kvtier_service.service_pid(socket)
    log = socket.parent / kvtier_service.SERVICE_LOG_NAME
    try:
        deadline = time.monotonic() + 20
        while "exiting" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.002)
        assert "exiting" in log.read_text(), "the idle service did not decide to exit"
        started = time.monotonic()
        found = kvtier_service.ensure_service(tmp_path / "store", options, socket, str(pool_dir), idle_timeout_s=1.0)
        client = kvtier_service.connect(found)
        client.hello(b"model", 1, 0, SLICE_BYTES)
        assert time.monotonic() - started < 15
        assert kvtier_service.service_pid(socket) != first
        del client
    finally:
        kvtier_service.stop_service(socket)
        if first is not None and kvtier_service._running(first):
            os.kill(first, 9)


def test_the_service_log_is_rotated_at_start_and_while_the_service_runs(tmp_path):
    """Issue 37, item 12 (a suspect, confirmed): service.log lives next to the socket (in
    $XDG_RUNTIME_DIR, a small tmpfs, or /tmp), every service of every store path with that socket
    directory appends to it, and nothing ever truncated it. Past SERVICE_LOG_MAX_BYTES it is now
    rotated to service.log.1 (one generation kept): at a service's start, and while it runs
    (checked every second, whoever wrote the bytes)."""
    pool_dir = tmp_path / "shm"
    pool_dir.mkdir()
    socket = tmp_path / "run" / "kvtier.sock"
    kvtier_service.private_dir(socket.parent)
    log = socket.parent / kvtier_service.SERVICE_LOG_NAME
    rotated = log.with_name(log.name + ".1")
    big = b"an old line of a chatty service\n" * (kvtier_service.SERVICE_LOG_MAX_BYTES // 32 + 1)
    log.write_bytes(big)
    options = {"dram_bytes": 4 << 20, "nvme_bytes": 0}
    try:
        kvtier_service.ensure_service(tmp_path / "store", options, socket, str(pool_dir))
        assert rotated.exists() and rotated.stat().st_size == len(big), "the log was not rotated at start"
        assert log.stat().st_size < 4096 and "serving" in log.read_text()
        with log.open("ab") as more:  # the service's own output, or another service's
            more.write(big)
        assert _wait(lambda: log.stat().st_size < 4096, 10), f"a {log.stat().st_size}-byte log was not rotated"
        assert rotated.stat().st_size > len(big)
        assert kvtier_service.stop_service(socket)
        assert "stopping" in log.read_text(), "the service's output after the rotation went elsewhere"
        assert log.stat().st_size + rotated.stat().st_size < 3 * kvtier_service.SERVICE_LOG_MAX_BYTES
    finally:
        kvtier_service.stop_service(socket)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")
def test_a_socket_directory_of_another_user_is_refused_before_anything_is_opened(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.chown(run, 12345, 12345)
    with pytest.raises(ServiceError, match="owned by uid 12345"):
        kvtier_service.ensure_service(tmp_path / "store", {}, run / "kvtier.sock", str(tmp_path))
    assert list(run.iterdir()) == []


@pytest.mark.parametrize("kind", ["open to others", "symlink"])
def test_a_socket_directory_open_to_others_or_a_symlink_is_refused(tmp_path, kind):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    run = tmp_path / "run"
    if kind == "symlink":
        run.symlink_to(real)
    else:
        run.mkdir()
        run.chmod(0o777)
    with pytest.raises(ServiceError, match="closed to others"):
        kvtier_service.ensure_service(tmp_path / "store", {}, run / "kvtier.sock", str(tmp_path))
    assert list(real.iterdir()) == []
    if kind != "symlink":
        assert list(run.iterdir()) == []


def test_a_log_file_planted_as_a_symlink_is_never_written_through(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run / kvtier_service.SERVICE_LOG_NAME).symlink_to(victim)
    with pytest.raises(ServiceError, match="symlink"):
        kvtier_service.ensure_service(tmp_path / "store", {}, run / "kvtier.sock", str(tmp_path))
    assert victim.read_text() == "precious\n"


# What an engine does: find or start the service, attach to a model, print its pool file.
_ATTACH = """
import sys
from kvtier import service
socket = service.ensure_service(sys.argv[1], {"dram_bytes": 4 << 20, "nvme_bytes": 0}, sys.argv[2], sys.argv[3])
print(service.connect(socket).hello(b"model", 1, 0, 65536)["pool_path"])
"""


def _attach_without_fowner(home: Path, pool_dir: Path) -> subprocess.CompletedProcess[str]:
    """`_ATTACH` (and the service it starts) as root without CAP_FOWNER: like any user in /dev/shm,
    it cannot remove another user's file from a sticky directory it does not own."""
    command = ["setpriv", "--bounding-set", "-fowner", "--", sys.executable, "-c", _ATTACH]
    command += [str(home / "store"), str(home / "run" / "kv.sock"), str(pool_dir)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.fixture
def shm_of_another_owner(tmp_path: Path) -> Iterator[Path]:
    """A directory like /dev/shm (sticky, open to all, owned by someone else: uid 54321) in
    /dev/shm; the service a test started for `tmp_path` is stopped and the directory removed."""
    pool_dir = Path(tempfile.mkdtemp(prefix="pooltest-", dir="/dev/shm"))
    pool_dir.chmod(0o1777)
    os.chown(pool_dir, 54321, 54321)
    try:
        yield pool_dir
    finally:
        kvtier_service.stop_service(tmp_path / "run" / "kv.sock")
        shutil.rmtree(pool_dir, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_a_pool_name_another_user_took_does_not_stop_a_model(tmp_path, shm_of_another_owner):
    """Issue 37, item 5: another local user sees a model's pool file in /dev/shm and, once it is
    gone, creates a file of their own at that name. The engine's user, with no power over that
    file, must still get its model's pool: the name used to be the same at every open, and every
    Hello of that model failed with EEXIST until the other user removed their file."""
    pool_dir = shm_of_another_owner
    first = _attach_without_fowner(tmp_path, pool_dir)
    assert first.returncode == 0, first.stderr
    seen = Path(first.stdout.split()[-1])
    assert seen.parent == pool_dir
    assert kvtier_service.stop_service(tmp_path / "run" / "kv.sock")
    assert not seen.exists()
    seen.write_bytes(b"squatter")
    os.chown(seen, 12345, 12345)
    again = _attach_without_fowner(tmp_path, pool_dir)
    assert again.returncode == 0, f"the model could not open its pool:\n{again.stderr[-2000:]}"
    assert Path(again.stdout.split()[-1]) != seen
    assert seen.read_bytes() == b"squatter" and seen.stat().st_uid == 12345


def test_an_engine_waiting_on_a_start_lock_a_service_removes_locks_the_file_at_the_path(tmp_path):
    """A stopping service removes the engines' start lock while it holds it (so that lock files do
    not pile up); an engine that was waiting on that file must then lock the file at the path, or two
    engines would each start a service."""
    import fcntl
    import threading

    lock_path = tmp_path / "kvtier.lock"
    service_fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT, 0o600)
    fcntl.flock(service_fd, fcntl.LOCK_EX)
    taken: list[int] = []
    engine = threading.Thread(target=lambda: taken.append(kvtier_service._lock_start(lock_path, 30)))
    engine.start()
    time.sleep(0.2)  # the engine waits on the service's file
    lock_path.unlink()
    os.close(service_fd)
    engine.join(timeout=10)
    assert taken, "the engine never got the start lock"
    try:
        held, there = os.fstat(taken[0]), os.stat(lock_path)
        assert (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino), "it holds a lock on a removed file"
        other = os.open(lock_path, os.O_WRONLY)
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(other)
    finally:
        os.close(taken[0])


def test_a_start_lock_never_let_go_is_waited_a_limit_and_the_error_says_what_to_do(tmp_path):
    """An engine's reconnect starts the service under this lock: a holder that never lets go (a
    process stopped while starting a service) must not hold the engine's reconnects for good."""
    import fcntl

    lock_path = tmp_path / "kvtier.lock"
    holder = os.open(lock_path, os.O_WRONLY | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        started = time.monotonic()
        with pytest.raises(kvtier_service.ServiceError, match="fuser"):
            kvtier_service._lock_start(lock_path, 0.5)
        assert 0.5 <= time.monotonic() - started < 5
    finally:
        os.close(holder)


def test_kvtier_serve_applies_its_reservation_deadline_and_pin_lease(tmp_path):
    """`--reservation-timeout-ms` and `--pin-lease-ms` reach the service `kvtier serve` runs: a store
    reserved and never committed (a rank frozen between the two) is given up, and the pins of a
    connection that went silent are let go, each at its deadline; the gauges show what is held."""
    pool_dir, socket = tmp_path / "shm", tmp_path / "run" / "kvtier.sock"
    pool_dir.mkdir()
    command = [sys.executable, "-m", "kvtier", "serve", str(tmp_path / "store"), "--socket", str(socket)]
    command += ["--pool-dir", str(pool_dir), "--option", f"dram_bytes={4 << 20}", "--option", "nvme_bytes=0"]
    refused = subprocess.run([*command, "--pin-lease-ms", "-1"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--pin-lease-ms takes milliseconds >= 0" in refused.stderr
    errors = (tmp_path / "serve.err").open("w")
    serve = subprocess.Popen([*command, "--reservation-timeout-ms", "1000", "--pin-lease-ms", "1500"], stderr=errors)
    try:
        assert _wait(socket.exists, 60), "kvtier serve did not start"
        engine = kvtier_service.connect(socket)
        engine.hello(b"model", 1, 0, SLICE_BYTES)
        keys = [bytes([i]) * 32 for i in range(2)]
        assert engine.store_blocks(keys, [np.ones((2, SLICE_BYTES), dtype=np.uint8)], [0, 1]) == [True, True]
        frozen = kvtier_service.connect(socket)
        frozen.hello(b"model", 1, 0, SLICE_BYTES)
        assert frozen.pin_many(keys) == [True, True]
        assert [kind for kind, _ in frozen.reserve_many([b"\x07" * 32])] == ["fill"]
        held = engine.stats()
        assert (held["service_held_pins"], held["service_pending_fills"]) == (2, 1)

        def let_go() -> bool:
            stats = engine.stats()
            return stats["service_expired_fills"] == 1 and stats["service_expired_pins"] == 2

        assert _wait(let_go, 10), engine.stats()
        stats = engine.stats()
        assert (stats["service_held_pins"], stats["service_pending_fills"]) == (0, 0), stats
        assert frozen.commit_many([b"\x07" * 32]) == [False], "a store given up at its deadline is refused"
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
        errors.close()
    assert not socket.exists() and not _pool_files(pool_dir)
    said = (tmp_path / "serve.err").read_text()
    warning = "--pin-lease-ms 1500 is not longer than an engine's own pin lease"
    assert said.count(warning) == 1, f"a lease engines outlast is not warned about once: {said}"
    warning = "--reservation-timeout-ms 1000 is not longer than the engines' job_timeout_ms"
    assert said.count(warning) == 1, f"a reservation deadline a store outlasts is not warned about once: {said}"
