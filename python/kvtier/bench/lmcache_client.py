"""The benchmark's side of the LMCache measurement: finds an interpreter with LMCache, keeps one
`lmcache_runner.py --serve` subprocess for the whole run, and sends it one JSON request per case.

LMCache lives in its own virtualenv (`scripts/install_lmcache.sh` makes `.venv-lmcache`), because it
pins torch and numpy versions that the main environment should not be forced to take.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import deque

RUNNER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lmcache_runner.py")
READY_TIMEOUT_S = 180.0


class LMCacheUnavailable(RuntimeError):
    """LMCache cannot be measured here; the message says why and how to fix it."""


def repository_root() -> str | None:
    """The checkout this package was imported from (python/kvtier/bench/ -> root), if it is one."""
    candidate = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    if os.path.exists(os.path.join(candidate, "pyproject.toml")):
        return candidate
    return None


def default_lmcache_python() -> str | None:
    """`.venv-lmcache/bin/python` in the current directory or the repository root, if it exists;
    else the running interpreter when it can import lmcache."""
    roots = [os.getcwd()]
    root = repository_root()
    if root:
        roots.append(root)
    for base in roots:
        candidate = os.path.join(base, ".venv-lmcache", "bin", "python")
        if os.path.exists(candidate):
            return candidate
    try:
        import importlib.util

        if importlib.util.find_spec("lmcache") is not None:
            return sys.executable
    except (ImportError, ValueError):
        pass
    return None


class LMCacheSession:
    """One long-lived runner subprocess; `measure(request)` returns its result dict."""

    def __init__(self, python_path: str):
        if not os.path.exists(python_path):
            raise LMCacheUnavailable(
                f"LMCache interpreter {python_path} does not exist: run scripts/install_lmcache.sh "
                "or pass --lmcache-python PATH (or --no-lmcache)"
            )
        self.python_path = python_path
        self.stderr_tail: deque[str] = deque(maxlen=60)
        env = dict(os.environ)
        env.setdefault("PYTHONHASHSEED", "0")
        env.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
        env.pop("PYTHONPATH", None)
        self.process = subprocess.Popen(
            [python_path, RUNNER_PATH, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
        )
        self._stderr_thread = threading.Thread(target=self._drain_stderr, daemon=True)
        self._stderr_thread.start()
        try:
            hello = self._read_answer(READY_TIMEOUT_S)
        except LMCacheUnavailable:  # it exited: the message below says why that usually is
            hello = None
        if not hello or not hello.get("ready"):
            self.close()
            raise LMCacheUnavailable(
                f"LMCache runner under {python_path} did not start (is lmcache installed in it? "
                f"run scripts/install_lmcache.sh). Its last output:\n{self.log_tail()}"
            )
        self.lmcache_version = hello.get("lmcache_version")
        self.torch_version = hello.get("torch_version")

    def _drain_stderr(self) -> None:
        assert self.process.stderr is not None  # Popen(stderr=PIPE)
        for line in self.process.stderr:
            self.stderr_tail.append(line.rstrip("\n"))

    def log_tail(self) -> str:
        return "\n".join(self.stderr_tail)

    def _read_answer(self, timeout_s: float) -> dict | None:
        """The runner's next JSON line; None when none came within ``timeout_s``. Raises
        LMCacheUnavailable when the runner closed its output: it exited (crashed) without answering."""
        answer: list[str] = []

        def read() -> None:
            assert self.process.stdout is not None  # Popen(stdout=PIPE)
            answer.append(self.process.stdout.readline())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if reader.is_alive() or not answer:
            return None
        if not answer[0]:
            try:
                code: int | str = self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = "still running, output closed"
            raise LMCacheUnavailable(
                f"LMCache runner exited ({code}) without answering; its last output:\n{self.log_tail()}"
            )
        return json.loads(answer[0])

    def measure(self, request: dict, timeout_s: float) -> dict:
        if self.process.poll() is not None:
            raise LMCacheUnavailable(f"LMCache runner exited ({self.process.returncode}):\n{self.log_tail()}")
        assert self.process.stdin is not None  # Popen(stdin=PIPE)
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self._read_answer(timeout_s)
        if answer is None:
            self.close()
            raise LMCacheUnavailable(
                f"LMCache runner gave no answer within {timeout_s:.0f} s (a silent hang is what LocalDiskBackend "
                f"does when O_DIRECT writes fail); its last output:\n{self.log_tail()}"
            )
        if not answer.get("ok"):
            raise RuntimeError(f"LMCache measurement failed: {answer.get('error')}\n{self.log_tail()}")
        result = answer["result"]
        degraded = [line for line in self.stderr_tail if "degraded mode" in line]
        if degraded:
            result["log_warnings"] = degraded
        return result

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None  # Popen(stdin=PIPE)
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.flush()
                self.process.wait(timeout=30)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
