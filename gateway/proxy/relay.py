"""What passes from a backend to the client, and the events it reports on the way.

The relay tells its :class:`RelayListener`, in the order they happen: the first frame
that carries generated output (the backend runs the request), every write of output
frames to the client, the token usage the backend reported, and the end of the answer
(complete: the ``[DONE]`` frame or the whole body went out).

:class:`FrameFilter` is the pure part: it splits SSE bytes into frames, finds the first
output frame, takes the usage frame, and drops the usage-only frame fairgate asked for
when the client did not. Which frames to expect is the endpoint's (``Frames`` in
``gateway/proxy/endpoints.py``): a Responses API stream (``EVENTS``) has no usage frame and no
``[DONE]``: its final event (``response.completed``) carries the usage in
``response.usage`` and ends the answer. The usage counts' names are the endpoint's too.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from gateway.core.edge import sse_frame
from gateway.core.errors import UpstreamError
from gateway.proxy.endpoints import Endpoint, Frames, Usage

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]"
# delta fields that carry generated output (chat); a role-only or empty delta does not
OUTPUT_DELTA_FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls",
                       "function_call")
# the Responses API's final events: the whole response, with its usage
RESPONSE_FINAL_EVENTS = frozenset(("response.completed", "response.incomplete",
                                   "response.failed"))
RESPONSE_OBJECT = b'"response":'  # in those events (generated text has its quotes escaped)


class RelayListener(Protocol):
    async def first_token(self) -> None:
        """The first frame with generated output passed: the backend runs the request."""

    def tokens_sent(self, frames: int) -> None:
        """``frames`` output frames were written to the client."""

    def usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        """The backend's token counts for the request."""

    def end(self, completed: bool) -> None:
        """The answer is over; ``completed`` when the client got all of it."""


def carries_output(event: dict[str, Any]) -> bool:
    """Does this streamed event carry generated content or token ids?"""
    kind = event.get("type")
    if isinstance(kind, str):  # Responses API: response.output_text.delta, ….delta
        return kind.startswith("response.") and kind.endswith(".delta") and bool(
            event.get("delta"))
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("text") or choice.get("token_ids"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(delta.get(f) for f in OUTPUT_DELTA_FIELDS):
            return True
    return False


def _data(frame: bytes) -> bytes | None:
    """The JSON payload of an SSE frame (its ``data:`` line), if it has one."""
    for line in frame.split(b"\n"):
        if line.startswith(b"data: {"):
            return line[6:]
    return None


class FrameFilter:
    """Splits a stream into whole SSE frames and reads what the relay reports."""

    def __init__(self, wants_usage: bool, frames: Frames = Frames.CHOICES) -> None:
        self.wants_usage = wants_usage
        self.events = frames is Frames.EVENTS  # typed events, the final one with usage
        self.started = False  # an output frame has passed
        self.output_frames = 0
        self.usage: dict[str, Any] | None = None
        self.done = False  # the [DONE] frame has passed
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to write to the client now (whole frames only)."""
        self._pending += chunk
        end = self._pending.rfind(b"\n\n")
        if end < 0:
            return b""
        complete, self._pending = self._pending[: end + 2], self._pending[end + 2:]
        if (self.started and b'"usage"' not in complete and DONE not in complete
                and not (self.events and RESPONSE_OBJECT in complete)):
            # the hot path, no parsing: lines that start a JSON payload (a JSON string
            # cannot hold a raw newline, so generated text never matches)
            self.output_frames += (complete.count(b"\ndata: {")
                                   + complete.startswith(b"data: {"))
            return complete
        return b"".join(self._frame(f + b"\n\n") for f in complete.split(b"\n\n")[:-1])

    def rest(self) -> bytes:
        """Whatever trailed the last whole frame when the stream ended."""
        rest, self._pending = self._pending, b""
        return rest

    def _frame(self, frame: bytes) -> bytes:
        if frame.startswith(DONE):
            self.done = True
            return frame
        payload = _data(frame)
        if payload is None:
            return frame
        if not self.started or b'"usage"' in payload:
            try:
                event = json.loads(payload)
            except (ValueError, RecursionError):  # not ours to judge: relay it as it came
                return frame
            if not isinstance(event, dict):
                return frame
            if carries_output(event):
                self.started = True
            if self.events and event.get("type") in RESPONSE_FINAL_EVENTS:
                self.done = True
                response = event.get("response")
                usage = response.get("usage") if isinstance(response, dict) else None
                if isinstance(usage, dict) and usage:
                    self.usage = usage
                return self._counted(frame)
            usage = event.get("usage")
            if isinstance(usage, dict) and usage:
                self.usage = usage
                if not (self.wants_usage or event.get("choices")):
                    return b""  # the usage-only frame fairgate asked for, not the client
        return self._counted(frame)

    def _counted(self, frame: bytes) -> bytes:
        if self.started:
            self.output_frames += 1
        return frame


def report_usage(usage: Any, listener: RelayListener, names: Usage) -> None:
    """The endpoint's usage counts (``names``); a count that is missing or not an integer
    is 0 (embeddings have no completion tokens)."""
    if isinstance(usage, dict):
        listener.usage(_count(usage, names.prompt), _count(usage, names.output))


def _count(usage: dict[str, Any], name: str) -> int:
    value = usage.get(name)
    return value if type(value) is int else 0


class ClientGone(Exception):
    """The client's connection closed while the relay wrote to it."""


async def _write(out: web.StreamResponse, data: bytes) -> None:
    try:
        await out.write(data)
    except ConnectionResetError as exc:  # aiohttp's: "Cannot write to closing transport"
        raise ClientGone from exc


async def relay_stream(request: web.Request, resp: aiohttp.ClientResponse,
                       listener: RelayListener, wants_usage: bool,
                       endpoint: Endpoint) -> web.StreamResponse:
    """Relay the backend's SSE stream. A client that hangs up is handled like the handler's
    cancellation (its request settles as ``client_closed`` and the backend connection
    closes, so vLLM aborts it), not as a gateway error."""
    try:
        return await _relay(request, resp, listener, wants_usage, endpoint)
    except ClientGone:
        raise asyncio.CancelledError from None


async def _relay(request: web.Request, resp: aiohttp.ClientResponse,
                 listener: RelayListener, wants_usage: bool,
                 endpoint: Endpoint) -> web.StreamResponse:
    out = web.StreamResponse(status=200, headers=SSE_HEADERS)
    try:
        await out.prepare(request)
    except ConnectionResetError as exc:
        listener.end(False)
        raise ClientGone from exc
    frames = FrameFilter(wants_usage, endpoint.frames)
    try:
        async for chunk in resp.content.iter_any():
            was_started, sent_before = frames.started, frames.output_frames
            data = frames.feed(chunk)
            if data:
                await _write(out, data)
            if frames.output_frames != sent_before:
                listener.tokens_sent(frames.output_frames - sent_before)
            if frames.started and not was_started:
                await listener.first_token()
        if rest := frames.rest():
            await _write(out, rest)
    except (aiohttp.ClientError, TimeoutError) as exc:
        # The status line is gone already: end the stream with an error event instead.
        await _write(out, sse_frame(UpstreamError(f"backend failed mid-stream: {exc!r}")))
    finally:
        report_usage(frames.usage, listener, endpoint.usage)
        if not frames.usage:
            listener.usage(0, frames.output_frames)
        listener.end(frames.done)
    try:
        await out.write_eof()
    except ConnectionError:
        if not frames.done:
            raise ClientGone from None
        # the client hung up after reading [DONE]: the answer was delivered
    return out
