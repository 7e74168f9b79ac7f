"""The CI-size run of scripts/distfs/bench_filesystems.py (seed 002's experiments 4 and 5): ext4 and
xfs made on loop files, `kvtier bench io` on each with fio beside it, and the shared tier's cold gets
across two "nodes" on a local directory. The GlusterFS and CephFS targets are left to the full run:
they bring up their own daemons, which cannot run beside the test session's (tests/fs_fixtures.py).

The second test runs experiment 5 through vLLM on the local target (tiny model, 512 tokens, one
prompt): node A's engine publishes the prompt to the shared tier, a fresh engine with an empty local
store reads every block from there, beside recompute and the local NVMe hit of the same run (five
engine starts, about 1.5 minutes)."""

from __future__ import annotations

import importlib.util
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


# Full only: five engine starts; a fresh engine reading a prompt from the shared tier is checked by
# tests/test_vllm_tiers.py::test_second_engine_hits_blocks_published_by_first.
@pytest.mark.full
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (scripts/install_vllm.sh)")
def test_small_exp5_ttft_reads_every_block_of_the_prompt_from_the_local_shared_tier(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "scripts/distfs/bench_filesystems.py"), "--small", "--only", "exp5"]
    command += ["--targets", "local", "--ttft-length", "512", "--ttft-repeats", "1"]
    command += ["--out", str(out), "--work", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    (row,) = results["exp5_ttft"]
    assert "error" not in row, row
    assert row["target"] == "local disk" and row["length"] == 512
    assert row["expected_blocks"] == 4  # 512 tokens of 128-token blocks
    assert row["shared_blocks"] == [4], row  # the service counted every block as a shared-tier hit
    assert row["same_token"] == "1/1", row  # the greedy token of the recompute of the same prompt
    for config in ("recompute", "kvtier_nvme", "kvtier_shared"):
        assert row[config]["n"] == 1 and row[config]["median"] > 0, (config, row)
    assert row["shared_over_nvme"] > 0 and row["shared_over_recompute"] > 0 and row["kvtier_nvme_first_ms"] > 0
    ttft_result = json.loads(Path(row["results"]).read_text())
    (shared,) = [m for m in ttft_result["measurements"] if m["config"] == "kvtier_shared"]
    # Before timing, node B's store placed every block in the shared tier (its local store was empty).
    assert shared["kvtier"]["tiers_before"] == {"shared": 4}, shared
    assert shared["kvtier"]["nvme_hits"] == 0 and shared["kvtier"]["misses"] == 0, shared
    assert shared["cached_tokens"] == 512 and "problem" not in shared, shared
    load_engine = ttft_result["phases"]["kvtier_shared_load-512-r0"]["engine"]
    assert load_engine["blocks_dram_at_start"] == 0 and load_engine["blocks_nvme_at_start"] == 0
    (publish,) = [ttft_result["phases"]["kvtier_shared_store"]["shared_publish"]]
    assert publish["shared_files_published"] >= 1 and publish["shared_dropped_publishes"] == 0, publish
    report = (out / "report.md").read_text()
    assert "Experiment 5 through vLLM" in report and (out / "exp5-ttft.png").stat().st_size > 0
