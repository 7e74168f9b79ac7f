"""`kvtier bench ttft --slow-link`: the remote tiers behind a slow link (issue 36, item 4), the parent's side.

Per link speed, node B (a fresh engine and service with an empty local store, per prompt, as in the
``kvtier_object`` and ``kvtier_shared`` rows) reads the bucket through ``kvtier.bench.slowlink`` (a
proxy on 127.0.0.1 limited to that many MB/s, with an added latency each way), or the shared directory
through ``kvtier.bench.slowmount`` (a FUSE passthrough whose reads and writes go through the same
delay line); node A publishes directly. Three rows per tier and speed:

- recompute (vLLM alone): the baseline's ``recompute`` of the same prompts (the link plays no part).
- always-load: ``load_policy: always``, with a deadline (``service_timeout_ms``) long enough that every
  hit is waited for: what kvtier did before it could choose (every block must come from the tier).
- kvtier's choice: ``load_policy: auto`` (the default), kvtier deciding per request which leading
  hits to load (docs/vllm.md, "Load or recompute"). Its outputs must match recompute's and its
  decisions must cover every block of the prompt; a choice to recompute is correct here.

How the choice learns, as across a user's restarts: node A's engine (``load_policy: auto``) trains
the prefill model from its own steps and writes the costs file when it stops; every engine of the run
shares one runtime directory (``XDG_RUNTIME_DIR``, the run's own), so each node B starts from the
file the engines before it left, and writes what it learned when it stops (each tier's node A starts
with none: the tiers' rates share one name). At each link speed the
file is put back to what node A left (as if that link were the deployment's only one), so the first
``auto`` engine of each speed probes the slow tier (reads its first 4 blocks in the background while
the request recomputes them) and records its rate; the later ones start from that rate (forgotten
after 300 s without a load, then probed again). The decisions of each run (``load``, ``recompute``,
``probe``, ``probe_aside``, ``untrained``, in blocks) are in its record, so the report says which runs
were probes.

Order: per tier (after its node A and its plain rows), per speed, per repeat, per length, always-load
then kvtier's choice.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from kvtier.bench.slowlink import LinkSpec, SlowLinkError, SlowLinkProcess
from kvtier.bench.slowmount import SlowMount
from kvtier.bench.ttft.orchestrate import LOGPROB_TOLERANCE, same_output, spread
from kvtier.bench.ttft.plan import BenchError
from kvtier.bench.ttft.report import markdown_table

POLICIES = ("always", "auto")
SLOW_PHASES = {"object": "kvtier_object_slow", "shared": "kvtier_shared_slow"}
REMOTE_COUNTERS = {"object": "bucket_hits", "shared": "shared_hits"}  # blocks served from the tier
NODE_A_PHASES = {"kvtier_object_store": "object", "kvtier_shared_store": "shared"}
# kvtier's TTFT at most this times the better of recompute and always-load (issue 36's target).
TARGET_OVER_BEST = 1.05
NODE_A_COSTS = "costs-node-a"  # the snapshot of what node A left, under the run's output directory


def slow_link_phases(plan: dict, tier: str) -> list[tuple[str, str, list]]:
    """(phase, run name, item) of every slow-link phase of ``tier`` ("object" or "shared"), in order:
    per speed, per repeat, per length, always-load then kvtier's choice."""
    if not plan.get("slow_link") or tier not in plan["slow_link"]["tiers"]:
        return []
    phases = []
    for rate in plan["slow_link"]["rates_mb_per_s"]:
        for repeat in range(plan["repeats"]):
            for length in plan["lengths"]:
                for policy in POLICIES:
                    run_name = f"{SLOW_PHASES[tier]}-{rate:g}MBps-{policy}-{length}-r{repeat}"
                    phases.append((SLOW_PHASES[tier], run_name, [length, repeat, rate, policy]))
    return phases


def node_store_name(phase: str, item: list) -> str:
    """The node name of a slow phase's local store (``shared_store_dir``'s ``node``)."""
    length, repeat, rate, policy = item
    tier = next(tier for tier, name in SLOW_PHASES.items() if name == phase)
    return f"{tier}-slow-{rate:g}-{policy}-{length}-r{repeat}"


def costs_dir(plan: dict) -> Path:
    """Where the run's engines keep their costs files: beside the service sockets of its runtime dir."""
    return Path(plan["runtime_dir"]) / "kvtier"


class SlowLinks:
    """The slow link (or mount) of the current tier and speed, a child process, and the costs files:
    what each tier's node A left is kept, and put back before each speed of that tier."""

    def __init__(self, plan: dict, log) -> None:
        self._plan = plan
        self._log = log
        self._link: SlowLinkProcess | SlowMount | None = None
        self._current: tuple[str, float] | None = None  # (tier, MB/s)
        self._snapshots = Path(plan["out_dir"]) / NODE_A_COSTS

    def after_phase(self, phase: str) -> None:
        """After a node A: keeps what it left (each speed of its tier starts from it)."""
        tier = NODE_A_PHASES.get(phase)
        if tier is None or not self._plan.get("slow_link"):
            return
        snapshot = self._snapshots / tier
        shutil.rmtree(snapshot, ignore_errors=True)
        shutil.copytree(costs_dir(self._plan), snapshot, ignore=_not_costs)
        self._log(f"slow link: node A of the {tier} tier left {sorted(p.name for p in snapshot.iterdir())}")

    def plan_for(self, phase: str, item: Any, plan: dict) -> dict:
        """The plan a phase runs with: a slow phase's remote tier is reached through its speed's link
        (started here, the previous one stopped, the costs files put back to its node A's)."""
        if phase in NODE_A_PHASES and self._plan.get("slow_link"):
            # Each tier's chain is a deployment of its own: its node A starts with no costs file, as a
            # user's first engine on that tier would (the prefill model the other chain learned would
            # start it warmer).
            self.close()
            for path in costs_dir(self._plan).glob("costs-*.json"):
                path.unlink()
        tier = next((tier for tier, name in SLOW_PHASES.items() if name == phase), None)
        if tier is None:
            return plan
        rate = item[2]
        if (tier, rate) != self._current:
            self.close()
            self._restore_node_a_costs(tier)
            self._start(tier, rate, plan)
        if isinstance(self._link, SlowMount):
            return {**plan, "shared": {**plan["shared"], "load_root": str(self._link.mountpoint)}}
        assert self._link is not None
        return {**plan, "object": {**plan["object"], "bucket_endpoint": self._link.url}}

    def _start(self, tier: str, rate: float, plan: dict) -> None:
        spec = LinkSpec(rate, self._plan["slow_link"]["latency_ms"])
        log_path = Path(self._plan["out_dir"]) / "logs" / f"slow{tier}-{rate:g}MBps.log"
        try:
            if tier == "shared":  # node B's view of the shared directory, through the slow mount
                mountpoint = Path(plan["store_dir"]).parent / "slow-mount"
                self._link = SlowMount(plan["shared"]["load_root"], mountpoint, spec, log_path)
                self._link.start()
                target = plan["shared"]["load_root"]
            else:
                target = plan["object"]["bucket_endpoint"]
                self._link = SlowLinkProcess(target, spec, log_path)
                self._link.start()
        except SlowLinkError as error:
            self._link = None
            raise BenchError(f"--slow-link, the {tier} tier: {error}") from None
        self._current = (tier, rate)
        where = str(self._link.mountpoint) if isinstance(self._link, SlowMount) else self._link.url
        self._log(f"slow link: the {tier} tier at {spec.describe()}: {where} -> {target}")

    def _restore_node_a_costs(self, tier: str) -> None:
        directory = costs_dir(self._plan)
        directory.mkdir(parents=True, exist_ok=True)
        for path in directory.glob("costs-*.json"):
            path.unlink()
        for path in (self._snapshots / tier).glob("costs-*.json"):
            shutil.copy2(path, directory / path.name)

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
        self._link, self._current = None, None


def _not_costs(_directory: str, names: list[str]) -> list[str]:
    return [name for name in names if not (name.startswith("costs-") and name.endswith(".json"))]


def _slow_records(measurements: list[dict], tier: str, policy: str, rate: float, length: int) -> list[dict]:
    return [
        record
        for record in measurements
        if record.get("experiment") == "slow_link"
        and record["tier"] == tier
        and record["policy"] == policy
        and record["link_mb_per_s"] == rate
        and record["length_tokens"] == length
    ]


def _point(records: list[dict]) -> dict[str, Any]:
    decisions: dict[str, int] = {}
    for record in records:
        for key, count in record["decisions"].items():
            decisions[key] = decisions.get(key, 0) + count
    first = min(records, key=lambda record: record["repeat"]) if records else None
    return {
        "ttft_s": spread([record["ttft_s"] for record in records]),
        "cached_tokens": spread([record["cached_tokens"] for record in records]),
        "remote_hits": sum(record["kvtier"][REMOTE_COUNTERS[record["tier"]]] for record in records),
        "decisions": decisions,
        "probe_repeats": [
            r["repeat"] for r in records if any(k.endswith((":probe", ":probe_aside")) for k in r["decisions"])
        ],
        "untrained_repeats": [r["repeat"] for r in records if any(k.endswith(":untrained") for k in r["decisions"])],
        "believed_first": first["believed"] if first else None,
        "problems": [record["problem"] for record in records if record.get("problem")],
    }


def summarize_slow_link(plan: dict, measurements: list[dict], summary: dict) -> dict | None:
    """Per tier, speed, policy and length: TTFT, cached tokens, decisions, probes; kvtier's choice
    against the better of recompute and always-load (medians)."""
    if not plan.get("slow_link"):
        return None
    recompute = summary["experiment1"].get("recompute", {})
    points: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    targets = []
    for tier in plan["slow_link"]["tiers"]:
        for rate in plan["slow_link"]["rates_mb_per_s"]:
            by_policy = points.setdefault(tier, {}).setdefault(f"{rate:g}", {})
            for policy in POLICIES:
                by_policy[policy] = {
                    str(n): _point(_slow_records(measurements, tier, policy, rate, n)) for n in plan["lengths"]
                }
            targets += [_target(tier, rate, length, recompute, by_policy) for length in plan["lengths"]]
    return {
        "tiers": plan["slow_link"]["tiers"],
        "rates_mb_per_s": plan["slow_link"]["rates_mb_per_s"],
        "latency_ms": plan["slow_link"]["latency_ms"],
        "points": points,
        "targets": targets,
    }


def _target(tier: str, rate: float, length: int, recompute: dict, by_policy: dict) -> dict[str, Any]:
    """kvtier's choice over the better of recompute and always-load at one point (medians)."""
    medians = [
        point["ttft_s"]["median"] if point and point.get("ttft_s") else None
        for point in (recompute.get(str(length)), by_policy["always"][str(length)])
    ]
    auto = by_policy["auto"][str(length)]["ttft_s"]
    best = min((median for median in medians if median is not None), default=None)
    value = auto["median"] / best if auto and best else None
    return {
        "name": "kvtier's choice / better of recompute and always-load", "tier": tier, "link_mb_per_s": rate,
        "length_tokens": length, "value": value, "target_at_most": TARGET_OVER_BEST,
        "met": None if value is None else value <= TARGET_OVER_BEST,
        "better": None if best is None else ("recompute" if best == medians[0] else "always-load"),
    }  # fmt: skip


def slow_link_failures(plan: dict, measurements: list[dict]) -> list[str]:
    """Why the slow-link rows cannot be trusted (empty when they can): a run missing; an always-load run
    that did not load every block from the tier; a run of kvtier's choice whose decisions do not cover
    the prompt's blocks or that served more than it offered; any greedy output unlike recompute's."""
    if not plan.get("slow_link"):
        return []
    failures = []
    by_prompt = {(r["config"], r["prompt_id"]): r for r in measurements if r.get("prompt_id")}
    points = [
        (tier, rate, policy, length)
        for tier in plan["slow_link"]["tiers"]
        for rate in plan["slow_link"]["rates_mb_per_s"]
        for policy in POLICIES
        for length in plan["lengths"]
    ]
    for tier, rate, policy, length in points:
        records = _slow_records(measurements, tier, policy, rate, length)
        where = f"{tier} tier, {policy} at {rate:g} MB/s, {length} tokens"
        if len(records) != plan["repeats"]:
            failures.append(f"{where}: {len(records)} of {plan['repeats']} repeats measured")
        for record in records:
            problems = _record_failures(record, plan["block_tokens"]) + _output_failures(record, by_prompt)
            failures += [f"{where} r{record['repeat']}: {problem}" for problem in problems]
    return failures


def _output_failures(record: dict, by_prompt: dict) -> list[str]:
    """Recompute's greedy token, with its logprob or vLLM's own prefix hit's (``same_output``)."""
    base = by_prompt.get(("recompute", record["prompt_id"]))
    if base is not None and same_output(record, base, by_prompt.get(("vllm_prefix", record["prompt_id"]))):
        return []
    theirs = f"{base['token_id']} ({base.get('logprob')})" if base else "(not measured)"
    return [
        f"token {record['token_id']} ({record.get('logprob')}) against recompute's {theirs}, "
        f"logprobs within {LOGPROB_TOLERANCE}"
    ]


def _record_failures(record: dict, block_tokens: int) -> list[str]:
    """An always-load run loads every block from the bucket; kvtier's choice decides on every block
    of the prompt and serves no more than it offered (a choice to recompute is correct)."""
    blocks = record["length_tokens"] // block_tokens
    failures = []
    if record["policy"] == "always":
        if record.get("problem"):
            failures.append(record["problem"])
        if record["cached_tokens"] != record["length_tokens"]:
            failures.append(f"always-load served {record['cached_tokens']} of {record['length_tokens']} tokens")
        if any(not key.endswith(":load") for key in record["decisions"]):
            failures.append(f"always-load decided {record['decisions']}")
    else:
        if record["decided_blocks"] != blocks:
            failures.append(f"kvtier decided on {record['decided_blocks']} of the prompt's {blocks} blocks")
        if record["cached_tokens"] > record["offered_tokens"]:
            failures.append(f"{record['cached_tokens']} tokens served, {record['offered_tokens']} offered")
    return failures


def slow_link_markdown(plan: dict, slow: dict | None, summary: dict) -> list[str]:
    """The slow-link tables (Markdown lines), per tier: TTFT per row, then kvtier's choice in detail."""
    if not slow:
        return []
    lines = []
    for tier in slow["tiers"]:
        title = (
            f"The {tier} tier behind a slow link (+{slow['latency_ms']:g} ms each way): TTFT ms, median (min-max) "
            f"of {plan['repeats']}"
        )
        lines += [f"### {title}", "", _ttft_table(plan, slow, summary, tier), "",
                  f"kvtier's choice in detail (target: at most {TARGET_OVER_BEST}x the better of recompute and "
                  "always-load)", "", _detail_table(slow, tier), ""]  # fmt: skip
    return lines


def _ttft_table(plan: dict, slow: dict, summary: dict, tier: str) -> str:
    lengths = plan["lengths"]
    recompute = summary["experiment1"].get("recompute", {})
    rows = [["-", "recompute (vLLM alone)"] + [_ttft_cell(recompute.get(str(n))) for n in lengths]]
    for rate, by_policy in slow["points"][tier].items():
        for policy, label in (("always", "always-load"), ("auto", "kvtier's choice (auto)")):
            rows.append([f"{rate} MB/s", label] + [_ttft_cell(by_policy[policy][str(n)]) for n in lengths])
    return markdown_table(["link", "row"] + [f"{length} tok" for length in lengths], rows)


def _detail_table(slow: dict, tier: str) -> str:
    header = ["link", "length", "auto / best", "better", "auto cached tokens", "decisions (blocks)",
              "probe runs", "untrained runs", "believed first: recompute / load s"]  # fmt: skip
    rows = []
    for target in (target for target in slow["targets"] if target["tier"] == tier):
        point = slow["points"][tier][f"{target['link_mb_per_s']:g}"]["auto"][str(target["length_tokens"])]
        believed = point["believed_first"] or {}
        rows.append([
            f"{target['link_mb_per_s']:g} MB/s", str(target["length_tokens"]),
            "-" if target["value"] is None else f"{target['value']:.2f}" + ("" if target["met"] else " (NOT met)"),
            target["better"] or "-", _spread_text(point["cached_tokens"]),
            ", ".join(f"{key} {count}" for key, count in sorted(point["decisions"].items())) or "-",
            ", ".join(f"r{r}" for r in point["probe_repeats"]) or "-",
            ", ".join(f"r{r}" for r in point["untrained_repeats"]) or "-",
            f"{_seconds(believed.get('predicted_recompute_s'))} / {_seconds(believed.get('predicted_load_s'))}",
        ])  # fmt: skip
    return markdown_table(header, rows)


def _ttft_cell(point: dict | None) -> str:
    if not point or not point.get("ttft_s"):
        return "-"
    spread_s = point["ttft_s"]
    text = f"{spread_s['median'] * 1000:.0f} ({spread_s['min'] * 1000:.0f}-{spread_s['max'] * 1000:.0f})"
    return text + (" !" if point["problems"] else "")


def _spread_text(values: dict | None) -> str:
    if not values:
        return "-"
    if values["min"] == values["max"]:
        return f"{values['median']:.0f}"
    return f"{values['median']:.0f} ({values['min']:.0f}-{values['max']:.0f})"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
