"""An S3 bucket for the object-tier benchmarks: a given one, or Ceph's RADOS gateway on 127.0.0.1.

``open_bucket`` yields a ``Bucket``: the ``bucket_url`` / ``bucket_endpoint`` options of a fresh
prefix, with the credentials in this process's environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``: the object tier reads them from there, and child
processes such as an engine's host service inherit them; they are never options, never in the
results). Without a URL it brings up ``scripts/distfs/radosgw.sh`` (root, Debian's Ceph packages)
in a state directory of its own, creates the bucket, and tears everything down at the end, also
when the benchmark fails. Its OSD holds the run's objects in RAM (memstore) when that fits beside
the engines (``osd_store``), else on a sparse file in the state directory (bluestore): a 32-user
run's memstore OSD took 17 GB and was OOM-killed on a 24 GiB machine. With a URL it uses that
bucket and the credentials already in the environment, and deletes the run's prefix at the end.

Requests made here (bucket creation, listing, deleting a prefix) are signed by curl's
``--aws-sigv4``: the test environment has no S3 SDK, and these few calls do not need one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "distfs" / "radosgw.sh"
BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph-authtool", "monmaptool", "curl")
DEFAULT_BUCKET = "kvtier-bench"
DEFAULT_STATE_DIR = "/tmp/kvtier-bench-radosgw"
S3_NAMESPACE = {"s3": "http://s3.amazonaws.com/doc/2006-03-01/"}
BRING_UP_TIMEOUT_S = 300
FIRST_OBJECT_TIMEOUT_S = 60  # the gateway creates its data pool at the first object written
REQUEST_TIMEOUT_S = 60
CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION")
# A memstore OSD took about twice the bytes it held (17 GB for 8 GiB of objects); it may take this
# share of the memory available at bring-up, the rest is the engines'.
MEMSTORE_SHARE_OF_AVAILABLE = 0.5
MEMSTORE_BYTES_PER_BYTE = 2


def add_arguments(parser: Any, use: str, endpoint_note: str = "default AWS") -> None:
    """``--bucket-url`` and ``--bucket-endpoint`` of a benchmark's object rows (``use``: which of its
    rows or options take the bucket), as ``open_bucket`` reads them."""
    parser.add_argument(
        "--bucket-url",
        help=f"s3://bucket[/prefix] for {use}, credentials from the environment (AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_REGION); the run's objects go under a fresh prefix, deleted afterwards "
        "(default: Ceph's RADOS gateway on 127.0.0.1, brought up and torn down for the run; root)",
    )
    parser.add_argument("--bucket-endpoint", help=f"S3 endpoint of --bucket-url (http(s)://host:port; {endpoint_note})")


class BucketUnavailable(RuntimeError):
    """No bucket to benchmark against; the message says why and how to get one."""


@dataclass
class Bucket:
    """A prefix in a bucket, and how to reach it."""

    name: str
    prefix: str
    endpoint: str
    region: str
    self_hosted: bool  # a gateway this process brought up (and tears down)
    state_dir: str | None = None

    def url(self, sub_prefix: str = "") -> str:
        """``bucket_url`` of the run's prefix, or of ``sub_prefix`` under it."""
        return f"s3://{self.name}/{self.prefix}" + (f"/{sub_prefix}" if sub_prefix else "")

    def options(self, sub_prefix: str = "") -> dict:
        return {"bucket_url": self.url(sub_prefix), "bucket_endpoint": self.endpoint}

    def request(self, method: str, path: str, body: bytes = b"", query: str = "") -> tuple[int, bytes]:
        """One signed request (curl --aws-sigv4) to ``<endpoint>/<path>``; returns (HTTP status, body)."""
        url = f"{self.endpoint}/{path}" + (f"?{query}" if query else "")
        command = ["curl", "-s", "-X", method, "--aws-sigv4", f"aws:amz:{self.region}:s3"]
        command += ["--user", f"{os.environ['AWS_ACCESS_KEY_ID']}:{os.environ['AWS_SECRET_ACCESS_KEY']}"]
        command += ["-o", "-", "-w", "\n%{http_code}"]
        command += ["-H", f"x-amz-content-sha256: {hashlib.sha256(body).hexdigest()}"]
        if os.environ.get("AWS_SESSION_TOKEN"):
            command += ["-H", f"x-amz-security-token: {os.environ['AWS_SESSION_TOKEN']}"]
        if body or method == "PUT":
            command += ["--data-binary", "@-"]
        done = subprocess.run([*command, url], input=body, capture_output=True, timeout=REQUEST_TIMEOUT_S)
        out, _, code = done.stdout.rpartition(b"\n")
        return int(code or 0), out

    def keys(self, sub_prefix: str = "") -> list[tuple[str, int]]:
        """Every (key, size) under the run's prefix (or ``sub_prefix`` under it), all pages."""
        # The trailing slash: another run's prefix may start with this one's name.
        prefix = self.prefix + (f"/{sub_prefix}" if sub_prefix else "") + "/"
        found: list[tuple[str, int]] = []
        token = None
        while True:
            # Parameters in sorted order, encoded: curl 7.88 signs the query as given, the server
            # signs its canonical (sorted, encoded) form, and they must agree.
            query = f"continuation-token={quote(token, safe='')}&" if token else ""
            query += f"list-type=2&prefix={quote(prefix, safe='')}"
            status, body = self.request("GET", self.name, query=query)
            if status != 200:
                raise BucketUnavailable(f"listing s3://{self.name}/{prefix}: HTTP {status} {body[:200]!r}")
            root = ET.fromstring(body)
            for entry in root.findall("s3:Contents", S3_NAMESPACE):
                size = int(entry.findtext("s3:Size", namespaces=S3_NAMESPACE) or 0)
                found.append((entry.findtext("s3:Key", namespaces=S3_NAMESPACE) or "", size))
            token = root.findtext("s3:NextContinuationToken", namespaces=S3_NAMESPACE)
            if not token:
                return found

    def delete_prefix(self, sub_prefix: str = "") -> int:
        """Deletes every object under the prefix; returns how many. A self-hosted gateway also runs
        its garbage collection at once: a deleted object's data otherwise stays in the memstore OSD
        (RAM) for hours (rgw_gc_obj_min_wait), and the next case's PUTs would fill it."""
        keys = self.keys(sub_prefix)
        for key, _ in keys:
            self.request("DELETE", f"{self.name}/{key}")
        if self.self_hosted and keys:
            conf = f"{self.state_dir}/ceph.conf"
            subprocess.run(
                ["radosgw-admin", "-c", conf, "gc", "process", "--include-all"],
                capture_output=True,
                timeout=REQUEST_TIMEOUT_S,
            )
        return len(keys)


def missing_reason() -> str | None:
    """Why this machine cannot bring up the local gateway (with the fix), or None."""
    if not SCRIPT.exists():
        return f"{SCRIPT} is not here (an installed kvtier without its repository): give --bucket-url"
    if os.geteuid() != 0:
        return "bringing up the local RADOS gateway needs root (the Ceph daemons); run as root or give --bucket-url"
    absent = [binary for binary in BINARIES if shutil.which(binary) is None]
    if absent:
        return (
            f"the local RADOS gateway needs {' '.join(absent)}: apt-get install ceph-mon ceph-osd radosgw "
            "ceph-common curl (scripts/setup.sh does as root), or give --bucket-url"
        )
    return None


def available_memory_bytes() -> int:
    """``MemAvailable`` of /proc/meminfo (0 where there is none)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def osd_store(osd_bytes: int, state_dir: str, available_bytes: int | None = None) -> str:
    """Where the local gateway's OSD keeps ``osd_bytes``: ``memstore`` (RAM) while it takes at most
    ``MEMSTORE_SHARE_OF_AVAILABLE`` of the memory available, else ``bluestore`` on a sparse file
    under ``state_dir``, which needs that much free disk."""
    available = available_memory_bytes() if available_bytes is None else available_bytes
    if osd_bytes * MEMSTORE_BYTES_PER_BYTE <= available * MEMSTORE_SHARE_OF_AVAILABLE:
        return "memstore"
    parent = Path(state_dir).parent
    free = shutil.disk_usage(parent).free if parent.exists() else 0
    if free < osd_bytes:
        raise BucketUnavailable(
            f"the local gateway's OSD needs {osd_bytes >> 20} MiB: more than fits in memory beside the engines "
            f"({available >> 20} MiB available) and than {parent} has free ({free >> 20} MiB); fewer users, "
            "a disk with room, or --bucket-url"
        )
    return "bluestore"


def _run_script(action: str, state_dir: str, osd_bytes: int, store: str = "memstore") -> subprocess.CompletedProcess:
    environment = {**os.environ, "KVTIER_CEPH_OSD_BYTES": str(osd_bytes), "KVTIER_CEPH_OSD_STORE": store}
    return subprocess.run(
        ["bash", str(SCRIPT), action, state_dir],
        capture_output=True,
        text=True,
        timeout=BRING_UP_TIMEOUT_S,
        env=environment,
    )


def _bring_up(state_dir: str, osd_bytes: int, prefix: str, log) -> Bucket:
    reason = missing_reason()
    if reason:
        raise BucketUnavailable(reason)
    started = time.monotonic()
    store = osd_store(osd_bytes, state_dir)
    done = _run_script("up", state_dir, osd_bytes, store)
    if done.returncode != 0:
        _run_script("down", state_dir, osd_bytes)
        raise BucketUnavailable(f"radosgw.sh up failed (rc {done.returncode}): {done.stderr.strip()[-2000:]}")
    info = dict(line.split("=", 1) for line in done.stdout.split() if "=" in line)
    os.environ["AWS_ACCESS_KEY_ID"] = info["ACCESS_KEY"]
    os.environ["AWS_SECRET_ACCESS_KEY"] = info["SECRET_KEY"]
    os.environ["AWS_REGION"] = "us-east-1"
    os.environ.pop("AWS_SESSION_TOKEN", None)
    bucket = Bucket(DEFAULT_BUCKET, prefix, info["ENDPOINT"], "us-east-1", True, state_dir)
    status, body = bucket.request("PUT", bucket.name)
    if status != 200:
        raise BucketUnavailable(f"creating bucket {bucket.name}: HTTP {status} {body[:200]!r}")
    deadline = time.monotonic() + FIRST_OBJECT_TIMEOUT_S
    while bucket.request("PUT", f"{bucket.name}/{prefix}-warm-up", b"x")[0] != 200:
        if time.monotonic() > deadline:
            raise BucketUnavailable(f"the gateway did not take a first object within {FIRST_OBJECT_TIMEOUT_S} s")
        time.sleep(0.5)
    bucket.request("DELETE", f"{bucket.name}/{prefix}-warm-up")
    elapsed_s = time.monotonic() - started
    where = "in RAM" if store == "memstore" else f"on a file under {state_dir}"
    log(f"radosgw: up in {elapsed_s:.1f} s at {bucket.endpoint} ({store} OSD of {osd_bytes >> 20} MiB, {where})")
    return bucket


def _given_bucket(url: str, endpoint: str | None, prefix: str) -> Bucket:
    if not url.startswith("s3://"):
        raise BucketUnavailable(f"--bucket-url {url!r} is not s3://bucket[/prefix]")
    name, _, base = url.removeprefix("s3://").partition("/")
    missing = [variable for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if not os.environ.get(variable)]
    if missing:
        raise BucketUnavailable(f"--bucket-url needs the credentials in the environment: {', '.join(missing)}")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL") or f"https://s3.{region}.amazonaws.com"
    full_prefix = f"{base.strip('/')}/{prefix}" if base.strip("/") else prefix
    return Bucket(name, full_prefix, endpoint.rstrip("/"), region, False)


@contextlib.contextmanager
def open_bucket(
    url: str | None,
    endpoint: str | None,
    osd_bytes: int,
    log,
    state_dir: str = DEFAULT_STATE_DIR,
) -> Iterator[Bucket]:
    """The bucket of one benchmark run (see the module's docstring); cleaned up on the way out."""
    prefix = f"kvtier-bench-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    if url:
        bucket = _given_bucket(url, endpoint, prefix)
        try:
            yield bucket
        finally:
            with contextlib.suppress(Exception):
                bucket.delete_prefix()
        return
    saved = {variable: os.environ.get(variable) for variable in CREDENTIAL_VARIABLES}
    try:
        yield _bring_up(state_dir, osd_bytes, prefix, log)
    finally:
        for variable, value in saved.items():  # the caller's own credentials, if any, come back
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value
        done = _run_script("down", state_dir, osd_bytes)
        log(f"radosgw: torn down ({state_dir} removed)" if done.returncode == 0 else f"radosgw down: {done.stderr}")
