"""The GPU run rehearsed on the CPU, in the GPU machine's shape (issue 27): the command docs/gpu.md
gives for the device tool, run with ``--device cpu --small`` in a copy of what travels there (the
working tree's tracked and unignored files, and ``dist/`` with the abi3 wheel built by
scripts/build_wheel.sh), with ``python3`` on the PATH a Python 3.12 virtual environment holding
torch and numpy only (scripts/rehearsal_env.sh): no vLLM, no Rust, no .venv, no pip. It must finish and
leave stage 1's and stage 2's JSON in ``$OUT``, in no more files than the device tool returns.

The first run builds the environment (about a minute, a 531 MB download pip caches) under
~/.cache/kvtier-rehearsal; later runs reuse it. The wheel is rebuilt when a source is newer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEVICE_FILES_BACK = 8  # the device tool returns at most 8 files from $OUT


def documented_command() -> str:
    """The device tool's command from docs/gpu.md (``run(command="...", ...)``)."""
    match = re.search(r'run\(command="([^"]+)"', (REPO / "docs" / "gpu.md").read_text())
    assert match, "docs/gpu.md gives no run(command=...) for the GPU run"
    return match.group(1)


def fresh_wheel() -> Path:
    """dist/'s wheel, rebuilt (scripts/build_wheel.sh) when missing or older than a source."""
    wheels = sorted((REPO / "dist").glob("kvtier-*.whl"))
    sources = [
        *REPO.glob("python/kvtier/**/*.py"),
        *REPO.glob("crates/*/src/**/*.rs"),
        *REPO.glob("crates/*/Cargo.toml"),
    ]
    sources += [REPO / "pyproject.toml", REPO / "Cargo.lock"]
    newest = max(path.stat().st_mtime for path in sources if path.exists())
    if not wheels or wheels[0].stat().st_mtime < newest:
        subprocess.run(["bash", "scripts/build_wheel.sh"], cwd=REPO, check=True, capture_output=True, timeout=900)
        wheels = sorted((REPO / "dist").glob("kvtier-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def travelling_copy(destination: Path, wheel: Path) -> None:
    """What the device tool sends: tracked and untracked-but-not-ignored files, and dist/ carried."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, (item.decode() for item in listed)):
        source = REPO / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    (destination / "dist").mkdir()
    shutil.copy2(wheel, destination / "dist" / wheel.name)


@pytest.mark.slow
def test_the_documented_gpu_command_runs_on_the_cpu_in_the_devices_shape(tmp_path):
    python = subprocess.run(
        ["bash", "scripts/rehearsal_env.sh"], cwd=REPO, check=True, capture_output=True, text=True, timeout=900
    ).stdout.strip()
    no_pip = subprocess.run([python, "-c", "import pip"], capture_output=True)
    assert no_pip.returncode != 0, "the rehearsal environment has pip; the GPU machine's need not"
    copy, out = tmp_path / "repo", tmp_path / "out"
    travelling_copy(copy, fresh_wheel())
    command = documented_command()
    environment = {
        "PATH": f"{Path(python).parent}:/usr/local/bin:/usr/bin:/bin",  # no .venv, no cargo
        "HOME": os.environ.get("HOME", "/root"),
        "OUT": str(out),
        "TMPDIR": str(tmp_path),
        "KVTIER_GPU_DIR": str(tmp_path),
    }
    run = subprocess.run(
        ["bash", "-c", f"{command} --device cpu --small"],
        cwd=copy,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    files = sorted(path.name for path in out.iterdir())
    assert {"run.log", "stage1.json", "gpu.json", "nvidia-smi.txt"} <= set(files), files
    assert len(files) <= DEVICE_FILES_BACK, files
    stage1 = json.loads((out / "stage1.json").read_text())
    assert stage1["facts"]["python"].startswith("3.12"), stage1["facts"]
    assert stage1["round_trip"]["ok"] and stage1["round_trip"]["wrong_blocks"] == 0, stage1["round_trip"]
    assert stage1["o_direct"].get("ok") is not None and "io_engine" in stage1["store_engine"], stage1
    document = json.loads((out / "gpu.json").read_text())
    assert document["complete"] and document["verdict"] == {"bytes_identical_everywhere": True, "ordering_ok": True}
    assert [case["case"] for case in document["cases"]][:2] == ["small/nhd/block16", "small-mla/mla/block16"]
    assert all("error" not in case for case in document["cases"]), document["cases"]
