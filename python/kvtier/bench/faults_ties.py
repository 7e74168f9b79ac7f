"""Near ties: whether an output that differs from vLLM alone's is wrong, or the model's greedy choice
nearly tied (``kvtier bench faults``' output check, issue 36).

The random-weight presets have flat next-token distributions: their top tokens often differ by
hundredths of a nat. Under CPU batching (which requests share a step, how a prompt is split into
chunks, whether its prefix came from a cache) the same request then picks a different token from run
to run, without kvtier, and diverges from there. Comparing texts cannot tell that from kvtier serving
wrong KV. This module can, as vLLM's own tests compare logprobs (``check_logprobs_close``): a fresh
server of vLLM alone, one request at a time, gives each checked request's greedy path with the top
``TOP_LOGPROBS`` logprobs at every step. An output is

- ``same``: its text is the path's;
- ``tie``: at every token where it leaves the path, the token it took is among the top ones and within
  ``tie_nats`` of the path's; after a divergence the path is followed on from the output's own
  token (the prompt, the tokens so far and that token sent again as token ids), so every divergence of
  the whole output is checked, up to ``MAX_DIVERGENCES``;
- ``wrong``: it took a token further than ``tie_nats`` below the path's, or one that is not among the
  top ones where the check cannot rate others;
- ``unchecked``: more divergences than ``MAX_DIVERGENCES``, or the path could not be had.

A token outside the top ones is not wrong for that alone: where every logprob is flat (random
weights), a batch's rounding reorders dozens of tokens. The check then rates it (``Beyond``): of the
vocabulary's tokens whose text the output continues with, each one's logprob after the same context,
and the path's token's, from a prefill of the context and the token (``prompt_logprobs``), and judges
the likeliest by the same ``tie_nats``. Only ``same`` and ``tie`` clear an output. The reference
run's own output is judged the same way: it measures the noise (its gaps are reported), and one
judged ``wrong`` means the check's prompts or threshold are off, which the run reports as a problem
instead of clearing anything.

The prompts are the load's: vLLM's ``prefix_repetition`` dataset rebuilt in this process from the
plan's seed (``vllm bench serve`` sends it in the same order; the saved prompt lengths are compared).
A path's text is the one the server streams (``stream_decoder``): vLLM renders the output tokens after
the prompt's, so a prompt that ends inside a character (random token ids often do) changes the
output's first text, which then holds the prompt's own.
"""

from __future__ import annotations

import copy
import json
import urllib.request
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOP_LOGPROBS = 5
MAX_DIVERGENCES = 8
DEFAULT_TIE_NATS = 0.1
REQUEST_TIMEOUT_S = 600
CLEARED = ("same", "tie")
BASELINE_ROW = "vllm"  # the load against vLLM alone: the reference outputs


@dataclass(frozen=True)
class Step:
    """One generated token of a greedy path: the token, its logprob, the top tokens' logprobs."""

    token: int
    logprob: float
    top: dict[int, float]


Decode = Callable[[list[int]], str]  # output token ids -> their text, as the server streams it
Decoder = Callable[[list[int]], Decode]  # prompt token ids -> the Decode of that prompt's outputs
Ask = Callable[[list[int], int], list[Step]]  # (prompt token ids, tokens to generate) -> the greedy path
Rate = Callable[[list[int], int], float]  # (context token ids, a token) -> its logprob after them
MAX_RATED = 8  # tokens outside the top ones rated at one divergence (each a request)


@dataclass(frozen=True)
class Beyond:
    """How a divergence to a token outside the top ones is judged: ``rate`` gives a token's logprob
    after a context; ``vocab_size`` token ids are searched for the ones the output continues with."""

    rate: Rate
    vocab_size: int


def _shown(decode: Decode, ids: list[int]) -> str:
    """The text of ``ids`` as far as it is whole: a trailing partial character (a byte-level token
    that ends inside one) decodes to U+FFFD until the next token completes it."""
    return decode(ids).rstrip("\ufffd")


def first_divergence(decode: Decode, path: list[int], output: str, start: int) -> int | None:
    """The first position from ``start`` whose token takes the path's text off ``output``; None if the
    output is the path's text."""
    if _shown(decode, path) == output.rstrip("\ufffd"):  # vLLM's stream holds back a last partial character
        return None
    position = next(
        (k for k in range(start, len(path)) if not _compatible(_shown(decode, path[: k + 1]), output)), len(path)
    )  # fmt: skip
    # the character the output leaves the path on may have begun with tokens that showed nothing yet
    # (at the end: the path's last tokens are the first part of a character the output does not have)
    while position > start and _shown(decode, path[:position]) == _shown(decode, path[: position - 1]):
        position -= 1
    return position  # len(path): the path's text is a prefix of the output, which went on past it


def _compatible(text: str, output: str) -> bool:
    return output.startswith(text) or text.startswith(output)


def taken_alternative(decode: Decode, before: list[int], step: Step, output: str) -> int | None:
    """The token among ``step``'s top ones, other than the path's, that the output took after
    ``before``: the likeliest whose text the output continues with; failing that, the likeliest that
    shows no text yet (the first part of a character), which the next step's check then judges."""
    shown_before = len(_shown(decode, before))
    pending = None
    for token, _ in sorted(step.top.items(), key=lambda item: -item[1]):
        text = _shown(decode, [*before, token])
        if token == step.token or not _compatible(text, output):
            continue
        if len(text) > shown_before:
            return token
        pending = token if pending is None else pending
    return pending


def rated_alternative(
    decode: Decode, beyond: Beyond, prompt: list[int], before: list[int], step: Step, output: str
) -> tuple[int, float] | None:
    """The token outside ``step``'s top ones that the output took after ``before`` (the likeliest of
    those whose text it continues with) and its gap below the path's token in nats, both rated from a
    prefill; None if no token of the vocabulary continues the output."""
    shown_before = len(_shown(decode, before))
    candidates = []
    for token in range(beyond.vocab_size):
        text = _shown(decode, [*before, token])
        if token != step.token and token not in step.top and len(text) > shown_before and _compatible(text, output):
            candidates.append(token)
    if not candidates:
        return None
    context = [*prompt, *before]
    rated = {token: beyond.rate(context, token) for token in candidates[:MAX_RATED]}
    token = max(rated, key=lambda candidate: rated[candidate])
    return token, beyond.rate(context, step.token) - rated[token]


def judge_output(
    decode: Decode, ask: Ask, prompt: list[int], output: str, tokens: int, tie_nats: float,
    beyond: Beyond | None = None,
) -> dict:  # fmt: skip
    """The verdict on one output of ``tokens`` tokens against the greedy path of ``prompt`` (see the
    module's text), with each divergence's position and gap in nats."""
    assert tie_nats >= 0.0, tie_nats
    context: list[int] = []
    divergences: list[dict[str, Any]] = []
    while True:
        steps = ask([*prompt, *context], tokens - len(context)) if len(context) < tokens else []
        path = [*context, *(step.token for step in steps)]
        position = first_divergence(decode, path, output, len(context))
        if position is None:
            return {"verdict": "tie" if divergences else "same", "divergences": divergences}
        if position >= len(path):
            return {"verdict": "wrong", "divergences": divergences, "why": "longer than the path"}
        step = steps[position - len(context)]
        token = taken_alternative(decode, path[:position], step, output)
        found = (token, step.logprob - step.top[token]) if token is not None else None
        if found is None and beyond is not None:
            found = rated_alternative(decode, beyond, prompt, path[:position], step, output)
        if found is None:
            divergences.append({"position": position, "gap_nats": None})
            return {"verdict": "wrong", "divergences": divergences, "why": f"not in the top {TOP_LOGPROBS}"}
        token, gap_nats = found
        beyond_top = {} if token in step.top else {"beyond_top": True}  # rated by a prefill
        divergences.append({"position": position, "gap_nats": round(gap_nats, 6), **beyond_top})
        if gap_nats > tie_nats:
            return {"verdict": "wrong", "divergences": divergences, "why": f"{gap_nats:.4f} nats below the top"}
        if len(divergences) >= MAX_DIVERGENCES:
            return {"verdict": "unchecked", "divergences": divergences, "why": "too many divergences"}
        context = [*path[:position], token]


# --------------------------------------------------------------------------------------------
# the server's side
# --------------------------------------------------------------------------------------------


def _post(url: str, payload: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
        return json.loads(answer.read())


def _token_id(name: str) -> int:
    assert name.startswith("token_id:"), name  # return_tokens_as_token_ids
    return int(name[len("token_id:") :])


def server_asker(url: str, model: str) -> Ask:
    """Greedy paths from a ``vllm serve`` at ``url``: one completion of token ids, as the load's
    requests (temperature 0, EOS ignored), with the top logprobs as token ids."""

    def ask(prompt: list[int], tokens: int) -> list[Step]:
        payload = {
            "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
            "logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True,
        }  # fmt: skip
        logprobs = _post(f"{url}/v1/completions", payload)["choices"][0]["logprobs"]
        columns = (logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"])
        return [
            Step(_token_id(name), logprob, {_token_id(key): value for key, value in top.items()})
            for name, logprob, top in zip(*columns, strict=True)
        ]

    return ask


def server_rater(url: str, model: str) -> Rate:
    """A token's logprob after a context from a ``vllm serve`` at ``url``: the context and the token
    sent as a prompt of token ids, the token's prompt logprob (one prefill; vLLM's prefix cache holds
    the context after the first)."""

    def rate(context: list[int], token: int) -> float:
        payload = {"model": model, "prompt": [*context, token], "max_tokens": 1, "prompt_logprobs": 0}
        last = _post(f"{url}/v1/completions", payload)["choices"][0]["prompt_logprobs"][-1]
        return float(last[str(token)]["logprob"])

    return rate


INVALID_PREFIX = "Invalid prefix encountered"  # tokenizers' DecodeStream error vLLM recovers from
RENDERED_STREAMS = 512  # streams a prompt's decoder keeps (the oldest used go first)


def stream_decoder(tokenizer: Any) -> Decoder:
    """The text vLLM 0.32's OpenAI server streams for output token ids after a prompt: its
    ``FastIncrementalDetokenizer``, a ``tokenizers`` ``DecodeStream`` primed with the prompt's ids
    (special tokens skipped), each token stepped in turn, a stream that loses its prefix restarted
    without the prompt. Where the prompt ends inside a character, the first text holds the prompt's
    (the stream had no whole prefix yet); a character split over output tokens shows when whole.
    ``tokenizer``: a fast (``tokenizers``-backed) Hugging Face tokenizer, as vLLM's for our models."""
    from tokenizers.decoders import DecodeStream

    backend = tokenizer._tokenizer  # what vLLM steps: the tokenizers.Tokenizer
    assert getattr(tokenizer, "is_fast", False), "vLLM renders a slow tokenizer's outputs otherwise"

    def step(stream: Any, token: int) -> tuple[Any, str]:
        try:
            return stream, stream.step(backend, token) or ""
        except Exception as error:
            if not str(error).startswith(INVALID_PREFIX):
                raise
            stream = DecodeStream(skip_special_tokens=True)
            return stream, stream.step(backend, token) or ""

    def decoder(prompt: list[int]) -> Decode:
        # the streams of paths rendered so far: the check renders a path's prefixes in turn and
        # every token of the vocabulary after one prefix (a stream copied is independent)
        primed = DecodeStream(ids=prompt, skip_special_tokens=True)
        rendered: OrderedDict[tuple[int, ...], tuple[Any, str]] = OrderedDict()

        def decode(ids: list[int]) -> str:
            key = tuple(ids)
            known = max((length for length in range(1, len(key) + 1) if key[:length] in rendered), default=0)
            stream, text = rendered[key[:known]] if known else (primed, "")
            if known:
                rendered.move_to_end(key[:known])
            for position in range(known, len(key)):
                stream, piece = step(copy.copy(stream), key[position])
                text += piece
                rendered[key[: position + 1]] = (stream, text)
            while len(rendered) > RENDERED_STREAMS:
                rendered.popitem(last=False)
            return text

        return decode

    return decoder


def tokenize(url: str, model: str, prompt: str, special: bool = True) -> list[int]:
    """The prompt's token ids as the server makes them of a completion's text (``special``: with the
    special tokens a completion adds)."""
    return _post(f"{url}/tokenize", {"model": model, "prompt": prompt, "add_special_tokens": special})["tokens"]


def align_to_server(samples: list[tuple[str, int]], url: str, model: str) -> list[str]:
    """The prompts as ``vllm bench serve`` sent them: when the server's tokenizer makes the first one
    longer or shorter than the dataset's count, it cuts every prompt the server makes longer to its
    count (``_align_prompts_to_server_tokenizer`` in vLLM 0.32's ``benchmarks/serve.py``)."""
    if len(tokenize(url, model, samples[0][0], special=False)) == samples[0][1]:
        return [prompt for prompt, _ in samples]
    aligned = []
    for prompt, length in samples:
        ids = tokenize(url, model, prompt, special=False)
        cut = _post(f"{url}/detokenize", {"model": model, "tokens": ids[:length]})["prompt"]
        aligned.append(prompt if len(ids) <= length else cut)
    return aligned


def load_prompts(plan: dict[str, Any], tokenizer: Any) -> list[tuple[str, int]]:
    """The load's prompts in sending order, with the dataset's token counts: ``vllm bench serve``'s
    prefix_repetition dataset rebuilt from the plan (kvtier.bench.serve_points.bench_command's
    arguments), before ``align_to_server``."""
    from vllm.benchmarks.datasets.datasets import PrefixRepetitionRandomDataset

    users = plan["users"]
    requests = PrefixRepetitionRandomDataset(random_seed=plan["seed"], dataset_path=None).sample(
        tokenizer=tokenizer, num_requests=users * plan["requests_per_user"], prefix_len=plan["prefix_len"],
        suffix_len=plan["suffix_len"], num_prefixes=users, output_len=plan["output_len"],
    )  # fmt: skip
    return [(str(request.prompt), int(request.prompt_len)) for request in requests]


# --------------------------------------------------------------------------------------------
# a run's check
# --------------------------------------------------------------------------------------------


def is_reference(row: str) -> bool:
    """Whether ``row`` is a run of vLLM alone (``vllm``, ``vllm-2``, ...: ``--reference-runs``)."""
    return row == BASELINE_ROW or (row.startswith(f"{BASELINE_ROW}-") and row[len(BASELINE_ROW) + 1 :].isdigit())


def differing_requests(
    reference: list[str], outputs: list[str], errors: list[str], skip: frozenset[int] = frozenset()
) -> list[int]:
    """The requests whose generated text differs from the reference's, leaving out failed ones and
    those in ``skip``."""
    return [
        index for index, (expected, got) in enumerate(zip(reference, outputs, strict=False))
        if expected != got and index not in skip and not (index < len(errors) and errors[index])
    ]  # fmt: skip


def wrong_outputs(
    reference: list[str], outputs: list[str], errors: list[str], unstable: frozenset[int] = frozenset()
) -> int:
    """Requests whose generated text differs from the reference's (a failed request counts as failed,
    not as wrong; an ``unstable`` one, whose output vLLM alone does not repeat, counts as neither); a
    different number of requests counts as that many wrong."""
    return abs(len(reference) - len(outputs)) + len(differing_requests(reference, outputs, errors, unstable))


def unstable_requests(rows: list[dict[str, Any]]) -> frozenset[int]:
    """The requests whose outputs differ between the runs of vLLM alone (``--reference-runs``)."""
    runs = [record["outputs"] for record in rows if is_reference(record["row"]) and record.get("outputs")]
    if len(runs) < 2:
        return frozenset()
    return frozenset(i for i in range(len(runs[0])) if any(i >= len(run) or run[i] != runs[0][i] for run in runs))


def wrong_cell(record: dict[str, Any]) -> str:
    """A row's wrong outputs as the table shows them, with the near ties cleared."""
    wrong = str(record.get("wrong_outputs", "-"))
    return f"{wrong} ({record['near_ties']} near ties cleared)" if record.get("near_ties") else wrong


def differing(rows: list[dict[str, Any]], unstable: frozenset[int]) -> dict[str, list[int]]:
    """Per row after the first (vLLM alone), the requests whose output differs from the first row's,
    leaving out failed requests and ``unstable`` ones."""
    if not rows or not rows[0].get("outputs"):
        return {}
    found = {}
    for record in rows[1:]:
        outputs, errors = record.get("outputs") or [], record.get("request_errors") or []
        indices = differing_requests(rows[0]["outputs"], outputs, errors, unstable)
        if indices:
            found[record["row"]] = indices
    return found


def check_rows(
    rows: list[dict[str, Any]], todo: dict[str, list[int]], prompts: list[str], tokens: int, paths: Any
) -> tuple[dict[str, frozenset[int]], dict[str, Any]]:
    """Judges the ``todo`` outputs (``tokens`` tokens each) of each row and, for each of their
    requests, the reference's own output; ``paths``: (decoder, ask, tokenize, tie_nats[, beyond]), the
    decoder giving each prompt's ``Decode``. Returns the cleared requests per row and the check's
    record (verdicts, the reference's gaps, problems)."""
    decoder, ask, to_ids, tie_nats, *rest = paths
    beyond = rest[0] if rest else None
    reference = rows[0]
    # the load's prompt lengths are the server's counts (vllm bench serve takes them from the usage)
    prompt_ids = [to_ids(prompt) for prompt in prompts]
    if (reference.get("input_lens") or []) != [len(ids) for ids in prompt_ids]:
        return {}, {"problems": ["the rebuilt prompts' token counts differ from the load's: nothing checked"]}
    indices = sorted({index for found in todo.values() for index in found})

    def verdict(index: int, output: str) -> dict:
        prompt = prompt_ids[index]
        return judge_output(decoder(prompt), ask, prompt, output, tokens, tie_nats, beyond)

    own = {index: verdict(index, reference["outputs"][index]) for index in indices}
    problems = [
        f"vLLM alone's own output of request {index} is {own[index]['verdict']} against its greedy path alone: "
        "that request is not cleared" for index in indices if own[index]["verdict"] not in CLEARED
    ]  # fmt: skip
    cleared, verdicts = {}, {}
    for row, found in todo.items():
        record = next(record for record in rows if record["row"] == row)
        verdicts[row] = {index: verdict(index, record["outputs"][index]) for index in found}
        cleared[row] = frozenset(
            index for index, judged in verdicts[row].items()
            if judged["verdict"] in CLEARED and own[index]["verdict"] in CLEARED
        )  # fmt: skip
    return cleared, {"tie_nats": tie_nats, "reference": own, "rows": verdicts, "problems": problems}


def gaps(check: dict[str, Any], rows: bool) -> list[float]:
    """The gaps (nats) of the check's divergences: the kvtier rows' (``rows``) or vLLM alone's own."""
    if rows:
        judged = [verdict for found in check.get("rows", {}).values() for verdict in found.values()]
    else:
        judged = list(check.get("reference", {}).values())
    return [d["gap_nats"] for v in judged for d in v["divergences"] if d["gap_nats"] is not None]


def run_check(
    plan: dict[str, Any], rows: list[dict[str, Any]], todo: dict[str, list[int]], out_dir: Path, tie_nats: float
) -> tuple[dict[str, frozenset[int]], dict[str, Any]]:
    """``check_rows`` against a fresh server of vLLM alone (started here, stopped after)."""
    from vllm.tokenizers import get_tokenizer

    from kvtier.bench import serve_servers

    tokenizer = get_tokenizer(plan["model_dir"])
    samples = load_prompts(plan, tokenizer)
    server, log_path, _ = serve_servers.start_server(plan, BASELINE_ROW, 0, out_dir / "tie-check", [], [])
    try:
        server.wait_healthy()
        prompts = align_to_server(samples, server.url, server.model)
        paths = (
            stream_decoder(tokenizer),
            server_asker(server.url, server.model),
            lambda text: tokenize(server.url, server.model, text),
        )
        beyond = Beyond(server_rater(server.url, server.model), len(tokenizer))
        cleared, check = check_rows(rows, todo, prompts, plan["output_len"], (*paths, tie_nats, beyond))
    finally:
        server.stop()
    check["server_log"] = str(log_path)
    return cleared, check
