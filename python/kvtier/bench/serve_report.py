"""`kvtier bench serve`'s report: a point's progress line (``point_line``), the table (``table_rows``),
the plot (``write_plot``) and the slow-link rows' section under the table (``slow_link_section``)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from kvtier.bench import serve_slow
from kvtier.bench.serve_plan import COUNTERS, DECODE_METRICS, PERCENTILES, load_text


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def point_line(point: dict[str, Any]) -> str:
    ttft = point["ttft_ms"]
    text = (
        f"{_number(point['request_throughput'])} req/s, {_number(point['output_throughput'], 1)} output tok/s, "
        f"TTFT p50/p90/p99 {_number(ttft['p50'], 0)}/{_number(ttft['p90'], 0)}/{_number(ttft['p99'], 0)} ms"
    )
    for metric in DECODE_METRICS:
        if point.get(f"{metric}_ms"):
            text += f", {metric.upper()} p50/p99 {_p50_p99(point, metric)} ms"
    if point.get("cache_tokens"):
        tokens = point["cache_tokens"]
        text += f", cached tokens: vLLM's {tokens['vllm_hits']}, connector's {tokens['connector_hits']}"
    if point.get("lmcache"):
        shim = point["lmcache"]
        text += f", LMCache loaded {shim['loaded_tokens']} tokens, stored {shim['stored_tokens']}"
        if shim["disk_chunks_read"]:
            text += f" ({shim['disk_chunks_read']} chunks from disk)"
    if point.get("kvtier"):
        counters = point["kvtier"]
        text += (
            f", kvtier DRAM hits {counters['dram_hits']}, NVMe hits {counters['nvme_hits']}, "
            f"shared hits {counters['shared_hits']}, puts {counters['puts']}, "
            f"NVMe written {counters.get('bytes_written_nvme', 0) / 2**20:.0f} MiB"
        )
        if counters.get("dropped_without_evidence"):
            text += f" ({counters['dropped_without_evidence']} blocks dropped unused)"
        if counters.get("retained_by_hint"):
            text += f", {counters['retained_by_hint']} blocks of hinted requests"
        if counters.get("bucket_put_requests"):
            written_mib = counters.get("bucket_bytes_written", 0) / 2**20
            text += f", bucket PUTs {counters['bucket_put_requests']} ({written_mib:.0f} MiB)"
    if point.get("cpu_s"):
        text += f", CPU ms per request: server (kvtier threads) / service {cpu_text(point)}"
    if point.get("kv_events"):
        events = point["kv_events"]
        rate = events["bytes_per_s"]
        text += (
            f", KV events {events['events_per_request']:.1f} per request ({events['kvtier_events_per_request']:.1f} "
            f"kvtier's), {_number(rate / 1000 if rate is not None else None, 1)} KB/s"
        )
    return text


def cpu_text(point: dict[str, Any]) -> str:
    """The point's CPU per request (``cpu_account``), in ms: the servers' (kvtier's threads in them)
    and the host service's; the service's is "-" for a row without one."""
    per_request = (point.get("cpu_s") or {}).get("per_request")
    if not per_request:
        return "-"
    ms = {name: value * 1000 for name, value in per_request.items()}
    service = _number(ms["service_s"], 0) if point.get("kvtier") else "-"
    return f"{ms['server_s']:.0f} ({ms['engine_kvtier_threads_s']:.0f}) / {service}"


def _p50_p99(point: dict[str, Any], metric: str) -> str:
    values = point.get(f"{metric}_ms") or {}
    return f"{_number(values.get('p50'), 0)}/{_number(values.get('p99'), 0)}"


TABLE_HEADER = [
    "row", "users", "requests", "req/s", "output tok/s", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms",
    "TPOT p50/p99 ms", "ITL p50/p99 ms", "connector hit tokens", "kvtier DRAM hits", "NVMe hits", "shared hits", "puts",
    "NVMe MiB written", "dropped unused", "hinted blocks", "bucket PUTs", "bucket MiB written",
    "CPU ms/request server (kvtier threads) / service",
]  # fmt: skip


def row_label(record: dict[str, Any]) -> str:
    occurrence = record.get("occurrence", 1)
    return record["label"] if occurrence == 1 else f"{record['label']} (run {occurrence})"


def _counter(counters: dict[str, int], name: str) -> str:
    if name not in counters:
        return "-"
    return _number(counters[name] / 2**20, 0) if "bytes" in name.split("_") else str(counters[name])


def _bucket_cells(document: dict[str, Any], record: dict[str, Any], counters: dict[str, int]) -> list[str]:
    """The bucket's PUTs and MiB written in a point, for a row that has the object tier."""
    publishing = (document.get("settings") or {}).get("publish_bucket_rows") or ()
    row = record.get("row", "")
    if row not in publishing and serve_slow.tier_of(row) is not serve_slow.BUCKET:
        return ["-", "-"]
    return [_counter(counters, "bucket_put_requests"), _counter(counters, "bucket_bytes_written")]


def table_rows(document: dict[str, Any]) -> list[list[str]]:
    rows = []
    for record in document["rows"]:
        for point in record["points"]:
            counters = point.get("kvtier") or {}
            ttft = point["ttft_ms"]
            rows.append(
                [
                    row_label(record),
                    str(point["users"]),
                    f"{point['completed']}" + (f" ({point['failed']} failed)" if point.get("failed") else ""),
                    _number(point["request_throughput"]),
                    _number(point["output_throughput"], 1),
                    *(_number(ttft[f"p{p}"], 0) for p in PERCENTILES),
                    *(_p50_p99(point, metric) for metric in DECODE_METRICS),
                    str((point.get("cache_tokens") or {}).get("connector_hits", "-")),
                    *(_counter(counters, name) for name in COUNTERS),
                    *_bucket_cells(document, record, counters),
                    cpu_text(point),
                ]
            )
        if not record["points"]:
            why = record.get("skipped") or "not measured"
            rows.append([row_label(record), "-", why, *["-"] * (len(TABLE_HEADER) - 3)])
    return rows


def write_plot(document: dict[str, Any], path: Path) -> str | None:
    """Request throughput and TTFT p99 against users, one line per row. None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'kvtier[bench]'); no plot written"
    figure, (throughput_axis, ttft_axis, tpot_axis) = plt.subplots(1, 3, figsize=(15, 4.5))
    for record in document["rows"]:
        points = [p for p in record["points"] if p.get("request_throughput") is not None]
        if not points:
            continue
        users = [p["users"] for p in points]
        throughput_axis.plot(users, [p["request_throughput"] for p in points], marker="o", label=row_label(record))
        ttft_axis.plot(users, [p["ttft_ms"]["p99"] for p in points], marker="o", label=row_label(record))
        tpot = [(p.get("tpot_ms") or {}).get("p99") for p in points]
        tpot_axis.plot(users, [math.nan if t is None else t for t in tpot], marker="o", label=row_label(record))
    axes = (
        (throughput_axis, "requests / s"),
        (ttft_axis, "TTFT p99 (ms)"),
        (tpot_axis, "TPOT p99 (ms per output token)"),
    )
    for axis, label in axes:
        axis.set_xticks(document["settings"]["users"])
        axis.set_ylim(bottom=0)
        axis.set_xlabel("users (one system prompt each)")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    settings = document["settings"]
    figure.suptitle(
        f"kvtier bench serve: {settings['preset']}, prefix {settings['prefix_len']} + question "
        f"{settings['suffix_len']} tokens, {settings['output_len']} out, {settings['requests_per_user']} requests per "
        f"user, {load_text(settings)}, {os.cpu_count()} CPU cores",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None


def slow_link_section(document: dict[str, Any]) -> str:
    """Under the table: each slow tier row's decisions per point, and kvtier's choice against the better
    of vLLM alone and always-load (``document["slow_link"]``); "" without slow tier rows."""
    lines = []
    for record in document["rows"]:
        if serve_slow.row_base(record["row"]) in serve_slow.ROW_LABELS:
            for point in record["points"]:
                decisions = point.get("load_decisions") or {}
                counted = ", ".join(f"{key} {count}" for key, count in sorted(decisions.items())) or "none"
                lines.append(f"- {record['label']}, {point['users']} users: load decisions (blocks) {counted}")
    document["slow_link"] = serve_slow.judged(document)
    for judged in document["slow_link"]:
        value = judged["auto_over_best"]
        verdict = "-" if value is None else f"{value:.2f}x" + ("" if judged["met"] else " (NOT met)")
        lines.append(
            f"- kvtier's choice ({judged.get('tier', 'bucket')} tier) at {judged['link_mb_per_s']:g} MB/s, "
            f"{judged['users']} users: {verdict} the req/s of "
            f"the better of vLLM alone and always-load ({judged['better']}; target >= {judged['target_at_least']})"
        )
    return "\n\n" + "\n".join(lines) if lines else ""
