"""``KvtierLoadStoreSpec``: what the scheduler side hands the worker side for one job.

vLLM's offloading keeps the medium a job reads or writes apart from both of its ends (its CPU
medium's spec is in ``vllm/v1/kv_offload/cpu/common.py``, beside neither the manager nor the
worker), so that the manager, which makes specs, and the worker, which reads them, need not know
each other. kvtier's spec lives here for the same reason.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import LoadStoreSpec


class KvtierLoadStoreSpec(LoadStoreSpec):
    """The kvtier keys of a load or store job, in the order of the engine blocks of the job."""

    def __init__(self, keys: list[bytes]):
        self.keys = keys

    def __repr__(self) -> str:
        return f"KvtierLoadStoreSpec({len(self.keys)} blocks)"
