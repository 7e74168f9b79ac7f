"""What a request's ``kv_transfer_params`` tell kvtier (``kvtier.vllm.hints``): the retention hint, and
malformed hints ignored with one warning that names the form (a cache hint never fails a request)."""

from __future__ import annotations

import pytest

hints = pytest.importorskip("kvtier.vllm.hints")


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"kvtier": {"retain": True}}, True),
        ({"kvtier": {"retain": False}}, False),
        ({"kvtier": {}, "do_remote_prefill": True}, False),
        ({"max_load_tokens": 5}, False),
        (None, False),
    ],
)
def test_a_request_says_its_prompt_comes_back_only_in_kvtiers_form(params, expected):
    assert hints.retains(params) is expected


@pytest.mark.parametrize(
    ("params", "tokens"),
    [
        ({"kvtier": {"retain": True}}, hints.WHOLE_REQUEST),
        ({"kvtier": {"retain": False}}, 0),
        ({"kvtier": {"retain": 2048}}, 2048),
        ({"kvtier": {"retain": 0}}, 0),
        ({"kvtier": {"retain": 1 << 70}}, hints.WHOLE_REQUEST),
        ({"kvtier": {"retain": -1}}, 0),
        ({"kvtier": {"retain": 12.5}}, 0),
    ],
)
def test_a_hint_retains_the_whole_request_or_its_first_tokens(params, tokens):
    assert hints.retained_tokens(params) == tokens


def test_a_block_is_retained_when_it_ends_within_the_hinted_tokens():
    assert hints.is_retained(2048, 2048) and not hints.is_retained(2064, 2048)
    assert hints.is_retained(10**9, hints.WHOLE_REQUEST)
    assert not hints.is_retained(16, 0), "no hint: nothing retained"
    assert hints.is_retained(None, 16), "an unrecorded position: a hint costs bytes, never a hit"


def test_a_malformed_hint_is_ignored_with_one_warning_that_names_the_form(monkeypatch):
    # The logger's own calls are counted: handlers other tests install (vLLM's, kvtier.vllm.logs)
    # would show one record more than once.
    warnings: list[str] = []
    monkeypatch.setattr(hints, "_warned_bad_hint", False)
    monkeypatch.setattr(hints.logger, "warning", lambda message, *args: warnings.append(message % args))
    assert not hints.retains({"kvtier": {"another_hint": 1}})
    assert not warnings, "kvtier's object without the retain hint is not malformed"
    assert not hints.retains({"kvtier": {"retain": "yes"}})
    assert not hints.retains({"kvtier": True})
    assert not hints.retains({"kvtier": {"retain": -5}})
    assert len(warnings) == 1 and '{"kvtier": {"retain": true}}' in warnings[0], warnings
    assert '{"kvtier": {"retain": TOKENS}}' in warnings[0], warnings
