"""The remote-tier rows of `kvtier bench ttft` as planned from the command line: the size options
are parsed once, and bad combinations are refused with the flag to fix (no engine runs here)."""

from __future__ import annotations

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
