"""The torch side of the GPU data path: a side stream ordered after the engine's compute stream,
completion events, and the pool pinned for DMA. ``HostSide`` gives the same interface for KV caches
in host memory, where every copy is synchronous: the transfers run unchanged on a CPU (the tests do),
and only what this module does with CUDA needs a GPU.

Ordering. ``ready_marker`` runs on the engine's thread when vLLM submits a job and records an event
on the engine's current (compute) stream: a store must not read KV the model is still writing, and
a load must not land before pending writes (vLLM's zeroing of reused blocks) to its destination. The
side stream waits for that event; nothing ever synchronizes the engine's stream. The job thread
waits for its own copies' event, on the host, before it commits a store or releases a load's pins.

The side stream is kvtier's own (``cuStreamCreate``, non-blocking), not one of torch's pooled
streams: ``torch.cuda.Stream()`` hands out the pool's streams round robin, and vLLM's offloading
streams come from the same pool, so a pooled stream could be one vLLM also queues work on. It is
non-blocking so that it never waits for (nor holds up) work on the legacy default stream.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

# A single registration is bounded (the driver refuses very large ones on some systems); vLLM pins its
# offload region in pieces of at most 64 GiB too.
MAX_REGISTER_CHUNK_BYTES = 64 << 30
# cudaHostRegisterPortable: pinned for every CUDA context, not only the one current when it was
# registered (a rank that re-pins after a reconnect on its job thread, TP > 1).
HOST_REGISTER_PORTABLE = 1
_CU_STREAM_NON_BLOCKING = 1


class Registration(Protocol):
    pinned: bool

    def close(self) -> None: ...


class _Unpinned:
    """Host memory needs no registration (KV caches on the CPU)."""

    pinned = False

    def close(self) -> None:
        pass


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

    def activate(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def register(self, address: int, nbytes: int, align: int) -> Registration:
        return _Unpinned()

    def pinned_empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.uint8)

    def close(self) -> None:
        pass


class CudaSide:
    """kvtier's own stream on the KV cache's GPU, with events for ordering and completion."""

    is_cuda = True

    def __init__(self, device: torch.device):
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", ordinal)
        self._handle, self.stream = new_side_stream(self.device)

    def ready_marker(self) -> Any:
        """An event on the caller's current stream (the engine's compute stream, at submission)."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextmanager
    def running(self, ready: Any) -> Iterator[None]:
        """Runs the enclosed copies on the side stream, after ``ready``."""
        with torch.cuda.device(self.device):
            if ready is not None:
                self.stream.wait_event(ready)
            with torch.cuda.stream(self.stream):
                yield

    def done_marker(self) -> Any:
        # blocking: the job thread sleeps in synchronize() instead of spinning a core (CPU per GB).
        event = torch.cuda.Event(blocking=True)
        event.record(self.stream)
        return event

    def is_done(self, marker: Any) -> bool:
        return marker is None or bool(marker.query())

    def wait(self, marker: Any) -> None:
        """Blocks this (job) thread until the side stream passed ``marker``."""
        if marker is not None:
            marker.synchronize()

    def activate(self) -> AbstractContextManager[Any]:
        """The KV cache's device current on this thread (the job thread may start on device 0)."""
        return torch.cuda.device(self.device)

    def register(self, address: int, nbytes: int, align: int) -> Registration:
        return PinnedRange(address, nbytes, align)

    def pinned_empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.uint8, pin_memory=True)

    def close(self) -> None:
        if self._handle:
            self.stream.synchronize()
            _driver().cuStreamDestroy_v2(ctypes.c_void_p(self._handle))
            self._handle = 0


def side_for(device: torch.device) -> HostSide | CudaSide:
    if device.type == "cuda":
        return CudaSide(device)
    if device.type == "cpu":
        return HostSide(device)
    raise ValueError(f"kvtier moves KV caches on CUDA GPUs or in host memory, not on {device}")


def new_side_stream(device: torch.device) -> tuple[int, torch.cuda.ExternalStream]:
    """A stream created for kvtier alone (``cuStreamCreate``, non-blocking) in the primary context
    torch uses for ``device``, wrapped for torch."""
    driver = _driver()
    with torch.cuda.device(device):
        torch.zeros(1, device=device)  # the primary context exists and is current on this thread
        handle = ctypes.c_void_p()
        code = driver.cuStreamCreate(ctypes.byref(handle), _CU_STREAM_NON_BLOCKING)
        if code != 0 or not handle.value:
            raise RuntimeError(f"cuStreamCreate failed with CUDA error {code}")
        return int(handle.value), torch.cuda.ExternalStream(int(handle.value), device=device)


_DRIVER: ctypes.CDLL | None = None


def _driver() -> ctypes.CDLL:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
    return _DRIVER


def pool_view(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the pool as this process mapped it (no copy). Valid while the client that
    mapped it is alive: keep a reference to that client alongside."""
    buffer = (ctypes.c_uint8 * nbytes).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.uint8)


class CudaRuntime:
    """The three runtime calls pinning needs. torch's ``cudart()`` binding has no
    ``cudaGetLastError``: that one comes from the libcudart torch itself loaded (the error state is
    per runtime library, so another copy of the library would not clear torch's)."""

    def __init__(self) -> None:
        self._torch = torch.cuda.cudart()
        self._loaded = _loaded_cudart()

    def host_register(self, address: int, nbytes: int, flags: int) -> int:
        return _code(self._torch.cudaHostRegister(address, nbytes, flags))

    def host_unregister(self, address: int) -> int:
        return _code(self._torch.cudaHostUnregister(address))

    def get_last_error(self) -> int | None:
        """Reads and clears the calling thread's last runtime error; None when it cannot."""
        if self._loaded is None:
            return None
        return int(self._loaded.cudaGetLastError())


def _loaded_cudart() -> ctypes.CDLL | None:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


class PinnedRange:
    """``[address, address + nbytes)`` registered with CUDA as pinned memory, in pieces that end on
    ``align`` boundaries (the pool's slot size, so that no block's copy straddles two pieces).
    Registration is best effort: when the driver refuses, copies still work, from pageable memory,
    slower; ``pinned`` says which, and the refusal is logged with the likely fix. A refusal also
    sets the runtime's last error, which torch's next kernel launch check would raise as its own:
    it is read and cleared here."""

    def __init__(self, address: int, nbytes: int, align: int, runtime: Any = None):
        self.address, self.nbytes = address, nbytes
        self.pieces: list[int] = []
        self.pinned = False
        self._runtime = runtime if runtime is not None else CudaRuntime()
        chunk = max(align, (MAX_REGISTER_CHUNK_BYTES // max(1, align)) * align)
        for offset in range(0, nbytes, chunk):
            size = min(chunk, nbytes - offset)
            code = self._runtime.host_register(address + offset, size, HOST_REGISTER_PORTABLE)
            if code != 0:
                cleared = self._runtime.get_last_error()
                logger.warning(
                    "kvtier: cudaHostRegister of the pool failed (CUDA error %d at %.1f of %.1f GiB; last error %s "
                    "cleared); copies run from pageable memory, slower. Check the memlock limit (ulimit -l) and that "
                    "the pool file's filesystem (/dev/shm) allows pinning",
                    code,
                    offset / 2**30,
                    nbytes / 2**30,
                    "not" if cleared is None else cleared,
                )
                self.close()
                return
            self.pieces.append(address + offset)
        self.pinned = True

    def close(self) -> None:
        for piece in reversed(self.pieces):
            if self._runtime.host_unregister(piece) != 0:
                self._runtime.get_last_error()
        self.pieces.clear()
        self.pinned = False


class PoolPins:
    """One registration per pool mapping, shared by every ``BlockTransfers`` bound to the same
    client (the benchmark binds a storer and a loader to one client; registering the same range
    twice fails with "already registered"). Counted: the range is unregistered when the last lease
    closes, which must happen before the client (and its mapping) goes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, int, int], list[Any]] = {}  # key -> [registration, leases, owner]

    def lease(self, owner: Any, address: int, nbytes: int, align: int, side: Any) -> PinLease:
        key = (id(owner), address, nbytes)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = [side.register(address, nbytes, align), 0, owner]
                self._entries[key] = entry
            entry[1] += 1
        return PinLease(self, key, entry[0])

    def release(self, key: tuple[int, int, int]) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._entries[key]
        entry[0].close()

    def open_count(self) -> int:
        """Registrations (pinned or not) not yet closed: 0 once every transfers object closed."""
        with self._lock:
            return len(self._entries)


class PinLease:
    def __init__(self, pins: PoolPins, key: tuple[int, int, int], registration: Registration):
        self._pins, self._key, self.registration = pins, key, registration
        self._closed = False

    @property
    def pinned(self) -> bool:
        return bool(self.registration.pinned) and not self._closed

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pins.release(self._key)


POOL_PINS = PoolPins()


def _code(result: Any) -> int:
    """A cudaError as an int (torch returns an enum member)."""
    return int(getattr(result, "value", result))
