#!/usr/bin/env bash
# All set-up on a fresh machine: system packages (fio; GlusterFS and CephFS for the filesystem tests), the virtualenv with vLLM's CPU build
# (scripts/install_vllm.sh), the Python tools, and kvtier itself built in release mode with maturin.
# Idempotent. KVTIER_SKIP_VLLM=1 sets up the store and its benchmarks without vLLM.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
start_seconds=$SECONDS
log() { printf '[setup %3ds] %s\n' "$((SECONDS - start_seconds))" "$*"; }

command -v cargo >/dev/null || { echo "cargo is missing: install Rust (rustup) and rerun" >&2; exit 1; }
if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
    command -v rustup >/dev/null || { echo "rustfmt or clippy is missing and rustup is not here to add them: install both and rerun" >&2; exit 1; }
    log "adding rustfmt and clippy (scripts/lint.sh runs them)"
    rustup component add rustfmt clippy
fi

# fio: the benchmarks' yardstick; strace: tests/test_io_pattern.py checks the I/O pattern counters
# against the system calls it sees; libfuse2: the slow mount of the benchmarks (kvtier.bench.slowmount,
# fusepy over libfuse 2).
tools=()
command -v fio >/dev/null || tools+=(fio)
command -v strace >/dev/null || tools+=(strace)
ldconfig -p 2>/dev/null | grep -q 'libfuse\.so\.2' || tools+=(libfuse2)
if (( ${#tools[@]} )); then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        log "installing ${tools[*]}"
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${tools[@]}" >/dev/null
    else
        log "${tools[*]} not found and cannot apt-get install (not root); benchmarks skip fio, the strace test skips"
    fi
fi

# GlusterFS and CephFS on 127.0.0.1 for the shared tier's filesystem tests (tests/test_shared_fs.py,
# scripts/distfs/): the daemons and FUSE clients, and the brick host name the gluster CLI accepts
# (it refuses 127.0.0.1 and localhost). KVTIER_SKIP_DISTFS=1 leaves them out (the tests then skip).
# Also mkfs for xfs, f2fs and btrfs (scripts/distfs/bench_filesystems.py, experiment 4), and Ceph's
# RADOS gateway, the S3 server of the object tier's tests (tests/test_object_tier.py, scripts/distfs/radosgw.sh).
distfs_packages=(glusterfs-server glusterfs-client ceph-mon ceph-mgr ceph-osd ceph-mds ceph-fuse ceph-common
    xfsprogs f2fs-tools btrfs-progs radosgw)
if [[ "${KVTIER_SKIP_DISTFS:-0}" != "1" ]]; then
    if ! command -v glusterd >/dev/null || ! command -v ceph-fuse >/dev/null || ! command -v ceph-mds >/dev/null \
        || ! command -v mkfs.f2fs >/dev/null || ! command -v mkfs.btrfs >/dev/null || ! command -v radosgw >/dev/null; then
        if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
            log "installing GlusterFS and CephFS (the shared tier's filesystem tests)"
            apt-get update -qq >/dev/null
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${distfs_packages[@]}" >/dev/null
        else
            log "GlusterFS/CephFS not found and cannot apt-get install them (not root); tests/test_shared_fs.py will skip"
        fi
    fi
    if [[ $(id -u) -eq 0 ]] && ! getent hosts kvtier-brick | grep -q '^127\.0\.0\.1'; then
        log "adding '127.0.0.1 kvtier-brick' to /etc/hosts (GlusterFS brick host for the tests)"
        echo "127.0.0.1 kvtier-brick" >>/etc/hosts
    fi
fi

if [[ "${KVTIER_SKIP_VLLM:-0}" == "1" ]]; then
    if [[ ! -x .venv/bin/python ]]; then
        python3 -m pip install --quiet uv 2>/dev/null || true
        if command -v uv >/dev/null; then uv venv .venv --python 3.11 --seed; else python3 -m venv .venv; fi
    fi
else
    bash scripts/install_vllm.sh
fi

log "installing build and test tools"
if command -v uv >/dev/null; then
    uv pip install --quiet --python .venv/bin/python maturin pytest numpy click matplotlib rich prometheus-client ruff mypy \
        fusepy pandas
else
    .venv/bin/python -m pip install --quiet maturin pytest numpy click matplotlib rich prometheus-client ruff mypy fusepy pandas
fi

log "compiling bytecode (vLLM's engine processes start about 3x faster with it)"
bash scripts/compile_bytecode.sh .venv/bin/python

log "building kvtier (release)"
.venv/bin/maturin develop --release --quiet
.venv/bin/python -c 'import kvtier; print("kvtier", kvtier.__version__, "ready")'
log "done"
