"""kvtier's shared-filesystem tier and run-time faults behind the real (CPU) vLLM engine.

Engines, in order, never two alive at once (engine start is the cost: about a minute each on two
shared cores):

1. engine A, a subprocess: own NVMe directory, ``shared_root``; computes three prompts, flushing
   after each (so each prompt is published in a shared file of its own), then exits.
2. engine C, a subprocess: a model with the tiny model's exact shape (same KV bytes per block) but
   other weights, on A's NVMe directory and shared root: must not get a single hit.
3. engine B, in this process (so the tests read its store directly): another NVMe directory, the
   same shared root. It gets A's prefixes from the shared tier, then serves through a full shared
   filesystem and through its store directories being removed.

The shared root is a small tmpfs mount when this runs as root (so "filesystem full" is a real
ENOSPC), else a plain directory and the full-disk test is skipped.

Run: ``.venv/bin/python -m pytest tests/test_vllm_tiers.py -m slow -v -s``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler and worker in one process (kvtier needs it)

try:
    import vllm  # noqa: F401
except Exception as import_error:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"vllm is not importable ({import_error!r}); run scripts/install_vllm.sh to install the CPU build",
        allow_module_level=True,
    )
try:
    import kvtier  # noqa: F401
    from kvtier.vllm._testing import open_stores
except Exception as import_error:  # pragma: no cover
    pytest.skip(f"kvtier is not importable ({import_error!r}); run `maturin develop` first", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for the subprocess entry point below
from kvtier.models import ensure_model
from test_vllm import (
    TOKENS_PER_BLOCK,
    StatsDelta,
    assert_same_output,
    engine_kwargs,
    generate,
    random_prompt,
    settle,
)

# A fresh process sees a block another process published within the staleness bound; small here
# so nothing waits. Files of 2 MiB (7 tiny-model blocks) so the tmpfs below holds many of them.
SHARED_OPTIONS = {"shared_staleness_ms": 100, "shared_file_bytes": 2 << 20}
SHARED_TMPFS_BYTES = 48 << 20
ENGINE_PROCESS_TIMEOUT_S = 300

# The prompts engine A computes and publishes: name -> (seed, full blocks).
PROMPTS_OF_A = {"hit": (11, 4), "full_disk": (12, 3), "removed": (13, 3)}


def hit_counts(stats_delta: StatsDelta) -> dict[str, int]:
    return {tier: stats_delta[f"{tier}_hits"] for tier in ("dram", "nvme", "shared")}


def counters(stats: dict, names: tuple[str, ...]) -> dict[str, int]:
    return {name: int(stats.get(name, 0)) for name in names}


FAULT_COUNTERS = (
    "misses",
    "shared_misses",
    "checksum_failures",
    "io_errors",
    "dropped_stores",
    "nvme_dropped_writes",
    "cancelled_writes",
    "shared_publish_errors",
    "shared_dropped_publishes",
    "shared_quarantined_files",
)


# ---------------------------------------------------------------------------------------------
# Engine processes (this file is also their entry point)
# ---------------------------------------------------------------------------------------------


def _phase_publish(model: str, nvme_dir: str, shared_root: str, result_path: str) -> None:
    """Engine A: computes every prompt of PROMPTS_OF_A and publishes it to the shared tier."""
    from vllm import LLM

    llm = LLM(**{**engine_kwargs(Path(nvme_dir), shared_root=shared_root, **SHARED_OPTIONS), "model": model})
    (shared,) = open_stores()
    outputs = {}
    for name, (seed, full_blocks) in PROMPTS_OF_A.items():
        outputs[name] = generate(llm, random_prompt(seed, full_blocks))
        # Flushing publishes the partly filled shared file, so each prompt gets a file of its own
        # (the removal test needs a file engine B never opened).
        settle(llm, shared.store)
    stats = shared.store.stats()
    Path(result_path).write_text(
        json.dumps(
            {
                "outputs": outputs,
                "namespace": shared.namespace_hex,
                "object_bytes": shared.object_bytes,
                "stats": counters(stats, ("puts", "shared_files_published", "shared_publish_errors")),
            }
        )
    )
    shared.store.close()


def _phase_other_model(model: str, nvme_dir: str, shared_root: str, result_path: str) -> None:
    """Engine C: asks for A's first prompt with other weights of the same shape."""
    from vllm import LLM

    llm = LLM(**{**engine_kwargs(Path(nvme_dir), shared_root=shared_root, **SHARED_OPTIONS), "model": model})
    (shared,) = open_stores()
    seed, full_blocks = PROMPTS_OF_A["hit"]
    before = shared.store.stats()
    result = generate(llm, random_prompt(seed, full_blocks))
    after = shared.store.stats()
    Path(result_path).write_text(
        json.dumps(
            {
                "output": result,
                "namespace": shared.namespace_hex,
                "object_bytes": shared.object_bytes,
                "hits": {tier: after[f"{tier}_hits"] - before[f"{tier}_hits"] for tier in ("dram", "nvme", "shared")},
            }
        )
    )
    shared.store.close()


PHASES = {"publish": _phase_publish, "other-model": _phase_other_model}


def run_engine_process(phase: str, result_path: Path, *, model: Path, nvme_dir: Path, shared_root: Path) -> dict:
    started = time.monotonic()
    completed = subprocess.run(
        [sys.executable, __file__, "--phase", phase, str(model), str(nvme_dir), str(shared_root), str(result_path)],
        capture_output=True,
        text=True,
        timeout=ENGINE_PROCESS_TIMEOUT_S,
    )
    print(f"engine process {phase}: {time.monotonic() - started:.1f} s")
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(result_path.read_text())


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


def _try_mount_tmpfs(directory: Path, size_bytes: int) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    completed = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
    )
    return completed.returncode == 0


def _unmount(directory: Path) -> None:
    # The last store's manifest handle is closed only when its Python object is collected
    # (Store.close() keeps it), so a busy mount is retried, then detached lazily.
    for _ in range(3):
        if subprocess.run(["umount", str(directory)], capture_output=True).returncode == 0:
            return
        gc.collect()
        time.sleep(0.2)
    subprocess.run(["umount", "-l", str(directory)], check=True)


@pytest.fixture(scope="module")
def shared_root(tmp_path_factory):
    """(directory, is_tmpfs): the shared root of every engine in this module."""
    root = tmp_path_factory.mktemp("kvtier-shared")
    mounted = _try_mount_tmpfs(root, SHARED_TMPFS_BYTES)
    try:
        yield root, mounted
    finally:
        if mounted:
            _unmount(root)


@pytest.fixture(scope="module")
def engine_a(tmp_path_factory, shared_root):
    """Runs engine A to completion; returns its results and its NVMe directory."""
    root, _ = shared_root
    work_dir = tmp_path_factory.mktemp("engine-a")
    nvme_dir = work_dir / "nvme"
    nvme_dir.mkdir()
    result = run_engine_process(
        "publish", work_dir / "result.json", model=ensure_model("tiny"), nvme_dir=nvme_dir, shared_root=root
    )
    assert result["stats"]["shared_files_published"] >= len(PROMPTS_OF_A), result
    for name, output in result["outputs"].items():
        assert output[2] == 0, f"engine A must compute {name} itself, not restore it"
    result["nvme_dir"] = nvme_dir
    return result


def tiny_model_with_other_weights(directory: Path) -> Path:
    """The tiny model's files with every weight negated: the same shape and KV bytes per block
    (so only the namespace can keep its blocks apart), a different model."""
    import torch
    from safetensors.torch import load_file, save_file

    source = ensure_model("tiny")
    shutil.copytree(source, directory)
    weights = load_file(str(source / "model.safetensors"))
    save_file(
        {name: (-tensor).contiguous() for name, tensor in weights.items()},
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    assert not torch.equal(next(iter(weights.values())), -next(iter(weights.values())))
    return directory


@pytest.fixture(scope="module")
def engine_b(tmp_path_factory, shared_root, engine_a):
    """Engine B in this process: its own empty NVMe directory, A's shared root."""
    from vllm import LLM

    root, _ = shared_root
    nvme_dir = tmp_path_factory.mktemp("engine-b") / "nvme"
    nvme_dir.mkdir()
    started = time.monotonic()
    # disable_log_stats=False: the hit-source test reads vLLM's Prometheus counters.
    # shared_fail_on_full: when test_full_shared_filesystem_keeps_serving fills the root, B must refuse
    # to publish rather than evict; as the evictor it would otherwise remove A's files (least recently
    # used) before the reads those tests expect to hit, depending on when its pass runs.
    llm = LLM(
        **engine_kwargs(nvme_dir, shared_root=str(root), shared_fail_on_full=True, **SHARED_OPTIONS),
        disable_log_stats=False,
    )
    print(f"engine B start: {time.monotonic() - started:.1f} s")
    (shared,) = open_stores()
    assert shared.namespace_hex == engine_a["namespace"], "same model and layout must give the same namespace"
    try:
        yield llm, shared.store, nvme_dir
    finally:
        # Shut the engine down now, so its store closes before the tmpfs is unmounted.
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def cached_tokens_by_source(llm) -> dict[str, float]:
    """vLLM's ``vllm:prompt_tokens_cached_by_source`` counters (tokens per cache-hit source)."""
    return {
        metric.labels["source"]: metric.value
        for metric in llm.get_metrics()
        if metric.name == "vllm:prompt_tokens_cached_by_source"
    }


def a_prompt(name: str) -> list[int]:
    seed, full_blocks = PROMPTS_OF_A[name]
    return random_prompt(seed, full_blocks)


def wait_for_counter(store, name: str, minimum: int, timeout_s: float = 5.0) -> int:
    """Publishing is asynchronous (a background publisher): waits until a counter reaches minimum."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = int(store.stats().get(name, 0))
        if value >= minimum or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# Tests. Order matters: engine C runs before engine B starts (one engine alive at a time).
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.full
def test_other_model_on_same_directories_gets_no_hit(engine_a, shared_root, tmp_path):
    """Full only (an engine start): CI checks that the namespace follows the weights without an engine
    (tests/test_vllm.py::test_namespace_changes_with_dtype_and_block_size, tests/test_vllm_fingerprint.py)."""
    root, _ = shared_root
    other_model = tiny_model_with_other_weights(tmp_path / "tiny-negated")
    result = run_engine_process(
        "other-model", tmp_path / "result.json", model=other_model, nvme_dir=engine_a["nvme_dir"], shared_root=root
    )
    # Same KV bytes per block, so neither the object size nor the layout told the stores apart:
    # only the namespace (model identity) did.
    assert result["object_bytes"] == engine_a["object_bytes"]
    assert result["namespace"] != engine_a["namespace"]
    assert result["hits"] == {"dram": 0, "nvme": 0, "shared": 0}
    assert result["output"][2] == 0, "the other model must compute the prompt, not restore A's blocks"


@pytest.mark.slow
def test_second_engine_hits_blocks_published_by_first(engine_b, engine_a):
    llm, store, _ = engine_b
    sources_before = cached_tokens_by_source(llm)
    delta = StatsDelta(store)
    restored = generate(llm, a_prompt("hit"))
    full_blocks = PROMPTS_OF_A["hit"][1]
    assert restored[2] == full_blocks * TOKENS_PER_BLOCK
    assert hit_counts(delta) == {"dram": 0, "nvme": 0, "shared": full_blocks}
    # A's first run computed the prompt without any cached KV: the recompute baseline.
    assert_same_output(engine_a["outputs"]["hit"], restored)

    # vLLM's per-source counter: no tier of its own for a shared filesystem, so external_unspecified.
    sources_after = cached_tokens_by_source(llm)
    shared_tokens = sources_after.get("external_unspecified", 0) - sources_before.get("external_unspecified", 0)
    assert shared_tokens == full_blocks * TOKENS_PER_BLOCK, (sources_before, sources_after)

    # Loaded shared blocks become DRAM-resident: the next hit is a DRAM hit, reported as "host".
    assert llm.reset_prefix_cache()
    delta = StatsDelta(store)
    again = generate(llm, a_prompt("hit"))
    assert hit_counts(delta) == {"dram": full_blocks, "nvme": 0, "shared": 0}
    host_tokens = cached_tokens_by_source(llm).get("host", 0) - sources_after.get("host", 0)
    assert host_tokens == full_blocks * TOKENS_PER_BLOCK
    assert_same_output(engine_a["outputs"]["hit"], again)


def _fill_filesystem(directory: Path) -> Path:
    """Writes a filler file until the filesystem returns ENOSPC."""
    filler = directory / "filler"
    chunk = b"\xa5" * (1 << 20)
    with open(filler, "wb") as file:
        try:
            while True:
                file.write(chunk)
                file.flush()
        except OSError as error:
            assert error.errno == 28, error  # ENOSPC
    return filler


@pytest.mark.slow
def test_full_shared_filesystem_keeps_serving(engine_b, engine_a, shared_root):
    llm, store, _ = engine_b
    root, is_tmpfs = shared_root
    if not is_tmpfs:
        pytest.skip("needs root to mount a small tmpfs as the shared root")
    filler = _fill_filesystem(root)
    try:
        # Reads need no space: A's blocks still come from the shared tier.
        delta = StatsDelta(store)
        restored = generate(llm, a_prompt("full_disk"))
        assert hit_counts(delta)["shared"] == PROMPTS_OF_A["full_disk"][1]
        assert_same_output(engine_a["outputs"]["full_disk"], restored)

        # Writes fail: a new prompt is computed and kept locally, its publish fails and is counted.
        before = store.stats()
        new_prompt = random_prompt(seed=21, full_blocks=3)
        computed = generate(llm, new_prompt)
        settle(llm, store)
        publish_errors = wait_for_counter(store, "shared_publish_errors", before["shared_publish_errors"] + 1)
        print(
            "full shared filesystem:",
            {name: value - int(before.get(name, 0)) for name, value in counters(store.stats(), FAULT_COUNTERS).items()},
        )
        assert publish_errors > before["shared_publish_errors"]

        assert llm.reset_prefix_cache()
        delta = StatsDelta(store)
        again = generate(llm, new_prompt)
        assert again[2] == 3 * TOKENS_PER_BLOCK and hit_counts(delta)["dram"] + hit_counts(delta)["nvme"] == 3
        assert_same_output(computed, again)
    finally:
        filler.unlink()


def remove_while_written(path: Path, tries: int = 50) -> None:
    """Removes a tree that the store's background publishing may write into meanwhile.

    A file published between rmtree's listing and its rmdir fails it with ENOTEMPTY (as for a user
    removing a live store's directory); the next try removes that file too. Once one try has removed
    the whole tree, the store may recreate it: that is what the test checks next.
    """
    last_error = None
    for _ in range(tries):
        if not path.exists():
            return
        try:
            shutil.rmtree(path)
            return
        except OSError as error:  # ENOTEMPTY, or ENOENT for an entry the store removed itself
            last_error = error
            time.sleep(0.01)
    raise AssertionError(f"{path} kept being refilled while removed: {last_error}")


@pytest.mark.slow
def test_store_directories_removed_while_serving(engine_b, engine_a, shared_root):
    llm, store, nvme_dir = engine_b
    root, _ = shared_root
    # Keep something on B's local tiers from before the removal.
    local_prompt = random_prompt(seed=31, full_blocks=3)
    local_baseline = generate(llm, local_prompt)
    settle(llm, store)
    before = store.stats()

    remove_while_written(nvme_dir)
    for entry in root.iterdir():  # the root may be a mount point: empty it instead of removing it
        remove_while_written(entry) if entry.is_dir() else entry.unlink()

    # A prompt only A computed, in a shared file B never opened: the file is gone, so the load
    # fails; vLLM recomputes (KvtierConnector reports the failed blocks) with the same output.
    recomputed = generate(llm, a_prompt("removed"))
    assert recomputed[2] < PROMPTS_OF_A["removed"][1] * TOKENS_PER_BLOCK
    assert_same_output(engine_a["outputs"]["removed"], recomputed)

    # B's own blocks: still served (DRAM, or the NVMe file, which stays open after its unlink).
    assert llm.reset_prefix_cache()
    assert_same_output(local_baseline, generate(llm, local_prompt))

    # New work: computed and stored; the shared tier recreates its directory and publishing resumes.
    new_prompt = random_prompt(seed=32, full_blocks=3)
    computed = generate(llm, new_prompt)
    settle(llm, store)
    wait_for_counter(store, "shared_files_published", before["shared_files_published"] + 1)
    assert llm.reset_prefix_cache()
    assert_same_output(computed, generate(llm, new_prompt))

    after = store.stats()
    increments = {name: after.get(name, 0) - before.get(name, 0) for name in FAULT_COUNTERS}
    print("store directories removed:", increments)
    assert increments["shared_misses"] + increments["misses"] + increments["io_errors"] >= 1, increments
    published = after["shared_files_published"] - before["shared_files_published"]
    assert published >= 1, f"publishing did not resume after the shared directory was removed: {after}"
    assert any((root / store.namespace_hex).iterdir()), "the shared namespace directory was not recreated"


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == "--phase":
    PHASES[sys.argv[2]](*sys.argv[3:])
