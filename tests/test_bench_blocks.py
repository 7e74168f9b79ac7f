"""`kvtier bench blocks` (seed 002's experiment 3): the report from rows, the plumbing of the shared
tier's options (shared roots and the shared_file_bytes sweep) into each `kvtier bench ttft` run and
its store config, and a CI-size run through real engines (tiny model, 1K tokens, engine blocks of 64
and 256 tokens)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

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
    row["kvtier_shared_ms"] = None  # not measured without the shared roots: no shared columns
    text = blocks.report([row, {**row, "block_tokens": 256, "problems": ["1 of 4 blocks served from nvme"]}], 1024)
    assert "| 64 | 1.00 MiB | 10 | 20 | 30 | 40 | 50 | 60 | 0.17 | 32 | 1.00 MiB | 75% |" in text
    assert "- block 256: 1 of 4 blocks served from nvme" in text


def fake_ttft_result(argv: list[str]) -> dict:
    """What `kvtier bench ttft` writes, reduced to what `row_of` reads: the shared hit's spread grows
    with the shared file size so that the rows can be told apart."""
    value = dict(zip(argv[::2], argv[1::2], strict=False))
    block, length = int(value["--block-tokens"]), int(value["--lengths"])
    file_bytes = int(value.get("--shared-file-bytes", 256 << 20))
    point = {"min": 0.1, "median": 0.2, "max": 0.3, "n": 2}
    experiment1 = {config: {str(length): {"ttft_s": point, "problems": []}} for config in blocks.CONFIGS}
    experiment1["kvtier_shared"][str(length)]["ttft_s"] = {
        "min": 0.4,
        "median": 0.5,
        "max": 0.6 + file_bytes / 2**30,
        "n": 2,
    }
    nvme_stats = {"nvme_read_requests": 2 * length // block, "nvme_read_request_bytes": 2 * length * 4096}
    return {
        "plan": {"kv_bytes_per_token": 4096, "shared": {"prompts": 2, "file_bytes": file_bytes}},
        "phases": {
            "kvtier_nvme": {"store_stats": nvme_stats},
            "kvtier_shared_store": {"store_stats": {"shared_files_published": max(1, 2 * (8 << 20) // file_bytes)}},
        },
        "summary": {"experiment1": experiment1},
        "notes": [],
    }


def test_the_sweep_passes_the_shared_tier_to_every_run_and_sweeps_shared_file_bytes(tmp_path, monkeypatch) -> None:
    calls: list[list[str]] = []

    def fake_main(argv: list[str]) -> int:
        calls.append(argv)
        value = dict(zip(argv[::2], argv[1::2], strict=False))
        Path(value["--out"]).mkdir(parents=True)
        (Path(value["--out"]) / "results.json").write_text(json.dumps(fake_ttft_result(argv)))
        return 0

    monkeypatch.setattr(blocks.ttft, "main", fake_main)
    out = tmp_path / "out"
    argv = ["--small", "--block-tokens", "64,256", "--out", str(out), "--shared-root-store", "/a"]
    argv += ["--shared-root-load", "/b", "--shared-file-bytes", "256MiB,2MiB", "--file-bytes-block", "256"]
    assert blocks.main(argv) == 0
    # Blocks 64 and 256 at the default file size, then 256 at 2 MiB: 256 MiB at block 256 is the
    # block sweep's run, not run again.
    assert [call[call.index("--out") + 1] for call in calls] == [
        str(out / "block-64"), str(out / "block-256"), str(out / "block-256-file-2MiB")
    ]  # fmt: skip
    for call in calls:
        assert (
            call[call.index("--shared-root-store") + 1] == "/a" and call[call.index("--shared-root-load") + 1] == "/b"
        )
    assert "--shared-file-bytes" not in calls[0] and calls[2][calls[2].index("--shared-file-bytes") + 1] == "2097152"
    document = json.loads((out / "results.json").read_text())
    assert [row["kvtier_shared_ms"] for row in document["rows"]] == [500.0, 500.0]
    files = {row["shared_file_bytes"]: row for row in document["file_rows"]}
    assert files[2 << 20]["shared_files_per_prompt"] == 4 and files[2 << 20]["kvtier_shared_max_ms"] == pytest.approx(
        601.95, abs=0.01
    )
    assert files[256 << 20] is not None and document["file_bytes_block"] == 256
    text = (out / "report.md").read_text()
    assert "| 64 | 0.25 MiB | 200 | 200 | 200 | 200 | 200 | 500 (400-850) | 2.50 | 200 |" in text
    assert "### Shared-tier hit vs shared_file_bytes at 256-token blocks, 1024 tokens (ms)" in text
    assert "| 2MiB | 4.0 | 500 | 400 | 602 | 2 | 200 | 2.50 |" in text
    assert (out / "ttft_vs_block.png").stat().st_size > 0


def test_shared_file_bytes_reaches_both_nodes_store_config(tmp_path) -> None:
    argv = ["--small", "--block-tokens", "256", "--shared-root-store", str(tmp_path), "--shared-root-load"]
    argv += [str(tmp_path), "--shared-file-bytes", "2MiB"]
    plan = blocks.ttft.make_plan(blocks.ttft.build_parser().parse_args(argv))
    assert plan["shared"]["file_bytes"] == 2 << 20
    for root in (plan["shared"]["store_root"], plan["shared"]["load_root"]):
        extra = blocks.ttft.kvtier_transfer(plan, str(tmp_path / "store"), root)["kv_connector_extra_config"]
        assert extra["shared_file_bytes"] == 2 << 20 and extra["shared_root"] == root
    # Without the option the store keeps its default; a file that cannot hold one block is refused.
    plan = blocks.ttft.make_plan(blocks.ttft.build_parser().parse_args(argv[:-2]))
    assert "shared_file_bytes" not in blocks.ttft.kvtier_transfer(plan, "s", "r")["kv_connector_extra_config"]
    with pytest.raises(blocks.ttft.BenchError, match="cannot hold one 256-token block"):
        blocks.ttft.make_plan(blocks.ttft.build_parser().parse_args([*argv[:-1], "1MiB"]))


# Full only: two `kvtier bench ttft --small` runs (about 3 minutes); the sweep's plumbing into each run
# is checked above without an engine, and `kvtier bench ttft --small` runs in tests/test_bench_ttft.py.
@pytest.mark.slow
@pytest.mark.full
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
