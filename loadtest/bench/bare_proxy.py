"""A bare reverse proxy on fairgate's HTTP stack: the floor ``overhead`` compares with.

It does only what every request through fairgate must do on the wire: read the client's
request, send it to the backend with a pooled aiohttp client, and stream the answer back
chunk by chunk, on the event loop ``fairgate serve`` runs (uvloop when installed). No
authentication, no queue, no Redis, no logs or metrics. What fairgate costs above this
is its own; what this costs above the backend is aiohttp's and the loop's.

``python -m loadtest.bench.bare_proxy --port P --backend URL`` (one process).
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
from aiohttp import web

from gateway.core.event_loop import run as run_loop

PASSED = ("Content-Type",)


def make_app(backend: str) -> web.Application:
    app = web.Application()

    async def session(app: web.Application):  # type: ignore[no-untyped-def]
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=None)) as http:
            app["http"] = http
            yield

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        http: aiohttp.ClientSession = request.app["http"]
        async with http.post(backend + request.path, data=body,
                             headers={"Content-Type": "application/json"}) as up:
            out = web.StreamResponse(status=up.status, headers={
                k: up.headers[k] for k in PASSED if k in up.headers})
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app.cleanup_ctx.append(session)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/{tail:.*}", relay)
    return app


async def _serve(port: int, backend: str) -> None:
    runner = web.AppRunner(make_app(backend.rstrip("/")), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"bare proxy: serving on http://127.0.0.1:{port} -> {backend}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", required=True)
    args = parser.parse_args()
    run_loop(_serve(args.port, args.backend))


if __name__ == "__main__":
    main()
