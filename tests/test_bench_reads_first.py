"""``kvtier bench reads-first`` at CI size: loads from NVMe right after heavy stores (and while more
stores run) find every block, with the right bytes, and the report has its figures."""

from __future__ import annotations

import json

from kvtier.bench import reads_first


def test_loads_right_after_heavy_stores_find_every_block(tmp_path):
    out = tmp_path / "reads-first.json"
    argv = ["--rounds", "3", "--block-mib", "1", "--hit-mib", "16", "--dram-mib", "64", "--nvme-gib", "1"]
    exit_code = reads_first.main([*argv, "--dir", str(tmp_path), "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["missed_blocks"] == {"after_stores": 0, "quiet": 0, "dram": 0}
    assert exit_code == 0
    assert result["hit_bytes"] == 16 << 20
    for condition in ("after_stores", "quiet", "dram"):
        figures = result["loads"][condition]
        assert 0 < figures["min_s"] <= figures["median_s"] <= figures["p99_s"] <= figures["max_s"]
    assert result["service"]["nvme_hits"] >= 2 * 3 * 16, "every round's targets came from NVMe"
