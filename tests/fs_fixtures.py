"""Real distributed filesystems on 127.0.0.1 for the shared-tier tests: GlusterFS and CephFS, each
mounted twice per caching mode (two "nodes" that only share the filesystem).

The bring-up and teardown live in ``scripts/distfs/glusterfs.sh`` and ``scripts/distfs/cephfs.sh``
(also used by the benchmarks); these session-scoped fixtures run them once per pytest session and
always tear down (unmount, stop the daemons they started, remove their state), also when tests fail
or the session is interrupted. A leftover state directory from a killed session is torn down first.

Skips (with the fix in the reason) when not root, without /dev/fuse, or without the Debian packages
(``scripts/setup.sh`` installs them as root). ``KVTIER_REQUIRE_DISTFS=1`` turns those skips into
failures (for CI runs that must exercise the filesystems).
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STATE_ROOT = Path(os.environ.get("KVTIER_DISTFS_STATE", "/tmp/kvtier-distfs"))

PACKAGES = {
    "glusterfs": (["glusterd", "glusterfs", "gluster"], "glusterfs-server glusterfs-client"),
    "cephfs": (
        ["ceph-mon", "ceph-mgr", "ceph-osd", "ceph-mds", "ceph-fuse", "ceph"],
        "ceph-mon ceph-mgr ceph-osd ceph-mds ceph-fuse ceph-common",
    ),
}
# Caching modes, each a pair of mounts of the same filesystem: "default" is the filesystem's default
# client caching, "strict" the settings docs/shared-tier.md recommends (see the scripts).
MODES = ("default", "strict")


@dataclass
class DistFs:
    """One running filesystem: ``mounts[mode] = (node_a, node_b)``."""

    name: str
    state: Path
    mounts: dict[str, tuple[Path, Path]] = field(default_factory=dict)
    bring_up_s: float = 0.0

    def nodes(self, mode: str, subdir: str) -> tuple[Path, Path]:
        """The same fresh directory seen through node A's and node B's mount."""
        a, b = self.mounts[mode]
        (a / subdir).mkdir(parents=True, exist_ok=False)
        deadline = time.monotonic() + 5
        while not (b / subdir).is_dir():
            if time.monotonic() > deadline:
                raise AssertionError(f"{subdir} created through {a} is not visible through {b} after 5 s")
            time.sleep(0.05)
        return a / subdir, b / subdir


def script(name: str) -> Path:
    return REPO / "scripts" / "distfs" / f"{name}.sh"


def missing_reason(name: str) -> str | None:
    """Why the filesystem cannot be brought up here (with the fix), or None."""
    binaries, packages = PACKAGES[name]
    if os.geteuid() != 0:
        return f"{name} tests need root (FUSE mounts and the {name} daemons); run them as root"
    if not os.path.exists("/dev/fuse"):
        return (
            f"{name} tests need /dev/fuse: load the fuse module (modprobe fuse) "
            "or run the container with --device /dev/fuse"
        )
    absent = [b for b in binaries if shutil.which(b) is None]
    if absent:
        return (
            f"{name} tests need {' '.join(absent)}: apt-get install {packages} "
            "(scripts/setup.sh installs them when run as root)"
        )
    return None


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("KVTIER_REQUIRE_DISTFS") == "1":
        pytest.fail(f"KVTIER_REQUIRE_DISTFS=1 but {reason}")
    pytest.skip(reason)


def _down(name: str, state: Path) -> None:
    subprocess.run(["bash", str(script(name)), "down", str(state)], capture_output=True, text=True, timeout=120)


def bring_up(name: str) -> Iterator[DistFs]:
    reason = missing_reason(name)
    if reason:
        _skip_or_fail(reason)
    state = STATE_ROOT / name
    atexit.register(_down, name, state)  # also on an interrupted session; down is idempotent
    started = time.monotonic()
    try:
        done = subprocess.run(
            ["bash", str(script(name)), "up", str(state)], capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired as e:
        _down(name, state)
        pytest.fail(f"{script(name)} up {state} took over 300 s: {e.stderr!r}")
    if done.returncode == 3:  # a prerequisite the script checks itself (e.g. /etc/hosts)
        _down(name, state)
        _skip_or_fail(done.stderr.strip())
    if done.returncode != 0:
        _down(name, state)
        hint = ""
        if done.returncode == errno.ENOSPC:
            # ceph-mon exits so when its data directory's filesystem has under 5% free
            # (mon_data_avail_crit): a CI run failed this way on a nearly full disk.
            hint = f" (ENOSPC: free disk space under {STATE_ROOT}; Ceph's monitor needs 5% of it free)"
        pytest.fail(f"bringing up {name} failed (rc {done.returncode}){hint}:\n{done.stdout}\n{done.stderr}")
    paths = dict(line.split("=", 1) for line in done.stdout.split() if "=" in line)
    fs = DistFs(name=name, state=state, bring_up_s=time.monotonic() - started)
    for mode in MODES:
        fs.mounts[mode] = (Path(paths[f"{mode}-a"]), Path(paths[f"{mode}-b"]))
    print(f"\n{name}: up in {fs.bring_up_s:.1f} s at {state}")
    try:
        yield fs
    finally:
        _down(name, state)
        left = subprocess.run(["mount"], capture_output=True, text=True).stdout
        assert str(state) not in left, f"{name} mounts under {state} survived teardown:\n{left}"
        survivors = processes_naming(state)
        assert not survivors, f"{name} processes survived teardown: {survivors}"


def processes_naming(state: Path) -> list[str]:
    """Live processes whose command line names the state directory (daemons this session started)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            zombie = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if f"{state}/" in cmdline and not zombie:
            found.append(f"{proc.name}: {cmdline.strip()}")
    return found


@pytest.fixture(scope="session")
def glusterfs_fs() -> Iterator[DistFs]:
    yield from bring_up("glusterfs")


@pytest.fixture(scope="session")
def cephfs_fs() -> Iterator[DistFs]:
    yield from bring_up("cephfs")
