"""``gateway.proxy.choices`` and ``gateway.proxy.penalties`` on plain data: a stream of
several choices cut at any point, each unfinished choice continued from its own token ids,
re-frames into exactly the reference; the penalties' bias is what vLLM's penalties took.

The backend's frames come from the simulator's framer (``loadtest/sim/responses.py``,
vLLM 0.32's shapes): no server, no I/O."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.proxy.choices import ChoicesProgress, progress_of
from gateway.proxy.completion_request import parse_body
from gateway.proxy.continuation import Progress, not_continuable
from gateway.proxy.endpoints import CHAT, COMPLETIONS
from gateway.proxy.penalties import clamped, continued_bias
from loadtest.sim.protocol import parse_request
from loadtest.sim.records import Token
from loadtest.sim.responses import StreamFramer

MODEL = "sim-model"


def frames(body: dict[str, Any], chat: bool) -> list[dict[str, Any]]:
    """Every event the simulator streams for ``body`` (as fairgate asks: ids and usage),
    the choices' token frames interleaved as vLLM sends them (step by step)."""
    body = {**body, "model": MODEL, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    req = parse_request(body, chat=chat, headers_priority=None, model_len=4096, seed=0)
    framer = StreamFramer(req, "chatcmpl-ref" if chat else "cmpl-ref", MODEL)
    raw = framer.opening()
    for step in range(max(req.output_tokens)):
        for choice, count in enumerate(req.output_tokens):
            if step < count:
                finish = (("length" if req.max_tokens == count else "stop")
                          if step == count - 1 else None)
                raw += framer.token(Token(step, 0.0, choice, finish))
    raw += framer.closing()
    return [json.loads(f[6:]) for f in raw.split(b"\n\n") if f.startswith(b"data: {")]


def per_choice(events: list[dict[str, Any]], chat: bool) -> dict[int, tuple[str, Any]]:
    """Each choice's whole text and finish reason as a client reads them."""
    text: dict[int, str] = defaultdict(str)
    finish: dict[int, Any] = {}
    for event in events:
        for choice in event["choices"]:
            part = choice["delta"].get("content") if chat else choice["text"]
            text[choice["index"]] += part or ""
            if choice.get("finish_reason") is not None:
                finish[choice["index"]] = choice["finish_reason"]
    return {i: (text[i], finish.get(i)) for i in text}


@settings(max_examples=60, deadline=None)
@given(chat=st.booleans(), n=st.integers(2, 4), ignore_eos=st.booleans(),
       limit=st.integers(1, 30), seed=st.integers(0, 50), prompt=st.text(min_size=1,
                                                                          max_size=20),
       cut=st.floats(0, 1, exclude_max=True))
def test_each_choice_continues_from_its_own_ids_into_the_reference(
        chat: bool, n: int, ignore_eos: bool, limit: int, seed: int, prompt: str,
        cut: float) -> None:
    body: dict[str, Any] = {"max_tokens": limit, "ignore_eos": ignore_eos, "n": n,
                            "temperature": 1.0, "seed": seed}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat
                else {"prompt": prompt})
    reference = frames(body, chat)
    endpoint = CHAT if chat else COMPLETIONS
    creq = parse_body({**body, "model": MODEL}, endpoint)
    progress = progress_of(creq)
    assert isinstance(progress, ChoicesProgress), progress
    split = int(cut * len(reference))
    got = [progress.original(json.loads(json.dumps(e))) for e in reference[:split]]
    if not progress.resumable:
        # nothing came (sent again as it was) or every choice's last token came
        assert split == 0 or (not chat and split <= n) or progress.finish_reason, split
        return
    follow: list[dict[str, Any]] = []
    bodies = progress.continuation_bodies(creq, True)
    assert all(b["seed"] == seed + i % n and "n" not in b for i, b in bodies), bodies
    for index, sent in bodies:
        for event in frames(sent, chat=False):
            for choice in event["choices"]:
                choice["index"] = index  # as gateway/proxy/fan_in.py re-indexes them
            if event["choices"]:
                follow.append(event)
    follow.append(frames(bodies[0][1], chat=False)[-1])  # the one usage frame
    got += [progress.continued(e) for e in follow]
    assert per_choice(got, chat) == per_choice(reference, chat), (split, bodies)
    assert got[-1]["usage"] == reference[-1]["usage"], (got[-1], reference[-1])
    assert {e["id"] for e in got} == {reference[0]["id"]}


def test_a_finished_choice_stays_finished_and_only_the_others_continue() -> None:
    body = {"model": MODEL, "prompt": "abc", "n": 2, "max_tokens": 8, "temperature": 1,
            "seed": 5}
    creq = parse_body(body, COMPLETIONS)
    progress = progress_of(creq)
    assert isinstance(progress, ChoicesProgress)
    progress.original({"id": "c", "choices": [
        {"index": 0, "text": "a", "prompt_token_ids": [1, 2], "token_ids": [7],
         "finish_reason": "stop"},
        {"index": 1, "text": "b", "prompt_token_ids": [1, 2], "token_ids": [9, 10]}]})
    bodies = progress.continuation_bodies(creq, True)
    assert [(i, b["prompt"], b["max_tokens"], b["seed"]) for i, b in bodies] == [
        (1, [1, 2, 9, 10], 6, 6)], bodies
    assert progress.usage() == {"prompt_tokens": 2, "completion_tokens": 3,
                                "total_tokens": 5}


def test_a_batch_of_prompts_counts_each_prompt_once_and_shares_ids_within_a_prompt(
        ) -> None:
    body = {"model": MODEL, "prompt": ["a", "b"], "n": 2, "temperature": 1}
    creq = parse_body(body, COMPLETIONS)
    assert creq.choices == (2, 2)
    progress = progress_of(creq)
    assert isinstance(progress, ChoicesProgress)
    progress.original({"id": "c", "choices": [
        {"index": 0, "text": "x", "prompt_token_ids": [1], "token_ids": [5]}]})
    assert not progress.resumable  # prompt 1's ids never came
    progress.original({"id": "c", "choices": [
        {"index": 3, "text": "y", "prompt_token_ids": [2, 2], "token_ids": [6]}]})
    assert progress.resumable
    prompts = {i: b["prompt"] for i, b in progress.continuation_bodies(creq, True)}
    assert prompts == {0: [1, 5], 1: [1], 2: [2, 2], 3: [2, 2, 6]}, prompts
    assert progress.usage()["prompt_tokens"] == 3


def test_one_choice_one_prompt_keeps_the_single_progress() -> None:
    creq = parse_body({"model": MODEL, "prompt": ["only"], "n": 1}, COMPLETIONS)
    assert type(progress_of(creq)) is Progress


def test_several_choices_and_penalties_are_continuable_best_of_is_ignored() -> None:
    for endpoint, extra in ((CHAT, {"n": 3, "best_of": 4}),
                            (COMPLETIONS, {"prompt": ["a", "b"]}),
                            (CHAT, {"presence_penalty": 0.5, "frequency_penalty": 1}),
                            (CHAT, {"frequency_penalty": 1, "repetition_penalty": 1.0})):
        body = {"model": MODEL, "prompt": "p", "messages": [{"role": "user",
                                                             "content": "p"}], **extra}
        assert not_continuable(parse_body(body, endpoint)) is None, extra


def test_the_frequency_penalty_becomes_a_bias_on_the_tokens_generated() -> None:
    sampling = {"frequency_penalty": 0.5, "presence_penalty": 0.25,
                "logit_bias": {"7": 3.0, "8": 150}}
    bias = continued_bias(sampling, [7, 7, 9, 7])
    # vLLM subtracts frequency * count + presence * (count > 0) from each token's logit
    assert bias == {"7": 3.0 - 1.5 - 0.25, "8": 100.0, "9": -0.75}, bias
    assert continued_bias({"logit_bias": {"1": 2}}, [1]) is None  # no penalty: as sent
    assert continued_bias({"frequency_penalty": 1.0}, []) is None
    assert not clamped(sampling, [7] * 10)
    assert clamped({"frequency_penalty": 2.0}, [7] * 51)  # 102 past vLLM's ±100


def test_the_continuation_body_carries_the_penalties_bias() -> None:
    creq = parse_body({"model": MODEL, "prompt": "p", "frequency_penalty": 1.0,
                       "presence_penalty": 0.5, "max_tokens": 9}, COMPLETIONS)
    progress = Progress.of(creq)
    assert progress is not None
    progress.prompt_ids, progress.generated = [1], [4, 4, 5]
    body = progress.continuation_body(creq, True)
    assert body["logit_bias"] == {"4": -2.5, "5": -1.5}, body
    assert (body["frequency_penalty"], body["presence_penalty"]) == (1.0, 0.5), body


def test_a_client_bias_key_that_is_no_token_id_is_passed_on_as_given() -> None:
    bias = continued_bias({"frequency_penalty": 1.0, "logit_bias": {"x": 1, "-3": 2}}, [4])
    assert bias == {"x": 1.0, "-3": 2.0, "4": -1.0}, bias
