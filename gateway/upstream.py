"""Forwarding to a vLLM backend: inject ``priority``, relay SSE frame by frame.

For streams fairgate always asks vLLM for ``stream_options.include_usage`` so it can
charge real token counts; when the client did not ask for usage, the usage-only final
frame is dropped on the way out, so the client sees exactly what it asked for.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from gateway.backends import BackendHandle
from gateway.completion_request import CompletionRequest
from gateway.errors import UpstreamError
from gateway.observability import StreamTiming

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


@dataclass(slots=True)
class Usage:
    """Token counts of one request, filled in while the answer passes through."""

    prompt_tokens: int | None = None
    completion_tokens: int = 0
    content_frames: int = 0
    timing: StreamTiming | None = None  # metrics hook: when token frames reached the client
    # called once when the first token frame passed: the backend is running the request
    started: Callable[[], Awaitable[None]] | None = None

    def take(self, usage: dict[str, Any]) -> None:
        self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        self.completion_tokens = int(usage.get("completion_tokens") or 0)

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens or self.content_frames


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, read_timeout_s: float) -> None:
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=read_timeout_s)

    async def forward(self, request: web.Request, handle: BackendHandle, creq: CompletionRequest,
                      priority: int, usage: Usage) -> web.StreamResponse:
        wants_usage = bool((creq.body.get("stream_options") or {}).get("include_usage"))
        body = dict(creq.body)
        if creq.stream:
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        resp = await self._post(handle, creq.path, body, priority)
        try:
            if resp.status != 200 or not creq.stream:
                data = await _read(handle, resp, usage)
                return web.Response(body=data, status=resp.status,
                                    content_type=resp.content_type or "application/json")
            return await _relay_stream(request, resp, usage, wants_usage)
        finally:
            resp.release()

    async def fetch(self, handle: BackendHandle, creq: CompletionRequest, priority: int,
                    usage: Usage) -> tuple[int, bytes]:
        """A non-streaming call whose answer stays in fairgate (the Batch API)."""
        body = {**creq.body, "stream": False}
        resp = await self._post(handle, creq.path, body, priority)
        try:
            return resp.status, await _read(handle, resp, usage)
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
            return await self.session.post(handle.config.url + path, json=body,
                                           timeout=self.timeout)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(f"backend {handle.name} unreachable: {exc}") from exc


async def _read(handle: BackendHandle, resp: aiohttp.ClientResponse, usage: Usage) -> bytes:
    try:
        data = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise UpstreamError(f"backend {handle.name} failed mid-response: {exc}") from exc
    if resp.status == 200:
        _take_usage(data, usage)
    return data


def _take_usage(data: bytes, usage: Usage) -> None:
    try:
        found = json.loads(data).get("usage")
    except (ValueError, AttributeError):
        return
    if isinstance(found, dict):
        usage.take(found)


async def _relay_stream(request: web.Request, resp: aiohttp.ClientResponse, usage: Usage,
                        wants_usage: bool) -> web.StreamResponse:
    out = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await out.prepare(request)
    pending = b""
    try:
        async for chunk in resp.content.iter_any():
            pending += chunk
            end = pending.rfind(b"\n\n")
            if end < 0:
                continue
            complete, pending = pending[: end + 2], pending[end + 2:]
            frames_before = usage.content_frames
            await out.write(_filter_frames(complete, usage, wants_usage))
            if usage.content_frames != frames_before:
                if usage.timing is not None:
                    usage.timing.token_frames_sent()
                if usage.started is not None:
                    started, usage.started = usage.started, None
                    await started()
        if pending:
            await out.write(pending)
    except (aiohttp.ClientError, TimeoutError) as exc:
        # The status line is gone already: end the stream with an error event instead.
        error = UpstreamError(f"backend failed mid-stream: {exc!r}")
        await out.write(b"data: " + json.dumps(error.body()).encode() + b"\n\n")
    await out.write_eof()
    return out


def _filter_frames(frames: bytes, usage: Usage, wants_usage: bool) -> bytes:
    if b'"usage"' not in frames:
        usage.content_frames += frames.count(b"data: {")
        return frames
    kept = []
    for frame in frames.split(b"\n\n")[:-1]:
        keep = True
        if frame.startswith(b"data: {") and b'"usage"' in frame:
            obj = json.loads(frame[6:])
            if obj.get("usage"):
                usage.take(obj["usage"])
                keep = wants_usage or bool(obj.get("choices"))
        if keep:
            if frame.startswith(b"data: {"):
                usage.content_frames += 1
            kept.append(frame + b"\n\n")
    return b"".join(kept)
