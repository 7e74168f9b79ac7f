"""Load or recompute: what a prefix costs to recompute now, what each tier takes to deliver it now,
and how many of a request's leading blocks are worth loading (docs/vllm.md, "Load or recompute").

Three parts, each fed online on the scheduler's side:

- ``PrefillModel``: a forward step's seconds against its work, ``a + b·N + c·W``, where ``N`` is the
  tokens the step computes and ``W`` their attention work (each request's new tokens times the
  context they attend to, ``n·(start + n/2)``). Fitted by recursive least squares with forgetting
  from vLLM's own steps (``KvtierConnector`` times them), so it follows the engine as load and
  context lengths change. Recomputing a prefix of ``n`` tokens then costs ``b·n + c·n²/2`` (the
  step's fixed part ``a`` is paid anyway).
- ``TierRates``: seconds per block each tier delivered recently (an exponentially weighted mean of
  what prefetches and loads took, queueing included, each sample first replaced by the median of the
  last ``RATE_MEDIAN_OF`` where that is lower: one chunk that waited behind other work does not move
  the rate, two of three do, a fast one does at once). A tier whose hits are declined is timed
  again in the background once its rate is ``REPROBE_S`` old (``reprobe``); a rate not refreshed
  for ``stale_s`` is forgotten: a remote tier is then probed again with a few blocks, a local one
  loaded whole again.
- ``EngineRequests``: the requests the engine holds now. A recompute delays every one of them; a load
  runs beside the engine and delays only the request that waits for it, behind the loads queued on
  its link before it.
- ``choose_blocks``: of a request's ``n`` leading hits on their tiers, the count that saves the most
  time: the largest saving ``(1 + others)·recompute(k) - queued - load(k)`` over ``k``, where ``others``
  is how many other requests the engine holds and ``queued`` what the prefetches queued before it
  take (only for ``k`` reaching below DRAM); 0 when no ``k`` saves anything. A ``k`` whose wait
  (``queued + load(k)``) exceeds ``max_wait_ratio`` times what recomputing would take it now
  (``recompute(k)`` after the prefill the engine runs for the others, ``prefill_ahead_s``) is not
  offered: the others make a load worth more than the request's own time, and this bounds what it
  pays for them.

Nothing here talks to vLLM or to the service: ``KvtierManager`` asks, ``KvtierConnector`` and the
prefetcher feed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvtier import tiers
from kvtier.vllm.options import INTEGRATION_OPTION_DEFAULTS, LOAD_POLICIES

logger = logging.getLogger("kvtier.vllm")

# Blocks offered from a remote tier whose rate is unknown (never measured, or forgotten): enough to
# time it, few enough that a slow tier costs little.
PROBE_BLOCKS = 4
# A tier whose hits are declined is timed again (``PROBE_BLOCKS`` read aside) once its rate is this
# old: declined, it gets no new measure, so one slow one (a chunk that waited behind other work, a
# link that recovered since) would otherwise keep it declined until the rate is forgotten (``stale_s``).
# Seen under load at 200 MB/s: one chunk timed at 7x the usual kept the bucket declined for 80 s.
REPROBE_S = 15.0
# A tier's rate takes the median of its last this many samples (the lower middle one while it has
# fewer) where that is below the sample, not each raw sample: under load at 200 MB/s one chunk timed
# at 7x its neighbours (the link 0.08 s/block, the chunk 1.5) tripled the mean at a weight of 0.3 and
# declined the bucket for 80 s.
# A slower link is still followed: two slow samples of the last three are the median; a faster one
# at once.
RATE_MEDIAN_OF = 3
# Tiers on this host. One of them with no rate yet is not probed but offered whole: its worst case is
# bounded by the local disk, so a probe (which recomputes all but a few blocks of a long prefix) costs
# more than it can save. A remote link can be arbitrarily slow (issue 36's 40 MB/s gateway): only
# there is a probe worth its cost. Any other tier name (``shared``: the shared-filesystem tier;
# ``bucket``: the object tier) counts as remote, each with a rate of its own.
LOCAL_TIERS = frozenset(tiers.ALL) - tiers.REMOTE
# The prefill model answers once it has seen this many steps that computed prompt tokens.
MIN_PREFILL_STEPS = 8
# A step slower than OUTLIER_FACTOR times the prediction (at least OUTLIER_FLOOR_S) is not fitted: an
# engine's first steps (warm-up: allocations, lazy initialization; seconds where a step takes tens of
# milliseconds) would otherwise dominate the fit. OUTLIER_RUN such steps in a row are fitted.
OUTLIER_FACTOR = 5.0
OUTLIER_FLOOR_S = 0.005
OUTLIER_RUN = 3
# The first steps an engine times are its warm-up, whatever the model says: never fitted.
WARMUP_STEPS = 2
# Features are scaled so that the least-squares state stays well conditioned.
_TOKENS_SCALE = 1e-3
_WORK_SCALE = 1e-6
# The least-squares state's uncertainty at the start (per coefficient), and its bound ever after.
_P_START = 1e4
_P_MAX_TRACE = 3 * _P_START


class PrefillModel:
    """``seconds = a + b·tokens + c·attention_work`` of a forward step, fitted online."""

    def __init__(self, forgetting: float = 0.98):
        self._forgetting = forgetting
        self._theta = np.zeros(3)
        self._p = np.eye(3) * _P_START
        self._lock = threading.Lock()
        self.prefill_steps = 0
        self.outliers = 0
        self._outliers_in_a_row = 0

    def observe(self, tokens: int, attention_work: float, seconds: float) -> None:
        """One step: ``tokens`` computed, their ``attention_work`` (``work_of``), wall ``seconds``.
        Once trained, a step far slower than predicted (an engine's warm-up, a pause) is not fitted,
        unless more than ``OUTLIER_RUN`` come in a row: then the engine really is slower now, and
        they are fitted until a step fits the prediction again."""
        if tokens <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        x = np.array([1.0, tokens * _TOKENS_SCALE, attention_work * _WORK_SCALE])
        with self._lock:
            if self.prefill_steps >= MIN_PREFILL_STEPS:
                predicted = max(float(x @ self._theta), OUTLIER_FLOOR_S)
                outlier = seconds > OUTLIER_FACTOR * predicted
                self._outliers_in_a_row = self._outliers_in_a_row + 1 if outlier else 0
                if outlier and self._outliers_in_a_row <= OUTLIER_RUN:
                    self.outliers += 1
                    return
            self._fit(x, seconds)
            if tokens > 1:
                self.prefill_steps += 1

    def _fit(self, x: np.ndarray, seconds: float) -> None:
        """One recursive least-squares step with forgetting. Steps that all look alike (decode steps
        of one batch size: constant and per-token terms move together) leave a direction unlearned,
        whose uncertainty forgetting grows every step until it overflows; it is held at the start's,
        and a step that would leave anything non-finite is not fitted."""
        px = self._p @ x
        gain = px / (self._forgetting + x @ px)
        theta = self._theta + gain * (seconds - x @ self._theta)
        p = (self._p - np.outer(gain, px)) / self._forgetting
        trace = float(np.trace(p))
        if trace > _P_MAX_TRACE:
            p *= _P_MAX_TRACE / trace
        if np.all(np.isfinite(theta)) and np.all(np.isfinite(p)):
            self._theta, self._p = theta, p

    def recompute_s(self, tokens: int) -> float | None:
        """Seconds to compute a prefix of ``tokens`` from nothing; None until the model is trained."""
        return self.compute_s(tokens, 0)

    def compute_s(self, tokens: int, context_start: int) -> float | None:
        """Seconds to compute ``tokens`` after ``context_start`` already computed (``work_of``); None
        until the model is trained."""
        with self._lock:
            if self.prefill_steps < MIN_PREFILL_STEPS:
                return None
            _, b, c = self._theta
        if not (math.isfinite(b) and math.isfinite(c)):
            return None
        per_token = max(b, 0.0) * _TOKENS_SCALE
        attention = max(c, 0.0) * _WORK_SCALE
        if per_token <= 0 and attention <= 0:
            return None
        return per_token * tokens + attention * work_of(tokens, context_start)

    def state(self) -> dict[str, object]:
        with self._lock:
            return {"theta": self._theta.tolist(), "p": self._p.tolist(), "prefill_steps": self.prefill_steps}

    def restore(self, state: dict[str, object]) -> None:
        """From ``state`` (a costs file's; shapes and values checked by the caller)."""
        theta, p = np.array(state["theta"], dtype=float), np.array(state["p"], dtype=float)
        trace = float(np.trace(p))
        if trace > _P_MAX_TRACE:  # written before the bound (``_fit``)
            p *= _P_MAX_TRACE / trace
        with self._lock:
            self._theta, self._p = theta, p
            self.prefill_steps = int(state["prefill_steps"])  # type: ignore[call-overload]

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """``(a, b, c)`` in seconds, seconds per token and seconds per token of attention work."""
        with self._lock:
            a, b, c = self._theta
        return float(a), float(b) * _TOKENS_SCALE, float(c) * _WORK_SCALE


def work_of(new_tokens: int, context_start: int) -> float:
    """Attention work of ``new_tokens`` computed after ``context_start`` tokens: each attends to the
    context before it, ``n·(start + n/2)`` token pairs."""
    return new_tokens * (context_start + new_tokens / 2)


@dataclass
class _Rate:
    seconds_per_block: float
    measured_at: float
    # The last ``RATE_MEDIAN_OF`` raw samples, newest last (a rate restored from a file: itself).
    samples: tuple[float, ...] = ()


@dataclass
class TierRates:
    """Seconds per block each tier delivered lately (weighted mean, newest ``weight``)."""

    weight: float = 0.3
    # A tier declined because it was slow is tried again after this long (a remote one probed, a local
    # one loaded whole: ``choose_blocks``); engines started within it
    # (a restart, another engine of the model on the host) reuse the rate (the costs file).
    stale_s: float = 300.0
    _rates: dict[str, _Rate] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, tier: str, blocks: int, seconds: float) -> None:
        if blocks <= 0 or seconds < 0:
            return
        now = time.monotonic()
        with self._lock:
            old = self._rates.get(tier)
            if old is not None and now - old.measured_at > self.stale_s:
                old = None
            raw = seconds / blocks
            samples = ((old.samples if old is not None else ()) + (raw,))[-RATE_MEDIAN_OF:]
            # Only a slow sample waits for a second: a fast one (a declined link's re-probe after it
            # recovered, every ``REPROBE_S``) counts at once.
            sample = min(raw, statistics.median_low(samples))
            if old is not None:
                sample = (1 - self.weight) * old.seconds_per_block + self.weight * sample
            self._rates[tier] = _Rate(sample, now, samples)

    def age_s(self, tier: str) -> float | None:
        """Seconds since the tier was last measured; None when never."""
        with self._lock:
            rate = self._rates.get(tier)
        return None if rate is None else time.monotonic() - rate.measured_at

    def seconds_per_block(self, tier: str) -> float | None:
        """None when never measured, or not since ``stale_s``."""
        with self._lock:
            rate = self._rates.get(tier)
        if rate is None or time.monotonic() - rate.measured_at > self.stale_s:
            return None
        return rate.seconds_per_block

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {tier: rate.seconds_per_block for tier, rate in self._rates.items()}

    def ages(self) -> dict[str, tuple[float, float]]:
        """Per tier: (seconds per block, seconds since measured)."""
        now = time.monotonic()
        with self._lock:
            return {tier: (rate.seconds_per_block, now - rate.measured_at) for tier, rate in self._rates.items()}

    def restore(self, tier: str, seconds_per_block: float, age_s: float) -> None:
        """The rate stands for its samples: one slow sample after a restart moves it no more than
        one before."""
        with self._lock:
            self._rates[tier] = _Rate(seconds_per_block, time.monotonic() - age_s, (seconds_per_block,))


def load_s(tiers: Sequence[str], rates: TierRates) -> float | None:
    """Seconds to load blocks on ``tiers`` (in order); None when a tier's rate is unknown. A block
    on NVMe or a remote tier reaches the engine through the DRAM pool: its tier's rate (the prefetch
    into DRAM) plus DRAM's (the copy to the engine). DRAM's rate unknown: taken as free."""
    total = 0.0
    dram = rates.seconds_per_block("dram") or 0.0
    for tier in tiers:
        rate = rates.seconds_per_block(tier)
        if tier == "dram":
            total += dram
        elif rate is None:
            return None
        else:
            total += rate + dram
    return total


def choose_blocks(
    tiers: Sequence[str],
    block_tokens: int,
    prefill: PrefillModel,
    rates: TierRates,
    others: int = 0,
    queued_s: float = 0.0,
    max_wait_ratio: float = 0.0,
    ahead_s: float = 0.0,
) -> tuple[int, str]:
    """How many of the leading hits on ``tiers`` to load, and why: ``"saves"`` (the count that
    saves the most time, 0 when none saves any; a recompute costs ``others``, the other requests
    the engine holds (``EngineRequests``), its time too; a load of blocks below DRAM waits
    ``queued_s`` first, the prefetches queued before it), ``"probe"`` (a local
    tier's rate is unknown: its blocks (``LOCAL_TIERS``) are all offered, costed as their copy out
    of DRAM alone),
    ``"probe_aside"`` (a remote tier's rate is unknown: what comes before it is weighed, and its
    first ``PROBE_BLOCKS`` blocks, ``probe_aside``, are read in the background to time it while the
    request recomputes them), or ``"untrained"`` (no prefill model yet: everything, as without the
    model). ``max_wait_ratio`` (0: none) caps a count's wait at that many times what recomputing it
    would take the request now: its recompute behind ``ahead_s``, the prefill the engine is running
    for the others (``prefill_ahead_s``)."""
    if not tiers:
        return 0, "saves"
    if prefill.recompute_s(block_tokens) is None:
        return len(tiers), "untrained"
    unknown_remote = first_unknown_remote(tiers, rates)
    if unknown_remote is not None:
        before = tiers[:unknown_remote]
        count, _ = choose_blocks(before, block_tokens, prefill, rates, others, queued_s, max_wait_ratio, ahead_s)
        return count, "probe_aside"
    unmeasured = [tier != "dram" and rates.seconds_per_block(tier) is None for tier in tiers]
    best_count, best_saving = 0, 0.0
    loaded, behind_queue = 0.0, False
    for count in range(1, len(tiers) + 1):
        # An unmeasured local tier's block: only its copy out of DRAM is known (load_s says None).
        block_s = load_s(tiers[count - 1 : count], rates)
        loaded += block_s if block_s is not None else load_s(["dram"], rates) or 0.0
        if tiers[count - 1] != "dram" and not behind_queue:  # the first block read below DRAM
            loaded, behind_queue = loaded + queued_s, True
        recompute_s = prefill.recompute_s(count * block_tokens) or 0.0
        saving = (1 + others) * recompute_s - loaded
        if max_wait_ratio and loaded > max_wait_ratio * (ahead_s + recompute_s):
            continue  # a longer count may wait less per recompute (a DRAM run after a slow tier's)
        if saving > best_saving:
            best_count, best_saving = count, saving
    return best_count, "probe" if any(unmeasured[:best_count]) else "saves"


def first_unknown_remote(tiers: Sequence[str], rates: TierRates) -> int | None:
    """Where the first hit on a remote tier with no rate yet is, if any."""
    return next(
        (i for i, tier in enumerate(tiers) if tier not in LOCAL_TIERS and rates.seconds_per_block(tier) is None),
        None,
    )


def probe_aside(tiers: Sequence[str], rates: TierRates) -> range:
    """The hits read in the background to time a remote tier with no rate yet (``choose_blocks``'
    ``"probe_aside"``): a request never waits for an unknown link (a 20 MB/s one took 6 s to probe
    on the request's path at kv8b, twice a recompute), and the next request finds the rate known."""
    first = first_unknown_remote(tiers, rates)
    return range(0) if first is None else range(first, min(len(tiers), first + PROBE_BLOCKS))


def reprobe(tiers: Sequence[str], offered: int, rates: TierRates) -> range:
    """The declined hits read in the background to time their tier again (``REPROBE_S``): the first
    ``PROBE_BLOCKS`` after the ``offered`` ones, of the first declined hit's tier, when it is below
    DRAM and its rate is at least ``REPROBE_S`` old."""
    if offered >= len(tiers) or tiers[offered] == "dram":
        return range(0)
    age_s = rates.age_s(tiers[offered])
    if age_s is None or age_s < REPROBE_S:
        return range(0)
    end = offered
    while end < min(len(tiers), offered + PROBE_BLOCKS) and tiers[end] == tiers[offered]:
        end += 1
    return range(offered, end)


# A plan's offer while the prefill model has no data: every hit, each counted as it is first seen.
UNTRAINED = 1 << 62


@dataclass
class _Plan:
    """One request's lookups from where vLLM asks: the keys of the first pass in order, with their
    tier then, and once decided how many of them to offer."""

    keys: list[bytes] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    index: dict[bytes, int] = field(default_factory=dict)
    offer: int | None = None
    probe: range = range(0)  # hits read aside to time their tier (``probe_aside``), recomputed
    last_at: int = -1  # where in ``keys`` the pass under way last asked


class LoadDecider:
    """Answers the manager's lookups under ``policy`` (``LOAD_POLICIES``).

    ``always`` offers every hit (kvtier before this model); ``never`` none (vLLM alone's loads, stores
    unchanged). ``auto`` offers DRAM hits at once; a request whose hits reach a slower tier is asked
    to retry (vLLM's ``RETRY``: it keeps scanning, so the first pass sees every hit and its tier),
    and on the next pass the leading ``choose_blocks`` hits are offered, the rest recomputed.
    Decisions are counted in blocks per (tier, choice)."""

    MAX_PLANS = 4096

    def __init__(
        self,
        policy: str = "auto",
        block_tokens: int = 16,
        max_wait_ratio: float = float(INTEGRATION_OPTION_DEFAULTS["load_wait_max_ratio"]),
    ):
        if policy not in LOAD_POLICIES:
            raise ValueError(f"load_policy must be one of {', '.join(LOAD_POLICIES)}, not {policy!r}")
        assert max_wait_ratio == 0.0 or max_wait_ratio >= 1.0, max_wait_ratio  # checked with the options
        self.policy = policy
        self.max_wait_ratio = max_wait_ratio
        self.block_tokens = block_tokens
        self.worker_block_bytes = 0  # one rank's bytes of a block (set by the spec): DRAM's rate
        # Where what this engine learned is kept for the next one of its model (``save_costs``).
        self.costs_path: Path | None = None
        self._saved_at = time.monotonic()
        self.prefill = PrefillModel()
        self.rates = TierRates()
        self.requests = EngineRequests()
        # Seconds the prefetches already queued take (``Prefetcher.backlog_s``, set by the manager).
        self.queued_s: Callable[[], float] = lambda: 0.0
        self.decisions: dict[tuple[str, str], int] = {}
        self._plans: dict[str, _Plan] = {}

    def answer(self, req_id: str, key: bytes, tier: str | None) -> str:
        """``"offer"`` (answer as a hit on ``tier``), ``"decline"`` (a miss: recomputed),
        ``"probe_aside"`` (a miss, and the manager reads ``take_probe``'s hits in the background to
        time their tier) or ``"retry"`` (vLLM asks again next step). ``tier`` None (not held) ends a pass."""
        if self.policy != "auto":
            return "offer" if self.policy == "always" else "decline"
        plan = self._plans.get(req_id)
        if tier is None:
            if plan is not None and plan.offer is None:
                self._decide(req_id, plan)
            return "decline"
        if plan is None:
            plan = self._new_plan(req_id)
        elif plan.offer is None and plan.index.get(key, len(plan.keys)) <= plan.last_at:
            # A new pass over the same request (vLLM scans in order: a key at or before the last one
            # asked starts one, wherever its own cache now ends the request's prefix): the last
            # pass saw every hit.
            self._decide(req_id, plan)
        if plan.offer is None and self.prefill.recompute_s(self.block_tokens) is None:
            plan.offer = UNTRAINED  # no step timed yet: load everything, as without the model
        at = plan.index.get(key)
        if at is None and plan.offer in (None, UNTRAINED):
            at = self._record(plan, key, tier)
        if at is not None:
            plan.last_at = at
        if plan.offer is None:
            return "offer" if all(seen == "dram" for seen in plan.tiers) else "retry"
        if at is None:  # first held after the decision: DRAM is always worth loading
            return "offer" if tier == "dram" else "decline"
        if at < plan.offer:
            return "offer"
        # vLLM stops at a request's first miss: the probe's hits are handed over there, all at once.
        return "probe_aside" if plan.probe else "decline"

    def take_probe(self, req_id: str) -> list[tuple[bytes, str]]:
        """The request's hits to read aside (key, tier), once (``answer`` said ``"probe_aside"``)."""
        plan = self._plans.get(req_id)
        if plan is None:
            return []
        aside = [(plan.keys[at], plan.tiers[at]) for at in plan.probe]
        plan.probe = range(0)
        return aside

    def _record(self, plan: _Plan, key: bytes, tier: str) -> int:
        plan.index[key] = len(plan.keys)
        plan.keys.append(key)
        plan.tiers.append(tier)
        if plan.offer == UNTRAINED:
            self._count(tier, "untrained")
        return plan.index[key]

    def _count(self, tier: str, choice: str) -> None:
        self.decisions[(tier, choice)] = self.decisions.get((tier, choice), 0) + 1

    def maybe_save(self, force: bool = False) -> None:
        """Writes the costs file at most every ``SAVE_INTERVAL_S`` (or now, ``force``). A failure to
        write is logged once and costs nothing else: the next engine learns from scratch."""
        if self.costs_path is None or self.policy != "auto":
            return
        now = time.monotonic()
        if not force and now - self._saved_at < SAVE_INTERVAL_S:
            return
        self._saved_at = now
        try:
            save_costs(self, self.costs_path)
        except OSError as error:
            logger.warning(
                "kvtier: cannot write %s (%s); the next engine learns its costs anew", self.costs_path, error
            )
            self.costs_path = None

    def forget(self, req_id: str) -> None:
        """The request's load was prepared (or it ended): its plan is done."""
        self._plans.pop(req_id, None)

    def _new_plan(self, req_id: str) -> _Plan:
        while len(self._plans) >= self.MAX_PLANS:
            self._plans.pop(next(iter(self._plans)))  # the oldest: a request that never loaded
        plan = _Plan()
        self._plans[req_id] = plan
        return plan

    def _decide(self, req_id: str, plan: _Plan) -> None:
        others, queued_s = self.requests.others(excluding=req_id), self.queued_s()
        ahead_s = prefill_ahead_s(self.requests, self.prefill, excluding=req_id)
        costs = (self.prefill, self.rates)
        capped = (self.max_wait_ratio, ahead_s)
        count, reason = choose_blocks(plan.tiers, self.block_tokens, *costs, others, queued_s, *capped)
        # Blocks past what an idle engine would load are loaded for the others' sake: ``load_busy``.
        idle_count = count
        if others > 0 and reason in ("saves", "probe_aside"):
            alone = choose_blocks(plan.tiers, self.block_tokens, *costs, 0, queued_s, self.max_wait_ratio)[0]
            idle_count = min(count, alone)
        # Blocks the wait cap alone declined (loading them would have saved engine time): ``recompute_wait``.
        uncapped = count
        if self.max_wait_ratio and reason == "saves":
            uncapped = choose_blocks(plan.tiers, self.block_tokens, *costs, others, queued_s)[0]
        plan.offer = count
        if reason == "probe_aside":
            plan.probe = probe_aside(plan.tiers, self.rates)
        elif reason == "saves":
            plan.probe = reprobe(plan.tiers, count, self.rates)
        for at, tier in enumerate(plan.tiers):
            if at < idle_count:
                self._count(tier, "load" if reason in ("saves", "probe_aside") else reason)
            elif at < count:
                self._count(tier, "load_busy")
            elif at in plan.probe:
                self._count(tier, "probe_aside")
            else:
                self._count(tier, "recompute_wait" if at < uncapped else "recompute")


class StepClock:
    """Times vLLM's forward steps from the scheduler: a step is scheduled (``scheduled``), then its
    output arrives (``finished``), in order. With asynchronous scheduling the next step is scheduled
    while one still runs, so a step runs from when it was scheduled or when the one before it
    finished, whichever is later.

    A step that computes nothing is not timed. Each output names its step where the worker echoes
    the step's number (``KvtierConnector``: every output then reaches the scheduler); without one
    the oldest pending step is taken, which pairs wrongly once an output goes missing (vLLM sends
    none for a step with no forward pass and no finished transfer) or comes from an untimed step."""

    MAX_PENDING = 64

    def __init__(self) -> None:
        # (step number or None, scheduled at, tokens, attention work)
        self._pending: list[tuple[int | None, float, int, float]] = []
        self._last_finished = 0.0
        self._warmup_left = WARMUP_STEPS

    def scheduled(self, tokens: int, attention_work: float, now: float | None = None, step: int | None = None) -> None:
        if tokens <= 0:
            return  # no forward pass to time
        if len(self._pending) >= self.MAX_PENDING:
            self._pending.pop(0)  # outputs stopped arriving for these: never time them
        self._pending.append((step, time.monotonic() if now is None else now, tokens, attention_work))

    def finished(self, now: float | None = None, step: int | None = None) -> tuple[int, float, float] | None:
        """The finished step's (tokens, attention work, seconds): step number ``step``'s, or without
        one the oldest pending step's; None if it is not one to time."""
        now = time.monotonic() if now is None else now
        if step is not None:
            while self._pending and self._pending[0][0] is not None and self._pending[0][0] < step:
                self._pending.pop(0)  # its output never came: not timed
            if not self._pending or self._pending[0][0] != step:
                self._last_finished = now  # a step with nothing to compute
                return None
        if not self._pending:
            return None
        _, scheduled_at, tokens, work = self._pending.pop(0)
        began = max(scheduled_at, self._last_finished)
        self._last_finished = now
        if tokens > 1 and self._warmup_left > 0:
            self._warmup_left -= 1
            return None
        return tokens, work, now - began


def scheduled_spans(scheduler_output: object) -> list[tuple[str, int, int]]:
    """(request, tokens computed before the step, tokens the step computes) of each request in a
    vLLM ``SchedulerOutput``: new requests carry where they start, cached ones their computed tokens."""
    scheduled: dict[str, int] = dict(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
    starts: dict[str, int] = {}
    for new in getattr(scheduler_output, "scheduled_new_reqs", []) or []:
        starts[new.req_id] = int(new.num_computed_tokens)
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is not None:
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=False):
            starts[req_id] = int(computed)
    return [(req_id, starts.get(req_id, 0), int(count)) for req_id, count in scheduled.items()]


def step_work(scheduler_output: object) -> tuple[int, float]:
    """Tokens a vLLM step computes and their attention work (``work_of`` per request)."""
    spans = scheduled_spans(scheduler_output)
    return sum(count for _, _, count in spans), sum(work_of(count, start) for _, start, count in spans)


class EngineRequests:
    """The requests the engine holds: told of (``admitted``), not yet finished, whether it runs them
    (computing their prompt or decoding), they wait for their load, or they wait their turn (told by
    ``KvtierConnector`` from vLLM's hooks; scheduler thread only).

    A request that recomputes its prefix takes that prefill's time from the engine, and every other
    request the engine holds waits for it: the running ones in longer steps, the others to be
    scheduled (first come, first served), those waiting for a load once it lands. So with ``n`` others
    its recompute costs ``(1 + n)`` times its time; one that loads waits alone, beside the engine
    (``choose_blocks``). Counting only the running ones (until 2026-12-04) recomputed whole prefixes
    while the engine's other requests waited for their loads on a 200 MB/s link, and the engine then
    served them one after another: 0.77x the throughput of loading every hit."""

    MAX_REQUESTS = 4096

    def __init__(self) -> None:
        self._prompt_tokens: dict[str, int] = {}
        self._computed: dict[str, int] = {}

    def admitted(self, req_id: str, prompt_tokens: int) -> None:
        while len(self._prompt_tokens) >= self.MAX_REQUESTS:
            oldest = next(iter(self._prompt_tokens))  # a request whose end was never told
            self.finished(oldest)
        self._prompt_tokens[req_id] = max(0, int(prompt_tokens))

    def scheduled(self, scheduler_output: object) -> None:
        for req_id, start, count in scheduled_spans(scheduler_output):
            if req_id in self._prompt_tokens:
                self._computed[req_id] = start + count

    def finished(self, req_id: str) -> None:
        self._prompt_tokens.pop(req_id, None)
        self._computed.pop(req_id, None)

    def progress(self) -> dict[str, tuple[int, int]]:
        """Per request followed: (tokens scheduled so far, or -1 before its first step; prompt tokens)."""
        return {req_id: (self._computed.get(req_id, -1), prompt) for req_id, prompt in self._prompt_tokens.items()}

    def others(self, excluding: str = "") -> int:
        """How many requests the engine holds, ``excluding`` one."""
        return sum(1 for req_id in self._prompt_tokens if req_id != excluding)


def prefill_ahead_s(requests: EngineRequests, prefill: PrefillModel, excluding: str = "") -> float:
    """Seconds of prompt the engine has yet to compute for the requests it already runs (scheduled
    at least once), ``excluding`` one: vLLM schedules the running requests' prefill chunks before a
    waiting request's, so a request that recomputes its prefix now finishes it only after theirs.
    Requests not yet scheduled are left out (they may load instead). 0 while the model is untrained."""
    ahead = 0.0
    for req_id, (computed, prompt) in requests.progress().items():
        if req_id != excluding and 0 <= computed < prompt:
            ahead += prefill.compute_s(prompt - computed, computed) or 0.0
    return ahead


# The costs file (docs/vllm.md, "The costs file"): what an engine learned of its own prefill and of
# the tiers, for the next engine of the same model on this host (a restart, a second server). JSON,
# versioned, size-bounded, every value checked on read: a file that is not ours in every detail is
# ignored, and the engine learns from scratch.
COSTS_FILE_VERSION = 1
MAX_COSTS_FILE_BYTES = 64 << 10
SAVE_INTERVAL_S = 10.0
_TIER_NAME_MAX = 16


def save_costs(decider: LoadDecider, path: Path) -> None:
    """Writes ``path`` atomically (a temporary file beside it, then a rename), mode 0600."""
    now = time.time()
    document = {
        "version": COSTS_FILE_VERSION,
        "written_at": now,
        "block_tokens": decider.block_tokens,
        "prefill": decider.prefill.state(),
        "rates": {
            tier: {"seconds_per_block": rate, "measured_at": now - age}
            for tier, (rate, age) in decider.rates.ages().items()
        },
    }
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as file:
        json.dump(document, file)
    os.replace(partial, path)


def load_costs(decider: LoadDecider, path: Path) -> bool:
    """Restores what ``path`` holds into ``decider``; False (and nothing restored) unless the file is
    a regular file of this user, within the size bound, of this version and block size, and every
    value is a finite number of the right shape."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_size > MAX_COSTS_FILE_BYTES:
            return False
        try:
            document = json.loads(file.read(MAX_COSTS_FILE_BYTES))
        except ValueError:
            return False
    parsed = _checked(document, decider.block_tokens)
    if parsed is None:
        return False
    prefill, rates = parsed
    decider.prefill.restore(prefill)
    now = time.time()
    for tier, (seconds_per_block, measured_at) in rates.items():
        decider.rates.restore(tier, seconds_per_block, max(0.0, now - measured_at))
    return True


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _checked(document: object, block_tokens: int) -> tuple[dict[str, object], dict[str, tuple[float, float]]] | None:
    if not isinstance(document, dict) or document.get("version") != COSTS_FILE_VERSION:
        return None
    if document.get("block_tokens") != block_tokens:
        return None
    prefill, rates = document.get("prefill"), document.get("rates")
    if not isinstance(prefill, dict) or not isinstance(rates, dict) or len(rates) > 8:
        return None
    theta, p, steps = prefill.get("theta"), prefill.get("p"), prefill.get("prefill_steps")
    if not (isinstance(theta, list) and len(theta) == 3 and all(_finite(v) for v in theta)):
        return None
    if not (isinstance(p, list) and len(p) == 3 and all(isinstance(r, list) and len(r) == 3 for r in p)):
        return None
    if not all(_finite(v) for row in p for v in row) or not (isinstance(steps, int) and 0 <= steps < 1 << 40):
        return None
    parsed_rates: dict[str, tuple[float, float]] = {}
    for tier, rate in rates.items():
        if not (isinstance(tier, str) and 0 < len(tier) <= _TIER_NAME_MAX and isinstance(rate, dict)):
            return None
        seconds, measured_at = rate.get("seconds_per_block"), rate.get("measured_at")
        if not (isinstance(seconds, (int, float)) and isinstance(measured_at, (int, float))):
            return None
        if not (_finite(seconds) and seconds >= 0 and _finite(measured_at)):
            return None
        parsed_rates[tier] = (float(seconds), float(measured_at))
    return {"theta": theta, "p": p, "prefill_steps": steps}, parsed_rates
