"""Benchmark workload: model KV shapes, object kinds, prompt sizes and the deterministic block data.

This module owns *what* the I/O benchmark moves, so that every system measured (fio, kvtier, LMCache
in its own virtualenv) moves the same bytes. It depends on numpy only: the LMCache runner
(`lmcache_runner.py`, run by another interpreter that has no kvtier) imports it by file path.

Data layout: one page-aligned pool of pseudo-random bytes (PCG64 raw stream, stable across numpy
versions) per run. Object ``i`` of a prompt is a zero-copy view into the pool at a 4 KiB-aligned offset
``((i + start_slot) * stride) mod slot_count``; the stride is coprime to the slot count, so no two
objects of a prompt share an offset and every object has different contents. A bug that returns
another block's bytes, a stale block, zeros or a torn block is therefore detected by comparing with
the view. The pool is at most ``pool_bytes_limit`` (1 GiB) however long the prompt, which keeps the
benchmark's memory at pool + one prompt of destination buffers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import mmap
import os
import re

import numpy as np

PAGE_BYTES = 4096
KIB = 1024
MIB = 1024 * 1024
GIB = 1024 * 1024 * 1024

DEFAULT_POOL_BYTES_LIMIT = 1 * GIB


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The KV-cache geometry of one model (per tensor-parallel rank = whole model here)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int  # 2 for bf16/fp16

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


MODEL_SHAPES: dict[str, ModelShape] = {
    # Llama-3-8B / Llama-3.1-8B: 32 layers, GQA 8 KV heads, head dim 128, bf16 -> 128 KiB per token.
    "llama3-8b": ModelShape("Llama-3-8B", num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2),
    # Llama-3-70B: 80 layers, 8 KV heads, head dim 128, bf16 -> 320 KiB per token.
    "llama3-70b": ModelShape("Llama-3-70B", num_layers=80, num_kv_heads=8, head_dim=128, dtype_bytes=2),
    # Qwen2.5-7B: 28 layers, 4 KV heads, head dim 128, bf16 -> 56 KiB per token.
    "qwen2.5-7b": ModelShape("Qwen2.5-7B", num_layers=28, num_kv_heads=4, head_dim=128, dtype_bytes=2),
}

# Tokens per stored object: engine-native block sizes (vLLM's 16, a large-block 128) and LMCache's
# default 256-token chunk.
OBJECT_KINDS: dict[str, int] = {"block16": 16, "block128": 128, "chunk256": 256}


def parse_token_count(text: str) -> int:
    """'8k' -> 8192, '512' -> 512, '1m' -> 1048576."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not match:
        raise ValueError(f"cannot read token count {text!r}: write it like 8k, 32k or 512")
    value = int(match.group(1))
    suffix = match.group(2).lower()
    return value * {"": 1, "k": 1024, "m": 1024 * 1024}[suffix]


def format_token_count(tokens: int) -> str:
    if tokens % 1024 == 0:
        return f"{tokens // 1024}K"
    return str(tokens)


def parse_object_kind(text: str) -> tuple[str, int]:
    """'block16' -> ('block16', 16); also accepts 'blockN' / 'chunkN' for any N."""
    name = text.strip()
    if name in OBJECT_KINDS:
        return name, OBJECT_KINDS[name]
    match = re.fullmatch(r"(block|chunk)(\d+)", name)
    if not match or int(match.group(2)) <= 0:
        raise ValueError(f"unknown object kind {text!r}: use one of {', '.join(OBJECT_KINDS)} or blockN / chunkN")
    return name, int(match.group(2))


def format_bytes(num_bytes: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if num_bytes >= size and num_bytes % size == 0:
            return f"{num_bytes // size} {unit}"
    if num_bytes >= MIB:
        return f"{num_bytes / MIB:.1f} MiB"
    return f"{num_bytes} B"


def aligned_buffer(num_bytes: int, prefault: bool = True) -> np.ndarray:
    """A page-aligned, zero-filled uint8 array backed by an anonymous mmap (like a pinned host pool).

    ``prefault`` writes every page once, so that a measurement that fills the buffer does not pay
    (and count as its CPU time) the kernel's first-touch page faults: an engine's KV cache and a
    pinned staging pool are allocated once and touched long before a load."""
    region = mmap.mmap(-1, max(num_bytes, PAGE_BYTES), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = np.frombuffer(region, dtype=np.uint8, count=num_bytes)
    assert array.ctypes.data % PAGE_BYTES == 0
    if prefault:
        array[::PAGE_BYTES] = 0
    return array


def pool_bytes_for(prompt_bytes: int, object_bytes: int, pool_bytes_limit: int = DEFAULT_POOL_BYTES_LIMIT) -> int:
    """Pool size for one run: the prompt itself if small, else the limit (but always >= 2 objects)."""
    pool_bytes = min(prompt_bytes, pool_bytes_limit)
    pool_bytes = max(pool_bytes, 2 * object_bytes)
    return (pool_bytes + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES


def fill_pool(pool: np.ndarray, seed: int) -> None:
    """Fill the pool with the PCG64 raw stream for ``seed`` (deterministic across processes)."""
    words = pool.view(np.uint64)
    bit_generator = np.random.PCG64(seed)
    step_words = 16 * MIB // 8
    for start in range(0, words.size, step_words):
        stop = min(start + step_words, words.size)
        words[start:stop] = bit_generator.random_raw(stop - start)


def make_pool(pool_bytes: int, seed: int) -> np.ndarray:
    pool = aligned_buffer(pool_bytes)
    fill_pool(pool, seed)
    return pool


@dataclasses.dataclass(frozen=True)
class PromptLayout:
    """Where each object of one prompt lives in the pool, and its 32-byte key."""

    object_bytes: int
    object_count: int
    pool_bytes: int
    key_salt: str  # distinguishes repeats and cases, so keys never collide between them
    start_slot: int = 0

    @property
    def slot_count(self) -> int:
        return (self.pool_bytes - self.object_bytes) // PAGE_BYTES + 1

    @property
    def stride(self) -> int:
        """A stride coprime to slot_count, near the golden ratio of it (spreads objects over the pool)."""
        slots = self.slot_count
        stride = max(1, int(slots * 0.6180339887)) | 1
        while math.gcd(stride, slots) != 1:
            stride += 1
        return stride

    def object_offset_bytes(self, index: int) -> int:
        slot = ((index + self.start_slot) * self.stride) % self.slot_count
        return slot * PAGE_BYTES

    def object_view(self, pool: np.ndarray, index: int) -> np.ndarray:
        offset = self.object_offset_bytes(index)
        return pool[offset : offset + self.object_bytes]

    def object_views(self, pool: np.ndarray) -> list[np.ndarray]:
        if self.object_count > self.slot_count:
            raise ValueError(
                f"pool of {self.pool_bytes} bytes has {self.slot_count} distinct object offsets, "
                f"fewer than the {self.object_count} objects of the prompt: raise the pool size"
            )
        return [self.object_view(pool, index) for index in range(self.object_count)]

    def keys(self) -> list[bytes]:
        """Chained 32-byte keys, like an engine's prefix hash: key_i = sha256(key_{i-1} || i)."""
        parent = hashlib.sha256(f"kvtier-bench-io/{self.key_salt}".encode()).digest()
        keys = []
        for index in range(self.object_count):
            parent = hashlib.sha256(parent + index.to_bytes(8, "little")).digest()
            keys.append(parent)
        return keys


def prompt_layout(
    shape: ModelShape,
    prompt_tokens: int,
    tokens_per_object: int,
    key_salt: str,
    pool_bytes: int,
    start_slot: int = 0,
) -> PromptLayout:
    """A prompt of ``prompt_tokens`` tokens cut into whole objects (a partial tail is not stored)."""
    object_bytes = tokens_per_object * shape.kv_bytes_per_token
    object_count = prompt_tokens // tokens_per_object
    if object_count == 0:
        raise ValueError(
            f"a prompt of {prompt_tokens} tokens holds no whole object of {tokens_per_object} tokens: "
            "use a larger --sizes value"
        )
    return PromptLayout(
        object_bytes=object_bytes,
        object_count=object_count,
        pool_bytes=pool_bytes,
        key_salt=key_salt,
        start_slot=start_slot,
    )


def count_wrong_objects(layout: PromptLayout, pool: np.ndarray, received: list[np.ndarray], found: list[bool]) -> int:
    """How many objects reported found whose bytes differ from what was stored."""
    wrong = 0
    for index, (buffer, ok) in enumerate(zip(received, found, strict=True)):
        if not ok:
            continue
        if not np.array_equal(buffer, layout.object_view(pool, index)):
            wrong += 1
    return wrong


def drop_page_cache() -> bool:
    """Writes back and drops the page cache (needs root); False when not permitted, so that callers
    can record that a "cold" read may have come from the page cache."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as control:
            control.write("3\n")
        return True
    except OSError:
        return False


def throwaway_key_file(directory: str, name: str = "encryption.key") -> str:
    """A benchmark run's throwaway ``encryption_key_file``: 32 random bytes, mode 0600, made once in
    ``directory`` (the run's scratch, removed with it; never under a shared root, where the store
    refuses a key). Only its path goes into plans and logs."""
    key_file = os.path.join(directory, name)
    if not os.path.exists(key_file):
        descriptor = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            out.write(os.urandom(32))
    return key_file
