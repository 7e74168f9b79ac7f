"""The engine's connection to the host service across the service's death (issue 36): a connection
lets go of a dead client at its first failed call, and the service its reconnect starts takes the
dead one's pool over. Real services over real sockets; no engine."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

try:
    from kvtier.vllm import KvtierOptions, ServiceConnection
except Exception as import_error:  # pragma: no cover - depends on the environment
    pytest.skip(f"vllm is not importable ({import_error!r}); run scripts/install_vllm.sh", allow_module_level=True)

from kvtier import errors as kvtier_errors
from kvtier import service as kvtier_service
from served import engine_counts

SLICE_BYTES = 128 << 10


@pytest.fixture
def options(tmp_path: Path):
    options = KvtierOptions.from_extra_config(
        {"path": str(tmp_path / "store"), "dram_bytes": 8 << 20, "nvme_bytes": 0, "pool_dir": str(tmp_path)}
    )
    yield options
    kvtier_service.stop_service(options.socket_path())


def _pools(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix == ".pool")


def test_after_a_kill_the_connections_let_go_and_the_new_service_takes_the_pool_over(options, tmp_path):
    """A service started again by the engine's connections used to allocate and zero a new pool
    (seconds of CPU per GiB, taken from the engine's requests under load) beside the dead one's,
    which went only at that start's sweep (or a later one). Now the new service takes the dead pool
    over: the same file."""
    asks = ServiceConnection(options, {"test": "connection"}, 1, 0, SLICE_BYTES)
    copies = ServiceConnection(options, {"test": "connection"}, 1, 0, SLICE_BYTES, populate_pool=True)
    try:
        [dead_pool] = _pools(tmp_path)
        dead_inode = dead_pool.stat().st_ino
        pid = kvtier_service.service_pid(options.socket_path())
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while kvtier_service._answers(options.socket_path()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "puts" not in asks.stats() and "puts" not in copies.stats(), "a dead service answered"
        deadline = time.monotonic() + 30
        while not (asks.available and copies.available) and time.monotonic() < deadline:
            asks.stats(), copies.stats()
            time.sleep(0.1)
        assert asks.available and copies.available, "the connections did not reattach"
        assert [p.stat().st_ino for p in _pools(tmp_path)] == [dead_inode], "the dead pool was not taken over"
    finally:
        asks.close()
        copies.close()


def _mapped(pool: Path) -> bool:
    return str(pool) in Path("/proc/self/maps").read_text()


def test_idle_connections_unmap_a_killed_services_pool_without_a_call(options, tmp_path):
    """An idle engine kept a killed service's pool mapped until its next call, so a service started
    meanwhile (by another engine, or by this one's first request) could not take it over. Now each
    connection notices the hang-up within about a second, with no call, and unmaps; a frozen
    service (SIGSTOP) is not taken for a dead one."""
    from kvtier.vllm.connection import HANGUP_CHECK_S

    asks = ServiceConnection(options, {"test": "connection"}, 1, 0, SLICE_BYTES)
    copies = ServiceConnection(options, {"test": "connection"}, 1, 0, SLICE_BYTES, populate_pool=True)
    try:
        [pool] = _pools(tmp_path)
        assert _mapped(pool)
        pid = kvtier_service.service_pid(options.socket_path())
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(4 * HANGUP_CHECK_S)
            assert asks.available and copies.available and _mapped(pool), "a frozen service was taken for dead"
        finally:
            os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        while (_mapped(pool) or asks.available or copies.available) and time.monotonic() - started < 10:
            time.sleep(0.05)
        let_go_s = time.monotonic() - started
        assert not _mapped(pool), "the idle connections still map the dead service's pool"
        assert not asks.available and not copies.available
        assert let_go_s < 4 * HANGUP_CHECK_S, f"let go after {let_go_s:.1f} s"
        assert asks.outages + copies.outages == 1  # the first to notice lets go for both: one outage
        inode = pool.stat().st_ino
        kvtier_service.ensure_service(options.path, options.service_options(), socket_path=options.socket_path(),
                                      pool_dir=options.pool_dir)  # fmt: skip
        assert asks.locate_many([bytes(32)]) == [None]  # the call that reconnects (a miss meanwhile)
        deadline = time.monotonic() + 30
        while not asks.available and time.monotonic() < deadline:
            time.sleep(0.1)
        assert asks.available, "the connection did not reattach"
        assert [p.stat().st_ino for p in _pools(tmp_path)] == [inode], "the dead pool was not taken over"
    finally:
        asks.close()
        copies.close()


def test_a_late_failure_on_a_dead_services_client_keeps_the_other_connections_new_clients(options):
    """A worker's job holds the client it took (``live_client``) across its calls: when the service
    dies, that call fails after the process's other connections may have reattached to a new
    service. Its drop let go of every connection's client, the new ones too, each then reconnecting
    again (a new hello, a new pool mapping). Now a drop lets go only of clients of the dead service."""
    asks = ServiceConnection(options, {"test": "connection"}, 1, 0, SLICE_BYTES)
    copies = ServiceConnection(options, {"test": "connection"}, 1, 0, SLICE_BYTES, populate_pool=True)
    try:
        held = copies.live_client()  # a job's client, held across the kill
        assert held is not None
        pid = kvtier_service.service_pid(options.socket_path())
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (asks.available or copies.available) and time.monotonic() < deadline:
            time.sleep(0.05)  # the hang-up watch lets go of both
        assert not asks.available and not copies.available, "the kill went unnoticed"
        while not (asks.available and copies.available) and time.monotonic() < deadline:
            asks.stats(), copies.stats()
            time.sleep(0.1)
        assert asks.available and copies.available, "the connections did not reattach"
        new_asks, new_copies = asks.live_client(), copies.live_client()
        copies._drop_dead(held)  # the job's call on the dead client fails now
        assert asks.live_client() is new_asks and copies.live_client() is new_copies, "a new client was let go"
        assert asks.outages + copies.outages == 1
    finally:
        asks.close()
        copies.close()


def test_an_engine_shutting_down_after_its_service_stopped_does_not_start_it_again(options):
    """A service stopped on purpose (``kvtier service stop``) stays stopped until a request needs
    it; an engine shutting down is no such request. Its scheduler released its pins and its worker
    ran the jobs still queued, and each of those calls started the service again (a ``kvtier serve``
    left running after the servers and the service were stopped)."""
    from kvtier.vllm.connection import RECONNECT_INTERVAL_S

    scheduler = ServiceConnection(options, {"test": "connection"}, 1, 0, SLICE_BYTES)
    worker = ServiceConnection(options, {"test": "connection"}, 1, 0, SLICE_BYTES, populate_pool=True)
    try:
        assert scheduler.available and worker.available
        kvtier_service.stop_service(options.socket_path())
        deadline = time.monotonic() + 10
        while (scheduler.available or worker.available) and time.monotonic() < deadline:
            time.sleep(0.05)  # the hang-up watch lets go of both
        assert not scheduler.available and not worker.available, "the stop went unnoticed"
        worker.stop_reconnecting()  # the worker's shutdown begins
        scheduler.unpin_many([bytes(32)])  # the scheduler's shutdown releases what it pinned
        assert "puts" not in worker.stats()  # a job still queued asks, and is answered its miss
        time.sleep(2 * RECONNECT_INTERVAL_S + 1)
        assert kvtier_service.service_pid(options.socket_path()) is None, "a shutdown started the service again"
        assert scheduler.locate_many([bytes(32)]) == [None]  # a lookup, in an engine still serving, does
        deadline = time.monotonic() + 30
        while not scheduler.available and time.monotonic() < deadline:
            time.sleep(0.1)
        assert scheduler.available, "a lookup did not start the service"
    finally:
        scheduler.close()
        worker.close()


def test_the_event_feeds_connection_never_starts_a_stopped_service_and_follows_one_a_lookup_starts(options):
    """An idle engine with KV events on polls the service's change log every few hundred ms; the
    feed's connection reconnected as a lookup's does, by starting the service: a service stopped on
    purpose (``kvtier service stop``) was running again within about a second though no request
    came. The feed's connection now only attaches to a running service."""
    from kvtier.vllm.connection import RECONNECT_INTERVAL_S

    feed = ServiceConnection(options, {"test": "connection"}, 1, 0, SLICE_BYTES, starts_service=False)
    scheduler = None
    try:
        assert not feed.available and feed.outages == 1, "a feed with no service to follow started one"
        scheduler = ServiceConnection(options, {"test": "connection"}, 1, 0, SLICE_BYTES)  # starts it
        deadline = time.monotonic() + 10
        while not feed.available and time.monotonic() < deadline:
            feed.call("changes", 0, 16)
            time.sleep(0.1)
        assert feed.available, "the feed did not attach to the service a lookup started"
        kvtier_service.stop_service(options.socket_path())
        deadline = time.monotonic() + 10
        while (feed.available or scheduler.available) and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(int(2 * RECONNECT_INTERVAL_S / 0.1) + 10):
            assert feed.call("changes", 0, 16) is None
            time.sleep(0.1)
        assert kvtier_service.service_pid(options.socket_path()) is None, "the feed's polls started the service"
    finally:
        feed.close()
        if scheduler is not None:
            scheduler.close()


def test_a_call_broken_outside_the_connection_counts_as_an_outage(options, caplog):
    """A GPU rank's transfers and the per-engine reports call the client themselves: when such a call
    broke the client (a frozen service past its deadline), the connection let it go at its next call
    without counting or logging an outage, so ``service_outages`` and the log said nothing of it."""
    from processes import wait_stopped

    connection = ServiceConnection(options, {"test": "connection"}, 1, 0, SLICE_BYTES, timeout_ms=500)
    pid = kvtier_service.service_pid(options.socket_path())
    assert pid is not None and connection.available
    os.kill(pid, signal.SIGSTOP)
    wait_stopped(pid)
    try:
        client = connection.live_client()
        with pytest.raises(kvtier_errors.ServiceError, match="taken for hung"):
            client.stats()  # as a GPU transfer calls it: past its deadline
        assert not connection.available
        assert connection.locate_many([bytes(32)]) == [None]
        assert connection.outages == 1, "the broken client was let go without an outage"
        assert any("stopped answering" in record.getMessage() for record in caplog.records)
    finally:
        os.kill(pid, signal.SIGCONT)
        connection.close()


def test_an_engine_starting_beside_a_stopped_service_waits_a_second_not_the_attach_limit(options, caplog):
    """Issue 36, never worse: an engine started while its host service is frozen (SIGSTOP) waited
    the whole ``ATTACH_AT_START_WAIT_S`` (30 s) at start for a hello that could not be answered. Now
    the start sees the service's process stopped, starts serving misses within about a second, and
    attaches once the service runs again."""
    from kvtier.vllm.store_probe import ATTACH_AT_START_WAIT_S

    first = ServiceConnection(options, {"test": "connection"}, 1, 0, SLICE_BYTES)  # starts the service
    pid = kvtier_service.service_pid(options.socket_path())
    assert pid is not None
    second = None
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        second = ServiceConnection(options, {"test": "connection"}, 1, 0, SLICE_BYTES, populate_pool=True)
        waited_s = time.monotonic() - started
        assert waited_s < 5 < ATTACH_AT_START_WAIT_S, f"the start waited {waited_s:.1f} s for a stopped service"
        assert not second.available and second.outages == 1
        assert any(f"process ({pid}) is stopped" in record.getMessage() for record in caplog.records)
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        deadline = time.monotonic() + 30
        while not second.available:
            assert time.monotonic() < deadline, "the engine did not attach once the service ran again"
            time.sleep(0.1)
        assert "puts" in second.stats()
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("timeout_ms, limit_s", [(None, 3), (1_000, 1)], ids=["worker", "scheduler"])
def test_a_slow_first_hello_on_a_filesystem_that_answers_is_waited_the_attach_limit(
    tmp_path, monkeypatch, caplog, timeout_ms, limit_s
):
    """What the start's checks must not cut short: a service that runs and has not answered yet
    while its store directory answers (a long open: a large pool faulted in, a long recovery) is
    waited the whole ``ATTACH_AT_START_WAIT_S`` by a worker, and by a scheduler its own deadline
    (``service_timeout_ms``): its worker, made first, already waited for the open, and a hello
    given 120 s would otherwise hold the scheduler's start for as long as the limit (on a frozen
    mount it waited 5 s in a real ``vllm serve``, against its 2-s hello before). The service here is
    a socket that is listened on and never answered."""
    import socket as socketlib

    from kvtier.vllm import store_probe

    monkeypatch.setattr(store_probe, "ATTACH_AT_START_WAIT_S", 3.0)
    monkeypatch.setattr(store_probe, "STORE_PROBE_WAIT_S", 0.5)
    socket_path = tmp_path / "run" / "kv.sock"
    socket_path.parent.mkdir(mode=0o700)
    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    listener.bind(str(socket_path))
    listener.listen(16)
    extra = {
        "path": str(tmp_path / "store"), "dram_bytes": 8 << 20, "nvme_bytes": 0, "pool_dir": str(tmp_path),
        "service_socket": str(socket_path), "job_timeout_ms": 10_000,
    }  # fmt: skip
    connection = None
    threads_before = set(threading.enumerate())
    try:
        started = time.monotonic()
        options = KvtierOptions.from_extra_config(extra)
        connection = ServiceConnection(options, {"test": "slow"}, 1, 0, SLICE_BYTES, timeout_ms=timeout_ms)
        waited_s = time.monotonic() - started
        assert limit_s <= waited_s < limit_s + 2, f"the start waited {waited_s:.1f} s, not its limit ({limit_s} s)"
        assert not connection.available and connection.outages == 1
        said = f"did not answer within {limit_s:g} s at start"
        assert any(said in record.getMessage() for record in caplog.records)
    finally:
        if connection is not None:
            connection.close()
        listener.close()
        # The attempt, still asking the socket whether a service answers, now finds none and starts one.
        for thread in set(threading.enumerate()) - threads_before:
            if thread.name == "kvtier-attach":
                thread.join(timeout=60)
        kvtier_service.stop_service(socket_path)


def test_what_an_engine_served_at_recompute_reaches_its_counters_once_a_service_answers(options):
    """An engine's fallbacks happen while the service does not answer, so the service could not count
    them: with `vllm serve` (other processes) they were nowhere to be seen. The connection reports
    them, with its sources' (the worker's jobs given up), at its first call that succeeds afterwards."""
    asks = ServiceConnection(options, {"test": "connection"}, 1, 0, SLICE_BYTES, label="engine-x")
    given_up = {"given_up_loads": 0}
    asks.add_count_source(lambda: dict(given_up))
    try:
        assert asks.locate_many([bytes(32)]) == [None]
        assert engine_counts(options.socket_path(), "engine-x").get("failed_calls") == 0, "nothing to report yet"
        pid = kvtier_service.service_pid(options.socket_path())
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while asks.outages == 0 and time.monotonic() < deadline:
            asks.locate_many([bytes(32)])  # a miss at once: failed, then stepped aside
            time.sleep(0.05)
        given_up["given_up_loads"] = 2
        while not asks.available and time.monotonic() < deadline:
            asks.locate_many([bytes(32)])  # misses until the reconnect (a new service) attaches
            time.sleep(0.1)
        assert asks.available, "the connection did not reattach"
        failed, unsent = asks.failed_calls, asks.stepped_aside_calls
        # A dead service fails a call at most once or twice (a broken pipe drops its client; the
        # hang-up watch may drop it first), the calls after that are answered unsent until the
        # reconnect attaches: counted apart, not as failures.
        assert failed <= 2 and unsent >= 1, (failed, unsent)
        asks.locate_many([bytes(32)])  # the first call that succeeds: the report goes with it
        counts = engine_counts(options.socket_path(), "engine-x")
        assert (counts["failed_calls"], counts["outages"], counts["given_up_loads"]) == (failed, 1, 2), counts
        assert counts["stepped_aside_calls"] == unsent, counts
        asks.locate_many([bytes(32)])
        assert engine_counts(options.socket_path(), "engine-x")["failed_calls"] == failed, "counted once"
    finally:
        asks.close()


def test_an_engine_attaches_when_the_disk_has_no_room_for_its_nvme_tier(tmp_path):
    """An engine whose store path had less room than `nvme_bytes` (8 GiB by default) for a namespace's
    new device file was refused by the service (a capacity error at hello), so `vllm serve` did not
    start where vLLM alone would. Now the service opens that namespace on DRAM only and says so;
    `refuse` keeps the old behaviour for whoever asks for it."""
    import shutil

    too_large = 4 * shutil.disk_usage(tmp_path).free
    extra = {"path": str(tmp_path / "store"), "dram_bytes": 8 << 20, "nvme_bytes": too_large, "pool_dir": str(tmp_path)}
    options = KvtierOptions.from_extra_config(extra)
    try:
        connection = ServiceConnection(options, {"test": "full disk"}, 1, 0, SLICE_BYTES)
        try:
            assert connection.available, "the engine did not attach"
            assert connection.locate_many([bytes(32)]) == [None]
            stats = connection.stats()
            assert stats["nvme_off_no_space"] == 1, stats
        finally:
            connection.close()
        assert not list((tmp_path / "store").rglob("nvme.kvt")), "a device file was made on a disk without room"
    finally:
        kvtier_service.stop_service(options.socket_path())
    refusing = KvtierOptions.from_extra_config({**extra, "nvme_without_space": "refuse"})
    try:
        with pytest.raises(Exception, match="nvme_bytes"):
            ServiceConnection(refusing, {"test": "full disk"}, 1, 0, SLICE_BYTES)
    finally:
        kvtier_service.stop_service(refusing.socket_path())
