"""`kvtier bench ttft`'s engine, as its phases (``engine_phase``) use it: one in-process vLLM engine
with the benchmark's measurement helpers (``Engine``), kvtier's ``kv_transfer_config`` for the plan
(``kvtier_transfer``), and the engine's store as the benchmark reads it, through the host service
the engine started (``ServiceView``, ``settle``, ``kvtier_measure``)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from kvtier.bench import workload
from kvtier.bench.ttft.plan import BenchError

RESET_ATTEMPTS = 50
PROGRESS_PREFIX = "[ttft] "
NUDGE_PROMPT = [5, 6, 7]  # shorter than a block: no kvtier lookup or store, drives engine steps


def progress(message: str) -> None:
    print(PROGRESS_PREFIX + message, flush=True)


class Engine:
    """One in-process vLLM engine and the measurement helpers of the benchmark."""

    def __init__(self, plan: dict, kv_transfer: dict | None, **engine_options: Any):
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig

        started = time.monotonic()
        self.llm = LLM(
            model=plan["model"],
            dtype=plan["dtype"],
            max_model_len=plan["max_model_len"],
            enable_prefix_caching=True,
            enforce_eager=True,
            distributed_executor_backend="uni",
            seed=0,
            kv_transfer_config=KVTransferConfig(**kv_transfer) if kv_transfer else None,
            block_size=plan["block_tokens"],
            **engine_options,
        )
        self.start_s = time.monotonic() - started
        self.params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1, seed=0)
        block_size = self.llm.llm_engine.vllm_config.cache_config.block_size
        if block_size != plan["block_tokens"]:
            raise BenchError(f"engine block size is {block_size} tokens, the benchmark assumes {plan['block_tokens']}")
        self.hash_algo = getattr(self.llm.llm_engine.vllm_config.cache_config, "prefix_caching_hash_algo", "sha256")
        self.block_tokens = block_size
        self.generate(NUDGE_PROMPT)  # first-request warm-up

    def generate(self, tokens: list[int]):
        from vllm.inputs import TokensPrompt

        (output,) = self.llm.generate([TokensPrompt(prompt_token_ids=tokens)], self.params, use_tqdm=False)
        return output

    def measure(self, tokens: list[int], expected_cached_tokens: int) -> dict:
        started = time.perf_counter()
        output = self.generate(tokens)
        ttft_s = time.perf_counter() - started
        completion = output.outputs[0]
        token_id = int(completion.token_ids[0])
        logprob = float(completion.logprobs[0][token_id].logprob) if completion.logprobs else None
        record = {
            "ttft_s": ttft_s,
            "prompt_tokens": len(tokens),
            "cached_tokens": int(output.num_cached_tokens or 0),
            "expected_cached_tokens": expected_cached_tokens,
            "token_id": token_id,
            "logprob": logprob,
        }
        engine_ttft = getattr(getattr(output, "metrics", None), "first_token_latency", None)
        if engine_ttft:
            record["engine_ttft_s"] = float(engine_ttft)
        return record

    def reset_prefix_cache(self) -> None:
        # vLLM refuses while offload stores still hold blocks; short requests drive the steps that finish them.
        for _ in range(RESET_ATTEMPTS):
            if self.llm.reset_prefix_cache():
                return
            self.generate(NUDGE_PROMPT)
        raise BenchError(f"vLLM did not reset its prefix cache after {RESET_ATTEMPTS} attempts")

    def block_keys(self, tokens: list[int], full_blocks: int) -> list[bytes]:
        """kvtier keys of the first full blocks of a prompt (vLLM's chained block hashes)."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.kv_offload.base import make_offload_key

        import kvtier.vllm as kvtier_vllm

        hash_fn = get_hash_fn_by_name(self.hash_algo)
        parent = None
        keys = []
        for index in range(full_blocks):
            block = tokens[index * self.block_tokens : (index + 1) * self.block_tokens]
            parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, block, None)
            keys.append(kvtier_vllm.kvtier_key(make_offload_key(bytes(parent), 0)))
        return keys


def kvtier_transfer(
    plan: dict,
    store_dir: str | None = None,
    shared_root: str | None = None,
    object_tier: bool = False,
    load_policy: str = "always",
    bucket_subprefix: str = "",
    **integration: Any,
) -> dict:
    """kvtier's kv_transfer_config for the plan's store (or ``store_dir``), with the shared tier on
    ``shared_root`` when given, or the object tier on the plan's bucket with ``object_tier`` (under
    ``bucket_subprefix`` of the run's prefix when given: a row's blocks of its own).

    ``load_policy`` "always" by default: a row named for a tier's hit measures what loading it costs,
    so kvtier must not decide to recompute it (docs/vllm.md, "Load or recompute"); the slow-link rows
    and node A (whose steps train the prefill model) use "auto". ``integration``: more of
    kvtier.vllm's integration or store options (``service_timeout_ms``, ``encryption_key_file``)."""
    from kvtier.vllm import kv_transfer_config

    # The default publish queue: a prefill hands every block of the prompt to the publisher at once,
    # and what does not fit waits in its backlog (a dropped publish fails the phase).
    remote: dict[str, Any] = {}
    if shared_root:
        remote = {"shared_root": shared_root}
        if plan["shared"].get("file_bytes"):
            remote["shared_file_bytes"] = plan["shared"]["file_bytes"]
    if object_tier:
        bucket_url = plan["object"]["bucket_url"] + (f"/{bucket_subprefix}" if bucket_subprefix else "")
        remote = {"bucket_url": bucket_url, "bucket_endpoint": plan["object"]["bucket_endpoint"]}
        if plan["object"].get("segment_bytes"):
            remote["bucket_segment_bytes"] = plan["object"]["segment_bytes"]
    return kv_transfer_config(
        store_dir or plan["store_dir"],
        dram_bytes=plan["dram_bytes"],
        nvme_bytes=plan["nvme_bytes"],
        region_bytes=plan["region_bytes"],
        load_policy=load_policy,
        **integration,
        **remote,
    )


class ServiceView:
    """The engine's store as the benchmark reads it, through the host service the engine started:
    the counters (summed over the service's namespaces: there is one), where blocks are, flush. At
    the end of a phase the service is stopped, so the next phase's engine finds the blocks on NVMe
    only, as after a restart."""

    def __init__(self, connection: Any):
        self._connection = connection
        self._socket = connection.socket_path

    def stats(self) -> dict[str, Any]:
        from kvtier import service as kvtier_service

        return kvtier_service.service_stats(self._socket)

    def locate_many(self, keys: list[bytes]) -> list[str | None]:
        return self._connection.locate_many(keys)

    def flush(self) -> None:
        self._connection.flush()

    def close(self) -> None:
        self.flush()
        still_running = stop_services_of_this_process()
        if still_running:
            raise BenchError(f"the kvtier service on {still_running[0]} did not stop")


def stop_services_of_this_process() -> list[Path]:
    """Closes this process's service connections (no reconnecting: it would start the service
    again) and stops the services they attached to; returns the sockets whose service did not stop.
    A failed phase calls it too: a detached service would outlive the benchmark and keep the store's
    (already removed) NVMe files open."""
    from kvtier import service as kvtier_service
    from kvtier.vllm._testing import service_connections

    connections = service_connections()
    sockets = {connection.socket_path for connection in connections}
    for connection in connections:
        connection.close()
    still_running = []
    for socket in sockets:
        stopped = False
        with contextlib.suppress(Exception):
            stopped = kvtier_service.stop_service(socket)
        if not stopped:
            still_running.append(socket)
    return still_running


def store_of_engine() -> ServiceView:
    from kvtier.vllm._testing import service_connections

    connections = service_connections()
    if not connections:
        raise BenchError("the engine opened no connection to a kvtier host service")
    return ServiceView(connections[0])


STORE_SETTLE_TIMEOUT_S = 600


def settle(engine: Engine, store) -> None:
    """Until everything stored so far is in the store: vLLM hands a step's stores to the worker in
    its next step (the nudges), the worker copies held-back stores while the engine idles (the
    wait), and the flush waits for the service's NVMe writes."""
    from kvtier.vllm._testing import wait_for_stores

    for _ in range(2):
        engine.generate(NUDGE_PROMPT)
    if not wait_for_stores(STORE_SETTLE_TIMEOUT_S):
        raise BenchError(f"the kvtier worker still held stores after {STORE_SETTLE_TIMEOUT_S} s of idling")
    store.flush()


def tier_counts(store, keys: list[bytes]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for tier in store.locate_many(keys):
        counts[str(tier)] = counts.get(str(tier), 0) + 1
    return counts


def kvtier_measure(
    engine: Engine,
    store,
    tokens: list[int],
    hit: int,
    tier: str,
    drop_cache: bool,
    all_served: bool = True,
) -> dict:
    """Measures a request whose first ``hit`` tokens are on ``tier`` (as ``locate_many`` names it:
    ``dram``, ``nvme``, ``shared``, ``bucket``) and must all be served from it, counted in its
    ``<tier>_hits`` (unless not ``all_served``: kvtier may choose to recompute them)."""
    keys = engine.block_keys(tokens, hit // engine.block_tokens)
    engine.reset_prefix_cache()
    tiers_before = tier_counts(store, keys)
    if keys and tiers_before.get(tier, 0) != len(keys):
        raise BenchError(f"before timing, the {len(keys)} stored blocks are in tiers {tiers_before}, not all in {tier}")
    dropped = None
    if drop_cache:
        dropped = workload.drop_page_cache()
        engine.generate(NUDGE_PROMPT)  # fault the engine's own code back in; no kvtier I/O
    before = store.stats()
    record = engine.measure(tokens, hit)
    after = store.stats()
    record["kvtier"] = {
        "tiers_before": tiers_before,
        "dram_hits": after["dram_hits"] - before["dram_hits"],
        "nvme_hits": after["nvme_hits"] - before["nvme_hits"],
        "shared_hits": after.get("shared_hits", 0) - before.get("shared_hits", 0),
        "shared_misses": after.get("shared_misses", 0) - before.get("shared_misses", 0),
        "bucket_hits": after.get("bucket_hits", 0) - before.get("bucket_hits", 0),
        "bucket_misses": after.get("bucket_misses", 0) - before.get("bucket_misses", 0),
        "bucket_get_requests": after.get("bucket_get_requests", 0) - before.get("bucket_get_requests", 0),
        "bucket_put_requests": after.get("bucket_put_requests", 0) - before.get("bucket_put_requests", 0),
        "misses": after["misses"] - before["misses"],
        "checksum_failures": after["checksum_failures"] - before["checksum_failures"],
    }
    served_counter = f"{tier}_hits"
    served = record["kvtier"][served_counter]
    if served != len(keys) and all_served:
        record["problem"] = f"{served} of {len(keys)} blocks served from {tier} ({served_counter})"
    if dropped is not None:
        record["page_cache_dropped"] = dropped
    return record
