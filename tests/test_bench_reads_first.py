"""``kvtier bench reads-first`` at CI size: loads from NVMe right after heavy stores (and while more
stores run) find every block, with the right bytes, and the report has its figures."""

from __future__ import annotations

import json

import pytest

from kvtier.bench import reads_first


@pytest.mark.parametrize("keep_queued_writes", [False, True])
def test_loads_right_after_heavy_stores_find_every_block(tmp_path, keep_queued_writes):
    out = tmp_path / "reads-first.json"
    argv = ["--rounds", "3", "--block-mib", "1", "--hit-mib", "16", "--dram-mib", "64", "--nvme-gib", "1"]
    argv += ["--keep-queued-writes"] if keep_queued_writes else []
    exit_code = reads_first.main([*argv, "--dir", str(tmp_path), "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["loads_cancel_queued_writes"] is not keep_queued_writes
    # Reported; loads take slots from queued writes only when allowed (how many depends on timing).
    assert isinstance(result["service"]["cancelled_writes"], int)
    if keep_queued_writes:
        assert result["service"]["cancelled_writes"] == 0
    assert result["missed_blocks"] == {"after_stores": 0, "quiet": 0, "dram": 0}
    assert exit_code == 0
    assert result["hit_bytes"] == 16 << 20
    for condition in ("after_stores", "quiet", "dram"):
        figures = result["loads"][condition]
        assert 0 < figures["min_s"] <= figures["median_s"] <= figures["p99_s"] <= figures["max_s"]
    assert result["service"]["nvme_hits"] >= 2 * 3 * 16, "every round's targets came from NVMe"
