"""vLLM in its default process layout with kvtier's host service, on the real (CPU) vLLM engine.

Every engine here runs as vLLM runs by default: its own engine-core process and worker process(es)
(no ``VLLM_ENABLE_V1_MULTIPROCESSING``, no executor flag), so each one is a child process of this
test driven over stdin/stdout (this file is also the driver, ``--engine``). They share one store path,
so one host service, which the first engine starts, and one DRAM pool with no NVMe tier: every hit
below is a hit in the shared pool.

Run: ``.venv/bin/python -m pytest tests/test_vllm_service.py -m slow -v``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401

    import kvtier.vllm as kvtier_vllm
    from kvtier import service as kvtier_service
    from kvtier.models import ensure_model
except Exception as import_error:  # pragma: no cover - depends on the environment
    pytest.skip(f"vllm or kvtier is not importable ({import_error!r})", allow_module_level=True)

pytestmark = pytest.mark.slow

TOKENS_PER_BLOCK = 128
MARK = "@@kvtier-test@@ "
ENGINE_START_TIMEOUT_S = 400
DRAM_BYTES = 64 << 20
LOGPROB_TOLERANCE = 1e-3


def random_prompt(seed: int, full_blocks: int, extra_tokens: int = 10) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(full_blocks * TOKENS_PER_BLOCK + extra_tokens)]


# ---------------------------------------------------------------------------------------------
# The engine side (this file run with --engine): vLLM with its defaults and kvtier
# ---------------------------------------------------------------------------------------------


def _engine_main(store_dir: str, tp_size: int, options_json: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    options = {"dram_bytes": DRAM_BYTES, "nvme_bytes": 0, **json.loads(options_json)}
    llm = LLM(
        model=str(ensure_model("tiny")),
        dtype="float32",
        max_model_len=4096,
        enable_prefix_caching=True,
        enforce_eager=True,
        seed=0,
        tensor_parallel_size=tp_size,
        kv_transfer_config=KVTransferConfig(**kvtier_vllm.kv_transfer_config(store_dir, **options)),
    )

    def generate(prompt: list[int], max_tokens: int, salt: str | None) -> dict:
        request = TokensPrompt(prompt_token_ids=prompt)
        if salt is not None:
            request["cache_salt"] = salt
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, seed=0)
        (output,) = llm.generate([request], params, use_tqdm=False)
        completion = output.outputs[0]
        steps = list(completion.logprobs or [])
        logprobs = [step[t].logprob for t, step in zip(completion.token_ids, steps, strict=True) if step is not None]
        return {"tokens": list(completion.token_ids), "logprobs": logprobs, "cached": output.num_cached_tokens or 0}

    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "generate":
            prompt = random_prompt(command["seed"], command["blocks"])
            reply = generate(prompt, command.get("max_tokens", 6), command.get("salt"))
        elif op == "settle":  # a few steps so that deferred store jobs are submitted and finish
            for _ in range(3):
                generate([5, 6, 7], 2, None)
            reply = {"ok": True}
        elif op == "reset":
            reply = {"ok": bool(llm.reset_prefix_cache())}
        elif op == "quit":
            print(MARK + json.dumps({"ok": True}), flush=True)
            break
        else:
            reply = {"error": f"unknown op {op}"}
        print(MARK + json.dumps(reply), flush=True)


# ---------------------------------------------------------------------------------------------
# The test side
# ---------------------------------------------------------------------------------------------


class Engine:
    """One vLLM engine (its own process group: front end, engine core, workers)."""

    def __init__(self, store_dir: Path, log_dir: Path, name: str, tp_size: int = 1, **options):
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
        if tp_size == 2:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank on this 2-core machine
        self.name = name
        self.log_path = log_dir / f"engine-{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115  # the engine's stderr for its whole life
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--engine", str(store_dir), str(tp_size), json.dumps(options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            start_new_session=True,
        )
        self._read(ENGINE_START_TIMEOUT_S)

    def _read(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        assert self.process.stdout is not None
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                raise AssertionError(f"engine {self.name} exited; log {self.log_path}:\n{self._tail()}")
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise AssertionError(f"engine {self.name} did not answer within {timeout_s} s:\n{self._tail()}")

    def _tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])

    def call(self, timeout_s: float = 300, **command) -> dict:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._read(timeout_s)

    def generate(self, seed: int, blocks: int, salt: str | None = None) -> dict:
        return self.call(op="generate", seed=seed, blocks=blocks, salt=salt)

    def kill(self) -> None:
        """kill -9 of every process of this engine (not the service: it has its own session)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=60)
        self._log.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.call(op="quit", timeout_s=60)
                self.process.wait(timeout=120)
            except Exception:
                self.kill()
        self._log.close()


def assert_same_output(expected: dict, actual: dict) -> None:
    assert actual["tokens"] == expected["tokens"]
    for a, b in zip(expected["logprobs"], actual["logprobs"], strict=True):
        assert abs(a - b) <= LOGPROB_TOLERANCE, (expected["logprobs"], actual["logprobs"])


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvtier-service-store")


@pytest.fixture(scope="module")
def socket_path(store_dir) -> Path:
    return kvtier_service.default_socket_path(store_dir)


@pytest.fixture(scope="module")
def engine_a(store_dir, tmp_path_factory, socket_path):
    engine = Engine(store_dir, tmp_path_factory.mktemp("logs"), "a")
    yield engine
    engine.stop()
    pid = kvtier_service.service_pid(socket_path)
    if pid is not None:
        with_suppressed_kill(pid, signal.SIGTERM)


def with_suppressed_kill(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def stats(socket_path: Path) -> dict[str, int]:
    return kvtier_service.service_stats(socket_path)


def test_defaults_hit_after_prefix_cache_reset(engine_a, socket_path):
    """vLLM's defaults (multiprocess engine core and executor): stored, evicted from vLLM's own
    cache, restored from kvtier's pool with the same greedy output."""
    first = engine_a.generate(seed=1, blocks=5)
    assert first["cached"] == 0
    engine_a.call(op="settle")
    before = stats(socket_path)
    assert before["puts"] >= 5 and before["service_namespaces"] == 1
    assert engine_a.call(op="reset")["ok"]
    again = engine_a.generate(seed=1, blocks=5)
    assert again["cached"] == 5 * TOKENS_PER_BLOCK
    assert_same_output(first, again)
    assert stats(socket_path)["dram_hits"] - before["dram_hits"] >= 5


def test_a_second_engine_hits_the_first_engines_prefix_in_dram_and_so_does_a_restarted_one(
    engine_a, store_dir, socket_path, tmp_path
):
    computed = engine_a.generate(seed=2, blocks=4)
    engine_a.call(op="settle")
    for name in ("b", "b-restarted"):
        before = stats(socket_path)
        other = Engine(store_dir, tmp_path, name)
        try:
            hit = other.generate(seed=2, blocks=4)
        finally:
            other.stop()
        assert hit["cached"] == 4 * TOKENS_PER_BLOCK, name
        assert_same_output(computed, hit)
        after = stats(socket_path)
        assert after["dram_hits"] - before["dram_hits"] >= 4, name
        assert after["bytes_read_nvme"] == 0 and after["nvme_capacity_bytes"] == 0  # the DRAM pool served it


def test_tensor_parallel_hit_matches_a_tensor_parallel_recompute(store_dir, socket_path, tmp_path, engine_a):
    engine = Engine(store_dir, tmp_path, "tp2", tp_size=2)
    try:
        first = engine.generate(seed=3, blocks=5)
        engine.call(op="settle")
        assert engine.call(op="reset")["ok"]
        again = engine.generate(seed=3, blocks=5)
    finally:
        engine.stop()
    assert first["cached"] == 0 and again["cached"] == 5 * TOKENS_PER_BLOCK
    assert_same_output(first, again)
    assert stats(socket_path)["service_namespaces"] == 2  # TP=2 blocks live in their own namespace


def test_kill_9_of_an_engine_during_stores_leaves_the_other_engine_correct(engine_a, store_dir, socket_path, tmp_path):
    victim = Engine(store_dir, tmp_path, "victim")
    assert victim.process.stdin is not None
    victim.process.stdin.write(json.dumps({"op": "generate", "seed": 4, "blocks": 12}) + "\n")
    victim.process.stdin.flush()
    deadline = time.monotonic() + 120
    puts_before = stats(socket_path)["puts"]
    while stats(socket_path)["puts"] == puts_before and time.monotonic() < deadline:
        time.sleep(0.05)
    victim.kill()  # in the middle of its stores (or just after its first ones)
    time.sleep(1.0)
    assert stats(socket_path)["service_connections"] >= 1
    reference = engine_a.generate(seed=4, blocks=12, salt="no-sharing")  # a recompute: another salt
    served = engine_a.generate(seed=4, blocks=12)  # whatever the victim stored, verified and complete
    assert_same_output(reference, served)
    earlier = engine_a.generate(seed=2, blocks=4)
    assert earlier["cached"] == 4 * TOKENS_PER_BLOCK


def test_kill_9_of_the_service_while_an_engine_serves(engine_a, socket_path):
    pid = kvtier_service.service_pid(socket_path)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    reference = engine_a.generate(seed=5, blocks=3, salt="reference")
    during = engine_a.generate(seed=5, blocks=3)
    assert time.monotonic() - started < 120, "requests stalled behind a dead service"
    assert_same_output(reference, during)
    # The engine reattaches: it starts a new service in the background, and stores and hits resume.
    deadline = time.monotonic() + 120
    while kvtier_service.service_pid(socket_path) in (None, pid) and time.monotonic() < deadline:
        engine_a.generate(seed=6, blocks=1)
        time.sleep(0.5)
    assert kvtier_service.service_pid(socket_path) not in (None, pid), "no service came back"
    for _ in range(60):
        fresh = engine_a.generate(seed=7, blocks=3)
        engine_a.call(op="settle")
        if stats(socket_path).get("puts", 0) >= 3:
            break
        time.sleep(1)
    assert engine_a.call(op="reset")["ok"]
    hit = engine_a.generate(seed=7, blocks=3)
    assert hit["cached"] == 3 * TOKENS_PER_BLOCK
    assert_same_output(fresh, hit)


if __name__ == "__main__" and len(sys.argv) >= 5 and sys.argv[1] == "--engine":
    _engine_main(sys.argv[2], int(sys.argv[3]), sys.argv[4])
