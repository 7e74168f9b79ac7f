"""Options of the vLLM integration: defaults, parsing and the integration's constants."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.service import ENGINE_JOB_TIMEOUT_DEFAULT_MS

SPEC_NAME = "KvtierOffloadingSpec"
SPEC_MODULE_PATH = "kvtier.vllm"
NAMESPACE_FORMAT_VERSION = 1

# Keys of kv_connector_extra_config that vLLM's OffloadingConnector itself reads.
VLLM_OFFLOADING_OPTION_NAMES = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "blocks_per_chunk",
        "block_size",
        "canonical_layout",
        "offload_prompt_only",
        "self_describing_kv_events",
        # vLLM 0.33: bytes a step may load synchronously (expedited loads).
        "sync_load_budget_bytes",
    }
)

INTEGRATION_OPTION_DEFAULTS: dict[str, Any] = {
    # Longest one call of a worker's transfer to the service may block its job thread (the socket's
    # timeout); what vLLM waits on is bounded by service_timeout_ms instead (below).
    "job_timeout_ms": ENGINE_JOB_TIMEOUT_DEFAULT_MS,
    # Extra string mixed into the namespace (for example a deployment name); "" = none.
    "namespace_salt": "",
    # Serve through the host service (one per host and path, shared by every engine; started on
    # demand). False: the store lives in the engine's own process, which needs vLLM's one-process
    # layout (VLLM_ENABLE_V1_MULTIPROCESSING=0, distributed_executor_backend="uni", TP=1).
    "host_service": True,
    # The service's Unix socket; "" = derived from `path` (kvtier.service.default_socket_path).
    "service_socket": "",
    # Where the service puts its shared-memory DRAM pools.
    "pool_dir": "/dev/shm",
    # For a service this engine starts: a model's pool is freed after this many seconds with no
    # engine attached (an engine restart within it still finds its blocks in DRAM), and the service
    # exits once it holds none.
    "service_idle_timeout_s": 300,
    # For a service this engine starts: the most DRAM the pools of all models on the host take
    # together; 0 = no host cap (each model's pool is dram_bytes).
    "host_dram_bytes": 0,
    # The deadline of what the engine waits on: a scheduler-side call (lookup, pin, prefetch) waits
    # this long before it counts as a miss and the service steps aside until it answers again; a
    # transfer that copies nothing this long is given up (a load is recomputed, a fenced store
    # dropped); a request waits in HIT_PENDING at most this long.
    "service_timeout_ms": 2_000,
    # Hold store copies while the engine runs a forward pass with prompt tokens in it (they compete
    # with prefill for the same cores and memory bandwidth); they run between steps, in decode steps
    # and when the engine idles. Needs kv_connector="KvtierConnector".
    "defer_stores": True,
    # Most blocks a worker holds back that way; a store job that would exceed it is dropped (counted).
    "deferred_store_max_blocks": 4096,
    # A lookup that finds a block on NVMe or in the shared tier has the service read it into the DRAM
    # pool in the background and answers HIT_PENDING until it is there: the request waits without
    # holding up the engine's step, and its load is then a DRAM copy.
    "prefetch": True,
    # Which hits are loaded: "auto" (those whose load is expected to beat recomputing them, judged
    # from what the tiers and the engine deliver now), "always" or "never" (kvtier.vllm.costs).
    "load_policy": "auto",
    # Under "auto", the longest a request waits for its load, as a multiple of what recomputing that
    # prefix would take it now, after the prefill the engine runs for its other requests (0: no cap).
    # The engine's other requests make a load worth more than its own time (a recompute delays them
    # all); this bounds what one request pays for them.
    "load_wait_max_ratio": 2.0,
    # Which computed blocks are stored: "all", or "second_sight" (a block is stored the second time
    # this engine computes it, so a prompt seen once costs no store).
    "admission": "all",
    # How many block keys "second_sight" remembers (least recently seen forgotten first).
    "admission_memory_blocks": 1 << 18,
    # This engine's name in the service's per-engine counters (kvtier_engine_* metrics); "" = vLLM's
    # engine_id (kv_transfer_config.engine_id: random per start unless set).
    "engine_label": "",
}

ADMISSION_POLICIES = ("all", "second_sight")
LOAD_POLICIES = ("auto", "always", "never")

# Prefix-hash algorithms whose block hashes are the same in every process.
STABLE_HASH_ALGOS = frozenset({"sha256", "sha256_cbor"})
SEEDED_HASH_ALGOS = frozenset({"xxhash", "xxhash_cbor"})


class KvtierVllmConfigError(ValueError):
    """The vLLM configuration cannot be served by kvtier; the message says what to change."""


# Labels of vLLM's ``vllm:kv_offload_config_info`` series (vLLM 0.33+) that kvtier fills: static facts
# an operator needs to tell which store an engine uses. Never a credential or a key file's contents.
CONFIG_INFO_KEYS = (
    "kvtier_version",
    "kvtier_store_path",
    "kvtier_host_service",
    "kvtier_dram_bytes",
    "kvtier_nvme_bytes",
    "kvtier_shared_tier",
)


def _checked_policies(option: Callable[[str], Any]) -> dict[str, Any]:
    """The admission and load-or-recompute options, checked (``option``: a name's value or default)."""
    admission = str(option("admission"))
    if admission not in ADMISSION_POLICIES:
        raise KvtierVllmConfigError(f'"admission" must be one of {", ".join(ADMISSION_POLICIES)}, not {admission!r}')
    load_policy = str(option("load_policy"))
    if load_policy not in LOAD_POLICIES:
        raise KvtierVllmConfigError(f'"load_policy" must be one of {", ".join(LOAD_POLICIES)}, not {load_policy!r}')
    load_wait_max_ratio = float(option("load_wait_max_ratio"))
    if not (load_wait_max_ratio == 0.0 or 1.0 <= load_wait_max_ratio < math.inf):
        raise KvtierVllmConfigError(
            '"load_wait_max_ratio" must be 0 (no cap) or a ratio >= 1 (a load may take this many times '
            f"the prefix's recompute), not {load_wait_max_ratio!r}"
        )
    return {"admission": admission, "load_policy": load_policy, "load_wait_max_ratio": load_wait_max_ratio}


@dataclass(frozen=True)
class KvtierOptions:
    path: str
    store_options: dict[str, Any]
    job_timeout_ms: int
    namespace_salt: str
    host_service: bool = True
    service_socket: str = ""
    pool_dir: str = "/dev/shm"
    service_idle_timeout_s: float = 300.0
    host_dram_bytes: int = 0
    service_timeout_ms: int = 2_000
    defer_stores: bool = True
    deferred_store_max_blocks: int = 4096
    prefetch: bool = True
    admission: str = "all"
    admission_memory_blocks: int = 1 << 18
    load_policy: str = "auto"
    load_wait_max_ratio: float = float(INTEGRATION_OPTION_DEFAULTS["load_wait_max_ratio"])
    engine_label: str = ""

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any]) -> KvtierOptions:
        path = extra_config.get("path")
        if not path:
            raise KvtierVllmConfigError(
                'kv_connector_extra_config needs "path": the kvtier store directory (for example a local '
                "NVMe mount), or a list of directories to stripe over"
            )
        store_options = {
            name: value
            for name, value in extra_config.items()
            if name != "path" and name not in VLLM_OFFLOADING_OPTION_NAMES and name not in INTEGRATION_OPTION_DEFAULTS
        }
        # An engine must start even when the disk has no room for its NVMe tier (it then runs on DRAM
        # and the remote tiers, with a warning), as vLLM alone would.
        store_options.setdefault("nvme_without_space", "dram_only")
        for reserved in ("namespace", "object_bytes"):
            if reserved in store_options:
                raise KvtierVllmConfigError(
                    f'kv_connector_extra_config must not set "{reserved}": kvtier.vllm derives it from the '
                    'vLLM configuration (use "namespace_salt" to separate deployments)'
                )
        job_timeout_ms = int(extra_config.get("job_timeout_ms", INTEGRATION_OPTION_DEFAULTS["job_timeout_ms"]))
        if job_timeout_ms <= 0:
            raise KvtierVllmConfigError('"job_timeout_ms" must be a positive number of milliseconds')
        option = lambda name: extra_config.get(name, INTEGRATION_OPTION_DEFAULTS[name])  # noqa: E731
        service_timeout_ms = int(option("service_timeout_ms"))
        if service_timeout_ms <= 0:
            raise KvtierVllmConfigError('"service_timeout_ms" must be a positive number of milliseconds')
        policies = _checked_policies(option)
        admission_memory_blocks = int(option("admission_memory_blocks"))
        if admission_memory_blocks <= 0:
            raise KvtierVllmConfigError('"admission_memory_blocks" must be a positive number of blocks')
        host_dram_bytes = int(option("host_dram_bytes"))
        if host_dram_bytes < 0:
            raise KvtierVllmConfigError('"host_dram_bytes" must be >= 0 (0: no host cap)')
        service_idle_timeout_s = float(option("service_idle_timeout_s"))
        if service_idle_timeout_s <= 0:
            raise KvtierVllmConfigError('"service_idle_timeout_s" must be a positive number of seconds')
        deferred_store_max_blocks = int(option("deferred_store_max_blocks"))
        if deferred_store_max_blocks < 0:
            raise KvtierVllmConfigError('"deferred_store_max_blocks" must be >= 0 (0: drop every store held back)')
        return cls(
            path=path,
            store_options=store_options,
            job_timeout_ms=job_timeout_ms,
            namespace_salt=str(option("namespace_salt")),
            host_service=bool(option("host_service")),
            service_socket=str(option("service_socket")),
            pool_dir=str(option("pool_dir")),
            service_idle_timeout_s=service_idle_timeout_s,
            host_dram_bytes=host_dram_bytes,
            service_timeout_ms=service_timeout_ms,
            defer_stores=bool(option("defer_stores")),
            deferred_store_max_blocks=deferred_store_max_blocks,
            prefetch=bool(option("prefetch")),
            admission_memory_blocks=admission_memory_blocks,
            **policies,
            engine_label=str(option("engine_label")),
        )

    def service_options(self) -> dict[str, Any]:
        """What a service this engine starts is started with: the store options, and the host cap."""
        if self.host_dram_bytes:
            return {**self.store_options, "host_dram_bytes": self.host_dram_bytes}
        return dict(self.store_options)

    def socket_path(self) -> Path:
        from kvtier.service import default_socket_path

        return Path(self.service_socket) if self.service_socket else default_socket_path(self.path)

    def config_info(self) -> dict[str, str | int | bool]:
        """The values of ``CONFIG_INFO_KEYS`` (store sizes as configured, else the store's defaults)."""
        from kvtier import __version__
        from kvtier import options as option_table

        defaults = {row["name"]: row["default"] for row in option_table()}

        def size(name: str) -> int | str:
            value = self.store_options.get(name, defaults.get(name))
            try:
                return int(value or 0)
            except (TypeError, ValueError):
                return str(value)

        paths = self.path if isinstance(self.path, (list, tuple)) else [self.path]
        info: dict[str, str | int | bool] = {
            "kvtier_version": __version__,
            "kvtier_store_path": os.pathsep.join(os.fspath(p) for p in paths),
            "kvtier_host_service": self.host_service,
            "kvtier_dram_bytes": size("dram_bytes"),
            "kvtier_nvme_bytes": size("nvme_bytes"),
            "kvtier_shared_tier": bool(self.store_options.get("shared_root")),
        }
        assert tuple(info) == CONFIG_INFO_KEYS
        return info

    @property
    def registry_path(self) -> str:
        paths = self.path if isinstance(self.path, (list, tuple)) else [self.path]
        return os.pathsep.join(os.path.realpath(os.fspath(p)) for p in paths)
