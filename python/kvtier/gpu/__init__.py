"""The GPU data path: one rank's KV-cache blocks between a CUDA paged KV cache and the host
service's shared DRAM pool.

- ``plan``: where each byte of a rank's slice lies, in its KV-cache pages and in the pool's block
  objects (layout math; no torch, no GPU).
- ``device``: the torch side: pinning the pool (``cudaHostRegister`` in pieces), side streams and
  completion events, and the same interface on the CPU, where every copy is synchronous.
- ``executors``: how a batch of copies is issued: one ``cuMemcpyBatchAsync`` per job, vLLM's
  ``swap_blocks_batch`` under GPU vLLM, or kvtier's own per-layer gathers plus one DMA per block.
- ``transfers``: a job against the host service: reserve, copy, commit for stores; acquire in
  rounds, copy while the next round is read from NVMe, release, for loads.
- ``layouts``: vLLM's GPU KV layouts and model shapes, for the benchmark (``kvtier bench gpu``).

docs/gpu.md says which path runs when and what has been validated on a GPU.
"""

from kvtier.gpu.plan import CopyPlan, Segment

__all__ = ["CopyPlan", "Segment"]
