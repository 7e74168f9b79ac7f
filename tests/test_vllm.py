"""End-to-end tests of kvtier behind vLLM's OffloadingConnector, on the real (CPU) vLLM engine.

One engine per module (starting one takes about a minute on two cores), built on the ``tiny`` model
from ``kvtier.models``; the engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the
tests read the kvtier store's counters directly. The restart test runs two short engine processes of
its own, before the shared engine starts, so that never more than one engine runs at a time.

Run: ``.venv/bin/python -m pytest tests/test_vllm.py -m slow -v`` (after ``scripts/install_vllm.sh``
and ``maturin develop``).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler and worker in this process

try:
    import vllm  # noqa: F401
except Exception as import_error:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"vllm is not importable ({import_error!r}); run scripts/install_vllm.sh to install the CPU build",
        allow_module_level=True,
    )
try:
    import kvtier
    import kvtier.vllm as kvtier_vllm
    from kvtier.vllm._testing import open_stores
except Exception as import_error:  # pragma: no cover
    pytest.skip(f"kvtier is not importable ({import_error!r}); run `maturin develop` first", allow_module_level=True)

from kvtier.models import ensure_model

TOKENS_PER_BLOCK = 128  # vLLM's block size on CPU
OBJECT_BYTES_TINY = 4 * 2 * 2 * TOKENS_PER_BLOCK * 64 * 4  # layers * (K,V) * kv heads * tokens * head dim * fp32
DRAM_BYTES = 6 << 20  # about 11 blocks of the tiny model: small, so tests can push blocks out to NVMe
NVME_BYTES = 128 << 20
REGION_BYTES = 8 << 20
LOGPROB_TOLERANCE = 1e-3


def engine_kwargs(store_dir: Path, **store_options) -> dict:
    from vllm.config import KVTransferConfig

    # host_service=False: the store lives in this process, so the tests read its counters directly
    # (tests/test_vllm_service.py covers vLLM's default layout with the host service).
    options = {
        "dram_bytes": DRAM_BYTES,
        "nvme_bytes": NVME_BYTES,
        "region_bytes": REGION_BYTES,
        "host_service": False,
        **store_options,
    }
    return dict(
        model=str(ensure_model("tiny")),
        dtype="float32",
        max_model_len=4096,
        enable_prefix_caching=True,
        enforce_eager=True,
        distributed_executor_backend="uni",
        seed=0,
        kv_transfer_config=KVTransferConfig(**kvtier_vllm.kv_transfer_config(store_dir, **options)),
    )


def random_prompt(seed: int, full_blocks: int, extra_tokens: int = 10) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(full_blocks * TOKENS_PER_BLOCK + extra_tokens)]


def generate(llm, prompt_token_ids: list[int], cache_salt: str | None = None, max_tokens: int = 6):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=prompt_token_ids)
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, seed=0)
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    completion = output.outputs[0]
    chosen_logprobs = [
        step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs, strict=True)
    ]
    return list(completion.token_ids), chosen_logprobs, output.num_cached_tokens or 0


def settle(llm, store) -> None:
    """Drives a few engine steps so deferred store jobs are submitted and completed, then flushes."""
    for _ in range(2):
        generate(llm, [5, 6, 7], max_tokens=2)
    store.flush()


def assert_same_output(baseline, candidate) -> None:
    baseline_tokens, baseline_logprobs, _ = baseline
    tokens, logprobs, _ = candidate
    assert tokens == baseline_tokens
    for expected, actual in zip(baseline_logprobs, logprobs, strict=True):
        assert abs(expected - actual) <= LOGPROB_TOLERANCE, (baseline_logprobs, logprobs)


class StatsDelta:
    def __init__(self, store):
        self.store = store
        self.before = store.stats()

    def __getitem__(self, name: str) -> int:
        return self.store.stats()[name] - self.before[name]


# ---------------------------------------------------------------------------------------------
# Restart persistence (own engine processes; runs first so no other engine is alive)
# ---------------------------------------------------------------------------------------------


def _restart_phase(phase: str, store_dir: str, result_path: str) -> None:
    from vllm import LLM

    llm = LLM(**engine_kwargs(Path(store_dir)))
    (shared,) = open_stores()
    prompt = random_prompt(seed=900, full_blocks=4)
    before = shared.store.stats()
    result = generate(llm, prompt)
    if phase == "store":
        settle(llm, shared.store)
    after = shared.store.stats()
    Path(result_path).write_text(
        json.dumps(
            {
                "tokens": result[0],
                "logprobs": result[1],
                "num_cached_tokens": result[2],
                "nvme_hits": after["nvme_hits"] - before["nvme_hits"],
                "dram_hits": after["dram_hits"] - before["dram_hits"],
                "recovered_blocks": after.get("recovered_blocks", 0),
                "puts": after["puts"] - before["puts"],
            }
        )
    )
    shared.store.flush()


@pytest.mark.slow
@pytest.mark.full
def test_restart_hits_from_nvme(tmp_path):
    """Full only (about 70 s, two engine processes): CI's engines restarted onto a store are in
    tests/test_bench_ttft.py (kvtier_nvme: a fresh engine hits what earlier ones left on NVMe) and
    tests/test_vllm_serve.py (OpenAI servers stopped one after the other on one pool)."""
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    results = {}
    for phase in ("store", "load"):
        result_path = tmp_path / f"{phase}.json"
        completed = subprocess.run(
            [sys.executable, __file__, "--restart-phase", phase, str(store_dir), str(result_path)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert completed.returncode == 0, completed.stderr[-4000:]
        results[phase] = json.loads(result_path.read_text())
    stored, loaded = results["store"], results["load"]
    assert stored["puts"] >= 4 and stored["num_cached_tokens"] == 0
    assert loaded["num_cached_tokens"] == 4 * TOKENS_PER_BLOCK
    assert loaded["nvme_hits"] >= 4 and loaded["recovered_blocks"] >= 4
    assert_same_output((stored["tokens"], stored["logprobs"], 0), (loaded["tokens"], loaded["logprobs"], 0))


# ---------------------------------------------------------------------------------------------
# One engine for the rest of the module
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvtier-store")


@pytest.fixture(scope="module")
def engine(store_dir):
    from vllm import LLM

    started = time.monotonic()
    llm = LLM(**engine_kwargs(store_dir))
    print(f"engine start: {time.monotonic() - started:.1f} s")
    (shared,) = open_stores()
    yield llm, shared.store
    del llm


@pytest.mark.slow
def test_dram_hit_after_prefix_cache_reset(engine):
    llm, store = engine
    prompt = random_prompt(seed=1, full_blocks=5)
    delta = StatsDelta(store)
    baseline = generate(llm, prompt)
    assert baseline[2] == 0, "a fresh prompt must be computed, not restored"
    settle(llm, store)
    assert delta["puts"] >= 5

    assert llm.reset_prefix_cache()
    delta = StatsDelta(store)
    restored = generate(llm, prompt)
    assert restored[2] == 5 * TOKENS_PER_BLOCK
    assert delta["dram_hits"] == 5 and delta["nvme_hits"] == 0
    assert_same_output(baseline, restored)


@pytest.mark.slow
def test_only_prompt_blocks_are_stored_not_decode_blocks(engine):
    """vLLM's OffloadingConnector offloads prompt blocks only by default (``offload_prompt_only``):
    a request that decodes three blocks' worth of tokens past its prompt writes its prompt's blocks,
    no more (issue 24, item 12: storing decode KV is write volume that is rarely read back)."""
    llm, store = engine
    prompt = random_prompt(seed=12, full_blocks=3)
    delta = StatsDelta(store)
    generate(llm, prompt, max_tokens=3 * TOKENS_PER_BLOCK + 20)
    settle(llm, store)
    # settle's own short prompts fill no block; the decoded tokens would fill three more.
    assert delta["puts"] == 3, delta["puts"]
    assert delta["bytes_copied_in"] == 3 * OBJECT_BYTES_TINY


@pytest.mark.slow
def test_nvme_hit_after_dram_eviction(engine):
    llm, store = engine
    prompt = random_prompt(seed=2, full_blocks=4)
    baseline = generate(llm, prompt)
    settle(llm, store)

    delta = StatsDelta(store)
    for flood_seed in range(100, 104):  # 32 blocks through an 11-block DRAM tier
        generate(llm, random_prompt(seed=flood_seed, full_blocks=8), max_tokens=2)
    settle(llm, store)
    assert delta["dram_evictions"] > 0

    assert llm.reset_prefix_cache()
    delta = StatsDelta(store)
    restored = generate(llm, prompt)
    assert restored[2] == 4 * TOKENS_PER_BLOCK
    assert delta["nvme_hits"] >= 1 and delta["nvme_hits"] + delta["dram_hits"] == 4
    assert_same_output(baseline, restored)


def _scheduler_connector(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


@pytest.mark.slow
def test_the_connector_follows_each_request_the_engine_runs_until_it_ends(engine, monkeypatch):
    """Issue 36: load-or-recompute weighs a recompute by the other requests the engine runs
    (kvtier.vllm.costs.EngineRequests), which the connector learns through vLLM's own hooks: the
    request's arrival, each step, and its end (a request never forgotten would count for ever)."""
    llm, _ = engine
    running = _scheduler_connector(llm)._decider().requests
    seen: list[dict[str, tuple[int, int]]] = []
    record = running.scheduled

    def recording(scheduler_output):
        record(scheduler_output)
        seen.append(running.progress())

    monkeypatch.setattr(running, "scheduled", recording)
    prompt = random_prompt(seed=21, full_blocks=3)
    generate(llm, prompt)
    followed = [progress for step in seen for progress in step.values()]
    assert (len(prompt), len(prompt)) in followed, f"the prompt was never seen computed: {followed}"
    assert all(0 <= computed <= prompt_tokens + 16 for computed, prompt_tokens in followed)
    assert running.progress() == {} and running.others() == 0, "a finished request still counts as running"


@pytest.mark.slow
def test_every_output_times_the_step_it_came_from(engine, monkeypatch):
    """Issue 36: the prefill model is fitted on the steps the scheduler times. Each output names its
    step (the worker echoes the step's number, ``StepWorkerMetadata``), so no step is left pending
    and none is timed by another's output, with asynchronous scheduling and steps that compute
    nothing alike."""
    llm, _ = engine
    connector = _scheduler_connector(llm)
    clock, prefill = connector._step_clock, connector._decider().prefill
    named: list[int | None] = []
    update = connector.update_connector_output

    def recording(connector_output):
        named.append(getattr(connector_output.kv_connector_worker_meta, "kvtier_step", None))
        update(connector_output)

    monkeypatch.setattr(connector, "update_connector_output", recording)
    fitted = prefill.prefill_steps + prefill.outliers
    generate(llm, random_prompt(seed=23, full_blocks=3))
    numbers = [number for number in named if number is not None]
    assert named and numbers == named, f"an output without its step's number: {named}"
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers), numbers
    assert connector._step_number == numbers[-1], "a step whose output never reached the scheduler"
    assert clock._pending == [], "steps left pending"
    assert prefill.prefill_steps + prefill.outliers > fitted, "no prompt step was timed"


@pytest.mark.slow
def test_vllm_offload_metrics_count_kvtier_transfers(engine, monkeypatch):
    """vLLM's own offload metrics (not only kvtier:*) count kvtier's stores and loads, in both the
    per-direction names and the older ``vllm:kv_offload_total_*{transfer_type}`` ones that
    dashboards read (those stayed at zero: vLLM fed them only for its own CPU spec)."""
    import functools

    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

    llm, store = engine
    connector = _scheduler_connector(llm)
    assert isinstance(connector, kvtier_vllm.KvtierConnector)
    # The scheduler drains the connector's stats every step and drops them in an offline engine
    # (no stat loggers): keep a copy of each payload, as a server's stat logger would receive it.
    payloads = []
    drain = connector.get_kv_connector_stats

    def recording_drain():
        stats = drain()
        if stats is not None and not stats.is_empty():
            payloads.append(stats)
        return stats

    monkeypatch.setattr(connector, "get_kv_connector_stats", recording_drain)
    prompt = random_prompt(seed=7, full_blocks=3)
    baseline = generate(llm, prompt)
    settle(llm, store)
    assert llm.reset_prefix_cache()
    restored = generate(llm, prompt)
    assert restored[2] == 3 * TOKENS_PER_BLOCK
    settle(llm, store)

    total = OffloadingConnectorStats()
    for stats in payloads:
        total.aggregate(stats)
    # vLLM's Prometheus side, as its stat logger builds it for this connector, on a private registry.
    registry = prometheus_client.CollectorRegistry()

    class PrivateRegistryProm(KVConnectorProm):
        # Factories, not classes: vLLM only calls them to create its metrics.
        _gauge_cls = functools.partial(prometheus_client.Gauge, registry=registry)  # type: ignore[assignment]
        _counter_cls = functools.partial(prometheus_client.Counter, registry=registry)  # type: ignore[assignment]
        _histogram_cls = functools.partial(prometheus_client.Histogram, registry=registry)  # type: ignore[assignment]

    engine_labels = {"model_name": "m", "engine": "0"}
    PrivateRegistryProm(llm.llm_engine.vllm_config, list(engine_labels), {0: list(engine_labels.values())}).observe(
        total.data, 0
    )

    def sample(name: str, labels: dict[str, str]) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    for direction in ("load", "store"):
        assert sample(f"vllm:kv_offload_{direction}_bytes_total", engine_labels) >= 3 * OBJECT_BYTES_TINY
        assert sample(f"vllm:kv_offload_{direction}_time_total", engine_labels) > 0
    for transfer_type, direction in (("CPU_to_GPU", "load"), ("GPU_to_CPU", "store")):
        labels = {**engine_labels, "transfer_type": transfer_type}
        assert sample("vllm:kv_offload_total_bytes_total", labels) == sample(
            f"vllm:kv_offload_{direction}_bytes_total", engine_labels
        )
        assert sample("vllm:kv_offload_total_time_total", labels) > 0
    # The dashboard's vLLM panels (vLLM's metrics, and kvtier's load decisions) query only what this
    # connector makes vLLM export.
    dashboard = json.loads((Path(__file__).resolve().parents[1] / "dashboards" / "kvtier.json").read_text())
    queried = {
        name for panel in dashboard["panels"] for target in panel["targets"]
        for name in re.findall(r"\b(?:vllm|kvtier):[a-z_]+", target["expr"])
    }  # fmt: skip
    assert "kvtier:load_decisions_total" in queried
    # A labelled counter that counted nothing in this test (the load decisions, counted by earlier
    # tests of the shared engine) has no sample yet: its declared name counts as exported.
    families = list(registry.collect())
    exported = {sample.name for metric in families for sample in metric.samples}
    exported |= {f"{metric.name}_total" for metric in families if metric.type == "counter"}
    assert queried and not queried - exported, (
        f"the dashboard queries vLLM metrics vLLM does not export: {queried - exported}"
    )
    assert_same_output(baseline, restored)


@pytest.mark.slow
def test_cache_salt_separates_tenants(engine):
    llm, store = engine
    prompt = random_prompt(seed=3, full_blocks=3)
    tenant_a = generate(llm, prompt, cache_salt="tenant-a")
    settle(llm, store)

    assert llm.reset_prefix_cache()
    delta = StatsDelta(store)
    tenant_b = generate(llm, prompt, cache_salt="tenant-b")
    assert tenant_b[2] == 0
    assert delta["dram_hits"] + delta["nvme_hits"] == 0
    assert_same_output(tenant_a, tenant_b)

    assert llm.reset_prefix_cache()
    tenant_a_again = generate(llm, prompt, cache_salt="tenant-a")
    assert tenant_a_again[2] == 3 * TOKENS_PER_BLOCK


def _data_files(store_dir: Path) -> list[Path]:
    return sorted(path for path in store_dir.rglob("*") if path.is_file() and path.stat().st_size >= 1 << 20)


def _page_snapshot(paths: list[Path]):
    import numpy as np

    return {path: np.fromfile(path, dtype=np.uint8).reshape(-1, 4096) for path in paths}


@pytest.mark.slow
def test_corrupt_block_on_disk_is_recomputed(engine, store_dir):
    import numpy as np

    llm, store = engine
    settle(llm, store)
    data_files = _data_files(store_dir)
    assert data_files, f"no kvtier data file under {store_dir}"
    before_prompt = _page_snapshot(data_files)

    prompt = random_prompt(seed=4, full_blocks=4)
    baseline = generate(llm, prompt)
    settle(llm, store)
    after_prompt = _page_snapshot(data_files)

    for flood_seed in range(200, 204):  # push the prompt's blocks out of DRAM
        generate(llm, random_prompt(seed=flood_seed, full_blocks=8), max_tokens=2)
    settle(llm, store)
    after_flood = _page_snapshot(data_files)

    # Pages written for the prompt and not rewritten since: the prompt's block payloads.
    corrupted_pages = 0
    for path in data_files:
        written = np.any(before_prompt[path] != after_prompt[path], axis=1)
        stable = np.all(after_prompt[path] == after_flood[path], axis=1)
        pages = np.flatnonzero(written & stable)
        with open(path, "r+b") as file:
            for page in pages:
                file.seek(int(page) * 4096 + 2048)
                byte = file.read(1)
                file.seek(int(page) * 4096 + 2048)
                file.write(bytes([byte[0] ^ 0xFF]))
            file.flush()
            os.fsync(file.fileno())
        corrupted_pages += len(pages)
    assert corrupted_pages > 0, "found no page written for the prompt"

    assert llm.reset_prefix_cache()
    delta = StatsDelta(store)
    recomputed = generate(llm, prompt)
    settle(llm, store)
    assert delta["checksum_failures"] >= 1
    assert recomputed[2] < 4 * TOKENS_PER_BLOCK
    assert_same_output(baseline, recomputed)

    # The engine keeps serving, and the recomputed blocks were stored again.
    assert llm.reset_prefix_cache()
    again = generate(llm, prompt)
    assert_same_output(baseline, again)


# ---------------------------------------------------------------------------------------------
# Configuration checks (no engine)
# ---------------------------------------------------------------------------------------------


def test_unstable_hash_algo_is_refused(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(kvtier_vllm.KvtierVllmConfigError, match="PYTHONHASHSEED"):
        kvtier_vllm.check_hash_algo("xxhash")
    kvtier_vllm.check_hash_algo("sha256")
    kvtier_vllm.check_hash_algo("sha256_cbor")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    kvtier_vllm.check_hash_algo("xxhash")


def test_kvtier_key_mapping():
    from vllm.v1.kv_offload.base import OffloadKey

    block_hash = bytes(range(32))
    assert kvtier_vllm.kvtier_key(OffloadKey(block_hash + b"\0\0\0\0")) == block_hash
    other_group = kvtier_vllm.kvtier_key(OffloadKey(block_hash + b"\0\0\0\1"))
    assert len(other_group) == 32 and other_group != block_hash
    assert len(kvtier_vllm.kvtier_key(OffloadKey(bytes(16) + b"\0\0\0\0"))) == 32


def test_store_options_come_from_extra_config():
    options = kvtier_vllm.KvtierOptions.from_extra_config(
        {
            "spec_name": "KvtierOffloadingSpec",
            "spec_module_path": "kvtier.vllm",
            "path": "/tmp/x",
            "dram_bytes": 1 << 30,
        }
    )
    # An engine never fails to start for want of disk: the NVMe tier is left off (docs/reliability.md).
    assert options.store_options == {"dram_bytes": 1 << 30, "nvme_without_space": "dram_only"}
    with pytest.raises(kvtier_vllm.KvtierVllmConfigError, match="path"):
        kvtier_vllm.KvtierOptions.from_extra_config({"dram_bytes": 1})
    with pytest.raises(kvtier_vllm.KvtierVllmConfigError, match="namespace"):
        kvtier_vllm.KvtierOptions.from_extra_config({"path": "/tmp/x", "namespace": "a"})
    # The cap on a request's wait for its load: 0 (none) or a ratio >= 1; not a store option.
    capped = kvtier_vllm.KvtierOptions.from_extra_config({"path": "/tmp/x", "load_wait_max_ratio": 3})
    assert capped.load_wait_max_ratio == 3.0 and "load_wait_max_ratio" not in capped.store_options
    assert kvtier_vllm.KvtierOptions.from_extra_config({"path": "/tmp/x"}).load_wait_max_ratio == 2.0
    assert (
        kvtier_vllm.KvtierOptions.from_extra_config({"path": "/tmp/x", "load_wait_max_ratio": 0}).load_wait_max_ratio
        == 0
    )
    for bad in (0.5, -1, float("nan"), float("inf")):
        with pytest.raises(kvtier_vllm.KvtierVllmConfigError, match="load_wait_max_ratio"):
            kvtier_vllm.KvtierOptions.from_extra_config({"path": "/tmp/x", "load_wait_max_ratio": bad})


def test_namespace_changes_with_dtype_and_block_size(tmp_path):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    model_dir = ensure_model("tiny")

    def config(dtype: str, tokens_per_block: int) -> OffloadingConfig:
        return OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block, ("layer.0",), 0),),
            worker_kv_bytes_per_block=1,
            enable_kv_cache_events=False,
            extra_config={},
            engine_id="e",
            model=OffloadingModelConfig(str(model_dir), dtype),
            cache=OffloadingCacheConfig(tokens_per_block, 1),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
        )

    def digest(dtype: str, tokens_per_block: int) -> bytes:
        return kvtier_vllm.namespace_digest(
            kvtier_vllm.namespace_description(
                config(dtype, tokens_per_block), page_bytes_per_layer=[1], hash_algo="sha256"
            )
        )

    assert digest("float32", 128) == digest("float32", 128)
    assert digest("float32", 128) != digest("bfloat16", 128)
    assert digest("float32", 128) != digest("float32", 64)


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--restart-phase":
    _restart_phase(sys.argv[2], sys.argv[3], sys.argv[4])


def test_lookup_of_a_block_being_stored_is_pending_then_hit(tmp_path):
    """A block whose store job is in flight is a pending hit (the request waits a step), a block the
    store shows is a hit even before vLLM hears the job finished, and a store that never landed
    turns back into a miss."""
    import numpy as np
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

    store = kvtier.Store.open(str(tmp_path / "store"), namespace=b"lookup-test", object_bytes=4096,
                              dram_bytes=1 << 20, nvme_bytes=0)  # fmt: skip
    shared = kvtier_vllm.LocalStore(
        store=store, path=str(tmp_path), namespace=b"lookup-test", description={}, object_bytes=4096
    )
    manager = kvtier_vllm.KvtierManager(shared)
    context = ReqContext(req_id="r")
    stored, dropped, unknown = (make_offload_key(bytes([n]) * 32, 0) for n in (1, 2, 3))
    output = manager.prepare_store([stored, dropped], context)
    assert output is not None and len(output.keys_to_store) == 2
    assert manager.lookup(stored, context) is LookupResult.HIT_PENDING
    assert manager.lookup(unknown, context) is LookupResult.MISS

    store.put_many([kvtier_vllm.kvtier_key(stored)], [np.full(4096, 7, dtype=np.uint8)])
    assert manager.lookup(stored, context) is LookupResult.HIT  # before complete_store
    manager.complete_store([stored], context)
    manager.complete_store([dropped], context, success=False)
    assert manager.lookup(stored, context) is LookupResult.HIT
    assert manager.lookup(dropped, context) is LookupResult.MISS
    store.close()


def test_a_request_looked_up_again_after_its_load_is_requeued_then_recomputes(tmp_path):
    """A request vLLM looks up again after its load (the load failed whole, or a preemption) is
    taken from vLLM's queue of requests that hold KV blocks, though it holds none now; if its new load
    does not fit, vLLM 0.32's scheduler stops at it every step, and the requests behind it, which
    hold the blocks it needs, never run (an engine stalled for good under load, 50 MB/s bucket,
    always-load). The manager answers that first pass RETRY, which makes vLLM requeue the request
    behind them; from the next pass on it is a miss (at 20 MB/s requests loaded, failed at once
    behind a stuck transfer, and loaded again: 1,066 failed loads for 36 requests)."""
    import numpy as np
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

    store = kvtier.Store.open(str(tmp_path / "store"), namespace=b"requeue-test", object_bytes=4096,
                              dram_bytes=1 << 20, nvme_bytes=0)  # fmt: skip
    shared = kvtier_vllm.LocalStore(
        store=store, path=str(tmp_path), namespace=b"requeue-test", description={}, object_bytes=4096
    )
    manager = kvtier_vllm.KvtierManager(shared)
    keys = [make_offload_key(bytes([n]) * 32, 0) for n in range(1, 4)]
    store.put_many([kvtier_vllm.kvtier_key(k) for k in keys], [np.full(4096, 7, dtype=np.uint8)] * 3)
    hits = [LookupResult.HIT] * 3
    for req_id, next_pass in (("failed", keys), ("shorter", keys[1:])):
        context = ReqContext(req_id=req_id)
        assert [manager.lookup(k, context) for k in keys] == hits
        manager.prepare_load(keys, context)
        assert [manager.lookup(k, context) for k in keys] == [LookupResult.RETRY] * 3, "requeued"
        # The next pass, even one that begins later (vLLM's own cache now holds the first block), is
        # a miss: the request recomputes rather than load again what just failed.
        assert manager.lookup(next_pass[0], context) is LookupResult.MISS
        assert [manager.lookup(k, context) for k in keys] == [LookupResult.MISS] * 3
    assert manager.requeued_after_load == 2
    # A request that ended is forgotten: its id looked up again is a new request.
    context = ReqContext(req_id="ended")
    manager.prepare_load(keys, context)
    manager.on_request_finished(context)
    assert [manager.lookup(k, context) for k in keys] == hits
    # A request that ends without a load leaves no lookup plan behind (they piled up to the
    # decider's bound, each with its keys: about 1 GB at 4,096 prompts of 32K tokens).
    manager.on_request_finished(context)
    assert manager.decider._plans == {}
    manager.shutdown()
    store.close()


def test_a_request_releases_only_its_own_pins(tmp_path):
    """A block only in the shared tier is present but unpinned. Once it is resident and another
    request pins it, the first request's complete_load must not take that pin away (the block would
    then be evicted while the second request's load is in flight)."""
    import numpy as np
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    object_bytes = 4096
    options = dict(namespace=b"pin-test", object_bytes=object_bytes, nvme_bytes=0, shared_root=str(tmp_path / "shared"),
                   shared_staleness_ms=50, shared_file_bytes=1 << 20)  # fmt: skip
    writer = kvtier.Store.open(str(tmp_path / "a"), dram_bytes=1 << 20, **options)
    engine_key = make_offload_key(bytes([9]) * 32, 0)
    block = kvtier_vllm.kvtier_key(engine_key)
    writer.put_many([block], [np.full(object_bytes, 5, dtype=np.uint8)])
    writer.flush()
    reader = kvtier.Store.open(str(tmp_path / "b"), dram_bytes=4 * (object_bytes + 4096), staging_slots=4, **options)
    deadline = time.monotonic() + 10
    while reader.locate_many([block]) != ["shared"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reader.locate_many([block]) == ["shared"]
    shared = kvtier_vllm.LocalStore(store=reader, path=str(tmp_path / "b"), namespace=b"pin-test", description={},
                                     object_bytes=object_bytes)  # fmt: skip
    manager = kvtier_vllm.KvtierManager(shared)
    first, second = ReqContext(req_id="first"), ReqContext(req_id="second")
    manager.prepare_load([engine_key], first)  # shared only: no pin
    out = np.zeros(object_bytes, dtype=np.uint8)
    assert reader.get_many([block], [out]) == [True] and reader.locate_many([block]) == ["dram"]
    manager.prepare_load([engine_key], second)  # resident now: pinned
    manager.complete_load([engine_key], first)
    fillers = [bytes([n]) * 32 for n in range(100, 116)]
    reader.put_many(fillers, [np.full(object_bytes, n, dtype=np.uint8) for n in range(16)])
    assert reader.locate_many([block]) == ["dram"], "the second request's pin was released by the first"
    manager.complete_load([engine_key], second)
    # Nothing pins it any more: a trim of everything removes it rather than skipping it as in use.
    # (Eviction would too, in time: a block read up from a lower tier counts as used once, so S3-FIFO
    # keeps it over one-time fillers.)
    trimmed = reader.trim("all", 0)
    assert trimmed["skipped_in_use"] == 0, trimmed
    assert reader.locate_many([block]) != ["dram"], "unpinned once both requests completed"
    reader.close()
    writer.close()


def test_pins_of_a_request_that_never_completes_its_load_expire(tmp_path):
    """vLLM may drop a request between prepare_load and its load: its pins must not stay for the
    engine's whole life (the DRAM pool then fills with unevictable blocks and loads starve)."""
    import numpy as np
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    object_bytes = 4096
    store = kvtier.Store.open(str(tmp_path / "s"), namespace=b"lease-test", object_bytes=object_bytes,
                              dram_bytes=4 * (object_bytes + 4096), staging_slots=4, nvme_bytes=0)  # fmt: skip
    shared = kvtier_vllm.LocalStore(store=store, path=str(tmp_path), namespace=b"lease-test", description={},
                                     object_bytes=object_bytes)  # fmt: skip
    manager = kvtier_vllm.KvtierManager(shared, pin_lease_s=0.2)
    engine_key = make_offload_key(bytes([7]) * 32, 0)
    store.put_many([kvtier_vllm.kvtier_key(engine_key)], [np.full(object_bytes, 3, dtype=np.uint8)])
    manager.prepare_load([engine_key], ReqContext(req_id="lost"))  # never completes
    fill = [bytes([n]) * 32 for n in range(100, 108)]
    store.put_many(fill, [np.zeros(object_bytes, dtype=np.uint8)] * len(fill))
    assert store.locate_many([kvtier_vllm.kvtier_key(engine_key)]) == ["dram"], "pinned while the lease runs"
    time.sleep(0.3)
    manager.prepare_load([], ReqContext(req_id="later"))  # any later load looks at the leases
    store.put_many([bytes([n]) * 32 for n in range(110, 118)], [np.zeros(object_bytes, dtype=np.uint8)] * 8)
    assert store.locate_many([kvtier_vllm.kvtier_key(engine_key)]) == [None], "released once the lease ran out"
    store.close()


def test_a_lookup_pass_locates_the_requests_blocks_in_one_call_per_step(tmp_path):
    """vLLM asks about a request one block at a time, every step it waits: each answer was a call to
    the store (the host service's socket), 2,000 of them a step for a 32K-token prompt in 16-token
    blocks. Once a pass found a block held, the next one locates the request's later blocks too (from
    the positions vLLM's scheduler records; a block not held is asked again when vLLM asks), and a
    step's end lets the next step see what changed."""
    import numpy as np
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key

    store = kvtier.Store.open(str(tmp_path / "store"), namespace=b"locate-test", object_bytes=4096,
                              dram_bytes=1 << 20, nvme_bytes=0)  # fmt: skip
    shared = kvtier_vllm.LocalStore(
        store=store, path=str(tmp_path), namespace=b"locate-test", description={}, object_bytes=4096
    )
    manager = kvtier_vllm.KvtierManager(shared)
    keys = [make_offload_key(bytes([n]) * 32, 0) for n in range(1, 9)]
    context = ReqContext(req_id="long")
    for at, key in enumerate(keys):
        context.set_offload_key_position(key, (at + 1) * 16)
    store.put_many([kvtier_vllm.kvtier_key(k) for k in keys[:6]], [np.full(4096, 7, dtype=np.uint8)] * 6)
    expected = [LookupResult.HIT] * 6 + [LookupResult.MISS]
    step_end = ScheduleEndContext._make([()] * len(ScheduleEndContext._fields))
    for _ in range(2):
        calls = manager._locations.calls
        assert [manager.lookup(k, context) for k in keys[:7]] == expected
        # The first block alone, then the rest of the request, then its miss again.
        assert manager._locations.calls == calls + 3, "three calls for a pass of seven blocks"
        manager.on_schedule_end(step_end)
    # The next pass may begin later (vLLM's own cache holds more): still one call. And what changed
    # between steps is seen.
    store.put_many([kvtier_vllm.kvtier_key(keys[6])], [np.full(4096, 7, dtype=np.uint8)])
    calls = manager._locations.calls
    assert [manager.lookup(k, context) for k in keys[2:]] == [LookupResult.HIT] * 5 + [LookupResult.MISS]
    assert manager._locations.calls == calls + 3
    # A request with nothing stored (most new prompts) costs one block's call, not the request's.
    cold = ReqContext(req_id="cold")
    cold_keys = [make_offload_key(bytes([n]) * 32, 0) for n in range(100, 110)]
    for at, key in enumerate(cold_keys):
        cold.set_offload_key_position(key, (at + 1) * 16)
    calls = manager._locations.calls
    assert manager.lookup(cold_keys[0], cold) is LookupResult.MISS
    assert manager._locations.calls == calls + 1
    # Without positions (another vLLM), a block at a time, as before.
    bare = ReqContext(req_id="bare")
    calls = manager._locations.calls
    assert [manager.lookup(k, bare) for k in keys[:3]] == [LookupResult.HIT] * 3
    assert manager._locations.calls == calls + 3
    manager.on_request_finished(context)
    manager.shutdown()
    store.close()
