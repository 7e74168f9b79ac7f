"""`kvtier bench serve --workload longtail`: most prompts are seen once, a minority come back (issue 39).

Production traffic is mostly one-off prompts; only some prefixes (a system prompt, a document many
questions are asked about) come back. That is the workload where writing every block below DRAM
(``write_admission: "all"``) spends drive endurance and bucket PUTs on blocks nobody reads again,
and where ``"reuse"`` (write once there is evidence of reuse) should write far less for about the
same hits. vLLM's ``prefix_repetition`` dataset repeats every prefix equally and ShareGPT's loader
drops prompts over 1,024 tokens, so each point writes its own dataset: a JSONL file of vLLM's
``custom`` format (one ``{"prompt": ...}`` per line), sent in file order (``--disable-shuffle``)
without a chat template, by ``vllm bench serve`` as in the other workloads (through
``kvtier.bench.vllm_client``, which lets a line carry its request's body fields: with
``--retain-hints``, the default, each returning user's requests say their prefix comes back, as a client that
knows it will ask about the same document again would; one-off requests say nothing).

A point of ``users`` users: each user has a prefix of ``prefix_len`` tokens and ``requests_per_user``
requests (that prefix plus a fresh question of ``suffix_len`` tokens); beside them come one-off
requests, each a fresh prefix and question, so that ``one_off_share`` of all requests are one-off.
The order is a seeded shuffle, so a user's requests arrive spread over the run, between one-offs.
Prompts are random token ids decoded by the model's tokenizer and re-encoded to the exact length
(as ``prefix_repetition`` does), from ``--seed`` + the point's index: every row sees the same prompts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.vllm_client import OVERRIDES_FIELD

ONE_OFF_SHARE = 0.8  # requests whose prefix is never seen again
FIRST_TOKEN_ID = 16  # below it: the tokenizer's special and byte tokens, which decode unevenly


def retain_hint(prefix_len: int) -> dict[str, Any]:
    """What a returning user's request sends with --retain-hints: its prompt's first ``prefix_len``
    tokens (the user's document) come back, its question does not (the form kvtier.vllm.hints reads;
    not imported from there, which would import vLLM into the bench's CLI)."""
    return {"kv_transfer_params": {"kvtier": {"retain": prefix_len}}}


@dataclass(frozen=True)
class LongTailPoint:
    """The requests of one point: ``prompts`` in sending order, and which of them reuse a prefix."""

    prompts: list[str]
    user_of_request: list[int | None]  # the user of each request; None for a one-off request

    @property
    def one_off_requests(self) -> int:
        return sum(1 for user in self.user_of_request if user is None)


def one_off_count(users: int, requests_per_user: int, one_off_share: float) -> int:
    """One-off requests so that they make ``one_off_share`` of a point's requests."""
    assert 0.0 <= one_off_share < 1.0, one_off_share
    returning = users * requests_per_user
    return round(returning * one_off_share / (1.0 - one_off_share))


def exact_text(tokenizer: Any, rng: random.Random, length: int) -> str:
    """Text of random tokens that the tokenizer encodes back to exactly ``length`` tokens (without
    special tokens), so that prompts have the lengths asked for."""
    assert length >= 1, length
    ids = [rng.randrange(FIRST_TOKEN_ID, tokenizer.vocab_size) for _ in range(length)]
    for _ in range(8):  # decoding and re-encoding merges or splits a few tokens; a few rounds settle
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            return text
        ids = ids[:length] + [rng.randrange(FIRST_TOKEN_ID, tokenizer.vocab_size) for _ in range(length - len(ids))]
    return tokenizer.decode(ids[:length])  # within a token or two: the prefix is still shared exactly


def build_point(tokenizer: Any, plan: dict[str, Any], users: int, seed: int) -> LongTailPoint:
    """The prompts of one point (see the module's text)."""
    rng = random.Random(seed)
    per_user = plan["requests_per_user"]
    prefixes = [exact_text(tokenizer, rng, plan["prefix_len"]) for _ in range(users)]
    owners: list[int | None] = [user for user in range(users) for _ in range(per_user)]
    owners += [None] * one_off_count(users, per_user, plan["one_off_share"])
    rng.shuffle(owners)
    prompts = []
    for owner in owners:
        prefix = prefixes[owner] if owner is not None else exact_text(tokenizer, rng, plan["prefix_len"])
        prompts.append(prefix + exact_text(tokenizer, rng, plan["suffix_len"]))
    return LongTailPoint(prompts=prompts, user_of_request=owners)


def write_dataset(plan: dict[str, Any], users: int, seed: int, path: Path) -> LongTailPoint:
    """Writes one point's dataset (vLLM's ``custom`` JSONL) to ``path`` and returns it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(plan["model_dir"])
    point = build_point(tokenizer, plan, users, seed)
    with path.open("w", encoding="utf-8") as out:
        for prompt, user in zip(point.prompts, point.user_of_request, strict=True):
            line: dict[str, Any] = {"prompt": prompt}
            if user is not None and plan.get("retain_hints"):
                line[OVERRIDES_FIELD] = retain_hint(plan["prefix_len"])
            out.write(json.dumps(line) + "\n")
    return point


def dataset_args(path: Path, request_count: int, output_len: int) -> list[str]:
    """``vllm bench serve``'s options for a dataset file of ``write_dataset``."""
    return [
        "--dataset-name", "custom",
        "--dataset-path", str(path),
        "--custom-output-len", str(output_len),
        "--skip-chat-template",
        "--disable-shuffle",
        "--num-prompts", str(request_count),
    ]  # fmt: skip
