"""The one option table (kvtier.options(), from the core's config::OPTIONS): the docs' option tables
are generated from it, Store.open accepts exactly its options, and the benchmark reads its defaults."""

import re
from pathlib import Path

import pytest

import kvtier
from kvtier import option_docs

DOCS = Path(__file__).resolve().parents[1] / "docs"
OBJECT_BYTES = 64 * 1024
SLOT_BYTES = OBJECT_BYTES + 4096


def valid_values(tmp_path):
    """A valid value for every Python option; a new option must be added here (the test checks)."""
    shared = tmp_path / "shared"
    shared.mkdir(exist_ok=True)
    key_file = tmp_path / "shared.key"
    key_file.write_bytes(bytes(range(32)))
    key_file.chmod(0o600)
    return {
        "object_bytes": OBJECT_BYTES,
        "namespace": "options-test",
        "dram_bytes": 8 * SLOT_BYTES,
        "staging_slots": 4,
        "nvme_bytes": 64 << 20,
        "nvme_without_space": "dram_only",
        "region_bytes": 2 << 20,
        "io_engine": "psync",
        "io_depth": 8,
        "direct_io": "off",
        "max_write_inflight_bytes": 1 << 20,
        "max_dirty_bytes": 4 * SLOT_BYTES,
        "store_queue_jobs": 8,
        "load_threads": 1,
        "checksum_threads": 4,
        "slot_wait_ms": 100,
        "remote_read_stall_ms": 250,
        "nvme_read_stall_ms": 750,
        "loads_cancel_queued_writes": False,
        "write_admission": "reuse",
        "remote_write_admission": "all",
        "write_admission_memory_blocks": 4096,
        "write_budget_nvme_dwpd": 2.5,
        "tenant_dram_share": 0.2,
        "tenant_dram_shares": "team-a=0.5,team-b=0.25",
        "tenant_dram_max_share": 0.6,
        "tenant_shares_nvme": False,
        "tenant_shares_shared_fs": False,
        "tenant_shares_bucket": False,
        "write_budget_nvme_bytes_per_day": 64 << 30,
        "write_budget_shared_bytes_per_day": 32 << 30,
        "write_budget_bucket_bytes_per_day": 16 << 30,
        "write_budget_burst_s": 60,
        "encryption_key_file": str(key_file),
        "shared_root": str(shared),
        "shared_high_watermark": 0.95,
        "shared_low_watermark": 0.85,
        "shared_file_bytes": 1 << 20,
        "shared_staleness_ms": 50,
        "shared_fail_on_full": True,
        "shared_publish_queue_bytes": 4 << 20,
        "shared_key_file": str(key_file),
        "shared_capacity_bytes": 1 << 30,
        "shared_grace_ms": 5000,
        "shared_publish_delay_ms": 100,
    }


def base_options(tmp_path):
    values = valid_values(tmp_path)
    return {
        name: values[name]
        for name in ("object_bytes", "namespace", "dram_bytes", "nvme_bytes", "region_bytes", "io_engine")
    }


def doc_rows(text: str, block: str) -> list[tuple[str, str]]:
    """(first cell, default cell) of every row of a generated table."""
    table = option_docs.read_block(text, block)
    assert table is not None, f"markers of the {block!r} option table are missing"
    rows = []
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows.append((cells[0], cells[1]))
    return rows


def test_options_describe_every_option():
    options = kvtier.options()
    names = [o["name"] for o in options]
    assert len(names) == len(set(names))
    assert "shared_publish_queue_bytes" in names
    assert "shared_publish_wait_ms" not in names  # removed: the publisher never waits
    for o in options:
        assert {"name", "kind", "default", "default_text", "description", "constraint", "choices"} <= set(o)
        assert o["kind"] in {"int", "size", "float", "bool", "path", "bytes_or_str", "choice"}, o
        assert o["description"] and o["default_text"], o
        assert o["python"] is True
        if o["kind"] == "choice":
            assert o["default"] in o["choices"], o
    rust_only = [o for o in kvtier.options(include_rust_only=True) if not o["python"]]
    assert rust_only and not {o["name"] for o in rust_only} & set(names)


def test_docs_tables_are_generated_from_the_option_table():
    stale = option_docs.stale_blocks(DOCS)
    assert not stale, f"stale option tables {stale}: run `python -m kvtier.option_docs --write`"


def test_docs_tables_list_exactly_the_options_with_their_defaults():
    expected = [(o["name"], o["default_text"]) for o in kvtier.options()]
    text = (DOCS / "configuration.md").read_text()
    blocks = ("store", "shared", "bucket")
    listed = [(cell.strip("`"), default) for block in blocks for cell, default in doc_rows(text, block)]
    assert listed == expected

    # shared-tier.md: every shared option, Python-settable ones by their Python name, the others as Rust only.
    shared_rows = doc_rows((DOCS / "shared-tier.md").read_text(), "shared-tier")
    python_shared = [(o["name"], o["default_text"]) for o in kvtier.options() if o["name"].startswith("shared_")]
    listed_python = [
        (cell.split(" / ")[0].strip("`"), default) for cell, default in shared_rows if not cell.startswith("Rust only")
    ]
    assert listed_python == python_shared
    rust_only = [
        ("`" + o["field"].removeprefix("shared.") + "`", o["default_text"])
        for o in kvtier.options(include_rust_only=True)
        if not o["python"]
    ]
    assert [
        (cell.removeprefix("Rust only: "), d) for cell, d in shared_rows if cell.startswith("Rust only")
    ] == rust_only


# bucket_* options open an S3 client that must reach its server: test_object_tier.py opens stores with
# every one of them against a real one.
def local_options() -> list[dict]:
    return [o for o in kvtier.options() if not o["name"].startswith("bucket_")]


def test_every_option_is_accepted_by_open(tmp_path):
    values = valid_values(tmp_path)
    assert set(values) == {o["name"] for o in local_options()}, "valid_values() must cover kvtier.options()"
    # All at once, and the setters took effect.
    with kvtier.Store.open(str(tmp_path / "all"), **values) as store:
        stats = store.stats()
        assert stats["io_engine"] == "psync"
        assert stats["direct_io"] is False
        assert store.object_bytes == OBJECT_BYTES
    # One at a time over the required ones (a shared_* option needs shared_root).
    for index, (name, value) in enumerate(values.items()):
        options = base_options(tmp_path)
        if name.startswith("shared_"):
            options["shared_root"] = values["shared_root"]
        options[name] = value
        kvtier.Store.open(str(tmp_path / f"one-{index}"), **options).close()


def test_typed_defaults_are_accepted_by_open(tmp_path):
    defaults = {o["name"]: o["default"] for o in local_options() if o["default"] is not None}
    # Not the 1 GiB DRAM arena and 8 GiB preallocation in a test.
    for name in ("dram_bytes", "nvme_bytes"):
        defaults.pop(name)
    options = dict(base_options(tmp_path), **defaults, shared_root=valid_values(tmp_path)["shared_root"])
    kvtier.Store.open(str(tmp_path / "defaults"), **options).close()


@pytest.mark.parametrize(
    "wrong, suggested",
    [
        ("dram_byte", "dram_bytes"),
        ("shared_publish_queue", "shared_publish_queue_bytes"),
        ("io_engin", "io_engine"),
    ],
)
def test_a_misspelled_option_is_refused_naming_it(tmp_path, wrong, suggested):
    with pytest.raises(kvtier.ConfigError, match=f"`{wrong}`") as info:
        kvtier.Store.open(str(tmp_path / "x"), **base_options(tmp_path), **{wrong: 1})
    assert f"`{suggested}`" in str(info.value)


def test_unknown_removed_and_rust_only_options_are_refused(tmp_path):
    with pytest.raises(kvtier.ConfigError, match="bogus") as info:
        kvtier.Store.open(str(tmp_path / "x"), **base_options(tmp_path), bogus=1)
    assert "dram_bytes" in str(info.value)  # no close name: every option is listed
    with pytest.raises(kvtier.ConfigError, match="shared_publish_wait_ms"):
        kvtier.Store.open(str(tmp_path / "x"), **base_options(tmp_path), shared_publish_wait_ms=10)
    with pytest.raises(kvtier.ConfigError, match=r"shared_lease_ms.*Rust"):
        kvtier.Store.open(str(tmp_path / "x"), **base_options(tmp_path), shared_lease_ms=1000)


@pytest.mark.parametrize(
    "name, value, expected",
    [
        ("dram_bytes", "1G", "int"),
        ("io_depth", -1, "int"),
        ("shared_high_watermark", "high", "float"),
        ("shared_fail_on_full", "yes", "bool"),
        ("shared_root", 5, "PathLike"),
        ("namespace", 5, "bytes or str"),
        ("io_engine", "spdk", "psync"),
        ("direct_io", "maybe", "off"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_option_and_type(tmp_path, name, value, expected):
    with pytest.raises(kvtier.ConfigError, match=name) as info:
        kvtier.Store.open(str(tmp_path / "x"), **dict(base_options(tmp_path), **{name: value}))
    assert expected in str(info.value)


def test_the_benchmark_reads_the_publish_queue_from_the_table():
    from kvtier.bench import kvtier_store

    default = next(o["default"] for o in kvtier.options() if o["name"] == "shared_publish_queue_bytes")
    assert kvtier_store.publish_queue_bytes() == default
    assert not hasattr(kvtier_store, "PUBLISH_QUEUE_BYTES")
