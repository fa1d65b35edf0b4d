"""``gateway.proxy.replay`` (through ``Progress``) on plain data: a tool-call or
structured-output stream cut anywhere and replayed, framed differently (vLLM puts several
tokens in one frame when its reader lags), reads to the client exactly as the
uninterrupted stream; a replay that differs is refused, never relayed.

The frames are vLLM 0.32's shapes for these streams (seen on the real server with
``return_token_ids``: a tool call's opening tokens buffered by the parser as empty deltas
with their ids, then ``tool_calls`` deltas, the last with ``finish_reason``)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.proxy.completion_request import parse_body
from gateway.proxy.continuation import Progress
from gateway.proxy.endpoints import CHAT, COMPLETIONS
from gateway.proxy.relay import FrameFilter
from gateway.proxy.replay import Diverged, Transcript, seeded

MODEL = "m"
PROMPT_IDS = [0, 31, 95, 347]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]

# (token id, delta) of a chat answer with two tool calls: buffered opening tokens, then
# each call's id and name, its arguments in pieces
TOOL_SCRIPT: list[tuple[int, dict[str, Any]]] = [
    (31, {}), (87, {}), (82, {}),
    (90, {"tool_calls": [{"index": 0, "id": "ID", "type": "function",
                          "function": {"name": "get_weather", "arguments": ""}}]}),
    (91, {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    (92, {"tool_calls": [{"index": 0, "function": {"arguments": '"par'}}]}),
    (93, {"tool_calls": [{"index": 0, "function": {"arguments": 'is"}'}}]}),
    (94, {}),
    (95, {"tool_calls": [{"index": 1, "id": "ID", "type": "function",
                          "function": {"name": "lookup", "arguments": ""}}]}),
    (96, {"tool_calls": [{"index": 1, "function": {"arguments": '{"q": "x'}}]}),
    (97, {"tool_calls": [{"index": 1, "function": {"arguments": 'yz"}'}}]}),
]
JSON_SCRIPT: list[tuple[int, dict[str, Any]]] = [
    (94, {"content": "{"}), (201, {"content": "\n  "}), (300, {"content": '"name"'}),
    (301, {"content": ": "}), (302, {"content": '"ad'}), (303, {"content": 'a"'}),
    (304, {"content": ", "}), (305, {"content": '"age": 4'}), (306, {"content": "2}"}),
]


def merged(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """The delta of several tokens in one frame: texts joined, each call's pieces joined."""
    out: dict[str, Any] = {}
    calls: dict[int, dict[str, Any]] = {}
    for delta in pieces:
        for name, value in delta.items():
            if name != "tool_calls":
                out[name] = out.get(name, "") + value
                continue
            for call in value:
                have = calls.setdefault(call["index"], {"index": call["index"]})
                for key in ("id", "type"):
                    if key in call:
                        have[key] = call[key]
                function = have.setdefault("function", {})
                for key, text in call["function"].items():
                    function[key] = function.get(key, "") + text
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


def chat_stream(script: list[tuple[int, dict[str, Any]]], sizes: list[int], call_id: str,
                finish: str) -> list[dict[str, Any]]:
    """The events vLLM streams for ``script``, ``sizes[i]`` tokens in frame ``i`` (cycled),
    every new call carrying ``call_id`` + its index."""
    head = {"id": f"chatcmpl-{call_id}", "object": "chat.completion.chunk", "created": 7,
            "model": MODEL}
    events = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}],
               "prompt_token_ids": PROMPT_IDS}]
    at, frame = 0, 0
    while at < len(script):
        size = sizes[frame % len(sizes)]
        part = script[at:at + size]
        at, frame = at + size, frame + 1
        delta = merged([copy.deepcopy(d) for _, d in part])
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                call["id"] = f"{call_id}-{call['index']}"
        choice = {"index": 0, "delta": delta, "logprobs": None,
                  "finish_reason": finish if at >= len(script) else None,
                  "token_ids": [t for t, _ in part]}
        events.append({**head, "choices": [choice]})
    count = len(script)
    events.append({**head, "choices": [], "usage": {
        "prompt_tokens": len(PROMPT_IDS), "completion_tokens": count,
        "total_tokens": len(PROMPT_IDS) + count}})
    return events


def what_the_client_has(events: list[dict[str, Any]]) -> tuple[Transcript, list[str],
                                                                 list[Any]]:
    """What the client's deltas add up to, every id and finish reason it saw."""
    transcript = Transcript()
    ids, finishes = [], []
    for event in events:
        ids.append(event["id"])
        for choice in event["choices"]:
            for call in (choice.get("delta") or {}).get("tool_calls") or ():
                assert call.get("id", "") is not None, f"a null id: {call}"
                if call.get("id") is not None:  # each call's id comes once
                    have = transcript.calls[call["index"]].id if call["index"] < len(
                        transcript.calls) else None
                    assert have is None, f"tool call {call['index']}: a second id"
            transcript.add(choice, chat="delta" in choice)
            if choice.get("finish_reason") is not None:
                finishes.append(choice["finish_reason"])
    return transcript, sorted(set(ids)), finishes


def tool_request(**extra: Any) -> Progress:
    body = {"model": MODEL, "stream": True, "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
            "tool_choice": "required", **extra}
    progress = Progress.of(parse_body(body, CHAT))
    assert progress is not None and progress.transcript is not None, body
    progress.first_body(body)
    return progress


def replayed(progress: Progress, original: list[dict[str, Any]], replay: list[dict[str, Any]],
             split: int) -> list[dict[str, Any]]:
    """What the client reads: the original's first ``split`` events, then the replay's
    re-framed ones."""
    got = [progress.original(copy.deepcopy(e)) for e in original[:split]]
    assert progress.resumable
    progress.replay_body()
    for event in replay:
        out = progress.continued(copy.deepcopy(event))
        if out is not None:
            got.append(out)
    return got


@settings(max_examples=80, deadline=None)
@given(script=st.sampled_from([TOOL_SCRIPT, JSON_SCRIPT]),
       sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
       replay_sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4),
       cut=st.floats(0, 1, exclude_max=True))
def test_a_replayed_stream_reads_as_the_uninterrupted_one(
        script: list[tuple[int, dict[str, Any]]], sizes: list[int], replay_sizes: list[int],
        cut: float) -> None:
    finish = "tool_calls" if script is TOOL_SCRIPT else "stop"
    reference = chat_stream(script, sizes, "first", finish)
    progress = tool_request()
    split = 1 + int(cut * (len(reference) - 2))  # the role frame and some token frames
    replay = chat_stream(script, replay_sizes, "second", finish)
    got = replayed(progress, reference, replay, split)
    want, _, want_finish = what_the_client_has(reference)
    have, ids, finishes = what_the_client_has(got)
    assert have == _with_ids(want, have), (have, want)
    assert ids == ["chatcmpl-first"], ids  # one answer: the original's id throughout
    assert finishes == want_finish == [finish], finishes
    # every call the client had before the cut keeps the id it got
    cut_calls, _, _ = what_the_client_has(reference[:split])
    assert [c.id for c in have.calls[:len(cut_calls.calls)]] == [
        c.id for c in cut_calls.calls], (have.calls, cut_calls.calls)
    assert progress.generated == [t for t, _ in script], progress.generated
    usage = [e["usage"] for e in got if "usage" in e]
    assert usage == [{"prompt_tokens": 4, "completion_tokens": len(script),
                      "total_tokens": 4 + len(script)}], usage


def _with_ids(want: Transcript, have: Transcript) -> Transcript:
    """``want`` with the tool-call ids ``have`` got (a call first seen in the replay has
    the replay's id; the check of those seen before the cut is separate)."""
    out = copy.deepcopy(want)
    for mine, theirs in zip(out.calls, have.calls, strict=False):
        mine.id = theirs.id
    return out


def test_a_replay_with_another_token_is_refused() -> None:
    reference = chat_stream(JSON_SCRIPT, [1], "first", "stop")
    progress = tool_request()
    for event in reference[:4]:
        progress.original(copy.deepcopy(event))
    progress.replay_body()
    other = chat_stream([(94, {"content": "{"}), (999, {"content": "\n  "}), *JSON_SCRIPT[2:]],
                        [1], "second", "stop")
    progress.continued(copy.deepcopy(other[0]))
    progress.continued(copy.deepcopy(other[1]))
    with pytest.raises(Diverged, match="token 1 is 999"):
        progress.continued(copy.deepcopy(other[2]))


def test_a_replay_whose_text_differs_is_refused() -> None:
    reference = chat_stream(JSON_SCRIPT, [2], "first", "stop")
    progress = tool_request()
    for event in reference[:3]:
        progress.original(copy.deepcopy(event))
    progress.replay_body()
    script = [(t, {"content": d["content"].upper()}) for t, d in JSON_SCRIPT]
    with pytest.raises(Diverged, match="content differs"):
        for event in chat_stream(script, [9], "second", "stop"):
            progress.continued(copy.deepcopy(event))


def test_a_replay_that_ends_early_is_refused() -> None:
    reference = chat_stream(TOOL_SCRIPT, [1], "first", "tool_calls")
    progress = tool_request()
    for event in reference[:8]:
        progress.original(copy.deepcopy(event))
    progress.replay_body()
    with pytest.raises(Diverged, match="ended after 3 tokens"):
        for event in chat_stream(TOOL_SCRIPT[:3], [1], "second", "stop"):
            progress.continued(copy.deepcopy(event))


def completion_stream(pieces: list[tuple[int, str]], sizes: list[int]) -> list[dict[str, Any]]:
    head = {"id": "cmpl-x", "object": "text_completion", "created": 3, "model": MODEL}
    events, at, frame = [], 0, 0
    while at < len(pieces):
        size = sizes[frame % len(sizes)]
        part = pieces[at:at + size]
        at, frame = at + size, frame + 1
        events.append({**head, "choices": [{
            "index": 0, "text": "".join(t for _, t in part), "logprobs": None,
            "finish_reason": "stop" if at >= len(pieces) else None, "stop_reason": None,
            "prompt_token_ids": PROMPT_IDS if frame == 1 else None,
            "token_ids": [i for i, _ in part]}]})
    events.append({**head, "choices": [], "usage": {
        "prompt_tokens": 4, "completion_tokens": len(pieces),
        "total_tokens": 4 + len(pieces)}})
    return events


def test_a_structured_completion_cut_inside_a_replay_frame_continues_after_the_seam(
        ) -> None:
    pieces = [(69, "b"), (520, "eta"), (475, " ga"), (80, "m"), (638, "ma"), (1, "")]
    body = {"model": MODEL, "prompt": "pick one", "stream": True, "return_token_ids": True,
            "structured_outputs": {"choice": ["alpha", "beta gamma"]}}
    progress = Progress.of(parse_body(body, COMPLETIONS))
    assert progress is not None and progress.transcript is not None
    progress.first_body(body)
    got = replayed(progress, completion_stream(pieces, [1]),
                   completion_stream(pieces, [4, 2]), 2)  # the seam inside the first frame
    text = "".join(c["text"] for e in got for c in e["choices"])
    assert text == "beta gamma", text
    ids = [i for e in got for c in e["choices"] for i in c.get("token_ids") or ()]
    assert ids == [i for i, _ in pieces], ids  # asked for: each id once


@pytest.mark.parametrize("extra", [
    {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {}}}},
    {"structured_outputs": {"regex": "[a-z]+"}}, {"guided_json": {"type": "object"}},
    {"tools": TOOLS, "presence_penalty": 0.5},  # the replay sends the penalties again
])
def test_tools_and_structured_output_are_replayed(extra: dict[str, Any]) -> None:
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}],
            **extra}
    creq = parse_body(body, CHAT)
    assert creq.unresumable is not None and creq.replayable, creq.unresumable
    progress = Progress.of(creq)
    assert progress is not None and progress.transcript is not None


@pytest.mark.parametrize("extra", [
    {"logprobs": True}, {"top_logprobs": 2}, {"n": 2}, {"echo": True},
    {"unknown_field": 1},
])
def test_tools_beside_what_a_replay_cannot_cut_are_not_continued(
        extra: dict[str, Any]) -> None:
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}],
            "tools": TOOLS, **extra}
    creq = parse_body(body, CHAT)
    assert not creq.replayable and Progress.of(creq) is None, extra


def test_a_sampled_request_is_seeded_so_its_replay_draws_the_same_tokens() -> None:
    progress = tool_request(temperature=0.8)
    sent = progress.first_body({"temperature": 0.8, "tools": TOOLS})
    assert isinstance(sent.get("seed"), int), sent
    assert progress.replay_body()["seed"] == sent["seed"]
    assert seeded({"temperature": 0}, 5) == {"temperature": 0}
    assert seeded({"seed": 1}, 5) == {"seed": 1}
    assert seeded({}, 5) == {"seed": 5}


def test_a_replay_frame_the_client_has_is_read_not_written_and_keeps_the_stream_alive(
        ) -> None:
    """The seam's frames go nowhere, yet they are the backend's work: the idle deadline
    (``stream_idle_timeout_s``) counts them, or a long answer's replay would time out
    before its first new token."""
    reference = chat_stream(JSON_SCRIPT, [1], "first", "stop")
    progress = tool_request()
    frames = FrameFilter(False, progress=progress)
    for event in reference[:4]:
        frames.feed(b"data: " + json.dumps(event).encode() + b"\n\n")
    progress.replay_body()
    frames.switch(continued=True)
    replay = chat_stream(JSON_SCRIPT, [1], "second", "stop")
    for event in replay[:4]:  # the role frame and the 3 tokens the client has
        assert frames.feed(b"data: " + json.dumps(event).encode() + b"\n\n") == b""
        assert frames.whole, "a dropped frame did not count as read"
    out = frames.feed(b"data: " + json.dumps(replay[4]).encode() + b"\n\n")
    assert b'"chatcmpl-first"' in out and b'"content":": "' in out, out
