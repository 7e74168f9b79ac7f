"""``kvtier bench serve --workload longtail`` (issue 39): the dataset of mostly one-off prompts that
the rows ``kvtier-nvme`` (``write_admission: "all"``) and ``kvtier-nvme-reuse`` are compared on.

Fast tests on the tiny model's real tokenizer: the mix of returning and one-off requests, exact
prompt lengths, prefixes shared within a user and nowhere else, the same prompts for the same seed,
the JSONL file and the ``vllm bench serve`` options that read it, and the plan's rows and sizes.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from kvtier.bench import serve, serve_longtail, serve_servers
from kvtier.models import ensure_model

PLAN = {"requests_per_user": 3, "prefix_len": 256, "suffix_len": 32, "one_off_share": 0.8}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_model("tiny"))


def plan_of(*argv: str) -> dict:
    return serve.make_plan(serve.build_parser().parse_args(list(argv)))


def test_one_off_requests_make_the_share_asked_for():
    assert serve_longtail.one_off_count(4, 3, 0.8) == 48  # 12 returning, 48 one-off: 80%
    assert serve_longtail.one_off_count(2, 3, 0.5) == 6
    assert serve_longtail.one_off_count(2, 3, 0.0) == 0


def test_a_point_mixes_returning_users_and_one_offs(tokenizer):
    point = serve_longtail.build_point(tokenizer, PLAN, users=2, seed=5)
    assert len(point.prompts) == 6 + 24 and point.one_off_requests == 24
    assert Counter(user for user in point.user_of_request if user is not None) == {0: 3, 1: 3}
    lengths = [len(tokenizer.encode(prompt, add_special_tokens=False)) for prompt in point.prompts]
    assert all(abs(length - 288) <= 4 for length in lengths), lengths  # a token may merge or split at the join
    # the users' requests are spread over the run, not sent first or last
    positions = [i for i, user in enumerate(point.user_of_request) if user is not None]
    assert positions[0] < 15 and positions[-1] > 15, positions

    def head(prompt: str) -> tuple[int, ...]:  # the first 240 tokens: whole blocks of the prefix
        return tuple(tokenizer.encode(prompt, add_special_tokens=False)[:240])

    heads = Counter(head(prompt) for prompt in point.prompts)
    for user in (0, 1):
        own = {head(p) for p, u in zip(point.prompts, point.user_of_request, strict=True) if u == user}
        assert len(own) == 1 and heads[next(iter(own))] == 3  # shared by the user's requests only
    one_offs = [head(p) for p, u in zip(point.prompts, point.user_of_request, strict=True) if u is None]
    assert all(heads[h] == 1 for h in one_offs)  # never seen again
    again = serve_longtail.build_point(tokenizer, PLAN, users=2, seed=5)
    assert again == point  # every row sees the same prompts
    assert serve_longtail.build_point(tokenizer, PLAN, users=2, seed=6).prompts != point.prompts


def test_the_dataset_file_and_its_bench_options(tokenizer, tmp_path):
    plan = {**PLAN, "model_dir": str(ensure_model("tiny")), "retain_hints": True}
    path = tmp_path / "point.jsonl"
    point = serve_longtail.write_dataset(plan, users=1, seed=3, path=path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["prompt"] for line in lines] == point.prompts and len(lines) == 3 + 12
    hinted = [line.get("request_overrides") == serve_longtail.retain_hint(int(PLAN["prefix_len"])) for line in lines]
    assert hinted == [user is not None for user in point.user_of_request], "the users' requests say so, no other"
    args = serve_longtail.dataset_args(path, len(lines), 16)
    assert args[args.index("--dataset-name") + 1] == "custom" and "--disable-shuffle" in args
    assert args[args.index("--num-prompts") + 1] == "15" and "--skip-chat-template" in args
    plan = {**plan_of("--workload", "longtail"), **plan}
    command = serve.bench_command(plan, "http://x", "m", tmp_path, 1, 3, tmp_path, "r.json", args)
    assert "prefix_repetition" not in command and command[command.index("--dataset-path") + 1] == str(path)
    assert command[1:3] == ["-m", "kvtier.bench.vllm_client"] and command[3:5] == ["bench", "serve"]
    unhinted = serve_longtail.write_dataset({**plan, "retain_hints": False}, users=1, seed=3, path=path)
    assert unhinted == point and "request_overrides" not in path.read_text()


def test_vllms_client_sends_each_lines_body_fields_with_its_request(tmp_path):
    """vLLM's own ``custom`` dataset class, as ``vllm bench serve`` builds it, once the client module
    installed its addition: a line's ``request_overrides`` reach its request, in file order."""
    pytest.importorskip("vllm")
    from vllm.benchmarks.datasets.datasets import CustomDataset

    from kvtier.bench import vllm_client
    from kvtier.vllm.hints import retained_tokens

    path = tmp_path / "d.jsonl"
    lines = [{"prompt": "a"}, {"prompt": "b", "request_overrides": serve_longtail.retain_hint(2048)}, {"prompt": "c"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    vllm_client.install()
    dataset = CustomDataset(dataset_path=str(path), disable_shuffle=True)
    requests = dataset.sample(tokenizer=None, num_requests=3)
    assert [r.prompt for r in requests] == ["a", "b", "c"]
    assert [r.request_overrides for r in requests] == [None, serve_longtail.retain_hint(2048), None]
    hint = serve_longtail.retain_hint(2048)["kv_transfer_params"]
    assert retained_tokens(hint) == 2048, "the form kvtier's scheduler reads"


def test_the_plan_and_the_reuse_row():
    plan = plan_of("--workload", "longtail", "--rows", "vllm,kvtier-nvme,kvtier-nvme-reuse")
    assert (plan["users"], plan["requests_per_user"], plan["one_off_share"]) == ([4], 3, 0.8)
    assert plan["rows"] == ["vllm", "kvtier-nvme", "kvtier-nvme-reuse"]
    assert plan_of("--workload", "longtail", "--small")["users"] == [2]
    store = Path("/nonexistent/store")  # only named in the options, never opened
    reuse = serve_servers.store_options("kvtier-nvme-reuse", plan, store)
    assert reuse["write_admission"] == "reuse" and reuse["nvme_bytes"] > 0
    assert "write_admission" not in serve_servers.store_options("kvtier-nvme", plan, store)  # the default: all
    with pytest.raises(serve.BenchError, match="one-off-share"):
        plan_of("--workload", "longtail", "--one-off-share", "1")
