"""The CI-size run of scripts/distfs/bench_filesystems.py (seed 002's experiments 4 and 5): ext4 and
xfs made on loop files, `kvtier bench io` on each with fio beside it, and the shared tier's cold gets
across two "nodes" on a local directory. The GlusterFS and CephFS targets are left to the full run:
they bring up their own daemons, which cannot run beside the test session's (tests/fs_fixtures.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: loop devices, mounts, dropping the page cache"),
    pytest.mark.skipif(shutil.which("mkfs.xfs") is None, reason="no mkfs.xfs (scripts/setup.sh installs xfsprogs)"),
    pytest.mark.skipif(shutil.which("fio") is None, reason="no fio (scripts/setup.sh installs it)"),
]


def test_small_run_measures_ext4_xfs_and_the_local_shared_tier(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "scripts/distfs/bench_filesystems.py"), "--small"]
    command += ["--filesystems", "ext4,xfs", "--targets", "local", "--out", str(out), "--work", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    rows = {row["fs"]: row for row in results["exp4"]}
    assert set(rows) == {"ext4", "xfs"}
    for fs, row in rows.items():
        assert row["wrong_objects"] == 0, fs
        for name in ("kvtier_store", "kvtier_retrieve", "fio_write", "fio_read"):
            assert row[name]["median"] > 0, (fs, name)
    (local,) = results["exp5"]
    assert local["target"].startswith("local") and local["misses"] == 0 and local["wrong"] == 0, local
    assert local["reads"] == 32 * 3, local  # --small: 32 blocks, 3 cold passes
    assert (out / "report.md").read_text().startswith("# Filesystem experiments")
    assert not [line for line in Path("/proc/mounts").read_text().splitlines() if str(tmp_path) in line]
