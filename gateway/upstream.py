"""Forwarding to a vLLM backend: inject ``priority``, then relay the answer.

For streams fairgate always asks vLLM for ``stream_options.include_usage`` so it can
charge real token counts; when the client did not ask for usage, the usage-only final
frame is dropped on the way out (``gateway/relay.py``), so the client sees exactly what it
asked for.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp import web

from gateway.backends import BackendHandle
from gateway.completion_request import CompletionRequest
from gateway.errors import UpstreamError
from gateway.relay import RelayListener, read_usage, relay_stream


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, read_timeout_s: float) -> None:
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=read_timeout_s)

    async def forward(self, request: web.Request, handle: BackendHandle, creq: CompletionRequest,
                      priority: int, listener: RelayListener) -> web.StreamResponse:
        wants_usage = bool((creq.body.get("stream_options") or {}).get("include_usage"))
        body = dict(creq.body)
        if creq.stream:
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        resp = await self._post(handle, creq.path, body, priority)
        try:
            if resp.status != 200 or not creq.stream:
                data = await _read(handle, resp, listener)
                return web.Response(body=data, status=resp.status,
                                    content_type=resp.content_type or "application/json")
            return await relay_stream(request, resp, listener, wants_usage)
        finally:
            resp.release()

    async def fetch(self, handle: BackendHandle, creq: CompletionRequest, priority: int,
                    listener: RelayListener) -> tuple[int, bytes]:
        """A non-streaming call whose answer stays in fairgate (the Batch API)."""
        body = {**creq.body, "stream": False}
        resp = await self._post(handle, creq.path, body, priority)
        try:
            return resp.status, await _read(handle, resp, listener)
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


async def _read(handle: BackendHandle, resp: aiohttp.ClientResponse,
                listener: RelayListener) -> bytes:
    """A whole (non-streamed or error) body; its usage reported when it succeeded."""
    try:
        data = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        listener.end(False)
        raise UpstreamError(f"backend {handle.name} failed mid-response: {exc}") from exc
    if resp.status == 200:
        read_usage(data, listener)
    listener.end(True)
    return data
