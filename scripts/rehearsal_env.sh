#!/usr/bin/env bash
# Builds the GPU run's rehearsal environment (tests/test_gpu_rehearsal.py, docs/gpu.md): a Python 3.12
# virtual environment shaped like the GPU machine's /opt/torch/.venv: itself a venv, holding torch
# 2.11 (the machine's version, the CUDA build from PyPI, run on the CPU) and numpy with torch's own
# pure-Python needs, and nothing of kvtier, vLLM or Rust, and no pip (as `uv venv` makes them: the
# GPU run must not need one). Idempotent; prints the environment's python.
#
# Where: $KVTIER_REHEARSAL_DIR, default ~/.cache/kvtier-rehearsal (outside the repository; built once,
# about 1.5 GB, of which the downloads are torch's 531 MB wheel and numpy's 16 MB; pip's cache keeps
# them). torch's CUDA libraries (the nvidia-* wheels, about 3 GB to download) are hard-linked from the
# repository's .venv, whose torch is also a CUDA 13 build: the same sonames, so import torch works on
# a CPU without downloading them again.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="${KVTIER_REHEARSAL_DIR:-$HOME/.cache/kvtier-rehearsal}"
env_dir="$root/torch-venv"
python="$env_dir/bin/python3"
torch_version=2.11.0
if [[ -x "$python" ]] && "$python" -c "import torch, numpy; assert torch.__version__.startswith('$torch_version')" 2>/dev/null \
    && ! "$python" -c "import pip" 2>/dev/null; then
    echo "$python"
    exit 0
fi
base=""
for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    if "$candidate" -c 'import venv' 2>/dev/null; then base=$candidate; break; fi
done
[[ -n "$base" ]] || { echo "python3.12 is missing: install it (pyenv install 3.12) and rerun" >&2; exit 1; }
venv_nvidia=$(ls -d "$repo_root"/.venv/lib/python3.*/site-packages/nvidia 2>/dev/null | head -n 1 || true)
[[ -n "$venv_nvidia" ]] || { echo "no nvidia libraries in .venv: run scripts/setup.sh first" >&2; exit 1; }
mkdir -p "$root/wheels"
rm -rf "$env_dir"
"$base" -m venv "$env_dir"
"$python" -m pip download --quiet --no-deps --only-binary=:all: -d "$root/wheels" \
    "torch==$torch_version" numpy filelock typing-extensions sympy mpmath networkx jinja2 markupsafe fsspec >&2
"$python" -m pip install --quiet --no-index --no-deps "$root"/wheels/*.whl >&2
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp -al "$venv_nvidia" "$site/nvidia" 2>/dev/null || cp -a "$venv_nvidia" "$site/nvidia"
"$python" -m pip uninstall --quiet --yes pip >&2
"$python" -c "import torch, numpy; print('rehearsal env: torch', torch.__version__, 'numpy', numpy.__version__)" >&2
echo "$python"
