"""The aiohttp application: middleware, routes, and resources in one cleanup context."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import structlog
from aiohttp import web

from gateway.admin import add_admin_routes
from gateway.auth import KeyRing
from gateway.backends import BackendPool
from gateway.batch_routes import add_batch_routes
from gateway.context import CONTEXT, Context
from gateway.dashboard import add_dashboard_routes
from gateway.dispatcher import Dispatcher
from gateway.embedded_redis import EmbeddedRedis
from gateway.errors import FairgateError, NotFound
from gateway.observability import GatewayMetrics, error_metrics, timed_redis
from gateway.routes import add_routes
from gateway.settings import Settings
from gateway.store import Store
from gateway.upstream import Upstream
from policies.fairness import ScoreRule, round_robin, vtc

log = structlog.get_logger("fairgate.app")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves in OpenAI's format: ``{"error": {message, type, param, code}}``."""
    structlog.contextvars.clear_contextvars()
    try:
        return await handler(request)
    except FairgateError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status == 404:
            return NotFound(f"no route {request.method} {request.path}").response()
        error = FairgateError(exc.reason)
        error.status = exc.status
        error.type = "invalid_request_error" if exc.status < 500 else "server_error"
        response = error.response()
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except Exception:
        log.exception("unhandled_error", path=request.path)
        return FairgateError("internal error; see the gateway logs").response()


def score_rule(settings: Settings) -> ScoreRule:
    if settings.fairness == "round_robin":
        return round_robin()
    return vtc(settings.vtc_input_weight, settings.vtc_output_weight)


def create_app(settings: Settings, metrics: GatewayMetrics | None = None) -> web.Application:
    metrics = metrics or GatewayMetrics(top_users=settings.metrics_top_users,
                                        user_idle_s=settings.metrics_user_idle_s)
    app = web.Application(middlewares=[openai_errors, error_metrics(metrics)],
                          client_max_size=settings.max_body_bytes)
    app.cleanup_ctx.append(_resources(settings, metrics))
    add_routes(app)
    add_batch_routes(app)
    add_admin_routes(app)
    add_dashboard_routes(app)
    return app


def _resources(settings: Settings, metrics: GatewayMetrics
               ) -> Callable[[web.Application], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def resources(app: web.Application) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            redis_url = settings.redis_url
            if redis_url is None:
                embedded = EmbeddedRedis(data_dir=None).start()
                stack.callback(embedded.stop)
                redis_url = embedded.url
                log.info("embedded_redis_started", url=redis_url)
            client = timed_redis(redis_url, metrics, decode_responses=True,
                                 socket_connect_timeout=2, health_check_interval=10)
            stack.push_async_callback(client.aclose)
            # vLLM's uvicorn drops idle keep-alive connections after 5 s; reusing one at
            # that moment fails a request, so ours expire first
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                limit=0, keepalive_timeout=settings.upstream_keepalive_s))
            stack.push_async_callback(session.close)
            replica_id = settings.replica_id or uuid.uuid4().hex[:12]
            rule = score_rule(settings)
            ttl = max(c.max_queue_wait_s for c in settings.classes.values())
            store = Store(client, rule, request_ttl_s=ttl + settings.upstream_timeout_s + 60)
            dispatcher_box: list[Dispatcher] = []
            pool = BackendPool(settings, session, store, metrics,
                               on_snapshot=lambda: dispatcher_box[0].wake())
            dispatcher = Dispatcher(settings, store, pool, metrics, replica_id)
            dispatcher_box.append(dispatcher)
            app[CONTEXT] = Context(settings, KeyRing(settings.api_keys, settings.admin_keys),
                                   rule, metrics, store, pool, dispatcher,
                                   Upstream(session, settings.upstream_timeout_s), replica_id,
                                   redis_url)
            tasks = [asyncio.create_task(pool.run(), name="scrape"),
                     asyncio.create_task(dispatcher.run(), name="dispatch")]
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                # bounded: a library that swallows a cancellation must not hang shutdown
                await asyncio.wait(tasks, timeout=5.0)

    return resources
