"""A prompt larger than the host service's DRAM pool, restored from NVMe, in vLLM's default layout.

Regression test of a livelock (issue 14): the manager pins every block of a request at
``prepare_load``, NVMe-only blocks included, and each block its load then read into the pool stayed
pinned there until ``complete_load``. A request with more NVMe blocks than the pool's free slots
never got slots for its last ones: every try waited ``slot_wait_ms``, missed, and vLLM retried
forever. Engine pins now keep a block loadable (its NVMe copy), not the slot its load used.

With ``prefetch: false`` the load itself reads from NVMe (no prefetch into the pool at lookup). The
pool holds 8 blocks; the prompt has 24.

Run: ``.venv/bin/python -m pytest tests/test_vllm_service_nvme.py -m slow -v``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

try:
    import vllm  # noqa: F401

    from kvtier import service as kvtier_service
    from kvtier.engine_process import TOKENS_PER_BLOCK, EngineProcess
    from kvtier.models import PRESETS
except Exception as import_error:  # pragma: no cover - depends on the environment
    pytest.skip(f"vllm or kvtier is not importable ({import_error!r})", allow_module_level=True)

pytestmark = pytest.mark.slow

POOL_SLOTS = 8
PROMPT_BLOCKS = 24
LOGPROB_TOLERANCE = 1e-3
# A restore that takes longer than this is the livelock (each failed try costs slot_wait_ms = 5 s).
RESTORE_LIMIT_S = 60


def store_options() -> dict:
    object_bytes = PRESETS["tiny"].kv_bytes_per_token * TOKENS_PER_BLOCK
    slot_bytes = 4096 + object_bytes
    return {
        "dram_bytes": POOL_SLOTS * slot_bytes,
        "nvme_bytes": 64 << 20,
        "region_bytes": 4 * slot_bytes + (1 << 16),
        "prefetch": False,
    }


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    store_dir = tmp_path_factory.mktemp("kvtier-nvme-store")
    log = tmp_path_factory.mktemp("logs") / "engine.log"
    process = EngineProcess(store_dir, log, {"tp_size": 1, "store": store_options()})
    yield process, kvtier_service.default_socket_path(store_dir)
    process.stop()
    pid = kvtier_service.service_pid(kvtier_service.default_socket_path(store_dir))
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def test_a_prompt_three_pools_long_is_restored_from_nvme_in_one_try(engine):
    process, socket = engine
    tokens = PROMPT_BLOCKS * TOKENS_PER_BLOCK + 10
    computed = process.generate(seed=11, tokens=tokens)
    assert computed["cached"] == 0
    deadline = time.monotonic() + 120
    while kvtier_service.service_stats(socket).get("blocks_nvme", 0) < PROMPT_BLOCKS:
        assert time.monotonic() < deadline, f"stores not on NVMe: {kvtier_service.service_stats(socket)}"
        process.call(op="settle")
        time.sleep(0.5)
    before = kvtier_service.service_stats(socket)
    assert before["dram_capacity_bytes"] < PROMPT_BLOCKS * PRESETS["tiny"].kv_bytes_per_token * TOKENS_PER_BLOCK
    assert process.call(op="reset")["ok"]
    started = time.monotonic()
    restored = process.generate(seed=11, tokens=tokens)
    took_s = time.monotonic() - started
    after = kvtier_service.service_stats(socket)
    assert took_s < RESTORE_LIMIT_S, f"the restore took {took_s:.0f} s: loads waited for slots"
    assert restored["cached"] == PROMPT_BLOCKS * TOKENS_PER_BLOCK, (restored["cached"], after)
    assert restored["tokens"] == computed["tokens"]
    for a, b in zip(computed["logprobs"], restored["logprobs"], strict=True):
        assert abs(a - b) <= LOGPROB_TOLERANCE
    assert after["slot_wait_timeouts"] == before["slot_wait_timeouts"], "a load waited slot_wait_ms and missed"
    assert after["bytes_read_nvme"] > before["bytes_read_nvme"], "the restore did not come from NVMe"
