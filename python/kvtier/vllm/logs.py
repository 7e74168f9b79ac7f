"""kvtier's log lines inside vLLM's processes, written by vLLM's own handler.

The package logs to ``kvtier.vllm`` and the Rust core to ``kvtier_core.*`` (through pyo3-log); neither
is under vLLM's ``vllm`` logger, so in an engine neither had a handler: Python's last resort printed
the warnings bare (no time, no process, no level) and dropped the info lines, and an outage's start
and end could not be timed from the engine's log. ``follow_vllm_logging`` runs where the spec is built
(vLLM has configured its process's logging by then) and hands kvtier's records to the handlers of
vLLM's logger, looked up at each record, as vLLM may configure them again: the lines get vLLM's
format, stream and level. With ``VLLM_CONFIGURE_LOGGING=0`` vLLM installs no handler, and kvtier's
loggers are left to the user's logging configuration, as vLLM's are.
"""

from __future__ import annotations

import logging

#: The roots of kvtier's logger names in an engine: the Python package's and the Rust core's.
KVTIER_LOGGERS = ("kvtier", "kvtier_core")
VLLM_LOGGER = "vllm"


class _ToVllmHandlers(logging.Handler):
    """Hands each record to the handlers of vLLM's logger of the moment (the root logger's, or
    Python's last resort, once vLLM's have gone), at their levels."""

    def emit(self, record: logging.LogRecord) -> None:
        vllm_logger = logging.getLogger(VLLM_LOGGER)
        target = vllm_logger if vllm_logger.handlers else logging.getLogger()
        if record.levelno < target.getEffectiveLevel():
            return
        handlers = target.handlers or ([logging.lastResort] if logging.lastResort else [])
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def follow_vllm_logging() -> bool:
    """Routes kvtier's loggers to vLLM's handlers, where vLLM configured them and nobody gave kvtier's
    loggers handlers of their own (once per process); whether it did."""
    vllm_logger = logging.getLogger(VLLM_LOGGER)
    if not vllm_logger.handlers:
        return False
    followed = False
    for name in KVTIER_LOGGERS:
        logger = logging.getLogger(name)
        if logger.handlers:
            continue  # the user's configuration, or an earlier call's
        logger.addHandler(_ToVllmHandlers())
        if logger.level == logging.NOTSET:
            # vLLM's level (INFO by default), not lower: the Rust core's debug records would each
            # cross into Python.
            logger.setLevel(vllm_logger.getEffectiveLevel())
        logger.propagate = False  # as vLLM's own: a handler on the root logger would print it twice
        followed = True
    return followed
