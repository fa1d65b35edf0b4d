"""Run the gateway on a TCP port, in-process (tests, demo) or as ``fairgate serve``."""

from __future__ import annotations

import asyncio
import signal

from aiohttp import web

from gateway.app import create_app
from gateway.metrics import GatewayMetrics
from gateway.services import SERVICES, Services
from gateway.settings import Settings


class GatewayServer:
    def __init__(self, settings: Settings, metrics: GatewayMetrics | None = None) -> None:
        self.settings = settings
        self.app = create_app(settings, metrics)
        # Cancel the handler when its client disconnects: a queued request then leaves
        # the queue and a streaming one closes its upstream connection (vLLM aborts it).
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        self.port = settings.listen.port

    @property
    def url(self) -> str:
        return f"http://{self.settings.listen.host}:{self.port}"

    @property
    def services(self) -> Services:
        return self.app[SERVICES]

    async def start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.settings.listen.host, self.settings.listen.port)
        await site.start()
        self.port = int(self.runner.addresses[0][1])

    async def stop(self) -> None:
        await self.runner.cleanup()


async def serve_forever(settings: Settings) -> None:
    server = GatewayServer(settings)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"fairgate listening on {server.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()
