"""Small local Llama models for testing and benchmarking kvtier with a real vLLM engine.

This module owns the recipe for the models kvtier's integration tests and benchmarks load: a
byte-level BPE tokenizer trained on local text (the running interpreter's standard-library sources)
and a `transformers` Llama configuration with seeded random weights, saved as safetensors. Nothing is
downloaded (it sets ``HF_HUB_OFFLINE=1``); a build is deterministic for a given seed, preset and
Python version, and cached in a directory (``<repo>/.models/<preset>`` by default).

Presets:

- ``kv8b``: the KV cache of Llama-3-8B (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB per token)
  on a deliberately thin body (hidden size 512, MLP 1024) so that prefill on two CPU cores is
  bearable. Use it wherever I/O volume must be realistic (benchmarks).
- ``lean``: a model whose prefill is cheap against its KV cache: 16 layers, 2 KV heads, head dim 128,
  bf16 (16 KiB per token), hidden size 256. It is where loading and storing KV can cost more than
  recomputing it (issue 36's "cheap prefill" case), so kvtier's overheads show there first.
- ``kv8b-fp32``, ``lean-fp32``: their float32 twins (half the layers, the same KV bytes per token) for
  CPUs without bf16 instructions, where bf16 runs about ten times slower; ``kvtier demo`` picks
  ``kv8b-fp32`` there by itself, and OpenAI servers run the twins with ``--dtype float32``.
- ``tiny``: 4 layers, 2 KV heads, head dim 64, float32 (4 KiB per token), for fast tests. float32
  keeps the comparison of logprobs between a recomputed and a restored prefix tight.

CLI: ``python -m kvtier.models --preset kv8b [--out DIR] [--force]`` prints the model directory.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

MODEL_RECIPE_VERSION = 1
"""Bump when the recipe changes in a way that changes the saved files."""

MANIFEST_FILE_NAME = "kvtier-model.json"

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")

# A minimal chat template so that /v1/chat/completions works on these models.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ModelBuildError(RuntimeError):
    """The model could not be built; the message says what to install or change."""


@dataclass(frozen=True)
class ModelPreset:
    """Shape of a preset model. KV bytes per token = 2 * layers * kv_heads * head_dim * dtype size."""

    name: str
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    # The --dtype an OpenAI server is given. None leaves vLLM's "auto", which on CPU runs a float32
    # model in bfloat16; the float32 twins exist to run in float32, so they say so.
    server_dtype: str | None = None
    initializer_range: float = 0.05
    seed: int = 1234
    tokenizer_training_text_bytes: int = 4 << 20

    @property
    def kv_bytes_per_token(self) -> int:
        dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[self.dtype]
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


PRESETS: dict[str, ModelPreset] = {
    "kv8b": ModelPreset(
        name="kv8b",
        num_hidden_layers=32,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        hidden_size=512,
        intermediate_size=1024,
        vocab_size=8192,
        max_position_embeddings=32768,
        dtype="bfloat16",
    ),
    "lean": ModelPreset(
        name="lean",
        num_hidden_layers=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        hidden_size=256,
        intermediate_size=512,
        vocab_size=8192,
        max_position_embeddings=32768,
        dtype="bfloat16",
    ),
    "tiny": ModelPreset(
        name="tiny",
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        hidden_size=256,
        intermediate_size=512,
        vocab_size=4096,
        max_position_embeddings=8192,
        dtype="float32",
    ),
}


def _fp32_twin(preset: ModelPreset) -> ModelPreset:
    """A twin for CPUs without fast bfloat16 (no AVX-512 BF16 or AMX: there bf16 runs about ten times
    slower than float32): half the layers in float32, so the same KV bytes per token (the I/O a
    benchmark moves) at a prefill cost near the bf16 preset's on a CPU that has it."""
    assert preset.dtype == "bfloat16" and preset.num_hidden_layers % 2 == 0
    return replace(
        preset,
        name=f"{preset.name}-fp32",
        num_hidden_layers=preset.num_hidden_layers // 2,
        dtype="float32",
        server_dtype="float32",
    )


FP32_TWINS = {name: f"{name}-fp32" for name in ("kv8b", "lean")}
"""The float32 twin of each bfloat16 preset: the same KV bytes per token, half the layers."""
PRESETS.update({twin: _fp32_twin(PRESETS[name]) for name, twin in FP32_TWINS.items()})

assert PRESETS["kv8b"].kv_bytes_per_token == 128 << 10
assert PRESETS["lean"].kv_bytes_per_token == 16 << 10
assert PRESETS["kv8b-fp32"].kv_bytes_per_token == PRESETS["kv8b"].kv_bytes_per_token
assert PRESETS["lean-fp32"].kv_bytes_per_token == PRESETS["lean"].kv_bytes_per_token


SLOW_BF16_RATIO = 3.0
"""A bfloat16 linear layer this many times slower than float32 means a CPU without bf16 instructions."""


@functools.cache
def bf16_slowdown() -> float:
    """How many times longer a bfloat16 linear layer takes than a float32 one on this CPU, at the
    shape of kv8b's prefill (1,024 tokens, 512 to 1,024). Measured 2026-12-05 on an AVX2-only AMD EPYC:
    about 9x (and kv8b prefilled 10x slower than its float32 twin), where AVX-512 BF16 or AMX make bf16
    at least as fast as float32. Takes about a second there."""
    import torch
    import torch.nn.functional as functional

    def best_seconds(dtype: torch.dtype) -> float:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randn(1024, 512, generator=generator).to(dtype)
        weight = torch.randn(1024, 512, generator=generator).to(dtype)
        functional.linear(tokens, weight)  # the first call pays for kernel selection
        timings = []
        for _ in range(3):
            started = time.perf_counter()
            functional.linear(tokens, weight)
            timings.append(time.perf_counter() - started)
        return min(timings)

    return best_seconds(torch.bfloat16) / max(best_seconds(torch.float32), 1e-9)


def slow_here(preset: str) -> tuple[str, float] | None:
    """``preset``'s float32 twin and how many times slower this CPU computes bfloat16, where that is
    ``SLOW_BF16_RATIO`` or more; None for a preset with no twin or a CPU fast enough."""
    twin = FP32_TWINS.get(preset)
    if twin is None:
        return None
    slowdown = bf16_slowdown()
    return (twin, slowdown) if slowdown >= SLOW_BF16_RATIO else None


def preset_for_this_cpu(preset: str) -> tuple[str, str | None]:
    """``preset``, or its float32 twin where this CPU computes bfloat16 too slowly to run it; with the
    reason to tell the user when it was swapped."""
    slow = slow_here(preset)
    if slow is None:
        return preset, None
    twin, slowdown = slow
    return twin, (
        f"this CPU computes bfloat16 {slowdown:.0f}x slower than float32 (no AVX-512 BF16 or AMX), "
        f"so {preset!r} is run as {twin!r}: the same {PRESETS[preset].kv_bytes_per_token >> 10} KiB of KV "
        f"per token in float32 (pass --preset {preset} to run it anyway)"
    )


def slow_bf16_warning(preset: str) -> str | None:
    """A warning for a benchmark about to run a bfloat16 preset on a CPU that computes it slowly."""
    slow = slow_here(preset)
    if slow is None:
        return None
    twin, slowdown = slow
    return (
        f"warning: this CPU computes bfloat16 {slowdown:.0f}x slower than float32 (no AVX-512 BF16 "
        f"or AMX): {preset!r} will prefill many times slower than its figures in docs/benchmarks.md; "
        f"--preset {twin} has the same KV bytes per token in float32"
    )


def server_dtype_args(preset: str, server_args: Sequence[str] = ()) -> list[str]:
    """``--dtype`` for a ``vllm serve`` of ``preset`` where the preset needs one and the user's own
    ``server_args`` name none."""
    dtype = PRESETS[preset].server_dtype if preset in PRESETS else None
    if dtype is None or any(arg == "--dtype" or arg.startswith("--dtype=") for arg in server_args):
        return []
    return ["--dtype", dtype]


def warn_about_slow_bf16(preset: str) -> None:
    """Tells a benchmark's user on stderr that its bfloat16 preset will run slowly on this CPU."""
    warning = slow_bf16_warning(preset)
    if warning:
        print(warning, file=sys.stderr, flush=True)


def ensure_bench_model(preset: str) -> Path:
    """:func:`ensure_model` for a benchmark: it warns first where the preset will run slowly."""
    warn_about_slow_bf16(preset)
    return ensure_model(preset)


def repo_root() -> Path | None:
    """The repository checkout this module lives in (editable install), or None."""
    candidate = Path(__file__).resolve().parents[2]
    if (candidate / "pyproject.toml").is_file() and (candidate / "crates").is_dir():
        return candidate
    return None


def default_models_dir() -> Path:
    """``$KVTIER_MODELS_DIR``, else ``<repo>/.models``, else ``~/.cache/kvtier/models``."""
    configured = os.environ.get("KVTIER_MODELS_DIR")
    if configured:
        return Path(configured)
    root = repo_root()
    if root is not None:
        return root / ".models"
    return Path.home() / ".cache" / "kvtier" / "models"


def default_model_dir(preset: str) -> Path:
    return default_models_dir() / preset


def _training_text_files() -> list[Path]:
    """Standard-library sources, in a stable order (the tokenizer's training corpus)."""
    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(path for path in stdlib_dir.glob("*.py") if path.is_file())
    if not files:
        raise ModelBuildError(
            f"no Python sources found in {stdlib_dir} to train the tokenizer on; "
            "install the interpreter's standard library sources"
        )
    return files


def _training_text(limit_bytes: int) -> list[str]:
    texts: list[str] = []
    total_bytes = 0
    for path in _training_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total_bytes += len(text)
        if total_bytes >= limit_bytes:
            break
    return texts


def _build_tokenizer(preset: ModelPreset, out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=preset.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(preset.tokenizer_training_text_bytes), trainer=trainer)
    fast_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=preset.max_position_embeddings,
    )
    fast_tokenizer.chat_template = CHAT_TEMPLATE
    fast_tokenizer.save_pretrained(str(out_dir))


def _build_weights(preset: ModelPreset, out_dir: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        head_dim=preset.head_dim,
        max_position_embeddings=preset.max_position_embeddings,
        initializer_range=preset.initializer_range,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        dtype=preset.dtype,
    )
    torch.manual_seed(preset.seed)
    model = LlamaForCausalLM(config)
    model = model.to(getattr(torch, preset.dtype))
    model.eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_manifest(model_dir: Path) -> dict:
    path = Path(model_dir) / MANIFEST_FILE_NAME
    return json.loads(path.read_text())


def _recipe(spec: ModelPreset) -> dict:
    """What a build's manifest must match. How a server runs the model is not part of its files: a
    build from before ``server_dtype`` existed is the same build."""
    preset = {key: value for key, value in asdict(spec).items() if key != "server_dtype"}
    return {"recipe_version": MODEL_RECIPE_VERSION, "preset": preset}


def build_model(preset: str = "tiny", out_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Builds the preset model into ``out_dir`` (default: :func:`default_model_dir`) unless a
    complete build of the same recipe is already there. Returns the model directory.

    The build goes to a temporary sibling directory that is renamed into place at the end, so an
    interrupted build never leaves a half-written model behind.
    """
    if preset not in PRESETS:
        raise ModelBuildError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    spec = PRESETS[preset]
    target_dir = Path(out_dir) if out_dir is not None else default_model_dir(preset)
    expected_recipe = _recipe(spec)

    manifest_path = target_dir / MANIFEST_FILE_NAME
    if manifest_path.is_file() and not force:
        manifest = json.loads(manifest_path.read_text())
        if {k: manifest.get(k) for k in expected_recipe} == expected_recipe:
            return target_dir
        raise ModelBuildError(
            f"{target_dir} holds a model built from another recipe ({manifest.get('preset', {}).get('name')!r}, "
            f"recipe version {manifest.get('recipe_version')}); pass force=True (--force) to rebuild it"
        )
    if target_dir.exists() and any(target_dir.iterdir()) and not manifest_path.is_file() and not force:
        raise ModelBuildError(
            f"{target_dir} exists and is not a kvtier model directory; choose another --out or remove it"
        )

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    staging_dir = Path(tempfile.mkdtemp(prefix=f".{target_dir.name}.building-", dir=target_dir.parent))
    staging_dir.chmod(0o755)
    started = time.monotonic()

    def step(what: str) -> None:  # progress on stderr: a build takes from seconds to minutes
        print(
            f"kvtier: building model {preset!r} [{time.monotonic() - started:5.1f} s] {what}",
            file=sys.stderr,
            flush=True,
        )

    try:
        step("1/3 tokenizer")
        _build_tokenizer(spec, staging_dir)
        from transformers import PreTrainedTokenizerFast

        vocab_size = len(PreTrainedTokenizerFast.from_pretrained(str(staging_dir)))
        step(f"2/3 weights ({vocab_size} tokens of vocabulary)")
        _build_weights(spec, staging_dir, vocab_size)
        step("3/3 checksums and manifest")
        files = {
            path.name: {"bytes": path.stat().st_size, "sha256": _file_digest(path)}
            for path in sorted(staging_dir.iterdir())
            if path.is_file()
        }
        manifest = {
            **expected_recipe,
            "vocab_size": vocab_size,
            "kv_bytes_per_token": spec.kv_bytes_per_token,
            "python_version": sys.version.split()[0],
            "files": files,
        }
        (staging_dir / MANIFEST_FILE_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        if target_dir.exists():
            shutil.rmtree(target_dir)
        os.rename(staging_dir, target_dir)
    except BaseException:
        shutil.rmtree(staging_dir, ignore_errors=True)
        raise
    return target_dir


def ensure_model(preset: str = "tiny", out_dir: str | os.PathLike | None = None) -> Path:
    """The model directory for ``preset``, building it first if missing."""
    return build_model(preset, out_dir, force=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.models",
        description="Build a small local Llama model (random weights, local BPE tokenizer) for vLLM.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--out", help="model directory (default: <repo>/.models/<preset>)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a build is present")
    args = parser.parse_args(argv)
    try:
        model_dir = build_model(args.preset, args.out, force=args.force)
    except ModelBuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    manifest = model_manifest(model_dir)
    print(model_dir)
    print(
        f"preset={args.preset} vocab={manifest['vocab_size']} kv_bytes_per_token={manifest['kv_bytes_per_token']}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
