"""Shared pytest fixtures: both I/O engines, a fresh store directory per test; the ``full`` marker."""

import os

import pytest

# Tests marked ``full`` run a benchmark end to end at more than smoke size, or repeat through a real
# engine what a cheaper test already checks: CI (under its time budget) skips them; run them with
# KVTIER_FULL_TESTS=1 bash scripts/test.sh.
FULL_TESTS_ENV = "KVTIER_FULL_TESTS"


def pytest_collection_modifyitems(config, items):
    if os.environ.get(FULL_TESTS_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"full-size check, not in CI's time budget: {FULL_TESTS_ENV}=1 runs it")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)


ENGINES = ["io_uring", "psync"]


@pytest.fixture(params=ENGINES)
def engine(request):
    return request.param


@pytest.fixture
def store_dir(tmp_path):
    return tmp_path / "nvme"


# Session-scoped GlusterFS and CephFS on 127.0.0.1 (tests/fs_fixtures.py, used by test_shared_fs.py).
from fs_fixtures import cephfs_fs, glusterfs_fs  # noqa: E402, F401

# Nothing is left behind: every kvtier service a test started is stopped, and no pool file of ours
# stays in /dev/shm (RAM until reboot), when the session ends.
LEAK_GRACE_S = 15.0
# Every process this session starts inherits this mark (services too: they are spawned with the
# engine's environment), so a service of another test session running beside this one is not
# counted as this one's leak. A service with no mark at all still counts.
SESSION_MARK = "KVTIER_TEST_SESSION"


def _session_of(pid: int) -> bytes | None:
    """The test session mark in a process's environment (None: none, or the process is gone)."""
    try:
        from pathlib import Path

        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = SESSION_MARK.encode() + b"="
    return next((entry[len(prefix) :] for entry in environ if entry.startswith(prefix)), None)


def _kvtier_services() -> set[int]:
    import os
    import subprocess

    found = subprocess.run(["pgrep", "-f", "kvtier serve"], capture_output=True, text=True).stdout.split()
    mine = os.environ[SESSION_MARK].encode()
    return {int(pid) for pid in found if _session_of(int(pid)) in (None, mine)}


def _kvtier_pool_files() -> set[str]:
    from pathlib import Path

    return {p.name for p in Path("/dev/shm").glob("kvtier-*")} if Path("/dev/shm").is_dir() else set()


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    import atexit
    import os
    import shutil
    import tempfile

    os.environ[SESSION_MARK] = str(os.getpid())
    # What services and engines keep beside their sockets (service.log, the costs files) goes to a
    # runtime directory of the session's own, removed at its end, not to the user's /tmp/kvtier-<uid>.
    # Removed at exit, after the engines still alive then have saved their costs (atexit runs
    # handlers last registered first: this one after vLLM's).
    runtime_dir = tempfile.mkdtemp(prefix="kvtier-tests-run-")
    os.environ["XDG_RUNTIME_DIR"] = runtime_dir
    atexit.register(shutil.rmtree, runtime_dir, ignore_errors=True)
    services_before, pools_before = _kvtier_services(), _kvtier_pool_files()
    yield
    _assert_nothing_left(services_before, pools_before)


def _assert_nothing_left(services_before: set[int], pools_before: set[str]) -> None:
    import time

    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        services = _kvtier_services() - services_before
        pools = _kvtier_pool_files() - pools_before
        if (not services and not pools) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not services, f"the tests left kvtier services running: pids {sorted(services)}"
    assert not pools, f"the tests left kvtier files in /dev/shm: {sorted(pools)}"
