#!/usr/bin/env bash
# Runs every check and test: static checks (scripts/lint.sh: rustfmt, clippy, ruff, mypy), the Rust
# core (both I/O engines, crash torture, faults, fuzzing at CI size), then the Python suite (API,
# benchmark smoke run, and the slow tests on the real vLLM engine).
# Needs scripts/setup.sh first. Extra arguments go to pytest (e.g. -m "not slow"). KVTIER_FULL_TESTS=1 also runs
# the tests marked `full` (benchmarks end to end beyond smoke size; CI skips them for time).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
export PROPTEST_CASES="${PROPTEST_CASES:-256}"
bash scripts/lint.sh
echo "== cargo test (kvtier-core, both I/O engines) =="
cargo test -p kvtier-core --release 2>&1
echo "== pytest =="
.venv/bin/python -m pytest -q -ra --durations=60 tests "$@"
