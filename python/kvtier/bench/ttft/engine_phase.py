"""`kvtier bench ttft`'s engine phases: each runs in a child process (one engine, one process),
started by the parent as ``python -m kvtier.bench.ttft --run-phase SPEC`` (see ``run_phase``); it
writes its records as JSON lines to the spec's ``result_path``."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.bench import workload
from kvtier.bench.ttft.engine import (
    NUDGE_PROMPT,
    Engine,
    kvtier_measure,
    kvtier_transfer,
    progress,
    settle,
    stop_services_of_this_process,
    store_of_engine,
    tier_counts,
)
from kvtier.bench.ttft.plan import BenchError, hit_tokens
from kvtier.bench.ttft.prompts import hit_rate_base, hit_rate_prompt, length_prompt

LMCACHE_HASH_SEED = "0"  # PYTHONHASHSEED of the LMCache engine process (stable chunk keys)
LMCACHE_STORE_WAIT_S = 600
SHARED_VISIBLE_WAIT_S = 30  # longest node B waits for node A's blocks in its shared index


def phase_baseline(plan: dict, emit) -> None:
    """Recompute and vLLM prefix-cache hits for one repeat (``plan["item"]``; every repeat if None).

    One engine process per repeat, run just before that repeat's kvtier phases, so that a slow
    spell of this shared machine does not land on the baseline of every repeat at once."""
    engine = Engine(plan, None)
    emit("engine", {"start_s": engine.start_s})
    for length in plan["lengths"]:
        for repeat in repeats_of(plan):
            prompt = length_prompt(plan, length, repeat)
            engine.reset_prefix_cache()
            emit("measure", {"experiment": 1, "config": "recompute", "length_tokens": length, "repeat": repeat,
                             "prompt_id": f"p:{length}:{repeat}", **engine.measure(prompt, 0)})  # fmt: skip
            emit("measure", {"experiment": 1, "config": "vllm_prefix", "length_tokens": length, "repeat": repeat,
                             "prompt_id": f"p:{length}:{repeat}", **engine.measure(prompt, length)})  # fmt: skip
    length = plan["hit_rate_length"]
    for repeat in repeats_of(plan):
        if not plan["hit_rates"]:
            break
        base_prompt = length_prompt(plan, length, repeat)
        if length in plan["lengths"]:
            engine.generate(base_prompt)  # usually still in vLLM's prefix cache from experiment 1
        else:
            engine.reset_prefix_cache()
            warm = engine.measure(base_prompt, 0)
            emit("measure", {"experiment": 2, "config": "recompute", "length_tokens": length, "hit_rate": None,
                             "repeat": repeat, "prompt_id": f"p:{length}:{repeat}", **warm})  # fmt: skip
        for rate in plan["hit_rates"]:
            hit = hit_tokens(length, rate, plan["block_tokens"])
            # The previous rate's new tokens may have pushed the base's tail out of vLLM's cache
            # (least recently used first); this puts it back (a cheap hit when nothing was evicted).
            engine.generate(base_prompt)
            prompt = hit_rate_prompt(plan, base_prompt[:hit], rate, repeat, "vllm")
            emit("measure", {"experiment": 2, "config": "vllm_prefix", "length_tokens": length, "hit_rate": rate,
                             "repeat": repeat, **engine.measure(prompt, hit)})  # fmt: skip


def repeats_of(plan: dict) -> list[int]:
    return list(range(plan["repeats"])) if plan.get("item") is None else [plan["item"]]


def phase_kvtier_store(plan: dict, emit) -> None:
    """Stores one prompt and measures its DRAM hit (one length or one hit rate, one repeat).

    kvtier keeps blocks that were read back in DRAM ahead of blocks seen once, so each prompt gets a
    fresh engine process (an empty DRAM tier) and the tier stays the size of one prompt."""
    engine = Engine(plan, kvtier_transfer(plan))
    store = store_of_engine()
    emit("engine", {"start_s": engine.start_s, "io_engine": store.stats().get("io_engine"),
                    "direct_io": store.stats().get("direct_io")})  # fmt: skip
    kind, value, repeat = plan["item"]
    if kind == "length":
        length = value
        prompt = length_prompt(plan, length, repeat)
        engine.reset_prefix_cache()
        emit("measure", {"experiment": 1, "config": "kvtier_miss", "length_tokens": length, "repeat": repeat,
                         "prompt_id": f"p:{length}:{repeat}", **engine.measure(prompt, 0)})  # fmt: skip
        settle(engine, store)
        emit("measure", {"experiment": 1, "config": "kvtier_dram", "length_tokens": length, "repeat": repeat,
                         "prompt_id": f"p:{length}:{repeat}",
                         **kvtier_measure(engine, store, prompt, length, "dram", drop_cache=False)})  # fmt: skip
    else:
        rate = value
        base = hit_rate_base(plan, rate, repeat)
        if base:
            engine.generate([*base, 11])  # computes and stores the part that will be hits
            settle(engine, store)
        prompt = hit_rate_prompt(plan, base, rate, repeat, "dram")
        emit("measure", {"experiment": 2, "config": "kvtier_dram", "length_tokens": plan["hit_rate_length"],
                         "hit_rate": rate, "repeat": repeat,
                         **kvtier_measure(engine, store, prompt, len(base), "dram", drop_cache=False)})  # fmt: skip
    settle(engine, store)
    emit("store_stats", dict(store.stats()))
    store.close()  # the next engine process finds the blocks on NVMe only


def disk_floor(plan: dict, length_tokens: int) -> dict | None:
    """fio's best O_DIRECT read of the bytes an NVMe hit of ``length_tokens`` reads (whole slots:
    descriptor page plus value per block), from a file beside the store, right after the hit: the
    time no disk hit can beat on this disk at this moment. None (with a log line) without fio."""
    from kvtier.bench import fio

    if not plan.get("disk_floor", True) or fio.fio_path() is None:
        return None
    blocks = length_tokens // plan["block_tokens"]
    read_bytes = blocks * plan["slot_bytes"]
    path = Path(plan["store_dir"]).parent / "disk-floor.fio"
    needed_bytes = max(plan["lengths"]) // plan["block_tokens"] * plan["slot_bytes"]
    if not path.exists() or path.stat().st_size < needed_bytes:
        # Written once, so that the reads find allocated extents (a sparse file reads as zeros, fast).
        fio.run_fio_job(str(path), needed_bytes, "write", fio.FioCombo(plan["slot_bytes"], 8))
    runs = []
    # Depth 32 is kvtier's default io_depth, so fio gets at least the bytes in flight kvtier has.
    for combo in (
        fio.FioCombo(plan["slot_bytes"], 8),
        fio.FioCombo(plan["slot_bytes"], 32),
        fio.FioCombo(1 << 20, 16, jobs=4),
    ):
        try:
            runs.append(fio.run_fio_job(str(path), read_bytes, "read", combo))
        except fio.FioError as error:
            progress(f"disk floor: {error}")
    if not runs:
        return None
    best = max(runs, key=lambda run: run["gbps"])
    return {
        "ttft_s": read_bytes / (best["gbps"] * 1e9),
        "prompt_tokens": length_tokens,
        "cached_tokens": length_tokens,
        "expected_cached_tokens": length_tokens,
        "read_bytes": read_bytes,
        "fio_best": best,
    }


def phase_kvtier_nvme(plan: dict, emit) -> None:
    """NVMe hits of what the kvtier_store phases stored: a fresh engine and service over the same
    store directory, every block on NVMe only; the disk floor after each of experiment 1's hits."""
    _nvme_hits(plan, emit, "kvtier_nvme", kvtier_transfer(plan), with_disk_floor=True)


def encrypted_transfer(plan: dict) -> dict:
    """The kvtier_nvme_encrypted row's kv_transfer_config: the plan's store options on the row's own
    store directory (never the clear row's blocks), with the run's key (``encryption_key_file``)."""
    return kvtier_transfer(plan, plan["encrypted_store_dir"], encryption_key_file=plan["encryption_key_file"])


def nvme_hit_prompts(plan: dict) -> list[list[int]]:
    """Every prompt whose blocks the NVMe phase reads, as the kvtier_store phases compute them:
    experiment 1's prompts, then experiment 2's stored bases (each with one token after it)."""
    prompts = [length_prompt(plan, length, repeat) for length in plan["lengths"] for repeat in range(plan["repeats"])]
    for repeat in range(plan["repeats"]):
        for rate in plan["hit_rates"]:
            base = hit_rate_base(plan, rate, repeat)
            if base:
                prompts.append([*base, 11])
    return prompts


def phase_kvtier_nvme_encrypted_store(plan: dict, emit) -> None:
    """The storing engine of kvtier_nvme_encrypted: computes every prompt the NVMe phase reads into
    the row's own store with the run's key (every value written to NVMe encrypted), then stops its
    service, so that the timed engine finds the blocks on NVMe only."""
    engine = Engine(plan, encrypted_transfer(plan))
    store = store_of_engine()
    emit("engine", {"start_s": engine.start_s, "encryption_key_file": plan["encryption_key_file"]})
    for prompt in nvme_hit_prompts(plan):
        engine.reset_prefix_cache()
        engine.generate(prompt)
        settle(engine, store)
    emit("store_stats", dict(store.stats()))
    store.close()


def phase_kvtier_nvme_encrypted(plan: dict, emit) -> None:
    """The kvtier_nvme row on the encrypted store: every hit decrypted (no disk floor: the same bytes
    as the clear row's, whose floor is measured)."""
    _nvme_hits(plan, emit, "kvtier_nvme_encrypted", encrypted_transfer(plan), with_disk_floor=False)


def _nvme_hits(plan: dict, emit, config: str, transfer: dict, with_disk_floor: bool) -> None:
    """The NVMe phase of ``config``: one engine on ``transfer``'s store, checked to start with every
    block on NVMe (``kvtier_measure``); experiment 1's hits, then experiment 2's, page cache dropped."""
    engine = Engine(plan, transfer)
    store = store_of_engine()
    stats = store.stats()
    emit("engine", {"start_s": engine.start_s, "blocks_dram_at_start": stats.get("blocks_dram"),
                    "blocks_nvme_at_start": stats.get("blocks_nvme"),
                    "recovered_blocks": stats.get("recovered_blocks")})  # fmt: skip
    for length in plan["lengths"]:
        for repeat in range(plan["repeats"]):
            prompt = length_prompt(plan, length, repeat)
            emit("measure", {"experiment": 1, "config": config, "length_tokens": length, "repeat": repeat,
                             "prompt_id": f"p:{length}:{repeat}",
                             **kvtier_measure(engine, store, prompt, length, "nvme", drop_cache=True)})  # fmt: skip
            floor = disk_floor(plan, length) if with_disk_floor else None
            if floor is not None:
                emit(
                    "measure",
                    {"experiment": 1, "config": "disk_floor", "length_tokens": length, "repeat": repeat, **floor},
                )
    length = plan["hit_rate_length"]
    for repeat in range(plan["repeats"]):
        for rate in plan["hit_rates"]:
            base = hit_rate_base(plan, rate, repeat)
            prompt = hit_rate_prompt(plan, base, rate, repeat, "nvme")
            emit("measure", {"experiment": 2, "config": config, "length_tokens": length, "hit_rate": rate,
                             "repeat": repeat,
                             **kvtier_measure(engine, store, prompt, len(base), "nvme", drop_cache=True)})  # fmt: skip
    emit("store_stats", dict(store.stats()))
    store.close()


def shared_store_dir(plan: dict, node: str) -> str:
    """A local store directory of the kvtier_shared phases, beside the plan's store (node "a" or "b-<L>-r<r>")."""
    return str(Path(plan["store_dir"]).parent / f"shared-node-{node}")


SHARED_PUBLISH_FAILURES = ("shared_dropped_publishes", "shared_publish_errors")


def _publish_every_prompt(
    plan: dict, emit, engine, store, tier: str, counters: tuple[str, ...], failures: tuple[str, ...]
) -> None:
    """Node A's loop for a remote tier (`tier`: "shared" or "object"): computes every prompt of
    experiment 1 and, after each, waits for the flush that publishes it; fails unless it was."""
    published, where = {"shared": ("shared_files_published", "the shared tier"),
                        "object": ("bucket_segments_published", "the bucket")}[tier]  # fmt: skip
    for length in plan["lengths"]:
        for repeat in range(plan["repeats"]):
            prompt = length_prompt(plan, length, repeat)
            engine.reset_prefix_cache()
            before = store.stats()
            started = time.perf_counter()
            engine.generate(prompt)
            ttft_s = time.perf_counter() - started
            settle(engine, store)
            after = store.stats()
            delta = {name: after.get(name, 0) - before.get(name, 0) for name in (*counters, *failures)}
            emit(f"{tier}_publish", {"length_tokens": length, "repeat": repeat, "ttft_s": ttft_s,
                                     "publish_wait_s": time.perf_counter() - started - ttft_s, **delta})  # fmt: skip
            progress(f"kvtier_{tier}_store: L={length} r{repeat}: {ttft_s * 1000:.0f} ms, published {delta}")
            failed = {name: delta[name] for name in failures if delta[name]}
            if failed or not delta[published]:
                raise BenchError(f"node A did not publish prompt p:{length}:{repeat} to {where}: {delta}")
    emit("store_stats", dict(store.stats()))
    store.close()  # publishes anything left and stops node A's service
    # As when node A's server stops: its manager writes what it learned of the prefill (its steps
    # with load_policy auto) to the costs file, where the next engine of the model starts from.
    emit("costs", shut_down(engine))


def phase_kvtier_shared_store(plan: dict, emit) -> None:
    """Node A of kvtier_shared: computes every prompt of experiment 1 with the shared tier on and
    waits, after each, until its blocks are published (the flush waits for the shared publisher)."""
    shared_root = plan["shared"]["store_root"]
    engine = Engine(plan, kvtier_transfer(plan, shared_store_dir(plan, "a"), shared_root, load_policy="auto"))
    store = store_of_engine()
    emit("engine", {"start_s": engine.start_s, "shared_root": shared_root})
    counters = ("puts", "shared_files_published", "shared_bytes_written")
    _publish_every_prompt(plan, emit, engine, store, "shared", counters, SHARED_PUBLISH_FAILURES)


def located_tier(transfer: dict[str, Any]) -> str:
    """The name ``locate_many`` gives the remote tier of a node B's transfer options: ``bucket`` for the
    object tier, ``shared`` for the shared-filesystem tier."""
    return "bucket" if transfer.get("object_tier") else "shared"


def _wait_remote_visible(store, keys: list[bytes], tier: str) -> dict[str, int]:
    """Until node B's index places every block in the remote ``tier`` (it reads the manifests or the
    bucket's index objects when the store opens, and again every refresh); the tier counts at the end."""
    deadline = time.monotonic() + SHARED_VISIBLE_WAIT_S
    while True:
        counts = tier_counts(store, keys)
        if counts.get(tier, 0) == len(keys) or time.monotonic() > deadline:
            return counts
        time.sleep(0.1)


def _start_node_b(plan: dict, emit, node: str, where: dict[str, str], **transfer: Any) -> tuple[Engine, Any, list[int]]:
    """Node B of a remote-tier row for the plan's item (length, repeat): a fresh engine and service on
    an empty local store (`node` names its directory), checked empty, and waited on until its index
    places every block of the prompt in the remote tier (`located_tier`). `where`: the tier's name for
    errors, and the option naming it for the record.
    Returns the engine, its store and the prompt."""
    length, repeat = plan["item"]
    store_dir = shared_store_dir(plan, f"{node}-{length}-r{repeat}")
    if Path(store_dir).exists() and any(Path(store_dir).iterdir()):
        raise BenchError(f"node B's local store {store_dir} is not empty")
    engine = Engine(plan, kvtier_transfer(plan, store_dir, **transfer))
    store = store_of_engine()
    stats = store.stats()
    emit("engine", {"start_s": engine.start_s, **{k: v for k, v in where.items() if k != "name"},
                    "blocks_dram_at_start": stats.get("blocks_dram"),
                    "blocks_nvme_at_start": stats.get("blocks_nvme")})  # fmt: skip
    if stats.get("blocks_dram") or stats.get("blocks_nvme"):
        raise BenchError(f"node B's store is not empty at start: {stats.get('blocks_dram')} blocks in DRAM, "
                         f"{stats.get('blocks_nvme')} on NVMe")  # fmt: skip
    prompt = length_prompt(plan, length, repeat)
    keys = engine.block_keys(prompt, length // engine.block_tokens)
    counts = _wait_remote_visible(store, keys, located_tier(transfer))
    if counts.get(located_tier(transfer), 0) != len(keys):
        raise BenchError(f"node B sees the {len(keys)} blocks of p:{length}:{repeat} in tiers {counts}, not all in "
                         f"{where['name']} (after {SHARED_VISIBLE_WAIT_S} s)")  # fmt: skip
    return engine, store, prompt


def _measure_node_b(plan: dict, emit, config: str, engine: Engine, store, prompt: list[int], tier: str) -> None:
    """Node B's one measurement (every block read from the remote `tier`, as `locate_many` names it,
    and counted in its `<tier>_hits`), its record and its store's stats."""
    length, repeat = plan["item"]
    record = kvtier_measure(engine, store, prompt, length, tier, drop_cache=True)
    emit("measure", {"experiment": 1, "config": config, "length_tokens": length, "repeat": repeat,
                     "prompt_id": f"p:{length}:{repeat}", **record})  # fmt: skip
    emit("store_stats", dict(store.stats()))
    store.close()


def phase_kvtier_shared_load(plan: dict, emit) -> None:
    """Node B of kvtier_shared for one prompt: a fresh engine and service with an empty local store,
    every block of the prompt read from the shared tier."""
    shared_root = plan["shared"]["load_root"]
    where = {"name": "the shared tier", "shared_root": shared_root}
    engine, store, prompt = _start_node_b(plan, emit, "b", where, shared_root=shared_root)
    _measure_node_b(plan, emit, "kvtier_shared", engine, store, prompt, "shared")


OBJECT_PUBLISH_FAILURES = ("bucket_dropped_publishes", "bucket_request_errors")


# The encrypted object row's blocks: a prefix of their own under the run's, so that its node B can only
# be served blocks its node A sealed (never the clear row's).
ENCRYPTED_OBJECT_SUBPREFIX = "encrypted"


def _object_row(plan: dict, encrypted: bool) -> tuple[str, dict[str, Any]]:
    """The object row's node prefix and its transfer options: in clear, or with the run's key on the
    bucket's encrypted subprefix (kvtier_object_encrypted)."""
    if not encrypted:
        return "object", {"object_tier": True}
    return "object-enc", {
        "object_tier": True,
        "bucket_subprefix": ENCRYPTED_OBJECT_SUBPREFIX,
        "encryption_key_file": plan["encryption_key_file"],
    }


def _object_store(plan: dict, emit, encrypted: bool) -> None:
    """Node A of an object row: computes every prompt of experiment 1 with the object tier on; the
    flush after each waits until its segments and index objects are PUT."""
    node, options = _object_row(plan, encrypted)
    engine = Engine(plan, kvtier_transfer(plan, shared_store_dir(plan, f"{node}-a"), load_policy="auto", **options))
    store = store_of_engine()
    emit("engine", {"start_s": engine.start_s, "bucket_url": plan["object"]["bucket_url"], "encrypted": encrypted})
    counters = ("puts", "bucket_segments_published", "bucket_bytes_written", "bucket_put_requests")
    _publish_every_prompt(plan, emit, engine, store, "object", counters, OBJECT_PUBLISH_FAILURES)


def _object_load(plan: dict, emit, encrypted: bool) -> None:
    """Node B of an object row for one prompt: a fresh engine and service with an empty local store,
    every block of the prompt read from the bucket (ranged GETs of adjacent blocks)."""
    node, options = _object_row(plan, encrypted)
    where = {"name": "the bucket", "bucket_url": plan["object"]["bucket_url"]}
    engine, store, prompt = _start_node_b(plan, emit, f"{node}-b", where, **options)
    config = "kvtier_object_encrypted" if encrypted else "kvtier_object"
    _measure_node_b(plan, emit, config, engine, store, prompt, located_tier(options))


def phase_kvtier_object_store(plan: dict, emit) -> None:
    _object_store(plan, emit, encrypted=False)


def phase_kvtier_object_load(plan: dict, emit) -> None:
    _object_load(plan, emit, encrypted=False)


def phase_kvtier_object_encrypted_store(plan: dict, emit) -> None:
    """Node A of kvtier_object_encrypted (``--object --encrypted``): as kvtier_object's, every value
    sealed with the run's key before it is PUT, under the bucket's encrypted subprefix."""
    _object_store(plan, emit, encrypted=True)


def phase_kvtier_object_encrypted_load(plan: dict, emit) -> None:
    """Node B of kvtier_object_encrypted: as kvtier_object's, with the key (every hit opened in its DRAM slot)."""
    _object_load(plan, emit, encrypted=True)


# The always-load rows behind a slow link wait for every hit, however long the link takes: with the
# default deadline (service_timeout_ms, 2 s) a request gives up a prefetch still running after it
# and recomputes, and the row would measure that instead of loading everything.
ALWAYS_LOAD_TIMEOUT_MS = 3_600_000
LOAD_CHOICES = ("load", "probe", "untrained")  # decisions that offer a block (recompute: declines it)


def load_decider(engine: Engine) -> Any:
    """kvtier's load-or-recompute decider in this engine's scheduler (kvtier.vllm.costs.LoadDecider)."""
    try:
        core = engine.llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]  # in-process client
        return core.scheduler.connector.connector_scheduler.manager.decider
    except AttributeError as error:
        raise BenchError(
            f"cannot reach kvtier's load decider in this vLLM's scheduler ({error}): the slow-link rows need "
            "vLLM's one-process layout (VLLM_ENABLE_V1_MULTIPROCESSING=0) and KvtierConnector"
        ) from None


def decider_view(decider: Any, blocks: int, tier: str) -> dict[str, Any]:
    """What the decider believes now, for ``blocks`` leading hits on ``tier``: its prefill model, each
    tier's rate, and the recompute and load times it predicts for them (None: not known yet)."""
    from kvtier.vllm.costs import load_s

    a, b, c = decider.prefill.coefficients
    tokens = blocks * decider.block_tokens
    return {
        "prefill_steps": decider.prefill.prefill_steps,
        "prefill_a_s": a,
        "prefill_b_s_per_token": b,
        "prefill_c_s_per_work": c,
        "rates_s_per_block": decider.rates.snapshot(),
        "predicted_recompute_s": decider.prefill.recompute_s(tokens),
        "predicted_load_s": load_s([tier] * blocks, decider.rates),
    }


def costs_files() -> dict[str, dict[str, Any]]:
    """The costs files in this process's runtime directory (beside the service sockets), as read now."""
    from kvtier.service import default_socket_path

    found: dict[str, dict[str, Any]] = {}
    for path in sorted(default_socket_path("/").parent.glob("costs-*.json")):
        try:
            document = json.loads(path.read_text())
            found[path.name] = {
                "prefill_steps": document["prefill"]["prefill_steps"],
                "rates_s_per_block": {tier: rate["seconds_per_block"] for tier, rate in document["rates"].items()},
            }
        except (OSError, ValueError, KeyError, TypeError) as error:
            found[path.name] = {"unreadable": str(error)}
    return found


def shut_down(engine: Engine) -> dict[str, Any]:
    """Stops the engine as a server's exit does (the connector's shutdown writes its costs file, as a
    user's restart would leave it); returns the costs files then."""
    engine.llm.llm_engine.engine_core.shutdown()
    return {"costs_files": costs_files()}


def phase_kvtier_object_slow(plan: dict, emit) -> None:
    """Node B of kvtier_object behind the slow link (the parent started the link and gave it as the
    bucket's endpoint), for one prompt and one load policy: ``_slow_node_b``."""
    where = {"name": "the bucket (through the slow link)", "bucket_endpoint": plan["object"]["bucket_endpoint"]}
    _slow_node_b(plan, emit, "object", where, {"object_tier": True})


def phase_kvtier_shared_slow(plan: dict, emit) -> None:
    """Node B of kvtier_shared on the slow mount of the shared directory (the parent mounted it and
    gave it as node B's shared root), for one prompt and one load policy: ``_slow_node_b``."""
    shared_root = plan["shared"]["load_root"]
    where = {"name": "the shared tier (through the slow mount)", "shared_root": shared_root}
    _slow_node_b(plan, emit, "shared", where, {"shared_root": shared_root})


def _slow_node_b(plan: dict, emit, tier: str, where: dict, remote: dict) -> None:
    """A remote-tier row's node B behind a slow link (the item: length, repeat, link MB/s, policy): a
    fresh engine and service with an empty local store, as in kvtier_shared and kvtier_object, started
    from the costs file the earlier engines of the model left; after the timed request it stops as a
    server does, leaving what it learned for the next engine."""
    length, repeat, rate, policy = plan["item"]
    costs_at_start = costs_files()
    integration = {"service_timeout_ms": ALWAYS_LOAD_TIMEOUT_MS} if policy == "always" else {}
    node_plan = {**plan, "item": [length, repeat]}
    engine, store, prompt = _start_node_b(
        node_plan, emit, f"{tier}-slow-{rate:g}-{policy}", where, load_policy=policy, **remote, **integration
    )  # fmt: skip
    decider = load_decider(engine)
    blocks = length // engine.block_tokens
    located = located_tier(remote)
    believed = decider_view(decider, blocks, located)
    decisions_before = dict(decider.decisions)
    record = kvtier_measure(engine, store, prompt, length, located, drop_cache=True, all_served=policy == "always")
    decisions = {
        f"{tier_name}:{choice}": count - decisions_before.get((tier_name, choice), 0)
        for (tier_name, choice), count in decider.decisions.items()
        if count != decisions_before.get((tier_name, choice), 0)
    }
    offered = sum(count for key, count in decisions.items() if key.split(":")[1] in LOAD_CHOICES)
    record.update(
        tier=tier, policy=policy, link_mb_per_s=rate, decisions=decisions, decided_blocks=sum(decisions.values()),
        offered_tokens=offered * engine.block_tokens, believed=believed,
        learned=decider_view(decider, blocks, located), costs_at_start=costs_at_start,
    )  # fmt: skip
    emit("measure", {"experiment": "slow_link", "config": f"kvtier_{tier}_{policy}", "length_tokens": length,
                     "repeat": repeat, "prompt_id": f"p:{length}:{repeat}", **record})  # fmt: skip
    emit("store_stats", dict(store.stats()))
    store.close()
    emit("costs", shut_down(engine))


def phase_example_connector(plan: dict, emit) -> None:
    transfer = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": plan["example_dir"]},
    }
    # ExampleConnector saves a prompt only in the step that schedules it first, so a prompt split by
    # chunked prefill is saved partly and its load fails (shape mismatch). One chunk per prompt here.
    engine = Engine(plan, transfer, max_num_batched_tokens=plan["max_model_len"])
    emit("engine", {"start_s": engine.start_s})
    for length in plan["lengths"]:
        prompt = length_prompt(plan, length, 0)
        engine.reset_prefix_cache()
        engine.generate(prompt)  # computes and saves the per-layer files
        for repeat in range(plan["repeats"]):
            engine.reset_prefix_cache()
            dropped = workload.drop_page_cache()
            engine.generate(NUDGE_PROMPT)
            record = engine.measure(prompt, length)
            record["files_present"] = example_files_present(plan, prompt, engine.block_tokens)
            if not record["files_present"]:
                record["problem"] = "ExampleConnector has no files for this prompt (recomputed)"
            record["page_cache_dropped"] = dropped
            emit("measure", {"experiment": 1, "config": "example_connector", "length_tokens": length,
                             "repeat": repeat, "prompt_id": f"p:{length}:0", **record})  # fmt: skip


def example_files_present(plan: dict, prompt: list[int], block_tokens: int) -> bool:
    """Whether ExampleConnector saved this prompt (its folder: md5 of the int64 token bytes it matches)."""
    import hashlib

    import numpy as np

    matched = (len(prompt) - 1) // block_tokens * block_tokens
    folder = hashlib.md5(np.asarray(prompt[:matched], dtype=np.int64).tobytes(), usedforsecurity=False).hexdigest()
    return (Path(plan["example_dir"]) / folder).is_dir()


def lmcache_config(plan: dict) -> dict[str, Any]:
    """LMCache's configuration for the lmcache_disk phase (written as LMCACHE_CONFIG_FILE).

    local_cpu off: LMCache's CPU cache never serves a hit, its pool only stages disk reads and
    writes. Whole chunks only (save_unfull_chunk off), so a prompt of L + 2 tokens hits L."""
    return {
        "chunk_size": plan["lmcache_chunk_tokens"],
        "local_cpu": False,
        "max_local_cpu_size": plan["lmcache_cpu_gib"],
        "local_disk": plan["lmcache_dir"],
        "max_local_disk_size": plan["lmcache_disk_gib"],
        "save_unfull_chunk": False,
        "use_layerwise": False,
        "enable_blending": False,
    }


def _lmcache_disk_backend():
    """LMCache's LocalDiskBackend in this engine process (fails when LMCache runs degraded)."""
    from lmcache.integration.vllm.utils import ENGINE_NAME
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    lmcache_engine = LMCacheEngineBuilder.get(ENGINE_NAME)
    if lmcache_engine is None or getattr(lmcache_engine, "storage_manager", None) is None:
        raise BenchError("LMCache's engine was not created in the engine process (degraded mode?)")
    backends = lmcache_engine.storage_manager.storage_backends
    backend = backends.get("LocalDiskBackend")
    if backend is None:
        raise BenchError(f"LMCache has no LocalDiskBackend (backends: {list(backends)})")
    hot = backends.get("LocalCPUBackend")
    if hot is not None and getattr(hot, "use_hot", False):
        raise BenchError("LMCache's CPU cache is on (local_cpu): hits would not come from disk")
    return backend


def _lmcache_wait_stored(engine: Engine, backend, chunks: int) -> float:
    """Waits until LMCache's disk index holds ``chunks`` chunks and no write is in flight."""
    started = time.monotonic()
    while True:
        with backend.disk_lock:
            indexed = len(backend.dict)
        with backend.disk_worker.put_lock:
            in_flight = len(backend.disk_worker.put_tasks)
        if indexed >= chunks and not in_flight:
            return time.monotonic() - started
        if time.monotonic() - started > LMCACHE_STORE_WAIT_S:
            raise BenchError(
                f"LMCache stored {indexed} of {chunks} chunks on disk ({in_flight} writes in flight) "
                f"after {LMCACHE_STORE_WAIT_S} s"
            )
        engine.generate(NUDGE_PROMPT)
        time.sleep(0.05)


def phase_lmcache_disk(plan: dict, emit) -> None:
    """LMCache's vLLM connector with its local disk backend (runs in the LMCache virtualenv)."""
    from kvtier.bench import lmcache_cpu_shim

    lmcache_cpu_shim.install()
    transfer = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    engine = Engine(plan, transfer)
    backend = _lmcache_disk_backend()
    emit("engine", {"start_s": engine.start_s, "lmcache_disk_path": str(backend.path),
                    "lmcache_odirect": bool(getattr(backend, "use_odirect", False))})  # fmt: skip
    chunk = plan["lmcache_chunk_tokens"]
    stored_chunks = 0
    for length in plan["lmcache_lengths"]:
        prompt = length_prompt(plan, length, 0)
        engine.reset_prefix_cache()
        engine.generate(prompt)  # computes and stores (LMCache writes its chunk files asynchronously)
        stored_chunks += length // chunk
        store_wait_s = _lmcache_wait_stored(engine, backend, stored_chunks)
        for repeat in range(plan["repeats"]):
            engine.reset_prefix_cache()
            dropped = workload.drop_page_cache()
            engine.generate(NUDGE_PROMPT)  # shorter than a chunk: no LMCache I/O
            before = lmcache_cpu_shim.counters()
            record = engine.measure(prompt, length)
            after = lmcache_cpu_shim.counters()
            delta = {name: after[name] - before[name] for name in after}
            record["lmcache"] = {**delta, "expected_disk_chunks": length // chunk, "store_wait_s": store_wait_s}
            problems = []
            if delta["loaded_tokens"] != length:
                problems.append(f"LMCache loaded {delta['loaded_tokens']} of {length} tokens into vLLM")
            if delta["disk_chunks_read"] != length // chunk:
                problems.append(
                    f"{delta['disk_chunks_read']} of {length // chunk} chunks read from LMCache's disk backend"
                )
            if problems:
                record["problem"] = "; ".join(problems)
            record["page_cache_dropped"] = dropped
            emit("measure", {"experiment": 1, "config": "lmcache_disk", "length_tokens": length,
                             "repeat": repeat, "prompt_id": f"p:{length}:0", **record})  # fmt: skip
    emit("lmcache_stats", {**lmcache_cpu_shim.counters(), "disk_chunks_indexed": len(backend.dict)})


LMCACHE_LOG_FAILURES = ("degraded mode", "No supported cpu connector", "Failed to initialize LMCacheManager")


def lmcache_log_problem(log_text: str) -> str | None:
    """A line of the LMCache phase's log that makes its figures untrustworthy, if any."""
    for line in log_text.splitlines():
        if any(marker in line for marker in LMCACHE_LOG_FAILURES):
            return line.strip()[:300]
    return None


def lmcache_environment(plan: dict) -> dict[str, str]:
    """Environment of the LMCache engine process (on top of phase_environment)."""
    import kvtier

    python_dir = str(Path(kvtier.__file__).resolve().parent.parent)
    return {
        "PYTHONPATH": os.pathsep.join(
            [python_dir] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
        "PYTHONHASHSEED": LMCACHE_HASH_SEED,
        "LMCACHE_CONFIG_FILE": plan["lmcache_config_file"],
        "LMCACHE_TRACK_USAGE": "false",
    }


PHASES = {
    "baseline": phase_baseline,
    "kvtier_store": phase_kvtier_store,
    "kvtier_nvme": phase_kvtier_nvme,
    "kvtier_nvme_encrypted_store": phase_kvtier_nvme_encrypted_store,
    "kvtier_nvme_encrypted": phase_kvtier_nvme_encrypted,
    "kvtier_object_encrypted_store": phase_kvtier_object_encrypted_store,
    "kvtier_object_encrypted_load": phase_kvtier_object_encrypted_load,
    "example_connector": phase_example_connector,
    "lmcache_disk": phase_lmcache_disk,
    "kvtier_shared_store": phase_kvtier_shared_store,
    "kvtier_shared_load": phase_kvtier_shared_load,
    "kvtier_object_store": phase_kvtier_object_store,
    "kvtier_object_load": phase_kvtier_object_load,
    "kvtier_object_slow": phase_kvtier_object_slow,
    "kvtier_shared_slow": phase_kvtier_shared_slow,
}


def run_phase(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    plan, phase = spec["plan"], spec["phase"]
    spec_path_name = Path(spec_path).name.removesuffix(".spec.json")
    with open(spec["result_path"], "w") as result_file:

        def emit(kind: str, payload: dict) -> None:
            result_file.write(json.dumps({"kind": kind, **payload}) + "\n")
            result_file.flush()
            if kind == "measure":
                where = f"L={payload['length_tokens']}" + (
                    f" hit={payload['hit_rate']}%" if payload.get("hit_rate") is not None else ""
                )
                progress(
                    f"{spec_path_name}: exp{payload['experiment']} {payload['config']} {where} r{payload['repeat']}: "
                    f"{payload['ttft_s'] * 1000:.0f} ms, "
                    f"cached {payload['cached_tokens']}/{payload['expected_cached_tokens']}"
                    + (f" PROBLEM: {payload['problem']}" if payload.get("problem") else "")
                )
            elif kind == "engine":
                progress(f"{phase}: engine started in {payload['start_s']:.0f} s")

        try:
            PHASES[phase](plan, emit)
        except BaseException:
            import traceback

            traceback.print_exc()
            stop_services_of_this_process()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    progress(f"{phase}: done")
    # Skip interpreter teardown of the engine (threads, store close are not timed; the OS reclaims).
    sys.stdout.flush()
    os._exit(0)
