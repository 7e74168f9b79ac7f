#!/usr/bin/env bash
# Writes the bytecode (.pyc) of every module in a Python environment's site-packages.
#
# Why: uv installs packages without their bytecode, and where PYTHONDONTWRITEBYTECODE is set (many
# container images, and this project's CI machines) Python never writes it at import either, so
# every process compiled vLLM's, torch's and transformers' sources again. A `vllm serve` imports vLLM
# in three processes (API server, engine core, worker): on a 2-core VM one start of the tiny model
# took 125 s without bytecode and 45 s with it (2026-12-02, the same command).
#
# Usage: scripts/compile_bytecode.sh PYTHON   (the environment's interpreter). Idempotent: an
# environment already compiled is checked in seconds. Files written for another Python version
# (torch ships one that only 3.12 parses) cannot compile: they are named, and skipped.
set -euo pipefail
python="${1:?usage: scripts/compile_bytecode.sh PYTHON}"
site_packages="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if ! output="$("$python" -m compileall -q -j 0 "$site_packages" 2>&1)"; then
    failed="$(grep '^\*\*\* Error compiling' <<<"$output" | sed -e "s/^\*\*\* Error compiling '//" -e "s/'...$//" || true)"
    echo "compile_bytecode: not compiled (skipped): ${failed//$'\n'/, }" >&2
fi
