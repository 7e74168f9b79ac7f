"""The cores a worker's job thread copies on (``ServiceCopy``): beside the engine's compute cores,
on the cores vLLM's own binding keeps back, never on another engine's share of a partitioned host."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def affinity() -> set[int]:
    """The cores the calling thread may run on (empty where the platform cannot say)."""
    try:
        return set(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        return set()


def usable_cores() -> set[int]:
    """The host's cores this process may be given (``kvtier.service.usable_cores``)."""
    from kvtier.service import usable_cores as host_usable_cores

    return host_usable_cores()


def spare_cores(compute: set[int], usable: set[int], binding: str) -> set[int]:
    """The cores a rank's job thread copies stores on, beside its engine's ``compute`` cores.

    Under vLLM's automatic binding (``VLLM_CPU_OMP_THREADS_BIND`` unset or ``auto``) the cores it
    leaves out are kept back for the engine's other processes (``VLLM_CPU_NUM_OF_RESERVED_CPU``): spare.
    A binding the user gave (``0-7``, ``8-15|16-23``) partitions the host, typically one engine per
    share, and the cores outside this engine's share are another engine's: none is spare then, and
    copies stay on the engine's own cores (held back during its prefill steps)."""
    if not compute or binding.strip().lower() not in ("", "auto"):
        return set()
    return usable - compute


def set_affinity(cores: set[int]) -> None:
    """Binds the calling thread (only it: pid 0 is the thread on Linux). An empty set: no change."""
    if not cores:
        return
    try:
        os.sched_setaffinity(0, cores)
    except (OSError, AttributeError) as error:
        logger.debug("kvtier: binding the worker's job thread to cores %s failed: %s", sorted(cores), error)
