"""kvtier's log lines in vLLM's processes go through vLLM's handler (kvtier.vllm.logs): with a time, the
process and the level, info lines included, for the package's and the Rust core's loggers; with
VLLM_CONFIGURE_LOGGING=0 they are left to the user's logging configuration."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

# Logging configured as vLLM's processes do it (vllm.logger.configure_logging, before the connector
# builds the spec), then kvtier's loggers, the Rust core's among them, as in an engine.
SCRIPT = """
import logging
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
from kvtier.vllm.logs import follow_vllm_logging

configure_logging(LoggingConfig())
print("followed", follow_vllm_logging(), flush=True)
logging.getLogger("kvtier.vllm").warning("kvtier: reattached to the host service; serving its hits again")
logging.getLogger("kvtier.vllm").info("kvtier: an info line")
logging.getLogger("kvtier.vllm").debug("kvtier: a debug line")
logging.getLogger("kvtier_core.tiers.nvme").warning("kvtier: a line of the Rust core")
"""

# vLLM's format: "(process pid=N) LEVEL MM-DD HH:MM:SS [file:line] message"
VLLM_LINE = re.compile(r"^\(\S+ pid=\d+\) (INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+\] kvtier: (.*)$")


def run_script(**env: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**os.environ, "VLLM_LOGGING_COLOR": "0", "VLLM_LOGGING_LEVEL": "INFO", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return (result.stdout + result.stderr).splitlines()


def test_kvtier_lines_carry_vllms_time_process_and_level() -> None:
    lines = run_script()
    assert "followed True" in lines
    ours = {match.group(2): match.group(1) for line in lines if (match := VLLM_LINE.match(line))}
    assert ours == {
        "reattached to the host service; serving its hits again": "WARNING",
        "an info line": "INFO",
        "a line of the Rust core": "WARNING",
    }, lines


def test_with_vllms_logging_off_kvtiers_loggers_are_left_alone() -> None:
    lines = run_script(VLLM_CONFIGURE_LOGGING="0")
    assert "followed False" in lines
    assert not any(VLLM_LINE.match(line) for line in lines), lines
    # Python's last resort, as before: warnings bare, info dropped.
    assert "kvtier: reattached to the host service; serving its hits again" in lines
    assert "kvtier: an info line" not in lines
