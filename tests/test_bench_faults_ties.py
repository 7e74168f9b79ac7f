"""The near-tie check of ``kvtier bench faults`` (``kvtier.bench.faults_ties``), without an engine.

A toy model stands in for vLLM alone's greedy paths: tokens are bytes (some of them halves of a UTF-8
character, as a byte-level BPE's are), and each step's top logprobs are set per context. The checks:
an output on the path is ``same``; one that leaves it only by near ties is ``tie``, every divergence
followed on its own branch; a token further below, or not among the top ones, is ``wrong``; a reference
that is itself wrong clears nothing; rebuilt prompts of the wrong lengths check nothing; ``judge``
leaves cleared requests out of the wrong outputs. With the tiny model's real tokenizer: a path's text is
the one vLLM's detokenizer streams after the prompt (``stream_decoder``), also where the prompt ends
inside a character.

Run: ``.venv/bin/python -m pytest tests/test_bench_faults_ties.py -v``.
"""

from __future__ import annotations

import pytest

from kvtier.bench import faults, faults_ties
from kvtier.bench.faults_ties import Step

# token ids are byte values; 0xC3 then 0xA9 is "é", a character split over two tokens
A, B, C, D = (ord(letter) for letter in "abcd")
E_FIRST, E_SECOND = 0xC3, 0xA9


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


class ToyModel:
    """Greedy paths: after a context, the step ``steps[context]`` if set, else ``A`` with ``B`` 0.5 nats
    below and ``C`` 3 nats below. ``asked`` keeps every call, to see the branches followed."""

    def __init__(self, steps: dict[tuple[int, ...], Step] | None = None):
        self.steps = steps or {}
        self.asked: list[tuple[int, ...]] = []
        self.rated: list[int] = []

    def step(self, context: tuple[int, ...]) -> Step:
        return self.steps.get(context, Step(A, -1.0, {A: -1.0, B: -1.5, C: -4.0}))

    def rate(self, context: list[int], token: int) -> float:
        """A token's logprob after ``context`` as a prefill gives it: the step's top ones, and ``D``
        (never among them) 0.04 nats below ``A``, other tokens far below."""
        step = self.step(tuple(t for t in context if t))
        self.rated.append(token)
        return step.top.get(token, -1.04 if token == D else -20.0)

    def ask(self, prompt: list[int], tokens: int) -> list[Step]:
        context = tuple(token for token in prompt if token)  # the prompt's own tokens are 0s
        self.asked.append(context)
        path = []
        for _ in range(tokens):
            step = self.step(context)
            path.append(step)
            context = (*context, step.token)
        return path


def tie(token: int, other: int, gap_nats: float) -> Step:
    return Step(token, -1.0, {token: -1.0, other: -1.0 - gap_nats, C: -5.0})


def judge(model: ToyModel, output: str, tokens: int = 4, tie_nats: float = 0.1) -> dict:
    return faults_ties.judge_output(decode, model.ask, [0], output, tokens, tie_nats)


def test_an_output_on_the_greedy_path_is_the_same():
    assert judge(ToyModel(), "aaaa") == {"verdict": "same", "divergences": []}


def test_divergences_within_the_tie_are_followed_to_the_end():
    model = ToyModel({(A,): tie(A, B, 0.02), (A, B, A): tie(A, D, 0.05)})
    verdict = judge(model, "abad")
    assert verdict["verdict"] == "tie", verdict
    assert [(d["position"], d["gap_nats"]) for d in verdict["divergences"]] == [(1, 0.02), (3, 0.05)]
    assert model.asked == [(), (A, B)], "each branch asked from the output's own token, the last one complete"


def test_a_token_further_below_than_the_tie_is_wrong():
    verdict = judge(ToyModel({(A,): tie(A, B, 0.3)}), "abaa")
    assert verdict["verdict"] == "wrong" and verdict["divergences"] == [{"position": 1, "gap_nats": 0.3}]
    assert judge(ToyModel({(A,): tie(A, B, 0.3)}), "abaa", tie_nats=0.5)["verdict"] == "tie"


def test_a_token_not_among_the_top_ones_is_wrong():
    verdict = judge(ToyModel(), "adaa")
    assert verdict["verdict"] == "wrong" and "top" in verdict["why"]
    assert verdict["divergences"] == [{"position": 1, "gap_nats": None}]


def test_a_token_outside_the_top_ones_is_rated_by_a_prefill_and_judged_by_its_gap():
    """Flat logprobs (random weights): a batch's rounding may pick a token outside the top ones. Where
    the check can rate tokens, it finds the one the output took and judges its gap, not its rank."""
    model = ToyModel()
    verdict = faults_ties.judge_output(decode, model.ask, [0], "adaa", 4, 0.1, faults_ties.Beyond(model.rate, 128))
    assert verdict == {"verdict": "tie", "divergences": [{"position": 1, "gap_nats": 0.04, "beyond_top": True}]}
    assert model.rated == [D, A], "only the token whose text the output continues with, and the path's"
    strict = faults_ties.judge_output(decode, model.ask, [0], "adaa", 4, 0.01, faults_ties.Beyond(model.rate, 128))
    assert strict["verdict"] == "wrong" and strict["divergences"][0]["gap_nats"] == 0.04


def test_an_output_longer_than_the_path_is_wrong():
    assert judge(ToyModel(), "aaaaa")["verdict"] == "wrong"


def test_a_character_split_over_two_tokens_is_not_a_divergence():
    split: dict[tuple[int, ...], Step] = {
        (A,): Step(E_FIRST, -1.0, {E_FIRST: -1.0, B: -2.0}),
        (A, E_FIRST): Step(E_SECOND, -0.1, {E_SECOND: -0.1}),
    }
    assert judge(ToyModel(split), "aéa")["verdict"] == "same"  # 4 tokens: a, half, half, a
    # leaving the path on the split character's first half, by a near tie: still a tie, not wrong
    first: dict[tuple[int, ...], Step] = {(A,): Step(E_FIRST, -1.0, {E_FIRST: -1.0, B: -1.01})}
    assert judge(ToyModel(first), "abaa")["verdict"] == "tie"
    # and leaving it for an alternative that is itself a first half: judged on the next step
    second: dict[tuple[int, ...], Step] = {
        (A,): Step(B, -1.0, {B: -1.0, E_FIRST: -1.02}),
        (A, E_FIRST): Step(E_SECOND, -0.1, {E_SECOND: -0.1}),
    }
    assert judge(ToyModel(second), "aéa")["verdict"] == "tie"


def test_a_path_ending_inside_a_character_diverges_there():
    """The greedy path's last token is the first half of a character (its text shows nothing more)
    where the output took a letter: the divergence is that token, not the output being longer."""
    end: dict[tuple[int, ...], Step] = {(A, A, A): Step(E_FIRST, -1.0, {E_FIRST: -1.0, B: -1.01})}
    verdict = judge(ToyModel(end), "aaab")
    assert verdict["verdict"] == "tie" and verdict["divergences"] == [{"position": 3, "gap_nats": 0.01}]


def test_a_partial_character_at_the_end_is_not_streamed():
    """vLLM's stream never sends the replacement character of a last token that ends inside one (it
    holds the bytes back for a next token that never comes): that output is the path's."""
    end: dict[tuple[int, ...], Step] = {(A, A, A): Step(E_FIRST, -1.0, {E_FIRST: -1.0, B: -3.0})}
    assert judge(ToyModel(end), "aaa") == {"verdict": "same", "divergences": []}


def test_too_many_divergences_are_unchecked():
    model = ToyModel({context: tie(A, B, 0.01) for context in [(), (B,), (B, B), (B, B, B)]})
    verdict = faults_ties.judge_output(decode, model.ask, [0], "bbbb", 4, 0.1)
    assert verdict["verdict"] == "tie" and len(verdict["divergences"]) == 4
    many = "b" * (faults_ties.MAX_DIVERGENCES + 1)
    model = ToyModel({tuple([B] * n): tie(A, B, 0.01) for n in range(len(many))})
    assert faults_ties.judge_output(decode, model.ask, [0], many, len(many), 0.1)["verdict"] == "unchecked"


def rows_of(reference: list[str], **others: list[str]) -> list[dict]:
    measured = {"completed": len(reference), "failed": 0, "problems": []}
    rows = [{"row": "vllm", "outputs": reference, "input_lens": [3] * len(reference), **measured}]
    fault = {"fault": {"pid": 1}}  # injected under load
    return rows + [{"row": name, "outputs": outputs, **measured, **fault} for name, outputs in others.items()]


def check(model: ToyModel, rows: list[dict], prompts: list[str] | None = None) -> tuple:
    todo = faults_ties.differing(rows, frozenset())
    prompts = prompts or ["abc"] * len(rows[0]["outputs"])
    paths = (lambda prompt: decode, model.ask, lambda text: [0] * len(text), 0.1)
    return faults_ties.check_rows(rows, todo, prompts, 4, paths)


def test_a_run_clears_near_ties_and_keeps_wrong_outputs():
    model = ToyModel({(A,): tie(A, B, 0.02)})
    rows = rows_of(["aaaa", "aaaa", "aaaa"], **{"service-stop": ["abaa", "adaa", "aaaa"]})
    assert faults_ties.differing(rows, frozenset()) == {"service-stop": [0, 1]}
    assert faults_ties.differing(rows, frozenset({1})) == {"service-stop": [0]}
    cleared, record = check(model, rows)
    assert cleared == {"service-stop": frozenset({0})}
    assert record["rows"]["service-stop"][1]["verdict"] == "wrong" and record["problems"] == []
    assert faults_ties.gaps(record, rows=True) == [0.02] and faults_ties.gaps(record, rows=False) == []
    problems = faults.judge(rows, cleared)
    assert rows[1]["wrong_outputs"] == 1 and rows[1]["near_ties"] == 1
    assert problems == ["service-stop: 1 outputs differ from vLLM alone's"]
    assert faults.wrong_cell(rows[1]) == "1 (1 near ties cleared)"


def test_a_reference_off_its_own_path_clears_nothing():
    rows = rows_of(["adaa"], **{"service-kill": ["abaa"]})  # vLLM alone's own output is not a near tie
    cleared, record = check(ToyModel({(A,): tie(A, B, 0.02)}), rows)
    assert cleared == {"service-kill": frozenset()}
    assert record["problems"] and "request 0" in record["problems"][0]


def test_prompts_of_other_token_counts_check_nothing():
    rows = rows_of(["aaaa"], **{"service-kill": ["abaa"]})
    cleared, record = check(ToyModel(), rows, prompts=["seven t"])
    assert cleared == {} and "token counts" in record["problems"][0]


def test_prompts_are_aligned_to_the_server_as_vllm_bench_serve_does(monkeypatch):
    """When the server counts the first prompt's tokens other than the dataset did, ``vllm bench
    serve`` cuts every prompt the server makes longer to the dataset's count; otherwise it sends them
    as they are. Here the server's tokens are characters."""

    def server(url: str, payload: dict) -> dict:
        if url.endswith("/tokenize"):
            assert payload["add_special_tokens"] is False
            return {"tokens": [ord(c) for c in payload["prompt"]]}
        return {"prompt": "".join(chr(token) for token in payload["tokens"])}

    monkeypatch.setattr(faults_ties, "_post", server)
    assert faults_ties.align_to_server([("abc", 3), ("defg", 3)], "u", "m") == ["abc", "defg"]
    assert faults_ties.align_to_server([("abcd", 3), ("efgh", 3), ("ij", 3)], "u", "m") == ["abc", "efg", "ij"]


# --------------------------------------------------------------------------------------------
# the text the server streams, with the tiny model's real tokenizer
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from vllm.tokenizers import get_tokenizer

    from kvtier.models import ensure_model

    return get_tokenizer(str(ensure_model("tiny")))


def vllm_streamed(tokenizer, prompt: list[int], output: list[int]) -> str:
    """What vLLM's own detokenizer streams for ``output`` after ``prompt``, delta by delta, as its
    OpenAI server does for ``vllm bench serve`` (one token a step, no stop strings)."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    request = EngineCoreRequest(
        request_id="r", prompt_token_ids=prompt, mm_features=None, sampling_params=SamplingParams(),
        pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None, data_parallel_rank=None,
    )  # fmt: skip
    detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
    deltas = []
    for token in output:
        detokenizer.update([token], False)
        deltas.append(detokenizer.get_next_output_text(False, True))
    return "".join(deltas)


def partial_tokens(tokenizer) -> list[int]:
    """Byte-level tokens that are the first part of a character: alone they decode to U+FFFD."""
    found = [token for token in range(len(tokenizer)) if tokenizer.decode([token]) == "\ufffd"]
    assert len(found) >= 2, "the tiny model's byte-level BPE has byte tokens"
    return found


def test_a_paths_text_is_the_one_vllm_streams_after_its_prompt(tokenizer):
    """A prompt that ends inside a character (random token ids, as vLLM's prefix_repetition dataset
    makes them, often do: stop 62's request 3) changes the text vLLM streams for the output: its first
    text holds the prompt's own. ``stream_decoder`` renders a path as vLLM's detokenizer does, for such
    a prompt, a whole one, and outputs with characters split or left unfinished."""
    partial = partial_tokens(tokenizer)
    words = tokenizer.encode(" the store keeps every block", add_special_tokens=False)
    decoder = faults_ties.stream_decoder(tokenizer)
    for prompt in ([tokenizer.bos_token_id, *words, partial[0]], [tokenizer.bos_token_id, *words]):
        for output in (words, [partial[1], *words], [*words, partial[0]], [partial[0], partial[1], *words[:2]]):
            assert decoder(prompt)(output) == vllm_streamed(tokenizer, prompt, output), (prompt, output)
    ends_inside = [tokenizer.bos_token_id, *words, partial[0]]
    streamed = vllm_streamed(tokenizer, ends_inside, words)
    assert streamed != tokenizer.decode(words, skip_special_tokens=True)  # what the check used to compare
    assert streamed.endswith(tokenizer.decode(words)) and "store keeps" in streamed[: -len(tokenizer.decode(words))]


def test_an_output_after_a_prompt_ending_inside_a_character_is_the_same(tokenizer):
    """The check judges such an output ``same`` (it called it a divergence at its first token in every
    row, vLLM alone's included, before it rendered paths as the server streams them)."""
    partial = partial_tokens(tokenizer)
    words = tokenizer.encode(" a block comes back", add_special_tokens=False)[:4]
    prompt = [tokenizer.bos_token_id, *tokenizer.encode(" some words", add_special_tokens=False), partial[0]]

    def ask(context: list[int], tokens: int) -> list[Step]:
        done = len(context) - len(prompt)
        return [Step(token, -1.0, {token: -1.0}) for token in words[done : done + tokens]]

    output = vllm_streamed(tokenizer, prompt, words)
    decoder = faults_ties.stream_decoder(tokenizer)
    assert faults_ties.judge_output(decoder(prompt), ask, prompt, output, len(words), 0.1)["verdict"] == "same"
    plain = faults_ties.judge_output(tokenizer.decode, ask, prompt, output, len(words), 0.1)
    assert plain["verdict"] == "wrong"
