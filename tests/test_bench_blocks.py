"""`kvtier bench blocks` (seed 002's experiment 3): the report from rows, and a CI-size run through
real engines (tiny model, 1K tokens, engine blocks of 64 and 256 tokens)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kvtier.bench import blocks


def test_block_sizes_are_checked() -> None:
    assert blocks.parse_blocks("256,64,64") == [64, 256]
    for bad in ("", "48", "0", "100"):
        with pytest.raises(blocks.ttft.BenchError):
            blocks.parse_blocks(bad)


def test_report_puts_the_rows_side_by_side() -> None:
    row = {"block_tokens": 64, "object_bytes": 1 << 20, "problems": [], "nvme_read_requests": 32}
    row |= {"nvme_mean_read_kib": 1028.0, "nvme_read_sequential": 0.75}
    row |= {f"{config}_ms": 10.0 * (i + 1) for i, config in enumerate(blocks.CONFIGS)}
    text = blocks.report([row, {**row, "block_tokens": 256, "problems": ["1 of 4 blocks served from nvme"]}], 1024)
    assert "| 64 | 1.00 MiB | 10 | 20 | 30 | 40 | 50 | 60 | 0.17 | 32 | 1.00 MiB | 75% |" in text
    assert "- block 256: 1 of 4 blocks served from nvme" in text


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (scripts/install_vllm.sh)")
def test_small_sweep_runs_every_block_size(tmp_path) -> None:
    out = tmp_path / "out"
    assert blocks.main(["--small", "--out", str(out), "--store-dir", str(tmp_path / "stores")]) == 0
    document = json.loads((out / "results.json").read_text())
    rows = {row["block_tokens"]: row for row in document["rows"]}
    assert set(rows) == {64, 256}
    for block, row in rows.items():
        assert row["problems"] == [], row
        assert row["kvtier_nvme_ms"] and row["kvtier_dram_ms"] and row["recompute_ms"], row
        # Every NVMe hit read whole objects: one request per block of the 1K prompt, per hit.
        assert row["nvme_read_requests"] % (1024 // block) == 0 and row["nvme_read_requests"] > 0, row
    # Four times the block, four times the request (one object per block, descriptor page aside).
    ratio = rows[256]["nvme_mean_read_kib"] / rows[64]["nvme_mean_read_kib"]
    assert 3.5 < ratio <= 4.0, ratio
    assert (out / "report.md").read_text().startswith("### TTFT vs the engine's block size")
