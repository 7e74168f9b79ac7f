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

Options: ``--preset tiny|kv8b`` (default kv8b: Llama-3-8B-sized KV, 128 KiB per token),
``--store DIR`` (default: a temporary directory, removed afterwards unless ``--keep-store``),
``--port``, ``--prefix-tokens``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvtier.models import PRESETS, ensure_model

HOST = "127.0.0.1"
SERVER_START_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 600
RESET_ATTEMPTS = 20


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def http_json(url: str, payload: dict | None = None, timeout_s: float = 30) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        body = response.read()
    return json.loads(body) if body else {}


def kvtier_hits(store_dir: Path) -> dict[str, int]:
    """Blocks served per tier so far, from the host service's counters (one request runs at a time
    here, so a difference belongs to the request between two readings, whichever server sent it)."""
    from kvtier.service import default_socket_path, service_stats

    stats = service_stats(default_socket_path(store_dir))
    return {"dram": stats.get("dram_hits", 0), "nvme": stats.get("nvme_hits", 0)}


def stream_completion(base_url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, dict]:
    """Sends a streamed completion; returns (time to first token in ms, usage)."""
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        f"{base_url}/v1/completions", data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    first_token_s = None
    usage: dict = {}
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        for raw_line in response:
            line = raw_line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if first_token_s is None and chunk.get("choices"):
                first_token_s = time.perf_counter() - started
            if chunk.get("usage"):
                usage = chunk["usage"]
    if first_token_s is None:
        raise DemoError("the server streamed no token")
    return first_token_s * 1000, usage


def start_server(model_dir: Path, store_dir: Path, port: int, preset: str, log_path: Path) -> subprocess.Popen:
    from kvtier.vllm import kv_transfer_config

    spec = PRESETS[preset]
    object_bytes = spec.kv_bytes_per_token * 128
    # A DRAM tier of 40 blocks: room for one conversation's prefix (a load needs DRAM slots for the
    # blocks it pins), small enough that the flood of unrelated prompts pushes it out to NVMe.
    transfer_config = kv_transfer_config(
        store_dir, dram_bytes=40 * object_bytes, nvme_bytes=max(1 << 30, 160 * object_bytes)
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # enables POST /reset_prefix_cache
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", preset,
        "--host", HOST,
        "--port", str(port),
        "--max-model-len", "8192",
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(transfer_config),
    ]  # fmt: skip
    log_file = log_path.open("w")
    return subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)


def wait_until_healthy(base_url: str, server: subprocess.Popen, log_path: Path) -> float:
    started = time.monotonic()
    deadline = started + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log_path.read_text()[-3000:]
            raise DemoError(f"the vLLM server exited with code {server.returncode}; log tail:\n{tail}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise DemoError(f"the vLLM server did not become healthy within {SERVER_START_TIMEOUT_S} s; see {log_path}")


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)  # the server's own process group (started with start_new_session)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


def build_texts(model_dir: Path, prefix_tokens: int) -> dict[str, str]:
    """Deterministic prompt texts cut to token counts with the model's own tokenizer."""
    import sysconfig

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents = ("argparse.py", "difflib.py", "inspect.py", "typing.py", "tarfile.py", "pydoc.py", "subprocess.py")
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
        **{f"flood_{index}": cut(path, prefix_tokens) for index, path in enumerate(sources[2:])},
    }


def run_workload(
    base_url: str, second_url: str, store_dir: Path, model: str, texts: dict[str, str], max_tokens: int
) -> list[RequestResult]:
    results: list[RequestResult] = []

    def send(label: str, expected_source: str, prompt: str, url: str = base_url) -> str:
        before = kvtier_hits(store_dir)
        ttft_ms, usage = stream_completion(url, model, prompt, max_tokens)
        after = kvtier_hits(store_dir)
        details = usage.get("prompt_tokens_details") or {}
        results.append(
            RequestResult(
                label=label,
                expected_source=expected_source,
                prompt_tokens=int(usage.get("prompt_tokens", 0)),
                cached_tokens=details.get("cached_tokens"),
                ttft_ms=ttft_ms,
                dram_hits=after["dram"] - before["dram"],
                nvme_hits=after["nvme"] - before["nvme"],
            )
        )
        return prompt

    def reset_prefix_cache() -> None:
        # vLLM refuses the reset while blocks are held by in-flight offload stores; a one-token
        # request drives the engine steps that complete them.
        for _ in range(RESET_ATTEMPTS):
            if http_json(f"{base_url}/reset_prefix_cache", payload={}, timeout_s=60).get("success"):
                return
            stream_completion(base_url, model, "# nudge", 1)
            time.sleep(0.5)
        raise DemoError(f"vLLM did not reset its prefix cache after {RESET_ATTEMPTS} attempts")

    turn_a1 = texts["document_a"] + texts["question_a1"]
    turn_c1 = texts["document_c"] + texts["question_c1"]
    send("A turn 1", "recompute", turn_a1)
    send("B turn 1", "vLLM prefix cache (shared document)", texts["document_a"] + texts["question_b1"])
    send("A turn 2", "vLLM prefix cache", turn_a1 + " ok.\n" + texts["question_a2"])
    send("C turn 1", "recompute", turn_c1)
    for _ in range(2):
        reset_prefix_cache()
        send("A turn 1 again", "kvtier DRAM", turn_a1)
    # The second server never saw A: it restores the first server's prefix from the shared pool.
    send("A turn 1 on B", "kvtier DRAM (another engine's prefill)", turn_a1, second_url)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="kv8b")
    parser.add_argument("--store", help="kvtier store directory (default: a temporary directory)")
    parser.add_argument("--keep-store", action="store_true", help="keep the temporary store directory")
    parser.add_argument("--port", type=int, default=0, help="server port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--prefix-tokens", type=int, default=2000, help="tokens of the shared system prompt")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    args = parser.parse_args(argv)

    model_dir = ensure_model(args.preset)
    temporary_store = args.store is None
    store_dir = Path(args.store or tempfile.mkdtemp(prefix="kvtier-demo-"))
    store_dir.mkdir(parents=True, exist_ok=True)
    port = args.port or free_port()
    base_url = f"http://{HOST}:{port}"
    log_path = store_dir.parent / f"kvtier-demo-server-{port}.log"
    print(f"model {model_dir}\nstore {store_dir}\nserver log {log_path}", flush=True)

    texts = build_texts(model_dir, args.prefix_tokens)
    second_port = free_port()
    second_url = f"http://{HOST}:{second_port}"
    second_log = store_dir.parent / f"kvtier-demo-server-{second_port}.log"
    server = start_server(model_dir, store_dir, port, args.preset, log_path)
    second = None
    try:
        start_seconds = wait_until_healthy(base_url, server, log_path)
        print(f"server A ready in {start_seconds:.0f} s at {base_url}", flush=True)
        # Server B: another vLLM process of the same model on the same store path.
        second = start_server(model_dir, store_dir, second_port, args.preset, second_log)
        start_seconds = wait_until_healthy(second_url, second, second_log)
        print(f"server B ready in {start_seconds:.0f} s at {second_url}\n", flush=True)
        results = run_workload(base_url, second_url, store_dir, args.preset, texts, args.max_tokens)
        print_table(results)
    except DemoError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        stop_server(server)
        if second is not None:
            stop_server(second)
        if temporary_store and not args.keep_store:
            from kvtier.service import default_socket_path, stop_service

            stop_service(default_socket_path(store_dir))
            shutil.rmtree(store_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
