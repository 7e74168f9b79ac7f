"""How a rank's worker in the host-service layout copies its blocks (``JobQueueWorker``'s
transport): ``ServiceCopy`` on the CPU, between the KV cache's rows and the service's shared pool;
``GpuDma`` on a GPU, by its DMA engine."""

from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np
import torch

from kvtier.vllm.connection import ServiceConnection
from kvtier.vllm.cores import affinity, set_affinity, spare_cores, usable_cores
from kvtier.vllm.jobs import Job
from kvtier.vllm.options import KvtierVllmConfigError

# Threads that copy a large load out of the pool while the engine has no forward pass running.
LOAD_COPY_THREADS = min(4, os.cpu_count() or 1)


class Transport(Protocol):
    """Does a ``JobQueueWorker``'s copies, on its job thread."""

    object_bytes: int

    def on_job_thread(self) -> None:
        """Runs first on the job thread."""

    def ready_marker(self) -> Any:
        """Runs on the engine's thread when vLLM submits a job; the job's copies wait for it."""

    def new_gate(self) -> Any:
        """A job's gate: ``cancel()`` (True once no copy of the job will run again), ``rounds``."""

    def load(self, job: Job, keys: list[bytes], engine_idle: bool) -> list[bool]:
        """Copies ``keys`` into ``job.block_ids``; ``engine_idle``: no forward pass runs, vLLM waits."""
        ...

    def store(self, job: Job, keys: list[bytes], block_ids: list[int]) -> list[bool]: ...

    def let_go_of_dead_client(self) -> None:
        """Runs on the job thread, between jobs, once the connection let go of a dead service's
        client: whatever the transport holds of it goes too."""

    def close(self) -> None:
        """Runs while the connection's pool mapping is still there."""


class ServiceCopy:
    """The CPU copies a rank's rows between its KV cache and the service's shared pool (the Rust
    binding's ``load_blocks``/``store_blocks``), on a spare core when there is one."""

    def __init__(self, connection: ServiceConnection, layer_buffers: list[np.ndarray], page_bytes: int):
        self._connection = connection
        self._layers = layer_buffers
        self.object_bytes = page_bytes * len(layer_buffers)
        # What the connection copies loads with now: 1 on each new client (a reattach starts one).
        self._copy_threads = (1, connection.client_epoch)
        # The cores vLLM bound this worker's compute to (this constructor runs on its main thread,
        # after the binding) and the others: stores are copied on a spare core when there is one.
        self._compute_cores = affinity()
        binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
        self._spare_cores = spare_cores(self._compute_cores, usable_cores(), binding)

    def on_job_thread(self) -> None:
        set_affinity(self._spare_cores)

    def let_go_of_dead_client(self) -> None:
        pass  # every copy goes through the connection's current client

    def ready_marker(self) -> Any:
        return None

    def new_gate(self) -> Any:
        from kvtier._core import CopyGate

        return CopyGate()

    def load(self, job: Job, keys: list[bytes], engine_idle: bool) -> list[bool]:
        spread = self._spread_load(engine_idle)
        found = self._connection.call("load_blocks", keys, self._layers, job.block_ids, job.gate, default=None)
        if spread:
            set_affinity(self._spare_cores)
        return list(found) if found is not None else [False] * len(keys)

    def store(self, job: Job, keys: list[bytes], block_ids: list[int]) -> list[bool]:
        found = self._connection.call("store_blocks", keys, self._layers, block_ids, job.gate, default=None)
        return list(found) if found is not None else [False] * len(keys)

    def _spread_load(self, engine_idle: bool) -> bool:
        """While no forward pass runs the engine waits for this load, so every core copies it (the
        job thread's binding widens for the copy; True if it did). Beside a forward pass one thread
        copies, on a spare core if there is one."""
        threads = LOAD_COPY_THREADS if engine_idle else 1
        epoch = self._connection.client_epoch
        if epoch != self._copy_threads[1] and threads == 1:
            self._copy_threads = (1, epoch)  # a new client copies with one thread already
        # A call answered with its miss, unsent, changed nothing: it is sent again next time.
        sent = (threads, epoch) != self._copy_threads and self._connection.call(
            "set_copy_threads", threads, default=False
        ) is not False
        if sent:
            self._copy_threads = (threads, epoch)
        if engine_idle and self._spare_cores:
            set_affinity(self._spare_cores | self._compute_cores)
            return True
        return False

    def close(self) -> None:
        pass


class GpuDma:
    """A GPU rank's copies, by the GPU's DMA engine (``kvtier.gpu``): stores reserve pool slots,
    copy on a side stream after the engine's event, wait for their own event and commit; loads
    acquire rounds and copy each while the service reads the next one from NVMe. The engine's stream
    is never synchronized."""

    def __init__(self, connection: ServiceConnection, rows: list[torch.Tensor]):
        from kvtier.gpu.transfers import BlockTransfers

        self._connection = connection
        # Failed service calls of the transfers count as the connection's (metrics, logs).
        self.transfers = BlockTransfers(rows, on_failed_call=connection.count_failed_call)
        self.object_bytes = sum(int(r.shape[1]) for r in rows)
        client = connection.live_client()
        if client is not None:
            try:
                self.transfers.bind(client)  # pins the pool and picks the executor: fails at start-up
            except Exception as error:
                raise KvtierVllmConfigError(f"kvtier cannot move this rank's GPU KV cache: {error}") from error

    def on_job_thread(self) -> None:
        pass

    def ready_marker(self) -> Any:
        return self.transfers.ready_marker()

    def new_gate(self) -> Any:
        from kvtier.gpu.transfers import DmaGate

        return DmaGate(self.transfers.side)

    def load(self, job: Job, keys: list[bytes], engine_idle: bool) -> list[bool]:
        return self.transfers.load(self._connection.live_client(), keys, job.block_ids, job.ready, job.gate)

    def store(self, job: Job, keys: list[bytes], block_ids: list[int]) -> list[bool]:
        return self.transfers.store(self._connection.live_client(), keys, block_ids, job.ready, job.gate)

    def let_go_of_dead_client(self) -> None:
        """The transfers' binding held the dead client, and with it the dead pool's mapping (pinned):
        until the next job, so an idle engine kept a killed service's pool mapped and the service
        started again allocated a new one beside it."""
        self.transfers.release_unless(self._connection.current_client)

    def close(self) -> None:
        self.transfers.close()  # unpins the pool before the connection unmaps it
