"""``kvtier bench faults`` (issue 36, item 5): faults injected into kvtier's host service under load.

Fast tests (no engine): the options and the plan (the load spread over the fault's timeline, greedy
sampling, the rows), the fault on a stand-in process (stopped and continued), the judging of made-up
results (a failed request or a different output is a problem), the table.
The slow test (``full``: not in CI's time) runs ``kvtier bench faults --small`` end to end: vLLM alone,
then kvtier with its service stopped for 5 s mid-run.

Run: ``.venv/bin/python -m pytest tests/test_bench_faults.py -v`` (``KVTIER_FULL_TESTS=1`` and ``-m slow``
for the run).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.bench import faults


def plan_of(*argv: str) -> dict:
    return faults.make_plan(faults.build_parser().parse_args(list(argv)))


def test_plan_small_and_full():
    small = plan_of("--small")
    assert (small["preset"], small["users"], small["requests_per_user"]) == ("tiny", 4, 2)
    assert small["rows"] == ["vllm", "service-stop", "service-kill"]
    assert small["fault_s"] == 20.0
    # 8 requests spread over 3 + 20 + 12 seconds, nearly evenly, greedy.
    assert small["request_rate"] == pytest.approx(8 / 35)
    assert small["burstiness"] == faults.BURSTINESS
    assert small["bench_args"][:2] == ["--temperature", "0"]
    assert small["max_model_len"] == 512 + 64 + 4 + 128
    full = plan_of("--faults", "service-kill", "--fault-s", "5", "--request-rate", "2")
    assert (full["preset"], full["users"], full["prefix_len"]) == ("kv8b", 8, 2048)
    assert full["rows"] == ["vllm", "service-kill"]
    assert full["request_rate"] == 2


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


def test_a_fault_without_a_service_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtier.service.running_service", lambda socket: None)
    with pytest.raises(faults.FaultError, match="no kvtier service"):
        faults.Fault("service-kill", tmp_path / "socket").start()


def test_engine_notes_keep_kvtier_service_lines(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "(APIServer pid=1) INFO kvtier: nothing\n"
        "kvtier: host service call locate_many failed (...); serving misses (recompute) until it answers again\n"
        "kvtier: reattached to the host service; serving its hits again\n"
    )
    assert [note[:30] for note in faults.engine_notes(log)] == [
        "kvtier: host service call loca", "kvtier: reattached to the host",
    ]  # fmt: skip
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
    faults.judge(rows)
    lines = faults.table_rows(rows)
    assert lines[0][:4] == ["vLLM alone", "1", "0", "0"] and lines[0][8:] == ["-", "-", "-"]
    assert lines[1][0] == "kvtier, service-stop" and lines[1][8:] == ["not during the run", "3", "1"]
    assert len(lines[1]) == len(faults.TABLE_HEADER)


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
