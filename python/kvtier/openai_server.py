"""A real ``vllm serve`` (vLLM's OpenAI-compatible server) with kvtier, as a user runs it.

The demo, the server tests and ``kvtier bench serve`` start servers through this module: the
``vllm`` command of this environment with vLLM's defaults (its own engine-core and worker
processes), kvtier through ``--kv-transfer-config``, only on 127.0.0.1; stopped with SIGTERM as an
operator or an orchestrator stops it. Requests are streamed completions, timed to the first token.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
SERVER_START_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 600
STOP_TIMEOUT_S = 90


def stream_completion(url: str, payload: dict[str, Any]) -> tuple[float, dict[str, Any], str]:
    """POSTs a streamed completion (``payload`` with ``"stream": True`` and usage included) to the server
    at ``url``: seconds to its first token, its usage, and its text. ``ServerError`` if it streamed no
    token; the request's own errors (refused, timed out) are raised as they come."""
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    first_token_s = None
    usage: dict[str, Any] = {}
    text = []
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        for raw_line in response:
            line = raw_line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("choices"):
                if first_token_s is None:
                    first_token_s = time.perf_counter() - started
                text.append(chunk["choices"][0].get("text", ""))
            if chunk.get("usage"):
                usage = chunk["usage"]
    if first_token_s is None:
        raise ServerError("the server streamed no token")
    return first_token_s, usage, "".join(text)


class ServerError(RuntimeError):
    """The server could not start or answer; the message says why and where its log is."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def vllm_command() -> list[str]:
    """``vllm`` as installed beside this interpreter (the user's command), else its module."""
    script = Path(sys.executable).parent / "vllm"
    return [str(script)] if script.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


@dataclass
class Completion:
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int
    text: str


class OpenAIServer:
    """One ``vllm serve`` process group. ``transfer_config``: the ``--kv-transfer-config`` dict (None:
    vLLM alone). ``extra_args``: more ``vllm serve`` flags. ``env``: more environment. ``vllm``: the
    command that stands for ``vllm`` (default: this environment's, see vllm_command)."""

    def __init__(
        self,
        model_dir: Path,
        served_name: str,
        log_path: Path,
        transfer_config: dict[str, Any] | None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        port: int = 0,
        vllm: list[str] | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.model = served_name
        self.log_path = log_path
        command = [
            *(vllm or vllm_command()), "serve", str(model_dir),
            "--served-model-name", served_name,
            "--host", HOST,
            "--port", str(self.port),
            "--enable-prompt-tokens-details",
            *(extra_args or []),
        ]  # fmt: skip
        if transfer_config is not None:
            command += ["--kv-transfer-config", json.dumps(transfer_config)]
        server_env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
            **(env or {}),
        }
        server_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        with log_path.open("w") as log:
            self.process = subprocess.Popen(
                command, env=server_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_healthy(self, timeout_s: float = SERVER_START_TIMEOUT_S) -> float:
        started = time.monotonic()
        while time.monotonic() < started + timeout_s:
            if self.process.poll() is not None:
                raise ServerError(f"vllm serve exited with code {self.process.returncode}; log tail:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        raise ServerError(f"vllm serve did not become healthy within {timeout_s:.0f} s; see {self.log_path}")

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def complete(self, prompt: str | list[int], max_tokens: int = 8) -> Completion:
        """A streamed completion (temperature 0), timed to its first token."""
        payload = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        first_token_s, usage, text = stream_completion(self.url, payload)
        details = usage.get("prompt_tokens_details") or {}
        return Completion(
            ttft_ms=first_token_s * 1000,
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=int(details.get("cached_tokens") or 0),
            text=text,
        )

    def reset_prefix_cache(self, attempts: int = 20) -> None:
        """Empties vLLM's own prefix cache. vLLM refuses while offload stores hold blocks; a one-token
        request drives the engine steps that complete them."""
        for _ in range(attempts):
            if _post_json(f"{self.url}/reset_prefix_cache").get("success"):
                return
            self.complete("# nudge", 1)
            time.sleep(0.5)
        raise ServerError(f"vLLM did not reset its prefix cache after {attempts} attempts")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM to the server's process group, as an operator stops it; SIGKILL after the wait. The
        wait covers the whole group: vLLM's engine core, a process of its own, may still be shutting
        down when the API server has exited, and a service stopped meanwhile would be started again
        by its connection."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        deadline = time.monotonic() + timeout_s
        while _group_members(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_members(self.process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.returncode


def _group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def _post_json(url: str, timeout_s: float = 60) -> dict:
    request = urllib.request.Request(url, data=b"{}", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        body = response.read()
    return json.loads(body) if body else {}
