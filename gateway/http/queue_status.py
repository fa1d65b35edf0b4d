"""Queue status while waiting: an opt-in early answer for streamed requests.

A streamed request sent with ``X-Fairgate-Queue-Status: 1`` gets its ``200`` and headers
at once and, while it is queued, an SSE comment line every ``queue_status_interval_s``
(1 s): ``: queue position=<requests expected before it> eta_ms=<estimated wait>``
(``eta_ms=unknown`` before any dispatch rate was measured). SSE parsers skip comment
lines (the ``openai`` SDK too), so a client that does not read them sees an ordinary
stream; one that does can show its user where it stands. The lines stop when the
request is dispatched; its answer follows in the same stream. Whatever refuses it after
that point (a queue timeout, a cancel, a backend's error answer) arrives as an SSE error
event, the status code being gone. The headers that only exist once it is dispatched
(``X-Fairgate-Queue-Wait-Ms``, ``x-ratelimit-*``) are not sent: the comments carry the
wait instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

from gateway.core.edge import sse_frame
from gateway.core.errors import BadRequest, FairgateError
from gateway.proxy.relay import SSE_HEADERS
from gateway.scheduling.waits import Place

log = structlog.get_logger("fairgate.request")

QUEUE_STATUS_HEADER = "X-Fairgate-Queue-Status"
ON, OFF = frozenset(("1", "true", "yes")), frozenset(("0", "false", "no", ""))


def wants_queue_status(value: str | None, stream: bool) -> bool:
    """The header's answer: ``1``/``true``/``yes`` on a streamed request (a 400 on any
    other, or for another value)."""
    if value is None or value.strip().lower() in OFF:
        return False
    if value.strip().lower() not in ON:
        raise BadRequest(f"header {QUEUE_STATUS_HEADER} must be 1 or 0 (got {value[:20]!r})")
    if not stream:
        raise BadRequest(f"header {QUEUE_STATUS_HEADER} needs a streamed request "
                         "('stream': true)", param="stream")
    return True


def status_line(place: Place | None) -> bytes:
    """One SSE comment line; ``None``: not in the queue's picture (yet, or any more)."""
    if place is None:
        return b": queued\n\n"
    eta = "unknown" if place.wait_s is None else str(max(0, round(place.wait_s * 1000)))
    return f": queue position={place.position} eta_ms={eta}\n\n".encode()


class QueueStatus:
    """The early answer of one request: prepared at once, fed status lines until
    :meth:`dispatched` hands it to the relay or :meth:`failed` ends it."""

    def __init__(self, out: web.StreamResponse, place: Callable[[], Awaitable[Place | None]],
                 interval_s: float) -> None:
        self.out = out
        self._place = place
        self._interval_s = interval_s
        self._ticker: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, request: web.Request, place: Callable[[], Awaitable[Place | None]],
                   interval_s: float) -> QueueStatus:
        out = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await out.prepare(request)
        status = cls(out, place, interval_s)
        status._ticker = asyncio.create_task(status._tick(), name="queue-status")
        return status

    async def _tick(self) -> None:
        """Until stopped: the request's place now, then a pause. A failed estimate
        (Redis unreachable) skips a line; a client gone ends the lines (the handler is
        cancelled by the hang-up anyway)."""
        while True:
            try:
                line = status_line(await self._place())
            except FairgateError as exc:
                log.info("queue_status_unknown", error=str(exc))
                line = b": queue position=unknown eta_ms=unknown\n\n"
            try:
                await self.out.write(line)
            except ConnectionError:
                return
            await asyncio.sleep(self._interval_s)

    async def _stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None

    async def dispatched(self) -> web.StreamResponse:
        """No more status lines: the answer's frames follow in this response."""
        await self._stop()
        return self.out

    async def failed(self, error: FairgateError) -> web.StreamResponse:
        """End the stream with ``error`` as its last event."""
        await self._stop()
        with contextlib.suppress(ConnectionError):
            await self.out.write(sse_frame(error))
            await self.out.write_eof()
        return self.out

    async def close(self) -> None:
        """The handler ends another way (cancelled): stop the lines."""
        await self._stop()
