"""``gateway.proxy.continuation`` on plain data: a reference stream cut at any point and
continued by token ids re-frames into exactly the reference.

The backend's frames come from the simulator's framer (``loadtest/sim/responses.py``,
vLLM 0.32's shapes), as plain dicts: no server, no I/O."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.proxy.completion_request import parse_body
from gateway.proxy.continuation import Progress, not_continuable
from gateway.proxy.endpoints import CHAT, COMPLETIONS, EMBEDDINGS
from loadtest.sim.protocol import parse_request
from loadtest.sim.records import Token
from loadtest.sim.responses import StreamFramer

MODEL = "sim-model"


def frames(body: dict[str, Any], chat: bool) -> list[dict[str, Any]]:
    """Every event the backend streams for ``body`` (as fairgate asks: ids and usage)."""
    body = {**body, "model": MODEL, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    req = parse_request(body, chat=chat, headers_priority=None, model_len=4096, seed=0)
    framer = StreamFramer(req, "chatcmpl-ref" if chat else "cmpl-ref", MODEL)
    count = req.output_tokens[0]
    raw = framer.opening() + b"".join(
        framer.token(Token(i, 0.0, 0, ("length" if req.max_tokens == count else "stop")
                           if i == count - 1 else None)) for i in range(count))
    raw += framer.closing()
    return [json.loads(f[6:]) for f in raw.split(b"\n\n") if f.startswith(b"data: {")]


def client_view(event: dict[str, Any], wants_ids: bool) -> dict[str, Any]:
    """What the client gets of a backend event when fairgate asked for the ids."""
    event = json.loads(json.dumps(event))
    if not wants_ids:
        if event.get("prompt_token_ids") is not None:
            event["prompt_token_ids"] = None
        for choice in event["choices"]:
            for name in ("prompt_token_ids", "token_ids"):
                if choice.get(name) is not None:
                    choice[name] = None
    event.pop("system_fingerprint", None)
    return event


def token_frames(events: list[dict[str, Any]]) -> int:
    return sum(1 for e in events if any(c.get("token_ids") for c in e["choices"]))


@settings(max_examples=60, deadline=None)
@given(chat=st.booleans(), wants_ids=st.booleans(), ignore_eos=st.booleans(),
       limit=st.integers(1, 40), prompt=st.text(min_size=1, max_size=30),
       cut=st.floats(0, 1, exclude_max=True))
def test_a_cut_stream_continued_reframes_into_the_reference(
        chat: bool, wants_ids: bool, ignore_eos: bool, limit: int, prompt: str,
        cut: float) -> None:
    body: dict[str, Any] = {"max_tokens": limit, "ignore_eos": ignore_eos, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat
                else {"prompt": prompt})
    if wants_ids:
        body["return_token_ids"] = True
    reference = frames(body, chat)
    endpoint = CHAT if chat else COMPLETIONS
    creq = parse_body({**body, "model": MODEL}, endpoint)
    progress = Progress.of(creq)
    assert progress is not None
    # the backend dies after `split` events: a chat's role frame and k token frames
    outputs = token_frames(reference)
    k = int(cut * outputs)
    split = k + (1 if chat else 0)
    got = [progress.original(json.loads(json.dumps(e))) for e in reference[:split]]
    if chat or k > 0:
        assert progress.resumable, (progress, split)
    else:
        return  # nothing came before the cut: the request is sent again as it was
    follow = frames(progress.continuation_body(creq, True),
                    chat=False)
    got += [progress.continued(e) for e in follow]
    want = [client_view(e, wants_ids) for e in reference]
    got = [client_view(e, wants_ids) for e in got]
    assert got == want, (k, outputs, got, want)


def test_the_usage_counts_the_whole_answer_once() -> None:
    body = {"model": MODEL, "prompt": "abcdefgh", "max_tokens": 10, "ignore_eos": True}
    creq = parse_body(body, COMPLETIONS)
    progress = Progress.of(creq)
    assert progress is not None
    reference = frames(body, chat=False)
    for event in reference[:4]:
        progress.original(event)
    follow = frames(progress.continuation_body(creq, True), chat=False)
    continued = [progress.continued(e) for e in follow]
    assert continued[-1]["usage"] == reference[-1]["usage"] == {
        "prompt_tokens": 2, "total_tokens": 12, "completion_tokens": 10}, continued[-1]
    assert progress.continuation_body(creq, True)["max_tokens"] == 1


def test_the_continuation_body_keeps_sampling_and_reduces_the_bound() -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 50, "temperature": 0.7, "seed": 3, "min_tokens": 10,
            "stream": True, "stream_options": {"include_usage": False}, "priority": 9}
    creq = parse_body(body, CHAT)
    progress = Progress.of(creq)
    assert progress is not None
    progress.prompt_ids, progress.generated = [1, 2, 3], [7, 8, 9, 10]
    cont = progress.continuation_body(creq, True)
    assert cont == {"model": MODEL, "prompt": [1, 2, 3, 7, 8, 9, 10], "max_tokens": 46,
                    "temperature": 0.7, "seed": 3, "min_tokens": 6, "stream": True,
                    "return_token_ids": True, "stream_options": {"include_usage": True}}, cont


# the last column: a replay continues it instead (tools, structured output:
# gateway/proxy/replay.py, tests/gateway/test_replay.py)
@pytest.mark.parametrize(("endpoint", "extra", "why", "replayed"), [
    (CHAT, {"n": 2, "stop": "x"}, "stop with several choices", False),
    (COMPLETIONS, {"prompt": ["a", "b"], "logprobs": 1}, "logprobs with several choices",
     False),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format is set", True),
    (CHAT, {"tools": [{"type": "function"}]}, "tools is set", True),
    (CHAT, {"tool_choice": "auto"}, "tool_choice is set", True),
    (CHAT, {"frequency_penalty": 0.5, "repetition_penalty": 1.2},
     "repetition_penalty with presence or frequency penalties", False),
    (EMBEDDINGS, {}, "/v1/embeddings is not continued", False),
])
def test_what_cannot_be_continued_says_why(endpoint: Any, extra: dict[str, Any],
                                           why: str, replayed: bool) -> None:
    body = {"model": MODEL, "prompt": "p", "messages": [{"role": "user", "content": "p"}],
            **({"input": "p"} if endpoint is EMBEDDINGS else {}), **extra}
    creq = parse_body(body, endpoint)
    assert not_continuable(creq) == why
    progress = Progress.of(creq)
    if replayed:
        assert progress is not None and progress.transcript is not None, progress
    else:
        assert progress is None


def test_plain_requests_are_continuable() -> None:
    body = {"model": MODEL, "prompt": "p", "stop": [], "n": 1, "logprobs": None,
            "response_format": {"type": "text"}, "temperature": 0, "tool_choice": "none"}
    assert not_continuable(parse_body(body, COMPLETIONS)) is None
