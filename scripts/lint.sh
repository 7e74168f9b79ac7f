#!/usr/bin/env bash
# Static checks, run by scripts/test.sh before any test (and alone: bash scripts/lint.sh):
# rustfmt, clippy with warnings as errors on every target (and on the production build, without the
# test seams of kvtier-core's `testing` feature), then the Python checks
# (scripts/lint_python.sh: ruff lint, ruff format, mypy). Needs scripts/setup.sh first.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
echo "== cargo fmt --check =="
cargo fmt --all --check
echo "== cargo clippy (all targets, warnings are errors) =="
# --release: the same lints, on the release build of the dependencies scripts/setup.sh already made (the
# debug profile would check all of them again: minutes on two cores).
cargo clippy --workspace --all-targets --release --quiet -- -D warnings
# The tests turn kvtier-core's `testing` feature on (its dev-dependency on itself) for every target
# above; the production build (the library, its tools, the Python binding) is linted without it.
echo "== cargo clippy (production build: no testing feature) =="
cargo clippy -p kvtier-core -p kvtier-py --release --quiet -- -D warnings
bash scripts/lint_python.sh
