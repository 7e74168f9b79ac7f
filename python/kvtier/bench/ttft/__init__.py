"""`kvtier bench ttft`: time to first token through a real vLLM engine, with and without kvtier.

This module owns the TTFT benchmark: seed 002's experiment 1 (TTFT vs prompt length at a 100% hit
rate) and experiment 2 (TTFT vs hit rate at one prompt length), run on the ``kv8b`` model of
``kvtier.models`` (the KV cache of Llama-3-8B: 128 KiB per token) with in-process ``vllm.LLM``
engines, greedy, ``max_tokens=1``. TTFT is the wall time of one ``LLM.generate()`` call with one
prompt (with ``max_tokens=1`` that call ends at the first token; offline engines export no
per-request metrics).

Configurations (one engine alive at a time, each in its own child process):

- ``recompute``: no kvtier; vLLM's prefix cache reset before the request.
- ``vllm_prefix``: vLLM's own prefix cache hit (the same prompt again, no reset).
- ``kvtier_miss``: kvtier on, prompt never seen (recompute plus storing: the cost of offloading).
  kvtier runs as in production: the engine starts the host service (``kvtier serve``) and its
  worker copies into the service's shared pool; the benchmark reads the service's counters.
- ``kvtier_dram``: stored by kvtier, vLLM's prefix cache reset, served from kvtier's DRAM pool (each
  prompt in a fresh engine process and a fresh service: kvtier keeps blocks read back ahead of
  blocks seen once, so earlier prompts would otherwise crowd a pool sized for one prompt).
- ``kvtier_nvme``: a fresh engine process and service over the same store directory (the pool
  starts empty, every block is on NVMe: checked with ``locate_many`` before timing), page cache dropped
  (``echo 3 > /proc/sys/vm/drop_caches``) and one short warm-up request (no full block, so no kvtier
  I/O) to fault the engine's own code back in before timing.
- ``kvtier_nvme_encrypted``: the cost of encryption at rest on an NVMe hit (issue 40), only with
  ``--encrypted``: ``kvtier_nvme`` on a store directory of its own (``kvtier-encrypted``, never the clear
  row's blocks) with ``encryption_key_file`` set, a throwaway key (32 random bytes, mode 0600) in the
  run's runtime directory, for both engines: one engine computes every prompt the NVMe phase reads
  (experiment 1's prompts, experiment 2's stored bases; every value written to NVMe encrypted), then
  the timed engine, as ``kvtier_nvme`` (fresh service, every block on NVMe, page cache dropped, no
  disk floor). The summary's ``encryption`` gives per length both medians and encrypted / clear.
- ``example_connector``: vLLM's ExampleConnector (per-layer safetensors files), page cache dropped.
- ``kvtier_shared``: a shared-tier hit (seed 002's experiment 5 through vLLM), only with
  ``--shared-root-store PATH --shared-root-load PATH``: two paths of the same shared directory as two
  nodes see it (two mounts of one network filesystem volume, or one local directory twice). Node A,
  one engine process with kvtier's ``shared_root`` under ``--shared-root-store``, computes every prompt
  (the ``p:L:r`` prompts of the recompute rows), and its store publishes the blocks to the shared tier;
  a flush after each prompt waits until they are published (the phase fails if the store dropped a
  publish or failed one). Then, per prompt, node B: a fresh engine process and a fresh host service
  with an empty local store directory (nothing in DRAM or on NVMe: checked) and ``shared_root`` under
  ``--shared-root-load``; ``locate_many`` must place every block of the prompt in the ``shared`` tier
  before timing; page cache dropped, a short warm-up request (no full block), and the timed request,
  whose blocks must all be counted as shared-tier hits by the service (else a problem is recorded,
  the table shows ``!`` and the benchmark exits 1). Each run uses a fresh subdirectory of the shared
  root (``kvtier-ttft-<timestamp>-<pid>``), removed at the end. ``--shared-file-bytes`` sets both
  nodes' ``shared_file_bytes`` (how many blocks node A packs into one published file).
- ``kvtier_object``: an object-tier hit (S3), only with ``--object``: the bucket is ``--bucket-url`` (credentials
  from the environment) or Ceph's RADOS gateway on 127.0.0.1, brought up and torn down by the benchmark
  (``scripts/distfs/radosgw.sh``, root). As ``kvtier_shared``, with the bucket instead of the shared
  directory: node A computes every prompt with the object tier on and its flush waits until the blocks'
  segments and index objects are PUT; then per prompt a fresh engine and service with an empty local
  store and the same bucket prefix, every block of the prompt placed in the remote tier by
  ``locate_many`` before timing, and every block of the timed request counted in ``bucket_hits`` (one
  ranged GET per run of adjacent blocks of a segment). ``--bucket-segment-bytes`` sets both nodes'
  ``bucket_segment_bytes``.
- ``kvtier_object_encrypted``: with ``--object --encrypted``, ``kvtier_object`` again with the run's key
  on both nodes (node A seals every value before its PUT, node B opens each hit in its DRAM slot), under
  a prefix of its own (``<prefix>/encrypted``: node B can only be served blocks sealed by node A). Both
  rows' nodes A run first, then the two rows' loads of each prompt one after the other. The summary's
  ``encryption`` gives its rows with ``tier: object`` beside the NVMe ones.
- ``kvtier_object_always`` / ``kvtier_object_auto`` (and ``kvtier_shared_*``): with ``--slow-link MB/S,...``
  (and ``--object`` and/or the shared roots), node B of the remote-tier row behind a slow link, per link
  speed: the bucket through ``kvtier.bench.slowlink`` (a TCP proxy), the shared directory through
  ``kvtier.bench.slowmount`` (a FUSE passthrough), each limited to that rate with
  ``--slow-link-latency-ms`` added. ``always`` loads every hit (``load_policy: always``, a deadline
  long enough to wait for it), ``auto`` is kvtier's choice (``load_policy: auto``); recompute is the
  baseline's. Their records are ``experiment: "slow_link"``, summarized apart (``slow_rows``). Every
  other kvtier row pins ``load_policy: always`` (a row named for a tier's hit measures loading it),
  and every engine of a run shares the run's own runtime directory (``XDG_RUNTIME_DIR``: its
  sockets and the costs files the engines leave each other).
- ``lmcache_disk``: LMCache's vLLM connector (LMCacheConnectorV1, LMCache 0.5.6) with its local disk
  backend, through kvtier's CPU copy shim (``kvtier.bench.lmcache_cpu_shim``: LMCache has no data
  mover for CPU vLLM). It runs in its own virtualenv (``scripts/install_lmcache_vllm.sh`` makes
  ``.venv-lmcache-vllm``; or ``--lmcache-python``), one engine process (LMCache's disk index lives in
  memory): each prompt is computed and stored, then vLLM's prefix cache reset, the page cache dropped,
  a short warm-up request, and the timed request. LMCache's CPU cache is off (``local_cpu: false``;
  its CPU pool only stages reads), and each hit is checked to have been read from disk. Not measured
  (a note says why) without that virtualenv.

Prompts are seeded random token ids: ``L + 2`` tokens, so that the ``L`` tokens of full blocks can
be hits and two tokens are always computed (see ``PROMPT_EXTRA_TOKENS``). Experiment 2 builds a prompt
of ``L + 2`` tokens whose first ``h * L`` tokens are stored (rounded down to a block) and the rest new.

Every measurement records the cached tokens vLLM reports (checked against the expected hit) and
the greedy token with its logprob; restored runs are compared to the recompute of the same prompt.

Output: tables on stdout (rich if installed), ``results.json`` and PNG plots (matplotlib, Agg) in
``bench-results/ttft-<timestamp>/``, with one engine log per phase under ``logs/``.

The package, in import order (each module imports only the ones before it; tests/test_bench_ttft_layout.py
checks it):

- ``plan``: constants, ``BenchError``, the command line (``build_parser``) and ``make_plan``.
- ``prompts``: the seeded prompts of both experiments.
- ``engine``: one in-process vLLM engine and its store as the phases measure them (``Engine``,
  ``kvtier_transfer``, ``ServiceView``).
- ``engine_phase``: what runs in a child process, one engine each (``run_phase`` and the phases).
- ``orchestrate``: the parent's side: ``launch_phase`` and the summary (``summarize``, the targets).
- ``report``: tables (stdout, report.md) and plots.
- ``slow_rows``: the slow-link rows' phases, links (proxies, mounts, the costs files between speeds),
  summary, checks and tables.
- ``entry``: ``main(argv)``; ``__main__`` runs it for ``python -m kvtier.bench.ttft``.

Below: the names the CLI, the other benchmarks (blocks, serve, scripts/distfs) and the tests use.
"""

from kvtier.bench.ttft.engine import kvtier_transfer
from kvtier.bench.ttft.engine_phase import LMCACHE_HASH_SEED, lmcache_log_problem
from kvtier.bench.ttft.entry import main
from kvtier.bench.ttft.orchestrate import shared_row_failures, summarize
from kvtier.bench.ttft.plan import (
    CPU_BLOCK_MULTIPLE,
    LMCACHE_CHUNK_TOKENS,
    LMCACHE_INSTALL,
    LMCACHE_VENV,
    BenchError,
    build_parser,
    make_plan,
    parse_lengths,
    parse_tokens,
    repo_root,
)
from kvtier.bench.ttft.report import (
    CONFIG_LABELS,
    io_pattern_section,
    markdown_table,
    print_report,
    table_rows,
    write_plots,
)

__all__ = [
    "CONFIG_LABELS",
    "CPU_BLOCK_MULTIPLE",
    "LMCACHE_CHUNK_TOKENS",
    "LMCACHE_HASH_SEED",
    "LMCACHE_INSTALL",
    "LMCACHE_VENV",
    "BenchError",
    "build_parser",
    "io_pattern_section",
    "kvtier_transfer",
    "lmcache_log_problem",
    "main",
    "make_plan",
    "markdown_table",
    "parse_lengths",
    "parse_tokens",
    "print_report",
    "repo_root",
    "shared_row_failures",
    "summarize",
    "table_rows",
    "write_plots",
]
