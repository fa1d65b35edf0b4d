"""The HTTP edge's one error boundary: every error leaves in OpenAI's format.

``{"error": {message, type, param, code}}`` with the error's status (and ``Retry-After``
where it has one). Each error answer is counted in ``fairgate_errors_total`` and logged as
one ``rejected`` event with status, type and code only: messages may quote what the
client sent. An upstream answer of status ≥ 400 passes through unchanged and is counted
as type ``upstream``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.errors import FairgateError, NotFound
from gateway.metrics import GatewayMetrics

log = structlog.get_logger("fairgate.request")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def render(error: FairgateError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers())


def _from_http(exc: web.HTTPException, request: web.Request) -> FairgateError:
    """aiohttp's own errors (405, 413 from client_max_size, …) in OpenAI's format."""
    if exc.status == 404:
        return NotFound(f"no route {request.method} {request.path}")
    error = FairgateError(exc.reason)
    error.status = exc.status
    error.type = "invalid_request_error" if exc.status < 500 else "server_error"
    return error


def error_boundary(metrics: GatewayMetrics) -> Middleware:
    @web.middleware
    async def boundary(request: web.Request, handler: Handler) -> web.StreamResponse:
        structlog.contextvars.clear_contextvars()
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
        rendered = render(error)
        if allow is not None:
            rendered.headers["Allow"] = allow
        return rendered

    return boundary


def _rejected(metrics: GatewayMetrics, request: web.Request, status: int, type_: str,
              code: str | None) -> None:
    code_label = code or ""
    metrics.errors.labels(str(status), type_, code_label).inc()
    log.info("rejected", method=request.method, path=request.path, status=status,
             error_type=type_, code=code or None)
