"""``kvtier bench gpu`` on host tensors (``--device cpu --small``): the harness that awaits a GPU keeps
working. Every case stores through the real service, restores from DRAM and, after a restart, from
NVMe, and compares every byte; the JSON carries the figures docs/gpu.md reports."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.bench import gpu


def test_the_cpu_run_restores_every_byte_from_dram_and_nvme(tmp_path):
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--small", "--repeats", "1", "--block-tokens", "16", "--layouts", "nhd,kv-split,mla"]
    assert gpu.main([*argv, "--out", str(out), "--dir", str(tmp_path), "--skip-fio"]) == 0
    document = json.loads((out / "gpu.json").read_text())
    assert document["verdict"] == {"bytes_identical_everywhere": True, "ordering_ok": True}
    assert document["ordering"] == {"stored": 64, "found": 64, "blocks": 64, "wrong_pages": 0, "ok": True}
    cases = {case["case"]: case for case in document["cases"]}
    assert set(cases) == {"small/nhd/block16", "small/kv-split/block16", "small-mla/mla/block16"}
    assert [case["case"] for case in document["cases"]][:2] == ["small/nhd/block16", "small-mla/mla/block16"]
    assert document["complete"] and document["skipped_cases"] == []
    for case in cases.values():
        assert case["executor"] == "host-memmove"
        # Issue 27: the pool is in /dev/shm (pinnable) whatever --dir is, and removed after the case.
        assert case["pool_dir"] == "/dev/shm", case["pool_dir"]
        assert case["missing_blocks"] == {"store": 0, "dram": 0, "nvme": 0}
        assert case["wrong_blocks"] == {"dram": 0, "nvme": 0}
        for phase in ("gpu_to_dram", "dram_to_gpu", "nvme_to_gpu"):
            assert case["gbps"][phase]["median"] > 0 and case["cpu_core_s_per_gb"][phase]["median"] > 0
        assert set(case["ratios"]) == {
            "gpu_to_dram_vs_pinned_copy",
            "dram_to_gpu_vs_pinned_copy",
            "nvme_to_gpu_vs_disk_read",
        }
        assert case["limits"]["direct_read"]["file_bytes"] > 0
    assert cases["small/kv-split/block16"]["tensors"] == 2 * cases["small/nhd/block16"]["tensors"]
    # The other executors' restores of the same blocks (on a GPU: is cuMemcpyBatchAsync the fastest?);
    # on host tensors the staged copies run, the CUDA ones record why they cannot.
    others = cases["small/nhd/block16"]["dram_to_gpu_other_executors"]
    assert others["staged-index-copy"]["wrong_blocks"] == 0 and others["staged-index-copy"]["gbps"]["min"] > 0
    assert "error" in others["cuMemcpyBatchAsync"]
    assert not list(Path("/dev/shm").glob("kvtier-bench-gpu-pool-*")), "a case left its pool in /dev/shm"


def test_a_budget_skips_the_cases_that_would_not_finish_and_keeps_what_ran(tmp_path):
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--small", "--repeats", "1", "--block-tokens", "16", "--skip-fio", "--budget-s", "0.01"]
    gpu.main([*argv, "--out", str(out), "--dir", str(tmp_path)])
    document = json.loads((out / "gpu.json").read_text())
    assert document["cases"] == [] and not document["complete"]
    assert document["skipped_cases"][:2] == ["small/nhd/block16", "small-mla/mla/block16"]


def test_a_full_size_shape_with_a_long_case_name_stores_every_block_under_its_own_key(tmp_path):
    """The first GPU run (H200, docs/gpu.md): keys were the case's name cut to 32 bytes, so every case
    named past that (cross-layer, kv-split, MLA) stored one block under all its keys and reported
    wrong bytes. The real shapes' names, on host tensors, in a few blocks."""
    assert len(set(gpu.keys_for("qwen3-32b/cross-layer/block64", 2, 1000))) == 1000
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--models", "llama-3-8b", "--layouts", "cross-layer", "--block-tokens", "16"]
    argv += ["--job-mib", "8", "--repeats", "1", "--skip-fio", "--out", str(out), "--dir", str(tmp_path)]
    assert gpu.main(argv) == 0
    (case,) = json.loads((out / "gpu.json").read_text())["cases"]
    assert case["case"] == "llama-3-8b/cross-layer/block16" and case["blocks"] == 4
    assert case["missing_blocks"] == {"store": 0, "dram": 0, "nvme": 0}
    assert case["wrong_blocks"] == {"dram": 0, "nvme": 0}
