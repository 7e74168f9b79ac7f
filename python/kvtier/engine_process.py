"""A real vLLM engine in its default process layout, in a child process driven over stdin/stdout.

vLLM's defaults run the engine core (and each worker) in processes of their own; kvtier's tests and
benchmarks start such engines as children of their own so that several engines (and TP ranks) share
one kvtier host service, and an engine can be killed with SIGKILL as a crash would. The child is
``python -m kvtier.engine_process STORE_DIR SPEC_JSON``; it answers one JSON line per command
(``generate``, ``settle``, ``reset``, ``quit``) after a marker, so vLLM's own output never mixes in.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MARK = "@@kvtier-engine@@ "
TOKENS_PER_BLOCK = 128  # vLLM's block size on CPU
ENGINE_START_TIMEOUT_S = 600
# Seconds of quiet before a timed request when several engines share the host's cores. After
# serving a step, a vLLM engine's processes keep polling their shared-memory queues for 1 s (vLLM's
# shm_broadcast busy loop, not configurable) before they sleep; a request sent to another engine
# within that second computes beside it. On this 2-core machine that made a cross-engine DRAM hit
# cost 655-910 ms against an own hit of 190 ms (kv8b, 2K; 779 against 253 ms at 8K), and a
# recompute 2.4-3.3 s instead of 1.4 s. GPU servers poll on cores the model does not compute on.
ENGINE_QUIET_S = 1.5


def random_prompt(seed: int, tokens: int, vocab: int = 4000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(tokens)]


# ---------------------------------------------------------------------------------------------
# The child
# ---------------------------------------------------------------------------------------------


def _child(store_dir: str, spec: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvtier.models import PRESETS, ensure_model

    preset = spec.get("model", "tiny")
    started = time.perf_counter()
    llm = LLM(
        model=str(ensure_model(preset)),
        dtype=PRESETS[preset].dtype,  # type: ignore[arg-type]  # a preset names one of vLLM's dtypes
        max_model_len=spec.get("max_model_len", 4096),
        enable_prefix_caching=True,
        enforce_eager=True,
        seed=0,
        tensor_parallel_size=spec.get("tp_size", 1),
        # vLLM's LLM class defaults to 4096 prompt tokens per step on CPU, `vllm serve` to 2048.
        **({"max_num_batched_tokens": spec["chunk_tokens"]} if spec.get("chunk_tokens") else {}),
        kv_transfer_config=(KVTransferConfig(**transfer_config(store_dir, spec)) if spec.get("kvtier", True) else None),
        **_kv_events(spec),
    )
    vocab = PRESETS[preset].vocab_size

    def generate(prompt: list[int], max_tokens: int, salt: str | None) -> dict:
        request = TokensPrompt(prompt_token_ids=prompt)
        if salt is not None:
            request["cache_salt"] = salt
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, seed=0)
        began = time.perf_counter()
        (output,) = llm.generate([request], params, use_tqdm=False)
        seconds = time.perf_counter() - began
        completion = output.outputs[0]
        steps = list(completion.logprobs or [])
        logprobs = [step[t].logprob for t, step in zip(completion.token_ids, steps, strict=True) if step is not None]
        return {
            "tokens": list(completion.token_ids),
            "logprobs": logprobs,
            "cached": output.num_cached_tokens or 0,
            "seconds": seconds,
        }

    _reply({"ready": True, "start_seconds": time.perf_counter() - started})
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "generate":
            prompt = random_prompt(command["seed"], command["tokens"], vocab)
            reply = generate(prompt, command.get("max_tokens", 6), command.get("salt"))
        elif op == "settle":  # a few engine steps, so that deferred store jobs are submitted and finish
            for _ in range(3):
                generate([5, 6, 7], 2, None)
            reply = {"ok": True}
        elif op == "reset":
            reply = {"ok": bool(llm.reset_prefix_cache())}
        elif op == "quit":
            _reply({"ok": True})
            break
        else:
            reply = {"error": f"unknown op {op}"}
        _reply(reply)


def _kv_events(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM's KV-event publisher (ZMQ, bound to ``spec["kv_events_endpoint"]``), when asked for."""
    endpoint = spec.get("kv_events_endpoint")
    if not endpoint:
        return {}
    from vllm.config import KVEventsConfig

    return {"kv_events_config": KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)}


def transfer_config(store_dir: str, spec: dict[str, Any]) -> dict[str, Any]:
    """kvtier's ``kv_transfer_config`` through the route ``spec["route"]`` names: ``KvtierConnector``
    (the default), or vLLM's own ``OffloadingConnector`` with kvtier's spec."""
    import kvtier.vllm as kvtier_vllm

    config = kvtier_vllm.kv_transfer_config(store_dir, **spec.get("store", {}))
    if spec.get("route", "KvtierConnector") == "OffloadingConnector":
        config["kv_connector"] = "OffloadingConnector"
        del config["kv_connector_module_path"]
    return config


def _reply(message: dict) -> None:
    print(MARK + json.dumps(message), flush=True)


# ---------------------------------------------------------------------------------------------
# The parent's handle
# ---------------------------------------------------------------------------------------------


class EngineProcess:
    """One vLLM engine with kvtier (its own process group: front end, engine core, workers).

    ``spec``: ``model`` (a ``kvtier.models`` preset), ``tp_size``, ``max_model_len`` and ``store``
    (the ``kv_connector_extra_config`` options besides ``path``), ``route`` (``KvtierConnector``, the
    default, or vLLM's plain ``OffloadingConnector``), ``kv_events_endpoint`` (vLLM's ZMQ KV-event
    publisher binds there), ``chunk_tokens`` (prompt tokens per
    engine step; vLLM's default if absent); ``kvtier: false`` runs the engine
    without kvtier (vLLM's own prefix cache only, a benchmark's baseline). The engine runs with vLLM's
    defaults: no ``VLLM_ENABLE_V1_MULTIPROCESSING``, no executor flag.
    """

    def __init__(self, store_dir: Path, log_path: Path, spec: dict[str, Any], env: dict[str, str] | None = None):
        child_env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        child_env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        child_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if spec.get("tp_size", 1) == 2 and os.cpu_count() == 2:
            child_env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank on a 2-core machine
        child_env.update(env or {})
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115  # the engine's stderr for its whole life
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvtier.engine_process", str(store_dir), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=child_env,
            start_new_session=True,
        )
        self.start_seconds = self._read(ENGINE_START_TIMEOUT_S)["start_seconds"]

    def _read(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        assert self.process.stdout is not None
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"the engine exited; its log {self.log_path} ends with:\n{self.tail()}")
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise RuntimeError(f"the engine did not answer within {timeout_s} s; its log ends with:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def call(self, timeout_s: float = 900, **command: Any) -> dict:
        self.send(**command)
        return self._read(timeout_s)

    def generate(self, seed: int, tokens: int, salt: str | None = None, max_tokens: int = 6) -> dict:
        return self.call(op="generate", seed=seed, tokens=tokens, salt=salt, max_tokens=max_tokens)

    def kill(self) -> None:
        """kill -9 of every process of this engine (not the service, which has its own session)."""
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


if __name__ == "__main__":
    _child(sys.argv[1], json.loads(sys.argv[2]))
