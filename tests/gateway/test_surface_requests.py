"""The pure parts of the embeddings and Responses routes: what fairgate validates, what it
estimates a request costs before dispatch, and the usage it reads from the answer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.core.errors import BadRequest
from gateway.proxy.completion_request import Limits, parse_body
from gateway.proxy.endpoints import CHAT, EMBEDDINGS, RESPONSES, Endpoint, Frames
from gateway.proxy.relay import FrameFilter, report_usage
from policies.cost import estimate_prompt_tokens

LIMITS = Limits(max_json_depth=8, max_output_tokens=100, max_end_user_chars=16)


@pytest.mark.parametrize("body", [
    {"model": "m", "input": "text"},
    {"model": "m", "input": ["a", "b"], "encoding_format": "float", "dimensions": 8},
    {"model": "m", "input": [1, 2, 3]},
    {"model": "m", "input": [[1, 2], [3]], "user": "end-user-7"},
    {"model": "m", "input": "x", "stream": False, "anything": {"passes": True}},
])
def test_embeddings_bodies_accepted(body: dict[str, Any]) -> None:
    parse_body(body, EMBEDDINGS, LIMITS)


@pytest.mark.parametrize("body", [
    {"model": "m", "input": "hi"},
    {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text",
                                                           "text": "hi"}]}],
     "stream": True, "max_output_tokens": 100, "instructions": "be brief"},
    {"model": "m", "input": "hi", "tools": [], "reasoning": {"effort": "low"}},
])
def test_responses_bodies_accepted(body: dict[str, Any]) -> None:
    parse_body(body, RESPONSES, LIMITS)


@pytest.mark.parametrize(("path", "body", "param"), [
    (EMBEDDINGS, {"input": "x"}, "model"),
    (EMBEDDINGS, {"model": "", "input": "x"}, "model"),
    (EMBEDDINGS, {"model": "m"}, "input"),
    (EMBEDDINGS, {"model": "m", "input": 3}, "input"),
    (EMBEDDINGS, {"model": "m", "input": None}, "input"),
    (EMBEDDINGS, {"model": "m", "input": "x", "stream": True}, "stream"),
    (EMBEDDINGS, {"model": "m", "input": "x", "user": "\x00"}, "user"),
    (EMBEDDINGS, {"model": "m", "input": [[[[[[[[["deep"]]]]]]]]]}, "input"),
    (RESPONSES, {"model": "m"}, "input"),
    (RESPONSES, {"model": "m", "input": {"role": "user"}}, "input"),
    (RESPONSES, {"model": "m", "input": "x", "stream": 1}, "stream"),
    (RESPONSES, {"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    (RESPONSES, {"model": "m", "input": "x", "max_output_tokens": "9"}, "max_output_tokens"),
    (RESPONSES, {"model": "m", "input": "x", "max_output_tokens": 101}, "max_output_tokens"),
    (RESPONSES, {"model": "m", "input": "x", "user": "u" * 17}, "user"),
])
def test_bad_bodies_name_the_field(path: Endpoint, body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as exc:
        parse_body(body, path, LIMITS)
    assert exc.value.param == param


@pytest.mark.parametrize(("body", "tokens"), [
    ({"input": "x" * 40}, 10),
    ({"input": "abc"}, 1),  # never free
    ({"input": ["x" * 40, "y" * 8, "z"]}, 10 + 2 + 1),
    ({"input": [5, 6, 7]}, 3),  # token ids count one each
    ({"input": [[1, 2], [3, 4, 5], [6]]}, 6),
    ({"input": "x" * 40, "instructions": "y" * 20}, 10 + 5),
    ({"input": [{"role": "user", "content": "x" * 40},
                {"role": "user", "content": [{"type": "input_text", "text": "y" * 8}]}]},
     (10 + 4) + (2 + 4)),  # like chat messages: text / 4 + 4 each
])
def test_input_estimates(body: dict[str, Any], tokens: int) -> None:
    assert estimate_prompt_tokens(parse_body({"model": "m", **body}, RESPONSES).prompt) == tokens


class Usage:
    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> None:
        self.seen.append((prompt_tokens, completion_tokens))


@pytest.mark.parametrize(("endpoint", "usage", "counts"), [
    (EMBEDDINGS, {"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0}, (7, 0)),
    (EMBEDDINGS, {"prompt_tokens": 7, "total_tokens": 7}, (7, 0)),
    (CHAT, {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}, (7, 2)),
    (RESPONSES, {"input_tokens": 9, "output_tokens": 4, "total_tokens": 13}, (9, 4)),
    (RESPONSES, {"input_tokens": "9", "output_tokens": None}, (0, 0)),  # not numbers
])
def test_usage_of_every_route(endpoint: Endpoint, usage: dict[str, Any],
                              counts: tuple[int, int]) -> None:
    listener = Usage()
    report_usage(usage, listener, endpoint.usage)  # type: ignore[arg-type]
    assert listener.seen == [counts]


def event(kind: str, **fields: Any) -> bytes:
    payload = json.dumps({**fields, "sequence_number": 0, "type": kind}, separators=(",", ":"))
    return f"event: {kind}\ndata: {payload}\n\n".encode()


def test_response_stream_usage_from_the_final_event_in_any_chunking() -> None:
    usage = {"input_tokens": 12, "output_tokens": 3, "total_tokens": 15}
    frames = [
        event("response.created", response={"status": "in_progress", "usage": None}),
        event("response.in_progress", response={"status": "in_progress", "usage": None}),
        *(event("response.output_text.delta", delta=w) for w in ("a", " usage", " x")),
        event("response.output_text.done", text='a "usage": x'),
        event("response.completed", response={"status": "incomplete", "usage": usage}),
    ]
    whole = b"".join(frames)
    for size in (1, 7, 64, len(whole)):
        f = FrameFilter(wants_usage=True, frames=Frames.EVENTS)
        out = b"".join(f.feed(whole[i:i + size]) for i in range(0, len(whole), size))
        assert out + f.rest() == whole  # relayed unchanged
        assert f.started and f.done and f.usage == usage
        listener = Usage()
        report_usage(f.usage, listener, RESPONSES.usage)  # type: ignore[arg-type]
        assert listener.seen == [(12, 3)]
