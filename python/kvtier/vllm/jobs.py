"""A worker's jobs: ``Job`` (one vLLM transfer job, with what the watchdog knows of its progress)
and ``JobResults`` (what vLLM collects of finished jobs)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import TransferResult

logger = logging.getLogger("kvtier.vllm")


@dataclass
class Job:
    vllm_job_id: int
    is_load: bool
    block_ids: list[int]
    started_ns: int
    # GPU workers: an event on the engine's stream at submission; the job's copies wait for it.
    ready: Any = None
    # Lets another thread give the job up without racing its copies (``CopyGate``, ``DmaGate``).
    gate: Any = None
    # For the watchdog: the gate's rounds when last seen, and when they last changed.
    seen_rounds: int = 0
    progressed_at: float = 0.0
    # The service's tier reads (bytes) when the watchdog last asked during a long round; None before
    # the first answer and once the service did not answer (then it is not asked again).
    service_reads: int | None = None
    service_unanswered: bool = False


class JobResults:
    """What vLLM collects of finished jobs: ``TransferResult``s, and the engine blocks of failed
    loads (reported only when the connector may recompute them)."""

    def __init__(self, object_bytes: int):
        self.object_bytes = object_bytes
        self.finished: list[TransferResult] = []
        self.failed_load_block_ids: set[int] = set()
        # Set by KvtierConnector: failed loads are reported to vLLM, which recomputes them.
        self.can_report_load_failures = False

    def complete(self, job: Job, found: list[bool]) -> tuple[float, int]:
        """Records ``job``'s outcome; returns its seconds and how many of a load's blocks failed."""
        seconds = (time.monotonic_ns() - job.started_ns) / 1e9
        first_failure = next((index for index, ok in enumerate(found) if not ok), len(found))
        moved_blocks = first_failure if job.is_load else sum(1 for ok in found if ok)
        success = True
        if job.is_load and first_failure < len(found):
            # Every block from the first failure on is invalid: later blocks of a prefix are
            # useless without it, and vLLM truncates the request there anyway.
            failed_block_ids = job.block_ids[first_failure:]
            if self.can_report_load_failures:
                self.failed_load_block_ids.update(failed_block_ids)
            else:
                logger.error(
                    "kvtier: %d of %d blocks of load job %d failed (missing or failed verification). "
                    "vLLM's OffloadingConnector cannot recompute a failed load, so the engine will stop "
                    "instead of using wrong KV data. Use kv_connector='KvtierConnector' with "
                    "kv_connector_module_path='kvtier.vllm' to recompute such blocks instead.",
                    len(failed_block_ids),
                    len(found),
                    job.vllm_job_id,
                )
                success = False
        self.finished.append(TransferResult(job.vllm_job_id, success, moved_blocks * self.object_bytes, seconds))
        return seconds, len(found) - first_failure if job.is_load else 0

    def take_finished(self) -> list[TransferResult]:
        finished, self.finished = self.finished, []
        return finished

    def take_failed_load_block_ids(self) -> set[int]:
        failed, self.failed_load_block_ids = self.failed_load_block_ids, set()
        return failed
