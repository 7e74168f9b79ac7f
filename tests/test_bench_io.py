"""`kvtier bench io --small` runs end to end (the CI size), writes sane JSON and never returns wrong bytes.

Runs the real benchmark in a subprocess (the `kvtier` CLI through `python -m kvtier`), on a directory
under pytest's tmp_path, with real fio when installed and LMCache when its venv exists.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _kvtier_core_missing_reason() -> str | None:
    try:
        import kvtier
    except ImportError as error:
        return f"kvtier does not import ({error}): run `maturin develop --release`"
    if getattr(kvtier, "Store", None) is None:
        return "kvtier.Store is missing (Rust core not built): run `maturin develop --release`"
    return None


def _run_bench(tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out_dir = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "kvtier",
        "bench",
        "io",
        "--small",
        "--dir",
        str(tmp_path / "data"),
        "--out",
        str(out_dir),
        *extra,
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    results_path = out_dir / "results.json"
    assert results_path.exists(), (
        f"no results.json (exit {completed.returncode})\nstdout:\n{completed.stdout}\nstderr:\n{completed.stderr}"
    )
    return completed, json.loads(results_path.read_text())


def _fio_args() -> list[str]:
    return [] if shutil.which("fio") else ["--no-fio"]


def test_bench_io_small_kvtier(tmp_path):
    reason = _kvtier_core_missing_reason()
    if reason:
        pytest.skip(reason)
    completed, document = _run_bench(tmp_path, *_fio_args())
    assert completed.returncode != 3, f"kvtier returned wrong bytes:\n{completed.stderr}"
    assert completed.returncode == 0, f"bench io --small failed:\n{completed.stderr}"

    assert document["benchmark"] == "kvtier bench io"
    assert document["small"] is True
    assert document["systems"]["kvtier"]["enabled"] is True
    assert document["wrong_objects"]["kvtier"] == 0
    assert document["sanity_problems"] == []
    assert document["cases"], "no case ran"
    for case in document["cases"]:
        for field in (
            "model",
            "prompt_tokens",
            "object_kind",
            "object_bytes",
            "object_count",
            "prompt_bytes",
            "repeats",
            "summary",
            "targets",
        ):
            assert field in case, field
        kv_bytes_per_token = document["models"][case["model"]]["kv_bytes_per_token"]
        assert case["object_bytes"] == case["tokens_per_object"] * kv_bytes_per_token
        assert len(case["repeats"]) == document["repeats"]
        for sample in case["repeats"]:
            measured = sample["kvtier"]
            assert measured["wrong_objects"] == 0
            assert measured["unexplained_missing_objects"] == 0
            assert measured["found_objects"] + measured["missing_objects"] == case["object_count"]
            for operation in ("store", "retrieve"):
                assert measured[operation]["gbps"] > 0
                assert measured[operation]["cpu_seconds"] >= 0
        summary = case["summary"]
        for key in ("kvtier_store", "kvtier_retrieve"):
            assert set(summary[key]["gbps"]) >= {"min", "median", "max"}
            assert summary[key]["cpu_seconds_per_gb"] is not None
        if document["systems"]["fio"]["enabled"]:
            assert summary["fio_read"]["gbps"]["median"] > 0
            assert summary["kvtier_retrieve"]["ratio_to_fio"]["median"] > 0
    assert os.path.exists(document["outputs"]["table"])
    if "plot" in document["outputs"]:
        assert os.path.getsize(document["outputs"]["plot"]) > 0


def test_bench_io_small_shared(tmp_path):
    """The shared-filesystem tier part: publish, visibility, cold retrieve from a second store, files per GB,
    lookup latency of 10,000 keys; never a wrong byte."""
    reason = _kvtier_core_missing_reason()
    if reason:
        pytest.skip(reason)
    completed, document = _run_bench(tmp_path, "--shared", "--encrypted", "--no-lmcache", *_fio_args())
    assert completed.returncode != 3, f"kvtier returned wrong bytes:\n{completed.stderr}"
    assert completed.returncode == 0, f"bench io --small --shared failed:\n{completed.stderr}"
    assert document["systems"]["kvtier_shared"]["enabled"] is True
    assert document["wrong_objects"]["kvtier_shared"] == 0
    # --encrypted (issue 40): the same store with encryption at rest, paired with the one in clear.
    assert document["systems"]["kvtier_encrypted"]["enabled"] is True
    assert document["wrong_objects"]["kvtier_encrypted"] == 0
    for case in document["cases"]:
        for sample in case["repeats"]:
            assert sample["kvtier_encrypted"]["found_objects"] == case["object_count"], sample["kvtier_encrypted"]
        assert case["summary"]["encryption_cost_retrieve"]["median"] > 0
    # --encrypted --shared: the shared-filesystem tier with the key on both stores, paired with it in clear.
    assert document["systems"]["kvtier_shared_encrypted"]["enabled"] is True
    assert document["wrong_objects"]["kvtier_shared_encrypted"] == 0
    for case in document["cases"]:
        for sample in case["repeats"]:
            measured = sample["kvtier_shared_encrypted"]
            assert measured["encrypted"] is True and measured["wrong_objects"] == 0
            assert measured["found_objects"] == case["object_count"], measured
        assert case["summary"]["shared_encryption_cost_retrieve"]["median"] > 0
    for case in document["cases"]:
        for sample in case["repeats"]:
            measured = sample["kvtier_shared"]
            assert measured["wrong_objects"] == 0
            assert measured["unexplained_missing_objects"] == 0
            assert measured["cold"] is True
            store, retrieve = measured["store"], measured["retrieve"]
            assert store["published_objects"] >= 1
            assert (
                store["published_objects"] + store["shared_dropped_publishes"] + store["dropped_stores"]
                == (case["object_count"])
            )
            assert measured["visible_objects"] == store["published_objects"]
            assert measured["found_objects"] == store["published_objects"]
            assert retrieve["shared_hits"] == store["published_objects"]
            assert store["gbps"] > 0 and retrieve["gbps"] > 0
            assert measured["visibility_seconds"] >= 0
            files = measured["files"]
            assert files["data_files"] >= 1 and files["manifest_files"] >= 1
            assert files["data_files"] == store["shared_files_published"]
            assert files["files_per_gb"] > 0 and files["directory_entries_per_gb"] > files["files_per_gb"]
            assert "counted_how" in files and "counted_how" in measured["metadata_ops"]
            assert measured["metadata_ops"]["total"] == 4 * store["shared_files_published"]
        summary = case["summary"]
        for key in ("kvtier_shared_store", "kvtier_shared_retrieve"):
            assert set(summary[key]["gbps"]) >= {"min", "median", "max"}
            if document["systems"]["fio"]["enabled"]:
                assert summary[key]["ratio_to_fio"]["median"] > 0
        assert summary["kvtier_shared_files"]["files_per_gb"]["median"] > 0
        assert summary["kvtier_shared_visibility_ms"]["median"] >= 0
    lookup = document["systems"]["kvtier_shared"]["lookup"]
    assert lookup["key_count"] == 10_000
    assert lookup["present"] == 10_000 and lookup["present_contains"] == 10_000
    for name in ("lookup_prefix", "contains_many"):
        assert 0 < lookup[name]["us_per_call"]["min"] <= lookup[name]["us_per_call"]["median"]
        assert lookup[name]["us_per_key"]["median"] == pytest.approx(lookup[name]["us_per_call"]["median"] / 10_000)
    table = Path(document["outputs"]["table"]).read_text()
    assert "kvtier shared fs" in table and "lookup_prefix" in table
    assert "kvtier shared fs encrypted" in table


def test_bench_io_small_fio_only(tmp_path):
    """The physical-limit side alone (no kvtier, no LMCache): fio's figures land in the JSON."""
    if not shutil.which("fio"):
        pytest.skip("fio is not installed (apt-get install -y fio): the fio part of the benchmark cannot run")
    completed, document = _run_bench(tmp_path, "--no-kvtier", "--no-lmcache")
    assert completed.returncode == 0, completed.stderr
    assert document["systems"]["fio"]["enabled"] is True
    for case in document["cases"]:
        for sample in case["repeats"]:
            assert sample["fio"]["best_read"]["gbps"] > 0
            assert sample["fio"]["best_write"]["gbps"] > 0
            assert {run["rw"] for run in sample["fio"]["runs"]} == {"read", "write"}
        assert case["summary"]["fio_read"]["gbps"]["median"] > 0


def test_cli_usage_and_unknown_command():
    completed = subprocess.run(
        [sys.executable, "-m", "kvtier", "--help"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120
    )
    assert completed.returncode == 0
    assert "bench io" in completed.stdout
    completed = subprocess.run(
        [sys.executable, "-m", "kvtier", "no-such-command"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120
    )
    assert completed.returncode == 2
    assert "unknown command" in completed.stderr


def test_workload_objects_are_distinct_and_keys_stable():
    spec = importlib.util.find_spec("kvtier.bench.workload")
    assert spec is not None
    from kvtier.bench import workload

    shape = workload.MODEL_SHAPES["llama3-8b"]
    assert shape.kv_bytes_per_token == 128 * 1024
    layout = workload.prompt_layout(shape, 1024, 16, key_salt="t", pool_bytes=64 * workload.MIB)
    pool = workload.make_pool(layout.pool_bytes, seed=7)
    views = layout.object_views(pool)
    assert len(views) == 64 and all(view.nbytes == 2 * workload.MIB for view in views)
    offsets = {layout.object_offset_bytes(index) for index in range(layout.object_count)}
    assert len(offsets) == layout.object_count
    assert all(view.ctypes.data % workload.PAGE_BYTES == 0 for view in views)
    keys = layout.keys()
    assert len(set(keys)) == len(keys) and all(len(key) == 32 for key in keys)
    assert keys == layout.keys()
    again = workload.make_pool(layout.pool_bytes, seed=7)
    assert (again[:4096] == pool[:4096]).all()


def test_a_failed_object_sweep_fails_the_run_at_any_size(tmp_path, monkeypatch, capsys):
    """Outside --small, other sanity problems are warnings, but an --object sweep that could not run
    fails the run with the reason (here: no credentials for the bucket given, found before any request)."""
    from kvtier.bench import io

    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(variable, raising=False)
    argv = ["--object", "--no-kvtier", "--no-fio", "--no-lmcache", "--object-size", "512", "--object-repeats", "1"]
    argv += ["--bucket-url", "s3://kvtier-nowhere/bench", "--bucket-endpoint", "http://127.0.0.1:9"]
    argv += ["--dir", str(tmp_path / "scratch"), "--out", str(tmp_path / "out")]
    assert io.main(argv) == io.EXIT_NOT_SANE
    err = capsys.readouterr().err
    assert "FAIL: kvtier_object failed in bucket: --bucket-url needs the credentials" in err, err


def test_an_lmcache_runner_that_exits_is_reported_as_exited_not_as_a_hang(tmp_path):
    """A stand-in interpreter speaks the runner's protocol (ready, then one request) and exits: the
    benchmark must say the runner exited with its code, within seconds, not wait out a timeout."""
    from kvtier.bench.lmcache_client import LMCacheSession, LMCacheUnavailable

    stand_in = tmp_path / "python"
    stand_in.write_text('#!/bin/sh\necho \'{"ready": true}\'\nread line\necho "runner: boom" >&2\nexit 3\n')
    stand_in.chmod(0o755)
    session = LMCacheSession(str(stand_in))
    started = time.monotonic()
    with pytest.raises(LMCacheUnavailable, match=r"exited \(3\) without answering"):
        session.measure({"op": "measure"}, timeout_s=120)
    assert time.monotonic() - started < 30
    session.close()
