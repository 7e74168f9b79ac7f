"""The `kvtier` command line: commands listed, exit codes, and the JSON of `status` and `ls` against a
real store directory, with a real service running and after it stopped (docs/cli.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from kvtier import Service, ServiceClient
from kvtier.cli import _load_main, cli, main

SLICE_BYTES = 4096
STORED = 12
STORE_OPTIONS: dict[str, Any] = {"dram_bytes": 1 << 20, "nvme_bytes": 4 << 20, "region_bytes": 1 << 20}

STATUS_KEYS = {
    "schema",
    "paths",
    "socket",
    "service",
    "message",
    "stats",
    "lookups",
    "hit_rate",
    "tiers",
    "shared_index_age_ms",
    "writes",
    "tenants",
    "namespaces",
}
LS_KEYS = {"schema", "paths", "socket", "service", "message", "namespaces"}
NAMESPACE_KEYS = {
    "path",
    "digest",
    "directory",
    "device_file_bytes",
    "geometry",
    "error",
    "locked_by_pid",
    "open_in_service",
}
GEOMETRY_KEYS = {
    "format_version",
    "device_index",
    "device_count",
    "namespace",
    "object_bytes",
    "slot_bytes",
    "region_bytes",
    "region_count",
    "capacity_bytes",
    "store_id",
}
TIER_KEYS = {"used_bytes", "capacity_bytes", "blocks", "hits", "hit_rate"}


class RunningStore:
    def __init__(self, root: Path) -> None:
        self.path = root / "store"
        self.socket = root / "kvtier.sock"
        self.service: Any = Service.start(
            os.fspath(self.socket), os.fspath(self.path), os.fspath(root), 30_000, **STORE_OPTIONS
        )
        client = ServiceClient.connect(os.fspath(self.socket), 10_000)
        client.hello(b"test-cli|model", 1, 0, SLICE_BYTES)
        keys = [i.to_bytes(8, "little") * 4 for i in range(STORED)]
        layer = np.arange(STORED * SLICE_BYTES, dtype=np.uint8).reshape(STORED, SLICE_BYTES)
        assert all(client.store_blocks(keys, [layer], list(range(STORED))))
        # 4 DRAM hits and 1 miss
        out = np.zeros((5, SLICE_BYTES), dtype=np.uint8)
        assert client.load_blocks([*keys[:4], b"\xee" * 32], [out], list(range(5))) == [True] * 4 + [False]
        client.flush()
        self.running = True

    def stop(self) -> None:
        if self.running:
            self.service.stop()
            self.running = False


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RunningStore]:
    running = RunningStore(tmp_path)
    try:
        yield running
    finally:
        running.stop()


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args), prog_name="kvtier")


def run_json(*args: str) -> dict[str, Any]:
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def check_namespace(entry: dict[str, Any], store: RunningStore) -> None:
    assert set(entry) == NAMESPACE_KEYS
    assert entry["path"] == str(store.path.resolve())
    assert len(entry["digest"]) == 64
    assert Path(entry["directory"]).is_dir()
    assert entry["error"] is None
    geometry = entry["geometry"]
    assert set(geometry) == GEOMETRY_KEYS
    assert geometry["namespace"] == entry["digest"]
    assert geometry["format_version"] == 1
    assert geometry["object_bytes"] == SLICE_BYTES
    assert geometry["slot_bytes"] == 4096 + SLICE_BYTES
    assert geometry["region_bytes"] == STORE_OPTIONS["region_bytes"]
    assert geometry["region_count"] >= 2
    assert (geometry["device_index"], geometry["device_count"]) == (0, 1)
    assert len(geometry["store_id"]) == 16
    assert entry["device_file_bytes"] == 4096 + geometry["region_count"] * geometry["region_bytes"]


def test_help_lists_every_command() -> None:
    top = invoke("--help")
    assert top.exit_code == 0
    for command in ("status", "ls", "serve", "demo", "bench", "inspect", "verify", "trim", "top"):
        assert f"  {command} " in top.output
    benches = invoke("bench", "--help")
    assert benches.exit_code == 0
    for command in ("io", "ttft", "lookup", "layout"):
        assert f"  {command} " in benches.output


def test_unknown_command_and_usage_errors_exit_2() -> None:
    assert main(["no-such-command"]) == 2
    assert main(["bench", "no-such-bench"]) == 2
    assert main([]) == 2
    assert main(["status"]) == 2  # PATH missing
    assert main(["--help"]) == 0
    unknown = invoke("bench", "lookp")
    assert unknown.exit_code == 2
    assert (
        "unknown command 'lookp'; choose one of: admission, blocks, faults, gpu, io, layout, lookup, reads-first, "
        "serve, serve-summary, tenants, ttft" in unknown.stderr
    )
    assert "Did you mean 'lookup'?" in unknown.stderr


def test_status_with_a_running_service(store: RunningStore) -> None:
    report = run_json("status", str(store.path), "--socket", str(store.socket))
    assert set(report) == STATUS_KEYS
    assert report["schema"] == "kvtier.status/1"
    assert report["paths"] == [str(store.path.resolve())]
    assert report["socket"] == str(store.socket)
    assert report["service"] == {"running": True, "pid": None}  # in-process: no pid file
    assert report["message"] is None
    stats = report["stats"]
    assert stats["puts"] == STORED
    assert stats["service_namespaces"] == 1
    assert report["lookups"] == 5
    assert report["hit_rate"] == pytest.approx(0.8)
    assert set(report["tiers"]) == {"dram", "nvme", "shared", "bucket"}
    for tier in report["tiers"].values():
        assert set(tier) == TIER_KEYS
    dram = report["tiers"]["dram"]
    assert (dram["blocks"], dram["hits"], dram["hit_rate"]) == (STORED, 4, pytest.approx(0.8))
    assert dram["capacity_bytes"] > 0
    assert report["tiers"]["nvme"]["blocks"] == STORED  # flushed
    assert report["tiers"]["shared"]["hits"] == 0
    assert report["tenants"] is None, "the pool is not split by tenant"
    [entry] = report["namespaces"]
    check_namespace(entry, store)
    assert entry["locked_by_pid"] == os.getpid()
    assert entry["open_in_service"] is True


def test_status_shows_each_tiers_write_budget_once_for_the_hosts_models(tmp_path: Path) -> None:
    """A remote tier's write budget was shown as "unbounded" whatever was set; and a host service's
    models take from one budget per tier, which status counts once, not once per model."""
    socket, path = tmp_path / "kvtier.sock", tmp_path / "store"
    budgets = {"write_budget_nvme_bytes_per_day": 2 << 30, "write_budget_shared_bytes_per_day": 1 << 30}
    options = {**STORE_OPTIONS, "shared_root": os.fspath(tmp_path / "shared"), **budgets}
    service = Service.start(os.fspath(socket), os.fspath(path), os.fspath(tmp_path), 30_000, **options)
    try:
        for model in (b"test-cli|one", b"test-cli|two"):
            ServiceClient.connect(os.fspath(socket), 10_000).hello(model, 1, 0, SLICE_BYTES)
        report = run_json("status", str(path), "--socket", str(socket))
        assert report["stats"]["service_namespaces"] == 2
        tiers = report["writes"]["tiers"]
        per_day = {tier: tiers[tier]["budget_bytes_per_day"] for tier in ("nvme", "shared", "bucket")}
        assert per_day == {"nvme": 2 << 30, "shared": 1 << 30, "bucket": None}, per_day
        assert tiers["shared"]["budget_left_bytes"] == 1 << 30
        table = invoke("status", str(path), "--socket", str(socket), "--plain")
        writes = table.stdout[table.stdout.index("writes below DRAM") :]
        shared_row = next(line for line in writes.splitlines() if line.strip().startswith("shared"))
        assert "/day" in shared_row and "unbounded" not in shared_row, table.stdout
    finally:
        service.stop()


def test_ls_with_a_running_service(store: RunningStore) -> None:
    report = run_json("ls", str(store.path), "--socket", str(store.socket))
    assert set(report) == LS_KEYS
    assert report["schema"] == "kvtier.ls/1"
    assert report["service"]["running"] is True
    [entry] = report["namespaces"]
    check_namespace(entry, store)
    assert entry["open_in_service"] is True


def test_ls_blocks_lists_every_block_per_tier(store: RunningStore) -> None:
    """`kvtier ls --blocks`: the keys the service holds per tier, as the engines' KV events name them."""
    report = run_json("ls", str(store.path), "--socket", str(store.socket), "--blocks")
    [entry] = report["namespaces"]
    assert set(entry) == NAMESPACE_KEYS | {"blocks", "blocks_truncated"}
    assert entry["blocks_truncated"] is False
    assert set(entry["blocks"]) == {"dram", "nvme", "shared"}
    stored = {(i.to_bytes(8, "little") * 4).hex() for i in range(STORED)}
    assert set(entry["blocks"]["dram"]) | set(entry["blocks"]["nvme"]) == stored
    assert entry["blocks"]["shared"] == []
    table = invoke("ls", str(store.path), "--socket", str(store.socket), "--blocks", "--plain")
    assert table.exit_code == 0, table.output
    assert "blocks per tier" in table.stdout and entry["digest"][:16] in table.stdout
    store.stop()
    refused = invoke("ls", str(store.path), "--socket", str(store.socket), "--blocks")
    assert refused.exit_code == 1 and "needs the running service" in refused.output


def test_status_and_ls_of_the_closed_store(store: RunningStore) -> None:
    store.stop()
    report = run_json("status", str(store.path), "--socket", str(store.socket))
    assert set(report) == STATUS_KEYS
    assert report["service"] == {"running": False, "pid": None}
    assert "no service running" in report["message"]
    assert report["stats"] is None and report["tiers"] is None and report["lookups"] is None
    [entry] = report["namespaces"]
    check_namespace(entry, store)
    assert entry["locked_by_pid"] is None
    assert entry["open_in_service"] is None
    listing = run_json("ls", str(store.path), "--socket", str(store.socket))
    assert set(listing) == LS_KEYS
    assert listing["service"]["running"] is False
    assert listing["namespaces"] == report["namespaces"]
    for command in ("status", "ls"):
        for flags in ([], ["--plain"]):
            human = invoke(command, str(store.path), "--socket", str(store.socket), *flags)
            assert human.exit_code == 0, human.output
            assert "none running" in human.stdout
            assert entry["digest"][:16] in human.stdout


def test_tables_with_a_running_service(store: RunningStore) -> None:
    for flags in ([], ["--plain"]):
        human = invoke("status", str(store.path), "--socket", str(store.socket), *flags)
        assert human.exit_code == 0, human.output
        assert "DRAM" in human.stdout and "80.0%" in human.stdout


def test_not_a_store_exits_1_with_the_fix(tmp_path: Path) -> None:
    for command in ("status", "ls"):
        missing = invoke(command, str(tmp_path / "missing"), "--socket", str(tmp_path / "s.sock"))
        assert missing.exit_code == 1
        assert "does not exist" in missing.stderr and "`path`" in missing.stderr
        empty = invoke(command, str(tmp_path), "--socket", str(tmp_path / "s.sock"), "--json")
        assert empty.exit_code == 1
        assert empty.stdout == ""
        assert "not a kvtier store" in empty.stderr and "--socket" in empty.stderr


def test_a_damaged_superblock_is_reported(store: RunningStore) -> None:
    store.stop()
    [directory] = [d for d in store.path.iterdir() if d.is_dir()]
    with open(directory / "nvme.kvt", "r+b") as device:
        device.write(b"NOTKVTR\0")
    report = run_json("ls", str(store.path), "--socket", str(store.socket))
    [entry] = report["namespaces"]
    assert entry["geometry"] is None
    assert "not a kvtier device file" in entry["error"]


def test_a_dram_only_store_has_no_device_file(tmp_path: Path) -> None:
    socket = tmp_path / "kvtier.sock"
    service = Service.start(
        os.fspath(socket), os.fspath(tmp_path / "store"), os.fspath(tmp_path), 30_000, dram_bytes=1 << 20, nvme_bytes=0
    )
    try:
        client = ServiceClient.connect(os.fspath(socket), 10_000)
        client.hello(b"test-cli|dram-only", 1, 0, SLICE_BYTES)
        report = run_json("ls", str(tmp_path / "store"), "--socket", str(socket))
    finally:
        service.stop()
    [entry] = report["namespaces"]
    assert entry["device_file_bytes"] is None and entry["geometry"] is None and entry["error"] is None
    assert entry["open_in_service"] is True


def test_a_missing_module_names_the_fix() -> None:
    with pytest.raises(SystemExit, match=r"kvtier bench nope: not available .*pip install -e \."):
        _load_main("kvtier.bench.nope", ("bench", "nope"))


def test_bench_lookup_runs_through_the_cli() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvtier", "bench", "lookup", "--calls", "50", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["calls_per_batch_size"] == 50
    assert set(figures["batches"]) == {"1", "32", "512"}


def test_sigterm_stops_a_benchmark_after_its_cleanup(tmp_path: Path) -> None:
    """SIGTERM (an operator's `kill`, a CI runner's timeout) to a running benchmark: it stops what it
    started, as after Ctrl-C, and exits 143. Python's default ended it at once: `bench lookup` left its
    store directory, and `bench faults` or `bench serve` left their `vllm serve` running."""
    runs = tmp_path / "runs"
    runs.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtier", "bench", "lookup", "--calls", "100000000", "--json"],
        env={**os.environ, "TMPDIR": str(runs)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not list(runs.glob("*/kvtier.sock")) and time.monotonic() < deadline:
            assert process.poll() is None, process.communicate()
            time.sleep(0.05)
        assert list(runs.glob("*/kvtier.sock")), "bench lookup did not start its service within 60 s"
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 143, stderr
    assert "stopped by SIGTERM" in stderr
    assert list(runs.iterdir()) == [], "its service's directory was left behind"


def test_sigterm_inside_a_native_call_still_exits_143() -> None:
    """CI caught SIGTERM arriving while `bench lookup` was inside `Service.start`: the handler's
    exception was raised in a logging callback from the core and came back as the call's
    `SystemError`, and the benchmark exited 1 with a traceback instead of 143."""
    from kvtier.cli import _by_sigterm, _Terminated

    try:
        try:
            raise _Terminated()
        except _Terminated as terminated:
            raise SystemError("<built-in method start> returned a result with an exception set") from terminated
    except SystemError as error:
        assert _by_sigterm(error)
    assert _by_sigterm(_Terminated())
    assert not _by_sigterm(SystemError("a real one"))
    assert not _by_sigterm(KeyboardInterrupt())
