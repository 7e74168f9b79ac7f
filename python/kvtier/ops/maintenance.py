"""``kvtier verify``, ``kvtier trim`` and ``kvtier inspect``: on the running service (protocol
version 2 ops) for the namespaces it has open, on the store's files (the store opened here, its
LOCK taken) for the others.

JSON schemas (docs/cli.md): ``kvtier.verify/1``, ``kvtier.trim/1``, ``kvtier.inspect/1``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.ops import store_files
from kvtier.ops.report import OpsError, _check_paths, resolve_socket

VERIFY_SCHEMA = "kvtier.verify/1"
TRIM_SCHEMA = "kvtier.trim/1"
INSPECT_SCHEMA = "kvtier.inspect/1"
DESCRIPTION_FILE_NAME = "DESCRIPTION"
# Blocks per verify step: a step is one request to the service (bounded in time) and one progress tick.
VERIFY_BATCH_BLOCKS = 64
# A paced step lasts about this long at most (the service answers each step within its timeout).
VERIFY_STEP_SECONDS = 2.0
# The slowest pace the core takes (`MIN_VERIFY_BYTES_PER_S` in maintenance.rs): 1 MB/s.
MIN_VERIFY_BYTES_PER_S = 1_000_000

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``1073741824``, ``512M``, ``1.5GiB``, ``2G`` (K/M/G/T are powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size: give bytes, or a number with K, M, G or T (1024-based), e.g. 20G")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * (1024 ** "_kmgt".index(unit) if unit else 1))


def parse_duration(text: str) -> float:
    """Seconds from ``90s``, ``30m``, ``2h``, ``1d``, ``1w``, ``500ms`` (a bare number is seconds)."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration: give a number with ms, s, m, h, d or w, e.g. 6h")
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[(match.group(2) or "s").lower()]
    return float(match.group(1)) * scale


def describe(description: bytes | None) -> dict[str, Any]:
    """The human-readable part of a namespace description (vLLM's JSON; other engines' text as is)."""
    if description is None:
        return {"text": None}
    try:
        parsed = json.loads(description)
    except (ValueError, UnicodeDecodeError):
        return {"text": description.decode(errors="replace")}
    if not isinstance(parsed, dict):
        return {"text": description.decode(errors="replace")}
    groups = parsed.get("groups") or []
    return {
        "text": None,
        "engine": parsed.get("engine"),
        "model": parsed.get("model"),
        "model_fingerprint": parsed.get("model_fingerprint"),
        "dtype": parsed.get("kv_dtype", parsed.get("dtype")),
        "layout": parsed.get("kv_cache_layout", parsed.get("layout")),
        "object_layout": parsed.get("object_layout"),
        "parallel": parsed.get("parallel"),
        "tokens_per_block": [g.get("tokens_per_block") for g in groups if isinstance(g, dict)] or None,
        "layers": sum(len(g.get("layers", [])) for g in groups if isinstance(g, dict)) or None,
        "salt": parsed.get("salt"),
    }


@dataclass
class Target:
    """One namespace to work on: in the service (``client``) or opened from disk (``store``)."""

    digest: str
    source: str  # "service" or "disk"
    description: bytes | None
    dirs: list[store_files.NamespaceDir] = field(default_factory=list)
    client: Any = None
    store: Any = None
    values: dict[str, int] = field(default_factory=dict)  # the service's per-namespace values
    object_bytes: int = 0
    shared_open: bool = False  # a store opened here with its shared tier (verify --shared-root)

    def step_blocks(self, max_bytes_per_s: int) -> int:
        """Blocks per verify step: 64, fewer when pacing would make a step longer than ~2 s."""
        if max_bytes_per_s <= 0 or self.object_bytes <= 0:
            return VERIFY_BATCH_BLOCKS
        slot_bytes = 4096 + -(-self.object_bytes // 4096) * 4096
        per_block = 2 * slot_bytes  # its DRAM copy and its NVMe entry
        return max(1, min(VERIFY_BATCH_BLOCKS, int(max_bytes_per_s * VERIFY_STEP_SECONDS) // per_block))

    def verify_batch(self, after: int, max_blocks: int, max_bytes_per_s: int, shared: bool = False) -> dict[str, Any]:
        if self.client is not None:
            return dict(self.client.verify_batch(self.digest, after, max_blocks, max_bytes_per_s, shared))
        return dict(self.store.verify_batch(after, max_blocks, max_bytes_per_s, shared))

    @property
    def has_shared_tier(self) -> bool:
        """The service's stores with a shared tier, and stores opened here with ``--shared-root``."""
        if self.client is not None:
            return "shared_index_age_ms" in self.values
        return self.store is not None and self.shared_open

    def trim(self, mode: str, value: int) -> dict[str, int]:
        if self.client is not None:
            return dict(self.client.trim(self.digest, mode, value))
        return dict(self.store.trim(mode, value))

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


@contextmanager
def _recovery_progress_on_stderr() -> Iterator[None]:
    """Opening a large store recovers its index from the device files, which takes a while: the
    core logs how far it has come every 2 s (target ``kvtier_core::tiers::nvme``, through pyo3-log),
    and this shows those lines on stderr (stdout stays the command's report, ``--json`` included)."""
    logger = logging.getLogger("kvtier_core.tiers.nvme")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _open_from_disk(
    paths: Sequence[Path], digest: str, dirs: list[store_files.NamespaceDir], shared: Mapping[str, str] | None = None
) -> Any:
    """Opens the namespace's store from its files (recovery runs; the LOCK is taken until close),
    with its shared tier when ``shared`` gives ``shared_root`` (and ``shared_key_file``)."""
    import kvtier
    from kvtier.errors import LockedError

    first = dirs[0]
    description_file = first.directory / DESCRIPTION_FILE_NAME
    try:
        description = description_file.read_bytes()
    except FileNotFoundError:
        raise OpsError(
            f"namespace {digest[:16]}: no {DESCRIPTION_FILE_NAME} file (the store was written by a kvtier before "
            "0.1 with operator commands), so it cannot be opened without its engine: run the command while the "
            "service has it open (start an engine on it), or open it once with this kvtier"
        ) from None
    superblock = first.superblock
    if superblock is None:
        raise OpsError(
            f"namespace {digest[:16]}: {first.error or 'no device file (a DRAM-only store): nothing on disk'}"
        )
    store_paths = [os.fspath(d.path) for d in dirs]
    try:
        with _recovery_progress_on_stderr():
            return kvtier.Store.open(
                store_paths if len(store_paths) > 1 else store_paths[0],
                namespace=description,
                object_bytes=superblock.object_bytes,
                dram_bytes=superblock.slot_bytes * 8,
                nvme_bytes=superblock.device_bytes * superblock.device_count,  # what gives this geometry back
                region_bytes=superblock.region_bytes,
                **dict(shared or {}),
            )
    except LockedError:
        holder = first.locked_by_pid
        raise OpsError(
            f"namespace {digest[:16]} is open in another process{f' (pid {holder})' if holder else ''} that is not "
            "the service answering on this path's socket (an engine with host_service: false, or a service on "
            "another --socket): run the command with that service's --socket, or stop the process"
        ) from None


def _matches(wanted: str, digest: str, description: bytes | None) -> bool:
    wanted = wanted.strip().lower()
    if digest.startswith(wanted) and len(wanted) >= 4:
        return True
    model = describe(description).get("model")
    return isinstance(model, str) and model.lower() == wanted


@dataclass
class Gathered:
    paths: list[Path]
    socket: Path
    service_running: bool
    service_pid: int | None
    targets: list[Target]
    skipped: list[dict[str, str]]


@dataclass
class _Found:
    """What ``gather`` finds before it opens anything: the service's namespaces and those on disk."""

    paths: list[Path]
    socket: Path
    client: Any  # the service's, or None: no service answers
    service_namespaces: dict[str, dict[str, Any]]  # digest -> the service's listing of it
    on_disk: dict[str, list[store_files.NamespaceDir]]

    def digests(self) -> list[str]:
        return sorted(set(self.on_disk) | set(self.service_namespaces))


def _listing_of_service(socket: Path) -> tuple[Any, dict[str, dict[str, Any]]]:
    """A client of the service on ``socket`` and its namespaces by digest; (None, {}) when none answers."""
    from kvtier.service import connect

    client = None
    if socket.exists():
        try:
            client = connect(socket, timeout_ms=600_000)
            listing = client.namespaces()
        except Exception as error:
            if client is not None and "protocol version 1" in str(error):
                raise OpsError(str(error)) from None
            client = None
        else:
            return client, {ns["digest"]: ns for ns in listing["namespaces"]}
    return client, {}


def _namespaces_on_disk(paths: list[Path]) -> dict[str, list[store_files.NamespaceDir]]:
    """The namespace directories under ``paths`` by digest (one per path a store is striped over)."""
    holders = store_files.flock_holders()
    on_disk: dict[str, list[store_files.NamespaceDir]] = {}
    for path in paths:
        try:
            for ns in store_files.scan(path, holders):
                on_disk.setdefault(ns.digest, []).append(ns)
        except OSError as error:
            raise OpsError(f"cannot list {path}: {error.strerror} (run as the store's owner)") from None
    return on_disk


def _find(paths: Sequence[Path], socket_option: str | os.PathLike | None) -> _Found:
    resolved = _check_paths(paths)
    socket = resolve_socket(resolved, socket_option)
    client, service_namespaces = _listing_of_service(socket)
    on_disk = _namespaces_on_disk(resolved)
    if client is None and not on_disk:
        where = ", ".join(str(p) for p in resolved)
        raise OpsError(
            f"{where}: not a kvtier store (no namespace directory) and no service answers on {socket}: give the "
            "directory the engines use as `path`, or --socket of the service that serves it"
        )
    return _Found(resolved, socket, client, service_namespaces, on_disk)


def _service_target(found: _Found, digest: str, namespace: str | None) -> Target | None:
    """The namespace the service has open; None when ``namespace`` names another."""
    info = found.service_namespaces[digest]
    description = bytes(info["description"])
    if namespace is not None and not _matches(namespace, digest, description):
        return None
    return Target(
        digest,
        "service",
        description,
        found.on_disk.get(digest, []),
        client=found.client,
        values=dict(info["values"]),
        object_bytes=int(info["object_bytes"]),
    )


def _disk_target(
    found: _Found,
    digest: str,
    namespace: str | None,
    open_disk: bool,
    shared: Mapping[str, str] | None,
    skipped: list[dict[str, str]],
) -> Target | None:
    """The namespace from its files, its store opened when ``open_disk``; None when ``namespace``
    names another, or when it cannot be opened (then ``skipped`` gets the reason)."""
    dirs = found.on_disk[digest]
    description_file = dirs[0].directory / DESCRIPTION_FILE_NAME
    description = description_file.read_bytes() if description_file.exists() else None
    if namespace is not None and not _matches(namespace, digest, description):
        return None
    if not open_disk:
        return Target(digest, "disk", description, dirs)
    if dirs[0].superblock is None and dirs[0].device_file_bytes is None:
        skipped.append({"digest": digest, "reason": "DRAM-only store (no device file): nothing on disk"})
        return None
    try:
        store = _open_from_disk(found.paths, digest, dirs, shared)
    except OpsError as error:
        skipped.append({"digest": digest, "reason": str(error)})
        return None
    target = Target(digest, "disk", description, dirs, store=store, object_bytes=store.object_bytes)
    target.shared_open = bool(shared)
    return target


@contextmanager
def gather(
    paths: Sequence[Path],
    socket_option: str | os.PathLike | None,
    namespace: str | None,
    open_disk: bool = True,
    shared: Mapping[str, str] | None = None,
) -> Iterator[Gathered]:
    """The namespaces under ``paths`` (only ``namespace`` when given: a digest prefix or a model
    name), each from the service if it has it open, else from disk (with the shared tier that
    ``shared`` names, if any). Stores opened here are closed on exit."""
    from kvtier.service import service_pid

    found = _find(paths, socket_option)
    targets: list[Target] = []
    skipped: list[dict[str, str]] = []
    try:
        for digest in found.digests():
            if digest in found.service_namespaces:
                target = _service_target(found, digest, namespace)
            else:
                target = _disk_target(found, digest, namespace, open_disk, shared, skipped)
            if target is not None:
                targets.append(target)
        if namespace is not None and not targets:
            known = ", ".join(f"{d[:16]}" for d in found.digests()) or "none"
            reasons = "; ".join(s["reason"] for s in skipped)
            raise OpsError(
                f"no namespace matches {namespace!r} (give a digest prefix of 4+ hex digits or a model name; "
                f"namespaces here: {known}){': ' + reasons if reasons else ''}"
            )
        yield Gathered(
            paths=found.paths,
            socket=found.socket,
            service_running=found.client is not None,
            service_pid=service_pid(found.socket) if found.client is not None else None,
            targets=targets,
            skipped=skipped,
        )
    finally:
        for target in targets:
            target.close()


def _header(g: Gathered, schema: str) -> dict[str, Any]:
    return {
        "schema": schema,
        "paths": [str(p) for p in g.paths],
        "socket": str(g.socket),
        "service": {"running": g.service_running, "pid": g.service_pid},
    }


# --------------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------------

ProgressFn = Callable[[str, int, int, int], None]  # (digest, blocks done, blocks total, bytes read)

_VERIFY_COUNTS = ("checked_dram", "checked_nvme", "bad_dram", "bad_nvme", "bytes_read", "skipped_busy")


def verify(
    paths: Sequence[Path],
    socket: str | os.PathLike | None = None,
    namespace: str | None = None,
    max_mbps: float = 0.0,
    progress: ProgressFn | None = None,
    shared_root: str | os.PathLike | None = None,
    shared_key_file: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Scrubs every namespace (or one): re-reads every block of DRAM and NVMe (and of the shared
    tier: for the service's namespaces that have one, and for stores opened here when
    ``shared_root`` names it), paced to ``max_mbps`` (MB/s, 10^6 bytes; 0 unpaced), and quarantines
    bad copies."""
    rate = _verify_rate(max_mbps)
    shared_options = _shared_options(shared_root, shared_key_file)
    with gather(paths, socket, namespace, shared=shared_options) as g:
        report = _header(g, VERIFY_SCHEMA)
        report["max_mbps"] = max_mbps or None
        results: list[dict[str, Any]] = []
        for target in g.targets:
            started = time.monotonic()
            totals: dict[str, Any] = dict.fromkeys(_VERIFY_COUNTS, 0)
            bad: list[dict[str, Any]] = []
            totals["checked_shared"] = totals["bad_shared"] = 0
            for shared in (False, True) if target.has_shared_tier else (False,):
                after, total, ceiling = 0, None, 0
                while True:
                    step = target.verify_batch(after, target.step_blocks(rate), rate, shared)
                    if shared:  # the shared tier's steps count its blocks as checked_nvme / bad_nvme
                        step["checked_shared"] = step.pop("checked_nvme", 0)
                        step["bad_shared"] = step.pop("bad_nvme", 0)
                    if total is None:
                        total = int(step.get("remaining_blocks", 0))
                        # Blocks stored after the scrub began are the next scrub's: beside an engine
                        # that keeps storing, a walk to the newest would never end.
                        ceiling = int(step.get("newest_sequence", 0))
                    for name in (*_VERIFY_COUNTS, "checked_shared", "bad_shared"):
                        totals[name] += int(step.get(name, 0))
                    bad += step["bad"]
                    after = int(step["next_after"])
                    if progress is not None:
                        label = f"{target.digest}{' shared' if shared else ''}"
                        done = totals["checked_shared"] if shared else totals["checked_dram"] + totals["checked_nvme"]
                        progress(label, min(done, total or done), max(total or 0, done), totals["bytes_read"])
                    if step["done"] or (ceiling and after >= ceiling):
                        break
                    # A step sleeps at most ~2 s for its pace (holding its namespace in the
                    # service); what the pace asks beyond that is waited here, holding nothing.
                    time.sleep(int(step.get("pace_wait_ms", 0)) / 1000)
            seconds = time.monotonic() - started
            results.append(
                {
                    "digest": target.digest,
                    "source": target.source,
                    "model": describe(target.description).get("model"),
                    **totals,
                    "bad_blocks": totals["bad_dram"] + totals["bad_nvme"] + totals["bad_shared"],
                    "seconds": round(seconds, 3),
                    "mb_per_s": round(totals["bytes_read"] / seconds / 1e6, 1) if seconds > 0 else None,
                    "bad": bad,
                }
            )
        report["namespaces"] = results
        report["skipped"] = g.skipped
        report["checked_copies"] = sum(r["checked_dram"] + r["checked_nvme"] + r["checked_shared"] for r in results)
        report["bad_blocks"] = sum(r["bad_blocks"] for r in results)
        report["ok"] = report["bad_blocks"] == 0
        return report


def _verify_rate(max_mbps: float) -> int:
    """Bytes per second for ``--max-mbps``; a pace slower than the core takes is refused here."""
    rate = int(max_mbps * 1_000_000)
    if 0 < rate < MIN_VERIFY_BYTES_PER_S:
        raise OpsError(
            f"--max-mbps {max_mbps:g} is below the slowest pace a scrub takes (1 MB/s): at that pace one block "
            "would take minutes to hours. Give --max-mbps 1 or more, or 0 to read unpaced"
        )
    return rate


def _shared_options(root: str | os.PathLike | None, key_file: str | os.PathLike | None) -> dict[str, str] | None:
    if root is None:
        if key_file is not None:
            raise OpsError("--shared-key-file needs --shared-root: the shared tier's directory")
        return None
    if not Path(root).is_dir():
        raise OpsError(f"--shared-root {root}: not a directory (give the shared_root the engines use)")
    options = {"shared_root": os.fspath(root)}
    if key_file is not None:
        options["shared_key_file"] = os.fspath(key_file)
    return options


# --------------------------------------------------------------------------------------------
# trim
# --------------------------------------------------------------------------------------------

_TRIM_COUNTS = ("dram_blocks", "dram_bytes", "nvme_blocks", "nvme_bytes", "regions_freed", "skipped_in_use")


def trim(
    paths: Sequence[Path],
    socket: str | os.PathLike | None = None,
    namespace: str | None = None,
    to_bytes: int | None = None,
    older_than_s: float | None = None,
) -> dict[str, Any]:
    """Removes blocks nobody uses: down to ``to_bytes`` of NVMe per namespace (oldest whole regions),
    those older than ``older_than_s``, or (neither given) every block of ``namespace``."""
    if to_bytes is not None and older_than_s is not None:
        raise OpsError("give one of --to and --older-than, not both")
    if to_bytes is None and older_than_s is None and namespace is None:
        raise OpsError("say what to trim: --to BYTES, --older-than DURATION, or --namespace NS (all of it)")
    if to_bytes is not None:
        mode, value = "nvme_to", int(to_bytes)
    elif older_than_s is not None:
        mode, value = "older_than", int(older_than_s * 1000)
    else:
        mode, value = "all", 0
    with gather(paths, socket, namespace) as g:
        report = _header(g, TRIM_SCHEMA)
        report["mode"] = mode
        report["value"] = value
        results: list[dict[str, Any]] = []
        for target in g.targets:
            counts = target.trim(mode, value)
            results.append(
                {
                    "digest": target.digest,
                    "source": target.source,
                    "model": describe(target.description).get("model"),
                    **{name: int(counts.get(name, 0)) for name in _TRIM_COUNTS},
                }
            )
        report["namespaces"] = results
        report["skipped"] = g.skipped
        report["removed_blocks"] = sum(r["dram_blocks"] + r["nvme_blocks"] for r in results)
        report["freed_nvme_bytes"] = sum(r["nvme_bytes"] for r in results)
        return report


# --------------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------------


def _iso(unix_ms: int | None) -> str | None:
    if not unix_ms:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_ms / 1000))


def inspect(paths: Sequence[Path], socket: str | os.PathLike | None = None, namespace: str = "") -> dict[str, Any]:
    """One namespace: its description, block counts and bytes per tier, oldest and newest block."""
    with gather(paths, socket, namespace) as g:
        if len(g.targets) > 1:
            raise OpsError(
                f"{len(g.targets)} namespaces match {namespace!r} "
                f"({', '.join(t.digest[:16] for t in g.targets)}): give more digits of the digest"
            )
        target = g.targets[0]
        report = _header(g, INSPECT_SCHEMA)
        if target.store is not None:
            stats = dict(target.store.stats())
            facts = dict(target.store.namespace_facts())
            values = {**stats, **facts}
        else:
            values = target.values
        superblock = target.dirs[0].superblock if target.dirs else None
        before_open = bool(values.get("oldest_block_before_open"))
        report["namespace"] = {
            "digest": target.digest,
            "source": target.source,
            "directories": [str(d.directory) for d in target.dirs],
            "description": describe(target.description),
            "description_raw": target.description.decode(errors="replace") if target.description else None,
            "object_bytes": superblock.object_bytes if superblock else values.get("object_bytes"),
            "slot_bytes": superblock.slot_bytes if superblock else None,
            "blocks": values.get("blocks"),
            "tiers": {
                "dram": {
                    "blocks": values.get("blocks_dram"),
                    "used_bytes": values.get("dram_used_bytes"),
                    "capacity_bytes": values.get("dram_capacity_bytes"),
                },
                "nvme": {
                    "blocks": values.get("blocks_nvme"),
                    "used_bytes": values.get("nvme_used_bytes"),
                    "capacity_bytes": values.get("nvme_capacity_bytes"),
                },
            },
            "oldest_block_unix_ms": values.get("oldest_block_unix_ms") or None,
            "newest_block_unix_ms": values.get("newest_block_unix_ms") or None,
            "oldest_block": _iso(values.get("oldest_block_unix_ms")),
            "newest_block": _iso(values.get("newest_block_unix_ms")),
            "oldest_block_before_open": before_open,
            "newest_block_before_open": bool(values.get("newest_block_before_open")),
            "opened": _iso(values.get("opened_unix_ms")),
            "hits": {k: values.get(k) for k in ("dram_hits", "nvme_hits", "shared_hits", "misses")},
            "checksum_failures": values.get("checksum_failures"),
        }
        return report
