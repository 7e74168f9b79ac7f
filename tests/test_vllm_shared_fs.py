"""Two real (CPU) vLLM engines sharing KV through GlusterFS: engine A (a subprocess) computes and
publishes three prompts through node A's mount; engine B (this process) restores A's prefix from the
shared tier through node B's mount, with GlusterFS's default client caching (the harder mode: see
docs/shared-tier.md, "GlusterFS"). Same engine set-up as tests/test_vllm_tiers.py, whose helpers it uses.

Run: ``.venv/bin/python -m pytest tests/test_vllm_shared_fs.py -m slow -v -s`` (root, GlusterFS).
"""

from __future__ import annotations

import contextlib
import gc
import os
import time

import pytest

from fs_fixtures import DistFs
from kvtier.models import ensure_model
from kvtier.vllm._testing import open_stores
from test_vllm_tiers import (  # skips this module too where vLLM or kvtier is not importable
    PROMPTS_OF_A,
    SHARED_OPTIONS,
    TOKENS_PER_BLOCK,
    StatsDelta,
    a_prompt,
    assert_same_output,
    engine_kwargs,
    generate,
    hit_counts,
    run_engine_process,
)


@pytest.mark.slow
@pytest.mark.glusterfs
def test_engine_b_restores_engine_a_prefix_through_glusterfs(glusterfs_fs: DistFs, tmp_path) -> None:
    from vllm import LLM

    node_a, node_b = glusterfs_fs.nodes("default", f"vllm-{os.getpid()}-{time.time_ns()}")
    nvme_a = tmp_path / "a" / "nvme"
    nvme_b = tmp_path / "b" / "nvme"
    nvme_a.mkdir(parents=True)
    nvme_b.mkdir(parents=True)
    started = time.monotonic()
    result = run_engine_process(
        "publish", tmp_path / "a" / "result.json", model=ensure_model("tiny"), nvme_dir=nvme_a, shared_root=node_a
    )
    assert result["stats"]["shared_files_published"] >= len(PROMPTS_OF_A), result
    print(f"\nengine A (node A's GlusterFS mount) done in {time.monotonic() - started:.0f} s")
    llm = LLM(**engine_kwargs(nvme_b, shared_root=str(node_b), **SHARED_OPTIONS))
    try:
        (shared,) = open_stores()
        assert shared.namespace_hex == result["namespace"], "same model and layout must give the same namespace"
        full_blocks = PROMPTS_OF_A["hit"][1]
        delta = StatsDelta(shared.store)
        restored = generate(llm, a_prompt("hit"))
        assert restored[2] == full_blocks * TOKENS_PER_BLOCK, restored
        assert hit_counts(delta) == {"dram": 0, "nvme": 0, "shared": full_blocks}
        assert_same_output(result["outputs"]["hit"], restored)
        stats = shared.store.stats()
        assert stats["checksum_failures"] == 0 and stats["shared_quarantined_files"] == 0, stats
        print(f"engine B (node B's mount) restored {restored[2]} tokens from the shared tier, same output as A")
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
