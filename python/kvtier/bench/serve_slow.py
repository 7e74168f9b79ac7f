"""`kvtier bench serve --slow-link` / `--slow-mount`: OpenAI servers under load with a remote tier behind a
slow path (issue 36, item 4): vLLM alone, always-load and kvtier's choice (load or recompute).

Two tiers, one scene each (``SlowTier``: ``BUCKET``, ``MOUNT``; a run takes one of them):

- ``--slow-link``: a bucket holds the users' system prompts (a server that ran the same load before,
  node A, published them), and a fresh server (node B: an empty local store, ``--dram-gib`` of DRAM, no
  NVMe) reads the bucket through ``kvtier.bench.slowlink``, a proxy on 127.0.0.1 limited to
  ``--slow-link`` MB/s with ``--slow-link-latency-ms`` added each way. Rows ``kvtier-object-*``.
- ``--slow-mount``: the same with the shared-filesystem tier: node A publishes into a directory of the
  run (``shared_root``), and node B's shared root is that directory through ``kvtier.bench.slowmount``,
  a FUSE passthrough whose reads go at ``--slow-mount`` MB/s with ``--slow-link-latency-ms`` added
  (the slow network filesystem of a user). Rows ``kvtier-mount-*``. The passthrough is Python: on a
  2-core machine it takes CPU beside the engine, as a FUSE client does, and tops out near 150 MB/s.

Rows, in order:

- ``vllm``: vLLM alone.
- the publish row (added before the tier's first row): node A, ``KvtierConnector`` with ``--dram-gib`` of
  DRAM and the tier reached directly, running every point of the run (the same dataset seeds), so the
  tier holds every user's prefix. Its figures are a row of their own (kvtier publishing, nothing slow).
- per speed, the always row (``load_policy: always`` with a deadline, ``service_timeout_ms``, long enough
  that every hit is waited for: kvtier before it could choose) and the auto row (``load_policy: auto``,
  the default: kvtier decides per request which leading hits to load), each a fresh node B with an
  empty store.

Every server of the run shares one runtime directory (``XDG_RUNTIME_DIR``, the run's own), where the
engines keep their costs files: node A's steps train the prefill model, and each slow row starts
from what node A left (the files are put back before each row), so kvtier's choice probes the slow
tier at each speed and learns its rate as a user's fresh server would.

Checks (a problem, exit 1): node A published; the always-load row loaded blocks from the tier;
kvtier's choice counted decisions (``kvtier:load_decisions`` on the server's ``/metrics``).
Per point the decisions (blocks per tier and choice) are recorded, and per point kvtier's
throughput is set against the better of vLLM alone and always-load (issue 36's target: at least 0.97x).
The bucket is ``--bucket-url`` (credentials from the environment) or Ceph's RADOS gateway on 127.0.0.1
(``kvtier.bench.bucket``, root), up from node A's row to the last object row; the shared directory is
the run's own (``OUT/slow-mount/source``), removed at the end.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench import bucket, slowmount
from kvtier.bench.slowlink import LinkSpec, SlowLinkError, SlowLinkProcess, parse_rates
from kvtier.bench.slowmount import SlowMount

DEFAULT_USERS = "12"  # --users 12,32 adds the 32-user point
ALWAYS_LOAD_TIMEOUT_MS = 3_600_000  # every hit waited for (the default 2 s would give up slow prefetches)
TARGET_OVER_BEST = 0.97  # kvtier's choice: throughput at least this times the better of the other two
DECISIONS_METRIC = "kvtier:load_decisions"


@dataclass(frozen=True)
class SlowTier:
    """A remote tier the slow rows read through a slowed path, and how its rows are named and checked."""

    name: str  # the tier in kvtier's decisions ("bucket", "shared")
    option: str  # the command-line option of its speeds
    path: str  # what is slow ("link", "mount")
    publish_row: str
    always_row: str
    auto_row: str
    hits: str  # kvtier's counter of blocks it served
    # kvtier's counter of what node A published during its points; None: checked after its row instead
    # (the shared tier publishes a file once it is full, or when the store closes)
    published: str | None
    published_what: str
    source: str  # where the always row reads from

    @property
    def rows(self) -> tuple[str, str]:
        """The rows asked for by name (--rows); the publish row comes with them."""
        return (self.always_row, self.auto_row)


BUCKET = SlowTier(
    "bucket", "--slow-link", "link", "kvtier-object-publish", "kvtier-object-always", "kvtier-object-auto",
    "bucket_hits", "bucket_segments_published", "segment to the bucket", "the bucket",
)  # fmt: skip
MOUNT = SlowTier(
    "shared", "--slow-mount", "mount", "kvtier-mount-publish", "kvtier-mount-always", "kvtier-mount-auto",
    "shared_hits", None, "file to the shared directory", "the shared directory",
)  # fmt: skip
TIERS = (BUCKET, MOUNT)
PUBLISH_ROW, ALWAYS_ROW, AUTO_ROW = BUCKET.publish_row, BUCKET.always_row, BUCKET.auto_row
OBJECT_ROWS = BUCKET.rows
MOUNT_ROWS = MOUNT.rows
ROW_LABELS = {
    PUBLISH_ROW: "node A: kvtier DRAM + bucket (direct)",
    ALWAYS_ROW: "always-load",
    AUTO_ROW: "kvtier's choice (auto)",
    MOUNT.publish_row: "node A: kvtier DRAM + shared directory (direct)",
    MOUNT.always_row: "always-load, slow mount",
    MOUNT.auto_row: "kvtier's choice (auto), slow mount",
}


class SlowRowsError(RuntimeError):
    """The slow-link rows cannot run as asked; the message says what to change."""


def row_base(row: str) -> str:
    """``kvtier-object-auto@20`` -> ``kvtier-object-auto``."""
    return row.split("@", 1)[0]


def row_rate(row: str) -> float | None:
    return float(row.split("@", 1)[1]) if "@" in row else None


def tier_of(row: str) -> SlowTier | None:
    """The slow tier a row reads (its publish, always or auto row), or None."""
    base = row_base(row)
    return next((tier for tier in TIERS if base in (tier.publish_row, *tier.rows)), None)


def is_auto_row(row: str) -> bool:
    tier = tier_of(row)
    return tier is not None and row_base(row) == tier.auto_row


def expand_rows(rows: list[str], rates_text: str | None, tier: SlowTier = BUCKET) -> list[str]:
    """The tier's rows once per speed (``kvtier-object-auto@20``), its publish row before the first of
    them. Without the tier's speeds none of its rows may be asked for."""
    asked = [row for row in rows if row in tier.rows]
    if not rates_text:
        if asked:
            raise SlowRowsError(f"the rows {', '.join(asked)} read through a slow {tier.path}: add {tier.option}")
        return rows
    if not asked:
        raise SlowRowsError(f"{tier.option} measures the rows {', '.join(tier.rows)}: name them in --rows")
    if len(asked) > len(set(asked)):
        # Each runs once per speed behind one node A; a second mention would run nothing more.
        raise SlowRowsError(
            f"the rows {', '.join(dict.fromkeys(asked))} run once per speed of {tier.option}: name each once, "
            "and run the command again (another --seed, --out) for repeats"
        )
    try:
        rates = parse_rates(rates_text)
    except SlowLinkError as error:
        raise SlowRowsError(f"{tier.option}: {error}") from None
    expanded: list[str] = []
    for row in rows:
        if row not in tier.rows:
            expanded.append(row)
        elif tier.publish_row not in expanded:  # the first of its rows: node A, then every speed's rows
            expanded.append(tier.publish_row)
            expanded += [f"{asked_row}@{rate:g}" for rate in rates for asked_row in dict.fromkeys(asked)]
    return expanded


class SlowTierRows:
    """The slow rows' tier (the bucket, or the shared directory), its slow path at the current speed,
    and the costs files between speeds."""

    def __init__(self, plan: dict[str, Any], out_dir: Path, log) -> None:
        self._plan, self._out_dir, self._log = plan, out_dir, log
        self._stack = contextlib.ExitStack()
        self._bucket: bucket.Bucket | None = None
        self._path: SlowLinkProcess | SlowMount | None = None
        self._rate: float | None = None
        self._snapshot = Path(tempfile.mkdtemp(prefix="kvtier-serve-costs-"))

    def options(self, row: str) -> dict[str, Any]:
        """kvtier options of a slow tier's row (where its tier is, load policy), or of a row that
        publishes to the bucket beside its NVMe tier (``--publish-bucket``: under a prefix of its own, so
        that no row reads another's blocks); {} for another row."""
        if row in self._plan.get("publish_bucket_rows", ()):
            return self._opened_bucket().options(sub_prefix=row)
        tier = tier_of(row)
        if tier is None:
            return {}
        direct = self._direct_options(tier)
        if row_base(row) == tier.publish_row:
            return {**direct, "load_policy": "auto"}  # its steps train the prefill model
        rate = row_rate(row)
        assert rate is not None
        if rate != self._rate:
            self._start_path(tier, rate)
        # Each row starts from node A's costs, as a user's fresh server would: the always-load row's
        # rates, measured with every hit loaded at once, must not decide for kvtier's choice.
        self._restore_costs()
        options = {**direct, **self._slow_options()}
        if row_base(row) == tier.always_row:
            return {**options, "load_policy": "always", "service_timeout_ms": ALWAYS_LOAD_TIMEOUT_MS}
        return {**options, "load_policy": "auto"}

    def _direct_options(self, tier: SlowTier) -> dict[str, Any]:
        """Where node A reaches the tier (the bucket brought up at the first row that needs it)."""
        if tier is MOUNT:
            source = self._out_dir / "slow-mount" / "source"
            source.mkdir(parents=True, exist_ok=True)
            return {"shared_root": str(source)}
        opened = self._opened_bucket()
        return {"bucket_url": opened.url(), "bucket_endpoint": opened.endpoint}

    def _opened_bucket(self) -> bucket.Bucket:
        """The rows' bucket, brought up at the first row that needs it."""
        if self._bucket is None:
            given = (self._plan.get("bucket_url"), self._plan.get("bucket_endpoint"))
            opened = bucket.open_bucket(*given, self._plan["bucket_osd_bytes"], self._log)
            self._bucket = self._stack.enter_context(opened)
        return self._bucket

    def _slow_options(self) -> dict[str, Any]:
        """Where node B reaches the tier: through the slow path."""
        if isinstance(self._path, SlowMount):
            return {"shared_root": str(self._path.mountpoint)}
        assert isinstance(self._path, SlowLinkProcess)
        return {"bucket_endpoint": self._path.url}

    def _start_path(self, tier: SlowTier, rate: float) -> None:
        self._stop_path()
        spec = LinkSpec(rate, self._plan["slow_link_latency_ms"])
        log_path = self._out_dir / "logs" / f"slow{tier.path}-{rate:g}MBps.log"
        if tier is MOUNT:
            reason = slowmount.missing_reason()
            if reason:
                raise SlowRowsError(f"--slow-mount: {reason}")
            source = self._out_dir / "slow-mount" / "source"
            mount = SlowMount(source, self._out_dir / "slow-mount" / "mount", spec, log_path=log_path)
            try:
                mount.start()
            except SlowLinkError as error:
                raise SlowRowsError(f"--slow-mount: {error}") from None
            self._path, self._rate = mount, rate
            self._log(f"slow mount: {spec.describe()} on {mount.mountpoint} -> {source}")
            return
        assert self._bucket is not None
        try:
            link = SlowLinkProcess(self._bucket.endpoint, spec, log_path)
            link.start()
        except SlowLinkError as error:
            raise SlowRowsError(
                f"{error} (the bucket's endpoint is {self._bucket.endpoint}: the slow link needs the local gateway "
                "or an endpoint on 127.0.0.1)"
            ) from None
        self._path, self._rate = link, rate
        self._log(f"slow link: {spec.describe()} on {link.url} -> {self._bucket.endpoint}")

    def row_done(self, row: str, record: dict[str, Any]) -> None:
        """After node A: keeps its costs files (each speed starts from them), and on the shared tier
        checks that it published (its server stopped: its last file is out)."""
        tier = tier_of(row)
        if tier is MOUNT and row_base(row) == tier.publish_row:
            source = self._out_dir / "slow-mount" / "source"  # data files: <namespace>/data/<xx>/<file>
            if not any(path.is_file() and "data" in path.relative_to(source).parts for path in source.rglob("*")):
                record["problems"].append(
                    f"node A published no {tier.published_what}: the slow rows would read nothing"
                )
        if tier is not None and row_base(row) == tier.publish_row:
            shutil.rmtree(self._snapshot, ignore_errors=True)
            self._snapshot.mkdir()
            for path in costs_dir().glob("costs-*.json"):
                shutil.copy2(path, self._snapshot / path.name)
            self._log(f"slow {tier.path}: node A left costs files {sorted(p.name for p in self._snapshot.iterdir())}")

    def _restore_costs(self) -> None:
        for path in costs_dir().glob("costs-*.json"):
            path.unlink()
        for path in self._snapshot.glob("costs-*.json"):
            shutil.copy2(path, costs_dir() / path.name)

    def _stop_path(self) -> None:
        if self._path is not None:
            self._path.close()
        self._path, self._rate = None, None

    def close(self) -> None:
        self._stop_path()
        self._stack.close()
        shutil.rmtree(self._snapshot, ignore_errors=True)
        shutil.rmtree(self._out_dir / "slow-mount", ignore_errors=True)

    def __enter__(self) -> SlowTierRows:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def costs_dir() -> Path:
    """The costs files' directory: beside the default service sockets (this run's runtime directory)."""
    from kvtier.service import default_socket_path

    directory = default_socket_path("/").parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return directory


def load_decisions(urls: list[str]) -> dict[str, float] | None:
    """``kvtier:load_decisions`` summed over the servers' ``/metrics``, as ``tier:choice`` -> blocks."""
    totals: dict[str, float] = {}
    try:
        for url in urls:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
                text = answer.read().decode()
            for line in text.splitlines():
                # The counter's samples only (a Prometheus client also writes ``..._created`` ones).
                if line.split("{", 1)[0] in (DECISIONS_METRIC, f"{DECISIONS_METRIC}_total") and "{" in line:
                    key = _decision_key(line[line.index("{") + 1 : line.rindex("}")])
                    totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as error:
        print(f"note: kvtier's load decisions unavailable ({error})", flush=True)
        return None
    return totals


def _decision_key(labels_text: str) -> str:
    """``tier:choice`` of a ``kvtier:load_decisions`` sample's labels (``a="x",tier="shared",...``)."""
    labels = dict(part.split("=", 1) for part in labels_text.split(",") if "=" in part)
    return f"{labels.get('tier', '?').strip(chr(34))}:{labels.get('choice', '?').strip(chr(34))}"


def decisions_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, int] | None:
    if before is None or after is None:
        return None
    return {key: int(value - before.get(key, 0.0)) for key, value in after.items() if value != before.get(key, 0.0)}


def row_problems(row: str, points: list[dict[str, Any]]) -> list[str]:
    """What a slow tier's row must show: node A published, always-load loaded from the tier, kvtier's
    choice decided."""
    tier = tier_of(row)
    if tier is None or not points:
        return []
    base = row_base(row)
    counters = [point.get("kvtier") or {} for point in points]
    if base == tier.publish_row and tier.published and not sum(c.get(tier.published, 0) for c in counters):
        return [f"node A published no {tier.published_what}: the slow rows would read nothing"]
    if base == tier.always_row and not sum(c.get(tier.hits, 0) for c in counters):
        return [f"always-load loaded no block from {tier.source}"]
    if base == tier.auto_row and not any(point.get("load_decisions") for point in points):
        return ["kvtier's choice counted no load decision (kvtier:load_decisions) at any point"]
    return []


def judged(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Per tier, speed and users: kvtier's choice's throughput over the better of vLLM alone and
    always-load."""
    by_row = {(record["row"], point["users"]): point for record in document["rows"] for point in record["points"]}
    results = []
    for (row, users), point in by_row.items():
        tier = tier_of(row)
        if tier is None or row_base(row) != tier.auto_row:
            continue
        rate = row_rate(row)
        alone = by_row.get(("vllm", users), {}).get("request_throughput")
        always = by_row.get((f"{tier.always_row}@{rate:g}", users), {}).get("request_throughput")
        best = max((value for value in (alone, always) if value), default=None)
        value = point["request_throughput"] / best if best and point.get("request_throughput") else None
        results.append({
            "tier": tier.name, "link_mb_per_s": rate, "users": users, "auto_over_best": value,
            "target_at_least": TARGET_OVER_BEST,
            "better": None if best is None else ("vLLM alone" if best == alone else "always-load"),
            "met": None if value is None else value >= TARGET_OVER_BEST,
        })  # fmt: skip
    return results


def osd_bytes(users: list[int], prefix_tokens: int, kv_bytes_per_token: int | None) -> int:
    """A local gateway's OSD (``bucket.osd_store``: RAM or disk): every point's users' prefixes, with room."""
    return int(sum(users) * prefix_tokens * (kv_bytes_per_token or 0) * 1.25) + (1 << 30)
