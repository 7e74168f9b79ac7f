"""``kvtier demo events``: what a prefix-aware router sees of kvtier, from vLLM's own KV events.

Two ``vllm serve`` OpenAI servers of the same model share one kvtier store path, each with vLLM's
KV-event publisher on (``--kv-events-config``, ZMQ on an ``ipc://`` endpoint in a temporary
directory). A subscriber built on vLLM's own message classes (``kvtier.kv_index.KvEventIndex``)
keeps the index a router keeps: which server holds which block in which tier. A few hundred short
requests over a set of prompts go to the servers (some prompts to one server, some to both); then,
for a few prompts, the demo prints how many of the prompt's leading blocks each server holds in
each tier (vLLM's GPU cache, kvtier DRAM, kvtier NVMe, kvtier's shared tier), as a router scores a
prefix.

The subscriber names a prompt's blocks as vLLM does: the model's tokenizer (vLLM's
``get_tokenizer``), then vLLM's chained block hash (``hash_block_tokens`` after ``init_none_hash``
with the engines' ``--prefix-caching-hash-algo``, per ``--block-size`` tokens), published as vLLM
publishes it (``maybe_convert_block_hash``: by default the hash's low 64 bits as an integer).
kvtier's keys are those hashes (``kvtier.vllm.events.direct_offload_key``).

What it prints, it checks (a claim that does not hold fails the demo, exit status 1):

- every request's prompt has as many tokens as the subscriber's tokenization (the hashes are of
  what the engine saw);
- the server that answered a prompt holds all its blocks on the GPU; a server that never saw it
  holds none there; both servers report the same kvtier blocks (every engine on the host can load
  them) and kvtier holds every block of the prompt;
- at the end, each server's index of kvtier's tiers is exactly what ``kvtier ls PATH --json
  --blocks`` lists (no block listed that kvtier no longer has, none missing);
- afterwards no process of the demo and no kvtier file in /dev/shm is left.

Options: ``--preset`` (default tiny), ``--requests``, ``--prompts``, ``--show``, ``--store DIR``
(default: a temporary directory, removed afterwards unless ``--keep-store``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.models import PRESETS, ensure_model, server_dtype_args
from kvtier.openai_server import OpenAIServer, ServerError

BLOCK_TOKENS = 128  # vLLM's block size on CPU, set explicitly (--block-size) so the hashes match
HASH_ALGO = "sha256"  # vLLM's default --prefix-caching-hash-algo, set explicitly
SERVERS = ("A", "B")
# The index's tiers for kvtier's tiers (kvtier.vllm.events.TIER_MEDIA, as the events carry them).
KVTIER_TIERS: dict[str, tuple[str, str | None, str | None]] = {
    "dram": ("CPU", "LOCAL", None),
    "nvme": ("STORAGE", "LOCAL", "kvtier-nvme"),
    "shared": ("STORAGE", "REMOTE", "kvtier-shared"),
}
AGREE_TIMEOUT_S = 90.0
GROUP_EXIT_GRACE_S = 30.0  # for a stopped server's engine-core process to exit
QUESTIONS = (
    "\n# Question: what does this module do?\n",
    "\n# Question: which function is the entry point?\n",
    "\n# Question: is any of this thread-safe?\n",
    "\n# Question: list the public classes.\n",
    "\n# Review: what would you rename?\n",
    "\n# Review: where are errors swallowed?\n",
)
DOCUMENTS = (
    "argparse.py", "difflib.py", "inspect.py", "typing.py", "tarfile.py", "pydoc.py", "subprocess.py",
    "threading.py", "shutil.py", "zipfile.py", "textwrap.py", "functools.py", "pathlib.py", "logging/__init__.py",
    "json/decoder.py", "email/message.py", "http/client.py", "dataclasses.py", "enum.py", "heapq.py",
)  # fmt: skip


class DemoClaimFailed(AssertionError):
    """Something the demo printed does not hold."""


@dataclass
class Prompt:
    family: int
    text: str
    servers: tuple[str, ...]  # the servers it is sent to
    # Its last request: the text sent, the server that answered, the prompt tokens it counted.
    last_text: str = ""
    last_server: str = ""
    last_prompt_tokens: int = 0
    hashes: list[Any] = field(default_factory=list)  # vLLM's event block hashes of last_text's full blocks


def block_hasher() -> tuple[Callable[[list[int]], list[Any]], Callable[[bytes], Any]]:
    """vLLM's prefix-cache hashing as the engines run it: ``(tokens -> event hashes of its full
    blocks, kvtier key -> event hash)``."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_utils import BlockHash
    from vllm.v1.kv_offload.base import get_offload_block_hash

    from kvtier.vllm.events import direct_offload_key

    hash_fn = get_hash_fn_by_name(HASH_ALGO)
    kv_cache_utils.init_none_hash(hash_fn)  # the fixed seed (or PYTHONHASHSEED, as the engines see it)
    offload_key = direct_offload_key(0)

    def prompt_hashes(tokens: list[int]) -> list[Any]:
        hashes, parent = [], None
        for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, tokens[start : start + BLOCK_TOKENS])
            hashes.append(kv_cache_utils.maybe_convert_block_hash(parent))
        return hashes

    def key_hash(key: bytes) -> Any:
        return kv_cache_utils.maybe_convert_block_hash(BlockHash(get_offload_block_hash(offload_key(key))))

    return prompt_hashes, key_hash


def build_prompts(tokenizer: Any, count: int) -> list[Prompt]:
    """``count`` documents of 2 to 4 blocks (standard-library sources cut with the model's
    tokenizer); family f goes to A (f % 3 == 0), B (f % 3 == 1) or both (f % 3 == 2)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for family in range(count):
        source = (stdlib / DOCUMENTS[family % len(DOCUMENTS)]).read_text(encoding="utf-8", errors="replace")
        start = (family // len(DOCUMENTS)) * 4000  # another part of the file on a second round
        source = source[start : start + 8000]
        wanted = (2 + family % 3) * BLOCK_TOKENS + 40
        text = tokenizer.decode(tokenizer.encode(source, add_special_tokens=False)[:wanted])
        servers = (SERVERS[family % 3],) if family % 3 < 2 else SERVERS
        prompts.append(Prompt(family, f"# Document {family}.\n{text}", servers))
    return prompts


def start_servers(model_dir: Path, preset: str, store_dir: Path, work: Path, endpoints: dict[str, str]) -> dict:
    from kvtier.vllm import kv_transfer_config

    object_bytes = PRESETS[preset].kv_bytes_per_token * BLOCK_TOKENS
    # A DRAM tier of 64 blocks, smaller than what the run stores, so blocks move to NVMe too.
    transfer = kv_transfer_config(store_dir, dram_bytes=64 * object_bytes, nvme_bytes=max(1 << 30, 2048 * object_bytes))
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    servers = {}
    for name in SERVERS:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoints[name], "topic": "kv"}
        args = [
            "--max-model-len", "4096", "--enforce-eager", "--block-size", str(BLOCK_TOKENS),
            "--prefix-caching-hash-algo", HASH_ALGO, "--kv-events-config", json.dumps(events),
            *server_dtype_args(preset),
        ]  # fmt: skip
        servers[name] = OpenAIServer(model_dir, preset, work / f"server-{name}.log", transfer, args, env)
    return servers


def send_requests(servers: dict[str, OpenAIServer], prompts: list[Prompt], requests: int, tokenizer: Any) -> None:
    """``requests`` completions over ``prompts`` x ``QUESTIONS``, two at a time. Every prompt's token
    count as the server reports it must be the subscriber's (else its hashes would name other blocks)."""
    jobs = []
    for index in range(requests):
        prompt = prompts[index % len(prompts)]
        round_ = index // len(prompts)
        jobs.append(
            (prompt, prompt.text + QUESTIONS[round_ % len(QUESTIONS)], prompt.servers[round_ % len(prompt.servers)])
        )

    def run(job: tuple[Prompt, str, str]) -> int:
        _prompt, text, server = job
        return servers[server].complete(text, 1).prompt_tokens

    with ThreadPoolExecutor(max_workers=2) as pool:
        counted = list(pool.map(run, jobs))
    for (prompt, text, server), prompt_tokens in zip(jobs, counted, strict=True):
        ours = len(tokenizer.encode(text))  # special tokens added, as vLLM does for a completion
        if ours != prompt_tokens:
            raise DemoClaimFailed(
                f"{server} counted {prompt_tokens} prompt tokens, the subscriber {ours}: {text[:60]!r}"
            )
        prompt.last_text, prompt.last_server, prompt.last_prompt_tokens = text, server, prompt_tokens


def held_prefix(held: set, hashes: list[Any]) -> int:
    """Leading blocks of ``hashes`` in ``held``: what a router scores for a prefix."""
    count = 0
    for block_hash in hashes:
        if block_hash not in held:
            break
        count += 1
    return count


def kvtier_listing(store_dir: Path) -> dict[str, set[bytes]]:
    """kvtier's blocks per tier as ``kvtier ls PATH --json --blocks`` lists them (every namespace)."""
    command = [sys.executable, "-m", "kvtier", "ls", str(store_dir), "--json", "--blocks"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise DemoClaimFailed(f"`kvtier ls {store_dir} --json --blocks` failed: {done.stderr.strip()}")
    tiers: dict[str, set[bytes]] = {tier: set() for tier in KVTIER_TIERS}
    for ns in json.loads(done.stdout)["namespaces"]:
        if ns.get("blocks_truncated"):
            raise DemoClaimFailed(f"namespace {ns['digest'][:16]} holds more blocks than one listing carries")
        for tier, keys in (ns.get("blocks") or {}).items():
            tiers[tier].update(bytes.fromhex(key) for key in keys)
    return tiers


def disagreements(index: Any, listing: dict[str, set[bytes]], key_hash: Callable[[bytes], Any]) -> list[str]:
    """Where a server's index of kvtier's tiers differs from kvtier's listing."""
    found = []
    for tier, keys in listing.items():
        listed = {key_hash(key) for key in keys}
        for server in SERVERS:
            held = index.held(server, KVTIER_TIERS[tier])
            extra, missing = len(held - listed), len(listed - held)
            if extra or missing:
                found.append(
                    f"{server} {tier}: index {len(held)}, kvtier ls {len(listed)} "
                    f"({extra} no longer in kvtier, {missing} missing)"
                )
    return found


def wait_for_agreement(
    servers: dict[str, OpenAIServer], store_dir: Path, index: Any, key_hash: Callable[[bytes], Any]
) -> dict[str, set[bytes]]:
    """Drives the idle servers (vLLM publishes a manager's events at its next scheduler step; a
    prompt under one block stores nothing) until the index agrees with ``kvtier ls``."""
    deadline = time.monotonic() + AGREE_TIMEOUT_S
    while True:
        for server in servers.values():
            server.complete("# nudge", 1)
        time.sleep(1.0)
        listing = kvtier_listing(store_dir)
        found = disagreements(index, listing, key_hash)
        if not found:
            return listing
        if time.monotonic() > deadline:
            raise DemoClaimFailed(
                f"after {AGREE_TIMEOUT_S:.0f} s the index disagrees with kvtier ls: " + "; ".join(found)
            )


def prefix_row(index: Any, prompt: Prompt) -> tuple[dict[str, dict[str, int]], list[str]]:
    """Per server, per tier, the prompt's leading blocks held; and every claim about them that fails."""
    from kvtier.kv_index import GPU

    n = len(prompt.hashes)
    counts: dict[str, dict[str, int]] = {}
    failures = []
    for server in SERVERS:
        tiers = {"GPU": index.held(server, GPU), **{t: index.held(server, m) for t, m in KVTIER_TIERS.items()}}
        counts[server] = {name: held_prefix(held, prompt.hashes) for name, held in tiers.items()}
        in_kvtier = held_prefix(set().union(*(tiers[t] for t in KVTIER_TIERS)), prompt.hashes)
        if in_kvtier != n:
            failures.append(f"prompt {prompt.family}: {server} sees {in_kvtier} of its {n} blocks in kvtier")
        gpu = counts[server]["GPU"]
        if server == prompt.last_server and gpu != n:
            failures.append(f"prompt {prompt.family}: {server} answered it but holds {gpu} of {n} blocks on GPU")
        if server not in prompt.servers and gpu != 0:
            failures.append(f"prompt {prompt.family}: {server} never saw it but holds {gpu} blocks on GPU")
    kvtier_views = [{t: counts[s][t] for t in KVTIER_TIERS} for s in SERVERS]
    if any(view != kvtier_views[0] for view in kvtier_views):
        failures.append(f"prompt {prompt.family}: the servers report different kvtier blocks {kvtier_views}")
    return counts, failures


def print_prefixes(index: Any, prompts: list[Prompt]) -> list[str]:
    tiers = ("GPU", *KVTIER_TIERS)
    header = f"{'prompt':<8} {'sent to':<8} {'blocks':>6}  " + "  ".join(
        f"{server + ': ' + ' '.join(f'{t:>6}' for t in tiers)}" for server in SERVERS
    )
    print(header)
    print("-" * len(header))
    failures = []
    for prompt in prompts:
        counts, failed = prefix_row(index, prompt)
        failures += failed
        cells = "  ".join(f"{server + ': ' + ' '.join(f'{counts[server][t]:>6}' for t in tiers)}" for server in SERVERS)
        print(f"{prompt.family:<8} {'+'.join(prompt.servers):<8} {len(prompt.hashes):>6}  {cells}")
    return failures


def pool_files() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("kvtier-*")} if shm.is_dir() else set()


def group_alive(pgid: int) -> bool:
    """A process of group ``pgid`` still runs (zombies waiting for a reaper do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def left_behind(servers: dict[str, OpenAIServer], pools_before: set[str], digests: set[str]) -> list[str]:
    """What the demo started and is still there: a server's process group, a pool file of its
    namespaces in /dev/shm (the service's, named after the namespace digest)."""
    found = []
    deadline = time.monotonic() + GROUP_EXIT_GRACE_S
    for name, server in servers.items():
        # The server's own process has exited; its engine-core child may still be shutting down.
        while group_alive(server.process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if group_alive(server.process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.process.pid, signal.SIGKILL)
            found.append(f"server {name}'s process group {server.process.pid} (killed)")
    ours = {f for f in pool_files() - pools_before if any(d[:16] in f for d in digests)}
    found += [f"/dev/shm/{name}" for name in sorted(ours)]
    return found


def run_demo(args: argparse.Namespace, work: Path, store_dir: Path, servers: dict[str, OpenAIServer]) -> None:
    """Everything between starting the servers (into ``servers``, which the caller stops) and
    checking the index."""
    from vllm.tokenizers.registry import get_tokenizer

    from kvtier.kv_index import KvEventIndex

    model_dir = ensure_model(args.preset)
    tokenizer = get_tokenizer(str(model_dir))
    prompt_hashes, key_hash = block_hasher()
    prompts = build_prompts(tokenizer, args.prompts)
    endpoints = {name: f"ipc://{work}/events-{name}.ipc" for name in SERVERS}
    index = KvEventIndex(endpoints)  # connects before the publishers bind: it sees every event
    try:
        servers.update(start_servers(model_dir, args.preset, store_dir, work, endpoints))
        started = time.monotonic()
        for name, server in servers.items():
            server.wait_healthy()
            print(f"server {name} ready at {server.url}, events on {endpoints[name]}", flush=True)
        print(f"both servers ready in {time.monotonic() - started:.0f} s", flush=True)
        started = time.monotonic()
        send_requests(servers, prompts, args.requests, tokenizer)
        print(f"{args.requests} requests over {len(prompts)} prompts in {time.monotonic() - started:.1f} s")
        listing = wait_for_agreement(servers, store_dir, index, key_hash)
        counts = ", ".join(f"{tier} {len(keys)}" for tier, keys in listing.items())
        print(f"the index of both servers agrees with `kvtier ls --json --blocks`: {counts} blocks")
        print(f"events seen {index.events_seen}, {index.bytes_seen} bytes\n")
        for prompt in prompts:
            prompt.hashes = prompt_hashes(tokenizer.encode(prompt.last_text))
        shown = prompts[: args.show]
        print("leading blocks of each prompt's last request held, per server and tier:")
        failures = print_prefixes(index, shown)
        if failures:
            raise DemoClaimFailed("; ".join(failures))
        print("every row agrees with the claims (answering server on GPU, both servers see kvtier's blocks)")
    finally:
        index.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier demo events", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--requests", type=int, default=200, help="completions sent (one token each)")
    parser.add_argument(
        "--prompts",
        type=int,
        default=12,
        help="distinct documents the requests share (12: 36 blocks, within the 64-block DRAM tier; more evict to NVMe)",
    )
    parser.add_argument("--show", type=int, default=3, help="prompts whose blocks are printed per server and tier")
    parser.add_argument("--store", help="kvtier store directory (default: a temporary directory)")
    parser.add_argument("--keep-store", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvtier-demo-events-"))
    store_dir = Path(args.store) if args.store else work / "store"
    store_dir.mkdir(parents=True, exist_ok=True)
    print(f"store {store_dir}\nserver logs and event endpoints in {work}", flush=True)
    pools_before = pool_files()
    servers: dict[str, OpenAIServer] = {}
    status = 0
    try:
        run_demo(args, work, store_dir, servers)
    except (DemoClaimFailed, ServerError) as error:
        print(f"claim failed: {error}" if isinstance(error, DemoClaimFailed) else f"error: {error}", file=sys.stderr)
        status = 1
    finally:
        status = max(status, stop_everything(servers, store_dir, work, pools_before, args.keep_store))
    return status


def stop_everything(
    servers: dict[str, OpenAIServer], store_dir: Path, work: Path, pools_before: set[str], keep: bool
) -> int:
    """Stops the servers and the service they started, then checks that nothing is left."""
    from kvtier.service import default_socket_path, stop_service

    digests = {d.name for d in store_dir.iterdir() if d.is_dir()} if store_dir.is_dir() else set()
    for server in servers.values():
        server.stop()
    stop_service(default_socket_path(store_dir))
    leftovers = left_behind(servers, pools_before, digests)
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    if leftovers:
        print(f"claim failed: left behind: {', '.join(leftovers)}", file=sys.stderr)
        return 1
    print("stopped: no server process and no kvtier file in /dev/shm left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
