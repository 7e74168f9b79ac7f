"""``KvtierConnector`` (vLLM's ``OffloadingConnector`` with failed-load reporting and deferred stores)
and ``kv_transfer_config``."""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from kvtier.vllm.costs import StepClock, step_work
from kvtier.vllm.options import SPEC_MODULE_PATH, SPEC_NAME
from kvtier.vllm.spec import _constructing
from kvtier.vllm.worker import JobQueueWorker, KvtierWorker

logger = logging.getLogger("kvtier.vllm")


def prefill_tokens(scheduler_output: Any) -> int:
    """Prompt tokens a step computes: every request scheduled for more than one token (a decode step
    schedules one per request)."""
    return sum(n for n in scheduler_output.num_scheduled_tokens.values() if n > 1)


class StepWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker-to-scheduler metadata with the number of the step it comes from: the scheduler
    times that step (``StepClock``), whichever outputs vLLM sent before it. Every step sends one, so
    every output reaches the scheduler's ``update_connector_output``."""

    def __init__(self, kvtier_step: int, base: OffloadingWorkerMetadata | None = None):
        super().__init__()
        if base is not None:
            self.completed_jobs, self.transfer_stats = base.completed_jobs, base.transfer_stats
        self.kvtier_step = kvtier_step

    def aggregate(self, other: Any) -> Any:
        """The ranks' metadata of one step (TP): vLLM's sum, with the step's number."""
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        return StepWorkerMetadata(max(self.kvtier_step, getattr(other, "kvtier_step", 0)), merged)


def _fill_spec_defaults(vllm_config: Any) -> None:
    transfer_config = vllm_config.kv_transfer_config
    if transfer_config.kv_connector_extra_config is None:
        transfer_config.kv_connector_extra_config = {}
    extra_config = transfer_config.kv_connector_extra_config
    extra_config.setdefault("spec_name", SPEC_NAME)
    extra_config.setdefault("spec_module_path", SPEC_MODULE_PATH)


class KvtierConnector(OffloadingConnector):
    """OffloadingConnector that reports failed kvtier loads to vLLM, which recomputes those blocks.

    It also defaults ``spec_name``/``spec_module_path`` to kvtier's spec and sets vLLM's
    ``kv_load_failure_policy`` to ``recompute`` (kvtier is a cache: a block that fails verification
    is a miss, never an error for the request).
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any):
        _fill_spec_defaults(vllm_config)
        transfer_config = vllm_config.kv_transfer_config
        if getattr(transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            logger.info("kvtier: setting kv_load_failure_policy=recompute (a failed load is recomputed)")
            transfer_config.kv_load_failure_policy = "recompute"
        _constructing.vllm_config = vllm_config
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            _constructing.vllm_config = None
        scheduler = getattr(self, "connector_scheduler", None)
        manager = getattr(scheduler, "manager", None)
        if manager is not None and hasattr(manager, "recomputes_failed_loads"):
            manager.recomputes_failed_loads = True  # blocks held only by a remote tier may be offered
        # The scheduler times vLLM's steps for the load-or-recompute model (kvtier.vllm.costs), by
        # number: the scheduler's last (``build_connector_meta``), the worker's bound one.
        self._step_clock = StepClock() if self._decider() is not None else None
        self._step_number = 0
        self._bound_step: int | None = None

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33 asks this at start when sleep mode is on, and refuses with its own message; under
        the plain OffloadingConnector route kvtier's spec refuses (``spec.refuse_sleep_mode``)."""
        return False

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        worker = self._kvtier_worker()
        if worker is not None:
            worker.can_report_load_failures = True

    def _kvtier_worker(self) -> KvtierWorker | JobQueueWorker | None:
        connector_worker = self.connector_worker
        worker = getattr(connector_worker, "worker", None) if connector_worker is not None else None
        return worker if isinstance(worker, (KvtierWorker, JobQueueWorker)) else None

    def on_new_request(self, request: Any) -> None:
        """Tells the manager the request's ``cache_salt``: its tenant (docs/tenants.md), and the
        load-or-recompute model the request (the requests the engine runs, kvtier.vllm.costs)."""
        manager = getattr(getattr(self, "connector_scheduler", None), "manager", None)
        note_cache_salt = getattr(manager, "note_cache_salt", None)
        if note_cache_salt is not None:
            note_cache_salt(request.request_id, getattr(request, "cache_salt", None))
        decider = self._decider()
        if decider is not None and self._step_clock is not None:
            decider.requests.admitted(request.request_id, int(getattr(request, "num_prompt_tokens", 0) or 0))
        super().on_new_request(request)

    # vLLM calls one of these two as a request ends (the second for connectors that support its
    # hybrid allocator, as OffloadingConnector does).

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        self._forget_running(request.request_id)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        self._forget_running(request.request_id)
        return super().request_finished_all_groups(request, block_ids)

    def _forget_running(self, req_id: str) -> None:
        decider = self._decider()
        if decider is not None:
            decider.requests.finished(req_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._kvtier_worker()
        return worker.take_failed_load_block_ids() if worker is not None else set()

    # The worker holds stores back during prefill steps: the scheduler says how many prompt tokens
    # each step computes. vLLM binds a step's metadata before its forward pass and calls
    # wait_for_save after it (start_load_kv too comes after it, unless a load must finish first).

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        metadata = super().build_connector_meta(scheduler_output)
        metadata.kvtier_prefill_tokens = prefill_tokens(scheduler_output)  # type: ignore[attr-defined]
        self._step_number += 1
        metadata.kvtier_step = self._step_number  # type: ignore[attr-defined]
        if self._step_clock is not None:
            self._step_clock.scheduled(*step_work(scheduler_output), step=self._step_number)
            decider = self._decider()
            if decider is not None:
                decider.requests.scheduled(scheduler_output)
        return metadata

    def update_connector_output(self, connector_output: Any) -> None:
        """The step's output reached the scheduler: its time feeds the prefill model, and the loads
        the workers finished in it feed DRAM's rate (kvtier.vllm.costs)."""
        decider = self._decider()
        if decider is not None and self._step_clock is not None:
            number = getattr(connector_output.kv_connector_worker_meta, "kvtier_step", None)
            step = self._step_clock.finished(step=number)
            if step is not None:
                decider.prefill.observe(*step)
            loads = getattr(getattr(connector_output.kv_connector_worker_meta, "transfer_stats", None), "load", None)
            block_bytes = int(getattr(decider, "worker_block_bytes", 0))
            if loads is not None and loads.bytes > 0 and block_bytes > 0:
                decider.rates.observe("dram", max(1, loads.bytes // block_bytes), loads.time)
            decider.maybe_save()
        super().update_connector_output(connector_output)

    def _decider(self) -> Any:
        manager = getattr(getattr(self, "connector_scheduler", None), "manager", None)
        return getattr(manager, "decider", None)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._bound_step = getattr(connector_metadata, "kvtier_step", None)
        worker = self._kvtier_worker()
        if worker is not None:
            worker.step_begins(getattr(connector_metadata, "kvtier_prefill_tokens", 0))

    def build_connector_worker_meta(self) -> Any:
        """vLLM's metadata of the step, with the step's number (``StepWorkerMetadata``)."""
        meta = super().build_connector_worker_meta()
        if self._bound_step is None or not (meta is None or isinstance(meta, OffloadingWorkerMetadata)):
            return meta
        return StepWorkerMetadata(self._bound_step, meta)

    def wait_for_save(self) -> None:
        super().wait_for_save()
        worker = self._kvtier_worker()
        if worker is not None:
            worker.step_ends()

    def clear_connector_metadata(self) -> None:
        # The step is over even on a path that skipped wait_for_save.
        super().clear_connector_metadata()
        worker = self._kvtier_worker()
        if worker is not None:
            worker.step_ends()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's offloading metrics, with its older ``transfer_type`` ones fed too.

        vLLM 0.32 counts every transfer the worker reports (bytes and seconds per load and store) in
        ``vllm:kv_offload_{load,store}_{bytes,time}``, but its older metrics
        (``vllm:kv_offload_total_bytes``, ``vllm:kv_offload_total_time``, ``vllm:kv_offload_size``,
        label ``transfer_type``) only for its own CPU spec, so with kvtier they stayed at zero while
        GBs moved. They are fed from the same figures here: ``CPU_to_GPU`` = loads from kvtier,
        ``GPU_to_CPU`` = stores into kvtier.
        """
        _fill_spec_defaults(vllm_config)
        prom_metrics = super().build_prom_metrics(vllm_config, *args, **kwargs)
        if hasattr(prom_metrics, "_observe_deprecated_metrics"):
            prom_metrics._observe_deprecated_metrics = True
        else:  # a vLLM other than 0.32: its own transfer metrics still count kvtier's transfers
            logger.warning(
                "kvtier: this vLLM's offload metrics have no switch for the transfer_type ones; "
                "vllm:kv_offload_total_* may stay at zero (read vllm:kv_offload_load_bytes and "
                "vllm:kv_offload_store_bytes)"
            )
        return prom_metrics


def kv_transfer_config(path: str | os.PathLike, **store_options: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` dict that plugs kvtier into vLLM (for ``LLM(kv_transfer_config=...)``
    via ``KVTransferConfig(**...)`` or ``--kv-transfer-config`` as JSON)."""
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": SPEC_MODULE_PATH,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": SPEC_NAME,
            "spec_module_path": SPEC_MODULE_PATH,
            "path": os.fspath(path),
            **store_options,
        },
    }
