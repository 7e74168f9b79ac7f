"""``kvtier bench admission`` on a real store: policy ``reuse`` writes a fraction of what ``all``
writes for the same trace, and a write budget holds (docs/benchmarks.md, "Writes below DRAM")."""

import json

from kvtier.bench import admission


def test_reuse_writes_less_than_all_and_a_budget_holds(capsys):
    argv = ["--requests", "400", "--documents", "10", "--repeats", "1", "--dram-mib", "16", "--nvme-mib", "512"]
    assert admission.main([*argv, "--budget-seconds", "3", "--budget-burst-s", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    every, reuse = result["policies"]["all"], result["policies"]["reuse"]
    assert every["awaiting_reuse"] == 0 and every["dropped_without_evidence"] == 0
    assert reuse["awaiting_reuse"] > 0 and reuse["dropped_without_evidence"] > 0
    assert reuse["admitted_on_reuse"] > 0, "shared prefixes hit in DRAM were written on reuse"
    assert reuse["nvme_bytes_written"] * 3 < every["nvme_bytes_written"], result["reuse_vs_all"]
    assert reuse["blocks_served"] > 0 and every["blocks_served"] >= reuse["blocks_served"]
    budget = result["budget"]
    assert budget["refusals"] > 0, "the trace writes faster than a tenth of its own rate"
    assert budget["written_over_rate"] <= budget["bound_over_rate"] * 1.01, budget
