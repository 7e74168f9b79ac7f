"""The torch side of the GPU data path: a side stream ordered after the engine's compute stream,
completion events, and the pool pinned for DMA. ``HostSide`` gives the same interface for KV caches
in host memory, where every copy is synchronous: the transfers run unchanged on a CPU (the tests do),
and only what this module does with CUDA needs a GPU.

Ordering. ``ready_marker`` runs on the engine's thread when vLLM submits a job and records an event
on the engine's current (compute) stream: a store must not read KV the model is still writing, and
a load must not land before pending writes (vLLM's zeroing of reused blocks) to its destination. The
side stream waits for that event; nothing ever synchronizes the engine's stream. The job thread
waits for its own copies' event, on the host, before it commits a store or releases a load's pins.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

logger = logging.getLogger(__name__)

# A single registration is bounded (the driver refuses very large ones on some systems); vLLM pins its
# offload region in pieces of at most 64 GiB too.
MAX_REGISTER_CHUNK_BYTES = 64 << 30


class HostSide:
    """Copies between host tensors: synchronous, no events."""

    is_cuda = False

    def __init__(self, device: torch.device):
        self.device = device

    def ready_marker(self) -> Any:
        return None

    @contextmanager
    def running(self, ready: Any) -> Iterator[None]:
        yield

    def done_marker(self) -> Any:
        return None

    def is_done(self, marker: Any) -> bool:
        return True

    def wait(self, marker: Any) -> None:
        pass

    def pinned_empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.uint8)


class CudaSide:
    """A side stream on the KV cache's GPU, with events for ordering and completion."""

    is_cuda = True

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def ready_marker(self) -> Any:
        """An event on the caller's current stream (the engine's compute stream, at submission)."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextmanager
    def running(self, ready: Any) -> Iterator[None]:
        """Runs the enclosed copies on the side stream, after ``ready``."""
        if ready is not None:
            self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            yield

    def done_marker(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def is_done(self, marker: Any) -> bool:
        return marker is None or bool(marker.query())

    def wait(self, marker: Any) -> None:
        """Blocks this (job) thread until the side stream passed ``marker``."""
        if marker is not None:
            marker.synchronize()

    def pinned_empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.uint8, pin_memory=True)


def side_for(device: torch.device) -> HostSide | CudaSide:
    if device.type == "cuda":
        return CudaSide(device)
    if device.type == "cpu":
        return HostSide(device)
    raise ValueError(f"kvtier moves KV caches on CUDA GPUs or in host memory, not on {device}")


def pool_view(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the pool as this process mapped it (no copy). Valid while the client that
    mapped it is alive: keep a reference to that client alongside."""
    buffer = (ctypes.c_uint8 * nbytes).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.uint8)


class PinnedRange:
    """``[address, address + nbytes)`` registered with CUDA as pinned memory, in pieces that end on
    ``align`` boundaries (the pool's slot size, so that no block's copy straddles two pieces).
    Registration is best effort: when the driver refuses, copies still work, from pageable memory,
    slower; ``pinned`` says which, and the refusal is logged once with the likely fix."""

    def __init__(self, address: int, nbytes: int, align: int):
        self.address, self.nbytes = address, nbytes
        self.pieces: list[int] = []
        self.pinned = False
        chunk = max(align, (MAX_REGISTER_CHUNK_BYTES // max(1, align)) * align)
        cudart = torch.cuda.cudart()
        for offset in range(0, nbytes, chunk):
            size = min(chunk, nbytes - offset)
            code = _code(cudart.cudaHostRegister(address + offset, size, 0))
            if code != 0:
                logger.warning(
                    "kvtier: cudaHostRegister of the pool failed (CUDA error %d at %.1f of %.1f GiB); copies run "
                    "from pageable memory, slower. Check the memlock limit (ulimit -l) and that the pool file's "
                    "filesystem (/dev/shm) allows pinning",
                    code,
                    offset / 2**30,
                    nbytes / 2**30,
                )
                self.close()
                return
            self.pieces.append(address + offset)
        self.pinned = True

    def close(self) -> None:
        cudart = torch.cuda.cudart()
        for piece in reversed(self.pieces):
            cudart.cudaHostUnregister(piece)
        self.pieces.clear()
        self.pinned = False


def _code(result: Any) -> int:
    """A cudaError as an int (torch returns an enum member)."""
    return int(getattr(result, "value", result))
