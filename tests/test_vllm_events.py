"""KV events for routers (issue 26), on the real (CPU) vLLM engine with its ZMQ publisher on.

Engines run in vLLM's default layout (``kvtier.engine_process``) with ``kv_events_config`` set; a
subscriber built on vLLM's own message classes (``kvtier.kv_index``) keeps the index a router
would. What kvtier holds appears as ``BlockStored`` for its media with the block hashes vLLM
itself publishes for its GPU cache; a prefix-cache reset clears the GPU tier and leaves kvtier's;
evictions from the pool are ``BlockRemoved``; a second engine on the host reports the blocks the
first one stored; and the index agrees with the service at the end.

Run: ``.venv/bin/python -m pytest tests/test_vllm_events.py -m slow -v``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401
    import zmq  # noqa: F401

    from kvtier import service as kvtier_service
    from kvtier.engine_process import TOKENS_PER_BLOCK, EngineProcess
    from kvtier.kv_index import GPU, KvEventIndex
except Exception as import_error:  # pragma: no cover - depends on the environment
    pytest.skip(f"vllm, pyzmq or kvtier is not importable ({import_error!r})", allow_module_level=True)

# Its checks run in tests/test_vllm_serve.py on `vllm serve` servers (GPU hashes, a prefix-cache
# reset, a second engine, evictions, agreement with the service): this engine-process version is a
# repeat, kept for KVTIER_FULL_TESTS=1 (CI's time budget).
pytestmark = [pytest.mark.slow, pytest.mark.full]

POOL = ("CPU", "LOCAL", None)
PROMPT_BLOCKS = 6
# A DRAM-only pool of 24 blocks (tiny model: 256 KiB each): a flood of other prompts evicts.
STORE_OPTIONS = {"dram_bytes": 24 * (256 << 10) + 24 * 4096, "nvme_bytes": 0}


def engine(store_dir: Path, log_dir: Path, name: str, endpoint: str) -> EngineProcess:
    spec = {"store": STORE_OPTIONS, "kv_events_endpoint": endpoint}
    return EngineProcess(store_dir, log_dir / f"engine-{name}.log", spec)


def settle(e: EngineProcess) -> None:
    for _ in range(3):
        e.call(op="settle")


def until(condition, *engines: EngineProcess, timeout_s: float = 60) -> bool:
    """vLLM publishes a manager's events at its next scheduler step: idle engines are driven."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        for e in engines:
            e.call(op="settle")
        time.sleep(0.3)
    return bool(condition())


def test_kvtier_blocks_are_kv_events_for_every_engine_and_evictions_are_removals(tmp_path):
    store_dir = tmp_path / "store"
    # ipc endpoints: vLLM's publisher binds them (and no port is opened).
    endpoints = {name: f"ipc://{tmp_path}/events-{name}.ipc" for name in ("a", "b")}
    index = KvEventIndex(endpoints)
    a = b = None
    try:
        a = engine(store_dir, tmp_path, "a", endpoints["a"])
        a.generate(seed=1, tokens=PROMPT_BLOCKS * TOKENS_PER_BLOCK + 10, max_tokens=2)
        settle(a)
        # vLLM names the prompt's blocks in its GPU events; kvtier's pool reports the same hashes.
        assert until(lambda: len(index.held("a", GPU)) >= PROMPT_BLOCKS, a), index.snapshot()
        gpu_blocks = index.held("a", GPU)
        assert until(lambda: len(index.held("a", POOL) & gpu_blocks) >= PROMPT_BLOCKS, a), index.snapshot()
        prompt_blocks = index.held("a", POOL) & gpu_blocks

        assert a.call(op="reset")["ok"]
        settle(a)
        assert until(lambda: not index.held("a", GPU) & prompt_blocks, a), "no GPU removal after the reset"
        assert prompt_blocks <= index.held("a", POOL), "kvtier's blocks must outlive vLLM's prefix-cache reset"

        # A second engine on the host reports what the first one stored (it can load it too).
        b = engine(store_dir, tmp_path, "b", endpoints["b"])
        settle(b)
        assert until(lambda: prompt_blocks <= index.held("b", POOL), b), index.snapshot()

        # Other prompts push the first one out of the 24-block pool: removals, in both engines' streams.
        for seed in range(10, 16):
            a.generate(seed=seed, tokens=PROMPT_BLOCKS * TOKENS_PER_BLOCK + 10, max_tokens=1)
        settle(a)
        settle(b)
        assert until(lambda: not prompt_blocks & index.held("a", POOL), a), "no removal for evicted blocks"
        assert until(lambda: not prompt_blocks & index.held("b", POOL), b), "another engine's eviction, unseen"

        # The index agrees with the service: as many blocks in the pool as it holds.
        socket = kvtier_service.default_socket_path(store_dir)

        def agree() -> bool:
            held = kvtier_service.service_stats(socket)["blocks_dram"]
            return len(index.held("a", POOL)) == held == len(index.held("b", POOL))

        assert until(agree, a, b), (kvtier_service.service_stats(socket).get("blocks_dram"), index.snapshot())
        print(f"events seen {index.events_seen}, {index.bytes_seen} bytes")
    finally:
        for e in (a, b):
            if e is not None:
                e.stop()
        index.close()
        kvtier_service.stop_service(kvtier_service.default_socket_path(store_dir))
