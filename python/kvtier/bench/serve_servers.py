"""The servers of a `kvtier bench serve` row: each one's `vllm serve` arguments, kvtier store or LMCache
configuration and cores (``start_server``), its warm-up, and the round-robin proxy in front of two
servers (``Proxy``, ``run_proxy``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, cast

from kvtier.bench import serve_slow
from kvtier.bench.serve_plan import (
    LMCACHE_ROWS,
    REUSE_ROW,
    SERVER_ENV,
    SHARED_TIER_ROW,
    TWO_SERVER_ROWS,
    WARM_UP_SEED,
    BenchError,
)
from kvtier.bench.ttft import LMCACHE_CHUNK_TOKENS, LMCACHE_HASH_SEED
from kvtier.models import server_dtype_args


def server_args(plan: dict[str, Any]) -> list[str]:
    args = ["--max-model-len", str(plan["max_model_len"]), "--enforce-eager"]
    if plan["vllm_blocks"]:
        args += ["--num-gpu-blocks-override", str(plan["vllm_blocks"])]
    return args + server_dtype_args(plan["preset"], plan["server_args"]) + plan["server_args"]


# --------------------------------------------------------------------------------------------
# the round-robin proxy (two servers)
# --------------------------------------------------------------------------------------------


def run_proxy(port: int, upstreams: list[str]) -> int:
    """Serve on 127.0.0.1:``port``: each POST to ``/v1/...`` goes to the next upstream in turn (its
    answer streamed back as it comes); any other request (``/tokenize``, ``/detokenize``, ``GET
    /v1/models``) to the first upstream (both serve the same model)."""
    import itertools

    import aiohttp
    from aiohttp import web

    turns = itertools.cycle(range(len(upstreams)))
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        balanced = request.method == "POST" and request.path.startswith("/v1/")
        upstream = upstreams[next(turns)] if balanced else upstreams[0]
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with request.app[session_key].request(
            request.method, upstream + request.path_qs, data=body, headers=headers
        ) as answer:
            response = web.StreamResponse(
                status=answer.status, headers={"Content-Type": answer.headers.get("Content-Type", "application/json")}
            )
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def open_session(app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0)
        app[session_key] = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))

    async def close_session(app: web.Application) -> None:
        await app[session_key].close()

    app = web.Application(client_max_size=1 << 30)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_route("*", "/{tail:.*}", forward)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)
    return 0


class Proxy:
    """The round-robin proxy as a child process."""

    def __init__(self, upstreams: list[str], log_path: Path):
        from kvtier.openai_server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "kvtier.bench.serve", "--run-proxy", str(self.port), *upstreams]
        with log_path.open("w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BenchError(f"the round-robin proxy exited with code {self.process.returncode}; see {log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise BenchError(f"the round-robin proxy did not answer within 60 s; see {log_path}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


# --------------------------------------------------------------------------------------------
# servers
# --------------------------------------------------------------------------------------------


def command_of(process: subprocess.Popen) -> list[str]:
    return [os.fsdecode(part) for part in cast(list, process.args)]


def row_stores(row: str, store_root: Path) -> list[Path]:
    """The kvtier store directory of each server of a row (a repeated path: one shared pool)."""
    if row == "vllm" or row in LMCACHE_ROWS:
        return []
    if row == "kvtier-2x-shared":
        return [store_root / row, store_root / row]
    if row == "kvtier-2x-private":
        return [store_root / row / "a", store_root / row / "b"]
    if row == SHARED_TIER_ROW:
        return [store_root / row / "local"]
    return [store_root / row]


def store_options(row: str, plan: dict[str, Any], store: Path) -> dict[str, Any]:
    dram_gib, nvme_gib = plan["dram_gib"], plan["nvme_gib"]
    if row in ("kvtier-dram", SHARED_TIER_ROW) or serve_slow.row_base(row) in serve_slow.ROW_LABELS:
        nvme_gib = 0.0
    if row == "kvtier-2x-private":  # the host's memory for kvtier is the same as in the shared row
        dram_gib, nvme_gib = dram_gib / 2, nvme_gib / 2
    options: dict[str, Any] = {"dram_bytes": int(dram_gib * 2**30), "nvme_bytes": int(nvme_gib * 2**30)}
    if row == SHARED_TIER_ROW:  # beside the local store, removed with the row's store directory
        options["shared_root"] = str(store.parent / "shared")
    if row == REUSE_ROW:
        options["write_admission"] = "reuse"
    return options


def lmcache_config(row: str, plan: dict[str, Any], disk_dir: Path) -> dict[str, Any]:
    """LMCache's configuration (LMCACHE_CONFIG_FILE) of a row: its CPU cache sized like kvtier's DRAM
    row, and on lmcache-disk its local disk sized like kvtier's NVMe tier. Whole chunks only, as in
    ``kvtier bench ttft``; the shim copies without layerwise or blending."""
    config: dict[str, Any] = {
        "chunk_size": LMCACHE_CHUNK_TOKENS,
        "local_cpu": True,
        "max_local_cpu_size": plan["dram_gib"] * 2**30 / 1e9,  # LMCache counts GB
        "save_unfull_chunk": False,
        "use_layerwise": False,
        "enable_blending": False,
    }
    if row == "lmcache-disk":
        config.update(local_disk=str(disk_dir), max_local_disk_size=plan["nvme_gib"] * 2**30 / 1e9)
    return config


def lmcache_server_setup(row: str, plan: dict[str, Any], out_dir: Path) -> tuple[dict, list[str], dict, Path]:
    """The transfer config, the command standing for ``vllm``, the environment and the shim's counters
    file of an LMCache row's server (LMCache's venv, kvtier's CPU copy shim installed by the launcher)."""
    import kvtier

    disk_dir = out_dir / "stores" / row
    disk_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / f"lmcache-{row}.yaml"
    config_path.write_text(json.dumps(lmcache_config(row, plan, disk_dir), indent=2) + "\n")  # JSON is YAML
    counters_path = out_dir / f"lmcache-{row}-counters"  # a prefix: one file per process
    for stale in out_dir.glob(f"{counters_path.name}.*"):
        stale.unlink()
    python_dir = str(Path(kvtier.__file__).resolve().parent.parent)
    env = {
        "PYTHONPATH": os.pathsep.join(
            [python_dir] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
        "PYTHONHASHSEED": LMCACHE_HASH_SEED,
        "LMCACHE_CONFIG_FILE": str(config_path),
        "LMCACHE_TRACK_USAGE": "false",
        "KVTIER_LMCACHE_SHIM_COUNTERS": str(counters_path),
    }
    transfer = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    return transfer, [plan["lmcache_python"], "-m", "kvtier.bench.lmcache_serve"], env, counters_path


def warm_up(server: Any, plan: dict[str, Any]) -> None:
    """vLLM's one-time costs of a prompt of this shape (and kvtier's first store), on a prompt no
    point uses; then an empty prefix cache."""
    from kvtier.engine_process import random_prompt
    from kvtier.models import PRESETS

    vocab = PRESETS[plan["preset"]].vocab_size if plan["preset"] in PRESETS else 4000
    prompt = random_prompt(WARM_UP_SEED, plan["prefix_len"] + plan["suffix_len"], min(vocab, 4000))
    server.complete(prompt, 1)
    server.complete([*prompt[: plan["prefix_len"]], *reversed(prompt[plan["prefix_len"] :])], 1)
    server.reset_prefix_cache()


def events_args(endpoint: str) -> list[str]:
    """``vllm serve`` arguments that publish the server's KV events on ``endpoint`` (vLLM binds it)."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    return ["--kv-events-config", json.dumps(config)]


def core_share(number: int, count: int) -> str | None:
    """The cores server ``number`` of ``count`` on this host binds its OpenMP threads to
    (``VLLM_CPU_OMP_THREADS_BIND``): an even, contiguous share of this process's cores. vLLM's
    automatic binding gives every engine the same cores, and two CPU engines whose OpenMP threads
    spin on the same cores slow each other far below half speed. None: fewer cores than servers."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // count
    if count < 2 or share < 1:
        return None
    return ",".join(str(core) for core in cores[number * share : (number + 1) * share])


def start_server(
    plan: dict[str, Any],
    row: str,
    number: int,
    out_dir: Path,
    stores: list[Path],
    extra: list[str],
    options: dict[str, Any] | None = None,
) -> tuple[Any, Path, Path | None]:
    """One server of a row: (the server, its log, the LMCache shim's counters file or None).
    ``options``: more kvtier options (an object row's bucket, endpoint and load policy)."""
    from kvtier.openai_server import OpenAIServer
    from kvtier.vllm import kv_transfer_config

    env = {**SERVER_ENV, "VLLM_CPU_KVCACHE_SPACE": str(plan["vllm_kv_gib"])}
    cores = core_share(number, 2) if row in TWO_SERVER_ROWS else None
    if cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    transfer: dict[str, Any] | None = None
    vllm: list[str] | None = None  # None: this environment's vllm command
    counters_path: Path | None = None
    if row in LMCACHE_ROWS:
        transfer, vllm, lmcache_env, counters_path = lmcache_server_setup(row, plan, out_dir)
        env.update(lmcache_env)
    elif stores:
        stores[number].mkdir(parents=True, exist_ok=True)
        transfer = kv_transfer_config(stores[number], **store_options(row, plan, stores[number]), **(options or {}))
    log_path = out_dir / "logs" / f"server-{row}-{number}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = OpenAIServer(
        Path(plan["model_dir"]), plan["preset"], log_path, transfer, server_args(plan) + extra, env, vllm=vllm
    )
    return server, log_path, counters_path
