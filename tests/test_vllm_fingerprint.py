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


def hub_snapshot(cache, repo, commit, seed, ref="main"):
    """A model in a Hugging Face cache as an upload leaves it: snapshots/<commit>/ and refs/<ref>."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    make_model_dir = repo_dir / "snapshots" / commit
    make_model_dir.parent.mkdir(parents=True, exist_ok=True)
    make_model(make_model_dir, seed)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / ref).write_text(commit)


def test_a_hub_model_is_fingerprinted_by_the_snapshot_it_resolves_to(tmp_path, monkeypatch):
    """Issue 37, item 10: a hub name was fingerprinted as "hub:<name>@main", so after the owner
    uploaded new weights, KV computed with the old ones was served to the new ones."""
    cache = tmp_path / "hub"
    # The cache vLLM downloads into when no --download-dir is given (read when a download resolves).
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    first, second = "a" * 40, "b" * 40
    hub_snapshot(cache, "org/model", first, seed=1)
    before = model_fingerprint("org/model")
    assert before == model_fingerprint("org/model", first), "main resolves to the same snapshot"
    hub_snapshot(cache, "org/model", second, seed=2)  # a new upload moves main
    assert model_fingerprint("org/model") != before
    assert model_fingerprint("org/model", first) == before, "a pinned commit keeps its fingerprint"
    # The same weights fetched into another directory (vLLM's --download-dir) share blocks.
    other = tmp_path / "download-dir"
    hub_snapshot(other, "org/model", first, seed=1)
    assert model_fingerprint("org/model", first, download_dir=str(other)) == before


def test_a_hub_model_with_no_local_snapshot_needs_a_commit_hash(tmp_path, monkeypatch):
    from kvtier.vllm import KvtierVllmConfigError

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(KvtierVllmConfigError, match="--revision with a commit hash"):
        model_fingerprint("org/elsewhere")
    assert model_fingerprint("org/elsewhere", "c" * 40) != model_fingerprint("org/elsewhere", "d" * 40)
