"""`kvtier verify`, `kvtier trim` and `kvtier inspect` while a real vLLM engine (its default process
layout, through the host service) serves: no false alarm, nothing in use removed, and the engine's
output after restoring from kvtier equals what it computed (0 wrong bytes reach the model).

Run: ``.venv/bin/python -m pytest tests/test_vllm_ops.py -m slow -v``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

try:
    import vllm  # noqa: F401

    from kvtier import service as kvtier_service
    from kvtier.engine_process import EngineProcess
except Exception as import_error:  # pragma: no cover - depends on the environment
    pytest.skip(f"vllm or kvtier is not importable ({import_error!r})", allow_module_level=True)

# Full only (about 90 s, an engine of its own): CI runs verify and trim against a client storing and
# loading through the same service (tests/test_ops.py::test_trim_and_verify_while_a_client_stores_and_loads).
pytestmark = [pytest.mark.slow, pytest.mark.full]

TOKENS_PER_BLOCK = 128
LOGPROB_TOLERANCE = 1e-3
# A small DRAM pool and an NVMe tier: most restored blocks come from NVMe.
STORE_OPTIONS = {"dram_bytes": 16 << 20, "nvme_bytes": 128 << 20, "region_bytes": 4 << 20}


def kvtier_cli(*args: str) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "kvtier", *args, "--json"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode in (0, 3), done.stderr
    return done.returncode, json.loads(done.stdout)


def same_output(expected: dict, actual: dict) -> bool:
    return actual["tokens"] == expected["tokens"] and all(
        abs(a - b) <= LOGPROB_TOLERANCE for a, b in zip(expected["logprobs"], actual["logprobs"], strict=True)
    )


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    store_dir = tmp_path_factory.mktemp("kvtier-ops-store")
    e = EngineProcess(store_dir, tmp_path_factory.mktemp("logs") / "engine.log", {"tp_size": 1, "store": STORE_OPTIONS})
    e.store_dir = store_dir  # type: ignore[attr-defined]
    yield e
    e.stop()
    pid = kvtier_service.service_pid(kvtier_service.default_socket_path(store_dir))
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def settle(engine: EngineProcess, socket: Path, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    last = None
    while time.monotonic() < deadline:
        engine.call(op="settle")
        now = kvtier_service.service_stats(socket)
        activity = tuple(now.get(n, 0) for n in ("puts", "bytes_written_nvme", "dropped_stores"))
        if now.get("service_pending_fills", 0) == 0 and activity == last:
            return
        last = activity
        time.sleep(1.0)
    raise AssertionError("stores still in flight")


def test_verify_trim_and_inspect_while_the_engine_serves(engine):
    store = str(engine.store_dir)
    socket = kvtier_service.default_socket_path(store)
    seeds = list(range(10, 16))
    computed = {seed: engine.generate(seed, 4 * TOKENS_PER_BLOCK + 10) for seed in seeds}
    settle(engine, socket)

    status, inspected = kvtier_cli("inspect", store, "-n", "local")
    ns = inspected["namespace"]
    assert ns["source"] == "service" and ns["blocks"] >= 4 * len(seeds)
    assert ns["description"]["engine"] == "vllm"
    # vLLM's CPU layout is parallelism-agnostic: the namespace names the canonical layout, no TP size.
    assert ns["description"]["object_layout"].startswith("canonical layer pages")
    assert "tp_size" not in ns["description"]["parallel"]

    # Operator commands in a loop beside the engine's requests.
    stop = threading.Event()
    reports: list[tuple[str, int, dict[str, Any]]] = []

    def operate() -> None:
        while not stop.is_set():
            reports.append(("verify", *kvtier_cli("verify", store, "--max-mbps", "400")))
            reports.append(("trim", *kvtier_cli("trim", store, "--older-than", "2s")))

    operator = threading.Thread(target=operate)
    operator.start()
    wrong = 0
    restored = 0
    try:
        for round_ in range(3):
            for seed in seeds:
                assert engine.call(op="reset")["ok"]  # vLLM's own cache forgets: kvtier restores
                again = engine.generate(seed, 4 * TOKENS_PER_BLOCK + 10)
                restored += again["cached"] // TOKENS_PER_BLOCK
                wrong += not same_output(computed[seed], again)
            settle(engine, socket)
            assert round_ < 2 or reports, "the operator loop ran"
    finally:
        stop.set()
        operator.join(timeout=600)
    assert wrong == 0, "an output after a restore differs from the computed one"
    verifies = [r for name, code, r in reports if name == "verify"]
    assert verifies and all(code == 0 for name, code, _ in reports if name == "verify"), reports
    assert sum(r["checked_copies"] for r in verifies) > 0
    trims = [r for name, _, r in reports if name == "trim"]
    assert trims and all(t["namespaces"][0]["source"] == "service" for t in trims)
    assert restored > 0, "some blocks were restored from kvtier while the operator commands ran"

    # Drop the model's blocks while it runs (stored again first: the loop's trims may have taken
    # them all); the next requests recompute and still agree.
    for seed in seeds[:2]:
        assert engine.call(op="reset")["ok"]
        assert same_output(computed[seed], engine.generate(seed, 4 * TOKENS_PER_BLOCK + 10))
    settle(engine, socket)
    _, dropped = kvtier_cli("trim", store, "--namespace", "local")
    assert dropped["removed_blocks"] > 0
    for seed in seeds[:2]:
        assert engine.call(op="reset")["ok"]
        assert same_output(computed[seed], engine.generate(seed, 4 * TOKENS_PER_BLOCK + 10))
    status, final = kvtier_cli("verify", store)
    assert status == 0 and final["ok"]
