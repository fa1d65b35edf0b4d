"""Run the gateway on a TCP port, in-process (tests, demo) or as ``fairgate serve``
(``gateway/runtime/cli.py``).

Client connections are bounded: at most ``max_client_connections`` are open at once (a
connection over the cap gets a 503 in OpenAI's format and is closed before anything is
read), a connection that sends no complete request within ``client_idle_timeout_s`` is
closed (slow or idle headers, idle keep-alive), and the process's open-file limit is
raised to its hard limit at start so the cap, not the kernel, refuses first.

Connections on which no request has authenticated yet (just opened, idle, or stuck in an
unauthenticated body such as a dashboard login) hold at most
``max_unauthenticated_connections`` (half the cap by default): a new connection beyond
that closes the oldest of them, so a flood of stalled logins cannot take the places of the
users being served. Bodies have their own deadline on every route
(``gateway/http/client_guard.py``).
"""

from __future__ import annotations

import asyncio
import resource
from typing import cast

import structlog
from aiohttp import web

from gateway.core.edge import raw_answer
from gateway.core.errors import TooManyConnections
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import Settings
from gateway.http.app import create_app
from gateway.http.client_guard import AUTHENTICATED, REQUESTED
from gateway.services import SERVICES, Services

log = structlog.get_logger("fairgate.server")

FD_HEADROOM = 512  # files kept free for backends, Redis, logs and the batch files
# a new connection's time to send its first request before it may be closed for room
FIRST_REQUEST_GRACE_S = 1.0


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


class _Refuse(asyncio.Protocol):
    """A connection over the cap: answer 503 and close, reading nothing."""

    def __init__(self, retry_after_s: int) -> None:
        self.retry_after_s = retry_after_s

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream server's transport writes, but uvloop's subclasses none of asyncio's
        # transport classes: an isinstance check refused every connection with a reset
        stream = cast(asyncio.WriteTransport, transport)
        stream.write(raw_answer(TooManyConnections(
            "too many open connections to the gateway; retry",
            retry_after_s=self.retry_after_s)))
        stream.close()


class GatewayServer:
    def __init__(self, settings: Settings, metrics: GatewayMetrics | None = None,
                 reuse_port: bool = False) -> None:
        self.settings = settings
        self.reuse_port = reuse_port  # several workers on one port (gateway/runtime/workers.py)
        self.app = create_app(settings, metrics)
        # Cancel the handler when its client disconnects: a queued request then leaves
        # the queue and a streaming one closes its upstream connection (vLLM aborts it).
        # keepalive_timeout also closes a connection that never completes its headers.
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                    keepalive_timeout=settings.listen.client_idle_timeout_s)
        self.port = settings.listen.port
        self.refused = 0
        self.evicted = 0  # unauthenticated connections closed to make room
        self._listener: asyncio.Server | None = None
        self._opened: dict[web.RequestHandler, float] = {}  # when each was accepted

    @property
    def url(self) -> str:
        return f"http://{self.settings.listen.host}:{self.port}"

    @property
    def services(self) -> Services:
        return self.app[SERVICES]

    def max_connections(self) -> int:
        return max(1, min(self.settings.listen.max_client_connections,
                          raise_open_file_limit() - FD_HEADROOM))

    def max_unauthenticated(self, cap: int) -> int:
        allowance = self.settings.listen.max_unauthenticated_connections
        return max(1, min(cap, allowance if allowance is not None else cap // 2))

    async def start(self) -> None:
        await self.runner.setup()
        if self.reuse_port:
            await self._first_scrapes()
        server = self.runner.server
        if server is None:
            raise RuntimeError("the aiohttp runner set up no server")
        cap = self.max_connections()
        allowance = self.max_unauthenticated(cap)
        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.BaseProtocol:
            now = loop.time()
            open_ = [h for h in server.connections if h.transport is not None]  # not closing
            self._forget_closed(open_)
            if len(open_) >= allowance:
                open_ = self._within_allowance(open_, now, allowance)
            if len(open_) >= cap:
                self.refused += 1
                if self.refused % 1000 == 1:  # a flood must not flood the log too
                    log.warning("connection_refused", open=len(server.connections), cap=cap,
                                refused=self.refused)
                return _Refuse(self.services.admission.waits.retry_after(None))
            handler = server()
            self._opened[handler] = now
            return handler

        self._listener = await loop.create_server(
            protocol, self.settings.listen.host, self.settings.listen.port,
            reuse_address=True, reuse_port=self.reuse_port or None, backlog=1024)
        self.port = int(self._listener.sockets[0].getsockname()[1])

    def _forget_closed(self, open_: list[web.RequestHandler]) -> None:
        """Drop the marks of connections long closed (amortized: when they outnumber the
        open ones twice over)."""
        if len(self._opened) > 2 * len(open_) + 64:
            still = set(open_)
            self._opened = {h: at for h, at in self._opened.items() if h in still}
        for marks in (self.app[AUTHENTICATED], self.app[REQUESTED]):
            if len(marks) > 2 * len(open_) + 64:
                marks.intersection_update(open_)

    def _within_allowance(self, open_: list[web.RequestHandler], now: float,
                          allowance: int) -> list[web.RequestHandler]:
        """Close the oldest stalled unauthenticated connection when the unauthenticated
        ones fill their allowance; the connections left open.

        Stalled: a request arrived on it and authenticated nothing (a login that never
        ends its body), or it sent none for ``FIRST_REQUEST_GRACE_S``. A connection just
        opened is never closed for room: a burst of new clients is all unauthenticated
        for a moment (uvloop accepts the whole backlog before reading any of it), and
        closing the first of them served nobody; over the cap the newest gets a 503."""
        authenticated, requested = self.app[AUTHENTICATED], self.app[REQUESTED]
        unauthenticated = [h for h in open_ if h not in authenticated]
        if len(unauthenticated) < allowance:
            return open_
        stalled = next((h for h in unauthenticated if h in requested
                        or now - self._opened.setdefault(h, now) >= FIRST_REQUEST_GRACE_S),
                       None)
        if stalled is None:
            return open_
        self.evicted += 1
        if self.evicted % 1000 == 1:
            log.warning("unauthenticated_connection_closed", open=len(open_),
                        unauthenticated=len(unauthenticated), allowance=allowance,
                        evicted=self.evicted)
        stalled.force_close()
        return [h for h in open_ if h is not stalled]

    async def _first_scrapes(self) -> None:
        """A worker joining a shared port (its siblings serve already) takes connections
        once each backend was scraped, or tried for the scrape timeout: not before, or it
        would answer "no healthy backend" while its siblings know better."""
        waits = [asyncio.create_task(h.scraped.wait())
                 for h in self.services.pool.handles.values()]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=self.settings.fleet.scrape_timeout_s * 2)
            for task in pending:
                task.cancel()

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()  # accept no more; the runner closes the open ones
        await self.runner.cleanup()
        if self._listener is not None:
            await asyncio.wait_for(self._listener.wait_closed(), 5.0)

