"""`kvtier bench ttft`'s prompts: seeded random token ids, the same in every engine process."""

from __future__ import annotations

import random

from kvtier.bench.ttft.plan import hit_tokens


def random_tokens(label: str, count: int, vocab_size: int) -> list[int]:
    rng = random.Random(f"kvtier.bench.ttft:{label}")
    return [rng.randrange(10, vocab_size - 10) for _ in range(count)]


PROMPT_EXTRA_TOKENS = 2
"""Tokens after the L that can be hits. Two, not one: ExampleConnector saves the first
(n - 1) // block * block tokens of an n-token prompt but looks up (n - 2) // block * block, so it
never hits a prompt of k * block + 1 tokens."""


def length_prompt(plan: dict, length_tokens: int, repeat: int) -> list[int]:
    """Experiment 1 prompt: L tokens that can be hits plus PROMPT_EXTRA_TOKENS always computed."""
    return random_tokens(f"p:{length_tokens}:{repeat}", length_tokens + PROMPT_EXTRA_TOKENS, plan["vocab_size"])


def hit_rate_base(plan: dict, rate: int, repeat: int) -> list[int]:
    """Experiment 2 stored part for one hit rate (distinct per rate: a load promotes blocks to DRAM)."""
    hit = hit_tokens(plan["hit_rate_length"], rate, plan["block_tokens"])
    return random_tokens(f"b:{plan['hit_rate_length']}:{rate}:{repeat}", hit, plan["vocab_size"])


def hit_rate_prompt(plan: dict, base: list[int], rate: int, repeat: int, suffix_label: str) -> list[int]:
    new_tokens = plan["hit_rate_length"] + PROMPT_EXTRA_TOKENS - len(base)
    return base + random_tokens(
        f"s:{suffix_label}:{plan['hit_rate_length']}:{rate}:{repeat}", new_tokens, plan["vocab_size"]
    )
