"""Keys and namespaces: what must match for a stored block to be valid in an engine."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
    CANONICAL_FORMAT_VERSION as CANONICAL_PAGE_FORMAT_VERSION,
)
from vllm.v1.kv_offload.base import (
    OffloadKey,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvtier.vllm.options import NAMESPACE_FORMAT_VERSION, SEEDED_HASH_ALGOS, STABLE_HASH_ALGOS, KvtierVllmConfigError

KVTIER_KEY_BYTES = 32


def kvtier_key(offload_key: OffloadKey) -> bytes:
    """The 32-byte kvtier key of a vLLM offload key (block hash + 4-byte KV-cache group index).

    A sha256 block hash of group 0 is used as is (the key is the engine's chained prefix hash);
    any other hash length or group is folded into 32 bytes with sha256.
    """
    block_hash, group_bytes = offload_key[:-4], offload_key[-4:]
    if len(block_hash) == KVTIER_KEY_BYTES and group_bytes == b"\0\0\0\0":
        return bytes(block_hash)
    return hashlib.sha256(b"kvtier.vllm.key\0" + bytes(offload_key)).digest()


def model_fingerprint(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """sha256 over the model's config.json, its safetensors index and the full contents of its weight files.

    Contents, not sizes or timestamps: a model rewritten in place (a fine-tune saved over the old
    weights) must never be served the old model's KV blocks, and two replicas holding the same weights
    under different paths or copy times must share them. A hub name is resolved to the snapshot vLLM
    loaded (the Hugging Face cache, or ``download_dir``) and that snapshot's files are fingerprinted:
    a name and a branch ("main") stand for different weights after every upload (issue 37, item 10).
    A hub model with no local snapshot is named by its revision only when that is a commit hash
    (immutable); otherwise it is refused with the fix.

    Every call reads and hashes every weight file; nothing is cached. A cache needs a key that no
    rewrite can keep, and file metadata is not one: size and mtime survive a same-tick rewrite on a
    filesystem with coarse timestamps (and ``os.utime`` or a copy tool can put an old mtime back),
    ctime has the same granularity, and the inode survives any in-place write. A cache would also save
    nothing where it matters: a server process starts one engine and fingerprints once. The cost, on
    this machine's 2 cores (sha256 with SHA-NI, 8 MiB reads): 0.8 s per GiB from the page cache,
    1.1 s per GiB from disk, so about 15 s for a 16 GB (8B bf16) model at engine start, beside the
    time vLLM takes to load the same bytes.
    """
    model_dir = Path(model)
    digest = hashlib.sha256()
    if not model_dir.is_dir():
        snapshot = _hub_snapshot(model, revision, download_dir)
        if snapshot is None:
            if revision is None or not _COMMIT.fullmatch(revision):
                raise KvtierVllmConfigError(
                    f"kvtier cannot find the local snapshot of the hub model {model!r} (revision "
                    f"{revision or 'main'}), so it cannot tell its weights from a later upload's. Pass --revision "
                    "with a commit hash, or serve a local directory"
                )
            digest.update(f"hub:{model}@{revision}".encode())
            return digest.hexdigest()
        model_dir = snapshot
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise KvtierVllmConfigError(f"model directory {model_dir} has no config.json; kvtier fingerprints it")
    digest.update(b"config.json\0" + config_path.read_bytes())
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        digest.update(b"index\0" + index_path.read_bytes())
    for weight_path in sorted(model_dir.glob("*.safetensors")):
        size_bytes, content = _file_sha256(weight_path)
        digest.update(f"{weight_path.name}\0{size_bytes}\0{content}\0".encode())
    return digest.hexdigest()


_COMMIT = re.compile(r"[0-9a-f]{40}")


def _hub_snapshot(model: str, revision: str | None, download_dir: str | None) -> Path | None:
    """The directory of the snapshot a hub name and revision resolve to in the local cache, or None."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=model, revision=revision, cache_dir=download_dir, local_files_only=True))
    except Exception:
        return None


def _file_sha256(path: Path) -> tuple[int, str]:
    """(bytes read, sha256 of those bytes) of a file, read now (never from a cache)."""
    digest = hashlib.sha256()
    size_bytes = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
            size_bytes += len(chunk)
    return size_bytes, digest.hexdigest()


def check_hash_algo(hash_algo: str | None) -> None:
    """Refuses prefix-hash algorithms whose hashes differ between processes.

    kvtier persists blocks under their hashes; a hash seeded per process would never hit after a
    restart and, shared between replicas, would make keys meaningless.
    """
    if hash_algo is None or hash_algo in STABLE_HASH_ALGOS:
        return
    if hash_algo in SEEDED_HASH_ALGOS:
        if os.environ.get("PYTHONHASHSEED") not in (None, "", "random"):
            return
        raise KvtierVllmConfigError(
            f"prefix_caching_hash_algo={hash_algo!r} seeds block hashes per process unless PYTHONHASHSEED "
            "is set, so blocks kvtier persists could never be found again. Use "
            "--prefix-caching-hash-algo sha256 (the default) or sha256_cbor, or export the same "
            "PYTHONHASHSEED for every engine process."
        )
    raise KvtierVllmConfigError(
        f"prefix_caching_hash_algo={hash_algo!r} is unknown to kvtier; use sha256 (the default) or sha256_cbor"
    )


def namespace_description(
    config: OffloadingConfig,
    *,
    page_bytes_per_layer: list[int],
    hash_algo: str | None,
    model_revision: str | None = None,
    salt: str = "",
    download_dir: str | None = None,
) -> dict[str, Any]:
    """Everything that must match for a stored block to be valid in this engine."""
    parallel = config.parallel
    return {
        "format": NAMESPACE_FORMAT_VERSION,
        "engine": "vllm",
        # A local model is identified by its contents alone, so replicas that mount the same weights
        # at different paths share blocks; a hub model by its name and revision.
        "model": config.model.name if not Path(config.model.name).is_dir() else "local",
        "model_fingerprint": model_fingerprint(config.model.name, model_revision, download_dir),
        "kv_dtype": config.model.dtype,
        "kv_cache_layout": config.kv_cache_layout,
        "canonical_layout": config.canonical_layout,
        "groups": [
            {"tokens_per_block": group.tokens_per_block, "layers": list(group.layer_names)} for group in config.groups
        ],
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "page_bytes_per_layer": page_bytes_per_layer,
        "prefix_caching_hash_algo": hash_algo,
        "parallel": {
            "tp_size": parallel.tp_size,
            "pp_size": parallel.pp_size,
            "pcp_size": parallel.pcp_size,
            "dcp_size": parallel.dcp_size,
            "world_size": parallel.world_size,
            "rank": parallel.rank,
        },
        "salt": salt,
    }


def rank_independent_objects(config: OffloadingConfig) -> bool:
    """Whether this engine stores blocks in the rank-independent ("canonical") object layout, which
    engines of every TP size share: vLLM certifies that each rank's KV pages are a head shard of one
    full-attention page (no MLA, no replicated or per-token-head-scaled KV, no context parallelism).
    Each rank checks its layers' certified mappings again before it places a byte (fail closed)."""
    parallel = config.parallel
    return bool(getattr(parallel, "is_parallelism_agnostic", False)) and parallel.world_size == parallel.tp_size


def service_namespace_description(
    config: OffloadingConfig,
    *,
    hash_algo: str | None,
    model_revision: str | None = None,
    salt: str = "",
    download_dir: str | None = None,
) -> dict[str, Any]:
    """The namespace of the host-service layout, the same in the scheduler and in every rank.

    Rank-independent layout (``rank_independent_objects``): a block object is the full page of
    every layer, in layer order, each page as vLLM's canonical mapping lays it out (all KV heads);
    rank r of any TP size writes and reads its heads there, so the TP size is not part of the
    namespace and engines of different TP sizes share blocks.

    Otherwise a block object holds every rank's slice in rank order (each slice: the rank's page of
    every layer, in layer order), so the rank is not part of it; the tensor-parallel size is, since
    it decides what a slice holds.
    """
    description = namespace_description(
        config,
        page_bytes_per_layer=[],
        hash_algo=hash_algo,
        model_revision=model_revision,
        salt=salt,
        download_dir=download_dir,
    )
    del description["page_bytes_per_layer"]
    del description["parallel"]["rank"]
    if rank_independent_objects(config):
        del description["parallel"]["tp_size"]
        del description["parallel"]["world_size"]
        description["object_layout"] = f"canonical layer pages v{CANONICAL_PAGE_FORMAT_VERSION}"
        description["object_bytes"] = config.worker_kv_bytes_per_block * config.parallel.tp_size
        return description
    description["object_layout"] = "rank-major slices of layer pages"
    description["slice_bytes"] = config.worker_kv_bytes_per_block
    return description


def canonical_placement(refs: list[Any], page_bytes: int) -> list[tuple[int, int, int]]:
    """Where this rank's slice (its page of each layer, in layer order) lies in a rank-independent
    block object: ``(slice_offset, object_offset, len)`` runs, from vLLM's certified per-layer
    canonical page mappings. Raises when a layer has none: the scheduler put this engine in a
    namespace shared across TP sizes, and opaque per-rank bytes must not land there."""
    runs: list[tuple[int, int, int]] = []
    object_base = 0
    for layer_index, ref in enumerate(refs):
        mapping = getattr(ref, "mapping", None)
        if (
            mapping is None
            or not mapping.parallelism_agnostic
            or mapping.num_writers != 1
            or mapping.local_page_size_bytes != page_bytes
        ):
            raise KvtierVllmConfigError(
                f"kvtier: vLLM declared this engine's KV layout parallelism-agnostic, but layer {layer_index} has "
                f"no certified canonical mapping ({mapping!r}, page {page_bytes} bytes); kvtier will not store "
                "rank-dependent bytes in a namespace shared across TP sizes. Report this layout to kvtier, and set "
                "namespace_salt to keep this engine's blocks apart meanwhile"
            )
        local_base = layer_index * page_bytes
        for run in mapping.runs:
            for fragment in range(run.num_fragments):
                runs.append(
                    (
                        local_base + run.local_offset + fragment * run.local_stride,
                        object_base + run.canonical_offset + fragment * run.canonical_stride,
                        run.fragment_size,
                    )
                )
        object_base += mapping.canonical_page_size_bytes
    runs.sort()
    return runs


def namespace_digest(description: Mapping[str, Any]) -> bytes:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).digest()
