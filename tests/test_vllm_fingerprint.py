"""The model fingerprint in kvtier's vLLM namespace follows the weights' contents, not their path."""

import shutil

import numpy as np
import pytest

pytest.importorskip("vllm")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from kvtier.vllm import model_fingerprint  # noqa: E402


def make_model(directory, seed):
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    rng = np.random.default_rng(seed)
    safetensors_numpy.save_file({"w": rng.standard_normal((64, 64)).astype(np.float32)},
                                str(directory / "model.safetensors"))


def test_same_weights_anywhere_same_fingerprint_and_rewritten_weights_differ(tmp_path):
    make_model(tmp_path / "a", seed=1)
    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere")
    assert model_fingerprint(str(tmp_path / "a")) == model_fingerprint(str(tmp_path / "elsewhere"))
    # A fine-tune saved over the old weights: same path, same size, same config.
    before = model_fingerprint(str(tmp_path / "a"))
    w = safetensors_numpy.load_file(str(tmp_path / "a" / "model.safetensors"))
    safetensors_numpy.save_file({k: -v for k, v in w.items()}, str(tmp_path / "a" / "model.safetensors"))
    assert model_fingerprint(str(tmp_path / "a")) != before
