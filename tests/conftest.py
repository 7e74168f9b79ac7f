"""Shared pytest fixtures: both I/O engines, a fresh store directory per test."""

import pytest

ENGINES = ["io_uring", "psync"]


@pytest.fixture(params=ENGINES)
def engine(request):
    return request.param


@pytest.fixture
def store_dir(tmp_path):
    return tmp_path / "nvme"


# Session-scoped GlusterFS and CephFS on 127.0.0.1 (tests/fs_fixtures.py, used by test_shared_fs.py).
from fs_fixtures import cephfs_fs, glusterfs_fs  # noqa: E402, F401
