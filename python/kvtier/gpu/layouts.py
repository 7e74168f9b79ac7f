"""vLLM's GPU KV-cache layouts and the model shapes the GPU benchmark builds them for.

vLLM 0.32 describes a KV cache as logical ``[L, B, H, N, C]`` (layers, blocks, KV heads, tokens per
block, content: K and V of a head side by side, ``2 * head_dim``) with a physical permutation
(``vllm.v1.kv_cache_layout.KVCacheLayout``). The transfers need each block's bytes as rows of
``(num_blocks, page_bytes)`` tensors, which every block-compact layout gives:

- ``nhd``: FlashAttention's default, ``[L, B, N, H, C]``, one tensor per layer;
- ``hnd``: FlashInfer's, ``[L, B, H, N, C]``, one tensor per layer;
- ``cross-layer``: ``[B, L, N, H, C]``, one tensor for all layers (a block is one page);
- ``kv-split``: vLLM before the canonical layouts, ``[2, B, N, H, D]`` per layer: K and V are
  separate halves, two tensors per layer (each block is two pages per layer);
- ``mla``: MLA's single latent per token, ``[L, B, N, latent]`` (DeepSeek-V3's 576 values).

The layout changes where a block's bytes lie, not how many there are: the benchmark checks that every
one of them survives a store and a restore into other block ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    latent: int = 0  # MLA: values per token, one latent for all heads

    def token_bytes(self, dtype: torch.dtype) -> int:
        per_layer = self.latent if self.latent else 2 * self.kv_heads * self.head_dim
        return self.layers * per_layer * torch.empty((), dtype=dtype).element_size()


MODELS = {
    "llama-3-8b": ModelShape("llama-3-8b", layers=32, kv_heads=8, head_dim=128),
    "qwen3-32b": ModelShape("qwen3-32b", layers=64, kv_heads=8, head_dim=128),
    "deepseek-v3-mla": ModelShape("deepseek-v3-mla", layers=61, kv_heads=1, head_dim=0, latent=576),
}
LAYOUTS = ("nhd", "hnd", "cross-layer", "kv-split", "mla")


def layouts_for(model: ModelShape) -> tuple[str, ...]:
    return ("mla",) if model.latent else ("nhd", "hnd", "cross-layer", "kv-split")


@dataclass
class PagedCache:
    """A paged KV cache in one of vLLM's layouts, and its block rows as the transfers see them."""

    layout: str
    storage: list[torch.Tensor]  # the tensors as vLLM allocates them (kept alive)
    rows: list[torch.Tensor]  # (num_blocks, page_bytes) uint8 views of the same memory

    @property
    def block_bytes(self) -> int:
        return sum(r.shape[1] for r in self.rows)

    def block(self, block_id: int) -> torch.Tensor:
        """A copy of the block's bytes, page by page (for comparing)."""
        return torch.cat([r[block_id] for r in self.rows])


def paged_cache(
    model: ModelShape,
    layout: str,
    num_blocks: int,
    block_tokens: int,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
) -> PagedCache:
    """Allocates the cache (uninitialized: fill it with ``fill_random``)."""
    L, B, N, H, D = model.layers, num_blocks, block_tokens, model.kv_heads, model.head_dim
    empty = lambda *shape: torch.empty(shape, dtype=dtype, device=device)  # noqa: E731
    if layout == "mla":
        if not model.latent:
            raise ValueError(f"{model.name} has no MLA latent")
        storage = [empty(B, N, model.latent) for _ in range(L)]
    elif model.latent:
        raise ValueError(f"{model.name} is an MLA model: its only layout is mla")
    elif layout == "nhd":
        storage = [empty(B, N, H, 2 * D) for _ in range(L)]
    elif layout == "hnd":
        storage = [empty(B, H, N, 2 * D) for _ in range(L)]
    elif layout == "cross-layer":
        storage = [empty(B, L, N, H, 2 * D)]
    elif layout == "kv-split":
        storage = [empty(2, B, N, H, D) for _ in range(L)]
    else:
        raise ValueError(f"unknown layout {layout!r}; one of {', '.join(LAYOUTS)}")
    # ``view`` (never ``reshape``): the rows must alias the cache, not copy it.
    halves = [half for tensor in storage for half in tensor.unbind(0)] if layout == "kv-split" else storage
    rows = [tensor.view(torch.uint8).view(B, -1) for tensor in halves]
    return PagedCache(layout, storage, rows)


def fill_random(cache: PagedCache, seed: int) -> None:
    generator = torch.Generator(device=cache.rows[0].device).manual_seed(seed)
    for row in cache.rows:
        row.random_(0, 256, generator=generator)
