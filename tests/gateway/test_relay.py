"""``gateway.proxy.relay``'s pure part: :class:`FrameFilter` and :func:`carries_output`.

The streams below have the shapes vLLM 0.32 sends (``serving_chat.py`` /
``serving_completion.py``: ``data: <compact JSON>\\n\\n`` frames, a role-only first frame
per choice in chat, a ``choices: []`` usage frame when ``stream_options.include_usage``,
``data: [DONE]`` last) and the Responses API's ``event:``/``data:`` frames.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest

from gateway.proxy.continuation import Progress
from gateway.proxy.endpoints import Frames
from gateway.proxy.relay import FrameFilter, StreamBroke, _pump, carries_output, strip_ids

MODEL = "llama-3.1-8b"
CREATED = 1764428400
DONE = b"data: [DONE]\n\n"
USAGE = {"prompt_tokens": 11, "total_tokens": 15, "completion_tokens": 4}


def sse(payload: dict[str, Any], event: str | None = None) -> bytes:
    """One frame as vLLM writes it: ``data: `` + compact JSON + a blank line."""
    head = b"" if event is None else b"event: " + event.encode() + b"\n"
    return head + b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def chat_chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
    return sse({"id": "chatcmpl-5f0c1e2a9b7d4c3e", "object": "chat.completion.chunk",
                "created": CREATED, "model": MODEL, "choices": choices, **extra})


def role(index: int = 0) -> bytes:
    """vLLM's first chat frame of a choice: the role and an empty content, no token."""
    return chat_chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}],
                      prompt_token_ids=None, prompt_text=None)


def delta(index: int = 0, finish: str | None = None, **fields: Any) -> bytes:
    choice: dict[str, Any] = {"index": index, "delta": fields, "logprobs": None,
                              "finish_reason": finish, "token_ids": None}
    if finish is not None:
        choice["stop_reason"] = None
    return chat_chunk([choice])


def text(value: str, index: int = 0, finish: str | None = None) -> bytes:
    return sse({"id": "cmpl-0c6d7e8f9a1b2c3d", "object": "text_completion",
                "created": CREATED, "model": MODEL,
                "choices": [{"index": index, "text": value, "logprobs": None,
                             "finish_reason": finish, "stop_reason": None,
                             "prompt_token_ids": None, "token_ids": None}]})


def chat_usage_frame() -> bytes:
    return chat_chunk([], usage=USAGE, system_fingerprint="fp_vllm")


def completion_usage_frame() -> bytes:
    return sse({"id": "cmpl-0c6d7e8f9a1b2c3d", "object": "text_completion",
                "created": CREATED, "model": MODEL, "choices": [], "usage": USAGE,
                "system_fingerprint": "fp_vllm"})


def response_event(kind: str, **fields: Any) -> bytes:
    return sse({"type": kind, "sequence_number": 0, **fields}, event=kind)


CHAT_CONTENT = [delta(content="The"), delta(content=" fair"), delta(content=" queue"),
                delta(content=" wins", finish="length")]
# what fairgate receives for a chat stream (it always asks vLLM for the usage frame)
CHAT_STREAM = [role(), *CHAT_CONTENT, chat_usage_frame(), DONE]
COMPLETION_CONTENT = [text("the"), text(" fair"), text(" queue"),
                      text(" wins", finish="length")]
COMPLETION_STREAM = [*COMPLETION_CONTENT, completion_usage_frame(), DONE]
# n=2: one role frame per choice first, then the choices' tokens interleaved
N2_CONTENT = [delta(0, content="A"), delta(1, content="B"), delta(0, content="a"),
              delta(1, content="b"), delta(0, content="!", finish="length"),
              delta(1, content="?", finish="length")]
N2_STREAM = [role(0), role(1), *N2_CONTENT, chat_usage_frame(), DONE]
RESPONSE_HEAD = [
    response_event("response.created",
                   response={"id": "resp_1", "object": "response", "status": "in_progress",
                             "output": [], "usage": None}),
    response_event("response.in_progress",
                   response={"id": "resp_1", "object": "response", "status": "in_progress"}),
    response_event("response.output_item.added", output_index=0,
                   item={"id": "msg_1", "type": "message", "role": "assistant",
                         "content": []}),
    response_event("response.content_part.added", item_id="msg_1", output_index=0,
                   content_index=0, part={"type": "output_text", "text": ""}),
]
RESPONSE_DELTAS = [response_event("response.output_text.delta", item_id="msg_1",
                                  output_index=0, content_index=0, delta=d, logprobs=[])
                   for d in ("Hi", " there")]
RESPONSE_STREAM = [*RESPONSE_HEAD, *RESPONSE_DELTAS, response_event(
    "response.completed", response={"id": "resp_1", "status": "completed",
                                    "usage": {"input_tokens": 5, "output_tokens": 2}})]


def run(frames: Iterable[bytes], wants_usage: bool, kind: Frames = Frames.CHOICES
        ) -> tuple[FrameFilter, bytes]:
    """Feed each frame as one chunk; returns the filter and everything it let out."""
    f = FrameFilter(wants_usage, kind)
    out = b"".join(f.feed(frame) for frame in frames)
    return f, out + f.rest()


def state(f: FrameFilter) -> tuple[bool, int, dict[str, Any] | None, bool]:
    return f.started, f.output_frames, f.usage, f.done


# --------------------------------------------------------------------------- carries_output


def payload(frame: bytes) -> dict[str, Any]:
    data = next(line for line in frame.split(b"\n") if line.startswith(b"data: "))
    event: dict[str, Any] = json.loads(data[len(b"data: "):])
    return event


@pytest.mark.parametrize(("event", "expected"), [
    (payload(role()), False),
    (payload(delta(content="")), False),
    (payload(delta(content=None)), False),
    (payload(delta()), False),
    (payload(delta(content="Hi")), True),
    (payload(delta(reasoning_content="Let me think")), True),
    (payload(delta(reasoning="Let me think")), True),
    (payload(delta(tool_calls=[{"id": "chatcmpl-tool-1", "type": "function", "index": 0,
                                "function": {"name": "get_weather", "arguments": ""}}])),
     True),
    (payload(delta(tool_calls=[{"index": 0, "function": {"arguments": "{\"city\":"}}])), True),
    (payload(delta(tool_calls=[])), False),
    (payload(delta(content="", finish="stop")), False),  # a bare finish frame
    (payload(text("x")), True),
    (payload(text("")), False),
    ({"choices": [{"index": 0, "text": "", "token_ids": [791]}]}, True),
    (payload(chat_usage_frame()), False),
    (payload(completion_usage_frame()), False),
    ({"choices": ["not an object", None]}, False),
    ({"choices": None}, False),
    ({}, False),
    (payload(RESPONSE_DELTAS[0]), True),
    (payload(response_event("response.reasoning_text.delta", delta="hmm")), True),
    (payload(response_event("response.function_call_arguments.delta", delta="{")), True),
    (payload(response_event("response.output_text.delta", delta="")), False),
    (payload(RESPONSE_HEAD[0]), False),
    (payload(response_event("response.output_text.done", text="Hi there")), False),
    (payload(RESPONSE_STREAM[-1]), False),
])
def test_carries_output(event: dict[str, Any], expected: bool) -> None:
    assert carries_output(event) is expected


# --------------------------------------------------------------------------- chat


def test_role_only_first_frame_does_not_start_the_stream() -> None:
    f = FrameFilter(wants_usage=False)
    assert f.feed(role()) == role()  # passes through to the client
    assert state(f) == (False, 0, None, False)
    assert f.feed(delta(content="")) == delta(content="")  # empty content: still no token
    assert state(f) == (False, 0, None, False)
    assert f.feed(CHAT_CONTENT[0]) == CHAT_CONTENT[0]
    assert (f.started, f.output_frames) == (True, 1)
    assert f.feed(CHAT_CONTENT[1]) == CHAT_CONTENT[1]  # the unparsed path counts too
    assert f.output_frames == 2


def test_chat_stream_without_client_usage_drops_the_usage_frame() -> None:
    f, out = run(CHAT_STREAM, wants_usage=False)
    assert out == b"".join([role(), *CHAT_CONTENT, DONE])
    assert state(f) == (True, len(CHAT_CONTENT), USAGE, True)


def test_chat_stream_with_client_usage_keeps_the_usage_frame() -> None:
    f, out = run(CHAT_STREAM, wants_usage=True)
    assert out == b"".join(CHAT_STREAM)
    assert (f.started, f.usage, f.done) == (True, USAGE, True)


@pytest.mark.parametrize("kind", ["reasoning_content", "reasoning"])
def test_reasoning_delta_starts_the_stream(kind: str) -> None:
    frames = [role(), delta(**{kind: "The user greets"}), delta(content="Hi"), DONE]
    f, out = run(frames, wants_usage=False)
    assert out == b"".join(frames)
    assert state(f) == (True, 2, None, True)


def test_tool_call_delta_starts_the_stream() -> None:
    call = delta(content=None, tool_calls=[{
        "id": "chatcmpl-tool-9a8b", "type": "function", "index": 0,
        "function": {"name": "get_weather", "arguments": ""}}])
    args = delta(tool_calls=[{"index": 0, "function": {"arguments": "{\"city\": \"Oslo\"}"}}])
    f = FrameFilter(wants_usage=False)
    f.feed(role())
    assert not f.started
    f.feed(call)
    assert (f.started, f.output_frames) == (True, 1)
    f.feed(args)
    assert f.output_frames == 2


def test_empty_content_first_frames_then_content() -> None:
    frames = [delta(content=""), delta(content=""), delta(content="ok", finish="stop"),
              chat_usage_frame(), DONE]
    f = FrameFilter(wants_usage=False)
    f.feed(frames[0] + frames[1])
    assert not f.started and f.output_frames == 0
    out = f.feed(b"".join(frames[2:]))
    assert out == frames[2] + DONE
    assert state(f) == (True, 1, USAGE, True)


def test_n2_interleaved_choices() -> None:
    f = FrameFilter(wants_usage=False)
    assert f.feed(role(0) + role(1)) == role(0) + role(1)
    assert not f.started  # two role frames, no token yet
    out = f.feed(b"".join(N2_STREAM[2:]))
    assert out == b"".join([*N2_CONTENT, DONE])
    assert state(f) == (True, len(N2_CONTENT), USAGE, True)


def test_continuous_usage_keeps_every_frame_and_takes_the_last_usage() -> None:
    """``include_usage`` + ``continuous_usage_stats``: every frame has a running usage."""
    frames = [chat_chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}}],
                         usage={"prompt_tokens": 11, "total_tokens": 11,
                                "completion_tokens": 0})]
    for i, word in enumerate(["a", "b", "c"], start=1):
        frames.append(chat_chunk([{"index": 0, "delta": {"content": word}}],
                                 usage={"prompt_tokens": 11, "total_tokens": 11 + i,
                                        "completion_tokens": i}))
    final = {"prompt_tokens": 11, "total_tokens": 14, "completion_tokens": 3}
    frames += [chat_chunk([], usage=final), DONE]
    f, out = run(frames, wants_usage=True)
    assert out == b"".join(frames)
    assert (f.started, f.usage, f.done) == (True, final, True)
    # the first output frame's running usage was taken on the way, before the last one
    g = FrameFilter(wants_usage=True)
    g.feed(b"".join(frames[:2]))
    assert g.started and g.usage == {"prompt_tokens": 11, "total_tokens": 12,
                                     "completion_tokens": 1}


# --------------------------------------------------------------------------- completions


def test_completion_stream_starts_at_the_first_text() -> None:
    f = FrameFilter(wants_usage=False)
    assert f.feed(text("")) == text("")
    assert not f.started
    f2, out = run(COMPLETION_STREAM, wants_usage=False)
    assert out == b"".join([*COMPLETION_CONTENT, DONE])
    assert state(f2) == (True, len(COMPLETION_CONTENT), USAGE, True)
    f3, out = run(COMPLETION_STREAM, wants_usage=True)
    assert out == b"".join(COMPLETION_STREAM)
    assert f3.usage == USAGE


# --------------------------------------------------------------------------- [DONE], rest


def test_done_frame_sets_done_and_passes_through() -> None:
    f = FrameFilter(wants_usage=False)
    f.feed(b"".join(CHAT_STREAM[:-1]))
    assert not f.done
    assert f.feed(DONE) == DONE
    assert f.done


def test_stream_without_done_is_not_done() -> None:
    f, _ = run(CHAT_STREAM[:-1], wants_usage=False)
    assert f.started and f.usage == USAGE and not f.done


def test_rest_returns_the_trailing_partial_frame() -> None:
    f = FrameFilter(wants_usage=False)
    partial = CHAT_CONTENT[1][:25]
    assert f.feed(role() + CHAT_CONTENT[0] + partial) == role() + CHAT_CONTENT[0]
    assert f.rest() == partial
    assert f.rest() == b""  # taken once
    # a frame cut before its blank line is held back until the stream ends
    g = FrameFilter(wants_usage=False)
    assert g.feed(DONE[:-1]) == b""
    assert not g.done
    assert g.rest() == DONE[:-1]


def test_frames_without_json_pass_through() -> None:
    frames = [b": keep-alive\n\n", role(), b"data: not json\n\n", CHAT_CONTENT[0], DONE]
    f, out = run(frames, wants_usage=False)
    assert out == b"".join(frames)
    assert state(f) == (True, 1, None, True)


# --------------------------------------------------------------------------- Responses API


def test_responses_api_events() -> None:
    f = FrameFilter(wants_usage=False, frames=Frames.EVENTS)
    head = b"".join(RESPONSE_HEAD)
    assert f.feed(head) == head
    assert (f.started, f.output_frames) == (False, 0)  # response.created & co: no output
    f.feed(RESPONSE_DELTAS[0])
    assert (f.started, f.output_frames) == (True, 1)
    f.feed(RESPONSE_DELTAS[1])
    assert f.output_frames == 2
    for wants_usage in (False, True):
        f2, out = run(RESPONSE_STREAM, wants_usage, Frames.EVENTS)
        assert out == b"".join(RESPONSE_STREAM)  # nothing dropped: no top-level usage
        # response.completed carries the usage and ends the answer
        assert f2.started and f2.usage == {"input_tokens": 5, "output_tokens": 2} and f2.done


# --------------------------------------------------------------------------- chunking


STREAMS = {
    "chat": CHAT_STREAM,
    "completion": COMPLETION_STREAM,
    "n2": N2_STREAM,
    "responses": RESPONSE_STREAM,
    "reasoning": [role(), delta(reasoning_content="hmm"), *CHAT_CONTENT, chat_usage_frame(),
                  DONE],
}


def splits(data: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, min(40, len(data) - 1))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


@pytest.mark.parametrize("wants_usage", [False, True])
@pytest.mark.parametrize("name", sorted(STREAMS))
def test_any_chunking_gives_the_same_output(name: str, wants_usage: bool) -> None:
    frames = STREAMS[name]
    kind = Frames.EVENTS if name == "responses" else Frames.CHOICES
    whole, expected = run(frames, wants_usage, kind)
    data = b"".join(frames)
    one = FrameFilter(wants_usage, kind)
    assert one.feed(data) + one.rest() == expected
    assert state(one) == state(whole)
    rng = random.Random(f"{name}-{wants_usage}")
    chunkings = [[data[i:i + 1] for i in range(len(data))]]  # byte by byte
    chunkings += [splits(data, rng) for _ in range(50)]
    for chunks in chunkings:
        f = FrameFilter(wants_usage, kind)
        outs = [f.feed(chunk) for chunk in chunks]
        assert all(o == b"" or o.endswith(b"\n\n") for o in outs)  # whole frames only
        assert b"".join(outs) + f.rest() == expected
        assert state(f) == state(whole)


def test_started_flips_on_the_chunk_that_completes_the_first_output_frame() -> None:
    first = CHAT_CONTENT[0]
    f = FrameFilter(wants_usage=False)
    f.feed(role() + first[:-1])
    assert not f.started  # the output frame is not whole yet
    assert f.feed(first[-1:]) == first
    assert f.started and f.output_frames == 1


def test_output_text_that_looks_like_a_frame_is_counted_once() -> None:
    frames = [role(), delta(content="Hi"), delta(content="data: {"), DONE]
    whole = FrameFilter(wants_usage=False)
    whole.feed(b"".join(frames))  # everything on the parsing path
    chunked = FrameFilter(wants_usage=False)
    for frame in frames:  # frames after the first token take the hot path
        chunked.feed(frame)
    assert whole.output_frames == 2
    assert chunked.output_frames == 2


# --------------------------------------------------------------- continuable (tracked) streams

PROMPT_IDS = [101, 7592, 2088, 3]


def tracked_text(value: str, ids: list[int] | None, first: bool = False,
                 finish: str | None = None) -> bytes:
    """A completion frame as vLLM 0.32 sends it with ``return_token_ids``."""
    return sse({"id": "cmpl-0c6d7e8f9a1b2c3d", "object": "text_completion",
                "created": CREATED, "model": MODEL,
                "choices": [{"index": 0, "text": value, "logprobs": None,
                             "finish_reason": finish, "stop_reason": None,
                             "prompt_token_ids": (PROMPT_IDS if first else None)
                             if ids is not None else None,
                             "token_ids": ids}]})


def tracked_stream(ids: bool) -> list[bytes]:
    """The stream with its ids, or (``ids`` false) as the client sees it without them."""
    words = [("the", 11), (" fair", 12), (" queue", 13), (" wins", 14)]
    frames = [tracked_text(w, [i] if ids else None, first=n == 0,
                           finish="length" if n == len(words) - 1 else None)
              for n, (w, i) in enumerate(words)]
    return [*frames, completion_usage_frame(), DONE]


def tracked(chunks: Iterable[bytes], wants_ids: bool = False
            ) -> tuple[FrameFilter, Progress, bytes]:
    progress = Progress(chat=False, wants_ids=wants_ids)
    f = FrameFilter(False, Frames.CHOICES, progress)
    out = b"".join(f.feed(chunk) for chunk in chunks)
    return f, progress, out + f.rest()


@pytest.mark.parametrize("wants_ids", [False, True])
def test_a_continuable_stream_is_recorded_and_stripped_however_it_is_chunked(
        wants_ids: bool) -> None:
    data = b"".join(tracked_stream(ids=True))
    # the client's bytes: the ids nulled unless it asked for them, the usage frame dropped
    expected = b"".join(tracked_stream(ids=wants_ids)[:4]) + DONE
    rng = random.Random(f"tracked-{wants_ids}")
    chunkings = [[data], tracked_stream(ids=True), [data[i:i + 1] for i in range(len(data))]]
    chunkings += [splits(data, rng) for _ in range(50)]
    for chunks in chunkings:
        f, progress, out = tracked(chunks, wants_ids)
        assert out == expected, f"chunks of sizes {[len(c) for c in chunks]} gave {out!r}"
        got = (progress.prompt_ids, progress.generated, progress.finish_reason,
               f.output_frames, f.usage, f.done)
        assert got == (PROMPT_IDS, [11, 12, 13, 14], "length", 4, USAGE, True), (
            f"chunks of sizes {[len(c) for c in chunks]}: {got}")


@pytest.mark.parametrize("bad", [b"data: {\"id\": broken\n\n",
                                 b'data: {"error":{"message":"engine dead"}}\n\n',
                                 b'data: {"choices":[]} {"choices":[]}\n\n'])
def test_a_broken_or_error_frame_among_output_frames_breaks_the_stream(bad: bytes) -> None:
    frames, client = tracked_stream(ids=True), tracked_stream(ids=False)
    for chunks in ([frames[0], frames[1] + bad + frames[2]], [frames[0], frames[1], bad]):
        progress = Progress(chat=False, wants_ids=False)
        f = FrameFilter(False, Frames.CHOICES, progress)
        out = b"".join(f.feed(chunk) for chunk in chunks)
        # the stream breaks at the bad frame; every frame recorded before it (the
        # continuation resumes after those) is also handed to the client, none after it
        assert isinstance(f.broken, StreamBroke), f"no failure noted: {f.broken!r}"
        said = str(f.broken)
        assert ("engine dead" if b"error" in bad else "broken frame") in said, said
        assert out == client[0] + client[1], f"{[len(c) for c in chunks]}: client got {out!r}"
        assert progress.generated == [11, 12], progress.generated


def test_ids_are_stripped_only_where_the_key_is_a_token_id_list() -> None:
    old = re.compile(rb'"(prompt_token_ids|token_ids)":\[[-0-9,\s]*\]')
    cases = [b'{"token_ids":[1, 2,\n3],"prompt_token_ids":[-1],"stop_token_ids":[4]}',
             b'{"text":"say \\"token_ids\\":[1]","token_ids":[]}',
             b'{"xtoken_ids":[1],"prompt_token_ids":[1]x,"token_ids":[1,"a"]}',
             b'token_ids":[1] "token_ids":[2]', b'"token_ids":[', b""]
    for case in cases:
        assert strip_ids(case) == old.sub(rb'"\1":null', case), case


class FakeContent:
    """A backend response's body: ``chunks``, the backend's end read with the last."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.at = 0  # chunks read

    def is_eof(self) -> bool:
        return self.at == len(self.chunks)

    async def iter_any(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.at += 1
            yield chunk


class FakeResponse:
    content_type = "text/event-stream"

    def __init__(self, chunks: list[bytes]) -> None:
        self.content = FakeContent(chunks)


class Out:
    """The client's stream: what was written, and with which call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []

    async def write(self, data: bytes) -> None:
        self.calls.append(("write", data))

    async def write_eof(self, data: bytes = b"") -> None:
        self.calls.append(("write_eof", data))


class Heard:
    def __init__(self) -> None:
        self.frames = 0
        self.firsts = 0

    async def first_token(self) -> None:
        self.firsts += 1

    def tokens_sent(self, frames: int) -> None:
        self.frames += frames


@pytest.mark.parametrize("tracked_stream_", [False, True], ids=["plain", "continuable"])
async def test_the_last_chunk_goes_out_with_the_stream_end_when_the_backend_ended_with_it(
        tracked_stream_: bool) -> None:
    frames = tracked_stream(ids=True)
    chunks = [frames[0], frames[1], b"".join(frames[2:])]  # the last: end of the answer
    progress = Progress(chat=False, wants_ids=True) if tracked_stream_ else None
    f = FrameFilter(False, Frames.CHOICES, progress)
    out, heard = Out(), Heard()
    failure = await _pump(out, FakeResponse(chunks), f,  # type: ignore[arg-type]
                          heard, heard.first_token)  # type: ignore[arg-type]
    assert failure is None and f.ended, failure
    last = frames[2] + frames[3] + DONE  # the usage frame dropped
    assert out.calls == [("write", frames[0]), ("write", frames[1]), ("write_eof", last)], (
        out.calls)
    assert (heard.frames, heard.firsts) == (4, 1), (heard.frames, heard.firsts)


async def test_frames_before_a_broken_one_in_the_same_chunk_reach_the_client() -> None:
    # recorded frames are what a continuation resumes after: written before the failure
    frames = tracked_stream(ids=True)
    bad = b'data: {"error":{"message":"engine dead"}}\n\n'
    progress = Progress(chat=False, wants_ids=True)
    f = FrameFilter(False, Frames.CHOICES, progress)
    out, heard = Out(), Heard()
    failure = await _pump(out, FakeResponse([frames[0] + frames[1] + bad + frames[2]]),  # type: ignore[arg-type]
                          f, heard, heard.first_token)  # type: ignore[arg-type]
    assert failure is not None and "engine dead" in failure, failure
    assert out.calls == [("write", frames[0] + frames[1])], out.calls
    assert (progress.generated, heard.frames, heard.firsts) == ([11, 12], 2, 1), (
        progress.generated, heard.frames, heard.firsts)
