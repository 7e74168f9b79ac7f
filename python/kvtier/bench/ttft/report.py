"""`kvtier bench ttft`'s report: the summary as tables (stdout and report.md) and PNG plots."""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.bench import io_pattern

CONFIG_LABELS = {
    "recompute": "recompute (no kvtier)",
    "vllm_prefix": "vLLM prefix cache hit",
    "kvtier_miss": "kvtier miss (recompute + store)",
    "kvtier_dram": "kvtier DRAM hit",
    "kvtier_nvme": "kvtier NVMe hit (page cache dropped)",
    "kvtier_nvme_encrypted": "kvtier NVMe hit, encrypted (encryption_key_file, own store, page cache dropped)",
    "example_connector": "vLLM ExampleConnector (disk, page cache dropped)",
    "lmcache_disk": "LMCache + CPU copy shim (local disk)",
    "kvtier_shared": "kvtier shared-tier hit (other node's mount, empty local store, page cache dropped)",
    "kvtier_object": "kvtier object-tier hit (S3 bucket, other node, empty local store)",
    "kvtier_object_encrypted": "kvtier object-tier hit, encrypted (encryption_key_file on both nodes, own prefix)",
    "disk_floor": "disk floor: fio O_DIRECT read of the same bytes",
}


def _cell(point: dict | None) -> str:
    if not point or not point["ttft_s"]:
        return "-"
    spread_s = point["ttft_s"]
    text = f"{spread_s['median'] * 1000:.0f} ({spread_s['min'] * 1000:.0f}-{spread_s['max'] * 1000:.0f})"
    if not point["cached_tokens_ok"] or point["problems"]:
        text += " !"
    return text


CONFIG_ORDER = (
    "recompute", "kvtier_miss", "vllm_prefix", "kvtier_dram", "kvtier_nvme", "kvtier_nvme_encrypted",
    "kvtier_shared", "kvtier_object", "kvtier_object_encrypted", "example_connector", "lmcache_disk", "disk_floor",
)  # fmt: skip


def table_rows(plan: dict, summary: dict) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    header1 = ["configuration"] + [f"{length} tok" for length in plan["lengths"]]
    rows1 = []
    for config in CONFIG_ORDER:
        points = summary["experiment1"].get(config)
        if points is None:
            continue
        rows1.append([CONFIG_LABELS[config]] + [_cell(points.get(str(length))) for length in plan["lengths"]])
    header2 = ["configuration"] + [f"{rate}% hit" for rate in plan["hit_rates"]]
    rows2 = []
    for config in CONFIG_ORDER:
        points = summary["experiment2"].get(config)
        if points is None or not plan["hit_rates"]:
            continue
        rows2.append([CONFIG_LABELS[config]] + [_cell(points.get(str(rate))) for rate in plan["hit_rates"]])
    return header1, rows1, header2, rows2


def experiment2_recompute_line(plan: dict, summary: dict) -> str | None:
    """Experiment 2's recompute reference: one figure, for every hit rate, said once."""
    point = summary.get("experiment2_recompute")
    if not plan["hit_rates"] or not point:
        return None
    return (
        f"{CONFIG_LABELS['recompute']} at {point['length_tokens']} tokens: {_cell(point)} ms, one figure for every "
        f"hit rate (measured in experiment {point['from_experiment']}; recomputing ignores what is stored)"
    )


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def io_pattern_section(phase_info: dict) -> list[str]:
    """Markdown: the NVMe tier's I/O pattern in each kvtier phase (seed 002's experiment 6), from the
    counters of the phase's service (it starts with the phase, so its counters are the phase's)."""
    # Summed over the repeats and lengths of a phase kind (kvtier_store-8192-r1 -> kvtier_store).
    totals: dict[str, dict[str, int]] = {}
    for name, info in phase_info.items():
        if name.startswith("kvtier") and "store_stats" in info:
            total = totals.setdefault(name.split("-")[0], {})
            for key, value in info["store_stats"].items():
                if key.startswith(("nvme_read", "nvme_write")):
                    total[key] = total.get(key, 0) + int(value)
    patterns = {name: io_pattern.pattern_of(total) for name, total in totals.items()}
    header, rows = io_pattern.pattern_rows(patterns)
    if not rows:
        return []
    ratios = [
        f"{name} {pattern['read_write_byte_ratio']:.2f}"
        for name, pattern in patterns.items()
        if pattern["read_write_byte_ratio"] and pattern["read"]["requests"]
    ]
    lines = ["### I/O pattern of the NVMe tier per phase kind (experiment 6; requests per size class)", ""]
    lines += [markdown_table(header, rows), ""]
    if ratios:
        lines += ["read:write bytes: " + ", ".join(ratios), ""]
    return lines


ENCRYPTED_TIER_NAMES = {"nvme": "NVMe", "object": "object-tier"}


def encryption_section(summary: dict) -> list[str]:
    """Markdown: the cost of encryption at rest on a hit (issue 40), per tier (NVMe; the bucket with
    --object) and length: the clear and the encrypted hit's median TTFT and encrypted / clear; nothing
    without --encrypted."""
    rows = summary.get("encryption")
    if not rows:
        return []

    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1000:.0f}"

    lines = []
    for tier, name in ENCRYPTED_TIER_NAMES.items():
        mine = [row for row in rows if row.get("tier", "nvme") == tier]
        if not mine:
            continue
        header = ["prompt length", f"kvtier {name} hit (ms, median)", f"encrypted {name} hit (ms, median)"]
        cells = [
            [f"{row['length_tokens']} tok", ms(row["clear_median_s"]), ms(row["encrypted_median_s"]),
             "-" if row["encrypted_over_clear"] is None else f"{row['encrypted_over_clear']:.3f}"]
            for row in mine
        ]  # fmt: skip
        title = f"### Encryption at rest: {name} hit with encryption_key_file vs in clear (AES-256-GCM, issue 40)"
        lines += [title, "", markdown_table([*header, "encrypted / clear"], cells), ""]
    return lines


def print_report(plan: dict, summary: dict, notes: list[str], phase_info: dict | None = None) -> str:
    """Prints the tables, targets and notes; returns the same as Markdown (also written to report.md)."""
    header1, rows1, header2, rows2 = table_rows(plan, summary)
    recompute_line = experiment2_recompute_line(plan, summary)
    title1 = f"Experiment 1: TTFT vs prompt length, 100% hit (ms, median (min-max) of {plan['repeats']})"
    title2 = f"Experiment 2: TTFT vs hit rate at {plan['hit_rate_length']} tokens (ms, median (min-max))"
    target_lines = []
    for target in summary["targets"]:
        value = "not measured" if target["value"] is None else f"{target['value']:.3f}"
        met = "" if target["met"] is None else (" (met)" if target["met"] else " (NOT met)")
        note = f" - {target['note']}" if target["note"] else ""
        goal = "" if target["target_at_most"] is None else f", target <= {target['target_at_most']:.3f}"
        target_lines.append(f"{target['name']} at {target['length_tokens']} tokens: {value}{goal}{met}{note}")
    output_lines = [
        f"{CONFIG_LABELS[config]}: {entry['same_token']}/{entry['compared']} same greedy token as recompute, "
        f"max |logprob diff| {entry['max_logprob_diff']:.2e}"
        for config, entry in summary["outputs_vs_recompute"].items()
    ]
    try:
        from rich.console import Console
        from rich.table import Table

        console = Console()
        for title, header, rows in ((title1, header1, rows1), (title2, header2, rows2)):
            if not rows:
                continue
            table = Table(title=title)
            for column in header:
                table.add_column(column, justify="left" if column == "configuration" else "right")
            for row in rows:
                table.add_row(*row)
            if rows is rows2 and recompute_line:
                table.caption = recompute_line
            console.print(table)
    except ImportError:
        for title, header, rows in ((title1, header1, rows1), (title2, header2, rows2)):
            if rows:
                print(title)
                print(markdown_table(header, rows))
                if rows is rows2 and recompute_line:
                    print(recompute_line)
                print()
    print("Targets (figures, not asserts):")
    for line in target_lines:
        print("  " + line)
    print("Outputs:")
    for line in output_lines:
        print("  " + line)
    for note in notes:
        print("note: " + note)
    markdown = [f"### {title1}", "", markdown_table(header1, rows1), ""]
    if rows2:
        markdown += [f"### {title2}", "", markdown_table(header2, rows2), ""]
        if recompute_line:
            markdown += [recompute_line, ""]
    memcpy = plan.get("memcpy_gbps")
    memcpy_line = [f"memcpy rate measured in this run: {memcpy:.1f} GB/s (numpy, 256 MiB copies)", ""] if memcpy else []
    markdown += ["Targets (figures, not asserts):", ""] + [f"- {line}" for line in target_lines] + [""] + memcpy_line
    markdown += ["Outputs:", ""] + [f"- {line}" for line in output_lines] + [""]
    section_lines = encryption_section(summary) + io_pattern_section(phase_info or {})
    if section_lines:
        print("\n".join(section_lines))
    markdown += section_lines
    markdown += [f"- note: {note}" for note in notes]
    return "\n".join(markdown) + "\n"


def write_plots(plan: dict, summary: dict, out_dir: Path) -> list[str]:
    """PNG plots of both experiments; returns the file names (empty with a note if no matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install 'kvtier[bench]'); no plots written")
        return []
    written = []
    for experiment, x_values, x_label, file_name in (
        ("experiment1", plan["lengths"], "prompt length (tokens)", "ttft_vs_length.png"),
        ("experiment2", plan["hit_rates"], f"hit rate (%) at {plan['hit_rate_length']} tokens", "ttft_vs_hit_rate.png"),
    ):
        if not x_values or not summary[experiment]:
            continue
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for config in CONFIG_ORDER:
            points = summary[experiment].get(config)
            if not points:
                continue
            xs, medians, lows, highs = [], [], [], []
            for x in x_values:
                point = points.get(str(x))
                if point and point["ttft_s"]:
                    xs.append(x)
                    medians.append(point["ttft_s"]["median"])
                    lows.append(point["ttft_s"]["median"] - point["ttft_s"]["min"])
                    highs.append(point["ttft_s"]["max"] - point["ttft_s"]["median"])
            if xs:
                axes.errorbar(xs, medians, yerr=[lows, highs], marker="o", capsize=3, label=CONFIG_LABELS[config])
        recompute = summary.get("experiment2_recompute") if experiment == "experiment2" else None
        if recompute and recompute["ttft_s"]:
            # One figure for every hit rate: a reference line, not a series of points.
            axes.axhline(
                recompute["ttft_s"]["median"],
                color="gray",
                linestyle="--",
                label=f"{CONFIG_LABELS['recompute']} (experiment {recompute['from_experiment']}, any hit rate)",
            )
        axes.set_xlabel(x_label)
        axes.set_ylabel("TTFT (s), median with min-max")
        axes.set_yscale("log")
        axes.grid(True, which="both", alpha=0.3)
        axes.set_title(f"kvtier bench ttft ({plan['preset']}, {os.cpu_count()} CPU cores, CPU vLLM)")
        axes.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(out_dir / file_name, dpi=120)
        plt.close(figure)
        written.append(file_name)
    return written
