"""What a request tells kvtier itself, in vLLM's ``kv_transfer_params`` (docs/vllm.md, "Retention hints").

A client that knows a prompt will come back (a system prompt, a document it will ask more about, a
conversation that goes on) says so: ``{"kv_transfer_params": {"kvtier": {"retain": true}}}`` in the
request's body, as OpenAI's ``prompt_cache_retention`` and Anthropic's ``cache_control`` let a client
say. vLLM's OpenAI server hands the object to the request, and its offloading scheduler to every
manager call (``ReqContext.kv_transfer_params``), on both connector routes. Under
``write_admission: "reuse"`` the blocks such a request stores are written below DRAM at once, as if
seen twice (``Store.note_retained``); unhinted ones still wait for evidence.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("kvtier.vllm")

PARAMS_KEY = "kvtier"  # kv_transfer_params["kvtier"]: kvtier's own hints, beside other connectors'
RETAIN_KEY = "retain"

_warned_bad_hint = False


def retains(kv_transfer_params: Any) -> bool:
    """Whether a request's ``kv_transfer_params`` say its prompt will be read again. A malformed hint
    is ignored (the request is served as an unhinted one), with one warning per process that names
    the expected form: a cache hint never fails a request."""
    if not isinstance(kv_transfer_params, Mapping) or PARAMS_KEY not in kv_transfer_params:
        return False
    hints = kv_transfer_params[PARAMS_KEY]
    if isinstance(hints, Mapping) and RETAIN_KEY not in hints:
        return False  # kvtier's object without this hint (another of its keys): nothing to say
    value = hints.get(RETAIN_KEY) if isinstance(hints, Mapping) else None
    if isinstance(value, bool):
        return value
    _warn_once(hints)
    return False


def _warn_once(hints: Any) -> None:
    global _warned_bad_hint
    if _warned_bad_hint:
        return
    _warned_bad_hint = True
    logger.warning(
        "kvtier: ignoring kv_transfer_params[%r] = %.200r; the form kvtier reads is "
        '{"kvtier": {"retain": true}} (docs/vllm.md, "Retention hints")',
        PARAMS_KEY,
        hints,
    )
