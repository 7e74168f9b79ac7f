"""The benchmarks' local S3 gateway (``kvtier.bench.bucket``): where its OSD keeps the run's objects.

- RAM (memstore) while that fits beside the engines, else a sparse file on disk (bluestore), else a
  clear error: a 32-user slow-link run's memstore OSD grew to 17 GB and was OOM-killed on a 24 GiB
  machine (issue 36), which voided the run;
- a gateway brought up on bluestore takes and serves objects, and goes without a trace.

The second needs root and Debian's Ceph packages (about 20 s); skipped with the fix otherwise.
"""

from __future__ import annotations

import os
import shutil

import pytest

from kvtier.bench import bucket

GIB = 1 << 30


def test_the_osd_is_in_ram_only_while_it_fits_beside_the_engines(tmp_path):
    state = str(tmp_path / "radosgw")
    assert bucket.osd_store(4 * GIB, state, available_bytes=22 * GIB) == "memstore"  # 12 users, kv8b
    assert bucket.osd_store(11 * GIB, state, available_bytes=22 * GIB) == "bluestore"  # 32 users
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(bucket.BucketUnavailable, match="--bucket-url"):
        bucket.osd_store(free + GIB, state, available_bytes=GIB)


@pytest.mark.radosgw
def test_a_gateway_on_a_disk_osd_serves_objects_and_leaves_nothing(tmp_path, monkeypatch):
    reason = bucket.missing_reason()
    if reason:
        pytest.skip(reason)
    # Ports of its own: the object-tier tests' gateway may be up beside it.
    monkeypatch.setenv("KVTIER_RGW_PORT", "7483")
    monkeypatch.setenv("KVTIER_CEPH_MON_PORT", "3303")
    monkeypatch.setattr(bucket, "available_memory_bytes", lambda: GIB)  # too little for RAM
    state = tmp_path / "radosgw"
    lines: list[str] = []
    with bucket.open_bucket(None, None, 2 * GIB, lines.append, state_dir=str(state)) as target:
        assert "osd objectstore = bluestore" in (state / "ceph.conf").read_text()
        block = state / "osd" / "osd.0" / "block"
        assert block.stat().st_size == 2 * GIB and block.stat().st_blocks * 512 < GIB, "a sparse file"
        payload = os.urandom(3 << 20)
        key = f"{target.name}/{target.prefix}/object"
        assert target.request("PUT", key, payload)[0] == 200
        status, body = target.request("GET", key)
        assert status == 200 and body == payload
    assert any("bluestore OSD of 2048 MiB" in line for line in lines), lines
    assert not state.exists(), "the state directory (the OSD's file) went with the gateway"
