"""Where each byte of one rank's slice of a block lies: in the rank's KV-cache pages and in the block
object in the host service's pool. Pure layout math (numpy only), so that it is tested where there is
no GPU.

A rank's KV cache is a list of tensors, one per layer, each ``(num_blocks, page_bytes)`` bytes (vLLM
0.32's canonical view of every GPU layout: FlashAttention's and FlashInfer's per-layer caches, MLA's
latent cache). The rank's *slice* of a block is its page of every tensor, in tensor order. The
service's placement runs (``ServiceClient.pool()["placement_runs"]``, ``(slice_offset,
object_offset, len)``) say where each piece of the slice lies inside the block object: one run at
``rank * slice_bytes`` by default, or many interleaved runs when the object is vLLM's
parallelism-agnostic canonical page and the rank holds some of its heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class PlanError(ValueError):
    """The tensors and the placement do not describe one slice (a bug or an unsupported layout)."""


@dataclass(frozen=True)
class Segment:
    """``size`` bytes at ``page_offset`` in tensor ``tensor``'s page of a block lie at
    ``object_offset`` in the block's object."""

    tensor: int
    page_offset: int
    object_offset: int
    size: int


class CopyPlan:
    """One rank's slice as segments that each lie in one tensor's page and one object range.

    ``contiguous``: the slice lands in the object as one range, in page order (TP=1, or the default
    rank-major placement): a staged copy can move a block's slice with one DMA. Otherwise the
    rank's bytes are interleaved with other ranks' in the object, and only a per-segment batch copy
    (or a bounce through host memory) can place them without touching the other ranks' bytes.
    """

    def __init__(self, page_bytes: Sequence[int], runs: Sequence[tuple[int, int, int]], object_bytes: int):
        if not page_bytes or any(p <= 0 for p in page_bytes):
            raise PlanError(f"every KV-cache tensor needs a positive page size, got {list(page_bytes)}")
        self.page_bytes = [int(p) for p in page_bytes]
        self.slice_bytes = sum(self.page_bytes)
        self.object_bytes = int(object_bytes)
        self.runs = _checked_runs(runs, self.slice_bytes, self.object_bytes)
        self.segments = _segments(self.runs, self.page_bytes)
        self.contiguous = len(self.runs) == 1
        self.object_offset = self.runs[0][1] if self.contiguous else None

    @property
    def segment_count(self) -> int:
        return len(self.segments)

    def segment_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The segments as arrays: tensor index, page offset, object offset, size."""
        cols = np.array([(s.tensor, s.page_offset, s.object_offset, s.size) for s in self.segments], dtype=np.int64)
        return cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3]

    def pointers(
        self,
        tensor_addresses: Sequence[int],
        row_strides: Sequence[int],
        block_ids: Sequence[int],
        object_addresses: Sequence[int],
        to_pool: bool,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Source and destination addresses and sizes of every copy of a job: one per (block,
        segment), block-major. ``tensor_addresses[t]`` is the address of block 0's page in tensor
        ``t`` and ``row_strides[t]`` the bytes from one block's page to the next;
        ``object_addresses[i]`` is where block ``i``'s object starts in the mapped pool."""
        if len(block_ids) != len(object_addresses):
            raise PlanError(f"{len(block_ids)} engine blocks for {len(object_addresses)} pool objects")
        if len(tensor_addresses) != len(self.page_bytes) or len(row_strides) != len(self.page_bytes):
            raise PlanError(f"the plan has {len(self.page_bytes)} tensors, got {len(tensor_addresses)} addresses")
        tensor_of, page_offset, object_offset, sizes = self.segment_arrays()
        bases = np.asarray(tensor_addresses, dtype=np.uint64)[tensor_of]
        strides = np.asarray(row_strides, dtype=np.uint64)[tensor_of]
        ids = np.asarray(block_ids, dtype=np.uint64)[:, None]
        device = bases[None, :] + ids * strides[None, :] + page_offset.astype(np.uint64)[None, :]
        pool = np.asarray(object_addresses, dtype=np.uint64)[:, None] + object_offset.astype(np.uint64)[None, :]
        all_sizes = np.broadcast_to(sizes.astype(np.uint64), device.shape)
        src, dst = (device, pool) if to_pool else (pool, device)
        return src.ravel(), dst.ravel(), np.ascontiguousarray(all_sizes).ravel()


def _checked_runs(
    runs: Sequence[tuple[int, int, int]], slice_bytes: int, object_bytes: int
) -> list[tuple[int, int, int]]:
    """The runs, checked to tile the slice in order inside the object, merged where they continue
    each other on both sides (the service merges the same way)."""
    merged: list[tuple[int, int, int]] = []
    expected = 0
    for slice_offset, object_offset, length in runs:
        if length <= 0 or slice_offset != expected:
            raise PlanError(
                f"placement runs must tile the slice in order: a run starts at {slice_offset}, expected {expected}"
            )
        if object_offset < 0 or object_offset + length > object_bytes:
            raise PlanError(
                f"a run of {length} bytes at object offset {object_offset} ends past the {object_bytes}-byte object"
            )
        expected += length
        if merged and merged[-1][1] + merged[-1][2] == object_offset:
            s, o, n = merged[-1]
            merged[-1] = (s, o, n + length)
        else:
            merged.append((slice_offset, object_offset, length))
    if expected != slice_bytes:
        raise PlanError(f"placement runs cover {expected} bytes; the rank's pages hold {slice_bytes} per block")
    return merged


def _segments(runs: list[tuple[int, int, int]], page_bytes: list[int]) -> list[Segment]:
    """Splits the runs where a tensor's page ends; a segment never spans two tensors."""
    page_starts = np.cumsum([0, *page_bytes])
    segments: list[Segment] = []
    for slice_offset, object_offset, length in runs:
        at = slice_offset
        end = slice_offset + length
        while at < end:
            tensor = int(np.searchsorted(page_starts, at, side="right")) - 1
            page_end = int(page_starts[tensor + 1])
            size = min(end, page_end) - at
            segments.append(Segment(tensor, at - int(page_starts[tensor]), object_offset + (at - slice_offset), size))
            at += size
    return segments


def round_blocks(slot_count: int, object_bytes: int, target_bytes: int = 64 << 20) -> int:
    """Blocks per acquire round of a pipelined load: small enough that the first copy starts early
    and that a round's blocks stay resident (at most a quarter of the pool, as the client's own
    loads), large enough to amortize a round trip (about ``target_bytes``)."""
    by_pool = max(1, slot_count // 4)
    by_bytes = max(1, target_bytes // max(1, object_bytes))
    return max(1, min(by_pool, by_bytes))
