"""The remote tiers of ``kvtier bench faults``: the rows whose fault is in the S3 gateway or the shared
filesystem's FUSE daemon rather than in kvtier's own service (issue 36, item 5).

- ``bucket-stop``: the object tier on Ceph's RADOS gateway on 127.0.0.1 (``kvtier.bench.bucket``,
  ``scripts/distfs/radosgw.sh``, root), whose ``radosgw`` process is SIGSTOPped for the fault, then
  SIGCONT: a frozen gateway (GETs connect, then hang).
- ``bucket-kill``: the same gateway SIGKILLed, started again (same configuration, same cluster) when
  the fault's seconds are over: GETs are refused meanwhile.
- ``fuse-stop``: the shared-filesystem tier (``shared_root``) on a FUSE passthrough
  (``kvtier.bench.slowmount``, no rate limit) whose daemon is SIGSTOPped for the fault, then SIGCONT:
  a network filesystem's client that hangs (every access to the mount waits in the kernel).

Each such row's store has no NVMe tier and a DRAM tier far below the users' prefixes
(``tier_dram_slots``), and loads every hit (``load_policy: always``: recomputing the tiny model's
prefix is so cheap that kvtier's own choice would skip a remote tier), so that repeats are read from
the faulted tier.
One gateway serves every bucket row of a run (a prefix each), up from the first to the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

BUCKET_STOP, BUCKET_KILL, FUSE_STOP = "bucket-stop", "bucket-kill", "fuse-stop"
READ_ERRORS = "nvme-read-errors"
NVME_STOP = "nvme-stop"  # a hung disk: the FUSE daemon under the NVMe tier's files stopped
DISK_FULL = "nvme-full"  # the NVMe tier's filesystem full (kvtier.bench.faults_disk)
TIER_FAULTS = (BUCKET_STOP, BUCKET_KILL, FUSE_STOP)
TIER_DRAM_SLOTS = 4  # DRAM of a few blocks (I/O staging), not a prefix: repeats come from the tier below
VLLM_CPU_BLOCK_TOKENS = 128  # vLLM's block on CPU by default: a prompt's KV is stored and loaded in these
MOUNT_RATE_MB_PER_S = 100_000.0  # the FUSE passthrough's line: no limit (the daemon's own ceiling)
GATEWAY_NAME = "client.rgw.a"  # radosgw.sh's gateway daemon (its pid file: STATE/run/client.rgw.a.pid)
GATEWAY_RESTART_TIMEOUT_S = 60.0
DEFAULT_RGW_STATE_DIR = "/tmp/kvtier-bench-faults-radosgw"
# Published soon after the first request, listed soon after: the repeats a few seconds later find them.
BUCKET_TIMING = {"bucket_publish_delay_ms": 500, "bucket_refresh_ms": 200}
# The tier whose reads a fault touches, and the counters of the service that count them.
TIER_OF = {
    BUCKET_STOP: "bucket", BUCKET_KILL: "bucket", FUSE_STOP: "shared", READ_ERRORS: "nvme", NVME_STOP: "nvme",
    DISK_FULL: "nvme",
}  # fmt: skip
TIER_HITS = {"bucket": ("bucket_hits",), "shared": ("shared_hits",), "nvme": ("dram_hits", "nvme_hits")}
# Reads of a tier: a finished load (hit or miss; a read the fault held finishes just after its end),
# a block only the sick tier holds (not read: remote_tier_lookups_skipped, or nvme_lookups_skipped for a
# sick NVMe tier, docs/reliability.md "Sick tiers"), a GET or pread started.
TIER_READS = {
    "bucket": ("bucket_hits", "bucket_misses", "remote_tier_lookups_skipped"),
    "shared": ("shared_hits", "shared_misses", "remote_tier_lookups_skipped"),
    "nvme": ("nvme_read_requests", "nvme_lookups_skipped"),
}
STATS = (
    "dram_hits", "nvme_hits", "shared_hits", "shared_misses", "bucket_hits", "bucket_misses", "bucket_get_requests",
    "bucket_request_errors", "nvme_read_requests", "nvme_outages", "nvme_lookups_skipped", "remote_tier_outages",
    "remote_tier_lookups_skipped", "remote_refreshes_stalled", "puts", "bytes_written_nvme", "nvme_dropped_writes",
    "io_errors", "nvme_reads_given_up",
)  # fmt: skip
READS_SETTLE_S = 1.0  # after the fault's end: the reads it held finish (and are counted)


def service_log_size(socket: Path) -> int:
    """Bytes in the log the row's service will write to (shared by the services of this user)."""
    from kvtier.service import SERVICE_LOG_NAME

    try:
        return (socket.parent / SERVICE_LOG_NAME).stat().st_size
    except OSError:
        return 0


def keep_service_log(socket: Path, since_bytes: int, logs_dir: Path) -> None:
    """What the row's service logged, beside the server's log: the service's log lives next to its
    socket, shared by this user's services, and it alone tells what the service did in the fault."""
    from kvtier.service import SERVICE_LOG_NAME

    try:
        with open(socket.parent / SERVICE_LOG_NAME, "rb") as log:
            start = since_bytes if log.seek(0, os.SEEK_END) >= since_bytes else 0  # rotated meanwhile
            log.seek(start)
            logs_dir.mkdir(parents=True, exist_ok=True)
            (logs_dir / SERVICE_LOG_NAME).write_bytes(log.read())
    except OSError:
        pass


def hit_counters(kind: str) -> tuple[str, ...]:
    """The service's counters whose rise means "kvtier serves hits again" after this fault: the faulted
    tier's own hits for a remote tier's fault, DRAM + NVMe for the others."""
    return TIER_HITS[TIER_OF[kind]] if kind in TIER_FAULTS else TIER_HITS["nvme"]


def read_counters(kind: str) -> tuple[str, ...]:
    """The counters of the reads of the faulted tier (none for the service's own faults)."""
    return TIER_READS[TIER_OF[kind]] if kind in TIER_OF else ()


def service_counters(socket: Path) -> dict[str, int] | None:
    """``STATS`` of the service on ``socket``; None while it does not answer."""
    from kvtier.service import service_stats

    try:
        stats = service_stats(socket)
    except Exception:  # stopped, killed or not yet restarted
        return None
    return {name: int(stats.get(name, 0)) for name in STATS}


def engine_fallbacks(socket: Path) -> dict[str, int] | None:
    """What the row's engine served at recompute because the service did not answer, as it reported
    it to the service (``kvtier.ops.metrics.ENGINE_FALLBACKS``, summed over its labels and the
    namespaces); None while the service does not answer. A killed service's successor holds what the
    engine reported after the kill: the outage's own failed calls included."""
    from kvtier.ops.metrics import ENGINE_FALLBACKS
    from kvtier.service import connect

    totals = dict.fromkeys(ENGINE_FALLBACKS, 0)
    try:
        client = connect(socket, timeout_ms=5_000)
        for namespace in client.namespaces()["namespaces"]:
            for _label, pairs in client.engines(namespace["digest"]):
                counts = dict(pairs)
                for name in ENGINE_FALLBACKS:
                    totals[name] += int(counts.get(name, 0))
    except Exception:  # stopped, killed or not yet restarted
        return None
    return totals


def engines_attached(socket: Path) -> int:
    """Engines the service on ``socket`` knows (labels over its namespaces): an engine labels each of
    its connections when it attaches, so a service started anew lists it once the engine reattached;
    0 while it does not answer."""
    from kvtier.service import connect

    try:
        client = connect(socket, timeout_ms=5_000)
        return sum(len(client.engines(namespace["digest"])) for namespace in client.namespaces()["namespaces"])
    except Exception:  # stopped, killed or not yet restarted
        return 0


def delta(before: dict[str, int] | None, after: dict[str, int] | None, names: tuple[str, ...]) -> int | None:
    if before is None or after is None or not names:
        return None
    return sum(after[name] - before[name] for name in names)


def row_options(plan: dict[str, Any], row: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The plan and the extra store options of a remote tier's row: no NVMe tier, DRAM of a few slots,
    every hit loaded (the tier's own options come from ``Tiers.open``)."""
    options = {"staging_slots": tier_dram_slots(plan), "load_policy": "always"}
    return {**plan, "dram_gib": 0.0, "nvme_gib": 0.0}, options


def tier_dram_slots(plan: dict[str, Any]) -> int:
    """The remote tier rows' DRAM, in blocks. At full size, one prompt's blocks and ``TIER_DRAM_SLOTS``
    more: a load streams through DRAM in rounds of a quarter of it while the engine's stores take
    slots too, and through 4 slots a 16-block load read one block per round and stalled behind the
    stores after every fault (stop 62's logs), a pool no deployment has. Still far below the users'
    prefixes, so repeats come from the tier. At CI size (``--small``) 4: the tiny model's prompt is a
    few blocks, and the one repeat the fault covers must come from the tier, not DRAM."""
    if plan.get("small"):
        return TIER_DRAM_SLOTS
    prompt_tokens = plan["prefix_len"] + plan["suffix_len"] + plan["output_len"]
    return TIER_DRAM_SLOTS + -(-prompt_tokens // VLLM_CPU_BLOCK_TOKENS)


class Gateway:
    """The local RADOS gateway of a ``Bucket`` brought up here: its pid, and a restart after a kill."""

    def __init__(self, bucket: Any):
        self.bucket = bucket

    def pid(self) -> int:
        try:
            return int(Path(self.bucket.state_dir, "run", f"{GATEWAY_NAME}.pid").read_text().strip())
        except (OSError, ValueError) as error:
            raise RuntimeError(f"the gateway's pid file is not readable ({error})") from None

    def restart(self) -> int:
        """Starts the gateway again with radosgw.sh's configuration (the monitor and the OSD still run:
        the bucket and its objects are there) and waits until it answers; returns its new pid."""
        state = Path(self.bucket.state_dir)
        with open(state / "logs" / "daemons.out", "a") as log:
            command = ["radosgw", "-c", str(state / "ceph.conf"), "-n", GATEWAY_NAME]
            subprocess.run(command, stdout=log, stderr=log, timeout=GATEWAY_RESTART_TIMEOUT_S, check=True)
        deadline = time.monotonic() + GATEWAY_RESTART_TIMEOUT_S
        while self.bucket.request("GET", self.bucket.name, query="list-type=2&max-keys=1")[0] != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the restarted gateway did not answer in {GATEWAY_RESTART_TIMEOUT_S:g} s; see {state}"
                )
            time.sleep(0.2)
        return self.pid()


class MountDaemon:
    """The FUSE daemon of a slow mount (the ``python -m kvtier.bench.slowmount`` child itself)."""

    def __init__(self, mount: Any):
        self.mount = mount

    def pid(self) -> int:
        if self.mount.process is None or self.mount.process.poll() is not None:
            raise RuntimeError(f"the FUSE daemon of {self.mount.mountpoint} is not running")
        return int(self.mount.process.pid)

    def restart(self) -> int:
        raise RuntimeError("a FUSE daemon is stopped, never killed, by kvtier bench faults")


class TierFault:
    """A tier's fault on ``target`` (a ``Gateway``, or a ``MountDaemon``: the shared tier's, or the NVMe
    tier's for ``nvme-stop``): ``start()`` stops or
    kills it, ``end()`` continues or restarts it; ``release()`` undoes what is left whatever happened
    (a stopped process continued, a killed gateway started again)."""

    def __init__(self, kind: str, target: Any):
        self.kind, self.target = kind, target
        self.pid: int | None = None
        self.stopped = self.killed = False
        self.restarted_pid: int | None = None

    def start(self) -> None:
        self.pid = self.target.pid()
        assert self.pid is not None
        if self.kind == BUCKET_KILL:
            os.kill(self.pid, signal.SIGKILL)
            self.killed = True
        else:
            os.kill(self.pid, signal.SIGSTOP)
            self.stopped = True

    def release(self) -> None:
        if self.stopped and self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
            self.stopped = False
        if self.killed:
            self.killed = False  # once: a failed restart is not tried again by every later release
            self.restarted_pid = self.target.restart()


class Tiers:
    """The remote tiers of a run's rows: the gateway (brought up at the first bucket row, down at
    ``close``) and each ``fuse-stop`` row's mount (up in ``open``, down in ``close_row``)."""

    def __init__(self, plan: dict[str, Any], log):
        self._plan, self._log = plan, log
        self._stack = contextlib.ExitStack()
        self._bucket: Any = None
        self.mounts: dict[str, Any] = {}

    def open(self, row: str, row_dir: Path) -> tuple[dict[str, Any], Any]:
        """The row's tier options (bucket or ``shared_root``) and its fault's target."""
        if row == FUSE_STOP:
            mount = passthrough_mount(row_dir, "shared-source", "shared")
            self.mounts[row] = mount
            return {"shared_root": str(mount.mountpoint)}, MountDaemon(mount)
        if self._bucket is None:
            from kvtier.bench import bucket

            opened = bucket.open_bucket(
                None, None, self._plan["bucket_osd_bytes"], self._log, state_dir=self._plan["rgw_state_dir"]
            )  # fmt: skip
            self._bucket = self._stack.enter_context(opened)
        return {**self._bucket.options(row), **BUCKET_TIMING}, Gateway(self._bucket)

    def close_row(self, row: str) -> list[str]:
        """Unmounts the row's mount (if any); the problems left (still mounted)."""
        mount = self.mounts.pop(row, None)
        if mount is None:
            return []
        mount.close()
        return [f"the mount {mount.mountpoint} is still mounted"] if os.path.ismount(mount.mountpoint) else []

    def close(self) -> None:
        for row in list(self.mounts):
            self.close_row(row)
        self._stack.close()

    def __enter__(self) -> Tiers:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def passthrough_mount(row_dir: Path, source: str, mountpoint: str, fail_reads_flag: Path | None = None) -> Any:
    """``row_dir/source`` at ``row_dir/mountpoint`` through a FUSE passthrough (``kvtier.bench.slowmount``,
    no rate limit; reads fail with EIO while ``fail_reads_flag`` exists, when given); started."""
    from kvtier.bench.slowlink import LinkSpec
    from kvtier.bench.slowmount import SlowMount

    (row_dir / source).mkdir(parents=True, exist_ok=True)
    (row_dir / "logs").mkdir(parents=True, exist_ok=True)
    log_path = row_dir / "logs" / f"{mountpoint}-mount.log"
    spec = LinkSpec(MOUNT_RATE_MB_PER_S)
    mount = SlowMount(row_dir / source, row_dir / mountpoint, spec, log_path, fail_reads_flag=fail_reads_flag)
    mount.start()
    return mount
