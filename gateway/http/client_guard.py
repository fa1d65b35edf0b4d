"""What every request's client owes the gateway, whatever the route: a body that keeps
arriving, and proof of who it is before it holds a connection for long.

- **Body deadline** (every route): a body that stops arriving for
  ``client_idle_timeout_s`` is cut, and so is one that, past that first window, arrives
  slower than ``min_body_bytes_per_s`` on average (a trickle of a byte every few seconds
  never goes idle); either answers 408 and closes the connection. The reader of the body
  (JSON, a form, a multipart upload) sees :class:`~gateway.core.errors.RequestTimeout`.
- **Authenticated connections**: each request marks its connection as having sent a
  request, and again once a key check passes (``gateway/core/connections.py``); the
  server (``gateway/http/server.py``) reads both sets to keep connections that never
  authenticated within their own allowance without closing ones just opened.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import StreamReader, web
from aiohttp.typedefs import Middleware

from gateway.core.connections import marking
from gateway.core.errors import RequestTimeout

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# the connections (their protocol objects) on which a request authenticated
AUTHENTICATED = web.AppKey("fairgate_authenticated_connections", set)
# ... and those on which a request arrived (authenticated or not)
REQUESTED = web.AppKey("fairgate_requested_connections", set)
TICKS_PER_WINDOW = 4  # a stalled body is cut within 1.25 × the idle timeout


def client_guard(idle_timeout_s: float, min_bytes_per_s: int) -> Middleware:
    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        protocol = request.protocol
        authenticated: set[object] = request.app[AUTHENTICATED]
        request.app[REQUESTED].add(protocol)
        with marking(lambda: authenticated.add(protocol)):
            content = request.content
            if not request.body_exists or content.is_eof():
                return await handler(request)
            watch = asyncio.create_task(body_deadline(content, idle_timeout_s,
                                                      min_bytes_per_s))
            try:
                response = await handler(request)
            finally:
                watch.cancel()
            if watch.done() and not watch.cancelled() and watch.result():
                response.force_close()  # the rest of the body is not waited for
            return response

    return guard


async def body_deadline(content: StreamReader, idle_timeout_s: float,
                        min_bytes_per_s: int) -> bool:
    """Until ``content`` is complete: cut it (its reader raises ``RequestTimeout``; True)
    when nothing arrived for ``idle_timeout_s``, or when after that first window it
    averaged below ``min_bytes_per_s`` (0: no rate)."""
    loop = asyncio.get_running_loop()
    start = last_at = loop.time()
    seen = content.total_bytes
    while not content.is_eof():
        await asyncio.sleep(idle_timeout_s / TICKS_PER_WINDOW)
        now, got = loop.time(), content.total_bytes
        if got != seen:
            seen, last_at = got, now
        if content.is_eof():
            break
        if now - last_at >= idle_timeout_s:
            problem = f"the request body stopped arriving for {idle_timeout_s:g}s"
        elif min_bytes_per_s and got < min_bytes_per_s * (now - start - idle_timeout_s):
            problem = (f"the request body arrives slower than {min_bytes_per_s} bytes/s "
                       f"({got} bytes in {now - start:.0f}s)")
        else:
            continue
        content.set_exception(RequestTimeout(problem))
        return True
    return False
