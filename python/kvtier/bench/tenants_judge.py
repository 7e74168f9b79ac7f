"""``kvtier bench tenants``' judging and table (``kvtier.bench.tenants`` runs the rows): which rows
contradict their labels, and the table's lines."""

from __future__ import annotations

from typing import Any

PROTECTED_ROWS = {"flood-shares": "the share", "flood-cap": "the cap"}  # rows that must keep the quiet tenant's hits
QUIET, FLOOD = "quiet", "flood"
MIN_RATIO = 0.9  # issue 40: the quiet tenant keeps at least this share of its hit rate alone
LOCAL_HIT_LIMIT = 0.1  # at most this share of the quiet tenant's hits from vLLM's own cache
SHARED_LOW_WATERMARK = 0.6  # the room the shares are fractions of
TABLE_HEADER = [
    "row", "quiet hit rate", "on repeats", "vs alone", "quiet TTFT p50 / p99 ms", "on repeats", "flood req/s",
    "flood prompt tok/s", "quiet in pool MiB", "quiet guaranteed MiB", "quiet evicted", "flood evicted", "failed",
]  # fmt: skip
NVME_COLUMNS = ["quiet on NVMe MiB", "regions reclaimed quiet / flood"]  # with --nvme-regions
SHARED_COLUMNS = ["quiet on shared MiB", "files evicted quiet / flood"]  # with --shared-files
BUCKET_COLUMNS = ["quiet in bucket MiB", "segments evicted quiet / flood"]  # with --bucket-segments
EXTRA_COLUMNS = {"nvme": NVME_COLUMNS, "shared": SHARED_COLUMNS, "bucket": BUCKET_COLUMNS}
BUCKET_TRIM_FRACTION = 0.9  # the object tier's evictor trims to this share of the budget: the room shares split


def judge(plan: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The problems of the run: a row that contradicts its label (module docstring). Fills each row's
    ``vs_alone`` (its quiet hit rate over the alone row's) and ``local_hit_share``."""
    problems: list[str] = []
    alone = next((record for record in rows if record["row"] == "alone"), None)
    alone_rate = alone.get("quiet_hit_rate") if alone else None
    for record in rows:
        row = record["row"]
        problems += [f"{row}: {problem}" for problem in record["problems"]]
        if "quiet_hit_rate" not in record:
            if not record["problems"]:
                problems.append(f"{row}: not measured")
            continue
        failed = record["quiet_failed"] + record["flood_failed"]
        if failed:
            problems.append(f"{row}: {failed} requests failed ({'; '.join(record['errors'][:3])})")
        rate = record["quiet_hit_rate"] or 0.0
        cached = record["quiet_cached_tokens"]
        metrics = record.get("vllm_cache_tokens") or {}
        local = metrics.get("vllm_hits")
        if local is not None:
            record["local_hit_share"] = local / cached if cached else 0.0
            if cached and local > LOCAL_HIT_LIMIT * cached:
                problems.append(
                    f"{row}: vLLM's own cache served {local:.0f} of the quiet tenant's {cached} cached tokens: "
                    "the row does not measure kvtier's pool (fewer --vllm-blocks)"
                )
        if alone_rate:
            record["vs_alone"] = rate / alone_rate
        if row == "alone" and not cached:
            problems.append("alone: the quiet tenant had no hit: kvtier served nothing to compare with")
        if row == "flood" and alone_rate and rate >= MIN_RATIO * alone_rate:
            problems.append(
                f"flood: the flood cost the quiet tenant no hits ({rate:.3f} against {alone_rate:.3f} alone): the "
                "pool holds both tenants, so the shares row shows nothing (more --flood-per-round, fewer --pool-blocks)"
            )
        if row == "flood-shares":
            problems += shares_problems(plan, record, alone_rate)
        if row == "flood-cap":
            problems += cap_problems(plan, record, alone_rate)
    return problems


def protection_problems(record: dict[str, Any], alone_rate: float | None) -> list[str]:
    """A row with shares or a cap: the quiet tenant kept ``MIN_RATIO`` of its hit rate alone, and the
    pool shows both tenants' counters."""
    row, what = record["row"], PROTECTED_ROWS[record["row"]]
    problems = []
    rate = record["quiet_hit_rate"] or 0.0
    if alone_rate and rate < MIN_RATIO * alone_rate:
        problems.append(
            f"{row}: the quiet tenant kept {rate / alone_rate:.2f}x its hit rate alone ({rate:.3f} against "
            f"{alone_rate:.3f}), under {MIN_RATIO}x: {what} did not protect it"
        )
    tenants = record.get("tenants") or {}
    if QUIET not in tenants or FLOOD not in tenants:
        problems.append(f"{row}: the pool shows no tenant counters for quiet and flood: {record.get('tenants')}")
    return problems


def cap_problems(plan: dict[str, Any], record: dict[str, Any], alone_rate: float | None) -> list[str]:
    """``flood-cap``: as a shares row, and the documents fit both the quiet tenant's own cap and the
    room the flood's cap leaves it."""
    problems = protection_problems(record, alone_rate)
    room = min(plan["cap"], 1 - plan["cap"])
    need, have, unit = quiet_need_and_room(plan, room)
    if need > have:
        problems.append(
            f"flood-cap: the quiet tenant's documents take {need} {unit}, more than the {have} a cap of "
            f"{plan['cap']} leaves it (more --pool-blocks, --nvme-regions, --shared-files or --bucket-segments)"
        )
    return problems


def shares_problems(plan: dict[str, Any], record: dict[str, Any], alone_rate: float | None) -> list[str]:
    problems = protection_problems(record, alone_rate)
    tenants = record.get("tenants") or {}
    quiet = tenants.get(QUIET)
    if not quiet or FLOOD not in tenants:
        return problems  # protection_problems named the missing counters
    if plan["nvme_regions"] or plan["shared_files"] or plan.get("bucket_segments"):
        need, have, unit = quiet_need_and_room(plan, plan["share"])
        if have < need:
            problems.append(
                f"flood-shares: the quiet tenant's documents take {need} {unit}, more than its guaranteed "
                f"{have} (more --nvme-regions, --shared-files, --bucket-segments or --share)"
            )
    elif quiet.get("guaranteed_bytes", 0) < plan["quiet_blocks"] * plan["slot_bytes"]:
        problems.append(
            f"flood-shares: the quiet tenant's documents ({plan['quiet_blocks']} blocks) do not fit its guaranteed "
            f"{quiet.get('guaranteed_bytes', 0)} bytes (more --pool-blocks or --share)"
        )
    return problems


def quiet_need_and_room(plan: dict[str, Any], fraction: float) -> tuple[int, int, str]:
    """What the quiet tenant's documents take in the tier the run measures, and ``fraction`` of that
    tier (of the shared tier's room, its low watermark's share of its capacity), in that tier's unit."""
    if plan["nvme_regions"]:
        return plan["quiet_regions"], int(fraction * plan["nvme_regions"]), "NVMe regions"
    if plan["shared_files"]:
        return plan["quiet_files"], int(fraction * SHARED_LOW_WATERMARK * plan["shared_files"]), "shared files"
    if plan.get("bucket_segments"):
        room = int(fraction * BUCKET_TRIM_FRACTION * plan["bucket_segments"])
        return plan["quiet_segments"], room, "bucket segments"
    return plan["quiet_blocks"], int(fraction * plan["pool_blocks"]), "pool blocks"


def number_text(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def mib_text(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def table_rows(
    rows: list[dict[str, Any]], nvme: bool = False, shared: bool = False, bucket: bool = False
) -> list[list[str]]:
    """The table's lines; ``nvme``: with ``NVME_COLUMNS`` (``--nvme-regions``); ``shared``: with
    ``SHARED_COLUMNS`` (``--shared-files``); ``bucket``: with ``BUCKET_COLUMNS`` (``--bucket-segments``)."""
    lines = []
    for record in rows:
        ttft = record.get("quiet_ttft_ms") or {}
        repeat_ttft = record.get("quiet_repeat_ttft_ms") or {}
        tenants = record.get("tenants") or {}
        quiet, flood = tenants.get(QUIET, {}), tenants.get(FLOOD, {})
        failed = record.get("quiet_failed", 0) + record.get("flood_failed", 0) if "quiet_failed" in record else None
        rate, repeat_rate = record.get("quiet_hit_rate"), record.get("quiet_repeat_hit_rate")
        lines.append([
            record["label"], number_text(rate, 3), number_text(repeat_rate, 3), number_text(record.get("vs_alone")),
            f"{number_text(ttft.get('p50'), 0)} / {number_text(ttft.get('p99'), 0)}",
            f"{number_text(repeat_ttft.get('p50'), 0)} / {number_text(repeat_ttft.get('p99'), 0)}",
            number_text(record.get("flood_request_throughput")), number_text(record.get("flood_prompt_throughput"), 0),
            mib_text(quiet.get("bytes")), mib_text(quiet.get("guaranteed_bytes")), str(quiet.get("evictions", "-")),
            str(flood.get("evictions", "-")), "-" if failed is None else str(failed),
        ])  # fmt: skip
        if nvme:
            reclaimed = f"{quiet.get('nvme_reclaimed_regions', '-')} / {flood.get('nvme_reclaimed_regions', '-')}"
            lines[-1] += [mib_text(quiet.get("nvme_bytes")), reclaimed]
        if shared:
            evicted = f"{quiet.get('shared_evicted_files', '-')} / {flood.get('shared_evicted_files', '-')}"
            lines[-1] += [mib_text(quiet.get("shared_bytes")), evicted]
        if bucket:
            evicted = f"{quiet.get('bucket_evicted_segments', '-')} / {flood.get('bucket_evicted_segments', '-')}"
            lines[-1] += [mib_text(quiet.get("bucket_bytes")), evicted]
    return lines
