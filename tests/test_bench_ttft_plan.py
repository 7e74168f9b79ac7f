"""The remote-tier rows of `kvtier bench ttft` as planned from the command line: the size options
are parsed once, and bad combinations are refused with the flag to fix (no engine runs here)."""

from __future__ import annotations

import os
import stat
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.ttft.plan import BenchError, build_parser, object_plan, shared_plan

SLOT_BYTES = 4096 + (2 << 20)  # a 2 MiB block behind its descriptor page
LENGTHS = [1024, 2048]


def _args(*argv: str):
    return build_parser().parse_args(list(argv))


def _shared(*argv: str):
    return shared_plan(_args(*argv), "stamp", LENGTHS, 2, SLOT_BYTES, 16)


def _object(*argv: str):
    return object_plan(_args(*argv), LENGTHS, 2, 1 << 17, SLOT_BYTES)


def test_shared_row_is_planned_under_both_roots_with_its_file_size(tmp_path):
    assert _shared() is None
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plan = _shared("--shared-root-store", str(tmp_path / "a"), "--shared-root-load", str(tmp_path / "b"),
                   "--shared-file-bytes", "64MiB")  # fmt: skip
    assert plan["file_bytes"] == 64 << 20 and plan["prompts"] == 4
    assert plan["store_root"].startswith(str(tmp_path / "a")) and plan["load_root"].startswith(str(tmp_path / "b"))
    assert plan["store_root"].rsplit("/", 1)[1] == plan["load_root"].rsplit("/", 1)[1], "one subdirectory, two views"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--shared-file-bytes", "64MiB"], "--shared-root-store and --shared-root-load"),
        (["--shared-root-store", "/tmp"], "go together"),
        (["--shared-root-store", "/tmp", "--shared-root-load", "/tmp", "--shared-file-bytes", "12 parsecs"],
         "--shared-file-bytes:"),
        (["--shared-root-store", "/tmp", "--shared-root-load", "/tmp", "--shared-file-bytes", "1MiB"],
         "cannot hold one 16-token block"),
        (["--shared-root-store", "/nonexistent-kvtier", "--shared-root-load", "/tmp"], "is not a directory"),
    ],
)  # fmt: skip
def test_shared_row_refuses_what_cannot_run(argv, says):
    with pytest.raises(BenchError, match=says):
        _shared(*argv)


def test_object_row_is_planned_with_its_segment_size():
    assert _object() is None
    plan = _object("--object", "--bucket-segment-bytes", "32MiB")
    assert plan["segment_bytes"] == 32 << 20
    assert plan["osd_bytes"] > 2 * sum(LENGTHS) * (1 << 17), "the gateway's OSD holds every prompt of the row"
    assert _object("--object")["segment_bytes"] is None, "unset: the store's default"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--bucket-segment-bytes", "32MiB"], "go with --object"),
        (["--object", "--bucket-segment-bytes", "lots"], "--bucket-segment-bytes:"),
        (["--object", "--bucket-segment-bytes", "1MiB"], "must hold one block"),
    ],
)
def test_object_row_refuses_what_cannot_run(argv, says):
    with pytest.raises(BenchError, match=says):
        _object(*argv)


def test_too_little_disk_space_refuses_the_run_and_leaves_no_temporary_store(tmp_path, monkeypatch, capsys):
    import shutil
    import tempfile

    from kvtier.bench import layout
    from kvtier.bench.ttft import entry

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(layout, "memcpy_gbps", lambda: 10.0)  # not what this test is about
    monkeypatch.setattr(entry.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1 << 20))
    assert entry.main(["--small", "--out", str(tmp_path / "out")]) == 2
    assert "GiB are free" in capsys.readouterr().err
    assert not list(tmp_path.glob("kvtier-bench-ttft-*")), "the temporary store directory was left behind"


def test_encrypted_flag_adds_the_encrypted_nvme_row_on_its_own_store_with_a_throwaway_key(tmp_path, monkeypatch):
    from kvtier.bench import layout
    from kvtier.bench.ttft import engine_phase, entry
    from kvtier.bench.ttft.engine import kvtier_transfer

    monkeypatch.setattr(layout, "memcpy_gbps", lambda: 10.0)
    # kvtier.vllm imports vLLM (seconds to a minute): a stand-in that gives the store options it is passed.
    stand_in: Any = types.ModuleType("kvtier.vllm")
    stand_in.kv_transfer_config = lambda path, **options: {"kv_connector_extra_config": {"path": path, **options}}
    monkeypatch.setitem(sys.modules, "kvtier.vllm", stand_in)
    seen: dict[str, Any] = {}

    def run_phases(plan, phases, timeout_s, started, notes):  # no engine: what main would run, and its key
        key_file = plan["encryption_key_file"]
        seen.update(plan=dict(plan), phases=[phase.name for phase in phases], key_mode=os.stat(key_file).st_mode,
                    key_bytes=len(Path(key_file).read_bytes()))  # fmt: skip
        seen["transfer"] = engine_phase.encrypted_transfer(plan)["kv_connector_extra_config"]
        seen["clear"] = kvtier_transfer(plan)["kv_connector_extra_config"]
        return entry.PhaseResults()

    monkeypatch.setattr(entry, "run_phases", run_phases)
    store_dir = tmp_path / "store"
    argv = ["--small", "--encrypted", "--skip-lmcache", "--out", str(tmp_path / "out"), "--store-dir", str(store_dir)]
    assert entry.main(argv) == 1, "no measurements"
    plan, phases = seen["plan"], seen["phases"]
    assert plan["encrypted"] and not entry.make_plan(_args("--small"))["encrypted"]
    nvme = phases.index("kvtier_nvme")
    assert phases[nvme + 1 : nvme + 3] == ["kvtier_nvme_encrypted_store", "kvtier_nvme_encrypted"]
    assert stat.S_IMODE(seen["key_mode"]) == 0o600 and seen["key_bytes"] == 32
    assert plan["encryption_key_file"].startswith(plan["runtime_dir"]), "in the run's scratch directory"
    assert not os.path.exists(plan["encryption_key_file"]), "the throwaway key goes with the run"
    assert seen["transfer"]["encryption_key_file"] == plan["encryption_key_file"]
    assert seen["transfer"]["path"] == plan["encrypted_store_dir"] != plan["store_dir"] == seen["clear"]["path"]
    assert "encryption_key_file" not in seen["clear"], "the clear rows stay in clear"
    assert {key: seen["transfer"][key] for key in seen["clear"] if key != "path"} == {
        key: value for key, value in seen["clear"].items() if key != "path"
    }, "the same store options as kvtier_nvme's but the key and the directory"
    assert not (store_dir / "kvtier-encrypted").exists(), "unreadable without its key: removed"


def test_encrypted_row_needs_room_for_its_own_store():
    from kvtier.bench.ttft.entry import disk_space_needed_bytes

    plan = {"nvme_bytes": 1 << 30, "lengths": [512], "kv_bytes_per_token": 1, "example_connector": False,
            "disk_floor": False, "lmcache_available": False, "shared": None, "object": None}  # fmt: skip
    assert disk_space_needed_bytes({**plan, "encrypted": True}) == disk_space_needed_bytes(plan) + (1 << 30)


def test_object_and_encrypted_flags_add_the_encrypted_object_row_on_its_own_prefix(monkeypatch):
    """--object --encrypted: both rows' nodes A first, then each prompt's clear and encrypted loads one
    after the other; the encrypted row's nodes carry the run's key and read and write a prefix of
    their own under the run's, with the clear row's other options."""
    from kvtier.bench.ttft import engine_phase, entry
    from kvtier.bench.ttft.engine import kvtier_transfer

    stand_in: Any = types.ModuleType("kvtier.vllm")
    stand_in.kv_transfer_config = lambda path, **options: {"kv_connector_extra_config": {"path": path, **options}}
    monkeypatch.setitem(sys.modules, "kvtier.vllm", stand_in)
    the_plan = {"lengths": [512, 1024], "repeats": 2, "encrypted": True, "encryption_key_file": "/run/k.key",
                "object": {"bucket_url": "s3://b/run", "bucket_endpoint": "http://127.0.0.1:1"}, "store_dir": "/s",
                "dram_bytes": 1, "nvme_bytes": 2, "region_bytes": 3}  # fmt: skip
    names = [phase.run_name for phase in entry.object_row_phases(the_plan)]
    assert names[:2] == ["kvtier_object_store", "kvtier_object_encrypted_store"]
    assert names[2:6] == [
        "kvtier_object_load-512-r0", "kvtier_object_encrypted_load-512-r0",
        "kvtier_object_load-1024-r0", "kvtier_object_encrypted_load-1024-r0",
    ]  # fmt: skip
    assert len(names) == 2 + 2 * 2 * 2
    assert [p.run_name for p in entry.object_row_phases({**the_plan, "encrypted": False})] == [
        name for name in names if "encrypted" not in name
    ]
    options = {}
    for encrypted in (False, True):
        node, row = engine_phase._object_row(the_plan, encrypted)
        options[encrypted] = kvtier_transfer(the_plan, f"/nodes/{node}", **row)["kv_connector_extra_config"]
    clear, sealed = options[False], options[True]
    assert (clear["bucket_url"], sealed["bucket_url"]) == ("s3://b/run", "s3://b/run/encrypted")
    assert sealed["encryption_key_file"] == "/run/k.key" and "encryption_key_file" not in clear
    assert clear["path"] != sealed["path"]
    ignored = ("path", "bucket_url", "encryption_key_file")
    assert {k: v for k, v in clear.items() if k not in ignored} == {k: v for k, v in sealed.items() if k not in ignored}
