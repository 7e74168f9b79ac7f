#!/usr/bin/env bash
# Builds kvtier's abi3 wheel (CPython 3.11 and later) into dist/, for a machine that cannot build it
# (the GPU machine: no Rust toolchain, no network). Carry dist/ there and install it with
# scripts/gpu_run.sh (docs/gpu.md). Needs scripts/setup.sh first (maturin in .venv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rm -rf dist
.venv/bin/maturin build --release --quiet --out dist
ls -l dist/*.whl
