"""Smoke test of `kvtier bench ttft` at CI size (tiny model, 512 tokens, one repeat, experiment 2 at 50%).

vLLM's ExampleConnector row is left out (``--skip-example-connector``: vLLM's own reference
connector, not kvtier's; the full runs of docs/benchmarks.md measure it).

It runs the real benchmark (one vLLM engine at a time, each in its own process, of about 35 s each,
most of it vLLM's import) and checks the JSON it writes: the fields, that every restored configuration
really was a hit of the expected size, and that restored runs give the same greedy token as the
recompute of the same prompt (logprob within 1e-3). Two runs, the ``results`` fixture's parameters:

- ``local`` (CI): the local rows, four engine starts (baseline, kvtier_store per length and per hit
  rate, kvtier_nvme); each length or hit rate more costs two to four.
- ``remote`` (``full``: KVTIER_FULL_TESTS=1 runs it; eight engine starts): the same run plus the shared
  tier's rows and the shared tier behind a slow link. Node A publishes to a directory, node B reads
  it directly (kvtier_shared, checked by the run itself: exit 1 otherwise) and through
  ``kvtier.bench.slowmount`` (``--slow-link 4``: a FUSE mount limited to 4 MB/s; its blocks of 512 KiB
  then load slower than the tiny model recomputes them), so that ``test_slow_link_rows`` checks the
  rows always-load and kvtier's choice: every always-load block from the shared tier, kvtier's
  decisions covering every block, outputs equal to recompute's, and the first run of kvtier's choice
  probing the tier. Without fusepy or /dev/fuse the slow-link rows are left out (skipped with the
  reason). In CI, without this run: engines restoring another engine's prefix from the shared tier
  are checked by tests/test_vllm_tiers.py and tests/test_vllm_shared_fs.py; the slow mount by
  tests/test_slowmount.py; the slow-link phases, rows, checks and report without an engine by
  tests/test_bench_slow_link.py; kvtier's choice (load or recompute) and its costs file by
  tests/test_load_costs.py.

When ``.venv-lmcache-vllm`` exists (scripts/install_lmcache_vllm.sh; CI does not install it) the same
run also measures LMCache's connector with its local disk backend through kvtier's CPU copy shim,
and ``test_lmcache_disk_hits`` checks those hits; without it, that test is skipped.

Run: ``.venv/bin/python -m pytest tests/test_bench_ttft.py -m slow -v`` (``KVTIER_FULL_TESTS=1`` for ``remote``).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from kvtier.bench import slowmount

pytestmark = pytest.mark.slow

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - depends on the environment
    pytest.skip("vllm is not installed; run scripts/install_vllm.sh to install the CPU build", allow_module_level=True)

LOGPROB_TOLERANCE = 1e-3
LMCACHE_PYTHON = Path(__file__).resolve().parents[1] / ".venv-lmcache-vllm" / "bin" / "python"
MEASUREMENT_FIELDS = {"experiment", "config", "length_tokens", "repeat", "ttft_s", "prompt_tokens", "cached_tokens",
                      "expected_cached_tokens", "token_id", "logprob"}  # fmt: skip


@pytest.fixture(scope="module", params=["local", pytest.param("remote", marks=pytest.mark.full)])
def results(request, tmp_path_factory):
    """(results.json, output directory) of the local rows' run, or (``remote``) of the run with the
    shared tier's rows and its slow-link rows too."""
    from kvtier.bench import ttft

    out_dir = tmp_path_factory.mktemp(f"ttft-results-{request.param}")
    store_dir = tmp_path_factory.mktemp(f"ttft-store-{request.param}")
    argv = ["--small", "--lengths", "512", "--hit-rates", "50", "--skip-example-connector"]
    argv += ["--out", str(out_dir), "--store-dir", str(store_dir)]
    if request.param == "remote" and slowmount.missing_reason() is None:
        shared = tmp_path_factory.mktemp("ttft-shared")
        argv += ["--shared-root-store", str(shared), "--shared-root-load", str(shared)]
        argv += ["--slow-link", "4", "--slow-link-latency-ms", "20"]
    exit_code = ttft.main(argv)
    assert exit_code == 0
    return json.loads((out_dir / "results.json").read_text()), out_dir


def test_json_fields(results):
    result, out_dir = results
    assert result["benchmark"] == "kvtier bench ttft"
    assert result["plan"]["preset"] == "tiny"
    assert result["plan"]["lengths"] == [512]
    assert {"experiment1", "experiment2", "outputs_vs_recompute", "targets"} <= set(result["summary"])
    for measurement in result["measurements"]:
        if measurement["config"] == "disk_floor":
            # fio reading what the NVMe hit of the same length read (whole slots), beside the store.
            block_tokens = result["plan"]["block_tokens"]
            assert (
                measurement["read_bytes"] == measurement["length_tokens"] // block_tokens * result["plan"]["slot_bytes"]
            )
            assert measurement["fio_best"]["bytes"] > 0 and measurement["ttft_s"] > 0
            continue
        assert set(measurement) >= MEASUREMENT_FIELDS, measurement
        assert measurement["ttft_s"] > 0
    experiment1 = result["summary"]["experiment1"]
    for config in ("recompute", "vllm_prefix", "kvtier_miss", "kvtier_dram", "kvtier_nvme"):
        for length in ("512",):
            spread = experiment1[config][length]["ttft_s"]
            assert spread["min"] <= spread["median"] <= spread["max"], (config, length)
    experiment2 = result["summary"]["experiment2"]
    for config in ("vllm_prefix", "kvtier_dram", "kvtier_nvme"):
        assert set(experiment2[config]) == {"50"}, config
    # Recompute does not depend on the hit rate: one figure (experiment 1's at 512), not a cell per rate.
    assert "recompute" not in experiment2
    recompute = result["summary"]["experiment2_recompute"]
    assert recompute["from_experiment"] == 1 and recompute["length_tokens"] == 512
    assert recompute["ttft_s"] == experiment1["recompute"]["512"]["ttft_s"]
    assert [target["name"] for target in result["summary"]["targets"]][:3] == [
        "kvtier NVMe hit / kvtier DRAM hit",
        "kvtier DRAM hit / recompute",
        "kvtier NVMe hit / recompute",
    ]
    assert any("LMCache" in note for note in result["notes"])
    if shutil.which("fio"):
        assert set(experiment1["disk_floor"]) == {"512"}
        (floor_row,) = [t for t in result["summary"]["targets"] if t["name"].endswith("/ disk floor")]
        assert floor_row["value"] is not None and floor_row["met"] is None
    if not LMCACHE_PYTHON.exists():
        assert not result["plan"]["lmcache_available"]
        assert any("scripts/install_lmcache_vllm.sh" in note for note in result["notes"])
    assert (out_dir / "report.md").is_file()


def test_restores_were_real_hits(results):
    result, _ = results
    for measurement in result["measurements"]:
        assert not measurement.get("problem"), measurement
        assert measurement["cached_tokens"] == measurement["expected_cached_tokens"], measurement
        if measurement["config"] == "kvtier_nvme":
            assert measurement.get("page_cache_dropped") in (True, False)
            stored_blocks = measurement["expected_cached_tokens"] // 128
            assert measurement["kvtier"]["nvme_hits"] == stored_blocks
            assert measurement["kvtier"]["tiers_before"].get("nvme", 0) == stored_blocks
        if measurement["config"] == "kvtier_dram":
            assert measurement["kvtier"]["dram_hits"] == measurement["expected_cached_tokens"] // 128


def test_restored_outputs_match_recompute(results):
    result, _ = results
    recompute = {m["prompt_id"]: m for m in result["measurements"] if m["config"] == "recompute" and m.get("prompt_id")}
    compared = 0
    for measurement in result["measurements"]:
        if measurement["config"] not in ("vllm_prefix", "kvtier_dram", "kvtier_nvme"):
            continue
        if measurement.get("prompt_id") not in recompute:
            continue
        reference = recompute[measurement["prompt_id"]]
        assert measurement["token_id"] == reference["token_id"], (measurement["config"], measurement["prompt_id"])
        assert abs(measurement["logprob"] - reference["logprob"]) <= LOGPROB_TOLERANCE
        compared += 1
    assert compared >= 3  # 3 restored configurations x 1 length
    outputs = result["summary"]["outputs_vs_recompute"]
    for config in ("vllm_prefix", "kvtier_dram", "kvtier_nvme"):
        assert outputs[config]["same_token"] == outputs[config]["compared"] > 0


def test_lmcache_disk_hits(results):
    """LMCache + CPU copy shim: full disk hits (page cache dropped), same greedy token as recompute."""
    if not LMCACHE_PYTHON.exists():
        pytest.skip("no .venv-lmcache-vllm (scripts/install_lmcache_vllm.sh): LMCache's connector is not measured")
    result, out_dir = results
    assert result["plan"]["lmcache_available"]
    assert "degraded mode" not in (out_dir / "logs" / "lmcache_disk.log").read_text(errors="replace")
    recompute = {m["prompt_id"]: m for m in result["measurements"] if m["config"] == "recompute" and m.get("prompt_id")}
    measured = [m for m in result["measurements"] if m["config"] == "lmcache_disk"]
    assert sorted(m["length_tokens"] for m in measured) == result["plan"]["lengths"]
    for measurement in measured:
        length = measurement["length_tokens"]
        assert not measurement.get("problem"), measurement
        assert measurement["cached_tokens"] == measurement["expected_cached_tokens"] == length
        assert measurement["lmcache"]["loaded_tokens"] == length
        assert measurement["lmcache"]["disk_chunks_read"] == length // 256
        assert measurement["page_cache_dropped"] in (True, False)
        reference = recompute[measurement["prompt_id"]]
        assert measurement["token_id"] == reference["token_id"]
        assert abs(measurement["logprob"] - reference["logprob"]) <= LOGPROB_TOLERANCE
    outputs = result["summary"]["outputs_vs_recompute"]["lmcache_disk"]
    assert outputs["same_token"] == outputs["compared"] == len(result["plan"]["lengths"])
    (target,) = [t for t in result["summary"]["targets"] if t["name"] == "kvtier NVMe hit / LMCache disk hit"]
    assert target["value"] is not None and target["value"] > 0


def test_slow_link_rows(results):
    """The shared tier behind a 4 MB/s slow mount: always-load loaded every block from it, kvtier's choice
    decided on every block (the speed's first run probing the tier), and
    every output is recompute's (the run's own checks, exit 1 otherwise, are re-read here)."""
    if slowmount.missing_reason() is not None:
        pytest.skip(f"the slow-link rows need the slow mount: {slowmount.missing_reason()}")
    result, out_dir = results
    if not result["plan"].get("slow_link"):
        pytest.skip("the local rows' run has no slow-link rows: the remote run (KVTIER_FULL_TESTS=1) has them")
    slow = result["summary"]["slow_link"]
    assert slow["tiers"] == ["shared"] and slow["rates_mb_per_s"] == [4.0]
    records = [m for m in result["measurements"] if m["experiment"] == "slow_link"]
    assert sorted((m["policy"], m["length_tokens"]) for m in records) == [("always", 512), ("auto", 512)]
    for record in records:
        blocks = record["length_tokens"] // 128
        assert record["kvtier"]["tiers_before"] == {"shared": blocks}
        if record["policy"] == "always":
            assert record["kvtier"]["shared_hits"] == blocks and record["cached_tokens"] == record["length_tokens"]
        else:
            assert record["decided_blocks"] == blocks and record["cached_tokens"] <= record["offered_tokens"]
    (first,) = (m for m in records if m["policy"] == "auto")
    # As across a user's restart: kvtier's choice started from node A's costs file (its prefill steps; no
    # rate of the tier yet), so it probed the tier.
    (node_a,) = first["costs_at_start"].values()
    assert node_a["prefill_steps"] > 0 and "shared" not in node_a["rates_s_per_block"]
    assert set(first["decisions"]) <= {
        "shared:probe",
        "shared:probe_aside",
        "shared:untrained",
        "shared:recompute",
        "shared:load",
    }
    assert not [note for note in result["notes"] if "FAILED" in note]
    report = (out_dir / "report.md").read_text()
    assert "The shared tier behind a slow link" in report and "kvtier's choice (auto)" in report


@pytest.mark.full
@pytest.mark.radosgw
def test_object_tier_behind_a_slow_link(tmp_path):
    """`kvtier bench ttft --object --slow-link` end to end at CI size (Ceph's RADOS gateway, root): the
    run's own checks pass (exit 0) and both speeds have their rows. Full only: the gateway and nine more
    engine starts."""
    from kvtier.bench import bucket, ttft

    reason = bucket.missing_reason()
    if reason:
        pytest.skip(reason)
    out_dir = tmp_path / "out"
    argv = ["--small", "--lengths", "1k", "--repeats", "2", "--hit-rate-length", "0", "--skip-example-connector",
            "--no-disk-floor", "--object", "--slow-link", "2,200", "--out", str(out_dir), "--store-dir",
            str(tmp_path / "store")]  # fmt: skip
    assert ttft.main(argv) == 0
    result = json.loads((out_dir / "results.json").read_text())
    slow = result["summary"]["slow_link"]
    assert slow["tiers"] == ["object"] and set(slow["points"]["object"]) == {"2", "200"}
    records = [m for m in result["measurements"] if m["experiment"] == "slow_link"]
    assert len(records) == 2 * 2 * 2 and all(r["link_mb_per_s"] in (2.0, 200.0) for r in records)
    assert all(r["kvtier"]["bucket_hits"] == 8 for r in records if r["policy"] == "always")


@pytest.mark.radosgw
def test_object_row_at_ci_size(tmp_path):
    """`kvtier bench ttft --object` at CI size (Ceph's RADOS gateway, root): node A publishes one prompt
    to the bucket, a fresh node B with an empty local store loads every block of it from the bucket,
    and the run's own checks pass (exit 0: node B found the blocks located in the object tier, each
    served from it, and recompute's token). Five engine starts and the gateway; the only object row
    CI runs through vLLM (the row's phases broke once while only full runs measured them)."""
    from kvtier.bench import bucket, ttft

    reason = bucket.missing_reason()
    if reason:
        pytest.skip(reason)
    out_dir = tmp_path / "out"
    argv = ["--small", "--lengths", "512", "--repeats", "1", "--hit-rate-length", "0", "--skip-example-connector",
            "--no-disk-floor", "--object", "--out", str(out_dir), "--store-dir", str(tmp_path / "store")]  # fmt: skip
    assert ttft.main(argv) == 0
    result = json.loads((out_dir / "results.json").read_text())
    (hit,) = [m for m in result["measurements"] if m["config"] == "kvtier_object"]
    blocks = hit["expected_cached_tokens"] // result["plan"]["block_tokens"]
    assert blocks > 0 and hit["kvtier"]["bucket_hits"] == blocks and hit["kvtier"]["tiers_before"] == {"bucket": blocks}
    assert hit["cached_tokens"] == hit["expected_cached_tokens"] and not hit.get("problem")
    assert not [note for note in result["notes"] if "FAILED" in note]
