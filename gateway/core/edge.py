"""The HTTP edge: every error leaves in OpenAI's format, rendered here and only here.

``{"error": {message, type, param, code}}`` with the error's status, as a JSON answer
(:func:`render`), as an SSE frame ending a stream whose status line is gone
(:func:`sse_frame`: the relay), as a JSON body (:func:`error_json`: a foreign upstream
answer) or as a whole raw HTTP answer (:func:`raw_answer`: the server's connection cap).
Every 429 and 503 carries ``Retry-After``; its value comes from the wait estimator
(``gateway/scheduling/waits.py``), here when the error does not carry one yet. Each error answer is
counted in ``fairgate_errors_total`` and logged as one ``rejected`` event with status,
type and code only: messages may quote what the client sent. An upstream answer of status
≥ 400 passes through unchanged and is counted as type ``upstream``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.core.errors import FairgateError, NotFound, RateLimitExceeded
from gateway.core.logs import clear_request
from gateway.core.metrics import GatewayMetrics

log = structlog.get_logger("fairgate.request")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# the request's Retry-After when its error carries none (the wait estimator's floor)
RetryAfter = Callable[[web.Request], int]
RETRY_STATUSES = frozenset((429, 503))


def error_object(error: FairgateError) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": error.message, "type": error.type, "param": error.param,
                      "code": error.code}}


def error_json(error: FairgateError) -> bytes:
    return json.dumps(error_object(error)).encode()


def error_headers(error: FairgateError) -> dict[str, str]:
    """``Retry-After`` when the error carries one, and a rate limit's ``x-ratelimit-*``."""
    headers = dict(error.limit_headers) if isinstance(error, RateLimitExceeded) else {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    return headers


def render(error: FairgateError) -> web.Response:
    return web.json_response(error_object(error), status=error.status,
                             headers=error_headers(error))


def sse_frame(error: FairgateError) -> bytes:
    """The error as the last frame of a stream already answered 200."""
    return b"data: " + error_json(error) + b"\n\n"


def raw_answer(error: FairgateError) -> bytes:
    """The whole HTTP/1.1 answer, closing the connection (nothing of the request read)."""
    body = error_json(error)
    head = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}",
            "Content-Type: application/json",
            *(f"{name}: {value}" for name, value in error_headers(error).items()),
            "Connection: close", f"Content-Length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _from_http(exc: web.HTTPException, request: web.Request) -> FairgateError:
    """aiohttp's own errors (405, 413 from client_max_size, …) in OpenAI's format."""
    if exc.status == 404:
        return NotFound(f"no route {request.method} {request.path}")
    error = FairgateError(exc.reason)
    error.status = exc.status
    error.type = "invalid_request_error" if exc.status < 500 else "server_error"
    return error


def error_boundary(metrics: GatewayMetrics, retry_after: RetryAfter) -> Middleware:
    @web.middleware
    async def boundary(request: web.Request, handler: Handler) -> web.StreamResponse:
        clear_request()
        allow: str | None = None
        try:
            response = await handler(request)
        except FairgateError as exc:
            error = exc
        except web.HTTPException as exc:
            error = _from_http(exc, request)
            allow = exc.headers.get("Allow")
        except Exception:
            log.exception("unhandled_error", path=request.path)
            error = FairgateError("internal error; see the gateway logs")
        else:
            if response.status >= 400:  # an upstream answer passed through unchanged
                _rejected(metrics, request, response.status, "upstream", None)
            return response
        _rejected(metrics, request, error.status, error.type, error.code)
        if error.status in RETRY_STATUSES and error.retry_after_s is None:
            error.retry_after_s = retry_after(request)
        rendered = render(error)
        if allow is not None:
            rendered.headers["Allow"] = allow
        return rendered

    return boundary


def _rejected(metrics: GatewayMetrics, request: web.Request, status: int, type_: str,
              code: str | None) -> None:
    code_label = code or ""
    metrics.child(metrics.edge.errors, str(status), type_, code_label).inc()
    log.info("rejected", method=request.method, path=request.path, status=status,
             error_type=type_, code=code or None)
