"""Benchmarks of kvtier (`kvtier bench ...`).

- `io`: the store against the disk's physical limit (fio) and LMCache's disk backend (`kvtier bench io`).
- `workload`: model KV shapes, object kinds and the deterministic block data every system moves.
- `fio`, `kvtier_store`, `lmcache_client` (+ `lmcache_runner`, run in LMCache's own interpreter):
  one measurement each; `report`: summaries, targets, table and plot.

`ttft` (time to first token through a real engine) is provided by the engine integration, when present.
"""
