"""The worker side: jobs that copy engine blocks to and from the store.

Two workers, no inheritance between them:

- ``KvtierWorker``: the one-process layout (``host_service: false``); the store's own threads run
  the jobs.
- ``JobQueueWorker``: the host-service layout; one job queue (loads first, stores held back during
  prefill, fences for what vLLM waits on) on a thread of its own, composed with a transport that
  does the copies: ``ServiceCopy`` (the CPU copies rows through the service's pool) or ``GpuDma``
  (the GPU's DMA engine, ``kvtier.gpu``). ``ServiceWorker`` and ``GpuServiceWorker`` build one
  with each.

Both report finished jobs, and failed loads for recompute, through ``JobResults`` (``jobs.py``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvtier.threads import start_thread
from kvtier.vllm._registry import registry_lock
from kvtier.vllm.connection import ServiceConnection
from kvtier.vllm.jobs import Job, JobResults
from kvtier.vllm.load_store_spec import KvtierLoadStoreSpec
from kvtier.vllm.local_store import LocalStore, StoreNotOpen, release_store
from kvtier.vllm.transports import GpuDma, ServiceCopy, Transport

logger = logging.getLogger("kvtier.vllm")


# Bytes per store_blocks call of a service worker (at least one block): between two calls a load or
# a prefill step may come first. 16 MiB is one block of an 8B model (128 tokens), a few ms to copy;
# a call's round trips to the service cost tens of microseconds.
STORE_BATCH_BYTES = 16 << 20
# How often a fence looks at its jobs' progress, and the watchdog at pending loads'.
FENCE_POLL_S = 0.05
WATCH_INTERVAL_S = 0.25
# The most the watchdog waits for the service's read counters (``_note_service_reads``).
READS_PROBE_TIMEOUT_MS = 500


def _store_job(src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> tuple[list[bytes], list[int]]:
    """A vLLM store job as (kvtier keys, engine block ids)."""
    assert isinstance(dst_spec, KvtierLoadStoreSpec), f"unexpected store spec {type(dst_spec).__name__}"
    return dst_spec.keys, src_spec.block_ids.tolist()


def _load_job(src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> tuple[list[bytes], list[int]]:
    """A vLLM load job as (kvtier keys, engine block ids). vLLM 0.33 marks a load a step waits on
    ``expedited``; every kvtier load already goes before any store, so that needs nothing more."""
    assert isinstance(src_spec, KvtierLoadStoreSpec), f"unexpected load spec {type(src_spec).__name__}"
    return src_spec.keys, dst_spec.block_ids.tolist()


def _check_job(vllm_job_id: int, keys: list[bytes], block_ids: list[int]) -> None:
    if len(keys) != len(block_ids):
        raise RuntimeError(
            f"kvtier: job {vllm_job_id} has {len(keys)} keys for {len(block_ids)} engine blocks; "
            "kvtier needs blocks_per_chunk=1 and one KV-cache group"
        )


class KvtierWorker(OffloadingWorker):
    """Moves engine blocks to and from the in-process store (``host_service: false``). One kvtier
    object per engine block: the block's page in every layer, in layer order (the store gathers and
    scatters; no Python loop per block)."""

    def __init__(self, local: LocalStore, layer_buffers: list[np.ndarray], page_bytes: int, job_timeout_ms: int):
        self._local = local
        self._store = local.store
        self._layers = layer_buffers
        self._job_timeout_ms = job_timeout_ms
        self._in_flight: dict[int, Job] = {}
        self.results = JobResults(page_bytes * len(layer_buffers))

    @property
    def can_report_load_failures(self) -> bool:
        return self.results.can_report_load_failures

    @can_report_load_failures.setter
    def can_report_load_failures(self, value: bool) -> None:
        self.results.can_report_load_failures = value

    # -- submission -------------------------------------------------------------------------

    def _submit(self, vllm_job_id: int, is_load: bool, keys: list[bytes], block_ids: list[int]) -> bool:
        _check_job(vllm_job_id, keys, block_ids)
        started_ns = time.monotonic_ns()
        if not keys:
            self.results.finished.append(TransferResult(vllm_job_id, True, 0, 0.0))
            return True
        store_job_id = self._local.next_job_id()
        job = Job(vllm_job_id, is_load, block_ids, started_ns)
        try:
            if is_load:
                self._store.submit_get_blocks(store_job_id, keys, self._layers, block_ids)
            else:
                self._store.submit_put_blocks(store_job_id, keys, self._layers, block_ids)
        except StoreNotOpen:  # its filesystem has not answered since the start (logged then)
            self._complete(job, [False] * len(keys))
            return True
        except Exception:
            logger.exception("kvtier: submitting %s job %d failed", "load" if is_load else "store", vllm_job_id)
            self._complete(job, [False] * len(keys))
            return True
        self._in_flight[store_job_id] = job
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, False, *_store_job(src_spec, dst_spec))

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        return self._submit(job_id, True, *_load_job(src_spec, dst_spec))

    # -- completion -------------------------------------------------------------------------

    def _complete(self, job: Job, found: list[bool]) -> None:
        seconds, failed_blocks = self.results.complete(job, found)
        self._local.record_job("load" if job.is_load else "store", seconds, failed_blocks)

    def step_begins(self, prefill_tokens: int) -> None:
        """A forward pass starts (the in-process store's own threads do not hold stores back)."""

    def step_ends(self) -> None:
        """The forward pass ended."""

    def _drain_store(self) -> None:
        if not self._in_flight:
            return
        for store_job_id, found in self._local.take_finished(list(self._in_flight)).items():
            self._complete(self._in_flight.pop(store_job_id), found)

    def get_finished(self) -> list[TransferResult]:
        self._drain_store()
        return self.results.take_finished()

    def wait(self, job_ids: set[int]) -> None:
        waiting = {store_job_id for store_job_id, job in self._in_flight.items() if job.vllm_job_id in job_ids}
        for store_job_id in waiting:
            job = self._in_flight.get(store_job_id)
            if job is None:
                continue
            try:
                found = self._local.wait_job(store_job_id, self._job_timeout_ms)
            except Exception as error:
                # Returning would let vLLM overwrite blocks kvtier may still be reading.
                raise RuntimeError(
                    f"kvtier: job {job.vllm_job_id} did not finish within job_timeout_ms={self._job_timeout_ms} "
                    f"({error}); raise job_timeout_ms or check the store's device"
                ) from error
            if self._in_flight.pop(store_job_id, None) is not None:
                self._complete(job, found)

    def take_failed_load_block_ids(self) -> set[int]:
        return self.results.take_failed_load_block_ids()

    def shutdown(self) -> None:
        for store_job_id in list(self._in_flight):
            with contextlib.suppress(Exception):
                self._local.wait_job(store_job_id, self._job_timeout_ms)
        self._in_flight.clear()
        release_store(self._local)


@dataclass
class _StoreWork:
    """A store job the worker thread copies in batches, so that a load or a prefill step can come
    between two batches."""

    job: Job
    keys: list[bytes]
    found: list[bool]
    copied: int = 0

    @property
    def remaining(self) -> int:
        return len(self.keys) - self.copied


# Every JobQueueWorker of this process (for the benchmarks: a worker in this process holds stores
# back, so "stored" means its queue is empty, not only that the service took what it was sent;
# ``kvtier.vllm._testing.wait_for_stores``). Under ``registry_lock``.
_service_workers: weakref.WeakSet[JobQueueWorker] = weakref.WeakSet()


class JobQueueWorker(OffloadingWorker):
    """A rank's worker in the host-service layout: runs vLLM's jobs on a thread of its own, so that
    vLLM's step never waits for a transfer it did not ask to wait for; ``transport`` does the copies.

    Loads go first: a queued load is taken before the next batch of any store. Stores are held back
    while the engine runs a forward pass with prompt tokens in it (``defer_stores``): on a CPU engine
    a copy beside the prefill's OpenMP threads takes a core from one of them, and all the others wait
    for it at every barrier. A store vLLM must fence (``wait``) goes at once, and one that would make
    the held-back backlog exceed ``deferred_store_max_blocks`` is dropped and counted."""

    def __init__(
        self,
        connection: ServiceConnection,
        transport: Transport,
        job_timeout_ms: int,
        defer_stores: bool = True,
        deferred_store_max_blocks: int = 4096,
        stall_timeout_ms: int = 2_000,
    ):
        self._connection = connection
        self.transport = transport
        self._job_timeout_ms = job_timeout_ms
        self._stall_timeout_s = stall_timeout_ms / 1000
        self._defer_stores = defer_stores
        self._deferred_store_max_blocks = deferred_store_max_blocks
        self.results = JobResults(transport.object_bytes)
        self._cv = threading.Condition()
        self._loads: list[tuple[Job, list[bytes]]] = []
        self._stores: list[_StoreWork] = []
        self._pending: dict[int, Job] = {}  # vLLM job id -> job, queued or running
        self._works: dict[int, _StoreWork] = {}  # vLLM job id -> a pending store's progress
        self._urgent: set[int] = set()  # store jobs vLLM waits for: never held back
        self._prefill_running = False
        self._forward_running = False
        self._stopping = False
        # Counters (read by tests and the benchmark): stores held back by a prefill step, and blocks
        # dropped because the held-back backlog was full.
        self.deferred_store_jobs = 0
        self.dropped_store_blocks = 0
        self.job_thread_wakeups = 0  # times the job thread woke from waiting for work
        # Jobs given up because they made no progress for the stall timeout (a frozen service): a
        # store vLLM fenced (the blocks it had not copied yet are not stored), a load (recomputed).
        self.given_up_stores = 0
        self.given_up_loads = 0
        # Jobs answered at submission while the job thread is stuck in a call (``_stuck``): store
        # blocks not stored, loads failed (recomputed). Queued behind the stuck call, each would cost
        # the engine's fence or load one more stall timeout.
        self.skipped_store_blocks = 0
        self.skipped_loads = 0
        # Loads tried again once this worker's connection reattached (vLLM's plain OffloadingConnector:
        # ``_load``).
        self.loads_after_reattach = 0
        self._stall_logged = False
        self._current: Job | None = None  # the job whose transfer the job thread is in, and since when
        self._current_since = 0.0
        # The connection let go of a dead service's client: the transport lets go of it between jobs.
        self._client_dropped = False
        # Set while the watchdog has something to watch: a load pending, or the job thread in a transfer.
        self._watch_needed = threading.Event()
        self._thread = start_thread(self._run, "kvtier-worker-jobs")
        self._watchdog = start_thread(self._watch_loads, "kvtier-worker-watchdog")
        connection.add_count_source(self.reported_counts)
        connection.add_drop_listener(self._on_client_dropped)
        with registry_lock:
            _service_workers.add(self)

    def _on_client_dropped(self) -> None:
        with self._cv:
            self._client_dropped = True
            self._cv.notify_all()

    @property
    def can_report_load_failures(self) -> bool:
        return self.results.can_report_load_failures

    @can_report_load_failures.setter
    def can_report_load_failures(self, value: bool) -> None:
        with self._cv:
            self.results.can_report_load_failures = value

    def wait_stores_done(self, deadline: float) -> bool:
        """Waits (until the monotonic ``deadline``) for the store queue to empty; False on timeout."""
        with self._cv:
            while self._stores:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    # -- the engine's steps (called by KvtierConnector) ------------------------------------------

    def step_begins(self, prefill_tokens: int) -> None:
        """A forward pass starts; ``prefill_tokens`` of it are prompt tokens (0 for a decode step)."""
        with self._cv:
            self._forward_running = True
            self._set_prefill_running(self._defer_stores and prefill_tokens > 0)

    def step_ends(self) -> None:
        with self._cv:
            self._forward_running = False
            self._set_prefill_running(False)

    def _set_prefill_running(self, running: bool) -> None:
        """Holds ``_cv``. Wakes the job thread only when held-back stores may go now: no other change
        of a step gives it work, and on a CPU engine every wakeup takes a core (and then the GIL) from
        the forward pass's threads, three times a step."""
        stores_released = self._prefill_running and not running and bool(self._stores)
        self._prefill_running = running
        if stores_released:
            self._cv.notify_all()

    # -- submission ------------------------------------------------------------------------------

    def _submit(self, vllm_job_id: int, is_load: bool, keys: list[bytes], block_ids: list[int]) -> bool:
        _check_job(vllm_job_id, keys, block_ids)
        job = Job(vllm_job_id, is_load, block_ids, time.monotonic_ns(), self.transport.ready_marker())
        job.gate, job.progressed_at = self.transport.new_gate(), time.monotonic()
        with self._cv:
            if not keys:
                self.results.finished.append(TransferResult(vllm_job_id, True, 0, 0.0))
                return True
            if self._stuck() and self._skip(job, keys):
                return True
            if is_load:
                self._loads.append((job, keys))
                self._watch_needed.set()
            elif self._defer_stores and self._backlog_blocks() + len(keys) > self._deferred_store_max_blocks:
                self._drop_store(job, keys)
                return True
            else:
                work = _StoreWork(job, keys, [False] * len(keys))
                self._stores.append(work)
                self._works[vllm_job_id] = work
            self._pending[vllm_job_id] = job
            self._cv.notify_all()
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, False, *_store_job(src_spec, dst_spec))

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        return self._submit(job_id, True, *_load_job(src_spec, dst_spec))

    def reported_counts(self) -> dict[str, int]:
        """What this worker reports to the service's per-engine counters, by their names: the jobs it
        gave up or skipped (served at recompute), and the loads it held for a reattach (served late)."""
        return {
            "given_up_loads": self.given_up_loads,
            "given_up_stores": self.given_up_stores,
            "skipped_loads": self.skipped_loads,
            "skipped_store_blocks": self.skipped_store_blocks,
            "loads_after_reattach": self.loads_after_reattach,
        }

    def _stuck(self) -> bool:
        """Holds ``_cv``. Whether the job thread is in a transfer that copied nothing for the stall
        timeout (a frozen service): a job queued now would wait behind it."""
        now = time.monotonic()
        current = self._current
        return current is not None and now - self._current_since > self._stall_timeout_s and self._stalled(current, now)

    def _skip(self, job: Job, keys: list[bytes]) -> bool:
        """Holds ``_cv``. Answers a job submitted while the job thread is stuck, at once: a store is
        not stored (a cache: a miss later), a load fails (vLLM recomputes it) where the connector
        reports failed loads. Under vLLM's plain OffloadingConnector a load is queued (False): a
        failed load stops the engine there."""
        if job.is_load and not self.results.can_report_load_failures:
            return False
        if job.is_load:
            self.skipped_loads += 1
        else:
            self.skipped_store_blocks += len(keys)
        self.results.complete(job, [False] * len(keys))
        return True

    def _backlog_blocks(self) -> int:
        return sum(work.remaining for work in self._stores)

    def _drop_store(self, job: Job, keys: list[bytes]) -> None:
        """Holds ``_cv``. The newest job goes, not the oldest: older ones hold earlier prefix blocks."""
        if self.dropped_store_blocks == 0:
            logger.warning(
                "kvtier: %d store blocks are held back behind prefill steps (deferred_store_max_blocks=%d); "
                "dropping new stores until they drain (raise the option, or set defer_stores=false)",
                self._backlog_blocks(),
                self._deferred_store_max_blocks,
            )
        self.dropped_store_blocks += len(keys)
        self.results.complete(job, [False] * len(keys))

    # -- the job thread --------------------------------------------------------------------------

    def _next_work(self) -> tuple[Job, list[bytes]] | _StoreWork | None:
        """Holds ``_cv``; waits for work it may do now. None when stopping with nothing left, or
        when the connection let go of a dead client (``_client_dropped``) and no job waits."""
        counted_deferral = False
        while True:
            if self._loads:
                return self._loads.pop(0)
            if self._stores:
                work = self._stores[0]
                if not self._prefill_running or self._stopping or work.job.vllm_job_id in self._urgent:
                    return work
                if not counted_deferral and work.copied == 0:
                    self.deferred_store_jobs += 1
                    counted_deferral = True
                if self._client_dropped:
                    return None
            elif self._stopping or self._client_dropped:
                return None
            self._cv.wait()
            self.job_thread_wakeups += 1

    def _run(self) -> None:
        self.transport.on_job_thread()
        while True:
            with self._cv:
                work = self._next_work()
                let_go, self._client_dropped = self._client_dropped, False
                self._current = work.job if isinstance(work, _StoreWork) else work[0] if work else None
                self._current_since = time.monotonic()
                if self._current is not None:
                    # Its stall clock starts now: the wait behind the transfers before it is not its own.
                    self._current.progressed_at = self._current_since
                    self._watch_needed.set()
            if let_go:
                self.transport.let_go_of_dead_client()
            if work is None:
                if self._stopping:
                    return
                continue
            if isinstance(work, _StoreWork):
                self._store_batch(work)
            else:
                self._finish(work[0], self._load(*work))
            with self._cv:
                self._current = None
                self._clear_watch()
            self._connection.report_counts()

    def _load(self, job: Job, keys: list[bytes]) -> list[bool]:
        """The job's load. Under vLLM's plain OffloadingConnector a failed load stops the engine: one
        the service did not answer (this worker's connection unattached: its service died or was
        started again, and the scheduler's connection reattached first and offered the blocks it
        recovered) is tried again once the connection reattaches, within ``job_timeout_ms``."""
        deadline = time.monotonic() + self._job_timeout_ms / 1000
        while True:
            found = self.transport.load(job, keys, engine_idle=not self._forward_running)
            if all(found) or self.results.can_report_load_failures or self._connection.available:
                return found
            if not self._connection.wait_attached(deadline - time.monotonic()):
                return found
            with self._cv:
                if job.vllm_job_id not in self._pending:
                    return found  # given up meanwhile (a fence): reported then
            self.loads_after_reattach += 1

    def _store_batch(self, work: _StoreWork) -> None:
        batch = slice(work.copied, work.copied + max(1, STORE_BATCH_BYTES // self.transport.object_bytes))
        found = self.transport.store(work.job, work.keys[batch], work.job.block_ids[batch])
        with self._cv:
            if work.job.vllm_job_id not in self._pending:
                return  # given up meanwhile, and reported with what it had stored then
            work.found[batch] = found
            work.copied += len(found)
            work.job.progressed_at = time.monotonic()
            if work.remaining > 0:
                return
            self._stores.remove(work)
            self._finish_locked(work.job, work.found)

    def _finish(self, job: Job, found: list[bool]) -> None:
        with self._cv:
            self._finish_locked(job, found)

    def _finish_locked(self, job: Job, found: list[bool]) -> None:
        """Holds ``_cv``. A job given up earlier was reported then: its late outcome is dropped."""
        if self._pending.pop(job.vllm_job_id, None) is None:
            return
        self._works.pop(job.vllm_job_id, None)
        self.results.complete(job, found)
        self._urgent.discard(job.vllm_job_id)
        self._clear_watch()
        self._cv.notify_all()

    def _clear_watch(self) -> None:
        """Holds ``_cv``. The watchdog sleeps while no load is pending and no transfer runs."""
        if self._current is None and not any(pending.is_load for pending in self._pending.values()):
            self._watch_needed.clear()

    # -- giving up stalled jobs -------------------------------------------------------------------

    def _stalled(self, job: Job, now: float) -> bool:
        """Holds ``_cv``. Whether ``job`` copied nothing for the stall timeout: a frozen service or a
        stalled tier, not a long transfer (that copies a round at a time)."""
        rounds = int(job.gate.rounds) if job.gate is not None else 0
        if rounds != job.seen_rounds:
            job.seen_rounds, job.progressed_at = rounds, now
        return now - job.progressed_at > self._stall_timeout_s

    def _stalled_loads(self, now: float) -> list[Job]:
        """Holds ``_cv``. The pending loads to give up: the job thread's own when it copied nothing
        for the stall timeout, and those queued behind it only while it is stuck. A load queued
        behind a transfer that progresses (a slow link: at 200 MB/s a 256 MiB load takes seconds)
        waits its turn: giving it up would recompute what a working tier is delivering."""
        stuck = self._stuck()
        loads = [job for job in self._pending.values() if job.is_load]
        for job in loads if not stuck else []:
            if job is not self._current:
                job.progressed_at = now
        return [job for job in loads if stuck or (job is self._current and self._stalled(job, now))]

    def _note_service_reads(self) -> None:
        """A load round waits while the service reads its blocks from NVMe or a remote tier: a round
        of 256 MiB at 200 MB/s, sharing the link with another, copies nothing for 2.7 s. Once the job
        thread's transfer has copied nothing for half the stall timeout, the service's tier reads are
        asked for (on a connection of their own) at each look: while they grow, it progresses. A
        service that does not answer (frozen) is not asked again for that job."""
        with self._cv:
            job = self._current
            if (
                job is None
                or job.service_unanswered
                or time.monotonic() - job.progressed_at < self._stall_timeout_s / 2
            ):
                return
        timeout_ms = min(READS_PROBE_TIMEOUT_MS, int(self._stall_timeout_s * 250))
        reads = self._connection.tier_bytes_read(timeout_ms)
        with self._cv:
            if reads is not None and job.service_reads is not None and reads > job.service_reads:
                job.progressed_at = time.monotonic()
            job.service_reads, job.service_unanswered = reads, reads is None

    def _give_up(self, jobs: list[Job], why: str) -> None:
        """Reports ``jobs`` finished now, once their gates say no copy of theirs runs again: a store
        with the blocks it stored so far (the rest are dropped: a cache), a load as failed (vLLM
        recomputes it). The job thread may stay stuck in its call meanwhile; its outcome is dropped."""
        for job in jobs:
            self._cancel_gate(job)
        with self._cv:
            for job in jobs:
                if job.vllm_job_id not in self._pending:
                    continue  # finished meanwhile
                work = self._works.get(job.vllm_job_id)
                if work is not None and work in self._stores:
                    self._stores.remove(work)
                self._loads = [(queued, keys) for queued, keys in self._loads if queued is not job]
                self.given_up_loads += int(job.is_load)
                self.given_up_stores += int(not job.is_load)
                self._finish_locked(job, work.found if work is not None else [False] * len(job.block_ids))
        if not self._stall_logged:
            self._stall_logged = True
            logger.error(
                "kvtier: %s: %d job(s) made no progress for %.1f s (service_timeout_ms); given up, the engine "
                "recomputes what they would have loaded and keeps its blocks (logged once)",
                why,
                len(jobs),
                self._stall_timeout_s,
            )

    def _cancel_gate(self, job: Job) -> None:
        """Waits until no copy of ``job`` runs and none will start: a copy in progress is a memory copy
        of one round (milliseconds); the service call the job thread may be stuck in is not waited for."""
        deadline = time.monotonic() + self._job_timeout_ms / 1000
        while not job.gate.cancel():
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvtier: a copy of job {job.vllm_job_id} ran past job_timeout_ms; the engine stops")
            time.sleep(0.001)

    def _watch_loads(self) -> None:
        """Gives up loads that stalled (on KvtierConnector's route, which recomputes them). vLLM's
        plain OffloadingConnector stops the engine on a failed load: there a stalled load is waited for.
        While the job thread is stuck (a frozen service), every pending store is given up too: vLLM
        keeps a storing request's engine blocks until its store finishes, and a small engine cache
        that lends them to stores that cannot progress recomputes more than vLLM alone."""
        while not self._stopping:
            self._watch_needed.wait()
            time.sleep(WATCH_INTERVAL_S)
            self._note_service_reads()
            with self._cv:
                now = time.monotonic()
                stalled = self._stalled_loads(now)
                can_fail = self.results.can_report_load_failures
                stores = [job for job in self._pending.values() if not job.is_load] if self._stuck() else []
            if stores:
                self._give_up(stores, "stores behind a stuck transfer")
            if stalled and can_fail:
                self._give_up(stalled, "stalled loads")
            elif stalled and not self._stall_logged:
                self._stall_logged = True
                logger.error(
                    "kvtier: %d load(s) made no progress for %.1f s; under vLLM's OffloadingConnector a failed "
                    "load stops the engine, so they are waited for. kv_connector='KvtierConnector' recomputes them",
                    len(stalled),
                    self._stall_timeout_s,
                )

    # -- vLLM's side -----------------------------------------------------------------------------

    def get_finished(self) -> list[TransferResult]:
        with self._cv:
            return self.results.take_finished()

    def wait(self, job_ids: set[int]) -> None:
        """vLLM is about to reuse these jobs' engine blocks: a held-back store goes now, and the
        fence waits while the jobs progress. One that copied nothing for the stall timeout (a frozen
        service) is given up through its gate, so the fence returns without a copy left to land:
        a sick service costs the engine one stall timeout, never its step loop. While the job thread
        stays stuck in that call, jobs submitted are answered at once (``_skip``): a fence or a load
        on them never waits behind it."""
        with self._cv:
            self._urgent |= set(self._pending) & job_ids
            self._start_stall_clocks_at_fence(job_ids)
            self._cv.notify_all()
        while True:
            with self._cv:
                waiting = [self._pending[job_id] for job_id in job_ids if job_id in self._pending]
                now = time.monotonic()
                stalled = [job for job in waiting if self._stalled(job, now)]
                if not waiting:
                    return
                if not stalled:
                    self._cv.wait(FENCE_POLL_S)
                    continue
            self._give_up(stalled, "a fence")

    def _start_stall_clocks_at_fence(self, job_ids: set[int]) -> None:
        """Holds ``_cv``. A fenced job still queued (a store held back behind prefill steps, or waiting
        its turn behind a transfer that progresses) has copied nothing because it has not run, not
        because the service is stuck: its stall clock starts at the fence, so the fence gives it one
        stall timeout to run (it goes next: urgent). While the job thread is stuck in a call, queued
        jobs are given up at once, as before."""
        if self._stuck():
            return
        now = time.monotonic()
        for job_id in job_ids:
            job = self._pending.get(job_id)
            if job is not None and job is not self._current:
                job.progressed_at = max(job.progressed_at, now)

    def take_failed_load_block_ids(self) -> set[int]:
        with self._cv:
            return self.results.take_failed_load_block_ids()

    def shutdown(self) -> None:
        self._connection.stop_reconnecting()  # the jobs still queued must not start a stopped service
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._watch_needed.set()
        self._join_while_progressing()
        self.transport.close()
        self._connection.close()

    def _join_while_progressing(self) -> None:
        """Lets the job thread run the jobs still queued (stores not lost at a restart) while they
        progress, up to ``job_timeout_ms``. One stuck in a call a frozen service does not answer is
        let go after the stall timeout, its copies cancelled: vLLM's shutdown waited the whole
        ``job_timeout_ms`` (120 s by default) for it."""
        deadline = time.monotonic() + self._job_timeout_ms / 1000
        stuck = False
        while self._thread.is_alive() and time.monotonic() < deadline and not stuck:
            self._thread.join(timeout=FENCE_POLL_S)
            with self._cv:
                stuck = self._stuck()
        if not self._thread.is_alive():
            return
        # Gone or not, no copy of a job left behind may land once the transport closes.
        with self._cv:
            pending = list(self._pending.values())
        for job in pending:
            with contextlib.suppress(RuntimeError):  # a copy past job_timeout_ms: shutting down anyway
                self._cancel_gate(job)
        logger.warning(
            "kvtier: %s; the engine shuts down without its %d job(s) in progress (their stores are not stored)",
            "the host service does not answer" if stuck else "the job thread ran past job_timeout_ms",
            len(pending),
        )


class ServiceWorker(JobQueueWorker):
    """A CPU rank's worker in the host-service layout: the job queue with ``ServiceCopy`` (a
    constructor only: the queue's behaviour is ``JobQueueWorker``'s, the copies the transport's)."""

    def __init__(
        self,
        connection: ServiceConnection,
        layer_buffers: list[np.ndarray],
        page_bytes: int,
        job_timeout_ms: int,
        defer_stores: bool = True,
        deferred_store_max_blocks: int = 4096,
        stall_timeout_ms: int = 2_000,
    ):
        transport = ServiceCopy(connection, layer_buffers, page_bytes)
        super().__init__(
            connection, transport, job_timeout_ms, defer_stores, deferred_store_max_blocks, stall_timeout_ms
        )


class GpuServiceWorker(JobQueueWorker):
    """A GPU rank's worker: the job queue with ``GpuDma`` (a constructor only). No CPU copy threads
    are involved, so stores need not be held back behind prefill (``defer_stores`` is off)."""

    def __init__(
        self,
        connection: ServiceConnection,
        rows: list[torch.Tensor],
        job_timeout_ms: int,
        stall_timeout_ms: int = 2_000,
    ):
        transport = GpuDma(connection, rows)
        self.transfers = transport.transfers
        super().__init__(connection, transport, job_timeout_ms, defer_stores=False, stall_timeout_ms=stall_timeout_ms)
