#!/usr/bin/env bash
# Install LMCache (the anchor that `kvtier bench io` compares against) into its own virtualenv,
# .venv-lmcache at the repository root, so that its torch/numpy pins never touch the main .venv.
#
#   scripts/install_lmcache.sh            # creates or updates .venv-lmcache
#   LMCACHE_VENV=/path/to/venv scripts/install_lmcache.sh
#
# Recipe that works on a CPU-only machine: lmcache 0.5.6 with PyPI's torch 2.13.0 (a CUDA build, which
# runs on CPU; LMCache then selects its CPU stub device). About 5 GB of disk for the CUDA wheels.
# The benchmark finds the venv by itself; or pass `--lmcache-python .venv-lmcache/bin/python`.
set -euo pipefail

LMCACHE_VERSION="${LMCACHE_VERSION:-0.5.6}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON_VERSION="${PYTHON_VERSION:-3.11}"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${LMCACHE_VENV:-$repo_root/.venv-lmcache}"

if ! command -v uv >/dev/null 2>&1; then
    if [ -x "$HOME/.local/bin/uv" ]; then
        export PATH="$HOME/.local/bin:$PATH"
    else
        echo "installing uv (pip install --user uv) ..." >&2
        python3 -m pip install --user --quiet uv
        export PATH="$HOME/.local/bin:$PATH"
    fi
fi

if [ ! -x "$venv/bin/python" ]; then
    uv venv "$venv" --python "$PYTHON_VERSION"
fi
uv pip install --python "$venv/bin/python" "lmcache==$LMCACHE_VERSION" "torch==$TORCH_VERSION" numpy

# Smoke check: LMCache imports and its local disk backend module loads on this machine.
"$venv/bin/python" - <<'PY'
import importlib.metadata as metadata
import torch
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend  # noqa: F401
print(f"lmcache {metadata.version('lmcache')} with torch {torch.__version__} ready")
PY
echo "LMCache is in $venv; kvtier bench io will use $venv/bin/python" >&2
