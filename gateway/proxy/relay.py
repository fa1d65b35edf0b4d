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

A chat or completion stream that can be continued (``gateway/proxy/continuation.py``)
is read frame by frame: its token ids are recorded (and stripped unless the client asked
for them), and when its backend fails mid-answer (a reset, an error event, a broken
frame, or an end before the answer's) the relay asks ``resume`` for a continuation on
another backend and writes its frames, re-framed, into the same client stream. Only a
stream that cannot continue ends with an error event. Every stream must be one: a 200
that is not ``text/event-stream`` (a JSON or text body) or that ends without its
``[DONE]`` (Responses API: its final event) is such a failure, never relayed as it came.
A stream moved on purpose (its :class:`~gateway.proxy.moving.Mover` closed the response)
continues the same way, with the move's reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import structlog
from aiohttp import web

from gateway.core import jsonio
from gateway.core.edge import sse_frame
from gateway.core.errors import FairgateError, UpstreamError
from gateway.proxy.choices import StreamProgress
from gateway.proxy.endpoints import Endpoint, Frames, Usage
from gateway.proxy.fan_in import FanIn
from gateway.proxy.moving import FAILOVER, Mover
from gateway.proxy.replay import Diverged

log = structlog.get_logger("fairgate.relay")

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
# token ids fairgate asked for and the client did not: "token_ids":[…] and
# "prompt_token_ids":[…] become null (in generated text a quote is \"); found by their
# literal tail, the key's start checked after (several times faster than one pattern)
ID_LIST = re.compile(rb'token_ids":\[[-0-9,\s]*\]')


class StreamBroke(Exception):
    """A backend's stream failed before its answer ended."""


@dataclass(slots=True)
class Segment:
    """A continuation's answer: its response, who hears its first output, and whether it
    is the original request sent again (its prompt's token ids never came)."""

    resp: aiohttp.ClientResponse | FanIn  # FanIn: several choices' continuations
    started: Callable[[], Awaitable[None]]
    restart: bool = False


# (why: failover or a move's reason, what failed) → a continuation's segment (entering it
# may raise StreamBroke: try the next), or None: no more continuations
Resume = Callable[[str, str], AbstractAsyncContextManager[Segment] | None]


class RelayListener(Protocol):
    async def first_token(self) -> None:
        """The first frame with generated output passed: the backend runs the request."""

    def tokens_sent(self, frames: int) -> None:
        """``frames`` output frames were written to the client."""

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> None:
        """The backend's token counts for the request (``cached_tokens``: of the prompt,
        those found in its prefix cache; 0 when it does not say)."""

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


def strip_ids(frames: bytes) -> bytes:
    """``frames`` with every ``"token_ids"`` and ``"prompt_token_ids"`` list as ``null``."""
    out: list[bytes] = []
    pos = 0
    for match in ID_LIST.finditer(frames):
        start = match.start()
        if frames[start - 1:start] == b'"' or frames[start - 8:start] == b'"prompt_':
            out += (frames[pos:start], b'token_ids":null')
            pos = match.end()
    if not out:
        return frames
    out.append(frames[pos:])
    return b"".join(out)


def _data(frame: bytes) -> bytes | None:
    """The JSON payload of an SSE frame (its ``data:`` line), if it has one."""
    for line in frame.split(b"\n"):
        if line.startswith(b"data: {"):
            return line[6:]
    return None


class FrameFilter:
    """Splits a stream into whole SSE frames and reads what the relay reports."""

    def __init__(self, wants_usage: bool, frames: Frames = Frames.CHOICES,
                 progress: StreamProgress | None = None) -> None:
        self.wants_usage = wants_usage
        self.events = frames is Frames.EVENTS  # typed events, the final one with usage
        self.progress = progress  # a continuable answer: every frame is read
        self.continued = False  # the frames come from a continuation (re-framed)
        self.started = False  # an output frame has passed
        self.segment_started = False  # … from the current backend
        self.output_frames = 0
        self.usage: dict[str, Any] | None = None
        self.done = False  # the [DONE] frame has passed
        self.ended = False  # … and the client's stream ended with it (nothing more to write)
        self.cut = False  # fairgate ended the answer: the backend's rest is not read
        # a broken frame read after good ones of the same chunk: raised once those are written
        self.broken: StreamBroke | None = None
        # the last chunk completed a frame (a replay's frame the client has already is
        # read, not written: its backend is not idle)
        self.whole = False
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to write to the client now (whole frames only)."""
        self._pending += chunk
        end = self._pending.rfind(b"\n\n")
        self.whole = end >= 0
        if end < 0:
            return b""
        complete, self._pending = self._pending[: end + 2], self._pending[end + 2:]
        if (self.started and self.progress is None and b'"usage"' not in complete
                and DONE not in complete and not (self.events and RESPONSE_OBJECT in complete)):
            # the hot path, no parsing: lines that start a JSON payload (a JSON string
            # cannot hold a raw newline, so generated text never matches)
            self.output_frames += (complete.count(b"\ndata: {")
                                   + complete.startswith(b"data: {"))
            return complete
        out: list[bytes] = []
        try:
            if self.progress is not None and not self.continued:
                self._original(complete, self.progress, out)
            else:
                for f in complete.split(b"\n\n")[:-1]:
                    out.append(self._frame(f + b"\n\n"))
                    if self.cut:
                        break
        except StreamBroke as exc:
            # the frames before the broken one were recorded (the continuation resumes
            # after them), so they reach the client before the stream fails over
            self.broken = exc
        return b"".join(out)

    def _original(self, complete: bytes, progress: StreamProgress, out: list[bytes]) -> None:
        """Whole frames of a continuable stream's original backend, appended to ``out``
        as they are read: once its output began, each run of output frames (one
        ``data:`` line each, no usage) is read in one pass (:meth:`_outputs`); any other
        frame as :meth:`_frame` reads it."""
        run: list[bytes] = []
        for frame in complete.split(b"\n\n")[:-1]:
            if (self.segment_started and frame.startswith(b"data: {") and b"\n" not in frame
                    and b'"usage"' not in frame):
                run.append(frame)
                continue
            if run:
                self._outputs(run, progress, out)
                run = []
            out.append(self._frame(frame + b"\n\n"))
        if run:
            self._outputs(run, progress, out)

    def _outputs(self, frames: list[bytes], progress: StreamProgress, out: list[bytes]) -> None:
        """Output frames after the first, each read and recorded as :meth:`_tracked`
        does, their ids stripped in one pass (a key's ``"token_ids":[…]`` never spans two
        JSON objects), appended to ``out``; a broken one raises ``StreamBroke`` once the
        frames before it are appended."""
        plain = jsonio.plain(b"\n\n".join(frames))
        for i, frame in enumerate(frames):
            try:
                progress.original(_event_of(frame[6:], plain))
            except StreamBroke:
                self._append_run(frames[:i], progress, out)
                raise
        self._append_run(frames, progress, out)

    def _append_run(self, frames: list[bytes], progress: StreamProgress, out: list[bytes]) -> None:
        if frames:
            data = b"\n\n".join(frames) + b"\n\n"
            self.output_frames += len(frames)  # started: every one is counted
            out.append(data if progress.wants_ids else strip_ids(data))

    def rest(self) -> bytes:
        """Whatever trailed the last whole frame when the stream ended."""
        rest, self._pending = self._pending, b""
        return rest

    def switch(self, continued: bool) -> None:
        """The next frames come from another backend: a continuation (re-framed) or the
        request sent again; a partial frame of the failed stream is dropped."""
        self._pending = b""
        self.continued = continued
        self.segment_started = False

    def _frame(self, frame: bytes) -> bytes:
        if frame.startswith(DONE):
            self.done = True
            return frame
        payload = _data(frame)
        if payload is None:
            return frame
        if self.progress is not None:
            return self._tracked(frame, payload, self.progress)
        if not self.started or b'"usage"' in payload:
            try:
                event = jsonio.loads(payload)
            except (ValueError, RecursionError):  # not ours to judge: relay it as it came
                return frame
            if not isinstance(event, dict):
                return frame
            return self._event(frame, event)
        return self._counted(frame)

    def _tracked(self, frame: bytes, payload: bytes, progress: StreamProgress) -> bytes:
        """A frame of a continuable answer: recorded, its ids stripped unless asked for,
        re-framed when it comes from a continuation."""
        event = _event_of(payload)
        if self.continued:
            try:
                reframed = progress.continued(event)
            except Diverged as exc:  # a replay that differs: nothing of it goes out
                raise StreamBroke(str(exc)) from None
            if reframed is None:  # a replay's frame the client has already
                return b""
            event = reframed
            frame = _dumped(event)
            if progress.cut:  # fairgate ended the answer (a stop string across the seam)
                return self._event(frame, event) + self._cut(progress)
        else:
            progress.original(event)
            if progress.changed:  # the echoed prompt put back
                progress.changed = False
                frame = _dumped(event)
            elif not progress.wants_ids:
                frame = strip_ids(frame)
        return self._event(frame, event)

    def _cut(self, progress: StreamProgress) -> bytes:
        """The end of an answer fairgate ended: its usage (as asked) and ``[DONE]``; the
        continuation's later frames are not read."""
        self.usage, self.done, self.cut, self._pending = progress.usage(), True, True, b""
        return b"".join(_dumped(e) for e in progress.closing(self.wants_usage)) + DONE + (
            b"\n\n")

    def _event(self, frame: bytes, event: dict[str, Any]) -> bytes:
        if not self.started or b'"usage"' in frame:
            if carries_output(event):
                self.started = self.segment_started = True
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
        elif carries_output(event):
            self.segment_started = True
        return self._counted(frame)

    def _counted(self, frame: bytes) -> bytes:
        if self.started:
            self.output_frames += 1
        return frame


def _dumped(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":"),
                                  ensure_ascii=False).encode() + b"\n\n"


def _event_of(payload: bytes, plain: bool = False) -> dict[str, Any]:
    """A continuable stream's frame read; ``StreamBroke`` when it is broken, not an
    object, or an error event. ``plain``: ``jsonio.plain`` holds for it."""
    try:
        event = jsonio.loads(payload, plain=plain)
    except (ValueError, RecursionError):
        raise StreamBroke("the backend sent a broken frame") from None
    if not isinstance(event, dict):
        raise StreamBroke("the backend sent a frame that is not a JSON object")
    if "error" in event:
        error = event["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise StreamBroke(f"the backend sent an error event: {message}")
    return event


def report_usage(usage: Any, listener: RelayListener, names: Usage) -> None:
    """The endpoint's usage counts (``names``); a count that is missing or not an integer
    is 0 (embeddings have no completion tokens, a backend without
    ``--enable-prompt-tokens-details`` reports no cached tokens)."""
    if isinstance(usage, dict):
        details = usage.get(names.details)
        prompt = _count(usage, names.prompt)
        cached = _count(details, "cached_tokens") if isinstance(details, dict) else 0
        listener.usage(prompt, _count(usage, names.output), min(cached, prompt))


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


async def relay_stream(request: web.Request, resp: aiohttp.ClientResponse | FanIn,
                       listener: RelayListener, wants_usage: bool, endpoint: Endpoint,
                       progress: StreamProgress | None = None, resume: Resume | None = None,
                       started: Callable[[], Awaitable[None]] | None = None,
                       mover: Mover | None = None,
                       out: web.StreamResponse | None = None,
                       idle_s: float | None = None) -> web.StreamResponse:
    """Relay the backend's SSE stream. A client that hangs up is handled like the handler's
    cancellation (its request settles as ``client_closed`` and the backend connection
    closes, so vLLM aborts it), not as a gateway error. With ``progress`` and ``resume``
    a failed backend's answer continues elsewhere; ``mover`` hears each response read so
    the answer can be moved on purpose. ``out``: the client's stream when it was answered
    already (``gateway/http/queue_status.py``). ``idle_s``: a backend that sends no whole
    frame for this long once it sent its first bytes has failed
    (``stream_idle_timeout_s``)."""
    try:
        if out is None:
            out = web.StreamResponse(status=200, headers=SSE_HEADERS)
            try:
                await out.prepare(request)
            except ConnectionResetError as exc:
                listener.end(False)
                raise ClientGone from exc
        frames = FrameFilter(wants_usage, endpoint.frames, progress)
        try:
            return await _relay(resp, listener, endpoint, frames, resume,
                                started or listener.first_token, mover or Mover(), out, idle_s)
        except ClientGone:
            raise
        except Exception:
            # a bug (ours or a library's) once the status line went: the error boundary
            # can no longer answer, so the client gets an error event and the stream's
            # end here, not a connection left open until it times out
            log.exception("unhandled_error", path=request.path, mid_stream=True)
            if frames.ended:  # the whole answer and the stream's end went already
                return out
            await _write(out, sse_frame(FairgateError("internal error; see the gateway logs")))
            with contextlib.suppress(ConnectionError):
                await out.write_eof()
            return out
    except ClientGone:
        raise asyncio.CancelledError from None


async def _relay(resp: aiohttp.ClientResponse | FanIn, listener: RelayListener, endpoint: Endpoint,
                 frames: FrameFilter, resume: Resume | None,
                 started: Callable[[], Awaitable[None]], mover: Mover,
                 out: web.StreamResponse, idle_s: float | None) -> web.StreamResponse:
    progress = frames.progress
    mover.attach(resp)
    try:
        async with contextlib.AsyncExitStack() as stack:
            while (failure := await _pump(out, resp, frames, listener, started,
                                          idle_s)) is not None:
                reason = mover.take() or FAILOVER
                mover.detach()
                if progress is not None and progress.finish_reason is not None:
                    # the last token came, its backend died before the usage and [DONE]
                    await _close(out, frames, progress)
                    break
                segment = None
                if progress is not None and resume is not None and (
                        progress.resumable or not frames.started):
                    segment = await next_segment(stack, resume, reason, failure)
                if segment is None:
                    # The status line is gone already: end the stream with an error event.
                    await _write(out, sse_frame(UpstreamError(
                        f"backend failed mid-stream: {failure}")))
                    break
                resp, started = segment.resp, segment.started
                frames.switch(continued=not segment.restart)
                mover.attach(resp)
    finally:
        mover.detach()
        if not frames.usage and progress is not None and (progress.prompt_ids is not None
                                                          or progress.generated):
            # cut short (the client left, the backend failed): charged by the token ids
            # received, not by frames (vLLM puts several tokens in one when it runs ahead)
            frames.usage = progress.usage()
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


async def _pump(out: web.StreamResponse, resp: aiohttp.ClientResponse | FanIn, frames: FrameFilter,
                listener: RelayListener, started: Callable[[], Awaitable[None]],
                idle_s: float | None = None) -> str | None:
    """Relay one backend's stream; what failed, or ``None`` when it ended with its
    ``[DONE]`` (or, for the Responses API, its final event). A 200 that is not an event
    stream (a JSON or text body) failed before it began."""
    if resp.content_type != "text/event-stream":
        return (f"the backend answered the stream with {resp.content_type or 'no content type'},"
                " not an event stream")
    try:
        # the idle deadline counts whole frames from the backend (a byte trickle resets
        # aiohttp's sock_read, not this), from its first bytes on, never the time spent
        # writing to the client; silence before any byte is sock_read's
        async with asyncio.timeout(None) as idle:
            deadline = None if idle_s is None else IdleDeadline(idle, idle_s)
            try:
                async for chunk in resp.content.iter_any():
                    last = resp.content.is_eof()  # nothing follows this chunk
                    if deadline is not None:
                        deadline.busy = True
                    passed = await _pass(out, chunk, frames, listener, started, last)
                    if frames.ended or frames.cut:
                        break
                    if deadline is not None:
                        deadline.chunk_done(passed)
            finally:
                if deadline is not None:
                    deadline.close()
    except (aiohttp.ClientError, TimeoutError) as exc:
        if idle.expired():
            return f"no whole frame for {idle_s:g} s (stream_idle_timeout_s)"
        return repr(exc)
    except StreamBroke as exc:
        return str(exc)
    if not frames.done:
        return "the stream ended before the answer did (no [DONE])"
    if rest := frames.rest():
        await _write(out, rest)
    return None


class IdleDeadline:
    """A stream's idle deadline: ``idle_s`` after its latest whole frame (before any, its
    first bytes), never while the relay works on a chunk (writing it to the client,
    telling the listener). ``timeout`` fires only once the deadline passed. Its timer is
    set once and moved when it goes off early, instead of twice per chunk: per chunk the
    relay only notes the time."""

    def __init__(self, timeout: asyncio.Timeout, idle_s: float) -> None:
        self.timeout = timeout
        self.idle_s = idle_s
        self.loop = asyncio.get_running_loop()
        self.due: float | None = None  # None: no byte yet
        self.busy = False  # on a chunk
        self._timer: asyncio.TimerHandle | None = None

    def chunk_done(self, whole_frame: bool) -> None:
        """The relay is done with a chunk; ``whole_frame``: one passed to the client."""
        self.busy = False
        if whole_frame or self.due is None:
            self.due = self.loop.time() + self.idle_s
        if self._timer is None:
            self._timer = self.loop.call_at(self.due, self._check)

    def _check(self) -> None:
        self._timer = None
        if self.busy or self.due is None:
            return  # set again when the chunk is done
        now = self.loop.time()
        if now < self.due:
            self._timer = self.loop.call_at(self.due, self._check)
        else:
            self.timeout.reschedule(now)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


async def _pass(out: web.StreamResponse, chunk: bytes, frames: FrameFilter,
                listener: RelayListener, started: Callable[[], Awaitable[None]],
                last: bool = False) -> bool:
    """One chunk of the backend's stream to the client (its whole frames); whether a
    whole frame came (passed, or read and dropped: a replay's seam). ``last``: the
    backend's stream ends with it; when the answer ended too, the client's stream ends in
    the same write."""
    was_started, sent_before = frames.segment_started, frames.output_frames
    data = frames.feed(chunk)
    broken, frames.broken = frames.broken, None  # raised once the good frames are out
    first = frames.segment_started and not was_started
    if last and frames.done and not first and broken is None:
        if frames.output_frames != sent_before:
            listener.tokens_sent(frames.output_frames - sent_before)
        await _end(out, data + frames.rest())
        frames.ended = True
        return True
    if data:
        await _write(out, data)
    if frames.output_frames != sent_before:
        listener.tokens_sent(frames.output_frames - sent_before)
    if first:
        await started()
    if broken is not None:
        raise broken
    return bool(data) or frames.whole


async def _end(out: web.StreamResponse, data: bytes) -> None:
    """The client's stream's last bytes and its end, in one write."""
    try:
        await out.write_eof(data)
    except ConnectionResetError as exc:  # as _write's
        raise ClientGone from exc


async def next_segment(stack: contextlib.AsyncExitStack, resume: Resume, reason: str,
                       failure: str) -> Segment | None:
    """The next continuation that starts, each failed start one attempt (of ``reason``'s
    budget); ``None`` when no more are allowed."""
    while (attempt := resume(reason, failure)) is not None:
        try:
            return await stack.enter_async_context(attempt)
        except StreamBroke as exc:
            failure = str(exc)
    return None


async def one_segment(stack: contextlib.AsyncExitStack, resume: Resume, reason: str,
                      failure: str) -> Segment | None:
    """One continuation attempt (of ``reason``'s budget); ``None`` when it is not allowed
    or does not start."""
    attempt = resume(reason, failure)
    if attempt is None:
        return None
    try:
        return await stack.enter_async_context(attempt)
    except StreamBroke:
        return None


async def _close(out: web.StreamResponse, frames: FrameFilter, progress: StreamProgress) -> None:
    """End an answer whose last token was relayed: its usage (as asked) and ``[DONE]``."""
    for event in progress.closing(frames.wants_usage):
        await _write(out, _dumped(event))
    await _write(out, DONE + b"\n\n")
    frames.usage, frames.done = progress.usage(), True
