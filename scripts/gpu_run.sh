#!/usr/bin/env bash
# The GPU run (docs/gpu.md "The GPU run"), one command on the lent GPU machine, in two stages sized
# for its 15 minutes of device time:
#   stage 1 (under 2 minutes): python -m kvtier.bench.gpu_check: the machine's facts (driver, torch,
#     /dev/shm, io_uring, O_DIRECT), pinning, the executor chosen on kvtier's side stream, one 256 MiB
#     round trip through the service compared byte for byte -> $OUT/stage1.json;
#   stage 2: kvtier bench gpu, case by case, the most informative first, skipping what would end
#     past the budget -> $OUT/gpu.json, rewritten after every case.
# Everything lands in $OUT as it is produced (4 files: run.log, nvidia-smi.txt, stage1.json, gpu.json;
# the device tool returns at most 8), so a run cut off still returns what it got.
#
# Needs dist/kvtier-*.whl (scripts/build_wheel.sh here; carry dist/) and a python3 with torch and
# numpy on the PATH. Extra arguments go to both stages (the CPU rehearsal passes --device cpu --small).
# KVTIER_GPU_BUDGET_S (default 400): seconds for both stages; KVTIER_GPU_DIR: the disk under test
# (default: the first of /var/tmp, /tmp, $HOME that is not tmpfs).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
started=$SECONDS
out="${OUT:-bench-results/gpu}"
mkdir -p "$out"
exec > >(tee -a "$out/run.log") 2>&1
budget_s="${KVTIER_GPU_BUDGET_S:-400}"
say() { printf '[gpu_run %3ds] %s\n' "$((SECONDS - started))" "$*"; }
# The disk under test: the first writable directory that is not tmpfs (no O_DIRECT, no NVMe there).
work_dir=""
for candidate in ${KVTIER_GPU_DIR:-} /var/tmp /tmp "$HOME"; do
    if [[ -d "$candidate" && -w "$candidate" && "$(stat -f -c %T "$candidate" 2>/dev/null)" != "tmpfs" ]]; then
        work_dir=$candidate
        break
    fi
done
work_dir="${work_dir:-/tmp}"
say "disk under test: $work_dir ($(stat -f -c %T "$work_dir" 2>/dev/null); $(df -h --output=size,avail "$work_dir" | tail -n 1))"

wheel=$(ls dist/kvtier-*.whl 2>/dev/null | head -n 1 || true)
[[ -n "$wheel" ]] || { say "no wheel in dist/: run scripts/build_wheel.sh here first and carry dist/"; exit 1; }
# The machine's python3 is itself a virtual environment (/opt/torch/.venv): a venv made from it with
# --system-site-packages does not see its torch (cpython #129445). The wheel goes into a directory
# of its own, first on PYTHONPATH, over that python3 and its torch. No pip: nothing says the machine's
# environment has one (uv makes venvs without it), and a wheel is a zip to unpack. Its tags are
# checked first (abi3 for CPython >= 3.11, manylinux glibc >= 2.34), so a wheel the machine cannot
# load stops the run here with the reason, not at stage 1's first import.
site="${TMPDIR:-/tmp}/kvtier-site"
rm -rf "$site"
if ! python3 - "$wheel" "$site" <<'PY'
import os, re, sys, zipfile
wheel, site = sys.argv[1], sys.argv[2]
name = os.path.basename(wheel)
tags = re.match(r"kvtier-[^-]+-(cp\d+)-(abi3|cp\d+)-(.+)\.whl$", name)
if not tags:
    sys.exit(f"{name}: not a kvtier wheel name (kvtier-VERSION-PY-ABI-PLATFORM.whl)")
python, abi, platforms = tags.groups()
need = (int(python[2]), int(python[3:]))
if sys.implementation.name != "cpython" or sys.version_info[:2] < need or (abi != "abi3" and sys.version_info[:2] != need):
    sys.exit(f"{name} needs CPython {need[0]}.{need[1]}{'+' if abi == 'abi3' else ''}; this is {sys.version.split()[0]}")
libc, _, version = (os.confstr("CS_GNU_LIBC_VERSION") or "unknown 0.0").partition(" ")
have = tuple(int(part) for part in version.split(".")[:2])
for platform in platforms.split("."):
    found = re.match(r"manylinux_(\d+)_(\d+)_(\w+)$", platform)
    if found and (libc != "glibc" or have < (int(found[1]), int(found[2]))):
        sys.exit(f"{name} needs glibc {found[1]}.{found[2]}; this machine has {libc} {version}: build it there or older")
    if found and found[3] != os.uname().machine:
        sys.exit(f"{name} is for {found[3]}; this machine is {os.uname().machine}")
with zipfile.ZipFile(wheel) as archive:
    for member in archive.namelist():
        target = os.path.realpath(os.path.join(site, member))
        if not target.startswith(os.path.realpath(site) + os.sep):
            sys.exit(f"{name}: member {member} would land outside {site}")
    archive.extractall(site)
print(f"unpacked {name} ({libc} {version}, Python {sys.version.split()[0]})")
PY
then
    say "installing $wheel into $site failed (above: the reason)"
    exit 1
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
say "python3: $(command -v python3) ($(python3 -c 'import sys; print(sys.version.split()[0])')); kvtier from $site"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
    nvidia-smi
} >"$out/nvidia-smi.txt" 2>&1 || say "nvidia-smi failed (no GPU: a CPU rehearsal?)"
# The pool lives in /dev/shm (pinnable); stage 2's largest needs about 3 GiB. Grow a small one.
shm_free_gib=$(df -k --output=avail /dev/shm 2>/dev/null | tail -n 1 | awk '{print int($1 / 1048576)}')
if [[ -n "$shm_free_gib" && "$shm_free_gib" -lt 6 && $(id -u) -eq 0 ]]; then
    mount -o remount,size=24g /dev/shm && say "grew /dev/shm from ${shm_free_gib} GiB free to 24 GiB" \
        || say "/dev/shm has ${shm_free_gib} GiB free and could not be grown"
fi

say "stage 1: facts, pinning, executor, one round trip"
timeout 150 python3 -m kvtier.bench.gpu_check --out "$out" --dir "$work_dir" "$@"
stage1=$?
say "stage 1 exit $stage1"
remaining=$((budget_s - (SECONDS - started)))
((remaining >= 30)) || remaining=30  # stage 1 overran: still the ordering check and the first case
say "stage 2: the figures, ${remaining} s left"
timeout $((remaining + 60)) python3 -m kvtier.bench.gpu --out "$out" --dir "$work_dir" --job-mib 512 --repeats 3 \
    --skip-fio --budget-s "$remaining" "$@"
stage2=$?
say "stage 2 exit $stage2; in $out: $(ls "$out" | tr '\n' ' ')"
exit $((stage1 != 0 || stage2 != 0))
