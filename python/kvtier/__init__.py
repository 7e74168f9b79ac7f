"""kvtier: a tiered KV-cache store for LLM prefix caching (DRAM, local NVMe, shared filesystems).

``kvtier.Store`` is the store (see docs/python-api.md); ``kvtier.options()`` lists the options of
``Store.open`` with their kinds, defaults and descriptions (the option tables of the docs are generated
from it); ``kvtier.vllm`` holds the vLLM OffloadingConnector spec; ``kvtier.bench`` the benchmarks;
``kvtier.cli`` the ``kvtier`` command.
"""

from kvtier._core import Store, __version__, options
from kvtier.errors import (
    CapacityError,
    ClosedError,
    ConfigError,
    FormatError,
    IoError,
    KvtierError,
    LockedError,
    NamespaceError,
    TimeoutError,
)

KEY_BYTES = 32

__all__ = [
    "KEY_BYTES",
    "CapacityError",
    "ClosedError",
    "ConfigError",
    "FormatError",
    "IoError",
    "KvtierError",
    "LockedError",
    "NamespaceError",
    "Store",
    "TimeoutError",
    "__version__",
    "options",
]
