"""One rank's jobs against the host service when the rank copies itself (its KV cache is on a GPU):
stores reserve slots, copy, then commit; loads acquire blocks in rounds and copy each round while the
service reads the next one from NVMe.

Every failure ends as misses, never as wrong bytes: a store whose copy failed aborts its slots (the
blocks stay absent, and another engine may fill them); a load whose copy failed reports the round's
blocks as missing (vLLM recomputes them) and releases its pins. A service call that fails is
counted, and the job's remaining blocks are misses.

A copy that raised may have queued some of its copies first (a staged copy fails in its second
pass, a later round fails after earlier rounds were issued). Nothing goes back to the service, and
no failure is reported to vLLM, until every copy already queued on the side stream completed: an
aborted slot is handed to another block at once, a released pin lets the slot be evicted and reused,
and vLLM recomputes a missed block into the same pages, so a late copy would land in someone else's
bytes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.gpu.device import POOL_PINS, CudaSide, HostSide, pool_view, side_for
from kvtier.gpu.executors import CopyJob, Executor, choose
from kvtier.gpu.plan import CopyPlan, round_blocks

logger = logging.getLogger(__name__)


@dataclass
class TransferCounters:
    """What this rank's transfers did (read by the benchmark and the tests)."""

    stored_blocks: int = 0
    loaded_blocks: int = 0
    aborted_blocks: int = 0
    failed_copies: int = 0
    failed_calls: int = 0
    load_rounds: int = 0
    retried_reserves: int = 0
    errors: list[str] = field(default_factory=list)


class DmaGate:
    """``kvtier._core.CopyGate``'s protocol for copies the GPU runs asynchronously: the job thread
    issues each round's copies through ``issue``; another thread gives the job up with ``cancel``,
    which returns once every copy issued so far has landed, and no copy is issued after it. The job
    thread may be stuck in a call to a frozen service meanwhile: ``cancel`` never waits for it."""

    def __init__(self, side: Any):
        self._side = side
        self._lock = threading.Lock()
        self._cancelled = False
        self._markers: list[Any] = []
        self.rounds = 0

    def issue(self, copy: Callable[[], Any]) -> Any:
        """Runs ``copy`` (it issues copies and returns their done marker) unless given up: its
        marker, or ``GIVEN_UP`` when the job was given up (nothing issued)."""
        with self._lock:
            if self._cancelled:
                return GIVEN_UP
            marker = copy()
            self._markers.append(marker)
            self.rounds += 1
            return marker

    def cancel(self) -> bool:
        with self._lock:
            self._cancelled = True
            markers, self._markers = self._markers, []
        for marker in markers:
            self._side.wait(marker)
        return True

    @property
    def cancelled(self) -> bool:
        return self._cancelled


# What ``DmaGate.issue`` returns for a job given up (a host side's done marker is None).
GIVEN_UP = object()


def _issue(gate: DmaGate | None, copy: Callable[[], Any]) -> Any:
    return copy() if gate is None else gate.issue(copy)


class _Binding:
    """What depends on one service client: its pool mapping, pinned for DMA, and the plan."""

    def __init__(self, client: Any, tensors: Sequence[torch.Tensor], side: Any):
        pool = client.pool()
        self.client = client
        self.address, self.bytes = int(pool["address"]), int(pool["bytes"])
        self.slot_count, self.object_bytes = int(pool["slot_count"]), int(pool["object_bytes"])
        self.pool = pool_view(self.address, self.bytes)
        self.plan = CopyPlan(
            [t.shape[1] * t.element_size() for t in tensors], pool["placement_runs"], self.object_bytes
        )
        # Shared with the client's other transfers (one registration per mapping), closed before the
        # client goes: a registration that outlives its mapping pins stale pages, and a later pool
        # mapped at the same address could not be registered.
        self.pins = POOL_PINS.lease(client, self.address, self.bytes, int(pool["slot_bytes"]), side)
        self.round_blocks = round_blocks(self.slot_count, self.object_bytes)

    def close(self) -> None:
        self.pins.close()


class BlockTransfers:
    """Moves one rank's slice of blocks between ``tensors`` (its KV cache, one ``(num_blocks,
    page_bytes)`` uint8 view per tensor, on one device) and the service's pool.

    ``client`` is the live service client; a new one (after a reconnect) re-maps and re-pins.
    ``ready`` is the marker ``side.ready_marker()`` recorded when the job was submitted. Close it
    (or use it as a context manager) before the client goes: that unpins the pool mapping."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        executor: Executor | None = None,
        on_failed_call: Callable[[], None] | None = None,
        side: Any = None,
    ):
        if not tensors:
            raise ValueError("kvtier: a rank needs at least one KV-cache tensor")
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ValueError(
                f"kvtier: a rank's KV-cache tensors must be on one device, got {sorted(map(str, devices))}"
            )
        for tensor in tensors:
            if tensor.dim() != 2 or tensor.dtype != torch.uint8 or tensor.stride(1) != 1:
                raise ValueError(
                    "kvtier: each KV-cache tensor must be viewed as (num_blocks, page_bytes) uint8 rows, "
                    f"got {tuple(tensor.shape)} {tensor.dtype} strides {tensor.stride()}"
                )
        self.tensors = list(tensors)
        self.device = next(iter(devices))
        self.side: HostSide | CudaSide = side if side is not None else side_for(self.device)
        self._executor = executor
        self._binding: _Binding | None = None
        self._on_failed_call = on_failed_call
        self.counters = TransferCounters()

    @property
    def executor(self) -> Executor | None:
        return self._executor

    @property
    def plan(self) -> CopyPlan | None:
        """How a block's bytes map between the tensors and the pool (None until bound)."""
        return self._binding.plan if self._binding is not None else None

    @property
    def pool_pinned(self) -> bool:
        """Whether the bound pool is registered with CUDA (False on the host, or when refused)."""
        binding = self._binding
        return bool(binding is not None and binding.pins.pinned)

    def ready_marker(self) -> Any:
        return self.side.ready_marker()

    def bind(self, client: Any) -> None:
        """Maps and pins ``client``'s pool and picks the executor now, rather than in the first job
        (pinning a large pool takes a while; the benchmark keeps it out of its timings)."""
        self._bind(client)

    def _bind(self, client: Any) -> _Binding:
        if self._binding is not None and self._binding.client is client:
            return self._binding
        if self._binding is not None:
            self._binding.close()
            self._binding = None
        # On the KV cache's device: after a reconnect this runs on the job thread, whose current
        # device is 0 unless set (TP > 1).
        with self.side.activate():
            self._binding = _Binding(client, self.tensors, self.side)
            if self._executor is None:
                self._executor = choose(self.device, self._binding.plan, self.side)
                logger.info("kvtier: this rank copies with %s", self._executor.name)
        return self._binding

    def release_unless(self, client: Any) -> None:
        """Unpins and lets go of the pool of a client other than ``client`` (a dead service's), once
        the copies already queued completed; a later job binds the live one."""
        if self._binding is not None and self._binding.client is not client:
            self._settle()
            self.close()

    def close(self) -> None:
        """Unpins the pool (this object's share of the registration). Bind again to reuse it."""
        if self._binding is not None:
            self._binding.close()
            self._binding = None

    def __enter__(self) -> BlockTransfers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _settle(self) -> None:
        """Waits until every copy already queued on the side stream completed (see the module's
        docstring). When even that fails the device is in a sticky error and runs nothing more."""
        try:
            with self.side.running(None):
                marker = self.side.done_marker()
            self.side.wait(marker)
        except Exception as error:
            self._note(f"waiting for the copies queued before a failure failed too: {error}")

    def _job(self, binding: _Binding, ids: Sequence[int], offsets: Sequence[int], to_pool: bool) -> CopyJob:
        return CopyJob(binding.plan, self.tensors, ids, offsets, binding.pool, binding.address, to_pool)

    def _copy(self, binding: _Binding, ready: Any, ids: Sequence[int], offsets: Sequence[int], to_pool: bool) -> Any:
        """Issues the copies after ``ready``; their done marker. Raises if issuing failed."""
        assert self._executor is not None, "bound"
        with self.side.running(ready):
            self._executor.copy(self._job(binding, ids, offsets, to_pool))
            return self.side.done_marker()

    def _copy_failed(self, message: str) -> None:
        """A copy failed: counted and logged once every copy already queued completed, so that no
        slot or pin goes back while one of them may still land."""
        self.counters.failed_copies += 1
        self._note(message)
        self._settle()

    def _failed_call(self, what: str, error: Exception) -> None:
        self.counters.failed_calls += 1
        if self._on_failed_call is not None:
            self._on_failed_call()
        self._note(f"{what}: {error}")

    def _note(self, message: str) -> None:
        if len(self.counters.errors) < 16:
            self.counters.errors.append(message)
        logger.error("kvtier: %s", message)

    # ---- stores ---------------------------------------------------------------------------------

    def store(
        self, client: Any, keys: list[bytes], block_ids: Sequence[int], ready: Any = None, gate: DmaGate | None = None
    ) -> list[bool]:
        """Stores the blocks: True per block the service has now (stored, or present already).
        ``gate``: another thread may give the store up (``DmaGate.cancel``)."""
        stored = [False] * len(keys)
        if client is None or not keys:
            return stored
        try:
            binding = self._bind(client)
        except Exception as error:
            self._failed_call("binding to the service's pool", error)
            return stored
        pending = list(range(len(keys)))
        # Blocks the service had no room for are asked for again once the others are committed (as
        # the service's own store_blocks does); each round places a block or ends the job.
        while pending and not (gate is not None and gate.cancelled):
            retry = self._store_round(binding, (keys, block_ids), ready, pending, stored, gate)
            if retry and len(retry) == len(pending):
                self._give_up(binding, [keys[i] for i in retry])
                break
            self.counters.retried_reserves += int(bool(retry))
            pending = retry
        return stored

    def _give_up(self, binding: _Binding, keys: list[bytes]) -> None:
        """No progress: the service keeps answering "no room now". Aborting keys this connection
        holds no reservation of tells it these stores are given up: it counts them in
        ``dropped_stores`` (as its own drops) and every rank of the engine gives them up."""
        try:
            binding.client.abort_many(keys)
        except Exception as error:
            self._failed_call("abort", error)

    def _store_round(
        self,
        binding: _Binding,
        job: tuple[list[bytes], Sequence[int]],
        ready: Any,
        indices: list[int],
        stored: list[bool],
        gate: DmaGate | None,
    ) -> list[int]:
        """One reserve → copy → commit round over ``indices`` of ``job`` (keys, engine block ids);
        the indices to reserve again."""
        keys = job[0]
        try:
            replies = binding.client.reserve_many([keys[i] for i in indices])
        except Exception as error:
            self._failed_call("reserve", error)
            return []
        fills, retry = [], []
        for i, (kind, offset) in zip(indices, replies, strict=True):
            if kind == "fill":
                fills.append((i, offset))
            elif kind == "present":
                stored[i] = True
            elif kind == "retry":
                retry.append(i)
        if not fills:
            return retry
        chunk = binding.round_blocks
        chunks = [fills[at : at + chunk] for at in range(0, len(fills), chunk)]
        issued = self._issue_store_chunks(binding, job, ready, chunks, gate)
        self._commit_store_chunks(binding, keys, issued, stored)
        return retry

    def _issue_store_chunks(
        self,
        binding: _Binding,
        job: tuple[list[bytes], Sequence[int]],
        ready: Any,
        chunks: list[list[tuple[int, int]]],
        gate: DmaGate | None,
    ) -> list[tuple[Any, list[tuple[int, int]]]]:
        """Queues every chunk's copies, each with its own done marker, so that the service checksums
        a committed chunk while the next ones copy (the H200 run: one commit after the whole job's
        copies ran stores at 0.2-0.4x the DMA rate). The chunks not queued are aborted."""
        keys, block_ids = job
        issued: list[tuple[Any, list[tuple[int, int]]]] = []
        for n, fills in enumerate(chunks):
            ids, offsets = [block_ids[i] for i, _ in fills], [o for _, o in fills]
            try:
                marker = _issue(gate, lambda: self._copy(binding, ready, ids, offsets, to_pool=True))  # noqa: B023
            except Exception as error:
                self._copy_failed(f"copying {len(fills)} blocks to the pool failed: {error}")
                marker = GIVEN_UP
            if marker is GIVEN_UP:  # failed, or given up (the engine reuses the blocks)
                self._abort(binding, [keys[i] for later in chunks[n:] for i, _ in later])
                break
            issued.append((marker, fills))
        return issued

    def _commit_store_chunks(
        self,
        binding: _Binding,
        keys: list[bytes],
        issued: list[tuple[Any, list[tuple[int, int]]]],
        stored: list[bool],
    ) -> None:
        """Commits each queued chunk once its copies landed; after a failed copy or commit, the
        chunks behind it are aborted once nothing is in flight."""
        for n, (marker, fills) in enumerate(issued):
            fill_keys = [keys[i] for i, _ in fills]
            try:
                self.side.wait(marker)
            except Exception as error:
                self._copy_failed(f"copying {len(fills)} blocks to the pool failed: {error}")
                self._abort(binding, [keys[i] for _, later in issued[n:] for i, _ in later])
                return
            try:
                accepted = binding.client.commit_many(fill_keys)
            except Exception as error:
                self._failed_call("commit", error)
                self._settle()
                self._abort(binding, [keys[i] for _, later in issued[n + 1 :] for i, _ in later])
                return
            for (i, _), ok in zip(fills, accepted, strict=True):
                stored[i] = ok
                self.counters.stored_blocks += int(ok)

    def _abort(self, binding: _Binding, keys: list[bytes]) -> None:
        if not keys:
            return
        self.counters.aborted_blocks += len(keys)
        try:
            binding.client.abort_many(keys)
        except Exception as error:
            self._failed_call("abort", error)

    # ---- loads ----------------------------------------------------------------------------------

    def load(
        self, client: Any, keys: list[bytes], block_ids: Sequence[int], ready: Any = None, gate: DmaGate | None = None
    ) -> list[bool]:
        """Loads the blocks' prefix that the service has: True per block copied in. Rounds are
        pipelined: round n+1 is acquired (read up from NVMe by the service) while round n copies.
        ``gate``: another thread may give the load up (``DmaGate.cancel``): no copy after that."""
        found = [False] * len(keys)
        if client is None or not keys:
            return found
        try:
            binding = self._bind(client)
        except Exception as error:
            self._failed_call("binding to the service's pool", error)
            return found
        in_flight: list[tuple[Any, list[bytes], range]] = []  # (done marker, pinned keys, block indices)
        at = 0
        try:
            while at < len(keys):
                end = min(len(keys), at + binding.round_blocks)
                hits, pinned = self._acquire(binding, keys[at:end])
                self.counters.load_rounds += 1
                if hits:
                    ids = block_ids[at : at + len(hits)]
                    try:
                        marker = _issue(gate, lambda: self._copy(binding, ready, ids, hits, to_pool=False))  # noqa: B023
                    except Exception as error:
                        self._copy_failed(f"copying {len(hits)} blocks from the pool failed: {error}")
                        self._release(binding, pinned)
                        break
                    if marker is GIVEN_UP:  # given up: the engine recomputes these blocks
                        self._release(binding, pinned)
                        break
                    in_flight.append((marker, pinned, range(at, at + len(hits))))
                elif pinned:
                    self._release(binding, pinned)
                self._finish_rounds(binding, in_flight, found, keep=1)
                if len(hits) < end - at:
                    break  # later blocks are useless without this one: vLLM recomputes from here
                at = end
        finally:
            self._finish_rounds(binding, in_flight, found, keep=0)
        return found

    def _acquire(self, binding: _Binding, keys: list[bytes]) -> tuple[list[int], list[bytes]]:
        """Acquires a round: the object offsets of its leading hits, and every key it pinned."""
        try:
            offsets = binding.client.acquire_many(keys)
        except Exception as error:
            self._failed_call("acquire", error)
            return [], []
        pinned = [key for key, offset in zip(keys, offsets, strict=True) if offset is not None]
        hits: list[int] = []
        for offset in offsets:
            if offset is None:
                break
            hits.append(offset)
        return hits, pinned

    def _finish_rounds(
        self, binding: _Binding, in_flight: list[tuple[Any, list[bytes], range]], found: list[bool], keep: int
    ) -> None:
        """Waits for all but the newest ``keep`` rounds, marks their blocks found, releases their pins."""
        while len(in_flight) > keep:
            marker, pinned, indices = in_flight.pop(0)
            try:
                self.side.wait(marker)
                ok = True
            except Exception as error:
                self.counters.failed_copies += 1
                self._note(f"a load's copies failed: {error}")
                ok = False
            if not ok:
                # Later rounds may have landed, but a prefix with a hole is useless: drop them too,
                # once their copies are no longer in flight.
                self._settle()
            self._release(binding, pinned)
            if not ok:
                for _, later_pinned, _ in in_flight:
                    self._release(binding, later_pinned)
                in_flight.clear()
                return
            for i in indices:
                found[i] = True
            self.counters.loaded_blocks += len(indices)

    def _release(self, binding: _Binding, keys: list[bytes]) -> None:
        if not keys:
            return
        try:
            binding.client.release_many(keys)
        except Exception as error:
            self._failed_call("release", error)


def rank_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """vLLM's canonical per-layer tensors (``(num_blocks, page_bytes)`` in any dtype, block-major) as
    the uint8 row views the transfers copy."""
    views = []
    for tensor in tensors:
        if not tensor.is_contiguous():
            raise ValueError(f"kvtier: a KV-cache tensor with strides {tensor.stride()} is not block-major")
        views.append(tensor.view(torch.uint8).view(tensor.shape[0], -1))
    return views
