"""Forwarding to a vLLM backend: inject ``priority``, then relay the answer.

For chat and completion streams fairgate always asks vLLM for
``stream_options.include_usage`` so it can charge real token counts; when the client did
not ask for usage, the usage-only final frame is dropped on the way out
(``gateway/proxy/relay.py``), so the client sees exactly what it asked for. A Responses API
stream carries its usage in its final event anyway; embeddings are never streamed.
``/tokenize`` and ``/detokenize`` go to a backend as they came, unscheduled.

A whole answer (non-streamed, or an error) passes unchanged when it is what vLLM sends: a
JSON object, and for an error OpenAI's ``{"error": {...}}`` or vLLM's older top-level
``{"object": "error", "message": ...}``. Anything else — a text/plain 413 or an HTML 502
from a proxy in front of vLLM, FastAPI's ``{"detail": ...}`` — is wrapped in OpenAI's error
format (type and code ``upstream_error``), keeping the upstream status as the status code
(502 for a success that is not JSON) and in the message.

When the backend fails mid-answer, ``forward`` continues the answer on another backend
(``continuation``: the caller's way to get one, ``gateway/scheduling/admission.py``): a
continuable stream from its token ids (``gateway/proxy/continuation.py``), one with tools
or structured output by a replay of the request (``gateway/proxy/replay.py``), a whole
answer (nothing reached the client yet) by sending the request again. A backend that answers
a whole request with a 5xx is not taken for failing (it answered; the error may be the
request's): the request is sent once more, and a second 5xx reaches the client. A 404
for the LoRA adapter a request names (unloaded while the request was on its way) is
``AdapterGone``: nothing ran, and admission queues the request again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from gateway.backends.handle import BackendHandle
from gateway.core import jsonio
from gateway.core.edge import error_json
from gateway.core.errors import (
    AdapterGone,
    BackendUnreachable,
    BadRequest,
    FairgateError,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.proxy.choices import ChoicesProgress, StreamProgress, progress_of
from gateway.proxy.completion_request import CompletionRequest
from gateway.proxy.continuation import Progress
from gateway.proxy.endpoints import CHOICES_USAGE, COMPLETIONS, Usage
from gateway.proxy.fan_in import FanIn
from gateway.proxy.moving import FAILOVER, RETRY, Mover
from gateway.proxy.relay import (
    RelayListener,
    Resume,
    Segment,
    StreamBroke,
    next_segment,
    one_segment,
    relay_stream,
    report_usage,
)
from policies.cost import estimate_prompt_tokens

JSON_HEADERS = {"Content-Type": "application/json"}


class Lease(Protocol):
    """Where a continuation runs: its backend and priority; it hears the first output."""

    @property
    def backend(self) -> BackendHandle: ...

    @property
    def priority(self) -> int: ...

    async def first_token(self) -> None: ...


# (reason, tokens sent again, the failed backend) → a lease on another backend, or None
Continuation = Callable[[str, int, BackendHandle], AbstractAsyncContextManager[Lease] | None]


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, read_timeout_s: float,
                 max_request_s: float | None = None,
                 stream_idle_s: Callable[[], float | None] = lambda: None) -> None:
        self.session = session
        # no whole frame this long mid-stream, or a whole answer's body not whole this long
        # after its status line: failed (a byte trickle resets sock_read, not this); read
        # at each request (the settings in force, a reload applies it)
        self._stream_idle_s = stream_idle_s
        # sock_read: the backend went quiet; total: no answer, streamed or not, runs longer
        # than max_request_s (a stream then ends with an error event)
        self.timeout = aiohttp.ClientTimeout(total=max_request_s, sock_connect=10,
                                             sock_read=read_timeout_s)

    @property
    def stream_idle_s(self) -> float | None:
        return self._stream_idle_s()

    async def forward(self, request: web.Request, handle: BackendHandle, creq: CompletionRequest,
                      priority: int, listener: RelayListener,
                      continuation: Continuation | None = None,
                      mover: Mover | None = None,
                      early: web.StreamResponse | None = None) -> web.StreamResponse:
        """Send the request to ``handle`` and relay the answer; with ``continuation``, a
        backend that fails mid-answer hands the rest to another, and ``mover`` can move
        the answer there on purpose. ``early``: the client's stream, answered 200 already
        (``gateway/http/queue_status.py``): an error answer ends it as an error event."""
        wants_usage = True  # a Responses stream has no usage frame to drop
        if creq.endpoint.stream_usage_option:
            wants_usage = creq.include_usage
        progress = progress_of(creq) if (
            continuation is not None and creq.stream) else None
        body = creq.forwarded(token_ids=progress is not None)
        if isinstance(progress, Progress):
            body = progress.first_body(body)
        resume = None if continuation is None else self._resumer(
            creq, body, progress, handle, continuation)
        mover = mover or Mover()
        if resume is not None:
            mover.progress, mover.whole = progress, not creq.stream
        async with contextlib.AsyncExitStack() as stack:
            resp, started = await self._open(stack, handle, creq.path, body, priority,
                                             resume, mover, creq.stream)
            if resp.status == 404 and started is None and creq.model != handle.config.model:
                raise AdapterGone(f"backend {handle.name} no longer has the LoRA adapter "
                                  f"{creq.model!r}: {(await resp.read())[:200]!r}")
            if not creq.stream:
                return await self._whole(handle, resp, listener, creq.endpoint.usage, resume,
                                         mover)
            if resp.status != 200:
                status, data, content_type = await _read(handle, resp, listener,
                                                         creq.endpoint.usage,
                                                         self.stream_idle_s)
                if early is not None:  # one line: the error object as the last event
                    event = json.dumps(json.loads(data), separators=(",", ":")).encode()
                    await early.write(b"data: " + event + b"\n\n")
                    await early.write_eof()
                    return early
                return web.Response(body=data, status=status, content_type=content_type)
            return await relay_stream(request, resp, listener, wants_usage, creq.endpoint,
                                      progress, resume, started, mover,
                                      early, self.stream_idle_s)

    async def _open(self, stack: contextlib.AsyncExitStack, handle: BackendHandle, path: str,
                    body: dict[str, Any], priority: int, resume: Resume | None,
                    mover: Mover, stream: bool
                    ) -> tuple[aiohttp.ClientResponse, Callable[[], Awaitable[None]] | None]:
        """The answer's first response (and who hears its first output, for a
        continuation's): a whole answer's request can be moved before its status line;
        one that breaks off (or is moved) then continues elsewhere."""
        try:
            resp = await (self._post(handle, path, body, priority) if stream
                          else self._movable_post(mover, handle, path, body, priority))
            stack.callback(resp.release)
            return resp, None
        except BackendUnreachable:  # nothing was sent: queued again (admission)
            raise
        except UpstreamError as exc:  # it broke off (or was moved) before its status line
            if not stream and isinstance(exc, UpstreamTimeout):
                # a whole answer that outlasts the timeout: sent again elsewhere it would
                # be cut the same, after generating as much once more (what its client is
                # charged for the cut: gateway/scheduling/admission.py)
                raise
            segment = None if resume is None else await next_segment(
                stack, resume, mover.take() or FAILOVER, str(exc))
            if segment is None:
                raise
            return _single(segment.resp), segment.started

    async def _movable_post(self, mover: Mover, handle: BackendHandle, path: str,
                            body: dict[str, Any], priority: int) -> aiohttp.ClientResponse:
        """A whole answer's request: vLLM sends its status line with the whole answer, so
        the answer can be moved while it is generated (the request is cancelled)."""
        task = asyncio.ensure_future(self._post(handle, path, body, priority))
        mover.attach_pending(task)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if mover.reason is None or current is None or current.cancelling():
                raise  # not a move: the handler itself is cancelled
            raise UpstreamError(f"backend {handle.name}: the answer was moved "
                                f"({mover.reason})") from None
        finally:
            mover.detach()

    def _resumer(self, creq: CompletionRequest, body: dict[str, Any],
                 progress: StreamProgress | None, handle: BackendHandle,
                 continuation: Continuation) -> Resume:
        failed = [handle]  # the backend the answer last ran on

        def resume(reason: str, failure: str) -> AbstractAsyncContextManager[Segment] | None:
            if progress is None:  # a whole answer, sent again from the start
                tokens = estimate_prompt_tokens(creq.prompt)
            elif isinstance(progress, ChoicesProgress):
                tokens = progress.resent
            else:
                tokens = len(progress.prompt_ids or ()) + len(progress.generated)
            lease = continuation(reason, tokens, failed[0])
            return None if lease is None else self._segment(lease, creq, body, progress,
                                                            failed)
        return resume

    @asynccontextmanager
    async def _segment(self, lease: AbstractAsyncContextManager[Lease],
                       creq: CompletionRequest, body: dict[str, Any],
                       progress: StreamProgress | None,
                       failed: list[BackendHandle]) -> AsyncIterator[Segment]:
        """One continuation: scheduled, sent, answered 200, or ``StreamBroke``."""
        async with contextlib.AsyncExitStack() as stack:
            try:
                ticket = await stack.enter_async_context(lease)
            except FairgateError as exc:  # not placed: queue timeout, Redis down, …
                raise StreamBroke(f"no backend took the rest of the answer: {exc}") from exc
            failed[0] = ticket.backend
            restart = progress is None or not progress.resumable
            if isinstance(progress, ChoicesProgress) and not restart:  # one per choice
                parts = [(index, await self._segment_post(stack, ticket, COMPLETIONS.path,
                                                          sent, creq))
                         for index, sent in progress.continuation_bodies(creq, creq.stream)]
                fan = FanIn(parts)
                stack.callback(fan.content.stop)  # its readers end with the answer
                yield Segment(fan, ticket.first_token, restart)
                return
            path, sent = creq.path, body
            if isinstance(progress, Progress) and not restart:
                if progress.transcript is not None:  # replayed: the request as it came
                    sent = progress.replay_body()
                else:
                    await self._seam(ticket.backend, creq.model, progress)
                    path = COMPLETIONS.path
                    sent = progress.continuation_body(creq, creq.stream)
            resp = await self._segment_post(stack, ticket, path, sent, creq)
            yield Segment(resp, ticket.first_token, restart)

    async def _segment_post(self, stack: contextlib.AsyncExitStack, ticket: Lease, path: str,
                            sent: dict[str, Any], creq: CompletionRequest
                            ) -> aiohttp.ClientResponse:
        """A continuation's request, answered 200 (released with ``stack``), or
        ``StreamBroke``."""
        try:
            resp = await self._post(ticket.backend, path, dict(sent), ticket.priority)
        except UpstreamError as exc:  # BackendUnreachable too
            if not creq.stream and isinstance(exc, UpstreamTimeout):
                raise  # a whole answer cut by the timeout: final, as in _open
            raise StreamBroke(str(exc)) from exc
        stack.callback(resp.release)
        if resp.status != 200:
            raise StreamBroke(f"backend {ticket.backend.name} answered HTTP {resp.status}")
        return resp

    async def _seam(self, handle: BackendHandle, model: str, progress: Progress) -> None:
        """A stop-string answer's text at the seam: the prompt's ids and the generated ids
        decoded by ``handle`` (``/detokenize``), so fairgate can send what vLLM held back
        and apply the stop strings across the seam (``gateway/proxy/stop_strings.py``)."""
        if progress.stops is None:
            return
        texts = []
        for ids in progress.seam_ids():
            try:
                resp = await self._send(handle, "/detokenize", {"model": model, "tokens": ids})
            except UpstreamError as exc:  # BackendUnreachable too
                raise StreamBroke(str(exc)) from exc
            try:
                data = _json(await resp.read()) if resp.status == 200 else None
            except aiohttp.ClientError as exc:
                raise StreamBroke(f"backend {handle.name}: /detokenize failed: {exc}") from exc
            finally:
                resp.release()
            text = data.get("prompt") if isinstance(data, dict) else None
            if not isinstance(text, str):
                raise StreamBroke(f"backend {handle.name} answered /detokenize with HTTP "
                                  f"{resp.status}, no text")
            texts.append(text)
        if not progress.seam_at(*texts):
            raise StreamBroke(f"backend {handle.name} decodes the generated ids otherwise "
                              "than the stream's text")

    async def _whole(self, handle: BackendHandle, resp: aiohttp.ClientResponse,
                     listener: RelayListener, usage: Usage,
                     resume: Resume | None, mover: Mover) -> web.Response:
        """A whole answer; when its backend fails (the body breaks off) or it is moved,
        the request goes again to another backend: nothing reached the client yet. An
        answer of status 5xx is sent again once (``RETRY``: the backend answered, so its
        gates stay open); a second 5xx is the request's own, and the client gets the
        first: a request vLLM cannot serve (a prompt its tokenizer fails on) no longer
        goes round every backend closing each one's gates."""
        retried = False
        async with contextlib.AsyncExitStack() as stack:
            while True:
                if resp.status >= 500 and resume is not None and not retried:
                    retried = True
                    segment = await one_segment(
                        stack, resume, RETRY,
                        f"backend {handle.name} answered HTTP {resp.status}")
                    if segment is not None:
                        resp = _single(segment.resp)
                    continue
                mover.attach(resp)
                try:
                    status, data, content_type = await _read(
                        handle, resp, listener, usage, self.stream_idle_s)
                    return web.Response(body=data, status=status, content_type=content_type)
                except UpstreamError as exc:
                    if resume is None:
                        raise
                    failure, reason = str(exc), mover.take() or FAILOVER
                finally:
                    mover.detach()
                segment = await next_segment(stack, resume, reason, failure)
                if segment is None:
                    raise UpstreamError(failure)
                resp = _single(segment.resp)

    async def fetch(self, handle: BackendHandle, creq: CompletionRequest, priority: int,
                    listener: RelayListener, continuation: Continuation | None = None,
                    mover: Mover | None = None) -> tuple[int, bytes]:
        """A non-streaming call whose answer stays in fairgate (the Batch API). With
        ``continuation`` it is a whole answer like a non-streamed request's: moved on
        purpose (a drain, preemption) or failing, it is sent again elsewhere from the start
        (nothing of it was recorded yet)."""
        body = creq.fetched()
        resume = None if continuation is None else self._resumer(
            creq, body, None, handle, continuation)
        mover = mover or Mover()
        mover.whole = resume is not None
        async with contextlib.AsyncExitStack() as stack:
            resp, _ = await self._open(stack, handle, creq.path, body, priority, resume,
                                       mover, False)
            answer = await self._whole(handle, resp, listener, creq.endpoint.usage, resume,
                                       mover)
        return answer.status, bytes(answer.body)  # type: ignore[arg-type]

    async def unscheduled(self, handle: BackendHandle, path: str,
                          body: dict[str, Any]) -> web.Response:
        """A cheap call that is not queued (``/tokenize``, ``/detokenize``): the body as it
        came, the answer as vLLM gave it (a foreign error wrapped in OpenAI's format)."""
        resp = await self._send(handle, path, body)
        try:
            status, data, content_type = await _read(handle, resp, NO_LISTENER,
                                                     idle_s=self.stream_idle_s)
            return web.Response(body=data, status=status, content_type=content_type)
        finally:
            resp.release()

    async def _post(self, handle: BackendHandle, path: str, body: dict[str, Any],
                    priority: int) -> aiohttp.ClientResponse:
        send_priority = handle.accepts_priority and priority != 0
        if send_priority:
            body["priority"] = priority
        else:
            body.pop("priority", None)  # never let a client pick its own vLLM priority
        resp = await self._send(handle, path, body)
        if resp.status == 400 and send_priority:
            text = await resp.text()
            if "priority" in text.lower():
                # An fcfs-only server that rejects the field: remember and send without.
                resp.release()
                handle.accepts_priority = False
                body.pop("priority", None)
                return await self._send(handle, path, body)
        return resp

    async def _send(self, handle: BackendHandle, path: str,
                    body: dict[str, Any]) -> aiohttp.ClientResponse:
        try:
            data = jsonio.dumps(body)
        except RecursionError:  # only if max_json_depth was raised past what Python encodes
            raise BadRequest("request body is nested too deeply to be sent to the backend"
                             ) from None
        try:
            return await self.session.post(handle.config.url + path, data=data,
                                           headers=JSON_HEADERS, timeout=self.timeout)
        except aiohttp.ClientConnectorError as exc:
            raise BackendUnreachable(f"backend {handle.name} unreachable: {exc}") from exc
        except TimeoutError as exc:  # aiohttp's timeouts are TimeoutErrors too
            raise UpstreamTimeout(f"backend {handle.name} sent no answer in time "
                                  f"(upstream_timeout_s / max_request_s): {exc!r}") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"backend {handle.name} unreachable: {exc}") from exc


def _single(resp: aiohttp.ClientResponse | FanIn) -> aiohttp.ClientResponse:
    """A segment that sends the request again (a whole answer, or a stream before its
    first frame): one response, never several choices' continuations."""
    if isinstance(resp, FanIn):
        raise TypeError("several choices' continuations where the request was sent again")
    return resp


class _NoListener:
    """For answers nobody is charged for."""

    async def first_token(self) -> None:
        pass

    def tokens_sent(self, frames: int) -> None:
        pass

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> None:
        pass

    def end(self, completed: bool) -> None:
        pass


NO_LISTENER = _NoListener()


async def _read(handle: BackendHandle, resp: aiohttp.ClientResponse,
                listener: RelayListener, usage: Usage = CHOICES_USAGE,
                idle_s: float | None = None) -> tuple[int, bytes, str]:
    """(status, body, content type) of a whole (non-streamed or error) answer for the
    client, in OpenAI's format; its usage reported when it succeeded. ``idle_s``: the
    body is whole within this long after the status line (vLLM sends it at once)."""
    try:
        async with asyncio.timeout(idle_s) as deadline:
            data = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        listener.end(False)
        problem = (f"its body took longer than {idle_s:g} s (stream_idle_timeout_s)"
                   if deadline.expired() else f"failed mid-response: {exc}")
        raise UpstreamError(f"backend {handle.name} {problem}") from exc
    content_type = resp.content_type or "application/json"
    parsed = _json(data)
    if resp.status == 200 and isinstance(parsed, dict):
        report_usage(parsed.get("usage"), listener, usage)
    listener.end(True)
    if isinstance(parsed, dict) and (resp.status == 200 or is_openai_error(parsed)):
        return resp.status, data, content_type
    return _wrapped(handle, resp, data)


def _json(data: bytes) -> Any:
    try:
        return jsonio.loads(data)
    except (ValueError, RecursionError):
        return None


def is_openai_error(body: dict[str, Any]) -> bool:
    """vLLM's error shapes: ``{"error": {"message": …}}`` (OpenAI's, vLLM ≥ 0.10) or the
    older top-level ``{"object": "error", "message": …}``."""
    error = body.get("error")
    if isinstance(error, dict):
        return isinstance(error.get("message"), str)
    return body.get("object") == "error" and isinstance(body.get("message"), str)


SNIPPET_CHARS = 200


class ForeignAnswer(UpstreamError):
    """A backend answer that is not OpenAI-shaped; rendered with the upstream's status."""

    type = "upstream_error"


def _wrapped(handle: BackendHandle, resp: aiohttp.ClientResponse,
             data: bytes) -> tuple[int, bytes, str]:
    """A foreign answer in OpenAI's error format, its status and (text) body quoted."""
    content_type = resp.content_type or "no content type"
    said = f"HTTP {resp.status} {resp.reason or ''}".rstrip()
    if resp.status == 200:
        status = UpstreamError.status
        message = (f"backend {handle.name} answered {said} with a body that is not a JSON "
                   f"object ({content_type})")
    else:
        status = resp.status
        message = f"backend {handle.name} answered {said} ({content_type})"
        text = re.sub(r"\s+", " ", data[: SNIPPET_CHARS * 4].decode(errors="replace")).strip()
        if text and "html" not in content_type:
            message += ": " + text[:SNIPPET_CHARS]
    return status, error_json(ForeignAnswer(message)), "application/json"
