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


def _kvtier_services() -> set[int]:
    import subprocess

    found = subprocess.run(["pgrep", "-f", "kvtier serve"], capture_output=True, text=True).stdout.split()
    return {int(pid) for pid in found}


def _kvtier_pool_files() -> set[str]:
    from pathlib import Path

    return {p.name for p in Path("/dev/shm").glob("kvtier-*")} if Path("/dev/shm").is_dir() else set()


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    import time

    services_before, pools_before = _kvtier_services(), _kvtier_pool_files()
    yield
    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        services = _kvtier_services() - services_before
        pools = _kvtier_pool_files() - pools_before
        if (not services and not pools) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not services, f"the tests left kvtier services running: pids {sorted(services)}"
    assert not pools, f"the tests left kvtier files in /dev/shm: {sorted(pools)}"
