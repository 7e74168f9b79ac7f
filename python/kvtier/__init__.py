"""kvtier: a tiered KV-cache store for LLM prefix caching (DRAM, local NVMe, shared filesystems).

``kvtier.Store`` is the store (see docs/python-api.md); ``kvtier.Service`` the host service that shares
stores and their DRAM pools with every engine on a host, and ``kvtier.ServiceClient`` an engine's
connection to it (see docs/architecture.md); ``kvtier.options()`` lists the options of
``Store.open`` with their kinds, defaults and descriptions (the option tables of the docs are generated
from it); ``kvtier.tenant_id(cache_salt)`` names a tenant of the DRAM pool (docs/tenants.md);
``kvtier.vllm`` holds the vLLM OffloadingConnector spec; ``kvtier.bench`` the benchmarks;
``kvtier.cli`` the ``kvtier`` command.
"""

from kvtier._core import Service, ServiceClient, Store, __version__, options, tenant_id
from kvtier.errors import (
    CapacityError,
    ClosedError,
    ConfigError,
    FormatError,
    IoError,
    KvtierError,
    LockedError,
    NamespaceError,
    ServiceError,
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
    "Service",
    "ServiceClient",
    "ServiceError",
    "Store",
    "TimeoutError",
    "__version__",
    "options",
    "tenant_id",
]
