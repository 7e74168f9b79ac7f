"""Shared pytest fixtures: both I/O engines, a fresh store directory per test."""

import pytest

ENGINES = ["io_uring", "psync"]


@pytest.fixture(params=ENGINES)
def engine(request):
    return request.param


@pytest.fixture
def store_dir(tmp_path):
    return tmp_path / "nvme"
