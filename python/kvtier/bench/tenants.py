"""``kvtier bench tenants``: two tenants on one kvtier DRAM pool, one of them flooding it (issue 40).

A tenant is a request's ``cache_salt`` (docs/tenants.md). Real ``vllm serve`` servers with kvtier
(``KvtierConnector``, the host service as ``kvtier bench faults`` runs it: ``serve_servers.start_server``,
its ``kvtier-dram`` row: DRAM only, no NVMe tier), driven by streamed completions that carry the salt.

- The quiet tenant (salt ``quiet``) sends ``--quiet-requests`` requests, one after the other, each one
  of ``--docs`` long shared prefixes (a system prompt, a document; taken in turn) followed by a question
  of its own.
- The flooding tenant (salt ``flood``) sends ``--flood-per-round`` one-off long prompts in each round
  (one round per quiet request, sent beside it, ``--flood-concurrency`` at a time): far more new blocks
  between two uses of a document than kvtier's pool holds.

vLLM's own KV cache is cut to ``--vllm-blocks`` blocks (``--num-gpu-blocks-override``), too few to keep
a document until its next use, so the quiet tenant's hits come from kvtier's pool; the pool
(``--pool-blocks`` blocks, ``dram_bytes``; ``nvme_bytes`` 0) holds the quiet tenant's documents
(within its share) but not the flood too. kvtier loads every hit (``load_policy: always``): the rows
measure what the pool keeps, not the choice to load or recompute.

Rows, each on a fresh store; rows with the same kvtier options (``alone`` and ``flood``) share one
server and store, one after the other, each with documents of its own (removed after the last):

- ``alone``: the quiet tenant only.
- ``flood``: the same quiet requests with the flood, ``tenant_dram_share`` unset (one pool for all).
- ``flood-shares``: the same with ``tenant_dram_share`` ``--share`` (each tenant guaranteed that share).
- ``flood-cap`` (only when named in ``--rows``): the same with ``tenant_dram_max_share`` ``--cap``
  instead (no tenant holds more than that share, none is guaranteed any): the flood makes room from its
  own blocks at its cap, and the rest of the pool stays the quiet tenant's.

The rows are measured one after the other. ``--start-together`` (``--small`` implies it) starts both
servers at once and waits for both before the first row: a start is mostly single-threaded imports, so
on two cores two starts take about as long as one, and an idle server polls nothing while another row
runs.

Per row: the quiet tenant's hit rate (prompt tokens served from a cache / prompt tokens, from each
response's ``usage.prompt_tokens_details.cached_tokens``, which counts the tokens loaded through the
connector too: checked against vLLM's ``/metrics``) and its TTFT p50/p99, each also over its repeats only
(requests whose document was sent before), the flood's requests/s and prompt tokens/s, and kvtier's counters
(``tenant_dram_bytes``, ``tenant_dram_guaranteed_bytes`` and ``tenant_dram_evictions`` per tenant).

A row that contradicts its label is a problem, and the command exits 1: a failed request; quiet hits
served by vLLM's own cache rather than kvtier's pool (over ``LOCAL_HIT_LIMIT`` of them); ``alone``
without hits; ``flood`` where the flood did not cost the quiet tenant hits (at least ``MIN_RATIO`` of its
hit rate alone: the pool held both, nothing was measured); ``flood-shares`` where the quiet tenant kept
less than ``MIN_RATIO`` of its hit rate alone (the claim fails), or its documents do not fit its
guaranteed share, or the pool shows no tenant counters.

``--nvme-regions N``: the same rows with the quiet tenant's documents on kvtier's NVMe tier instead
(issue 40's quotas below DRAM): the pool cut to ``--pool-blocks`` (default ``NVME_POOL_BLOCKS``: its
staging slots), an NVMe tier of ``N`` regions of ``--region-blocks`` blocks each (``region_bytes``),
the flood past the whole tier between two uses of a document. The shares row's share then splits the
NVMe tier too (``tenant_shares_nvme``, true by default): a document must fit the quiet tenant's share
of the regions (checked), and the table adds the quiet tenant's NVMe bytes and the regions reclaimed
from each tenant.

``--shared-files N``: the same with the quiet tenant's documents on kvtier's shared-filesystem tier
instead (a directory of the row's, ``shared_root``; the pool cut as above, no NVMe tier): a tier of
``N`` data files of ``--file-blocks`` blocks (``shared_capacity_bytes``, ``shared_file_bytes``; a short
``shared_grace_ms``, so that eviction keeps up with the flood, and watermarks of 0.7 and 0.6, so that a
tenant under its share has a few files' room between the ceiling and full), the flood past the whole
tier between two uses of a document. The shares row's share splits that tier too
(``tenant_shares_shared_fs``, true by default): a document must fit the quiet tenant's share of the
tier's room (0.6 of its capacity; checked), and the table adds the quiet tenant's bytes on the tier and
the files evicted from each tenant.

``--bucket-segments N``: the same with the quiet tenant's documents on kvtier's object tier instead
(a bucket prefix per server: Ceph's RADOS gateway brought up on 127.0.0.1 by ``kvtier.bench.bucket``, or
``--bucket-url``; the pool cut as above, no NVMe tier): a budget (``bucket_budget_bytes``) of ``N``
segments of ``--segment-blocks`` blocks (``bucket_segment_bytes``; partly filled segments published
after 200 ms, the bucket listed every 100 ms), the flood past the whole budget between two uses of a
document. The shares row's share splits the bucket too (``tenant_shares_bucket``, true by default): a
document must fit the quiet tenant's share of the budget's room (the evictor trims to 0.9 of the
budget; checked), and the table adds the quiet tenant's bytes in the bucket and the segments evicted
from each tenant.

Output: the table (also ``--out DIR``/``table.md``), ``--json``: the result document on stdout;
``--out DIR``/``results.json`` and the servers' logs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvtier.bench import bucket, serve, serve_plan, serve_points, serve_servers
from kvtier.bench.tenants_judge import (
    EXTRA_COLUMNS,
    FLOOD,
    QUIET,
    SHARED_LOW_WATERMARK,
    TABLE_HEADER,
    judge,
    number_text,
    table_rows,
)
from kvtier.bench.ttft import markdown_table

ROWS = ("alone", "flood", "flood-shares", "flood-cap")
DEFAULT_ROWS = ("alone", "flood", "flood-shares")
ROW_LABELS = {"alone": "alone", "flood": "flood, no shares", "flood-shares": "flood, shares", "flood-cap": "flood, cap"}
KVTIER_ROW = "kvtier-dram"  # serve_servers' row whose store options the rows use: DRAM only
KVTIER_NVME_ROW = "kvtier-nvme"  # with --nvme-regions: DRAM over NVMe
NVME_POOL_BLOCKS = 8  # with --nvme-regions or --shared-files, the DRAM pool unless --pool-blocks: staging
# With --shared-files: a data file's header page and footer (a few entries), and the tier's options
# beside its size: eviction past a grace period of a second, files published within a fifth of one,
# and watermarks that leave the ceiling ((high + 1) / 2: 0.85) room below full for a few files of a
# tenant under its share while the flood's files wait out their grace period.
SHARED_FILE_FRAMING_BYTES = 8192
SHARED_TIER_OPTIONS = {
    "shared_grace_ms": 1000, "shared_staleness_ms": 200, "shared_publish_delay_ms": 200,
    "shared_high_watermark": 0.7, "shared_low_watermark": SHARED_LOW_WATERMARK,
}  # fmt: skip
# With --bucket-segments: a segment's header page, each block's value rounded to 4 KiB and its
# descriptor page (docs/object-tier.md, "Segment object"); the tier's options beside its size.
BUCKET_PAGE_BYTES = 4096
BUCKET_TIER_OPTIONS = {"bucket_publish_delay_ms": 200, "bucket_refresh_ms": 100}
# A round (a quiet request and its flood) lasts at least this long with the bucket: a document used
# once is published (its partly filled segment within the 200-ms delay, the PUT, the listing) before
# its next use; without a flood the tiny model's rounds take a few tens of milliseconds.
BUCKET_MIN_ROUND_S = 1.0
TRAILER_ROOM_BYTES = 64 << 10  # a region's trailer (its entries' list) fits in this, for a few blocks
SLOT_OVERHEAD_BYTES = 4096  # a DRAM slot: the block's bytes and a descriptor
SERVER_DTYPE = "bfloat16"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
REQUEST_TIMEOUT_S = 600
# Seeds of the prompts: documents, questions, flood prompts and the warm-up never share a block.
DOC_SEED, QUESTION_SEED, FLOOD_SEED, WARM_UP_SEED = 4_000_000, 5_000_000, 6_000_000, 7_000_000
# Full size: kv8b (128 KiB a token: 16 MiB a 128-token block), 4 documents of 2,048 tokens (64 blocks in
# all), the pool 168 blocks (2.6 GiB; a 0.4 share is 67 blocks), 96 flood blocks a round (384 between two
# uses of a document: past the pool and S3-FIFO's ghost queue of as many entries, which would otherwise
# bring a returning document into its main queue); vLLM's cache 40 blocks (two requests of 17).
FULL = {
    "preset": "kv8b", "docs": 4, "doc_len": 2048, "question_len": 64, "quiet_requests": 16, "flood_per_round": 6,
    "flood_len": 2048, "flood_concurrency": 1, "output_len": 16, "vllm_blocks": 40, "pool_blocks": 168,
    "block_tokens": 128, "vllm_kv_gib": 2,
}  # fmt: skip
# CI size: the tiny model (run in bfloat16: 2 KiB a token, 256 KiB a block), 3 documents of 512 tokens (12 blocks), the
# pool 40 blocks (a 0.4 share: 16), 40 flood blocks a round (120 between two uses of a document: past the
# pool and its ghost queue); vLLM's cache 10 blocks (a quiet and a flood request of 5 at once).
SMALL = {
    "preset": "tiny", "docs": 3, "doc_len": 512, "question_len": 64, "quiet_requests": 9, "flood_per_round": 10,
    "flood_len": 512, "flood_concurrency": 1, "output_len": 4, "vllm_blocks": 10, "pool_blocks": 40,
    "block_tokens": 128, "vllm_kv_gib": 1,
}  # fmt: skip
# The service's counters each row records (their change over the row).
ROW_COUNTERS = (
    "dram_hits", "nvme_hits", "shared_hits", "dram_evictions", "puts", "shared_files_published",
    "shared_publish_errors", "shared_evicted_files", "shared_dropped_publishes", "bucket_hits",
    "bucket_segments_published", "bucket_evicted_segments",
)  # fmt: skip


class TenantsError(RuntimeError):
    """The arguments are wrong or a row could not run; the message says why."""


# --------------------------------------------------------------------------------------------
# arguments and plan
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier bench tenants",
        description="Two tenants (cache_salt) on one kvtier DRAM pool through real vllm serve servers: the quiet "
        "tenant's hit rate and TTFT alone, beside a flooding tenant, and beside it with tenant_dram_share.",
    )
    parser.add_argument("--small", action="store_true", help="CI size: tiny model, 9 quiet requests, 90 flood ones")
    parser.add_argument(
        "--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated, from {', '.join(ROWS)} (default the first 3)"
    )
    parser.add_argument("--share", type=float, default=0.4, help="tenant_dram_share of the shares row (0.4)")
    parser.add_argument("--cap", type=float, default=0.5, help="tenant_dram_max_share of the cap row (0.5)")
    parser.add_argument("--preset", help="model preset of kvtier.models (default kv8b; --small: tiny)")
    parser.add_argument("--docs", type=int, help="the quiet tenant's shared prefixes (default 4; --small: 3)")
    parser.add_argument("--doc-len", type=int, help="tokens of each shared prefix (default 2048; --small: 512)")
    parser.add_argument("--question-len", type=int, help="tokens of each quiet question (default 64)")
    parser.add_argument("--quiet-requests", type=int, help="quiet requests, one per round (default 16; --small: 9)")
    parser.add_argument("--flood-per-round", type=int, help="flood prompts per round (default 6; --small: 10)")
    parser.add_argument("--flood-len", type=int, help="tokens of each flood prompt (default 2048; --small: 512)")
    parser.add_argument("--flood-concurrency", type=int, help="flood requests in flight (default 1)")
    parser.add_argument("--output-len", type=int, help="tokens generated per request (default 16; --small: 4)")
    parser.add_argument("--vllm-blocks", type=int, help="vLLM's own KV cache in blocks (default 40; --small: 10)")
    parser.add_argument("--pool-blocks", type=int, help="kvtier's DRAM pool in blocks (default 168; --small: 40)")
    parser.add_argument("--block-tokens", type=int, help="vLLM's block size, tokens (default 128: CPU vLLM's)")
    parser.add_argument(
        "--nvme-regions",
        type=int,
        default=0,
        help="the quiet tenant's documents on an NVMe tier of this many regions (default 0: DRAM only)",
    )
    parser.add_argument("--region-blocks", type=int, default=4, help="blocks per NVMe region (default 4)")
    parser.add_argument(
        "--shared-files",
        type=int,
        default=0,
        help="the quiet tenant's documents on a shared-filesystem tier of this many files (default 0: none)",
    )
    parser.add_argument("--file-blocks", type=int, default=4, help="blocks per shared data file (default 4)")
    parser.add_argument(
        "--bucket-segments", type=int, default=0,
        help="the quiet tenant's documents on an object tier with a budget of this many segments (default 0: "
        "none); needs root and Ceph's radosgw (brought up on 127.0.0.1), or --bucket-url",
    )  # fmt: skip
    parser.add_argument("--segment-blocks", type=int, default=4, help="blocks per bucket segment (default 4)")
    bucket.add_arguments(parser, "--bucket-segments")
    parser.add_argument(
        "--rgw-state-dir", default="/tmp/kvtier-bench-tenants-radosgw",
        help="the local gateway's state directory (removed at the end)",
    )  # fmt: skip
    parser.add_argument("--vllm-kv-gib", type=int, help="VLLM_CPU_KVCACHE_SPACE, GiB (default 2; --small: 1)")
    parser.add_argument(
        "--start-together",
        action="store_true",
        help="start every row's server at once, then measure the rows in turn (--small does)",
    )
    parser.add_argument("--out", help="output directory (default: a new temporary directory)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG", help="one more vllm serve arg")
    parser.add_argument("--json", action="store_true", help="print the result document (JSON) on stdout")
    return parser


def make_plan(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting of the run, defaults filled in, with what ``serve_servers.start_server`` reads."""
    from kvtier.models import PRESETS

    sizes = SMALL if args.small else FULL
    plan: dict[str, Any] = {}
    for name, default in sizes.items():
        value = getattr(args, name)
        plan[name] = default if value is None else value
    if (args.nvme_regions or args.shared_files or args.bucket_segments) and args.pool_blocks is None:
        plan["pool_blocks"] = NVME_POOL_BLOCKS
    rows = [row.strip() for row in args.rows.split(",") if row.strip()]
    unknown = [row for row in rows if row not in ROWS]
    if unknown or not rows:
        raise TenantsError(f"--rows: unknown or none {unknown}; choose from {', '.join(ROWS)}")
    counts = ("docs", "doc_len", "quiet_requests", "flood_len", "flood_concurrency", "output_len", "block_tokens")
    if min(plan[name] for name in counts) < 1 or plan["question_len"] < 1 or plan["flood_per_round"] < 0:
        raise TenantsError(f"{', '.join(counts)} and --question-len must be at least 1, --flood-per-round at least 0")
    if not 0 < args.share <= 1:
        raise TenantsError("--share is a fraction of the pool in (0, 1]")
    if not 0 < args.cap < 1:
        raise TenantsError("--cap is a fraction of the pool in (0, 1)")
    if plan["preset"] not in PRESETS:
        raise TenantsError(f"--preset: unknown {plan['preset']!r}; choose from {', '.join(sorted(PRESETS))}")
    preset = PRESETS[plan["preset"]]
    # The servers run bfloat16 (--dtype; CPU vLLM downcasts float32 anyway), the float32 twins float32.
    server_dtype = preset.server_dtype or SERVER_DTYPE
    kv_bytes_per_token = preset.kv_bytes_per_token * DTYPE_BYTES[server_dtype] // DTYPE_BYTES[preset.dtype]
    slot_bytes = plan["block_tokens"] * kv_bytes_per_token + SLOT_OVERHEAD_BYTES
    pool_bytes = plan["pool_blocks"] * slot_bytes + SLOT_OVERHEAD_BYTES // 2  # no slot lost to rounding
    longest = max(plan["doc_len"] + plan["question_len"], plan["flood_len"])
    plan.update(
        rows=rows, share=args.share, cap=args.cap, small=args.small,
        vocab=min(PRESETS[plan["preset"]].vocab_size, 4000),
        kv_bytes_per_token=kv_bytes_per_token, slot_bytes=slot_bytes, pool_bytes=pool_bytes,
        doc_blocks=plan["doc_len"] // plan["block_tokens"],
        # what serve_servers.start_server reads
        dram_gib=pool_bytes / 2**30, nvme_gib=0.0,
        max_model_len=longest + plan["output_len"] + serve_plan.MODEL_LEN_MARGIN,
        server_args=["--block-size", str(plan["block_tokens"]), "--dtype", server_dtype, *args.server_arg],
    )  # fmt: skip
    plan["start_together"] = args.start_together or args.small
    plan["quiet_blocks"] = plan["docs"] * plan["doc_blocks"]  # the quiet tenant's working set in the pool
    plan.update(nvme_plan(args, plan))
    plan.update(shared_plan(args, plan))
    plan.update(bucket_plan(args, plan))
    return plan


def bucket_plan(args: argparse.Namespace, plan: dict[str, Any]) -> dict[str, Any]:
    """With ``--bucket-segments``: the object tier's segment size and budget (the row options read
    them), how many segments the quiet tenant's documents take, and the local gateway's OSD size."""
    if args.bucket_segments < 0 or args.segment_blocks < 1:
        raise TenantsError("--bucket-segments must be at least 0 and --segment-blocks at least 1")
    if not args.bucket_segments:
        return {"bucket_segments": 0}
    if args.nvme_regions or args.shared_files:
        raise TenantsError("--bucket-segments, --shared-files and --nvme-regions measure one tier each: choose one")
    if args.bucket_segments < 2:
        raise TenantsError("--bucket-segments: a budget is at least 2 segments")
    value_bytes = plan["block_tokens"] * plan["kv_bytes_per_token"]
    block_room = -(-value_bytes // BUCKET_PAGE_BYTES) * BUCKET_PAGE_BYTES + BUCKET_PAGE_BYTES
    segment_bytes = BUCKET_PAGE_BYTES + args.segment_blocks * block_room
    # A segment per document at least (its last partly filled), and one being filled.
    quiet_segments = -(-plan["quiet_blocks"] // args.segment_blocks) + 1
    return {
        "bucket_segments": args.bucket_segments, "segment_blocks": args.segment_blocks,
        "segment_bytes": segment_bytes, "bucket_budget_bytes": args.bucket_segments * segment_bytes,
        "quiet_segments": quiet_segments, "bucket_url": args.bucket_url, "bucket_endpoint": args.bucket_endpoint,
        "rgw_state_dir": args.rgw_state_dir, "min_round_s": BUCKET_MIN_ROUND_S,
        # the gateway's memstore (RAM): the budget, and the flood's segments the evictor has yet to delete
        "bucket_osd_bytes": max(1 << 30, 3 * args.bucket_segments * segment_bytes),
    }  # fmt: skip


def shared_plan(args: argparse.Namespace, plan: dict[str, Any]) -> dict[str, Any]:
    """With ``--shared-files``: the shared tier's file size and capacity (the row options read them), and
    how many files the quiet tenant's documents take."""
    if args.shared_files < 0 or args.file_blocks < 1:
        raise TenantsError("--shared-files must be at least 0 and --file-blocks at least 1")
    if not args.shared_files:
        return {"shared_files": 0}
    if args.nvme_regions:
        raise TenantsError("--shared-files and --nvme-regions measure one tier each: choose one")
    file_bytes = SHARED_FILE_FRAMING_BYTES + args.file_blocks * plan["slot_bytes"]
    # A file per document at least (its last partly filled), and one being filled.
    quiet_files = -(-plan["quiet_blocks"] // args.file_blocks) + 1
    return {
        "shared_files": args.shared_files, "file_blocks": args.file_blocks, "file_bytes": file_bytes,
        "quiet_files": quiet_files, "shared_capacity_bytes": args.shared_files * file_bytes,
    }  # fmt: skip


def nvme_plan(args: argparse.Namespace, plan: dict[str, Any]) -> dict[str, Any]:
    """With ``--nvme-regions``: the NVMe tier's size and region size (what ``start_server`` and the
    row options read), and how many regions the quiet tenant's documents take."""
    if args.nvme_regions < 0 or args.region_blocks < 1:
        raise TenantsError("--nvme-regions must be at least 0 and --region-blocks at least 1")
    if not args.nvme_regions:
        return {"nvme_regions": 0, "kvtier_row": KVTIER_ROW}
    region_bytes = -(-(args.region_blocks * plan["slot_bytes"] + TRAILER_ROOM_BYTES) // 4096) * 4096
    # A region per document at least (its last partly written), and one open region per tenant.
    quiet_regions = -(-plan["quiet_blocks"] // args.region_blocks) + 1
    return {
        "nvme_regions": args.nvme_regions, "region_blocks": args.region_blocks, "region_bytes": region_bytes,
        "quiet_regions": quiet_regions, "kvtier_row": KVTIER_NVME_ROW,
        "nvme_gib": (args.nvme_regions * region_bytes + (1 << 20)) / 2**30,  # and the superblock page
    }  # fmt: skip


# --------------------------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------------------------


def quiet_prompt(plan: dict[str, Any], number: int, row_index: int = 0) -> tuple[int, list[int]]:
    """The ``number``-th quiet request of row ``row_index``: (its document, its prompt: the document,
    then its own question). Each row has documents of its own: a row measured after another on the
    same server finds none of its documents left by the one before."""
    from kvtier.engine_process import random_prompt

    doc = number % plan["docs"]
    prefix = random_prompt(DOC_SEED + 1000 * row_index + doc, plan["doc_len"], plan["vocab"])
    return doc, prefix + random_prompt(QUESTION_SEED + number, plan["question_len"], plan["vocab"])


def flood_prompt(plan: dict[str, Any], number: int) -> list[int]:
    from kvtier.engine_process import random_prompt

    return random_prompt(FLOOD_SEED + number, plan["flood_len"], plan["vocab"])


def complete(url: str, model: str, prompt: list[int], max_tokens: int, salt: str | None) -> dict[str, Any]:
    """One streamed completion (greedy) with ``cache_salt`` ``salt``: its TTFT, prompt and cached tokens
    (``usage.prompt_tokens_details``), or its error."""
    payload: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    if salt is not None:
        payload["cache_salt"] = salt
    from kvtier.openai_server import stream_completion

    started = time.perf_counter()
    try:
        first_token_s, usage, _ = stream_completion(url, payload)
    except Exception as error:  # a failed request is counted by its row
        return {"error": f"{type(error).__name__}: {error}"}
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_ms": first_token_s * 1000,
        "prompt_tokens": int(usage.get("prompt_tokens", 0)),
        "cached_tokens": int(details.get("cached_tokens") or 0),
        "seconds": time.perf_counter() - started,
    }


def warm_up(server: Any, plan: dict[str, Any]) -> None:
    """vLLM's one-time costs for prompts of this shape (and kvtier's first store) on flood-salted prompts
    no row sends (the blocks it leaves in the pool are the flood's, not the default tenant's); then an
    empty prefix cache."""
    from kvtier.engine_process import random_prompt

    for number in range(2):
        prompt = random_prompt(WARM_UP_SEED + number, plan["doc_len"] + plan["question_len"], plan["vocab"])
        answer = complete(server.url, server.model, prompt, 1, FLOOD)
        if "error" in answer:
            raise TenantsError(f"the warm-up request failed: {answer['error']}")
    server.reset_prefix_cache()


def drive(plan: dict[str, Any], url: str, model: str, flood: bool, row_index: int = 0) -> dict[str, Any]:
    """The load of one row: round after round, a quiet request beside ``flood_per_round`` flood ones (none
    in the ``alone`` row); each round waits for all of its requests."""
    quiet: list[dict[str, Any]] = []
    floods: list[dict[str, Any]] = []
    started = time.monotonic()
    flood_seconds = 0.0
    with ThreadPoolExecutor(max_workers=plan["flood_concurrency"]) as flood_pool:
        for number in range(plan["quiet_requests"]):
            round_started = time.monotonic()
            futures = []
            if flood:
                for index in range(plan["flood_per_round"]):
                    prompt = flood_prompt(plan, number * plan["flood_per_round"] + index)
                    futures.append(flood_pool.submit(complete, url, model, prompt, plan["output_len"], FLOOD))
            doc, prompt = quiet_prompt(plan, number, row_index)
            answer = complete(url, model, prompt, plan["output_len"], QUIET)
            answer.update(number=number, doc=doc, repeat=number >= plan["docs"])
            quiet.append(answer)
            floods += [future.result() for future in futures]
            if futures:
                flood_seconds += time.monotonic() - round_started
            # a remote tier publishes a document some time after its first use: every row's rounds
            # last long enough for it, as the flood rows' do anyway
            time.sleep(max(0.0, plan.get("min_round_s", 0.0) - (time.monotonic() - round_started)))
    return {"quiet": quiet, "flood": floods, "load_s": time.monotonic() - started, "flood_s": flood_seconds}


# --------------------------------------------------------------------------------------------
# rows
# --------------------------------------------------------------------------------------------


def tenant_label(salt: str) -> str:
    from kvtier._core import tenant_id

    return tenant_id(salt)[:8].hex()


def tenant_stats(stats: dict[str, int]) -> dict[str, dict[str, int]]:
    """The pool's tenant counters by tenant (``quiet``, ``flood``, ``default``; others by label)."""
    names = {tenant_label(QUIET): QUIET, tenant_label(FLOOD): FLOOD, "default": "default"}
    tenants: dict[str, dict[str, int]] = {}
    for name, value in stats.items():
        if not name.startswith(("tenant_dram_", "tenant_nvme_", "tenant_shared_", "tenant_bucket_")) or ":" not in name:
            continue
        counter, label = name.split(":", 1)
        # DRAM figures keep their short names (bytes, evictions); the others are nvme_bytes, shared_bytes...
        figure = counter.removeprefix("tenant_dram_").removeprefix("tenant_")
        tenants.setdefault(names.get(label, label), {})[figure] = int(value)
    return tenants


def percentile(values: list[float], pct: float) -> float | None:
    """The ``pct``-th percentile (linear between the closest ranks), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(plan: dict[str, Any], load: dict[str, Any]) -> dict[str, Any]:
    """The quiet tenant's hit rates and TTFTs, the flood's throughput, the failures."""
    quiet_ok = [answer for answer in load["quiet"] if "error" not in answer]
    flood_ok = [answer for answer in load["flood"] if "error" not in answer]
    repeats = [answer for answer in quiet_ok if answer["repeat"]]

    def hit_rate(answers: list[dict[str, Any]]) -> float | None:
        prompt = sum(answer["prompt_tokens"] for answer in answers)
        return sum(answer["cached_tokens"] for answer in answers) / prompt if prompt else None

    ttfts = [answer["ttft_ms"] for answer in quiet_ok]
    repeat_ttfts = [answer["ttft_ms"] for answer in repeats]
    flood_s = load["flood_s"]
    return {
        "quiet_requests": len(load["quiet"]),
        "quiet_failed": len(load["quiet"]) - len(quiet_ok),
        "quiet_prompt_tokens": sum(answer["prompt_tokens"] for answer in quiet_ok),
        "quiet_cached_tokens": sum(answer["cached_tokens"] for answer in quiet_ok),
        "quiet_hit_rate": hit_rate(quiet_ok),
        "quiet_repeat_hit_rate": hit_rate(repeats),
        "quiet_ttft_ms": {
            "p50": percentile(ttfts, 50),
            "p99": percentile(ttfts, 99),
            "mean": statistics.fmean(ttfts) if ttfts else None,
        },
        "quiet_repeat_ttft_ms": {"p50": percentile(repeat_ttfts, 50), "p99": percentile(repeat_ttfts, 99)},
        "flood_requests": len(load["flood"]),
        "flood_failed": len(load["flood"]) - len(flood_ok),
        "flood_cached_tokens": sum(answer["cached_tokens"] for answer in flood_ok),
        "flood_request_throughput": len(flood_ok) / flood_s if flood_s else None,
        "flood_prompt_throughput": sum(answer["prompt_tokens"] for answer in flood_ok) / flood_s if flood_s else None,
        "load_s": load["load_s"],
        "errors": [answer["error"] for answer in load["quiet"] + load["flood"] if "error" in answer][:10],
    }


def row_options(plan: dict[str, Any], row: str) -> dict[str, Any]:
    """The row's kvtier options beyond the pool's size: every hit loaded; the shares row's share."""
    options: dict[str, Any] = {"load_policy": "always"}
    if plan["nvme_regions"]:
        options["region_bytes"] = plan["region_bytes"]
    if plan["shared_files"]:
        options.update(SHARED_TIER_OPTIONS)
        options.update(shared_capacity_bytes=plan["shared_capacity_bytes"], shared_file_bytes=plan["file_bytes"])
    if plan["bucket_segments"]:
        options.update(BUCKET_TIER_OPTIONS)
        options.update(bucket_segment_bytes=plan["segment_bytes"], bucket_budget_bytes=plan["bucket_budget_bytes"])
    if row == "flood-shares":
        options["tenant_dram_share"] = plan["share"]
    if row == "flood-cap":
        options["tenant_dram_max_share"] = plan["cap"]
    return options


def counter_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    return {name: after[name] - before.get(name, 0.0) for name in after}


class RowServer:
    """A ``vllm serve`` server on its own store, for the rows with the same kvtier options: started
    (``launch``), healthy (``wait_healthy``), then gone with its service and store (``close``)."""

    def __init__(
        self, plan: dict[str, Any], name: str, options: dict[str, Any], out_dir: Path, run_bucket: Any = None
    ) -> None:
        from kvtier.service import default_socket_path

        self.name, self.options = name, options
        if run_bucket is not None:  # a prefix of the server's own in the run's bucket
            self.options = {**options, **run_bucket.options(name)}
        self.row_dir = out_dir / name
        self.store = self.row_dir / "store"
        self.shared_root: Path | None = None
        if plan["shared_files"]:  # a shared tier of the server's own, beside its store
            self.shared_root = self.row_dir / "shared"
            self.options = {**options, "shared_root": str(self.shared_root)}
        self.socket = default_socket_path(self.store)
        self.server: Any = None
        self.healthy = False
        self.problems: list[str] = []
        self.info: dict[str, Any] = {}

    def launch(self, plan: dict[str, Any]) -> None:
        """The server's process, not yet healthy; a failure is each of its rows' problem."""
        if self.server is not None or self.problems:
            return
        try:
            if self.shared_root is not None:
                self.shared_root.mkdir(parents=True, exist_ok=True)
            self.server, log_path, _ = serve_servers.start_server(
                plan, plan["kvtier_row"], 0, self.row_dir, [self.store], [], self.options
            )
            self.info = {"command": serve_servers.command_of(self.server.process), "log": str(log_path)}
        except Exception as error:
            self.fail(error)

    def wait_healthy(self, started: float) -> None:
        if self.server is None or self.healthy:
            return
        try:
            progress(started, f"{self.name}: server healthy after {self.server.wait_healthy():.0f} s")
            self.healthy = True
        except Exception as error:
            self.fail(error)
            self.close()

    def fail(self, error: Exception) -> None:
        self.problems.append(f"{type(error).__name__}: {error}")
        print(f"kvtier bench tenants: {self.name}: {error}", file=sys.stderr, flush=True)

    def close(self) -> None:
        from kvtier.service import stop_service

        if self.server is not None:
            self.server.stop()
            self.server = None
        if not stop_service(self.socket):
            self.problems.append(f"the kvtier service on {self.socket} did not stop")
        shutil.rmtree(self.store, ignore_errors=True)
        if self.shared_root is not None:
            shutil.rmtree(self.shared_root, ignore_errors=True)


def run_row(plan: dict[str, Any], row: str, row_index: int, host: RowServer, started: float) -> dict[str, Any]:
    """One row on its server (launched if it is not yet): healthy, warmed up, the load, the counters."""
    from kvtier.service import service_stats

    record: dict[str, Any] = {
        "row": row, "label": ROW_LABELS[row], "options": host.options, "problems": [], "server_name": host.name,
    }  # fmt: skip
    try:
        host.launch(plan)
        host.wait_healthy(started)
        record["server"] = host.info
        if host.server is None:
            return record  # the server's problems are added by run_rows
        server = host.server
        warm_up(server, plan)
        metrics_before = serve_points.cache_metrics([server.url])
        stats_before = dict(service_stats(host.socket))
        rounds = plan["quiet_requests"]
        floods = rounds * plan["flood_per_round"] if row != "alone" else 0
        progress(started, f"{row}: {rounds} quiet requests, {floods} flood ones")
        load = drive(plan, server.url, server.model, row != "alone", row_index)
        record["requests"] = load
        record.update(summarize(plan, load))
        time.sleep(1.0)  # the last stores land before the counters are read
        metrics = counter_deltas(metrics_before, serve_points.cache_metrics([server.url]))
        stats = dict(service_stats(host.socket))
        record["vllm_cache_tokens"] = metrics
        record["kvtier"] = {
            counter: int(stats.get(counter, 0)) - int(stats_before.get(counter, 0)) for counter in ROW_COUNTERS
        }
        record["tenants"] = tenant_stats(stats)
        record["pool"] = {
            counter: stats[counter] for counter in stats if counter.startswith("dram_") and "bytes" in counter
        }
        progress(
            started,
            f"{row}: quiet hit rate {number_text(record['quiet_hit_rate'], 3)}, "
            f"{record['quiet_failed'] + record['flood_failed']} failed",
        )
    except Exception as error:
        record["problems"].append(f"{type(error).__name__}: {error}")
        print(f"kvtier bench tenants: {row}: {error}", file=sys.stderr, flush=True)
    return record


def row_servers(plan: dict[str, Any], out_dir: Path, run_bucket: Any = None) -> dict[str, RowServer]:
    """Each row's server: rows with the same kvtier options (``alone`` and ``flood``) share one,
    named after the first of them (``run_bucket``: the run's bucket, with ``--bucket-segments``)."""
    by_options: dict[str, RowServer] = {}
    servers: dict[str, RowServer] = {}
    for row in plan["rows"]:
        options = row_options(plan, row)
        signature = json.dumps(options, sort_keys=True)
        if signature not in by_options:
            by_options[signature] = RowServer(plan, row, options, out_dir, run_bucket)
        servers[row] = by_options[signature]
    return servers


def run_rows(
    plan: dict[str, Any], out_dir: Path, started: float, document: dict[str, Any], run_bucket: Any = None
) -> None:
    """Every row in turn. Rows with the same kvtier options run one after the other on one server and
    store, each with documents of its own; a server goes after its last row. With ``start_together``
    every server starts at once (a start is mostly single-threaded imports: on two cores two take
    about as long as one) and all are healthy before the first row; an idle server polls nothing, so
    the row measured has the cores to itself."""
    servers = row_servers(plan, out_dir, run_bucket)
    hosts = list(dict.fromkeys(servers.values()))
    last_row = {host: row for row, host in servers.items()}  # later rows overwrite earlier ones
    try:
        if plan["start_together"]:
            for host in hosts:
                host.launch(plan)
            for host in hosts:
                host.wait_healthy(started)
        for index, row in enumerate(plan["rows"]):
            host = servers[row]
            record = run_row(plan, row, index, host, started)
            if last_row[host] == row:
                host.close()
            record["problems"] = host.problems + record["problems"]
            document["rows"].append(record)
            (out_dir / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    finally:
        for host in hosts:
            if host.server is not None:
                host.close()


@contextlib.contextmanager
def opened_bucket(plan: dict[str, Any], started: float) -> Iterator[Any]:
    """The run's bucket with ``--bucket-segments`` (kvtier.bench.bucket: the local gateway, brought up
    and torn down here, or ``--bucket-url``); None without."""
    if not plan["bucket_segments"]:
        yield None
        return
    log = lambda message: progress(started, message)  # noqa: E731
    with bucket.open_bucket(
        plan["bucket_url"], plan["bucket_endpoint"], plan["bucket_osd_bytes"], log, plan["rgw_state_dir"]
    ) as opened:  # fmt: skip
        yield opened


def progress(started: float, message: str) -> None:
    print(f"[tenants {time.monotonic() - started:6.0f} s] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = make_plan(args)
        serve_points.check_vllm_command()
        if plan["bucket_segments"] and not plan["bucket_url"] and bucket.missing_reason():
            raise TenantsError(f"--bucket-segments: {bucket.missing_reason()}")
    except (TenantsError, serve_plan.BenchError) as error:
        print(f"kvtier bench tenants: {error}", file=sys.stderr)
        return 2
    from kvtier.models import ensure_bench_model

    out_dir = Path(args.out or tempfile.mkdtemp(prefix="kvtier-bench-tenants-")).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    plan["model_dir"] = str(ensure_bench_model(plan["preset"]))
    started = time.monotonic()
    document: dict[str, Any] = {"benchmark": "kvtier bench tenants", "settings": plan, "rows": []}
    progress(
        started,
        f"{plan['preset']}: {plan['docs']} documents of {plan['doc_len']} tokens, {plan['quiet_requests']} quiet "
        f"requests, {plan['flood_per_round']} flood prompts of {plan['flood_len']} tokens a round; pool "
        f"{plan['pool_blocks']} blocks, vLLM {plan['vllm_blocks']}, NVMe {plan['nvme_regions']} regions, shared "
        f"tier {plan['shared_files']} files, bucket {plan['bucket_segments']} segments; "
        f"results {out_dir}",
    )
    with serve.own_runtime_dir(), opened_bucket(plan, started) as run_bucket:
        run_rows(plan, out_dir, started, document, run_bucket)
    document["problems"] = judge(plan, document["rows"])
    tiers = {"nvme": bool(plan["nvme_regions"]), "shared": bool(plan["shared_files"])}
    tiers["bucket"] = bool(plan["bucket_segments"])
    header = TABLE_HEADER + [column for tier, on in tiers.items() if on for column in EXTRA_COLUMNS[tier]]
    table = markdown_table(header, table_rows(document["rows"], **tiers))
    (out_dir / "table.md").write_text(table + "\n")
    (out_dir / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    report = sys.stderr if args.json else sys.stdout
    print(table, file=report)
    for problem in document["problems"]:
        print(f"problem: {problem}", file=report)
    print(f"results: {out_dir / 'results.json'}", file=report, flush=True)
    if args.json:
        summary = {**document, "rows": [{k: v for k, v in r.items() if k != "requests"} for r in document["rows"]]}
        json.dump(summary, sys.stdout, indent=2)
        print()
    return 1 if document["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
