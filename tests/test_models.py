"""The preset models' shapes, and the float32 twins chosen on CPUs that compute bfloat16 slowly."""

from __future__ import annotations

import json
import math
import platform
from dataclasses import asdict
from pathlib import Path

import pytest

from kvtier import models


def test_each_bf16_preset_has_a_float32_twin_with_the_same_kv_bytes_per_token():
    bf16_presets = {name for name, spec in models.PRESETS.items() if spec.dtype == "bfloat16"}
    assert set(models.FP32_TWINS) == bf16_presets
    for name, twin_name in models.FP32_TWINS.items():
        preset, twin = models.PRESETS[name], models.PRESETS[twin_name]
        assert twin.dtype == "float32" and twin.name == twin_name
        assert twin.kv_bytes_per_token == preset.kv_bytes_per_token
        assert twin.num_hidden_layers * 2 == preset.num_hidden_layers
        assert (twin.hidden_size, twin.head_dim, twin.vocab_size) == (
            preset.hidden_size,
            preset.head_dim,
            preset.vocab_size,
        )


def test_a_bf16_preset_is_swapped_for_its_twin_only_where_bf16_is_slow(monkeypatch):
    monkeypatch.setattr(models, "bf16_slowdown", lambda: 9.7)
    preset, reason = models.preset_for_this_cpu("kv8b")
    assert preset == "kv8b-fp32"
    assert reason is not None and "10x slower" in reason and "--preset kv8b" in reason and "128 KiB" in reason
    assert models.preset_for_this_cpu("tiny") == ("tiny", None)
    assert "--preset lean-fp32" in (models.slow_bf16_warning("lean") or "")
    assert models.slow_bf16_warning("kv8b-fp32") is None

    monkeypatch.setattr(models, "bf16_slowdown", lambda: 0.8)
    assert models.preset_for_this_cpu("kv8b") == ("kv8b", None)
    assert models.slow_bf16_warning("kv8b") is None


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the CPU flags read here are x86's")
def test_the_bf16_probe_agrees_with_the_cpus_instructions():
    """Where the CPU has bf16 instructions the probe must not swap; where it has not even AVX-512 (an
    AVX2-only part, where kv8b prefilled 10x slower than its twin) it must."""
    slowdown = models.bf16_slowdown()
    assert math.isfinite(slowdown) and slowdown > 0
    flags = _cpu_flags()
    if flags & {"avx512_bf16", "amx_bf16"}:
        assert slowdown < models.SLOW_BF16_RATIO, slowdown
    elif "avx512f" not in flags:
        assert slowdown >= models.SLOW_BF16_RATIO, slowdown


def test_a_server_runs_a_float32_twin_in_float32_unless_told_otherwise():
    """CPU vLLM's --dtype auto runs a float32 model in bfloat16: the twin would then hold half its KV
    bytes and compute as slowly as the preset it stands in for."""
    from kvtier.bench import serve_servers

    assert models.server_dtype_args("kv8b-fp32") == ["--dtype", "float32"]
    assert models.server_dtype_args("lean-fp32", ["--dtype=bfloat16"]) == []
    assert models.server_dtype_args("kv8b") == [] and models.server_dtype_args("tiny") == []
    plan = {"max_model_len": 4096, "vllm_blocks": 0, "preset": "kv8b-fp32", "server_args": []}
    assert serve_servers.server_args(plan)[-2:] == ["--dtype", "float32"]
    plan.update(server_args=["--dtype", "bfloat16"])
    assert serve_servers.server_args(plan).count("--dtype") == 1


def test_a_build_from_before_server_dtype_is_still_the_same_build(tmp_path):
    preset = models.PRESETS["tiny"]
    recipe = {key: value for key, value in asdict(preset).items() if key != "server_dtype"}
    manifest = {"recipe_version": models.MODEL_RECIPE_VERSION, "preset": recipe}
    (tmp_path / models.MANIFEST_FILE_NAME).write_text(json.dumps(manifest))
    assert models.build_model("tiny", tmp_path) == tmp_path  # accepted as is, not rebuilt
    assert sorted(path.name for path in tmp_path.iterdir()) == [models.MANIFEST_FILE_NAME]
