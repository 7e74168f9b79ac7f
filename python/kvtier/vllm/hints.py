"""What a request tells kvtier itself, in vLLM's ``kv_transfer_params`` (docs/vllm.md, "Retention hints").

A client that knows a prompt will come back (a system prompt, a document it will ask more about, a
conversation that goes on) says so: ``{"kv_transfer_params": {"kvtier": {"retain": true}}}`` in the
request's body, as OpenAI's ``prompt_cache_retention`` and Anthropic's ``cache_control`` let a client
say. ``"retain": N`` (a token count) says only the prompt's first N tokens come back, as a
``cache_control`` breakpoint marks where the shared part ends: the blocks that end within them are
retained, a unique tail is not. vLLM's OpenAI server hands the object to the request, and its
offloading scheduler to every manager call (``ReqContext.kv_transfer_params``, with each block's end
position), on both connector routes. Under ``write_admission: "reuse"`` the retained blocks a request
stores are written below DRAM at once, as if seen twice (``Store.note_retained``); others still wait
for evidence.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("kvtier.vllm")

PARAMS_KEY = "kvtier"  # kv_transfer_params["kvtier"]: kvtier's own hints, beside other connectors'
RETAIN_KEY = "retain"
WHOLE_REQUEST = 1 << 62  # ``"retain": true``: every block of the request, whatever its end position

_warned_bad_hint = False


def retained_tokens(kv_transfer_params: Any) -> int:
    """How many leading tokens of a request its ``kv_transfer_params`` say will be read again: 0 for
    none (no hint, ``false``), ``WHOLE_REQUEST`` for ``true``, N for ``"retain": N``. A malformed hint
    is ignored (the request is served as an unhinted one), with one warning per process that names
    the forms: a cache hint never fails a request."""
    if not isinstance(kv_transfer_params, Mapping) or PARAMS_KEY not in kv_transfer_params:
        return 0
    hints = kv_transfer_params[PARAMS_KEY]
    if isinstance(hints, Mapping) and RETAIN_KEY not in hints:
        return 0  # kvtier's object without this hint (another of its keys): nothing to say
    value = hints.get(RETAIN_KEY) if isinstance(hints, Mapping) else None
    if isinstance(value, bool):  # before int: a JSON boolean is a Python int too
        return WHOLE_REQUEST if value else 0
    if isinstance(value, int) and value >= 0:
        return min(value, WHOLE_REQUEST)
    _warn_once(hints)
    return 0


def retains(kv_transfer_params: Any) -> bool:
    """Whether a request's ``kv_transfer_params`` say any of its prompt will be read again."""
    return retained_tokens(kv_transfer_params) > 0


def is_retained(end_position: int | None, retained: int) -> bool:
    """Whether a block that ends at token ``end_position`` lies within the ``retained`` leading tokens.
    A block whose position the scheduler did not record counts as retained when any is: a hint costs a
    wrong guess bytes, never a hit."""
    assert retained >= 0, retained
    if retained == 0:
        return False
    return end_position is None or end_position <= retained


def _warn_once(hints: Any) -> None:
    global _warned_bad_hint
    if _warned_bad_hint:
        return
    _warned_bad_hint = True
    logger.warning(
        "kvtier: ignoring kv_transfer_params[%r] = %.200r; the forms kvtier reads are "
        '{"kvtier": {"retain": true}} and {"kvtier": {"retain": TOKENS}} (docs/vllm.md, "Retention hints")',
        PARAMS_KEY,
        hints,
    )
