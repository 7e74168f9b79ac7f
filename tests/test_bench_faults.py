"""``kvtier bench faults`` (issue 36, item 5): faults injected into kvtier's host service under load.

Fast tests (no engine): the options and the plan (the load spread over the fault's timeline, greedy
sampling, the rows), the fault on a stand-in process (stopped and continued), the judging of made-up
results (a failed request or a different output is a problem), the table.
The remote tiers' rows (``bucket-stop``, ``bucket-kill``, ``fuse-stop``) without an engine: their plan and
store options, the fault on stand-in processes (stopped and continued; killed and started again once),
one gateway for every bucket row, the tier's reads during the fault and the note when there were none.
The slow tests (``full``: not in CI's time) run ``kvtier bench faults --small`` end to end: vLLM alone,
then kvtier with its service stopped for 5 s mid-run; the three remote tiers' rows (root, Ceph's
radosgw and FUSE, else skipped); and the rest of the matrix: the service killed, the NVMe tier's reads
failing, its disk hung and full (root and FUSE, else skipped).

Run: ``.venv/bin/python -m pytest tests/test_bench_faults.py -v`` (``KVTIER_FULL_TESTS=1`` and ``-m slow``
for the run).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.bench import faults, faults_tiers


def plan_of(*argv: str) -> dict:
    return faults.make_plan(faults.build_parser().parse_args(list(argv)))


def test_plan_small_and_full():
    small = plan_of("--small")
    assert (small["preset"], small["users"], small["requests_per_user"]) == ("tiny", 4, 2)
    assert small["rows"] == ["vllm", "service-stop", "service-kill"]
    assert (small["fault_s"], small["fault_after_s"], small["after_s"]) == (20.0, 6.0, 9.0)
    # 8 requests spread over 6 + 20 + 9 seconds, nearly evenly, greedy.
    assert small["request_rate"] == pytest.approx(8 / 35)
    assert small["burstiness"] == faults.BURSTINESS
    assert small["bench_args"][:2] == ["--temperature", "0"]
    assert small["max_model_len"] == 512 + 64 + 4 + 128
    full = plan_of("--faults", "service-kill", "--fault-s", "5", "--request-rate", "2")
    assert (full["preset"], full["users"], full["prefix_len"]) == ("kv8b", 8, 2048)
    assert full["rows"] == ["vllm", "service-kill"]
    assert full["request_rate"] == 2
    assert (full["fault_after_s"], full["after_s"]) == (3.0, 12.0)
    chosen = plan_of("--small", "--fault-s", "5", "--fault-after-s", "3", "--after-s", "12")
    assert (chosen["fault_after_s"], chosen["after_s"], chosen["request_rate"]) == (3.0, 12.0, pytest.approx(0.4))


def test_small_fault_covers_the_repeat_kvtier_serves():
    """--small --fault-s 5: the load's rate stays 0.40 req/s (6 + 5 + 9 s), and the fault (6 s to 11 s)
    covers the fifth request (about 4 gaps in: 10 s), the one repeat whose prefix vLLM's own 12 blocks no
    longer hold, so kvtier serves it from the faulted tier; from 3 s the fault ended before it."""
    plan = plan_of("--small", "--fault-s", "5")
    assert plan["request_rate"] == pytest.approx(0.4)
    fifth = 4 / plan["request_rate"]
    assert plan["fault_after_s"] < fifth < plan["fault_after_s"] + plan["fault_s"]
    assert not 3.0 < fifth < 3.0 + plan["fault_s"]


@pytest.mark.parametrize(
    "argv",
    [["--faults", "disk-melt"], ["--faults", ","], ["--fault-s", "0"], ["--users", "0"], ["--request-rate", "0"]],
)
def test_bad_arguments(argv):
    with pytest.raises(faults.FaultError):
        plan_of(*argv)


def test_bench_command_is_bench_serves_with_the_rate(tmp_path):
    from kvtier.bench import serve

    plan = plan_of("--small", "--fault-s", "5")
    command = serve.bench_command(plan, "http://x", "tiny", tmp_path, plan["users"], 0, tmp_path, "r.json")
    assert command[command.index("--request-rate") + 1] == f"{8 / 20:g}"
    assert command[command.index("--max-concurrency") + 1] == "4"
    assert command[command.index("--temperature") + 1] == "0"
    assert "--save-detailed" in command and "--ignore-eos" in command


def test_main_refuses_unknown_faults(capsys):
    assert faults.main(["--faults", "nope"]) == 2
    assert "unknown faults" in capsys.readouterr().err


def test_service_stop_fault_stops_and_continues_the_process(tmp_path, monkeypatch):
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        monkeypatch.setattr("kvtier.service.running_service", lambda socket: (process.pid, 0))
        fault = faults.Fault("service-stop", tmp_path / "socket")
        fault.start()
        time.sleep(0.2)
        assert Path(f"/proc/{process.pid}/stat").read_text().split(")")[1].split()[0] == "T"
        fault.end()
        time.sleep(0.2)
        assert Path(f"/proc/{process.pid}/stat").read_text().split(")")[1].split()[0] != "T"
        fault.release()  # nothing left to undo
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()


def test_read_error_fault_holds_its_flag_while_it_lasts(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtier.service.running_service", lambda socket: (4242, 0))
    flag = tmp_path / "fail-reads"
    fault = faults.Fault("nvme-read-errors", tmp_path / "socket", flag)
    fault.start()
    assert flag.exists() and fault.pid == 4242
    fault.end()
    assert not flag.exists()
    with pytest.raises(faults.FaultError, match="flag"):
        faults.Fault("nvme-read-errors", tmp_path / "socket").start()


def test_read_error_row_has_a_few_blocks_of_dram():
    plan = plan_of("--small", "--faults", "nvme-read-errors")
    assert plan["rows"] == ["vllm", "nvme-read-errors"]
    assert faults.row_options(plan, "vllm") == (plan, {})
    row_plan, options = faults.row_options(plan, "nvme-read-errors")
    assert row_plan["dram_gib"] == 0 and options == {"staging_slots": faults.READ_ERROR_DRAM_SLOTS}
    assert plan["dram_gib"] == 0.25


def _can_make_disks() -> str | None:
    import shutil as sh

    if os.geteuid() != 0:
        return "needs root (mount)"
    return None if sh.which("mkfs.ext4") and sh.which("losetup") else "needs mkfs.ext4 and losetup"


def test_a_full_disk_leaves_a_preallocated_file_writable(tmp_path):
    """The premise of the nvme-full row, on a real filesystem: once the filler takes every free block
    a new file gets ENOSPC, while a file preallocated before (as kvtier's device file is) still takes
    writes; drained, the room is back; closed, nothing is left mounted."""
    from kvtier.bench import faults_disk

    reason = _can_make_disks()
    if reason:
        pytest.skip(reason)
    disk = faults_disk.SmallDisk(tmp_path, tmp_path / "store", 64 << 20)
    try:
        disk.start()
        device = tmp_path / "store" / "nvme.kvt"
        fd = os.open(device, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, 16 << 20)
            disk.fill()
            assert disk.free_after_fill is not None and disk.free_after_fill < (1 << 20), disk.free_after_fill
            with pytest.raises(OSError) as full:
                (tmp_path / "store" / "new").write_bytes(b"x" * (1 << 20))
            assert full.value.errno == errno.ENOSPC
            assert os.pwrite(fd, b"k" * (1 << 20), 8 << 20) == 1 << 20
            os.fsync(fd)
        finally:
            os.close(fd)
        disk.drain()
        assert disk.free_bytes() > (8 << 20)
    finally:
        disk.close()
    assert not os.path.ismount(tmp_path / "store") and not disk.image.exists()


def test_disk_full_fault_fills_and_drains_its_disk(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtier.service.running_service", lambda socket: (4242, 0))
    calls: list[str] = []

    class Disk:
        def fill(self) -> None:
            calls.append("fill")

        def drain(self) -> None:
            calls.append("drain")

    fault = faults.Fault("nvme-full", tmp_path / "socket", disk=Disk())
    fault.start()
    fault.end()
    assert calls == ["fill", "drain"]
    with pytest.raises(faults.FaultError, match="nvme-full"):
        faults.Fault("nvme-full", tmp_path / "socket").start()
    plan = plan_of("--small", "--faults", "nvme-full")
    row_plan, options = faults.row_options(plan, "nvme-full")
    assert row_plan["dram_gib"] == 0 and options == {"staging_slots": faults.READ_ERROR_DRAM_SLOTS}
    counters = {"bytes_written_nvme": 3 << 20, "io_errors": 0}
    record = {"row": "nvme-full", "fault": {"tier_reads": 2, "tier_counters": counters}}
    assert faults.tier_reads_cell(record) == "2; 3 MiB written, 0 I/O errors"


def test_a_fault_without_a_service_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtier.service.running_service", lambda socket: None)
    with pytest.raises(faults.FaultError, match="no kvtier service"):
        faults.Fault("service-kill", tmp_path / "socket").start()


def test_engine_notes_keep_kvtier_service_lines(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "(APIServer pid=1) INFO kvtier: nothing\n"
        "(EngineCore pid=2) ERROR 12-03 21:02:03 [connection.py:217] kvtier: host service call locate_many "
        "failed (...); serving misses (recompute) until it answers again\n"
        "(EngineCore pid=2) WARNING 12-03 21:02:10 [connection.py:154] kvtier: reattached to the host service; "
        "serving its hits again\n"
        "kvtier: reattached to the host service; serving its hits again\n"  # without vLLM's handler
    )
    assert [note[:60] for note in faults.engine_notes(log)] == [
        "(EngineCore pid=2) ERROR 12-03 21:02:03 [connection.py:217] ",
        "(EngineCore pid=2) WARNING 12-03 21:02:10 [connection.py:154",
        "kvtier: reattached to the host service; serving its hits aga",
    ]
    assert faults.engine_notes(tmp_path / "missing.log") == []


def row(name: str, outputs: list[str], failed: int = 0, errors: list[str] | None = None) -> dict:
    return {
        "row": name, "problems": [], "completed": len(outputs) - failed, "failed": failed, "outputs": outputs,
        "request_errors": errors or [""] * len(outputs), "request_throughput": 1.0, "output_throughput": 4.0,
        "ttft_ms": {"p50": 10.0, "p99": 20.0}, "fault": {"hits_again_s": 1.25, "pid": 7},
        "kvtier": {"dram_hits": 3, "nvme_hits": 1},
    }  # fmt: skip


def test_judging_same_outputs_pass():
    rows = [row("vllm", ["a", "b", "c"]), row("service-stop", ["a", "b", "c"])]
    assert faults.judge(rows) == []
    assert rows[1]["wrong_outputs"] == 0


def test_judging_a_different_output_fails():
    rows = [row("vllm", ["a", "b", "c"]), row("service-stop", ["a", "x", "c"]), row("service-kill", ["a", "b"])]
    problems = faults.judge(rows)
    assert problems == [
        "service-stop: 1 outputs differ from vLLM alone's",
        "service-kill: 1 outputs differ from vLLM alone's",
    ]


def test_outputs_the_runs_of_vllm_alone_disagree_on_are_unstable_not_wrong():
    """--reference-runs 2: a request whose output vLLM alone does not repeat (near-tied greedy tokens)
    is left out of every row's wrong outputs; one both runs agree on still counts."""
    assert plan_of("--small", "--reference-runs", "3")["rows"] == [
        "vllm",
        "vllm-2",
        "vllm-3",
        "service-stop",
        "service-kill",
    ]
    with pytest.raises(faults.FaultError, match="reference-runs"):
        plan_of("--reference-runs", "0")
    rows = [row("vllm", ["a", "b", "c"]), row("vllm-2", ["a", "B", "c"]), row("service-stop", ["a", "x", "y"])]
    assert faults.unstable_requests(rows) == {1}
    assert faults.judge(rows) == ["service-stop: 1 outputs differ from vLLM alone's"]
    assert [r["wrong_outputs"] for r in rows] == [0, 0, 1]
    assert faults.table_rows(rows)[1][0] == "vLLM alone, run 2" and faults.table_rows(rows)[1][8] == "-"
    assert faults.is_reference("vllm-2") and not faults.is_reference("vllm-stop")
    assert faults.unstable_requests(rows[:1] + rows[2:]) == set(), "one run of vLLM alone: nothing is unstable"


def test_judging_a_failed_request_fails_once():
    rows = [row("vllm", ["a", "b"]), row("service-kill", ["a", ""], failed=1, errors=["", "connection reset"])]
    assert faults.judge(rows) == ["service-kill: 1 requests failed"]
    assert rows[1]["wrong_outputs"] == 0


def test_judging_a_fault_after_the_load_fails():
    rows = [row("vllm", ["a"]), row("service-stop", ["a"])]
    rows[1]["fault"] = {"note": "the load ended before the fault started", "hits_again_s": None}
    assert faults.judge(rows) == [
        "service-stop: the fault was not injected under load (the load ended before the fault started)"
    ]


def test_judging_a_row_that_did_not_run_fails():
    rows = [row("vllm", ["a"]), {"row": "service-stop", "problems": ["BenchError: vllm bench serve failed"]}]
    assert faults.judge(rows) == ["service-stop: BenchError: vllm bench serve failed"]
    assert faults.judge([row("vllm", ["a"]), {"row": "service-kill", "problems": []}]) == ["service-kill: not measured"]


def test_table():
    rows = [row("vllm", ["a"]), row("service-stop", ["a"])]
    rows[0].pop("kvtier"), rows[0].pop("fault")
    rows[1]["fault"] = {"hits_again_s": None}
    counts = dict.fromkeys(("outages", "given_up_stores", "skipped_loads", "skipped_store_blocks"), 0)
    rows[1]["engine_fallbacks"] = {**counts, "failed_calls": 7, "given_up_loads": 2, "skipped_store_blocks": 5}
    faults.judge(rows)
    lines = faults.table_rows(rows)
    assert lines[0][:4] == ["vLLM alone", "1", "0", "0"] and lines[0][8:] == ["-", "-", "-", "-", "-", "-", "-"]
    assert lines[1][0] == "kvtier, service-stop"
    assert lines[1][8:] == ["-", "not during the run", "3", "1", "0", "-", "7 / 2 / 5"]
    assert len(lines[1]) == len(faults.TABLE_HEADER)
    rows[1]["engine_fallbacks"]["stepped_aside_calls"] = 600
    assert faults.table_rows(rows)[1][-1] == "7 (+600 unsent) / 2 / 5"
    rows[1]["fault"] = {"hits_again_s": 57.87, "reattached_s": 9.31}  # a kill: the engine's new service
    assert faults.table_rows(rows)[1][9] == "57.9 (reattached 9.3)"


def test_recheck_judges_a_finished_run_again(tmp_path, capsys):
    """``--recheck DIR`` judges a finished run's outputs again and rewrites its table; with no output
    that differs it needs no server (the near-tie check has nothing to do)."""
    rows = [row("vllm", ["a", "b"]), row("service-stop", ["a", "b"])]
    document = {"benchmark": "kvtier bench faults", "settings": plan_of("--small"), "rows": rows, "problems": ["old"]}
    (tmp_path / "results.json").write_text(json.dumps(document))
    assert faults.main(["--recheck", str(tmp_path)]) == 0
    rechecked = json.loads((tmp_path / "results.json").read_text())
    assert rechecked["problems"] == [] and rechecked["tie_check"] is None
    assert "kvtier, service-stop" in (tmp_path / "table.md").read_text()
    assert faults.main(["--recheck", str(tmp_path / "missing")]) == 2
    assert "cannot read" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# remote tiers' faults: the S3 gateway, the shared filesystem's FUSE daemon
# --------------------------------------------------------------------------------------------


def test_plan_of_the_remote_tier_rows():
    plan = plan_of("--small", "--faults", "bucket-stop,bucket-kill,fuse-stop", "--rgw-state-dir", "/tmp/x")
    assert plan["rows"] == ["vllm", "bucket-stop", "bucket-kill", "fuse-stop"]
    assert plan["rgw_state_dir"] == "/tmp/x" and plan["bucket_osd_bytes"] >= 1 << 30
    assert "rgw_state_dir" not in plan_of("--small")  # no gateway without a bucket row


@pytest.mark.parametrize("row", faults_tiers.TIER_FAULTS)
def test_a_remote_tier_row_reads_from_its_tier(row):
    plan = plan_of("--small", "--faults", row)
    row_plan, options = faults.row_options(plan, row)
    assert (row_plan["dram_gib"], row_plan["nvme_gib"]) == (0.0, 0.0)
    assert options == {"staging_slots": faults_tiers.TIER_DRAM_SLOTS, "load_policy": "always"}
    full_plan, full_options = faults.row_options(plan_of("--faults", row), row)
    prompt_blocks = -(-(2048 + 64 + 16) // 128)  # kv8b's prompt in vLLM's 128-token CPU blocks
    assert full_options["staging_slots"] == prompt_blocks + faults_tiers.TIER_DRAM_SLOTS, "room for one load"
    assert full_options["staging_slots"] < full_plan["users"] * prompt_blocks, "far below the users' prefixes"
    tier = "shared" if row == "fuse-stop" else "bucket"
    assert faults_tiers.hit_counters(row) == (f"{tier}_hits",)
    assert faults_tiers.read_counters(row) == (f"{tier}_hits", f"{tier}_misses", "remote_tier_lookups_skipped")
    assert faults_tiers.hit_counters("service-stop") == ("dram_hits", "nvme_hits")
    assert faults_tiers.read_counters("service-kill") == ()


class StandIn:
    """A remote tier's process stood in for by a sleeping child; ``restart`` starts another."""

    def __init__(self):
        self.process = self._spawn()
        self.restarts = 0

    @staticmethod
    def _spawn() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    def pid(self) -> int:
        return self.process.pid

    def restart(self) -> int:
        self.process.wait(timeout=10)
        self.process, self.restarts = self._spawn(), self.restarts + 1
        return self.process.pid

    def state(self) -> str:
        return Path(f"/proc/{self.process.pid}/stat").read_text().split(")")[1].split()[0]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def test_bucket_stop_and_fuse_stop_freeze_the_tiers_process(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtier.service.running_service", lambda socket: (4242, 0))
    for kind in ("bucket-stop", "fuse-stop"):
        target = StandIn()
        try:
            fault = faults.Fault(kind, tmp_path / "socket", target=target)
            fault.start()
            time.sleep(0.2)
            assert target.state() == "T" and (fault.pid, fault.service_pid) == (target.pid(), 4242)
            fault.end()
            time.sleep(0.2)
            assert target.state() != "T" and target.restarts == 0
            fault.release()  # nothing left to undo
        finally:
            target.kill()


def test_bucket_kill_kills_the_gateway_and_starts_it_again_once(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtier.service.running_service", lambda socket: (4242, 0))
    target = StandIn()
    try:
        killed = target.pid()
        fault = faults.Fault("bucket-kill", tmp_path / "socket", target=target)
        fault.start()
        assert fault.pid == killed
        fault.end()
        assert target.restarts == 1 and fault.tier is not None and fault.tier.restarted_pid == target.pid() != killed
        fault.release()
        assert target.restarts == 1
    finally:
        target.kill()


def test_a_remote_tier_fault_without_its_process_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtier.service.running_service", lambda socket: (4242, 0))
    with pytest.raises(faults.FaultError, match="without its tier"):
        faults.Fault("bucket-stop", tmp_path / "socket").start()


def test_gateway_pid_is_radosgw_shs_pid_file(tmp_path):
    (tmp_path / "run").mkdir()
    gateway = faults_tiers.Gateway(type("B", (), {"state_dir": str(tmp_path)})())
    with pytest.raises(RuntimeError, match="pid file"):
        gateway.pid()
    (tmp_path / "run" / f"{faults_tiers.GATEWAY_NAME}.pid").write_text("1234\n")
    assert gateway.pid() == 1234


def test_one_gateway_for_every_bucket_row(tmp_path, monkeypatch):
    from kvtier.bench import bucket

    opened: list = []

    @contextlib.contextmanager
    def fake_open(url, endpoint, osd_bytes, log, state_dir):
        opened.append((url, osd_bytes, state_dir))
        yield bucket.Bucket("b", "run", "http://127.0.0.1:7591", "us-east-1", True, state_dir)
        opened.append("down")

    monkeypatch.setattr(bucket, "open_bucket", fake_open)
    plan = plan_of("--small", "--faults", "bucket-stop,bucket-kill", "--rgw-state-dir", str(tmp_path))
    with faults_tiers.Tiers(plan, print) as tiers:
        options, target = tiers.open("bucket-stop", tmp_path / "bucket-stop")
        tiers.open("bucket-kill", tmp_path / "bucket-kill")
        assert tiers.close_row("bucket-stop") == []
    assert opened == [(None, plan["bucket_osd_bytes"], str(tmp_path)), "down"]
    assert options["bucket_url"] == "s3://b/run/bucket-stop" and options["bucket_endpoint"] == "http://127.0.0.1:7591"
    assert options["bucket_publish_delay_ms"] == faults_tiers.BUCKET_TIMING["bucket_publish_delay_ms"]
    assert isinstance(target, faults_tiers.Gateway)


def counters(**values: int) -> dict[str, int]:
    return {name: values.get(name, 0) for name in faults_tiers.STATS}


def test_tier_reads_are_taken_once_after_the_fault(monkeypatch):
    reads = faults.TierReads("bucket-stop", counters(bucket_hits=2), time.monotonic() + 60)
    reads.note(counters(bucket_hits=3))  # too early: the reads the fault held may not have finished
    assert not reads.taken
    reads.at = time.monotonic()
    reads.note(counters(bucket_hits=3, bucket_misses=1, remote_tier_lookups_skipped=2, dram_hits=5))
    reads.note(counters(bucket_hits=9))  # once
    assert reads.reads == 4 and reads.counters is not None and reads.counters["dram_hits"] == 5
    service = faults.TierReads("service-stop", counters(), time.monotonic())
    assert service.taken and service.reads is None


def test_read_errors_reads_count_the_blocks_a_sick_nvme_tier_skipped():
    """NVMe steps aside after 3 failed reads in a row (docs/reliability.md "Sick tiers"): the blocks it
    then skips are reads the fault touched, and its outages are in the row's counters."""
    reads = faults.TierReads("nvme-read-errors", counters(nvme_read_requests=1), time.monotonic())
    reads.note(counters(nvme_read_requests=4, nvme_outages=1, nvme_lookups_skipped=2))
    assert reads.reads == 5 and reads.counters is not None and reads.counters["nvme_outages"] == 1


def test_hits_of_a_tier_fault_are_its_tiers_and_its_pid_is_no_restart(tmp_path, monkeypatch):
    answers = iter([(4242, counters(bucket_hits=1, dram_hits=5)), (4242, counters(bucket_hits=2, dram_hits=5))])
    monkeypatch.setattr(faults, "service_now", lambda socket: next(answers))
    monkeypatch.setattr(faults, "POLL_S", 0.0)
    fault = faults.Fault("bucket-stop", tmp_path / "socket", target=object())
    fault.pid, fault.service_pid = 999, 4242  # the gateway's pid is not the service's
    client = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        info: dict = {}
        assert faults.wait_for_hits(fault, client, info, faults.TierReads("bucket-stop", None, 0.0)) is not None
        assert "service_restarted" not in info
    finally:
        client.kill()
        client.wait()


def test_a_fault_that_touched_no_read_of_its_tier_says_so():
    rows = [row("vllm", ["a"]), row("bucket-stop", ["a"]), row("fuse-stop", ["a"]), row("service-stop", ["a"])]
    rows[0].pop("kvtier"), rows[0].pop("fault")
    rows[1]["fault"]["tier_reads"] = 0
    rows[2]["fault"]["tier_reads"] = 3
    rows[2]["kvtier"] = {"dram_hits": 0, "nvme_hits": 0, "bucket_hits": 0, "shared_hits": 4}
    assert faults.judge(rows) == []  # a note, not a problem
    assert [note.split(":")[0] for note in faults.untouched(rows)] == ["bucket-stop"]
    lines = faults.table_rows(rows)
    tier_reads = faults.TABLE_HEADER.index("tier reads in fault")
    assert [line[tier_reads] for line in lines] == ["-", faults.NO_TIER_READ, "3", "-"]
    assert lines[2][tier_reads - 1] == "4"


# --------------------------------------------------------------------------------------------
# end to end (slow)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.full
def test_bench_faults_service_stop_small(tmp_path):
    try:
        import vllm  # noqa: F401
    except Exception as import_error:  # pragma: no cover - depends on the environment
        pytest.skip(f"vllm is not importable ({import_error!r})")
    out = tmp_path / "faults"
    command = [sys.executable, "-m", "kvtier", "bench", "faults", "--small", "--faults", "service-stop"]
    command += ["--fault-s", "5", "--out", str(out)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    document = json.loads((out / "results.json").read_text())
    assert not document["problems"]
    vllm_row, stopped = document["rows"]
    assert (vllm_row["row"], stopped["row"]) == ("vllm", "service-stop")
    for record in (vllm_row, stopped):
        assert record["completed"] == 8 and record["failed"] == 0
        assert len(record["outputs"]) == 8 and all(record["outputs"])
    assert stopped["wrong_outputs"] == 0
    assert stopped["fault"]["pid"] > 0 and stopped["fault"]["load_running_at_end"]
    assert (out / "table.md").exists()
    assert not list(out.glob("*/store"))  # the store went with the row
    # the near-tie check on every output (none differed): each the greedy path of vLLM alone, one
    # request at a time; an output made up for one request is wrong, not a tie
    from kvtier.bench import faults_ties

    stopped["outputs"][0] = "\u2603" + stopped["outputs"][0]
    todo = {"service-stop": list(range(8))}
    cleared, check = faults_ties.run_check(document["settings"], document["rows"], todo, tmp_path, 0.1)
    assert cleared == {"service-stop": frozenset(range(1, 8))}, check
    assert check["rows"]["service-stop"][0]["verdict"] == "wrong" and not check["problems"]


@pytest.mark.slow
@pytest.mark.full
def test_bench_faults_remote_tiers_small(tmp_path):
    """The S3 gateway stopped and killed, the shared filesystem's FUSE daemon stopped, each row's hits
    read from that tier: no failed request, no wrong output, the tier served hits, nothing left."""
    from kvtier.bench import bucket, slowmount

    reason = bucket.missing_reason() or slowmount.missing_reason()
    if reason:
        pytest.skip(reason)
    out, state = tmp_path / "faults", tmp_path / "radosgw"
    command = [sys.executable, "-m", "kvtier", "bench", "faults", "--small", "--fault-s", "5", "--out", str(out)]
    command += ["--faults", ",".join(faults_tiers.TIER_FAULTS), "--rgw-state-dir", str(state)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=2400)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    document = json.loads((out / "results.json").read_text())
    assert not document["problems"]
    for record in document["rows"][1:]:
        assert record["completed"] == 8 and record["failed"] == 0 and record["wrong_outputs"] == 0
        tier = "shared_hits" if record["row"] == "fuse-stop" else "bucket_hits"
        assert record["kvtier"][tier] > 0, record["kvtier"]  # hits came from the faulted tier
        assert record["fault"]["pid"] > 0
        assert record["fault"]["tier_reads"] > 0, record["fault"]  # --small's fault covers the 9.7-s repeat
    assert document["rows"][2]["fault"]["gateway_restarted"] > 0
    assert not state.exists() and not any(os.path.ismount(path) for path in out.glob("*/shared"))


@pytest.mark.slow
@pytest.mark.full
def test_bench_faults_service_kill_and_nvme_rows_small(tmp_path):
    """The rest of the fault matrix at small size: the host service killed, the NVMe tier's reads
    failing, its disk hung (the FUSE daemon under its files stopped) and full (a loop-mounted ext4):
    no failed request, no wrong output; the killed service's successor took the engine back; the
    failing reads were tried and erred; the hung disk turned the tier sick (the heartbeat: writes
    wait on it even where no read does); the full disk left no free byte and no I/O error (the
    device file is preallocated); nothing stays mounted."""
    from kvtier.bench import slowmount

    reason = slowmount.missing_reason() or (None if os.geteuid() == 0 else "nvme-full mounts a loop device: root")
    if reason:
        pytest.skip(reason)
    out = tmp_path / "faults"
    rows = "service-kill,nvme-read-errors,nvme-stop,nvme-full"
    command = [sys.executable, "-m", "kvtier", "bench", "faults", "--small", "--fault-s", "5", "--out", str(out)]
    completed = subprocess.run([*command, "--faults", rows], capture_output=True, text=True, timeout=2400)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    document = json.loads((out / "results.json").read_text())
    assert not document["problems"]
    by_row = {record["row"]: record for record in document["rows"][1:]}
    assert list(by_row) == rows.split(",")
    for record in by_row.values():
        assert record["completed"] == 8 and record["failed"] == 0 and record["wrong_outputs"] == 0
    killed = by_row["service-kill"]["fault"]
    assert killed["service_restarted"] not in (None, killed["pid"]) and killed["reattached_s"] is not None
    read_errors = by_row["nvme-read-errors"]["fault"]
    assert read_errors["tier_reads"] > 0 and read_errors["tier_counters"]["io_errors"] > 0, read_errors
    assert by_row["nvme-stop"]["fault"]["tier_counters"]["nvme_outages"] >= 1, by_row["nvme-stop"]["fault"]
    full = by_row["nvme-full"]["fault"]
    assert full["free_bytes_after_fill"] < 1 << 20 and full["tier_counters"]["io_errors"] == 0, full
    assert not list(out.glob("*/store")) and not any(os.path.ismount(path) for path in out.glob("*/*"))
