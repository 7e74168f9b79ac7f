"""`kvtier bench ttft`'s parent process: launches the engine phases (one child process each) and
turns their records into the summary (spreads, checks of hits and outputs, the targets)."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.bench.ttft.engine import PROGRESS_PREFIX
from kvtier.bench.ttft.engine_phase import lmcache_environment, lmcache_log_problem
from kvtier.bench.ttft.plan import TARGET_LENGTH_TOKENS, BenchError

TARGET_NVME_OVER_DRAM = 1.3
TARGET_HIT_OVER_RECOMPUTE = 0.15
TARGET_NVME_OVER_LMCACHE = 1 / 1.5  # NVMe at least 1.5x better than LMCache's disk backend
LOGPROB_TOLERANCE = 1e-3
RESTORED_CONFIGS = (
    "vllm_prefix", "kvtier_dram", "kvtier_nvme", "kvtier_nvme_encrypted", "example_connector", "lmcache_disk",
    "kvtier_shared", "kvtier_object", "kvtier_object_encrypted",
)  # fmt: skip


def phase_environment(plan: dict) -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # kvtier: scheduler and worker in one process
        "VLLM_CPU_KVCACHE_SPACE": str(plan["kvcache_space_gib"]),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "PYTHONUNBUFFERED": "1",
        # The run's own runtime directory: its services' sockets and the costs files its engines
        # leave for each other (load or recompute), apart from any other engine of the model here.
        **({"XDG_RUNTIME_DIR": plan["runtime_dir"]} if plan.get("runtime_dir") else {}),
    }


def launch_phase(
    plan: dict,
    phase: str,
    timeout_s: int,
    run_name: str | None = None,
    python: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> list[dict]:
    """Runs one engine phase in a child process (its own log); returns the records it emitted.

    ``python`` is the child's interpreter (default: this one), ``extra_env`` added to its environment."""
    run_name = run_name or phase
    out_dir = Path(plan["out_dir"])
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    spec_path = out_dir / "logs" / f"{run_name}.spec.json"
    result_path = out_dir / "logs" / f"{run_name}.jsonl"
    log_path = out_dir / "logs" / f"{run_name}.log"
    spec_path.write_text(json.dumps({"plan": plan, "phase": phase, "result_path": str(result_path)}, indent=2))
    print(f"phase {run_name}: starting an engine (log {log_path})", flush=True)
    phase_started = time.monotonic()
    command = [python or sys.executable, "-m", "kvtier.bench.ttft", "--run-phase", str(spec_path)]
    deadline = time.monotonic() + timeout_s
    with log_path.open("w") as log_file:
        child = subprocess.Popen(
            command,
            env={**phase_environment(plan), **(extra_env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            assert child.stdout is not None
            for line in child.stdout:
                log_file.write(line)
                if line.startswith(PROGRESS_PREFIX):
                    elapsed = time.monotonic() - phase_started
                    print(f"  [{elapsed:6.1f} s] " + line[len(PROGRESS_PREFIX) :], end="", flush=True)
                if time.monotonic() > deadline:
                    raise BenchError(f"phase {phase} exceeded --phase-timeout-s={timeout_s}")
            child.wait(timeout=max(1, deadline - time.monotonic()))
        finally:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, 9)
                child.wait()
    records = (
        [json.loads(line) for line in result_path.read_text().splitlines() if line.strip()]
        if result_path.exists()
        else []
    )
    if child.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise BenchError(f"phase {phase} failed (exit code {child.returncode}); log tail:\n{tail}")
    return records


def run_lmcache_phase(plan: dict, timeout_s: int, notes: list[str]) -> list[dict]:
    """The lmcache_disk phase in LMCache's interpreter; its figures are flagged if its log shows a failure.

    A failure of this optional phase is a note, not the end of the run."""
    log_path = Path(plan["out_dir"]) / "logs" / "lmcache_disk.log"
    try:
        records = launch_phase(
            {**plan, "item": None}, "lmcache_disk", timeout_s, "lmcache_disk", python=plan["lmcache_python"],
            extra_env=lmcache_environment(plan),
        )  # fmt: skip
    except BenchError as error:
        notes.append(f"LMCache phase failed, not measured: {str(error).splitlines()[0]} (log {log_path})")
        return []
    problem = lmcache_log_problem(log_path.read_text(errors="replace")) if log_path.exists() else "no log"
    if problem:
        notes.append(f"LMCache's log reports a failure, its figures are flagged: {problem}")
        for record in records:
            if record.get("kind") == "measure":
                record["problem"] = "; ".join(filter(None, [record.get("problem"), f"LMCache log: {problem}"]))
    return records


def spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def summarize(plan: dict, measurements: list[dict]) -> dict:
    """Spreads per experiment, configuration and point; checks of hits and of outputs; targets."""
    experiment1: dict[str, dict[str, Any]] = {}
    experiment2: dict[str, dict[str, Any]] = {}
    experiment2_recompute: list[dict] = []  # recompute measured by experiment 2 itself (no hit rate)
    for record in measurements:
        if record["experiment"] == "slow_link":  # their own summary (slow_rows)
            continue
        if record["experiment"] == 1:
            point = experiment1.setdefault(record["config"], {}).setdefault(str(record["length_tokens"]), [])
        elif record.get("hit_rate") is None:
            point = experiment2_recompute
        else:
            point = experiment2.setdefault(record["config"], {}).setdefault(str(record["hit_rate"]), [])
        point.append(record)

    def summary_of(records: list[dict]) -> dict:
        return {
            "ttft_s": spread([record["ttft_s"] for record in records]),
            "cached_tokens_ok": all(record["cached_tokens"] == record["expected_cached_tokens"] for record in records),
            "problems": [record["problem"] for record in records if record.get("problem")],
        }

    summary: dict[str, Any] = {
        "experiment1": {
            config: {point: summary_of(records) for point, records in points.items()}
            for config, points in experiment1.items()
        },
        "experiment2": {
            config: {point: summary_of(records) for point, records in points.items()}
            for config, points in experiment2.items()
        },
    }
    # Experiment 2: recompute does not depend on the hit rate, so it is one figure at that length (not a
    # cell per hit rate): experiment 1's when experiment 1 measured that length, else experiment 2's own.
    summary["experiment2_recompute"] = None
    if plan["hit_rates"]:
        length = plan["hit_rate_length"]
        from_experiment1 = experiment1.get("recompute", {}).get(str(length))
        records = from_experiment1 or experiment2_recompute
        if records:
            summary["experiment2_recompute"] = {
                "length_tokens": length,
                "from_experiment": 1 if from_experiment1 else 2,
                **summary_of(records),
            }

    # Outputs: each restored run's greedy token (and logprob) against the recompute of the same prompt.
    reference = {r["prompt_id"]: r for r in measurements if r["config"] == "recompute" and r.get("prompt_id")}
    outputs: dict[str, dict[str, Any]] = {}
    for record in measurements:
        if record["config"] not in (*RESTORED_CONFIGS, "kvtier_miss") or record.get("prompt_id") not in reference:
            continue
        base = reference[record["prompt_id"]]
        entry = outputs.setdefault(record["config"], {"compared": 0, "same_token": 0, "max_logprob_diff": 0.0})
        entry["compared"] += 1
        entry["same_token"] += int(record["token_id"] == base["token_id"])
        if record.get("logprob") is not None and base.get("logprob") is not None:
            entry["max_logprob_diff"] = max(entry["max_logprob_diff"], abs(record["logprob"] - base["logprob"]))
    summary["outputs_vs_recompute"] = outputs
    summary["encryption"] = encryption_summary(plan, summary)
    summary["targets"] = targets(plan, summary) + stores_off_the_critical_path_targets(plan, summary)
    summary["targets"] += encryption_targets(summary["encryption"])
    return summary


# The rows measured in clear and encrypted (issue 40): tier, clear row, encrypted row.
ENCRYPTED_ROWS = (
    ("nvme", "kvtier_nvme", "kvtier_nvme_encrypted"),
    ("object", "kvtier_object", "kvtier_object_encrypted"),
)


def encryption_summary(plan: dict, summary: dict) -> list[dict] | None:
    """Issue 40: per tier (NVMe; the bucket with --object too) and length, the encrypted hit's median
    TTFT, the clear hit's and encrypted / clear; None without --encrypted."""
    if not plan.get("encrypted"):
        return None
    rows = []
    for tier, clear_row, encrypted_row in ENCRYPTED_ROWS:
        if tier == "object" and not plan.get("object"):
            continue
        rows += _encryption_rows(plan, summary, tier, clear_row, encrypted_row)
    return rows


def _encryption_rows(plan: dict, summary: dict, tier: str, clear_row: str, encrypted_row: str) -> list[dict]:
    rows = []
    for length in plan["lengths"]:
        clear, encrypted = _median(summary, clear_row, length), _median(summary, encrypted_row, length)
        rows.append({
            "tier": tier,
            "length_tokens": length,
            "clear_median_s": clear,
            "encrypted_median_s": encrypted,
            "encrypted_over_clear": encrypted / clear if encrypted is not None and clear else None,
        })  # fmt: skip
    return rows


ENCRYPTION_FIGURE_NAMES = {
    "nvme": "kvtier encrypted NVMe hit / kvtier NVMe hit",
    "object": "kvtier encrypted object-tier hit / kvtier object-tier hit",
}


def encryption_targets(encryption: list[dict] | None) -> list[dict]:
    """The encrypted hit over the clear one per tier and length, as figures beside the targets (no target)."""
    return [
        {
            "name": ENCRYPTION_FIGURE_NAMES[row["tier"]],
            "length_tokens": row["length_tokens"],
            "value": row["encrypted_over_clear"],
            "target_at_most": None,
            "met": None,
            "note": None if row["encrypted_over_clear"] is not None else "a row was not measured at this length",
            "issue": 40,
        }
        for row in encryption or []
    ]


def shared_row_failures(
    plan: dict, summary: dict, measurements: list[dict], config: str = "kvtier_shared"
) -> list[str]:
    """Why the kvtier_shared (or kvtier_object) row cannot be trusted (empty when it can): a length or
    repeat not measured, a block not served from that tier, a wrong hit size, or a greedy token that
    differs from the recompute of the same prompt."""
    tier = {"kvtier_shared": "shared", "kvtier_object": "object", "kvtier_object_encrypted": "object"}[config]
    if not plan.get(tier) or (config == "kvtier_object_encrypted" and not plan.get("encrypted")):
        return []
    failures = []
    points = summary["experiment1"].get(config, {})
    for length in plan["lengths"]:
        point = points.get(str(length))
        measured = point["ttft_s"]["n"] if point and point["ttft_s"] else 0
        if measured != plan["repeats"]:
            failures.append(f"{measured} of {plan['repeats']} repeats measured at {length} tokens")
        elif not point["cached_tokens_ok"] or point["problems"]:
            failures.append(f"at {length} tokens: {'; '.join(point['problems']) or 'cached tokens differ'}")
    by_prompt = {(r["config"], r["prompt_id"]): r for r in measurements if r.get("prompt_id")}
    for record in (record for record in measurements if record["config"] == config):
        base = by_prompt.get(("recompute", record["prompt_id"]))
        if base is None:
            failures.append(f"no recompute of {record['prompt_id']} to compare with")
        elif not same_output(record, base, by_prompt.get(("vllm_prefix", record["prompt_id"]))):
            failures.append(
                f"{record['prompt_id']}: token {record['token_id']} (logprob {record.get('logprob')}) against "
                f"recompute's {base['token_id']} ({base.get('logprob')})"
            )
    return failures


def same_output(record: dict, recompute: dict, prefix_hit: dict | None) -> bool:
    """Whether a restored run gave recompute's greedy token with the logprob of recompute or of vLLM's
    own prefix-cache hit of the same prompt (within LOGPROB_TOLERANCE). A cached prefix takes another
    kernel path than a whole prefill: in bf16 that alone moves the logprob (0.031 seen at 2K tokens
    on vLLM's own prefix cache, which every kvtier row then matched to the last digit)."""
    if record["token_id"] != recompute["token_id"]:
        return False
    logprob = record.get("logprob")
    references = [r.get("logprob") for r in (recompute, prefix_hit) if r is not None]
    if logprob is None or all(reference is None for reference in references):
        return True
    return any(reference is not None and abs(logprob - reference) <= LOGPROB_TOLERANCE for reference in references)


def _median(summary: dict, config: str, length: int) -> float | None:
    point = summary["experiment1"].get(config, {}).get(str(length))
    return point["ttft_s"]["median"] if point and point["ttft_s"] else None


def targets(plan: dict, summary: dict) -> list[dict]:
    """The issue's targets as figures at 8K tokens (or the longest measured length), never asserts."""
    length = TARGET_LENGTH_TOKENS if TARGET_LENGTH_TOKENS in plan["lengths"] else max(plan["lengths"])
    recompute = _median(summary, "recompute", length)
    dram = _median(summary, "kvtier_dram", length)
    nvme = _median(summary, "kvtier_nvme", length)
    lmcache = _median(summary, "lmcache_disk", length)
    floor = _median(summary, "disk_floor", length)
    shared = _median(summary, "kvtier_shared", length)
    object_hit = _median(summary, "kvtier_object", length)

    def ratio(numerator, denominator):
        return numerator / denominator if numerator is not None and denominator else None

    rows = [
        ("kvtier NVMe hit / kvtier DRAM hit", ratio(nvme, dram), TARGET_NVME_OVER_DRAM, None),
        ("kvtier DRAM hit / recompute", ratio(dram, recompute), TARGET_HIT_OVER_RECOMPUTE, None),
        ("kvtier NVMe hit / recompute", ratio(nvme, recompute), TARGET_HIT_OVER_RECOMPUTE, None),
        (
            "kvtier NVMe hit / LMCache disk hit",
            ratio(nvme, lmcache),
            TARGET_NVME_OVER_LMCACHE,
            None
            if lmcache is not None
            else (plan.get("lmcache_not_measured") or "LMCache's connector was not measured at this length"),
        ),
        *(
            [
                ("kvtier shared-tier hit / kvtier NVMe hit", ratio(shared, nvme), None, None),
                ("kvtier shared-tier hit / recompute", ratio(shared, recompute), None, None),
            ]
            if plan.get("shared")
            else []
        ),
        *(
            [
                ("kvtier object-tier hit / kvtier NVMe hit", ratio(object_hit, nvme), None, None),
                ("kvtier object-tier hit / kvtier shared-tier hit", ratio(object_hit, shared), None, None),
                ("kvtier object-tier hit / recompute", ratio(object_hit, recompute), None, None),
            ]
            if plan.get("object")
            else []
        ),
        (
            # How much of the NVMe hit's extra time over a DRAM hit the disk itself needs: 1.0 means the
            # extra time is the disk's read time, so an NVMe hit within 1.3x of a DRAM hit needs a
            # faster disk, not a faster store.
            "(kvtier NVMe hit - kvtier DRAM hit) / disk floor",
            ratio(nvme - dram, floor) if nvme is not None and dram is not None else None,
            None,
            None if floor is not None else "fio not run (--no-disk-floor or fio missing)",
        ),
    ]
    return [
        {
            "name": name,
            "length_tokens": length,
            "value": value,
            "target_at_most": target,
            "met": None if value is None or target is None else value <= target,
            "note": note,
        }
        for name, value, target, note in rows
    ]


def _exp2_median(summary: dict, config: str, rate: int) -> float | None:
    point = summary["experiment2"].get(config, {}).get(str(rate))
    return point["ttft_s"]["median"] if point and point["ttft_s"] else None


def stores_off_the_critical_path_targets(plan: dict, summary: dict) -> list[dict]:
    """Issue 14's targets, as figures (never asserts): a miss costs at most 1.05x recompute; at the
    hit-rate length NVMe within 1.1x of DRAM, both at most recompute and at most 1.1x vLLM's own
    prefix cache at every hit rate; a DRAM hit within vLLM's prefix hit + 1.5x the KV bytes' memcpy
    time, an NVMe hit within a DRAM hit + 1.1x their fio read time; NVMe at most 0.67x LMCache."""
    rows: list[tuple[str, int, float | None, float, str | None]] = []

    def ratio(numerator: float | None, denominator: float | None) -> float | None:
        return numerator / denominator if numerator is not None and denominator else None

    for length in plan["lengths"]:
        recompute = _median(summary, "recompute", length)
        rows.append(
            ("kvtier miss / recompute", length, ratio(_median(summary, "kvtier_miss", length), recompute), 1.05, None)
        )
    length = plan["hit_rate_length"]
    recompute_point = summary.get("experiment2_recompute")
    recompute = recompute_point["ttft_s"]["median"] if recompute_point and recompute_point["ttft_s"] else None
    for rate in plan["hit_rates"]:
        dram, nvme = _exp2_median(summary, "kvtier_dram", rate), _exp2_median(summary, "kvtier_nvme", rate)
        prefix = _exp2_median(summary, "vllm_prefix", rate)
        rows += [
            (f"{rate}% hit: kvtier NVMe / kvtier DRAM", length, ratio(nvme, dram), 1.1, None),
            (f"{rate}% hit: kvtier DRAM / recompute", length, ratio(dram, recompute), 1.0, None),
            (f"{rate}% hit: kvtier NVMe / recompute", length, ratio(nvme, recompute), 1.0, None),
            (f"{rate}% hit: kvtier DRAM / vLLM prefix cache", length, ratio(dram, prefix), 1.1, None),
            (f"{rate}% hit: kvtier NVMe / vLLM prefix cache", length, ratio(nvme, prefix), 1.1, None),
        ]
    memcpy_gbps = plan.get("memcpy_gbps")
    for length in plan["lengths"]:
        block_tokens, kv_bytes_per_token = plan.get("block_tokens"), plan.get("kv_bytes_per_token")
        kv_bytes = (
            length // block_tokens * block_tokens * kv_bytes_per_token if block_tokens and kv_bytes_per_token else 0
        )
        dram, nvme = _median(summary, "kvtier_dram", length), _median(summary, "kvtier_nvme", length)
        prefix, floor = _median(summary, "vllm_prefix", length), _median(summary, "disk_floor", length)
        copy_s = kv_bytes / (memcpy_gbps * 1e9) if memcpy_gbps and kv_bytes else None
        extra = dram - prefix if dram is not None and prefix is not None else None
        note = None if copy_s else "memcpy or the KV size not measured"
        rows.append(
            ("(kvtier DRAM hit - vLLM prefix hit) / memcpy time of the KV", length, ratio(extra, copy_s), 1.5, note)
        )
        extra = nvme - dram if nvme is not None and dram is not None else None
        note = None if floor is not None else "fio not run"
        rows.append(("(kvtier NVMe hit - kvtier DRAM hit) / fio read time", length, ratio(extra, floor), 1.1, note))
        lmcache = _median(summary, "lmcache_disk", length)
        note = None if lmcache is not None else (plan.get("lmcache_not_measured") or "LMCache not measured")
        rows.append(("kvtier NVMe hit / LMCache disk hit, per length", length, ratio(nvme, lmcache), 0.67, note))
    return [
        {
            "name": name,
            "length_tokens": length,
            "value": value,
            "target_at_most": target,
            "met": None if value is None else value <= target,
            "note": note,
            "issue": 14,
        }
        for name, length, value, target, note in rows
    ]
