"""``vllm serve`` with kvtier's LMCache CPU copy shim, for ``kvtier bench serve``'s LMCache rows.

Run with the interpreter of the LMCache virtualenv (scripts/install_lmcache_vllm.sh) and
``PYTHONPATH=<repo>/python``, exactly as the ``vllm`` command: ``python -m kvtier.bench.lmcache_serve
serve MODEL --kv-transfer-config '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}' ...``.

Why a launcher: LMCache 0.5.6 has no CPU data mover, so the shim (``kvtier.bench.lmcache_cpu_shim``)
must be installed in the process that creates vLLM's KV connector. Under ``vllm serve`` that is the
worker process (LMCache's scheduler side lives in the engine-core process, its copies in the
worker's), which vLLM starts with multiprocessing's *spawn* method on CPU (its CPU platform sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn``): a spawned child imports the parent's main module again (as
``__mp_main__``) before it runs, so the ``install()`` below, at module level and outside the
``__main__`` guard, runs in the API server, the engine core and the worker alike. The shim writes its
counters to ``$KVTIER_LMCACHE_SHIM_COUNTERS.<pid>.json`` (set by the benchmark), since the benchmark
cannot ask those processes directly.
"""

from __future__ import annotations

import sys

from kvtier.bench import lmcache_cpu_shim

lmcache_cpu_shim.install()


def main() -> int:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
