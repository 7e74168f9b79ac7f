#!/usr/bin/env bash
# Runs on the GPU machine (docs/gpu.md): installs the wheel from dist/ (scripts/build_wheel.sh) into a
# virtual environment over the machine's PyTorch, then runs `kvtier bench gpu` with the arguments
# given (default: every model, layout and block size). gpu.json lands in $OUT when set, else in
# bench-results/gpu.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
wheel=$(ls dist/kvtier-*.whl 2>/dev/null | head -n 1 || true)
[ -n "$wheel" ] || { echo "no wheel in dist/: run scripts/build_wheel.sh here first" >&2; exit 1; }
env_dir="${TMPDIR:-/tmp}/kvtier-gpu-venv"
python3 -m venv --system-site-packages "$env_dir"
"$env_dir/bin/python" -m pip install --quiet --no-index --no-deps --force-reinstall "$wheel"
out="${OUT:-bench-results/gpu}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/nvidia-smi.txt" || true
"$env_dir/bin/python" -m kvtier.bench.gpu --out "$out" "$@" 2>&1 | tee "$out/bench-gpu.log"
