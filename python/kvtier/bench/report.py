"""Summaries, targets, the printed table and the PNG plot of `kvtier bench io`.

This module owns turning raw samples (one per system, operation and repeat) into figures: GB/s
min/median/max, the ratio to fio's best read or write of the same repeat, CPU core-seconds per GB,
and the targets from the design (figures to print against, not assertions).
"""

from __future__ import annotations

import statistics

from . import workload

# Targets from the kvtier core issue: figures to print against, not asserts.
TARGET_RETRIEVE_RATIO_LARGE = 0.9  # objects >= 1 MiB, vs best fio read of the same repeat
TARGET_RETRIEVE_RATIO_SMALL = 0.8  # smaller objects (e.g. 128 KiB)
TARGET_STORE_RATIO = 0.85  # vs best fio write of the same repeat
TARGET_CPU_SECONDS_PER_GB = 0.15
TARGET_VS_LMCACHE_RETRIEVE = 1.5  # Llama-3-8B shape, 8K tokens
LMCACHE_TARGET_MODEL = "llama3-8b"
LMCACHE_TARGET_PROMPT_TOKENS = 8192

OPERATIONS = ("retrieve", "store")
SYSTEMS = ("kvtier", "kvtier_encrypted", "kvtier_shared", "kvtier_shared_encrypted", "lmcache")
# Encryption's cost (--encrypted): the summary's field, the system in clear and the same one encrypted.
ENCRYPTION_PAIRS = (
    ("encryption_cost", "kvtier", "kvtier_encrypted"),
    ("shared_encryption_cost", "kvtier_shared", "kvtier_shared_encrypted"),
)
FIO_DIRECTION = {"retrieve": "read", "store": "write"}


def spread(values: list[float | None]) -> dict | None:
    present = [value for value in values if value is not None]
    if not present:
        return None
    return {"min": min(present), "median": statistics.median(present), "max": max(present), "n": len(present)}


def retrieve_target_ratio(object_bytes: int) -> float:
    return TARGET_RETRIEVE_RATIO_LARGE if object_bytes >= workload.MIB else TARGET_RETRIEVE_RATIO_SMALL


def summarize_case(case: dict) -> dict:
    """Per system and operation: GB/s spread, CPU core-s/GB, ratio to fio (paired by repeat)."""
    repeats = case["repeats"]
    fio_best = {
        operation: [
            (sample.get("fio") or {}).get(f"best_{FIO_DIRECTION[operation]}", {}).get("gbps") for sample in repeats
        ]
        for operation in OPERATIONS
    }
    summary: dict = {}
    for operation in OPERATIONS:
        fio_values = fio_best[operation]
        fio_cpu = [_cpu_per_gb((sample.get("fio") or {}).get(f"best_{FIO_DIRECTION[operation]}")) for sample in repeats]
        summary[f"fio_{FIO_DIRECTION[operation]}"] = {
            "gbps": spread(fio_values),
            "cpu_seconds_per_gb": spread(fio_cpu),
        }
        run_best_fio = max((value for value in fio_values if value), default=None)
        for system in SYSTEMS:
            gbps_values, ratios, cpu_values = [], [], []
            for sample, fio_value in zip(repeats, fio_values, strict=True):
                measured = (sample.get(system) or {}).get(operation)
                if not measured:
                    continue
                gbps_values.append(measured["gbps"])
                cpu_values.append(_cpu_per_gb(measured, case["prompt_bytes"]))
                if fio_value:
                    ratios.append(measured["gbps"] / fio_value)
            if not gbps_values:
                continue
            gbps_spread = spread(gbps_values)
            assert gbps_spread is not None  # gbps_values has a figure
            summary[f"{system}_{operation}"] = {
                "gbps": gbps_spread,
                "ratio_to_fio": spread(ratios),
                "ratio_to_run_best_fio": (gbps_spread["median"] / run_best_fio) if run_best_fio else None,
                "cpu_seconds_per_gb": spread(cpu_values),
            }
    kvtier_retrieve = [((s.get("kvtier") or {}).get("retrieve") or {}).get("gbps") for s in repeats]
    lmcache_retrieve = [((s.get("lmcache") or {}).get("retrieve") or {}).get("gbps") for s in repeats]
    paired = [ours / theirs for ours, theirs in zip(kvtier_retrieve, lmcache_retrieve, strict=True) if ours and theirs]
    if paired:
        summary["kvtier_vs_lmcache_retrieve"] = spread(paired)
    summary.update(encryption_costs(repeats))
    summary["wrong_objects"] = {
        system: sum((s.get(system) or {}).get("wrong_objects", 0) or 0 for s in repeats) for system in SYSTEMS
    }
    shared = [s["kvtier_shared"] for s in repeats if s.get("kvtier_shared")]
    if shared:
        summary["kvtier_shared_files"] = {
            field: spread([sample["files"][field] for sample in shared if sample.get("files")])
            for field in ("data_files", "files_per_gb", "directory_entries_per_gb")
        }
        summary["kvtier_shared_files"]["metadata_ops_per_gb"] = spread(
            [sample["metadata_ops"]["total_per_gb"] for sample in shared if sample.get("metadata_ops")]
        )
        summary["kvtier_shared_dropped_publishes"] = sum(
            (sample.get("store") or {}).get("shared_dropped_publishes") or 0 for sample in shared
        )
        summary["kvtier_shared_open_ms"] = spread(
            [sample["b_open_seconds"] * 1e3 for sample in shared if "b_open_seconds" in sample]
        )
        summary["kvtier_shared_visibility_ms"] = spread(
            [sample["visibility_seconds"] * 1e3 for sample in shared if "visibility_seconds" in sample]
        )
    return summary


def _cpu_per_gb(measured: dict | None, prompt_bytes: int | None = None) -> float | None:
    if not measured or measured.get("cpu_seconds") is None:
        return None
    moved_bytes = measured.get("bytes") or prompt_bytes
    if not moved_bytes:
        return None
    return measured["cpu_seconds"] / (moved_bytes / 1e9)


def evaluate_targets(case: dict) -> list[dict]:
    """Each target that applies to this case, with the measured median and whether it is met."""
    summary = case["summary"]
    checks = []

    def add(name: str, short: str, measured: float | None, target: float, higher_is_better: bool = True) -> None:
        if measured is None:
            return
        met = measured >= target if higher_is_better else measured <= target
        checks.append(
            {
                "target": name,
                "short": short,
                "measured": measured,
                "goal": target,
                "higher_is_better": higher_is_better,
                "met": met,
            }
        )

    retrieve = summary.get("kvtier_retrieve")
    if retrieve and retrieve["ratio_to_fio"]:
        add(
            f"retrieve >= {retrieve_target_ratio(case['object_bytes'])}x fio read",
            f">={retrieve_target_ratio(case['object_bytes'])}x fio",
            retrieve["ratio_to_fio"]["median"],
            retrieve_target_ratio(case["object_bytes"]),
        )
    store = summary.get("kvtier_store")
    if store and store["ratio_to_fio"]:
        add(
            f"store >= {TARGET_STORE_RATIO}x fio write",
            f">={TARGET_STORE_RATIO}x fio",
            store["ratio_to_fio"]["median"],
            TARGET_STORE_RATIO,
        )
    for operation, measured in (("retrieve", retrieve), ("store", store)):
        if measured and measured["cpu_seconds_per_gb"]:
            add(
                f"{operation} CPU <= {TARGET_CPU_SECONDS_PER_GB} core-s/GB",
                f"<={TARGET_CPU_SECONDS_PER_GB} core-s/GB",
                measured["cpu_seconds_per_gb"]["median"],
                TARGET_CPU_SECONDS_PER_GB,
                higher_is_better=False,
            )
    versus = summary.get("kvtier_vs_lmcache_retrieve")
    if versus and case["model"] == LMCACHE_TARGET_MODEL and case["prompt_tokens"] == LMCACHE_TARGET_PROMPT_TOKENS:
        add(
            f"retrieve >= {TARGET_VS_LMCACHE_RETRIEVE}x LMCache",
            f">={TARGET_VS_LMCACHE_RETRIEVE}x LMCache",
            versus["median"],
            TARGET_VS_LMCACHE_RETRIEVE,
        )
    return checks


# ---------------------------------------------------------------------------------------------- table


def _fmt_spread(value: dict | None, digits: int = 2) -> str:
    if not value:
        return "-"
    return f"{value['min']:.{digits}f} / {value['median']:.{digits}f} / {value['max']:.{digits}f}"


def _fmt_number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


TABLE_COLUMNS = (
    "model",
    "prompt",
    "object",
    "system",
    "op",
    "GB/s min / med / max",
    "x fio (med)",
    "core-s/GB",
    "target",
)


def encryption_costs(repeats: list[dict]) -> dict:
    """Encryption's cost per operation, paired by repeat (``--encrypted``): how many times longer the
    encrypted store takes than the one in clear (clear GB/s / encrypted GB/s); ``encryption_cost_*`` for
    the local tiers, ``shared_encryption_cost_*`` for the shared-filesystem tier (with ``--shared``)."""
    costs_by_operation = {}
    for field, clear_system, encrypted_system in ENCRYPTION_PAIRS:
        for operation in OPERATIONS:
            clear = [((s.get(clear_system) or {}).get(operation) or {}).get("gbps") for s in repeats]
            encrypted = [((s.get(encrypted_system) or {}).get(operation) or {}).get("gbps") for s in repeats]
            costs = [plain / secret for plain, secret in zip(clear, encrypted, strict=True) if plain and secret]
            if costs:
                costs_by_operation[f"{field}_{operation}"] = spread(costs)
    return costs_by_operation


TABLE_SYSTEMS = (
    ("kvtier", "kvtier"),
    ("kvtier encrypted", "kvtier_encrypted"),
    ("kvtier shared fs", "kvtier_shared"),
    ("kvtier shared fs encrypted", "kvtier_shared_encrypted"),
    ("LMCache disk", "lmcache"),
)


def table_rows(document: dict) -> list[list[str]]:
    rows = []
    for case in document["cases"]:
        summary = case["summary"]
        label_object = f"{case['object_kind']} ({workload.format_bytes(case['object_bytes'])})"
        label_prompt = workload.format_token_count(case["prompt_tokens"])
        checks = {check["target"]: check for check in case.get("targets", [])}
        for operation in OPERATIONS:
            entries = [("fio (best)", f"fio_{FIO_DIRECTION[operation]}")]
            entries += [(label, f"{system}_{operation}") for label, system in TABLE_SYSTEMS]
            for system_label, key in entries:
                entry = summary.get(key)
                if not entry or not entry.get("gbps"):
                    continue
                ratio = (entry.get("ratio_to_fio") or {}).get("median") if system_label != "fio (best)" else 1.0
                cpu = (entry.get("cpu_seconds_per_gb") or {}).get("median")
                rows.append(
                    [
                        document["models"][case["model"]]["name"],
                        label_prompt,
                        label_object,
                        system_label,
                        operation if system_label != "fio (best)" else FIO_DIRECTION[operation],
                        _fmt_spread(entry["gbps"]),
                        _fmt_number(ratio),
                        _fmt_number(cpu, 3),
                        _target_text(system_label, operation, summary, checks),
                    ]
                )
    return rows


def _target_text(system_label: str, operation: str, summary: dict, checks: dict) -> str:
    """The table's last column for one system and operation: targets met or missed, the shared tier's
    files and visibility, encryption's cost, kvtier against LMCache."""
    if system_label == "kvtier":
        marks = []
        for name, check in checks.items():
            if name.startswith(operation) and "LMCache" not in name:
                marks.append(("ok " if check["met"] else "MISS ") + check["short"])
        return "; ".join(marks)
    encryption_field = {"kvtier encrypted": "encryption_cost", "kvtier shared fs encrypted": "shared_encryption_cost"}
    cost = summary.get(f"{encryption_field.get(system_label)}_{operation}")
    if cost:
        return f"time x clear {_fmt_spread(cost)} (paired by repeat)"
    if system_label == "kvtier shared fs":
        if operation == "store" and summary.get("kvtier_shared_files"):
            files = summary["kvtier_shared_files"]
            text = (
                f"{files['files_per_gb']['median']:.1f} files/GB, "
                f"{files['directory_entries_per_gb']['median']:.1f} dir entries/GB, "
                f"{files['metadata_ops_per_gb']['median']:.1f} meta ops/GB"
            )
            if summary.get("kvtier_shared_dropped_publishes"):
                text += f"; {summary['kvtier_shared_dropped_publishes']} publishes dropped"
            return text
        if operation == "retrieve" and summary.get("kvtier_shared_visibility_ms"):
            return (
                f"visible after {summary['kvtier_shared_visibility_ms']['median']:.1f} ms "
                f"(open {summary['kvtier_shared_open_ms']['median']:.1f} ms)"
            )
    versus = summary.get("kvtier_vs_lmcache_retrieve")
    if system_label == "LMCache disk" and operation == "retrieve" and versus:
        text = f"kvtier = {versus['median']:.2f}x LMCache"
        check = next((c for n, c in checks.items() if "LMCache" in n), None)
        if check:
            text += " (ok)" if check["met"] else f" (MISS, goal {TARGET_VS_LMCACHE_RETRIEVE}x)"
        return text
    return ""


def lookup_lines(document: dict) -> list[str]:
    """One line per call kind of the shared index lookup latency (empty without --shared)."""
    lookup = (document["systems"].get("kvtier_shared") or {}).get("lookup")
    if not lookup:
        return []
    lines = []
    for name in ("lookup_prefix", "contains_many"):
        per_call, per_key = lookup[name]["us_per_call"], lookup[name]["us_per_key"]
        lines.append(
            f"shared index, {lookup['key_count']:,} keys present: {name}: "
            f"{per_call['min']:.0f} / {per_call['median']:.0f} / {per_call['max']:.0f} us per call, "
            f"{per_key['min'] * 1e3:.0f} / {per_key['median'] * 1e3:.0f} / {per_key['max'] * 1e3:.0f} ns per key "
            f"(min / med / max of {per_call['n']})"
        )
    return lines


def render_table(document: dict, console_file=None) -> str:
    """Print the table (rich when installed); return it as plain text for table.txt."""
    rows = table_rows(document)
    extra = lookup_lines(document)
    plain = "\n".join([_plain_table(rows), *extra])
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(plain, file=console_file)
        return plain
    table = Table(title=f"kvtier bench io — {document['started_at']}", show_lines=False)
    for column in TABLE_COLUMNS:
        table.add_column(column, justify="right" if column[0] in "Gxc" else "left")
    previous_case = None
    for row in rows:
        case_key = tuple(row[:3])
        if previous_case is not None and case_key != previous_case:
            table.add_section()
        previous_case = case_key
        styled = list(row)
        if "MISS" in styled[-1]:
            styled[-1] = f"[red]{styled[-1]}[/red]"
        elif styled[-1].startswith("ok") or styled[-1].endswith("(ok)"):
            styled[-1] = f"[green]{styled[-1]}[/green]"
        table.add_row(*styled)
    console = Console(file=console_file, width=200)
    console.print(table)
    for line in extra:
        console.print(line, markup=False, highlight=False)
    return plain


def _plain_table(rows: list[list[str]]) -> str:
    widths = [len(column) for column in TABLE_COLUMNS]
    for row in rows:
        widths = [max(width, len(cell)) for width, cell in zip(widths, row, strict=True)]
    lines = ["  ".join(column.ljust(width) for column, width in zip(TABLE_COLUMNS, widths, strict=True))]
    lines.append("  ".join("-" * width for width in widths))
    for row in rows:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- plot


def write_plot(document: dict, path: str) -> str | None:
    """Bar chart of median GB/s with min-max whiskers per case, retrieve and store side by side.

    Returns None when it was written, else the reason it was not (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'kvtier[bench]' or pip install matplotlib)"

    cases = document["cases"]
    systems = [
        ("fio (best)", "fio_{direction}", "#7f7f7f"),
        ("kvtier", "kvtier_{operation}", "#1f77b4"),
        ("kvtier encrypted", "kvtier_encrypted_{operation}", "#9467bd"),
        ("kvtier shared fs", "kvtier_shared_{operation}", "#2ca02c"),
        ("kvtier shared fs encrypted", "kvtier_shared_encrypted_{operation}", "#17becf"),
        ("LMCache disk", "lmcache_{operation}", "#ff7f0e"),
    ]
    labels = [
        f"{document['models'][c['model']]['name']}\n{workload.format_token_count(c['prompt_tokens'])} tok\n"
        f"{c['object_kind']} {workload.format_bytes(c['object_bytes'])}"
        for c in cases
    ]
    figure, axes = plt.subplots(2, 1, figsize=(max(8.0, 1.3 * len(cases)), 9.0), sharey=True)
    width = 0.8 / len(systems)
    for axis, operation in zip(axes, OPERATIONS, strict=True):
        direction = FIO_DIRECTION[operation]
        for index, (label, pattern, color) in enumerate(systems):
            key = pattern.format(direction=direction, operation=operation)
            xs, medians, lower, upper = [], [], [], []
            for position, case in enumerate(cases):
                entry = case["summary"].get(key)
                if not entry or not entry.get("gbps"):
                    continue
                gbps = entry["gbps"]
                xs.append(position + (index - (len(systems) - 1) / 2) * width)
                medians.append(gbps["median"])
                lower.append(gbps["median"] - gbps["min"])
                upper.append(gbps["max"] - gbps["median"])
            if xs:
                axis.bar(xs, medians, width, yerr=[lower, upper], capsize=3, label=label, color=color)
        title = "cold retrieve (page cache dropped)" if operation == "retrieve" else "store (kvtier: incl. flush)"
        axis.set_title(title)
        axis.set_xticks(range(len(cases)))
        axis.set_xticklabels(labels, fontsize=7)
        axis.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("GB/s (median, whiskers min-max)")
    axes[0].legend(loc="upper left", fontsize=8)
    figure.suptitle(f"kvtier bench io, {document['repeats']} repeats, {document['started_at']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None
