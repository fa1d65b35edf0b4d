"""HTTP routes: the OpenAI-compatible surface plus health, readiness and metrics."""

from __future__ import annotations

import asyncio
import time
import uuid

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.admin import refresh_queue_metrics
from gateway.admission import admitted
from gateway.completion_request import CHAT, COMPLETIONS, CompletionRequest, read_completion
from gateway.context import CONTEXT, Context
from gateway.errors import (
    Forbidden,
    NotFound,
    StoreUnavailable,
    Unavailable,
)
from gateway.settings import ApiKey
from policies.classes import effective_class

log = structlog.get_logger("fairgate.request")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, COMPLETIONS)


def _resolve(ctx: Context, request: web.Request, key: ApiKey,
             creq: CompletionRequest) -> tuple[str, str]:
    """(user, class) the request is queued under."""
    if creq.model not in ctx.settings.models():
        raise NotFound(f"The model '{creq.model}' does not exist", param="model")
    requested = request.headers.get("X-Priority-Class")
    klass = effective_class(key.priority_class, requested)
    if klass is None:
        raise Forbidden(f"priority class {requested!r} is not allowed for this key "
                        f"(key class: {key.priority_class}; a request may only lower it)")
    user = key.user
    if key.trusted_end_users and creq.end_user:
        user = f"{key.user}/{creq.end_user}"
    return user, klass


async def _completion(request: web.Request, path: str) -> web.StreamResponse:
    arrived = time.monotonic()
    ctx = request.app[CONTEXT]
    key = ctx.keys.identify(request.headers.get("Authorization"))
    creq = await read_completion(request, path, ctx.settings.max_body_bytes)
    user, klass = _resolve(ctx, request, key, creq)
    model = creq.model
    if not ctx.pool.any_healthy(model):
        raise Unavailable(f"no healthy backend serves {model!r}",
                          retry_after_s=ctx.settings.retry_after_s)
    request_id = uuid.uuid4().hex
    structlog.contextvars.bind_contextvars(request_id=request_id, user=user, model=model,
                                           priority_class=klass)
    log.info("queued")
    status = "error"
    try:
        async with admitted(ctx, model, user, klass, key.weight, creq.body,
                            request_id=request_id, arrived_s=arrived) as ticket:
            response = await ctx.upstream.forward(request, ticket.backend, creq,
                                                  ticket.priority, ticket.usage)
            status = str(response.status)
            return response
    except asyncio.CancelledError:
        status = "client_closed"
        log.info("client_disconnected")
        raise
    finally:
        ctx.metrics.requests.labels(model, klass, status).inc()


async def list_models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    ctx.keys.identify(request.headers.get("Authorization"))
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "fairgate"}
            for m in ctx.settings.models()]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    try:
        await ctx.store.ping()
    except StoreUnavailable as exc:
        exc.retry_after_s = ctx.settings.retry_after_s
        raise
    if not ctx.pool.any_healthy():
        raise Unavailable("no healthy backend", retry_after_s=ctx.settings.retry_after_s)
    return web.json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    await refresh_queue_metrics(ctx)
    body = generate_latest(ctx.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_routes(app: web.Application) -> None:
    app.router.add_post(CHAT, chat_completions)
    app.router.add_post(COMPLETIONS, completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
