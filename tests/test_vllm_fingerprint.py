"""The model fingerprint in kvtier's vLLM namespace follows the weights' contents, not their path."""

import os
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
    safetensors_numpy.save_file(
        {"w": rng.standard_normal((64, 64)).astype(np.float32)}, str(directory / "model.safetensors")
    )


def test_same_weights_anywhere_same_fingerprint_and_rewritten_weights_differ(tmp_path):
    make_model(tmp_path / "a", seed=1)
    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere")
    assert model_fingerprint(str(tmp_path / "a")) == model_fingerprint(str(tmp_path / "elsewhere"))
    # A fine-tune saved over the old weights: same path, same size, same config.
    before = model_fingerprint(str(tmp_path / "a"))
    w = safetensors_numpy.load_file(str(tmp_path / "a" / "model.safetensors"))
    safetensors_numpy.save_file({k: -v for k, v in w.items()}, str(tmp_path / "a" / "model.safetensors"))
    assert model_fingerprint(str(tmp_path / "a")) != before


def test_weights_rewritten_in_place_with_same_size_and_mtime_change_the_fingerprint(tmp_path):
    """A filesystem with coarse timestamps (or a copy tool that keeps them) can leave a rewritten
    weight file with its old size and mtime; the fingerprint must still follow the bytes."""
    make_model(tmp_path / "m", seed=1)
    weights = tmp_path / "m" / "model.safetensors"
    before = model_fingerprint(str(tmp_path / "m"))
    stat = weights.stat()
    # Rewrite the last bytes of the tensor data in place (same inode, same size), then put the old
    # mtime back, as a same-tick rewrite on a coarse-mtime filesystem would leave it.
    with open(weights, "r+b") as f:
        f.seek(-16, 2)
        tail = f.read(16)
        f.seek(-16, 2)
        f.write(bytes(b ^ 0xFF for b in tail))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = weights.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (stat.st_size, stat.st_mtime_ns, stat.st_ino)
    assert model_fingerprint(str(tmp_path / "m")) != before
