"""`kvtier bench serve --slow-link`: OpenAI servers under load with kvtier's object tier behind a slow
link (issue 36, item 4): vLLM alone, always-load and kvtier's choice (load or recompute).

The scene: a bucket holds the users' system prompts (a server that ran the same load before, node A,
published them), and a fresh server (node B: an empty local store, ``--dram-gib`` of DRAM, no NVMe)
reads the bucket through ``kvtier.bench.slowlink``, a proxy on 127.0.0.1 limited to ``--slow-link``
MB/s with ``--slow-link-latency-ms`` added each way. Rows, in order:

- ``vllm``: vLLM alone.
- ``kvtier-object-publish`` (added before the first object row): node A, ``KvtierConnector`` with
  ``--dram-gib`` of DRAM and the bucket reached directly, running every point of the run (the same
  dataset seeds), so the bucket holds every user's prefix. Its figures are a row of their own (kvtier
  publishing to a bucket, nothing slow).
- per link speed, ``kvtier-object-always`` (``load_policy: always`` with a deadline,
  ``service_timeout_ms``, long enough that every hit is waited for: kvtier before it could choose) and
  ``kvtier-object-auto`` (``load_policy: auto``, the default: kvtier decides per request which leading
  hits to load), each a fresh node B with an empty store.

Every server of the run shares one runtime directory (``XDG_RUNTIME_DIR``, the run's own), where the
engines keep their costs files: node A's steps train the prefill model, and each object row starts
from what node A left (the files are put back before each row), so kvtier's choice probes the slow
tier at each speed and learns its rate as a user's fresh server would.

Checks (a problem, exit 1): node A published segments; the always-load row loaded blocks from the
bucket; kvtier's choice counted decisions (``kvtier:load_decisions`` on the server's ``/metrics``).
Per point the decisions (blocks per tier and choice) are recorded, and per point kvtier's
throughput is set against the better of vLLM alone and always-load (issue 36's target: at least 0.97x).
The bucket is ``--bucket-url`` (credentials from the environment) or Ceph's RADOS gateway on 127.0.0.1
(``kvtier.bench.bucket``, root), up from node A's row to the last object row.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvtier.bench import bucket
from kvtier.bench.slowlink import LinkSpec, SlowLinkError, SlowLinkProcess, parse_rates

PUBLISH_ROW = "kvtier-object-publish"
ALWAYS_ROW = "kvtier-object-always"
AUTO_ROW = "kvtier-object-auto"
OBJECT_ROWS = (ALWAYS_ROW, AUTO_ROW)
ROW_LABELS = {
    PUBLISH_ROW: "node A: kvtier DRAM + bucket (direct)",
    ALWAYS_ROW: "always-load",
    AUTO_ROW: "kvtier's choice (auto)",
}
DEFAULT_USERS = "12"  # --users 12,32 adds the 32-user point
ALWAYS_LOAD_TIMEOUT_MS = 3_600_000  # every hit waited for (the default 2 s would give up slow prefetches)
TARGET_OVER_BEST = 0.97  # kvtier's choice: throughput at least this times the better of the other two
DECISIONS_METRIC = "kvtier:load_decisions"


class SlowRowsError(RuntimeError):
    """The slow-link rows cannot run as asked; the message says what to change."""


def row_base(row: str) -> str:
    """``kvtier-object-auto@20`` -> ``kvtier-object-auto``."""
    return row.split("@", 1)[0]


def row_rate(row: str) -> float | None:
    return float(row.split("@", 1)[1]) if "@" in row else None


def expand_rows(rows: list[str], rates_text: str | None) -> list[str]:
    """The object rows once per link speed (``kvtier-object-auto@20``), node A's row before the first
    of them. Without ``--slow-link`` no object row may be asked for."""
    asked = [row for row in rows if row in OBJECT_ROWS]
    if not rates_text:
        if asked:
            raise SlowRowsError(f"the rows {', '.join(asked)} read the bucket through a slow link: add --slow-link")
        return rows
    if not asked:
        raise SlowRowsError(f"--slow-link measures the rows {', '.join(OBJECT_ROWS)}: name them in --rows")
    try:
        rates = parse_rates(rates_text)
    except SlowLinkError as error:
        raise SlowRowsError(f"--slow-link: {error}") from None
    expanded: list[str] = []
    for row in rows:
        if row not in OBJECT_ROWS:
            expanded.append(row)
        elif PUBLISH_ROW not in expanded:  # the first object row: node A, then every speed's rows
            expanded.append(PUBLISH_ROW)
            expanded += [f"{asked_row}@{rate:g}" for rate in rates for asked_row in dict.fromkeys(asked)]
    return expanded


class ObjectRows:
    """The bucket, the slow link of the current speed, and the costs files between speeds."""

    def __init__(self, plan: dict[str, Any], out_dir: Path, log) -> None:
        self._plan, self._out_dir, self._log = plan, out_dir, log
        self._stack = contextlib.ExitStack()
        self._bucket: bucket.Bucket | None = None
        self._link: SlowLinkProcess | None = None
        self._rate: float | None = None
        self._snapshot = Path(tempfile.mkdtemp(prefix="kvtier-serve-costs-"))

    def options(self, row: str) -> dict[str, Any]:
        """kvtier options of an object row's server (bucket, endpoint, load policy); {} for another row."""
        base = row_base(row)
        if base not in (PUBLISH_ROW, *OBJECT_ROWS):
            return {}
        if self._bucket is None:
            given = (self._plan.get("bucket_url"), self._plan.get("bucket_endpoint"))
            opened = bucket.open_bucket(*given, self._plan["bucket_osd_bytes"], self._log)
            self._bucket = self._stack.enter_context(opened)
        options: dict[str, Any] = {"bucket_url": self._bucket.url(), "bucket_endpoint": self._bucket.endpoint}
        if base == PUBLISH_ROW:
            return {**options, "load_policy": "auto"}  # its steps train the prefill model
        rate = row_rate(row)
        assert rate is not None
        if rate != self._rate:
            self._start_link(rate)
        # Each row starts from node A's costs, as a user's fresh server would: the always-load row's
        # rates, measured with every hit loaded at once, must not decide for kvtier's choice.
        self._restore_costs()
        assert self._link is not None
        options["bucket_endpoint"] = self._link.url
        if base == ALWAYS_ROW:
            return {**options, "load_policy": "always", "service_timeout_ms": ALWAYS_LOAD_TIMEOUT_MS}
        return {**options, "load_policy": "auto"}

    def _start_link(self, rate: float) -> None:
        self._stop_link()
        assert self._bucket is not None
        spec = LinkSpec(rate, self._plan["slow_link_latency_ms"])
        try:
            link = SlowLinkProcess(self._bucket.endpoint, spec, self._out_dir / "logs" / f"slowlink-{rate:g}MBps.log")
            link.start()
        except SlowLinkError as error:
            raise SlowRowsError(
                f"{error} (the bucket's endpoint is {self._bucket.endpoint}: the slow link needs the local gateway "
                "or an endpoint on 127.0.0.1)"
            ) from None
        self._link, self._rate = link, rate
        self._log(f"slow link: {spec.describe()} on {link.url} -> {self._bucket.endpoint}")

    def row_done(self, row: str) -> None:
        """After node A: keeps its costs files (each speed starts from them)."""
        if row_base(row) == PUBLISH_ROW:
            shutil.rmtree(self._snapshot, ignore_errors=True)
            self._snapshot.mkdir()
            for path in costs_dir().glob("costs-*.json"):
                shutil.copy2(path, self._snapshot / path.name)
            self._log(f"slow link: node A left costs files {sorted(p.name for p in self._snapshot.iterdir())}")

    def _restore_costs(self) -> None:
        for path in costs_dir().glob("costs-*.json"):
            path.unlink()
        for path in self._snapshot.glob("costs-*.json"):
            shutil.copy2(path, costs_dir() / path.name)

    def _stop_link(self) -> None:
        if self._link is not None:
            self._link.close()
        self._link, self._rate = None, None

    def close(self) -> None:
        self._stop_link()
        self._stack.close()
        shutil.rmtree(self._snapshot, ignore_errors=True)

    def __enter__(self) -> ObjectRows:
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
    """What an object row must show: node A published, always-load loaded from the bucket, kvtier's
    choice decided."""
    base = row_base(row)
    if base not in (PUBLISH_ROW, *OBJECT_ROWS) or not points:
        return []
    counters = [point.get("kvtier") or {} for point in points]
    if base == PUBLISH_ROW and not sum(c.get("bucket_segments_published", 0) for c in counters):
        return ["node A published no segment to the bucket: the object rows would read nothing"]
    if base == ALWAYS_ROW and not sum(c.get("bucket_hits", 0) for c in counters):
        return ["always-load loaded no block from the bucket"]
    if base == AUTO_ROW and not any(point.get("load_decisions") for point in points):
        return ["kvtier's choice counted no load decision (kvtier:load_decisions) at any point"]
    return []


def judged(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Per speed and users: kvtier's choice's throughput over the better of vLLM alone and always-load."""
    by_row = {(record["row"], point["users"]): point for record in document["rows"] for point in record["points"]}
    results = []
    for (row, users), point in by_row.items():
        if row_base(row) != AUTO_ROW:
            continue
        rate = row_rate(row)
        alone = by_row.get(("vllm", users), {}).get("request_throughput")
        always = by_row.get((f"{ALWAYS_ROW}@{rate:g}", users), {}).get("request_throughput")
        best = max((value for value in (alone, always) if value), default=None)
        value = point["request_throughput"] / best if best and point.get("request_throughput") else None
        results.append({
            "link_mb_per_s": rate, "users": users, "auto_over_best": value, "target_at_least": TARGET_OVER_BEST,
            "better": None if best is None else ("vLLM alone" if best == alone else "always-load"),
            "met": None if value is None else value >= TARGET_OVER_BEST,
        })  # fmt: skip
    return results


def osd_bytes(users: list[int], prefix_tokens: int, kv_bytes_per_token: int | None) -> int:
    """A local gateway's OSD (``bucket.osd_store``: RAM or disk): every point's users' prefixes, with room."""
    return int(sum(users) * prefix_tokens * (kv_bytes_per_token or 0) * 1.25) + (1 << 30)
