#!/usr/bin/env bash
# Python static checks on python/kvtier and tests/ (configured in pyproject.toml: [tool.ruff],
# [tool.mypy]): ruff lint, ruff format --check, mypy. Runs every check, then exits non-zero if any
# failed. Needs scripts/setup.sh first (it installs ruff and mypy into .venv). KVTIER_VENV names
# another virtualenv with them (a git worktree has no .venv of its own: KVTIER_VENV=/path/to/.venv).
set -uo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
venv="${KVTIER_VENV:-.venv}"
for tool in ruff mypy; do
    [[ -x $venv/bin/$tool ]] || { echo "$venv/bin/$tool is missing: run scripts/setup.sh (or set KVTIER_VENV)" >&2; exit 1; }
done
failed=()
echo "== ruff check =="
"$venv/bin/ruff" check python/kvtier tests || failed+=("ruff check")
echo "== ruff format --check =="
"$venv/bin/ruff" format --check python/kvtier tests || failed+=("ruff format --check (fix: $venv/bin/ruff format python/kvtier tests)")
echo "== mypy =="
"$venv/bin/mypy" || failed+=("mypy")
if ((${#failed[@]})); then
    printf 'python lint failed: %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "python lint: ok"
