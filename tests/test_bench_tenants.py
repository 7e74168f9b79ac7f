"""``kvtier bench tenants`` (issue 40): two tenants (``cache_salt``) on one kvtier DRAM pool, one flooding it.

Fast tests (no engine): the plan (the pool sized in blocks of the served dtype, the quiet tenant's
documents within its share), the arguments refused, the tenant counters by tenant, the judging of made-up
rows (a flood row that cost nothing, a shares row under 0.9x, hits from vLLM's own cache), the table.
The slow test runs ``kvtier bench tenants --small`` end to end through two real ``vllm serve`` servers:
with two tenants, one flooding the pool, the quiet one keeps at least 0.9x its hit rate alone with
``tenant_dram_share`` and loses hits without it (issue 40's "done when").

Run: ``.venv/bin/python -m pytest tests/test_bench_tenants.py -v`` (``-m "not slow"``: the fast ones).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from kvtier.bench import tenants, tenants_judge


def plan_of(*argv: str) -> dict[str, Any]:
    return tenants.make_plan(tenants.build_parser().parse_args(list(argv)))


def test_plan_small_and_full() -> None:
    small = plan_of("--small")
    assert (small["preset"], small["docs"], small["quiet_requests"], small["flood_per_round"]) == ("tiny", 3, 9, 10)
    assert small["rows"] == ["alone", "flood", "flood-shares"]
    assert small["start_together"]  # CI's time: two starts together take about as long as one
    # tiny in bfloat16: 2 KiB a token, a 128-token block in a 260-KiB slot; the pool is 40 of them.
    assert small["slot_bytes"] == 128 * 2048 + 4096
    assert int(small["dram_gib"] * 2**30) // small["slot_bytes"] == 40
    assert small["nvme_gib"] == 0
    assert "--dtype" in small["server_args"] and "--block-size" in small["server_args"]
    assert small["max_model_len"] == 512 + 64 + 4 + 128
    full = plan_of("--rows", "alone,flood-shares", "--share", "0.5")
    assert (full["preset"], full["doc_len"], full["share"]) == ("kv8b", 2048, 0.5)
    assert full["rows"] == ["alone", "flood-shares"]
    assert not full["start_together"] and plan_of("--start-together")["start_together"]
    assert full["slot_bytes"] == 128 * (128 << 10) + 4096


@pytest.mark.parametrize("argv", [["--small"], []])
def test_the_sizes_hold_what_the_rows_need(argv: list[str]) -> None:
    """The quiet tenant's documents fit its share of the pool; the flood between two uses of a document
    passes the pool and its ghost queue (as many entries) both; vLLM's cache holds two requests but not
    a document until its next use (the other documents' requests come between)."""
    plan = plan_of(*argv)
    pool = int(plan["dram_gib"] * 2**30) // plan["slot_bytes"]
    assert plan["quiet_blocks"] <= int(pool * plan["share"])
    flood_blocks = plan["docs"] * plan["flood_per_round"] * (plan["flood_len"] // plan["block_tokens"])
    assert flood_blocks > 2 * pool
    request_blocks = -(-(plan["doc_len"] + plan["question_len"] + plan["output_len"]) // plan["block_tokens"])
    assert 2 * request_blocks <= plan["vllm_blocks"] < plan["docs"] * request_blocks


@pytest.mark.parametrize(
    "argv",
    [["--rows", "both"], ["--rows", ","], ["--share", "0"], ["--share", "1.5"], ["--docs", "0"], ["--preset", "x"]],
)
def test_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(tenants.TenantsError):
        plan_of("--small", *argv)


def test_tenant_counters_by_tenant() -> None:
    quiet, flood = tenants.tenant_label("quiet"), tenants.tenant_label("flood")
    stats = {
        f"tenant_dram_bytes:{quiet}": 10, f"tenant_dram_evictions:{quiet}": 0, f"tenant_dram_bytes:{flood}": 30,
        f"tenant_dram_guaranteed_bytes:{flood}": 16, "tenant_dram_bytes:default": 0, "dram_hits": 4,
    }  # fmt: skip
    assert tenants.tenant_stats(stats) == {
        "quiet": {"bytes": 10, "evictions": 0},
        "flood": {"bytes": 30, "guaranteed_bytes": 16},
        "default": {"bytes": 0},
    }


def test_percentile() -> None:
    assert tenants.percentile([], 50) is None
    assert tenants.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert tenants.percentile([1.0, 2.0], 99) == pytest.approx(1.99)


def row(name: str, rate: float, cached: int = 900, local: float = 0.0, **more: Any) -> dict[str, Any]:
    return {
        "row": name, "label": tenants.ROW_LABELS[name], "problems": [], "quiet_hit_rate": rate,
        "quiet_repeat_hit_rate": rate, "quiet_cached_tokens": cached, "quiet_failed": 0, "flood_failed": 0,
        "errors": [], "vllm_cache_tokens": {"vllm_hits": local}, "quiet_ttft_ms": {"p50": 10.0, "p99": 20.0},
        **more,
    }  # fmt: skip


def shares_counters(plan: dict[str, Any], guaranteed_blocks: int) -> dict[str, Any]:
    guaranteed = guaranteed_blocks * plan["slot_bytes"]
    return {"quiet": {"bytes": 1, "guaranteed_bytes": guaranteed, "evictions": 0}, "flood": {"evictions": 300}}


def test_rows_with_the_same_options_share_a_server(tmp_path) -> None:
    plan = plan_of("--small")
    servers = tenants.row_servers(plan, tmp_path)
    assert servers["alone"] is servers["flood"] is not servers["flood-shares"]
    assert (servers["alone"].name, servers["flood-shares"].name) == ("alone", "flood-shares")
    assert servers["flood-shares"].options["tenant_dram_share"] == plan["share"]
    # each row its own documents: the second row on a server finds none of the first's
    assert tenants.quiet_prompt(plan, 0, 0)[1][:8] != tenants.quiet_prompt(plan, 0, 1)[1][:8]


def test_judge_a_run_that_shows_the_claim() -> None:
    plan = plan_of("--small")
    rows = [row("alone", 0.6), row("flood", 0.2), row("flood-shares", 0.58, tenants=shares_counters(plan, 16))]
    assert tenants.judge(plan, rows) == []
    assert rows[2]["vs_alone"] == pytest.approx(0.58 / 0.6)
    table = tenants.markdown_table(tenants.TABLE_HEADER, tenants.table_rows(rows))
    assert "flood, shares" in table and "0.97" in table


def test_judge_finds_rows_that_contradict_their_label() -> None:
    plan = plan_of("--small")
    rows = [
        row("alone", 0.6, local=500.0),  # vLLM's own cache served most hits
        row("flood", 0.58),  # the flood cost nothing: the pool holds both
        row("flood-shares", 0.4, tenants=shares_counters(plan, 8)),  # under 0.9x; documents past its share
    ]
    problems = "\n".join(tenants.judge(plan, rows))
    assert "alone: vLLM's own cache served 500" in problems
    assert "flood: the flood cost the quiet tenant no hits" in problems
    assert "the share did not protect it" in problems and "do not fit its guaranteed" in problems
    no_tenants = [row("alone", 0.6), row("flood", 0.1), row("flood-shares", 0.6, tenants={})]
    assert "no tenant counters" in "\n".join(tenants.judge(plan, no_tenants))
    failed = [row("alone", 0.0, cached=0, quiet_failed=1, errors=["URLError: refused"])]
    problems = "\n".join(tenants.judge(plan, failed))
    assert "1 requests failed (URLError: refused)" in problems and "had no hit" in problems


def test_the_nvme_plan_puts_the_documents_on_nvme_within_the_quiet_tenants_share() -> None:
    """``--nvme-regions``: the pool cut to its staging slots, the documents on NVMe within the quiet
    tenant's share of the regions, the flood past the whole tier between two uses of a document."""
    plan = plan_of("--small", "--nvme-regions", "12")
    assert (plan["kvtier_row"], plan["pool_blocks"], plan["region_blocks"]) == ("kvtier-nvme", 8, 4)
    assert plan["region_bytes"] % 4096 == 0 and plan["region_bytes"] >= 4 * plan["slot_bytes"]
    assert int(plan["nvme_gib"] * 2**30) // plan["region_bytes"] == 12
    assert plan["quiet_regions"] == 3 + 1 <= int(plan["share"] * 12)
    flood_blocks = plan["docs"] * plan["flood_per_round"] * (plan["flood_len"] // plan["block_tokens"])
    assert flood_blocks > 12 * plan["region_blocks"], "the flood passes the whole tier between two uses"
    assert tenants.row_options(plan, "flood-shares")["region_bytes"] == plan["region_bytes"]
    assert plan_of("--small")["kvtier_row"] == "kvtier-dram" and "region_bytes" not in plan_of("--small")
    short = plan_of("--small", "--nvme-regions", "8")  # a 0.4 share is 3 regions, the documents take 4
    rows = [row("alone", 0.6), row("flood", 0.1), row("flood-shares", 0.6, tenants=shares_counters(short, 0))]
    assert "take 4 NVMe regions, more than its guaranteed 3" in "\n".join(tenants.judge(short, rows))
    with pytest.raises(tenants.TenantsError):
        plan_of("--small", "--nvme-regions", "-1")


def test_the_shared_plan_puts_the_documents_on_the_shared_tier_within_the_quiet_tenants_share(tmp_path) -> None:
    """``--shared-files``: the pool cut to its staging slots, a shared tier of that many files of its own
    per server, the documents within the quiet tenant's share of its room, the flood past the whole
    tier between two uses of a document."""
    plan = plan_of("--small", "--shared-files", "24")
    assert (plan["kvtier_row"], plan["pool_blocks"], plan["file_blocks"]) == ("kvtier-dram", 8, 4)
    assert plan["file_bytes"] == 8192 + 4 * plan["slot_bytes"] and plan["nvme_gib"] == 0
    assert plan["shared_capacity_bytes"] == 24 * plan["file_bytes"]
    assert plan["quiet_files"] == 3 + 1 <= int(plan["share"] * 0.6 * 24)
    flood_blocks = plan["docs"] * plan["flood_per_round"] * (plan["flood_len"] // plan["block_tokens"])
    assert flood_blocks > 24 * plan["file_blocks"], "the flood passes the whole tier between two uses"
    options = tenants.row_options(plan, "flood-shares")
    assert options["shared_capacity_bytes"] == plan["shared_capacity_bytes"] and options["shared_grace_ms"] == 1000
    assert tenants.RowServer(plan, "alone", options, tmp_path).options["shared_root"] == str(tmp_path / "alone/shared")
    assert "shared_root" not in tenants.RowServer(plan_of("--small"), "alone", {}, tmp_path).options
    short = plan_of("--small", "--shared-files", "12")  # a 0.4 share of 0.6 of 12 is 2 files, the documents take 4
    rows = [row("alone", 0.6), row("flood", 0.1), row("flood-shares", 0.6, tenants=shares_counters(short, 0))]
    assert "take 4 shared files, more than its guaranteed 2" in "\n".join(tenants.judge(short, rows))
    for argv in (["--shared-files", "-1"], ["--shared-files", "8", "--nvme-regions", "8"]):
        with pytest.raises(tenants.TenantsError):
            plan_of("--small", *argv)
    stats = {f"tenant_shared_bytes:{tenants.tenant_label('quiet')}": 3 << 20}
    stats[f"tenant_shared_evicted_files:{tenants.tenant_label('flood')}"] = 30
    line = tenants.table_rows([row("flood-shares", 0.6, tenants=tenants.tenant_stats(stats))], shared=True)[0]
    assert len(line) == len(tenants.TABLE_HEADER + tenants_judge.SHARED_COLUMNS) and line[-2:] == ["3.0", "- / 30"]


def test_the_bucket_plan_puts_the_documents_in_the_bucket_within_the_quiet_tenants_share(tmp_path) -> None:
    """``--bucket-segments``: the pool cut to its staging slots, an object tier with a budget of that
    many segments, a prefix of its own per server, the documents within the quiet tenant's share of
    the budget's room (0.9 of it), the flood past the whole budget between two uses of a document."""
    plan = plan_of("--small", "--bucket-segments", "24")
    assert (plan["kvtier_row"], plan["pool_blocks"], plan["segment_blocks"]) == ("kvtier-dram", 8, 4)
    block_room = 128 * plan["kv_bytes_per_token"] + 4096  # tiny in bf16: 256 KiB a block, whole pages
    assert plan["segment_bytes"] == 4096 + 4 * block_room and plan["nvme_gib"] == 0
    assert plan["bucket_budget_bytes"] == 24 * plan["segment_bytes"] and plan["bucket_osd_bytes"] >= 1 << 30
    assert plan["quiet_segments"] == 3 + 1 <= int(plan["share"] * 0.9 * 24)
    flood_blocks = plan["docs"] * plan["flood_per_round"] * (plan["flood_len"] // plan["block_tokens"])
    assert flood_blocks > 24 * plan["segment_blocks"], "the flood passes the whole budget between two uses"
    options = tenants.row_options(plan, "flood-shares")
    assert options["bucket_budget_bytes"] == plan["bucket_budget_bytes"] and options["bucket_refresh_ms"] == 100
    assert options["bucket_segment_bytes"] == plan["segment_bytes"] and options["tenant_dram_share"] == 0.4
    assert plan["min_round_s"] == 1.0 and "min_round_s" not in plan_of("--small")

    class Bucket:
        def options(self, sub_prefix: str) -> dict:
            return {"bucket_url": f"s3://b/run/{sub_prefix}", "bucket_endpoint": "http://127.0.0.1:1"}

    assert tenants.RowServer(plan, "alone", options, tmp_path, Bucket()).options["bucket_url"] == "s3://b/run/alone"
    assert "bucket_url" not in tenants.RowServer(plan, "alone", options, tmp_path).options
    short = plan_of("--small", "--bucket-segments", "8")  # a 0.4 share of 0.9 of 8 is 2 segments
    rows = [row("alone", 0.6), row("flood", 0.1), row("flood-shares", 0.6, tenants=shares_counters(short, 0))]
    assert "take 4 bucket segments, more than its guaranteed 2" in "\n".join(tenants.judge(short, rows))
    for argv in (["--bucket-segments", "1"], ["--bucket-segments", "8", "--shared-files", "8"]):
        with pytest.raises(tenants.TenantsError):
            plan_of("--small", *argv)
    stats = {f"tenant_bucket_bytes:{tenants.tenant_label('quiet')}": 3 << 20}
    stats[f"tenant_bucket_evicted_segments:{tenants.tenant_label('flood')}"] = 30
    line = tenants.table_rows([row("flood-shares", 0.6, tenants=tenants.tenant_stats(stats))], bucket=True)[0]
    assert len(line) == len(tenants.TABLE_HEADER + tenants_judge.BUCKET_COLUMNS) and line[-2:] == ["3.0", "- / 30"]


def test_the_cap_row_is_named_to_run_and_judged_like_the_shares_row() -> None:
    plan = plan_of("--small", "--rows", "alone,flood,flood-cap", "--cap", "0.4")
    assert plan_of("--small")["rows"] == ["alone", "flood", "flood-shares"], "not a default row (CI's time)"
    assert tenants.row_options(plan, "flood-cap") == {"load_policy": "always", "tenant_dram_max_share": 0.4}
    counters = {"quiet": {"bytes": 1}, "flood": {"evictions": 300}}
    rows = [row("alone", 0.6), row("flood", 0.1), row("flood-cap", 0.58, tenants=counters)]
    assert tenants.judge(plan, rows) == []
    rows[2] = row("flood-cap", 0.3, tenants={})
    problems = "\n".join(tenants.judge(plan, rows))
    assert "the cap did not protect it" in problems and "no tenant counters" in problems
    tight = plan_of("--small", "--rows", "flood-cap", "--cap", "0.2")  # 8 of 40 blocks, the documents take 12
    assert "take 12 pool blocks, more than the 8" in "\n".join(tenants_judge.cap_problems(tight, rows[2], None))
    for cap in ("0", "1"):
        with pytest.raises(tenants.TenantsError):
            plan_of("--small", "--cap", cap)


def test_the_nvme_figures_by_tenant_and_in_the_table() -> None:
    quiet, flood = tenants.tenant_label("quiet"), tenants.tenant_label("flood")
    stats = {
        f"tenant_dram_bytes:{quiet}": 10, f"tenant_nvme_bytes:{quiet}": 3 << 20,
        f"tenant_nvme_reclaimed_regions:{quiet}": 0, f"tenant_nvme_reclaimed_regions:{flood}": 40,
    }  # fmt: skip
    counters = tenants.tenant_stats(stats)
    assert counters == {
        "quiet": {"bytes": 10, "nvme_bytes": 3 << 20, "nvme_reclaimed_regions": 0},
        "flood": {"nvme_reclaimed_regions": 40},
    }
    line = tenants.table_rows([row("flood-shares", 0.6, tenants=counters)], nvme=True)[0]
    assert len(line) == len(tenants.TABLE_HEADER + tenants_judge.NVME_COLUMNS)
    assert line[-2:] == ["3.0", "0 / 40"]


# --------------------------------------------------------------------------------------------
# end to end (slow): two real vllm serve servers
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_tenants_small_a_share_keeps_the_quiet_tenants_hits(tmp_path) -> None:
    try:
        import vllm  # noqa: F401
    except Exception as import_error:  # pragma: no cover - depends on the environment
        pytest.skip(f"vllm is not importable ({import_error!r})")
    out = tmp_path / "tenants"
    command = [sys.executable, "-m", "kvtier", "bench", "tenants", "--small", "--json", "--out", str(out)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    document = json.loads(completed.stdout)
    assert not document["problems"]
    alone, flood, shares = document["rows"]
    assert [record["row"] for record in document["rows"]] == ["alone", "flood", "flood-shares"]
    for record in document["rows"]:
        assert record["quiet_failed"] == 0 and record["flood_failed"] == 0
        assert record["local_hit_share"] <= tenants_judge.LOCAL_HIT_LIMIT  # hits from kvtier's pool, not vLLM's cache
        # usage's cached_tokens counts the tokens the connector loaded: vLLM's own counter agrees
        connector = record["vllm_cache_tokens"]["connector_hits"]
        assert record["quiet_cached_tokens"] == pytest.approx(connector, rel=0.1)
    assert alone["quiet_repeat_hit_rate"] > 0.8  # every repeat's document came back from the pool
    assert flood["vs_alone"] < tenants_judge.MIN_RATIO  # the flood evicts the quiet tenant without shares
    assert shares["vs_alone"] >= tenants_judge.MIN_RATIO  # issue 40's claim
    assert shares["tenants"]["quiet"]["evictions"] == 0 and shares["tenants"]["flood"]["evictions"] > 0
    assert not flood["tenants"]  # no tenant counters while the pool is not split
    assert alone["server_name"] == flood["server_name"] == "alone" and shares["server_name"] == "flood-shares"
    assert not list(out.glob("*/store"))  # each store went with its row


@pytest.mark.slow
def test_bench_tenants_small_the_bucket_split_keeps_the_quiet_tenants_hits(tmp_path) -> None:
    """``--bucket-segments``: the quiet tenant's documents come back from the object tier (Ceph's RADOS
    gateway on 127.0.0.1), a flood past the budget deletes them without shares, not with them."""
    from kvtier.bench import bucket

    if bucket.missing_reason():
        pytest.skip(str(bucket.missing_reason()))
    out, state = tmp_path / "tenants", tmp_path / "radosgw"
    command = [sys.executable, "-m", "kvtier", "bench", "tenants", "--small", "--bucket-segments", "24"]
    command += ["--rgw-state-dir", str(state), "--json", "--out", str(out)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    document = json.loads(completed.stdout)
    assert not document["problems"]
    alone, flood, shares = document["rows"]
    assert alone["kvtier"]["bucket_hits"] > 0 and alone["quiet_repeat_hit_rate"] > 0.5  # from the bucket
    assert flood["vs_alone"] < tenants_judge.MIN_RATIO and flood["kvtier"]["bucket_evicted_segments"] > 0
    assert shares["vs_alone"] >= tenants_judge.MIN_RATIO  # issue 40's claim, on the object tier
    quiet, flooding = shares["tenants"]["quiet"], shares["tenants"]["flood"]
    assert quiet.get("bucket_evicted_segments", 0) == 0 and flooding["bucket_evicted_segments"] > 0
    assert quiet["bucket_bytes"] > 0
    assert not state.exists()  # the gateway went with the run
