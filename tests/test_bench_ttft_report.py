"""`kvtier bench ttft`'s summary and report from made-up measurements (no engine, fast)."""

from __future__ import annotations

from kvtier.bench import ttft

RATES = [0, 50, 100]


def plan(lengths: list[int], hit_rate_length: int) -> dict:
    return {"lengths": lengths, "hit_rates": RATES, "hit_rate_length": hit_rate_length, "repeats": 1, "preset": "tiny"}


def measurement(experiment: int, config: str, length: int, ttft_s: float, hit_rate: int | None = None) -> dict:
    record = {
        "experiment": experiment,
        "config": config,
        "length_tokens": length,
        "repeat": 0,
        "ttft_s": ttft_s,
        "cached_tokens": 0,
        "expected_cached_tokens": 0,
        "token_id": 1,
        "logprob": -1.0,
    }
    if experiment == 2:
        record["hit_rate"] = hit_rate
    return record


def experiment2_rows(the_plan: dict, measurements: list[dict]) -> tuple[dict, list[list[str]], str]:
    summary = ttft.summarize(the_plan, measurements)
    _, _, _, rows2 = ttft.table_rows(the_plan, summary)
    markdown = ttft.print_report(the_plan, summary, [])
    return summary, rows2, markdown


def test_experiment2_recompute_is_one_labeled_figure_from_experiment1(tmp_path):
    the_plan = plan([512, 1024], 1024)
    measurements = [measurement(1, "recompute", 512, 0.2), measurement(1, "recompute", 1024, 0.5)]
    measurements += [measurement(2, "kvtier_dram", 1024, 0.5 - rate / 1000, rate) for rate in RATES]
    summary, rows2, markdown = experiment2_rows(the_plan, measurements)
    # No recompute cell per hit rate: a figure measured once is not shown as several measurements.
    assert "recompute" not in summary["experiment2"]
    assert [row[0] for row in rows2] == [ttft.CONFIG_LABELS["kvtier_dram"]]
    reference = summary["experiment2_recompute"]
    assert reference["from_experiment"] == 1 and reference["length_tokens"] == 1024
    assert reference["ttft_s"] == summary["experiment1"]["recompute"]["1024"]["ttft_s"]
    assert markdown.count("recompute (no kvtier) at 1024 tokens: 500 (500-500) ms, one figure for every hit rate") == 1
    # The plot draws it as one reference line (needs matplotlib, which the bench extra installs).
    if "ttft_vs_hit_rate.png" in ttft.write_plots(the_plan, summary, tmp_path):
        assert (tmp_path / "ttft_vs_hit_rate.png").stat().st_size > 0


def test_experiment2_recompute_measured_by_experiment2_when_its_length_is_not_in_experiment1():
    the_plan = plan([512], 1024)
    measurements = [measurement(1, "recompute", 512, 0.2), measurement(2, "recompute", 1024, 0.7)]
    measurements += [measurement(2, "vllm_prefix", 1024, 0.6, rate) for rate in RATES]
    summary, rows2, markdown = experiment2_rows(the_plan, measurements)
    assert "recompute" not in summary["experiment2"]
    assert [row[0] for row in rows2] == [ttft.CONFIG_LABELS["vllm_prefix"]]
    assert set(summary["experiment2"]["vllm_prefix"]) == {"0", "50", "100"}
    assert summary["experiment2_recompute"]["from_experiment"] == 2
    assert summary["experiment2_recompute"]["ttft_s"]["median"] == 0.7
    assert "measured in experiment 2" in markdown


def shared_run(token_id: int, problem: str | None = None, repeats: int = 1) -> tuple[dict, dict, list[dict]]:
    """A plan with the kvtier_shared row, and its recompute and shared-tier measurements at 512 tokens."""
    the_plan = {**plan([512], 0), "hit_rates": [], "repeats": repeats, "shared": {"store_root": "a", "load_root": "b"}}
    recompute = {**measurement(1, "recompute", 512, 0.5), "prompt_id": "p:512:0"}
    shared = {**measurement(1, "kvtier_shared", 512, 0.1), "prompt_id": "p:512:0", "token_id": token_id}
    shared.update(cached_tokens=512, expected_cached_tokens=512)
    if problem:
        shared["problem"] = problem
    measurements = [recompute, shared]
    return the_plan, ttft.summarize(the_plan, measurements), measurements


def test_shared_row_passes_when_every_check_holds():
    the_plan, summary, measurements = shared_run(token_id=1)
    assert ttft.shared_row_failures(the_plan, summary, measurements) == []
    names = [target["name"] for target in summary["targets"]]
    assert "kvtier shared-tier hit / recompute" in names
    rows1 = ttft.table_rows(the_plan, summary)[1]
    assert [row[0] for row in rows1] == [ttft.CONFIG_LABELS["recompute"], ttft.CONFIG_LABELS["kvtier_shared"]]


def test_shared_row_fails_on_another_token_a_block_not_from_the_shared_tier_or_a_missing_repeat():
    the_plan, summary, measurements = shared_run(token_id=2)
    (failure,) = ttft.shared_row_failures(the_plan, summary, measurements)
    assert "p:512:0: token 2" in failure
    the_plan, summary, measurements = shared_run(token_id=1, problem="3 of 4 blocks served from shared")
    (failure,) = ttft.shared_row_failures(the_plan, summary, measurements)
    assert "3 of 4 blocks served from shared" in failure
    the_plan, summary, measurements = shared_run(token_id=1, repeats=2)
    (failure,) = ttft.shared_row_failures(the_plan, summary, measurements)
    assert failure == "1 of 2 repeats measured at 512 tokens"


def test_object_row_is_checked_like_the_shared_row():
    the_plan = {**plan([512], 0), "hit_rates": [], "object": {"bucket_url": "s3://b/p", "bucket_endpoint": "http://x"}}
    recompute = {**measurement(1, "recompute", 512, 0.5), "prompt_id": "p:512:0"}
    hit = {**measurement(1, "kvtier_object", 512, 0.2), "prompt_id": "p:512:0", "token_id": 3}
    hit.update(cached_tokens=512, expected_cached_tokens=512)
    summary = ttft.summarize(the_plan, [recompute, hit])
    (failure,) = ttft.shared_row_failures(the_plan, summary, [recompute, hit], "kvtier_object")
    assert "p:512:0: token 3" in failure
    assert ttft.shared_row_failures(the_plan, summary, [recompute, hit]) == []  # no kvtier_shared row planned
    assert "kvtier object-tier hit / recompute" in [target["name"] for target in summary["targets"]]
    rows1 = ttft.table_rows(the_plan, summary)[1]
    assert [row[0] for row in rows1] == [ttft.CONFIG_LABELS["recompute"], ttft.CONFIG_LABELS["kvtier_object"]]


def test_a_restored_row_may_match_vllms_own_prefix_hit_instead_of_recompute():
    """In bf16 a cached prefix moves the logprob off recompute's (vLLM's own prefix cache does it):
    a row that matches vLLM's prefix hit of the same prompt is right; one that matches neither is not."""
    the_plan, summary, measurements = shared_run(token_id=1)
    prefix_hit = {**measurement(1, "vllm_prefix", 512, 0.05), "prompt_id": "p:512:0", "logprob": -1.031}
    measurements[1]["logprob"] = -1.031  # the shared-tier hit, 0.031 off recompute's -1.0
    assert ttft.shared_row_failures(the_plan, summary, [*measurements, prefix_hit]) == []
    (failure,) = ttft.shared_row_failures(the_plan, summary, measurements)
    assert "p:512:0: token 1 (logprob -1.031)" in failure, "no prefix hit to compare with: recompute's logprob rules"
    prefix_hit["logprob"] = -1.05
    (failure,) = ttft.shared_row_failures(the_plan, summary, [*measurements, prefix_hit])
    assert "against recompute's 1 (-1.0)" in failure


def test_encrypted_nvme_row_is_compared_with_the_clear_nvme_hit_per_length():
    the_plan = {**plan([512, 1024], 0), "hit_rates": [], "encrypted": True}
    measurements = [measurement(1, "kvtier_nvme", 512, 0.100), measurement(1, "kvtier_nvme", 1024, 0.200)]
    measurements += [measurement(1, "kvtier_nvme_encrypted", 512, 0.110)]  # none at 1024 tokens
    summary = ttft.summarize(the_plan, measurements)
    at_512, at_1024 = summary["encryption"]
    assert at_512["length_tokens"] == 512 and at_512["encrypted_median_s"] == 0.110
    assert at_512["clear_median_s"] == 0.100 and abs(at_512["encrypted_over_clear"] - 1.1) < 1e-9
    assert at_1024["encrypted_median_s"] is None and at_1024["encrypted_over_clear"] is None
    figures = [target for target in summary["targets"] if target.get("issue") == 40]
    assert [(target["length_tokens"], target["note"]) for target in figures] == [
        (512, None), (1024, "a row was not measured at this length")
    ]  # fmt: skip
    assert figures[0]["name"] == "kvtier encrypted NVMe hit / kvtier NVMe hit" and figures[0]["target_at_most"] is None
    rows1 = ttft.table_rows(the_plan, summary)[1]
    assert [row[0] for row in rows1] == [ttft.CONFIG_LABELS["kvtier_nvme"], ttft.CONFIG_LABELS["kvtier_nvme_encrypted"]]
    markdown = ttft.print_report(the_plan, summary, [])
    assert "| 512 tok | 100 | 110 | 1.100 |" in markdown
    assert "| 1024 tok | 200 | - | - |" in markdown
    assert "kvtier encrypted NVMe hit / kvtier NVMe hit at 512 tokens: 1.100" in markdown


def test_no_encryption_section_without_the_flag():
    the_plan = {**plan([512], 0), "hit_rates": []}
    summary = ttft.summarize(the_plan, [measurement(1, "kvtier_nvme", 512, 0.1)])
    assert summary["encryption"] is None
    assert not [target for target in summary["targets"] if target.get("issue") == 40]
    assert "Encryption at rest" not in ttft.print_report(the_plan, summary, [])


def test_encrypted_object_row_is_compared_with_the_clear_object_hit_and_checked_like_it():
    """With --object --encrypted: the encrypted object-tier hit per length against the clear one (beside
    the NVMe pair, each in a table of its own), and the row checked like kvtier_object's."""
    the_plan = {**plan([512], 0), "hit_rates": [], "encrypted": True}
    the_plan["object"] = {"bucket_url": "s3://b/p", "bucket_endpoint": "http://x"}
    recompute = {**measurement(1, "recompute", 512, 0.5), "prompt_id": "p:512:0"}
    hits = [
        {**measurement(1, config, 512, seconds), "prompt_id": "p:512:0", "token_id": token}
        for config, seconds, token in (("kvtier_object", 0.200, 1), ("kvtier_object_encrypted", 0.230, 4))
    ]
    for hit in hits:
        hit.update(cached_tokens=512, expected_cached_tokens=512)
    measurements = [recompute, measurement(1, "kvtier_nvme", 512, 0.1), *hits]
    summary = ttft.summarize(the_plan, measurements)
    nvme, bucket = summary["encryption"]
    assert (nvme["tier"], nvme["encrypted_median_s"]) == ("nvme", None)
    assert bucket["tier"] == "object" and abs(bucket["encrypted_over_clear"] - 1.15) < 1e-9
    names = [target["name"] for target in summary["targets"] if target.get("issue") == 40]
    assert names == [
        "kvtier encrypted NVMe hit / kvtier NVMe hit",
        "kvtier encrypted object-tier hit / kvtier object-tier hit",
    ]
    (failure,) = ttft.shared_row_failures(the_plan, summary, measurements, "kvtier_object_encrypted")
    assert "p:512:0: token 4" in failure, "a wrong token on the encrypted row fails it"
    assert ttft.shared_row_failures(the_plan, summary, measurements, "kvtier_object") == []
    markdown = ttft.print_report(the_plan, summary, [])
    assert "| 512 tok | 200 | 230 | 1.150 |" in markdown and "object-tier hit with encryption_key_file" in markdown
    rows1 = ttft.table_rows(the_plan, summary)[1]
    assert ttft.CONFIG_LABELS["kvtier_object_encrypted"] in [row[0] for row in rows1]
    the_plan["encrypted"] = False
    assert ttft.shared_row_failures(the_plan, summary, measurements, "kvtier_object_encrypted") == [], "not planned"
