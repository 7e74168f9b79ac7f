"""``python -m kvtier.demo``: kvtier behind vLLM's OpenAI-compatible server, in one command.

This module owns the demo: it builds the local model if missing (``kvtier.models``), starts
``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 with kvtier as the KV offloading
backend, sends a short shared-prefix multi-turn workload, and prints, per request, the time to first
token and where its prefix came from (recomputed, vLLM's own prefix cache, kvtier DRAM, kvtier NVMe),
read from the kvtier host service's counters before and after each request.

The workload (every step bounded; only loopback traffic):

1. conversations A and B share a long document; A turn 1 is computed (cold), B turn 1 and A turn 2
   reuse it from vLLM's own prefix cache; conversation C (another document) is computed;
2. vLLM's prefix cache is reset (``POST /reset_prefix_cache``): A turn 1 is restored from kvtier
   DRAM (twice); then a second server (another vLLM process, same model and store path, started
   beside the first) answers A turn 1: a DRAM hit in the host service's shared pool, for a prefix
   only the first server ever computed;
3. unrelated prompts push C out of kvtier's DRAM tier; after another reset, C is restored from
   kvtier NVMe.

Both servers run with vLLM's defaults (multiprocess engine core and executor); kvtier's host service,
started by the first engine, holds the store and the DRAM pool they share (docs/architecture.md).

Options: ``--preset`` (default kv8b: Llama-3-8B-sized KV, 128 KiB per token; on a CPU that computes
bfloat16 slowly, no AVX-512 BF16 or AMX, its float32 twin kv8b-fp32, the same KV bytes per token),
``--store DIR`` (default: a temporary directory, removed afterwards unless ``--keep-store``),
``--port``, ``--prefix-tokens``.

``kvtier demo events`` (``python -m kvtier.demo events``) runs another demo: two servers with vLLM's
KV events on and a router's index of them (``kvtier.demo_events``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvtier.engine_process import ENGINE_QUIET_S
from kvtier.models import PRESETS, ensure_model, preset_for_this_cpu, server_dtype_args
from kvtier.openai_server import OpenAIServer, ServerError, free_port


class DemoError(RuntimeError):
    """The demo could not run; the message says why and what to do."""


@dataclass
class RequestResult:
    label: str
    expected_source: str
    prompt_tokens: int
    cached_tokens: int | None
    ttft_ms: float
    dram_hits: int
    nvme_hits: int


def kvtier_hits(store_dir: Path) -> dict[str, int]:
    """Blocks served per tier so far, from the host service's counters (one request runs at a time
    here, so a difference belongs to the request between two readings, whichever server sent it)."""
    from kvtier.service import default_socket_path, service_stats

    stats = service_stats(default_socket_path(store_dir))
    return {"dram": stats.get("dram_hits", 0), "nvme": stats.get("nvme_hits", 0)}


def start_server(model_dir: Path, store_dir: Path, port: int, preset: str, log_path: Path) -> OpenAIServer:
    from kvtier.vllm import kv_transfer_config

    spec = PRESETS[preset]
    object_bytes = spec.kv_bytes_per_token * 128
    # A DRAM tier of 40 blocks: room for one conversation's prefix (a load needs DRAM slots for the
    # blocks it pins), small enough that the flood of unrelated prompts pushes it out to NVMe.
    transfer_config = kv_transfer_config(
        store_dir, dram_bytes=40 * object_bytes, nvme_bytes=max(1 << 30, 160 * object_bytes)
    )
    env = {
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    args = ["--max-model-len", "8192", "--enforce-eager", *server_dtype_args(preset)]
    return OpenAIServer(model_dir, preset, log_path, transfer_config, args, env, port)


def build_texts(model_dir: Path, prefix_tokens: int) -> dict[str, str]:
    """Deterministic prompt texts cut to token counts with the model's own tokenizer."""
    import sysconfig

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents = (
        "argparse.py", "difflib.py", "inspect.py", "typing.py", "tarfile.py", "pydoc.py", "subprocess.py",
        "threading.py", "shutil.py",
    )  # fmt: skip
    sources = [stdlib / name for name in documents]

    def cut(path: Path, tokens: int) -> str:
        encoding = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
        end = encoding.offsets[min(tokens, len(encoding.offsets)) - 1][1]
        return path.read_text(encoding="utf-8", errors="replace")[:end]

    return {
        "document_a": "# You are a code assistant. Reference source follows.\n" + cut(sources[0], prefix_tokens),
        "document_c": "# You are a code reviewer. Source under review follows.\n" + cut(sources[1], prefix_tokens),
        "question_a1": "\n# Question: what does add_argument do?\n",
        "question_a2": "\n# Follow-up: and parse_known_args?\n",
        "question_b1": "\n# Question: how are subparsers built?\n",
        "question_c1": "\n# Review: is SequenceMatcher quadratic?\n",
        **{f"flood_{index}": cut(path, prefix_tokens) for index, path in enumerate(sources[2:7])},
        "warm_up_a": cut(sources[7], prefix_tokens),
        "warm_up_b": cut(sources[8], prefix_tokens),
    }


def run_workload(
    server: OpenAIServer, second: OpenAIServer, store_dir: Path, texts: dict[str, str], max_tokens: int
) -> list[RequestResult]:
    results: list[RequestResult] = []

    def send(label: str, expected_source: str, prompt: str, on: OpenAIServer = server) -> str:
        time.sleep(ENGINE_QUIET_S)  # the other server's busy poll must not compete (engine_process)
        before = kvtier_hits(store_dir)
        completion = on.complete(prompt, max_tokens)
        after = kvtier_hits(store_dir)
        results.append(
            RequestResult(
                label=label,
                expected_source=expected_source,
                prompt_tokens=completion.prompt_tokens,
                cached_tokens=completion.cached_tokens,
                ttft_ms=completion.ttft_ms,
                dram_hits=after["dram"] - before["dram"],
                nvme_hits=after["nvme"] - before["nvme"],
            )
        )
        return prompt

    reset_prefix_cache = server.reset_prefix_cache

    turn_a1 = texts["document_a"] + texts["question_a1"]
    turn_c1 = texts["document_c"] + texts["question_c1"]
    # A fresh vLLM server's first requests of each shape pay for one-time set-up (measured here:
    # about 1 s on the first long prompt, 0.5 s on the first short tail after a long cached prefix),
    # so each server first computes a document of its own and then a question on it, as a
    # benchmark warms up. Neither reads anything from kvtier: B's first kvtier load is still the one
    # timed below.
    for on, warm_up in ((server, texts["warm_up_a"]), (second, texts["warm_up_b"])):
        on.complete(warm_up + texts["question_a1"], 1)
        on.complete(warm_up + texts["question_a2"], 1)
    send("A turn 1", "recompute", turn_a1)
    send("B turn 1", "vLLM prefix cache (shared document)", texts["document_a"] + texts["question_b1"])
    send("A turn 2", "vLLM prefix cache", turn_a1 + " ok.\n" + texts["question_a2"])
    send("C turn 1", "recompute", turn_c1)
    for _ in range(2):
        reset_prefix_cache()
        send("A turn 1 again", "kvtier DRAM", turn_a1)
    # The second server never saw A: it restores the first server's prefix from the shared pool.
    send("A turn 1 on B", "kvtier DRAM (another engine's prefill)", turn_a1, second)
    # Unrelated prompts push C (stored, never read back) out of kvtier's DRAM tier. kvtier keeps
    # blocks that were read back (A) in DRAM ahead of blocks seen once, so A stays.
    for index in range(5):
        send(f"flood {index}", "recompute", texts[f"flood_{index}"])
    reset_prefix_cache()
    send("C turn 1 again", "kvtier NVMe", turn_c1)
    return results


def print_table(results: list[RequestResult]) -> None:
    header = (
        f"{'request':<16} {'expected source':<48} {'prompt':>7} {'cached':>7} "
        f"{'dram hits':>9} {'nvme hits':>9} {'TTFT ms':>9}"
    )
    print(header)
    print("-" * len(header))
    for result in results:
        cached = "-" if result.cached_tokens is None else str(result.cached_tokens)
        print(
            f"{result.label:<16} {result.expected_source:<48} {result.prompt_tokens:>7} {cached:>7} "
            f"{result.dram_hits:>9} {result.nvme_hits:>9} {result.ttft_ms:>9.1f}"
        )
    cold = sorted(r.ttft_ms for r in results if r.expected_source == "recompute")
    if cold:
        median_cold = cold[len(cold) // 2]
        for source in ("kvtier DRAM", "kvtier DRAM (another engine's prefill)", "kvtier NVMe"):
            restored = [r.ttft_ms for r in results if r.expected_source == source]
            if restored:
                ratios = ", ".join(f"{ttft / median_cold:.2f}" for ttft in restored)
                print(f"TTFT {source} / median recompute TTFT ({median_cold:.0f} ms): {ratios}")


KVTIER_SOURCES = ("kvtier DRAM", "kvtier DRAM (another engine's prefill)", "kvtier NVMe")


def failed_claims(results: list[RequestResult]) -> list[str]:
    """Every row whose measurements contradict its label: where its prefix came from (vLLM's own
    counters and kvtier's), and, for kvtier's rows, that restoring beat computing."""
    failures = []
    recompute = sorted(r.ttft_ms for r in results if r.expected_source == "recompute")
    median_recompute = recompute[len(recompute) // 2] if recompute else None
    for r in results:
        cached = r.cached_tokens or 0
        loaded = r.dram_hits + r.nvme_hits
        source = r.expected_source
        if source == "recompute":
            wrong = cached != 0 or loaded != 0
        elif source.startswith("vLLM prefix cache"):
            wrong = cached == 0 or loaded != 0
        elif source == "kvtier NVMe":
            wrong = cached == 0 or r.nvme_hits == 0
        else:
            wrong = cached == 0 or r.dram_hits == 0 or r.nvme_hits != 0
        if wrong:
            failures.append(
                f"{r.label}: labelled {source!r}, but {cached} cached tokens, {r.dram_hits} DRAM and "
                f"{r.nvme_hits} NVMe hits"
            )
        if source in KVTIER_SOURCES and median_recompute is not None and r.ttft_ms >= median_recompute:
            failures.append(
                f"{r.label}: a {source} hit took {r.ttft_ms:.0f} ms, no faster than the median "
                f"recompute ({median_recompute:.0f} ms)"
            )
    return failures


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    if words[:1] == ["events"]:  # `kvtier demo events`: KV events for routers (kvtier.demo_events)
        from kvtier.demo_events import main as events_main

        return events_main(words[1:])
    parser = argparse.ArgumentParser(prog="python -m kvtier.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="model preset (default kv8b, or kv8b-fp32 on a CPU that computes bfloat16 slowly)",
    )
    parser.add_argument("--store", help="kvtier store directory (default: a temporary directory)")
    parser.add_argument("--keep-store", action="store_true", help="keep the temporary store directory")
    parser.add_argument("--port", type=int, default=0, help="server port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--prefix-tokens", type=int, default=2000, help="tokens of the shared system prompt")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    args = parser.parse_args(argv)
    if args.preset is None:
        args.preset, swapped = preset_for_this_cpu("kv8b")
        if swapped:
            print(f"kvtier demo: {swapped}", flush=True)

    model_dir = ensure_model(args.preset)
    temporary_store = args.store is None
    store_dir = Path(args.store or tempfile.mkdtemp(prefix="kvtier-demo-"))
    store_dir.mkdir(parents=True, exist_ok=True)
    port = args.port or free_port()
    log_path = store_dir.parent / f"kvtier-demo-server-{port}.log"
    print(f"model {model_dir}\nstore {store_dir}\nserver log {log_path}", flush=True)

    texts = build_texts(model_dir, args.prefix_tokens)
    second_port = free_port()
    second_log = store_dir.parent / f"kvtier-demo-server-{second_port}.log"
    server = start_server(model_dir, store_dir, port, args.preset, log_path)
    second = None
    try:
        start_seconds = server.wait_healthy()
        print(f"server A ready in {start_seconds:.0f} s at {server.url}", flush=True)
        # Server B: another vLLM process of the same model on the same store path.
        second = start_server(model_dir, store_dir, second_port, args.preset, second_log)
        start_seconds = second.wait_healthy()
        print(f"server B ready in {start_seconds:.0f} s at {second.url}\n", flush=True)
        results = run_workload(server, second, store_dir, texts, args.max_tokens)
        print_table(results)
        failures = failed_claims(results)
        for failure in failures:
            print(f"claim failed: {failure}", file=sys.stderr)
        if failures:
            return 1
        print("every row's source and time agree with its label")
    except (DemoError, ServerError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        server.stop()
        if second is not None:
            second.stop()
        # The service the servers started outlives them (it would free its pool after its idle
        # time); the demo asked for no long-lived service, so it goes now, with its pool files.
        from kvtier.service import default_socket_path, stop_service

        stop_service(default_socket_path(store_dir))
        if temporary_store and not args.keep_store:
            shutil.rmtree(store_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
