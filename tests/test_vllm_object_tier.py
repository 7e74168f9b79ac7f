"""Two real (CPU) vLLM engines sharing KV through an S3 bucket (Ceph's RADOS gateway on 127.0.0.1,
the fixture of tests/test_object_tier.py): engine A (a subprocess) computes a prompt, which is the
recompute baseline, and publishes its blocks to the object tier; engine B, a fresh node (this process,
empty local store), gets the prefix from the bucket with the same output.

Run: ``.venv/bin/python -m pytest tests/test_vllm_object_tier.py -v -s`` (root, radosgw; skips with the
reason where the gateway cannot start). In CI: two tiny-model engine starts and the gateway's bring-up,
about 60 s here (it was opt-in until the engines proved that quick).
"""

from __future__ import annotations

import contextlib
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.models import ensure_model
from kvtier.vllm._testing import open_stores
from test_object_tier import BUCKET, rgw  # noqa: F401 - the module's server fixture
from test_vllm_tiers import (  # skips this module too where vLLM or kvtier is not importable
    TOKENS_PER_BLOCK,
    StatsDelta,
    assert_same_output,
    engine_kwargs,
    generate,
    random_prompt,
    settle,
)

FULL_BLOCKS = 4
PROMPT_SEED = 28


def _phase_publish(options_json: str, nvme_dir: str, result_path: str) -> None:
    """Engine A: computes the prompt and publishes its blocks to the bucket."""
    from vllm import LLM

    llm = LLM(**engine_kwargs(Path(nvme_dir), **json.loads(options_json)))
    (store,) = open_stores()
    output = generate(llm, random_prompt(PROMPT_SEED, FULL_BLOCKS))
    settle(llm, store.store)
    stats = store.store.stats()
    result = {"output": output, "namespace": store.namespace_hex, "published": stats["bucket_segments_published"]}
    Path(result_path).write_text(json.dumps(result))
    store.store.close()


@pytest.mark.slow
@pytest.mark.radosgw
def test_fresh_engine_gets_its_prefix_from_the_bucket(rgw, tmp_path, monkeypatch) -> None:  # noqa: F811
    from vllm import LLM

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", rgw.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", rgw.secret_key)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    options = {
        "bucket_url": f"s3://{BUCKET}/vllm-{time.time_ns()}",
        "bucket_endpoint": rgw.endpoint,
        "bucket_segment_bytes": 8 << 20,
        "bucket_refresh_ms": 100,
    }
    nvme_a, nvme_b = tmp_path / "a" / "nvme", tmp_path / "b" / "nvme"
    nvme_a.mkdir(parents=True)
    nvme_b.mkdir(parents=True)
    ensure_model("tiny")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, __file__, "--phase", json.dumps(options), str(nvme_a), str(tmp_path / "a.json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "a.json").read_text())
    assert result["published"] >= 1, result
    print(f"\nengine A computed and published in {time.monotonic() - started:.0f} s")
    llm = LLM(**engine_kwargs(nvme_b, **options))
    try:
        (store,) = open_stores()
        assert store.namespace_hex == result["namespace"], "same model and layout must give the same namespace"
        delta = StatsDelta(store.store)
        restored = generate(llm, random_prompt(PROMPT_SEED, FULL_BLOCKS))
        assert restored[2] == FULL_BLOCKS * TOKENS_PER_BLOCK, restored
        assert delta["bucket_hits"] == FULL_BLOCKS and delta["dram_hits"] == 0 and delta["nvme_hits"] == 0
        assert_same_output(result["output"], restored)
        stats = store.store.stats()
        assert stats["bucket_verify_failures"] == 0 and stats["bucket_auth_failures"] == 0, stats
        print(f"engine B restored {restored[2]} tokens from the bucket, same output as engine A's recompute")
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--phase":
    _phase_publish(*sys.argv[2:])
