"""The load-or-recompute model (kvtier.vllm.costs) on its own: the prefill model fitted from steps,
step timing under asynchronous scheduling, tier rates that expire, the choice of how many leading
hits to load, and the two lookup passes the manager answers with (issue 36, item 3)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvtier.vllm.costs import (
    MIN_PREFILL_STEPS,
    PROBE_BLOCKS,
    REPROBE_S,
    EngineRequests,
    LoadDecider,
    PrefillModel,
    StepClock,
    TierRates,
    choose_blocks,
    load_s,
    prefill_ahead_s,
    probe_aside,
    step_work,
    work_of,
)

BLOCK_TOKENS = 16
# An engine that computes a token in 0.5 ms plus 2 ns per token pair of attention, 4 ms per step.
A_S, B_S, C_S = 0.004, 0.0005, 2e-9


def trained(steps: int = 64, seed: int = 1, model: PrefillModel | None = None, slower: float = 1.0) -> PrefillModel:
    rng = np.random.default_rng(seed)
    model = model or PrefillModel()
    for _ in range(steps):
        tokens = int(rng.integers(64, 4096))
        start = int(rng.integers(0, 16384))
        work = work_of(tokens, start)
        model.observe(tokens, work, slower * (A_S + B_S * tokens + C_S * work))
    return model


def test_the_prefill_model_recovers_the_engines_costs_and_waits_for_enough_steps():
    assert trained(MIN_PREFILL_STEPS - 1).recompute_s(1024) is None
    model = trained()
    a, b, c = model.coefficients
    assert a == pytest.approx(A_S, rel=0.05) and b == pytest.approx(B_S, rel=0.02) and c == pytest.approx(C_S, rel=0.05)
    # A prefix from nothing: per-token cost plus attention that grows with its own length.
    assert model.recompute_s(8192) == pytest.approx(B_S * 8192 + C_S * 8192 * 8192 / 2, rel=0.03)


def test_the_prefill_model_follows_an_engine_that_slows_down():
    model = trained(seed=2, model=trained(), slower=3.0, steps=200)  # now at a third of its speed
    assert model.recompute_s(2048) == pytest.approx(3 * (B_S * 2048 + C_S * 2048 * 2048 / 2), rel=0.05)


def test_a_step_runs_from_its_scheduling_or_the_previous_steps_end():
    clock = StepClock()
    for warmup in range(2):  # an engine's first prompt steps are its warm-up: never timed
        clock.scheduled(100, 10.0, now=-10.0 + warmup)
        assert clock.finished(now=-9.5 + warmup) is None
    clock.scheduled(100, 10.0, now=0.0)
    clock.scheduled(200, 20.0, now=0.5)  # asynchronous scheduling: scheduled while step 1 runs
    assert clock.finished(now=1.0) == (100, 10.0, 1.0)
    assert clock.finished(now=1.75) == (200, 20.0, 0.75)  # ran from 1.0, not from 0.5
    clock.scheduled(1, 1.0, now=3.0)  # the engine idled between
    assert clock.finished(now=3.25) == (1, 1.0, 0.25)
    assert clock.finished(now=4.0) is None


def test_step_work_reads_vllms_scheduler_output():
    output = SimpleNamespace(
        num_scheduled_tokens={"new": 512, "resumed": 256, "decode": 1},
        scheduled_new_reqs=[SimpleNamespace(req_id="new", num_computed_tokens=1024)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["resumed", "decode"], num_computed_tokens=[0, 4000]),
    )
    tokens, work = step_work(output)
    assert tokens == 769
    assert work == pytest.approx(work_of(512, 1024) + work_of(256, 0) + work_of(1, 4000))


def test_a_tier_rate_is_a_weighted_mean_and_is_forgotten_when_stale(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("kvtier.vllm.costs.time.monotonic", lambda: now[0])
    rates = TierRates(weight=0.5, stale_s=30)
    rates.observe("shared", 10, 1.0)
    rates.observe("shared", 10, 3.0)
    rates.observe("shared", 10, 3.0)
    # Samples 0.1, 0.3, 0.3 are medians 0.1, 0.1, 0.3: 0.1, then 0.1, then (0.1 + 0.3) / 2.
    assert rates.seconds_per_block("shared") == pytest.approx(0.2)
    now[0] += 31
    assert rates.seconds_per_block("shared") is None, "a slow tier is probed again after a while"
    rates.observe("shared", 10, 5.0)
    assert rates.seconds_per_block("shared") == pytest.approx(0.5), "a stale rate's samples are forgotten too"


def test_one_slow_sample_among_steady_ones_does_not_move_a_tier_rate_but_two_of_three_do():
    """Under load at 200 MB/s one prefetch chunk took 7x its neighbours (1.5 s a block against the
    link's 0.2): taken into the mean as it was, it tripled the bucket's rate and kept the bucket
    declined for 80 s, with throughput 0.74x always-load's. A link that really slows is still followed."""
    rates = TierRates()
    for _ in range(5):
        rates.observe("bucket", 16, 16 * 0.2)
    rates.observe("bucket", 16, 16 * 1.5)
    assert rates.seconds_per_block("bucket") == pytest.approx(0.2), "one slow chunk moved the rate"
    rates.observe("bucket", 16, 16 * 0.2)
    rates.observe("bucket", 16, 16 * 0.2)
    rates.observe("bucket", 16, 16 * 1.5)
    assert rates.seconds_per_block("bucket") == pytest.approx(0.2)
    rates.observe("bucket", 16, 16 * 1.5)
    slowed = 0.2 * 0.7 + 1.5 * 0.3
    assert rates.seconds_per_block("bucket") == pytest.approx(slowed), "a slower link ignored"
    # A link that recovers is followed at once (a declined tier is re-probed only every REPROBE_S).
    rates.observe("bucket", 16, 16 * 0.2)
    assert rates.seconds_per_block("bucket") == pytest.approx(slowed * 0.7 + 0.2 * 0.3), "a faster link ignored"
    # A rate from the costs file stands for its samples: one slow chunk after a restart moves nothing.
    restored = TierRates()
    restored.restore("bucket", 0.2, age_s=1.0)
    restored.observe("bucket", 16, 16 * 1.5)
    assert restored.seconds_per_block("bucket") == pytest.approx(0.2), "one slow chunk after a restart moved the rate"


def rates_of(**seconds_per_block: float) -> TierRates:
    rates = TierRates()
    for tier, rate in seconds_per_block.items():
        rates.observe(tier, 1, rate)
    return rates


def test_choose_blocks_loads_what_saves_time_and_recomputes_the_rest():
    model = trained()
    per_block = model.recompute_s(BLOCK_TOKENS)
    assert per_block is not None
    fast = rates_of(dram=0.0001, nvme=per_block / 10, shared=per_block / 10)
    slow = rates_of(dram=0.0001, nvme=per_block / 10, shared=per_block * 50)
    tiers = ["dram"] * 4 + ["shared"] * 8
    assert choose_blocks(tiers, BLOCK_TOKENS, model, fast) == (12, "saves")
    assert choose_blocks(tiers, BLOCK_TOKENS, model, slow) == (4, "saves"), "the DRAM part, not the slow tier"
    assert choose_blocks(["shared"] * 8, BLOCK_TOKENS, model, slow) == (0, "saves")
    # Attention grows with the prefix: a tier too slow for a short prefix pays for a long one.
    medium = rates_of(dram=0.0001, shared=1.05 * per_block)
    assert choose_blocks(["shared"] * 4, BLOCK_TOKENS, model, medium) == (0, "saves")
    long_count, _ = choose_blocks(["shared"] * 4096, BLOCK_TOKENS, model, medium)
    assert long_count == 4096
    # Unknown: a few blocks time the remote tier in the background (the unmeasured NVMe before it is
    # offered whole). Untrained: everything, as before the model.
    assert choose_blocks(["dram", "nvme"] + ["shared"] * 20, BLOCK_TOKENS, model, rates_of(dram=0.0001)) == (
        2,
        "probe_aside",
    )
    assert probe_aside(["dram", "nvme"] + ["shared"] * 20, rates_of(dram=0.0001)) == range(2, 2 + PROBE_BLOCKS)
    assert choose_blocks(["shared"] * 20, BLOCK_TOKENS, PrefillModel(), slow) == (20, "untrained")


def test_an_unmeasured_local_tier_is_offered_whole_and_only_a_remote_one_is_probed():
    """The README demo's NVMe row loaded 4 blocks of a long prefix and recomputed the rest: a local
    tier's worst case is bounded by the local disk, so one with no rate yet is loaded whole (which
    times it); a remote link can be arbitrarily slow, so only there are PROBE_BLOCKS blocks tried."""
    model = trained()
    per_block = model.recompute_s(BLOCK_TOKENS)
    assert per_block is not None
    assert PROBE_BLOCKS < 64
    assert choose_blocks(["nvme"] * 64, BLOCK_TOKENS, model, TierRates()) == (64, "probe")
    assert choose_blocks(["dram"] * 2 + ["nvme"] * 62, BLOCK_TOKENS, model, rates_of(dram=0.0001)) == (64, "probe")
    # The remote tier's rate unknown, NVMe's known: the remote one is probed aside, none loaded.
    assert choose_blocks(["shared"] * 64, BLOCK_TOKENS, model, rates_of(nvme=per_block / 10)) == (0, "probe_aside")
    # A known slow remote tier behind an unmeasured NVMe part: the NVMe part alone is loaded.
    slow_shared = rates_of(dram=0.0001, shared=per_block * 50)
    assert choose_blocks(["nvme"] * 8 + ["shared"] * 56, BLOCK_TOKENS, model, slow_shared) == (8, "probe")
    # Once measured slow, NVMe is declined like any tier; once its rate is forgotten, loaded whole again.
    slow_nvme = rates_of(dram=0.0001, nvme=per_block * 50)
    assert choose_blocks(["nvme"] * 64, BLOCK_TOKENS, model, slow_nvme) == (0, "saves")
    slow_nvme.stale_s = -1.0
    assert choose_blocks(["nvme"] * 64, BLOCK_TOKENS, model, slow_nvme) == (64, "probe")


def _step(**scheduled: tuple[int, int]) -> SimpleNamespace:
    """A scheduler output: request -> (computed before the step, tokens it computes)."""
    return SimpleNamespace(
        num_scheduled_tokens={req_id: count for req_id, (_, count) in scheduled.items()},
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(scheduled), num_computed_tokens=[start for start, _ in scheduled.values()]
        ),
    )


def test_the_engine_holds_every_request_it_was_told_of_until_it_ends():
    """A recompute delays every request the engine holds: those it runs, and those waiting for their
    load or their turn (at 200 MB/s under load, counting only the running ones recomputed prefixes
    while the others waited on the link: 0.77x the throughput of loading every hit)."""
    requests = EngineRequests()
    requests.admitted("prefilling", 4096)
    requests.admitted("waiting", 8192)  # not scheduled yet, or waiting for its load: still delayed
    requests.admitted("decoding", 1024)
    assert requests.others() == 3 and requests.others(excluding="waiting") == 2
    requests.scheduled(_step(prefilling=(0, 1024), decoding=(1024, 1)))
    assert requests.progress()["prefilling"] == (1024, 4096) and requests.progress()["waiting"] == (-1, 8192)
    requests.scheduled(_step(unknown=(0, 16)))  # a request whose arrival was not told: never counted
    assert requests.others() == 3
    requests.finished("prefilling")
    requests.finished("decoding")
    assert requests.others() == 1 and requests.others(excluding="waiting") == 0


def test_a_load_below_dram_waits_behind_the_prefetches_queued_before_it():
    """A load through a link waits for the blocks queued on it first (the prefetcher reads one chunk
    at a time): with others waiting, a link that is worth loading from when idle is not once its
    queue holds more than the recompute saves. DRAM hits wait for nothing."""
    model = trained()
    recompute = model.recompute_s(16 * BLOCK_TOKENS) or 0.0
    link = rates_of(dram=0.0001, bucket=0.5 * recompute / 16)  # loading takes half the recompute
    tiers = ["bucket"] * 16
    assert choose_blocks(tiers, BLOCK_TOKENS, model, link, others=1) == (16, "saves")
    assert choose_blocks(tiers, BLOCK_TOKENS, model, link, others=1, queued_s=1.0 * recompute) == (16, "saves")
    assert choose_blocks(tiers, BLOCK_TOKENS, model, link, others=1, queued_s=2.0 * recompute) == (0, "saves")
    assert choose_blocks(["dram"] * 4 + tiers, BLOCK_TOKENS, model, link, queued_s=9.0) == (4, "saves")
    decider = LoadDecider("auto", BLOCK_TOKENS)
    decider.prefill, decider.rates = model, link
    decider.queued_s = lambda: 2.0 * recompute
    decider.requests.admitted("other", 16 * BLOCK_TOKENS)
    keys = [bytes([i]) * 32 for i in range(16)]
    assert [decider.answer("r", key, "bucket") for key in keys] == ["retry"] * 16
    assert [decider.answer("r", key, "bucket") for key in keys] == ["decline"] * 16
    assert decider.decisions == {("bucket", "recompute"): 16}


def test_a_recompute_that_slows_other_requests_makes_a_slower_load_worth_it():
    """Under load (12 users, 4 in flight, kv8b) a 50 MB/s bucket hit loaded in 5.7 s against 3.4 s to
    recompute it alone, so kvtier recomputed it and made 0.84x the throughput of loading every hit:
    a request that recomputes lengthens the steps of every other request the engine runs, while
    one that loads waits alone."""
    model = trained()
    recompute = model.recompute_s(16 * BLOCK_TOKENS) or 0.0
    link = rates_of(dram=0.0001, bucket=1.7 * recompute / 16)  # loading takes 1.7x recomputing
    tiers = ["bucket"] * 16
    assert choose_blocks(tiers, BLOCK_TOKENS, model, link) == (0, "saves")
    assert choose_blocks(tiers, BLOCK_TOKENS, model, link, others=1) == (16, "saves")
    # A link far slower than the engine shared by three others is still declined.
    crawl = rates_of(dram=0.0001, bucket=10 * recompute / 16)
    assert choose_blocks(tiers, BLOCK_TOKENS, model, crawl, others=3) == (0, "saves")
    # The decider asks which requests the engine holds, leaving out the one it decides for.
    decider = LoadDecider("auto", BLOCK_TOKENS)
    decider.prefill, decider.rates = model, link
    for req_id in ("x", "r"):
        decider.requests.admitted(req_id, 16 * BLOCK_TOKENS)
    keys = [bytes([i]) * 32 for i in range(16)]
    assert [decider.answer("r", key, "bucket") for key in keys] == ["retry"] * 16
    assert [decider.answer("r", key, "bucket") for key in keys] == ["offer"] * 16
    assert decider.decisions == {("bucket", "load_busy"): 16}, "loaded for the other request's sake"


def test_a_request_waits_for_its_load_at_most_the_cap_times_its_recompute():
    """With many other requests held (tens on a GPU), the weight ``1 + others`` makes a load worth it
    however slow: a link 6x slower than recomputing the prefix would be loaded with 7 others, the
    request waiting 6 recomputes for them. ``max_wait_ratio`` (``load_wait_max_ratio``, 2 by default)
    bounds its wait; 0 leaves it unbounded. A DRAM run before the slow tier is still offered."""
    model = trained()
    recompute = model.recompute_s(16 * BLOCK_TOKENS) or 0.0
    six_times = rates_of(dram=0.0001, bucket=6 * recompute / 16)
    tiers = ["bucket"] * 16
    assert choose_blocks(tiers, BLOCK_TOKENS, model, six_times, others=7) == (16, "saves"), "no cap"
    assert choose_blocks(tiers, BLOCK_TOKENS, model, six_times, others=7, max_wait_ratio=2.0) == (0, "saves")
    assert choose_blocks(tiers, BLOCK_TOKENS, model, six_times, others=7, max_wait_ratio=8.0) == (16, "saves")
    # 1.7x (the 50 MB/s bucket under load, above) stays within the default cap.
    link = rates_of(dram=0.0001, bucket=1.7 * recompute / 16)
    assert choose_blocks(tiers, BLOCK_TOKENS, model, link, others=1, max_wait_ratio=2.0) == (16, "saves")
    # A queue before the load counts in its wait.
    queued = choose_blocks(tiers, BLOCK_TOKENS, model, link, others=1, queued_s=recompute, max_wait_ratio=2.0)
    assert queued == (0, "saves")
    # After a DRAM run, a few slow blocks fit within the cap (the fast run shortens the wait), not all.
    mixed = ["dram"] * 4 + tiers
    count, _ = choose_blocks(mixed, BLOCK_TOKENS, model, six_times, others=7, max_wait_ratio=2.0)
    assert 4 <= count < len(mixed)
    assert (load_s(mixed[:count], six_times) or 0.0) <= 2.0 * (model.recompute_s(count * BLOCK_TOKENS) or 0.0)
    # The decider takes the option's cap (docs/vllm.md: load_wait_max_ratio); one cap for a decider.
    decider = LoadDecider("auto", BLOCK_TOKENS)
    assert decider.max_wait_ratio == 2.0
    decider.prefill, decider.rates = model, six_times
    for req_id in [f"other-{i}" for i in range(7)] + ["r"]:
        decider.requests.admitted(req_id, 16 * BLOCK_TOKENS)
    keys = [bytes([i]) * 32 for i in range(16)]
    assert [decider.answer("r", key, "bucket") for key in keys] == ["retry"] * 16
    assert [decider.answer("r", key, "bucket") for key in keys] == ["decline"] * 16
    assert decider.decisions == {("bucket", "recompute_wait"): 16}, "the cap's declines are told apart"


def test_the_cap_counts_the_prefill_the_engine_runs_for_the_others():
    """Recomputing under load finishes after the prefill chunks vLLM runs first for the requests it
    already runs, so the cap compares a load's wait with that, not with the prefix's recompute on an
    idle engine. Measured before (32 users, the bucket at 200 MB/s, kv8b's fp32 twin): the cap alone
    declined 112-140 bucket blocks a run, kvtier's choice made 0.85x always-load's throughput, and
    always-load's TTFT p99 was the lower one (11.5 against 15.2 s)."""
    model = trained()
    recompute = model.recompute_s(16 * BLOCK_TOKENS) or 0.0
    three_times = rates_of(dram=0.0001, bucket=3 * recompute / 16)
    tiers = ["bucket"] * 16
    assert choose_blocks(tiers, BLOCK_TOKENS, model, three_times, others=3, max_wait_ratio=2.0) == (0, "saves")
    capped = choose_blocks(tiers, BLOCK_TOKENS, model, three_times, others=3, max_wait_ratio=2.0, ahead_s=recompute)
    assert capped == (16, "saves"), "waiting 3 recomputes against recomputing behind one is within the cap"
    decider = LoadDecider("auto", BLOCK_TOKENS)
    decider.prefill, decider.rates = model, three_times
    prompt = 16 * BLOCK_TOKENS
    for req_id in ("running-a", "running-b", "queued", "decoding", "r"):
        decider.requests.admitted(req_id, prompt)
    # Two run their prefill half-way, one decodes, one is not scheduled yet (it may load: not counted).
    decider.requests.scheduled(
        SimpleNamespace(
            num_scheduled_tokens={"running-a": prompt // 2, "running-b": prompt // 2, "decoding": 1},
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=["running-a", "running-b", "decoding"], num_computed_tokens=[0, 0, prompt]
            ),
        )
    )
    half = model.compute_s(prompt // 2, prompt // 2) or 0.0
    assert half > recompute / 2, "the second half attends to the first"
    assert prefill_ahead_s(decider.requests, model, excluding="r") == pytest.approx(2 * half)
    keys = [bytes([i]) * 32 for i in range(16)]
    assert [decider.answer("r", key, "bucket") for key in keys] == ["retry"] * 16
    assert [decider.answer("r", key, "bucket") for key in keys] == ["offer"] * 16
    assert decider.decisions == {("bucket", "load_busy"): 16}, "loaded for the others' sake, within the cap"


def test_the_decider_offers_dram_at_once_and_decides_the_rest_on_the_next_pass():
    decider = LoadDecider("auto", BLOCK_TOKENS)
    decider.prefill = trained()
    per_block = decider.prefill.recompute_s(BLOCK_TOKENS) or 0.0
    decider.rates = rates_of(dram=0.0001, nvme=per_block * 50)
    keys = [bytes([i]) * 32 for i in range(6)]
    # A DRAM-only request: offered in its first pass, no decision needed.
    assert [decider.answer("a", key, "dram") for key in keys[:3]] == ["offer"] * 3
    # Two DRAM hits, then NVMe: the first pass retries from the first slower block on...
    tiers = ["dram", "dram", "nvme", "nvme", "nvme", None]
    assert [decider.answer("b", key, tier) for key, tier in zip(keys, tiers, strict=True)] == [
        "offer",
        "offer",
        "retry",
        "retry",
        "retry",
        "decline",
    ]
    # ... and the pass ended at a miss: decided. NVMe is too slow here: only DRAM's two are offered.
    assert [decider.answer("b", key, tier) for key, tier in zip(keys, tiers, strict=True)][:5] == [
        "offer",
        "offer",
        "decline",
        "decline",
        "decline",
    ]
    assert decider.decisions == {("dram", "load"): 2, ("nvme", "recompute"): 3}
    decider.forget("b")
    for policy, expected in (("always", "offer"), ("never", "decline")):
        assert LoadDecider(policy, BLOCK_TOKENS).answer("c", keys[0], "nvme") == expected
    with pytest.raises(ValueError, match="load_policy"):
        LoadDecider("sometimes")


def test_a_pass_that_ends_without_a_miss_is_decided_when_the_next_one_starts():
    decider = LoadDecider("auto", BLOCK_TOKENS)
    decider.prefill = trained()
    decider.rates = rates_of(dram=0.0001, nvme=0.0)
    keys = [bytes([i]) * 32 for i in range(3)]
    assert [decider.answer("r", key, "nvme") for key in keys] == ["retry"] * 3
    assert [decider.answer("r", key, "nvme") for key in keys] == ["offer"] * 3
    assert decider.decisions == {("nvme", "load"): 3}


def test_the_decider_offers_every_hit_on_an_unmeasured_nvme_on_the_next_pass():
    decider = LoadDecider("auto", BLOCK_TOKENS)
    decider.prefill = trained()
    decider.rates = rates_of(dram=0.0001)
    keys = [bytes([i]) * 32 for i in range(12)]
    assert [decider.answer("r", key, "nvme") for key in keys] == ["retry"] * 12
    assert [decider.answer("r", key, "nvme") for key in keys] == ["offer"] * 12
    assert decider.decisions == {("nvme", "probe"): 12}


def test_a_remote_tier_with_no_rate_is_read_aside_while_the_request_recomputes_it():
    """At kv8b a 20 MB/s bucket took 6.2 s to probe on the request's path, twice a recompute: the
    hits that time an unknown remote tier are handed to the manager to read in the background."""
    decider = LoadDecider("auto", BLOCK_TOKENS)
    decider.prefill = trained()
    decider.rates = rates_of(dram=0.0001)
    keys = [bytes([i]) * 32 for i in range(10)]
    tiers = ["dram"] * 2 + ["bucket"] * 8
    first_pass = [decider.answer("r", key, tier) for key, tier in zip(keys, tiers, strict=True)]
    assert first_pass == ["offer"] * 2 + ["retry"] * 8
    assert [decider.answer("r", key, tier) for key, tier in zip(keys[:3], tiers, strict=False)] == [
        "offer",
        "offer",
        "probe_aside",  # vLLM stops at this miss: the whole probe is handed over here
    ]
    assert decider.take_probe("r") == [(key, "bucket") for key in keys[2 : 2 + PROBE_BLOCKS]]
    assert decider.take_probe("r") == [], "handed over once"
    assert decider.answer("r", keys[2], "bucket") == "decline"
    assert decider.decisions == {
        ("dram", "load"): 2,
        ("bucket", "probe_aside"): PROBE_BLOCKS,
        ("bucket", "recompute"): 8 - PROBE_BLOCKS,
    }


def test_a_tier_declined_on_an_old_rate_is_timed_again_in_the_background():
    """Declined hits give their tier no new measure: one slow chunk (seen under load at 200 MB/s, 7x
    the usual, a chunk that waited behind other work) kept the bucket declined for 80 s, until load
    after load was recomputed. Once the rate is ``REPROBE_S`` old, a request that declines the tier
    hands its first declined hits over to be read aside, which times the tier again."""
    model = trained()
    recompute = model.recompute_s(16 * BLOCK_TOKENS) or 0.0
    slow = 4 * recompute / 16  # loading the prefix would take 4 recomputes: declined
    keys = [bytes([i]) * 32 for i in range(16)]
    for age_s, expected in ((1.0, "decline"), (REPROBE_S + 1, "probe_aside")):
        decider = LoadDecider("auto", BLOCK_TOKENS)
        decider.prefill, decider.rates = model, rates_of(dram=0.0001)
        decider.rates.restore("bucket", slow, age_s)
        assert [decider.answer("r", key, "bucket") for key in keys] == ["retry"] * 16
        assert decider.answer("r", keys[0], "bucket") == expected
    assert decider.take_probe("r") == [(key, "bucket") for key in keys[:PROBE_BLOCKS]]
    assert decider.decisions == {("bucket", "probe_aside"): PROBE_BLOCKS, ("bucket", "recompute"): 12}


def test_an_untrained_decider_offers_every_hit_at_once_and_counts_each_once():
    decider = LoadDecider("auto", BLOCK_TOKENS)
    keys = [bytes([i]) * 32 for i in range(3)]
    for _ in range(2):  # a second pass (the prefetch answered HIT_PENDING) counts nothing again
        assert [decider.answer("r", key, "nvme") for key in keys] == ["offer"] * 3
    assert decider.decisions == {("nvme", "untrained"): 3}


def test_the_costs_file_carries_what_an_engine_learned_to_the_next_one(tmp_path):
    from kvtier.vllm.costs import load_costs, save_costs

    first = LoadDecider("auto", BLOCK_TOKENS)
    first.prefill = trained()
    first.rates.observe("shared", 4, 2.0)
    path = tmp_path / "costs.json"
    save_costs(first, path)
    assert path.stat().st_mode & 0o777 == 0o600
    second = LoadDecider("auto", BLOCK_TOKENS)
    assert load_costs(second, path)
    assert second.prefill.recompute_s(1024) == pytest.approx(first.prefill.recompute_s(1024))
    assert second.rates.seconds_per_block("shared") == pytest.approx(0.5)
    # Another block size is another engine configuration: nothing restored.
    assert not load_costs(LoadDecider("auto", 2 * BLOCK_TOKENS), path)


@pytest.mark.parametrize(
    "damage",
    ["truncated", "version", "nan", "shape", "huge", "symlink", "tier-name", "negative-rate"],
)
def test_a_costs_file_that_is_not_ours_in_every_detail_is_ignored(tmp_path, damage):
    import json
    import math

    from kvtier.vllm.costs import MAX_COSTS_FILE_BYTES, load_costs, save_costs

    learned = LoadDecider("auto", BLOCK_TOKENS)
    learned.prefill = trained()
    learned.rates.observe("nvme", 1, 0.01)
    path = tmp_path / "costs.json"
    save_costs(learned, path)
    document = json.loads(path.read_text())
    if damage == "truncated":
        path.write_text(path.read_text()[:40])
    elif damage == "symlink":
        target = tmp_path / "elsewhere.json"
        path.rename(target)
        path.symlink_to(target)
    elif damage == "huge":
        path.write_text(" " * (MAX_COSTS_FILE_BYTES + 1) + json.dumps(document))
    else:
        if damage == "version":
            document["version"] = 99
        elif damage == "nan":
            document["prefill"]["theta"][1] = math.nan
        elif damage == "shape":
            document["prefill"]["p"] = [[1.0, 0.0], [0.0, 1.0]]
        elif damage == "tier-name":
            document["rates"]["x" * 64] = {"seconds_per_block": 0.1, "measured_at": 0.0}
        elif damage == "negative-rate":
            document["rates"]["nvme"]["seconds_per_block"] = -1.0
        path.write_text(json.dumps(document))
    fresh = LoadDecider("auto", BLOCK_TOKENS)
    assert not load_costs(fresh, path)
    assert fresh.prefill.recompute_s(1024) is None and fresh.rates.snapshot() == {}


def test_a_step_far_slower_than_predicted_is_not_fitted_unless_the_engine_stays_slow():
    model = trained()
    per_1k = model.recompute_s(1024)
    model.observe(1024, work_of(1024, 0), 4.0)  # a pause of seconds where a step takes a fraction
    assert model.recompute_s(1024) == pytest.approx(per_1k) and model.outliers == 1
    trained(seed=3, model=model, slower=10.0, steps=100)  # the engine really is 10x slower now
    assert model.recompute_s(1024) == pytest.approx(10 * (per_1k or 0), rel=0.1)


def test_a_step_that_computes_nothing_is_not_timed():
    """vLLM reports a step with no forward pass only when a transfer finished in it: every step
    waiting on loads (nothing to compute) left an entry that paired each later output with an
    earlier step, for good (the pending list full of them, the fit fed empty steps' tokens)."""
    clock = StepClock()
    for warmup in range(2):
        clock.scheduled(100, 10.0, now=-10.0 + warmup)
        assert clock.finished(now=-9.5 + warmup) is None
    for idle in range(100):  # the engine waits on a load: empty steps, no output reaches the connector
        clock.scheduled(0, 0.0, now=idle * 0.001)
    clock.scheduled(300, 30.0, now=1.0)
    assert clock.finished(now=1.5) == (300, 30.0, 0.5)
    assert clock.finished(now=2.0) is None


def test_each_output_times_the_step_it_names():
    """Under asynchronous scheduling (vLLM's default) the next step is scheduled before an output
    arrives, and a step with nothing to compute sends an output only when a transfer finished in it:
    taking the oldest pending step for each output then timed the wrong one from the first such step
    on. The worker echoes each step's number (``StepWorkerMetadata``)."""
    clock = StepClock()
    for warmup in range(2):
        clock.scheduled(100, 10.0, now=-10.0 + warmup, step=warmup + 1)
        assert clock.finished(now=-9.5 + warmup, step=warmup + 1) is None
    clock.scheduled(100, 10.0, now=0.0, step=3)
    clock.scheduled(0, 0.0, now=0.1, step=4)  # every request waits on a load
    assert clock.finished(now=1.0, step=3) == (100, 10.0, 1.0)
    clock.scheduled(200, 20.0, now=1.1, step=5)  # scheduled before step 4's output arrives
    assert clock.finished(now=1.25, step=4) is None, "step 4's load finished: nothing to time"
    assert clock.finished(now=2.25, step=5) == (200, 20.0, 1.0)
    clock.scheduled(300, 30.0, now=3.0, step=6)
    clock.scheduled(400, 40.0, now=3.1, step=7)
    assert clock.finished(now=4.0, step=7) == (400, 40.0, pytest.approx(0.9)), "step 6's output never came: skipped"


def test_the_prefill_model_stays_finite_through_a_long_run_of_like_steps():
    """Decode steps of one batch size move the constant and per-token terms together: the
    least-squares uncertainty in that direction grew by the forgetting factor each step, overflowed
    after about 35,000 of them, and the model answered NaN for good."""
    model = trained()
    before = model.recompute_s(2048)
    for start in range(40_000):
        model.observe(1, work_of(1, 2048 + start % 4096), A_S + B_S + C_S * (2048 + start % 4096))
    after = model.recompute_s(2048)
    assert after is not None and np.isfinite(after), after
    assert after == pytest.approx(before, rel=0.2)
    assert np.all(np.isfinite(np.array(model.state()["p"], dtype=float)))


def test_a_pass_that_starts_after_where_the_last_one_did_is_a_new_pass():
    """A request waiting for a decision whose next pass starts at another of its keys (vLLM's own
    cache now holds more of its prefix: another request computed it) was answered RETRY for good:
    only a pass from the first pass's first key, or one that met a miss, was taken as new."""
    decider = LoadDecider("auto", BLOCK_TOKENS)
    decider.prefill = trained()
    decider.rates = rates_of(dram=0.0001, nvme=0.0)
    keys = [bytes([i]) * 32 for i in range(6)]
    assert [decider.answer("r", key, "nvme") for key in keys] == ["retry"] * 6
    assert [decider.answer("r", key, "nvme") for key in keys[2:]] == ["offer"] * 4
    assert decider.decisions == {("nvme", "load"): 6}
