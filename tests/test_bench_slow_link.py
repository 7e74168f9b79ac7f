"""The slow-link rows of `kvtier bench ttft --slow-link` and `kvtier bench serve --slow-link`, without an
engine: the options and their refusals, the order of the phases and rows (node A first, per speed
always-load then kvtier's choice), the costs files put back to node A's at each speed, and the
summaries and checks on made-up records (an always-load run that recomputed fails, a choice to
recompute passes, a wrong output fails, decisions that miss blocks fail). Under a second, no engine.
The end-to-end run is in tests/test_bench_ttft.py (test_slow_link_rows[remote], with KVTIER_FULL_TESTS=1)."""

from __future__ import annotations

import json

import pytest

from kvtier.bench import serve, serve_slow
from kvtier.bench.ttft.plan import BenchError, build_parser, slow_link_plan
from kvtier.bench.ttft.slow_rows import (
    NODE_A_COSTS,
    SlowLinks,
    slow_link_failures,
    slow_link_markdown,
    slow_link_phases,
    summarize_slow_link,
)


def _slow_plan(*argv: str):
    return slow_link_plan(build_parser().parse_args(list(argv)))


def test_ttft_options_plan_the_link_speeds_or_say_the_fix():
    assert _slow_plan() is None
    plan = _slow_plan("--object", "--slow-link", "200,20,50", "--slow-link-latency-ms", "40")
    assert plan == {"rates_mb_per_s": [200.0, 20.0, 50.0], "latency_ms": 40.0, "tiers": ["object"]}
    with pytest.raises(BenchError, match=r"add --object .* or --shared-root-store"):
        _slow_plan("--slow-link", "20")
    with pytest.raises(BenchError, match="--slow-link-latency-ms goes with --slow-link"):
        _slow_plan("--slow-link-latency-ms", "10")
    with pytest.raises(BenchError, match="MB/s"):
        _slow_plan("--object", "--slow-link", "fast")
    with pytest.raises(BenchError, match="latency"):
        _slow_plan("--object", "--slow-link", "20", "--slow-link-latency-ms", "-1")


def _plan(tmp_path, rates=(2.0,), repeats=2):
    return {
        "slow_link": {"rates_mb_per_s": list(rates), "latency_ms": 20.0, "tiers": ["object"]},
        "lengths": [512, 1024], "repeats": repeats, "block_tokens": 128, "out_dir": str(tmp_path / "out"),
        "runtime_dir": str(tmp_path / "run"), "object": {"bucket_endpoint": "http://127.0.0.1:1"},
    }  # fmt: skip


def test_phases_go_per_speed_then_repeat_then_length_always_before_auto(tmp_path):
    phases = slow_link_phases(_plan(tmp_path, rates=(20.0, 200.0)), "object")
    assert len(phases) == 2 * 2 * 2 * 2
    assert [item for _, _, item in phases[:4]] == [
        [512, 0, 20.0, "always"], [512, 0, 20.0, "auto"], [1024, 0, 20.0, "always"], [1024, 0, 20.0, "auto"],
    ]  # fmt: skip
    assert phases[8][2] == [512, 0, 200.0, "always"] and phases[0][1] == "kvtier_object_slow-20MBps-always-512-r0"
    assert slow_link_phases({"slow_link": None}, "object") == []
    assert slow_link_phases(_plan(tmp_path), "shared") == [], "the shared tier was not asked for"


def test_each_speed_starts_from_the_costs_node_a_left(tmp_path):
    plan = _plan(tmp_path)
    costs = tmp_path / "run" / "kvtier"
    costs.mkdir(parents=True)
    (tmp_path / "out" / "logs").mkdir(parents=True)
    (costs / "costs-abc.json").write_text('{"node": "a"}')
    (costs / "service.sock").write_text("")
    links = SlowLinks(plan, lambda _message: None)
    links.after_phase("kvtier_object_store")
    assert [p.name for p in (tmp_path / "out" / NODE_A_COSTS / "object").iterdir()] == ["costs-abc.json"]
    (costs / "costs-abc.json").write_text('{"node": "b, learned a rate"}')
    (costs / "costs-other.json").write_text("{}")
    assert links.plan_for("kvtier_object_load", [512, 0], plan) is plan  # not a slow phase: as planned
    with pytest.raises(BenchError, match=r"127\.0\.0\.1"):  # the link starts here; nothing listens on port 1
        links.plan_for("kvtier_object_slow", [512, 0, 2.0, "auto"], {**plan, "object": {"bucket_endpoint": "s3.x:1"}})
    assert sorted(p.name for p in costs.glob("costs-*")) == ["costs-abc.json"]
    assert json.loads((costs / "costs-abc.json").read_text()) == {"node": "a"}
    links.plan_for("kvtier_shared_store", None, plan)  # another tier's node A: a chain of its own
    assert not list(costs.glob("costs-*"))
    links.close()


def _record(policy, length, repeat, ttft_s, cached, decisions, token=7, problem=None):
    blocks = length // 128
    offered = sum(n for key, n in decisions.items() if key.split(":")[1] in ("load", "probe", "untrained"))
    record = {
        "experiment": "slow_link", "config": f"kvtier_object_{policy}", "tier": "object", "policy": policy,
        "link_mb_per_s": 2.0, "length_tokens": length, "repeat": repeat, "prompt_id": f"p:{length}:{repeat}",
        "ttft_s": ttft_s,
        "cached_tokens": cached, "token_id": token, "logprob": -1.0, "decisions": decisions,
        "decided_blocks": sum(decisions.values()) if policy == "auto" else blocks, "offered_tokens": offered * 128,
        "kvtier": {"bucket_hits": cached // 128}, "believed": {"predicted_recompute_s": 0.05, "predicted_load_s": 1.0},
    }  # fmt: skip
    if problem:
        record["problem"] = problem
    return record


def _measurements():
    records = []
    for length in (512, 1024):
        for repeat in (0, 1):
            base = {"experiment": 1, "length_tokens": length, "repeat": repeat, "prompt_id": f"p:{length}:{repeat}",
                    "token_id": 7, "logprob": -1.0, "cached_tokens": 0, "expected_cached_tokens": 0}  # fmt: skip
            records.append({**base, "config": "recompute", "ttft_s": 0.1})
            records.append(_record("always", length, repeat, 2.0, length, {}))
            probe = {"shared:probe": 4, "shared:recompute": length // 128 - 4}
            declined = {"shared:recompute": length // 128}
            probed = (length, repeat) == (512, 0)  # the speed's first run of kvtier's choice: a probe
            records.append(_record("auto", length, repeat, 0.5 if probed else 0.1, 512 if probed else 0,
                                   probe if probed else declined))  # fmt: skip
    return records


def _summary(records):
    return {"experiment1": {"recompute": {str(n): {"ttft_s": {"median": 0.1, "min": 0.1, "max": 0.1, "n": 2},
                                                   "problems": []} for n in (512, 1024)}}}  # fmt: skip


def test_a_choice_to_recompute_passes_and_the_report_says_which_runs_probed(tmp_path):
    plan, records = _plan(tmp_path), _measurements()
    assert slow_link_failures(plan, records) == []
    slow = summarize_slow_link(plan, records, _summary(records))
    assert slow is not None
    auto = slow["points"]["object"]["2"]["auto"]["512"]
    assert auto["probe_repeats"] == [0] and auto["decisions"] == {"shared:probe": 4, "shared:recompute": 4}
    (target,) = [t for t in slow["targets"] if t["length_tokens"] == 1024]
    assert target["better"] == "recompute" and target["value"] == pytest.approx(1.0) and target["met"]
    text = "\n".join(slow_link_markdown(plan, slow, _summary(records)))
    assert "recompute (vLLM alone)" in text and "always-load" in text and "kvtier's choice (auto)" in text
    assert "| 2 MB/s | 512 |" in text and "r0" in text


def test_rows_whose_data_contradict_their_label_fail(tmp_path):
    plan, records = _plan(tmp_path), _measurements()
    always = next(r for r in records if r.get("policy") == "always")
    always.update(cached_tokens=256, problem="2 of 4 blocks served from shared (bucket_hits)")
    auto = next(r for r in records if r.get("policy") == "auto" and r["repeat"] == 1)
    auto["decided_blocks"] = 1
    wrong = next(r for r in records if r.get("policy") == "auto" and r["repeat"] == 0 and r["length_tokens"] == 1024)
    wrong["token_id"] = 8
    failures = slow_link_failures(plan, [r for r in records if r is not records[-1]])
    text = "\n".join(failures)
    assert "always-load served 256 of 512 tokens" in text and "bucket_hits" in text
    assert "kvtier decided on 1 of the prompt's" in text
    assert "token 8" in text and "recompute's 7" in text
    assert "object tier, auto at 2 MB/s, 1024 tokens: 1 of 2 repeats measured" in text


def test_serve_rows_expand_per_speed_after_node_a():
    rows = serve_slow.expand_rows(["vllm", "kvtier-object-always", "kvtier-object-auto", "vllm"], "20,200")
    assert rows == [
        "vllm", "kvtier-object-publish", "kvtier-object-always@20", "kvtier-object-auto@20",
        "kvtier-object-always@200", "kvtier-object-auto@200", "vllm",
    ]  # fmt: skip
    with pytest.raises(serve_slow.SlowRowsError, match="add --slow-link"):
        serve_slow.expand_rows(["kvtier-object-auto"], None)
    with pytest.raises(serve_slow.SlowRowsError, match="name them in --rows"):
        serve_slow.expand_rows(["vllm"], "20")
    assert serve_slow.expand_rows(["vllm", "kvtier-dram"], None) == ["vllm", "kvtier-dram"]
    # A slow row named twice ran once, in silence (asked for three repeats, a run got one).
    with pytest.raises(serve_slow.SlowRowsError, match="run once per speed"):
        serve_slow.expand_rows(["vllm", "kvtier-object-auto", "vllm", "kvtier-object-auto"], "200")


def test_serve_plan_with_a_slow_link():
    plan = serve.make_plan(serve.build_parser().parse_args(["--small", "--slow-link", "4"]))
    assert plan["users"] == [12] and plan["slow_link_latency_ms"] == 30.0
    assert plan["rows"] == ["vllm", "kvtier-object-publish", "kvtier-object-always@4", "kvtier-object-auto@4"]
    assert plan["bucket_osd_bytes"] > 12 * 512 * 4096
    assert serve.row_title("kvtier-object-auto@4") == "kvtier's choice (auto), 4 MB/s"
    assert serve.store_options("kvtier-object-auto@4", plan, serve.Path("/s"))["nvme_bytes"] == 0
    with pytest.raises(serve.BenchError, match="go with --slow-link"):
        serve.make_plan(serve.build_parser().parse_args(["--bucket-url", "s3://b"]))


def test_serve_reads_the_decisions_and_judges_the_choice():
    assert serve_slow._decision_key('model_name="tiny",tier="shared",choice="probe"') == "shared:probe"
    assert serve_slow.decisions_delta({"shared:load": 2.0}, {"shared:load": 5.0, "dram:load": 1.0}) == {
        "shared:load": 3,
        "dram:load": 1,
    }
    document = {"rows": [
        {"row": "vllm", "points": [{"users": 12, "request_throughput": 1.0}]},
        {"row": "kvtier-object-always@20", "points": [{"users": 12, "request_throughput": 0.5}]},
        {"row": "kvtier-object-auto@20", "points": [{"users": 12, "request_throughput": 0.98}]},
    ]}  # fmt: skip
    (judged,) = serve_slow.judged(document)
    assert judged["better"] == "vLLM alone" and judged["auto_over_best"] == pytest.approx(0.98) and judged["met"]
    points = [{"users": 12, "kvtier": {"bucket_hits": 0}, "load_decisions": {}}]
    assert serve_slow.row_problems("kvtier-object-always@20", points) == ["always-load loaded no block from the bucket"]
    assert "no load decision" in serve_slow.row_problems("kvtier-object-auto@20", points)[0]
    assert "published no segment" in serve_slow.row_problems("kvtier-object-publish", points)[0]
    assert serve_slow.row_problems("kvtier-dram", points) == []
    mount_points = [{"users": 12, "kvtier": {"shared_hits": 0, "shared_files_published": 0}, "load_decisions": {}}]
    assert serve_slow.row_problems("kvtier-mount-always@20", mount_points) == [
        "always-load loaded no block from the shared directory"
    ]
    assert serve_slow.row_problems("kvtier-mount-publish", mount_points) == [], "checked after the row instead"
    document["rows"] += [
        {"row": "kvtier-mount-always@20", "points": [{"users": 12, "request_throughput": 1.2}]},
        {"row": "kvtier-mount-auto@20", "points": [{"users": 12, "request_throughput": 1.1}]},
    ]
    bucket_row, mount_row = serve_slow.judged(document)
    assert (bucket_row["tier"], mount_row["tier"]) == ("bucket", "shared")
    assert mount_row["better"] == "always-load" and mount_row["auto_over_best"] == pytest.approx(1.1 / 1.2)


def test_node_a_of_the_slow_mount_is_checked_for_files_after_its_row(tmp_path):
    """The shared tier publishes a file once it is full or when the store closes: node A's row is judged
    by the files in the run's shared directory once its server stopped, not by a point's counters."""
    plan = {"slow_link_latency_ms": 30.0}
    with serve_slow.SlowTierRows(plan, tmp_path, lambda _: None) as rows:
        assert rows.options("kvtier-mount-publish") == {
            "shared_root": str(tmp_path / "slow-mount" / "source"), "load_policy": "auto",
        }  # fmt: skip
        record: dict = {"problems": []}
        rows.row_done("kvtier-mount-publish", record)
        assert record["problems"] == [
            "node A published no file to the shared directory: the slow rows would read nothing"
        ]
        data = tmp_path / "slow-mount" / "source" / "0123abcd" / "data" / "ab"  # <namespace>/data/<xx>/
        data.mkdir(parents=True)
        (data / "file").write_bytes(b"x")
        record = {"problems": []}
        rows.row_done("kvtier-mount-publish", record)
        assert record["problems"] == []
    assert not (tmp_path / "slow-mount").exists()


def test_serve_plan_with_a_slow_mount():
    """`--slow-mount`: the shared tier's rows, node A first, each speed's pair after; not with --slow-link."""
    plan = serve.make_plan(serve.build_parser().parse_args(["--small", "--slow-mount", "4,50"]))
    assert plan["users"] == [12] and plan["slow_mount"] == "4,50" and "bucket_osd_bytes" not in plan
    assert plan["rows"] == [
        "vllm", "kvtier-mount-publish", "kvtier-mount-always@4", "kvtier-mount-auto@4",
        "kvtier-mount-always@50", "kvtier-mount-auto@50",
    ]  # fmt: skip
    assert serve.row_title("kvtier-mount-auto@4") == "kvtier's choice (auto), slow mount, 4 MB/s"
    assert serve.store_options("kvtier-mount-always@4", plan, serve.Path("/s"))["nvme_bytes"] == 0
    assert serve_slow.is_auto_row("kvtier-mount-auto@4") and not serve_slow.is_auto_row("kvtier-mount-always@4")
    with pytest.raises(serve.BenchError, match="give one of them"):
        serve.make_plan(serve.build_parser().parse_args(["--slow-mount", "4", "--slow-link", "4"]))
    with pytest.raises(serve.BenchError, match="add --slow-mount"):
        serve.make_plan(serve.build_parser().parse_args(["--rows", "kvtier-mount-auto"]))
