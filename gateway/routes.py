"""HTTP routes: the OpenAI-compatible surface plus health, readiness and metrics.

Chat, completions, embeddings and the Responses API are scheduled: each goes through
:meth:`Admission.call` in its key's class (queued fairly, paced, charged its tokens).
vLLM's ``/tokenize`` and ``/detokenize`` are cheap and go straight to a healthy backend of
the model, authenticated but not queued.

Every scheduled answer carries ``X-Request-Id`` from the moment the request is queued (in a
stream's headers too, and on its errors), and ``X-Fairgate-Queue-Wait-Ms`` once it was
dispatched; ``GET /v1/fairgate/requests/{id}`` tells its owner (or an admin) where it stands
while it is queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import time
import uuid
from importlib import resources

import structlog
import yaml
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.admission import Ticket
from gateway.backends import BackendHandle
from gateway.completion_request import (
    CHAT,
    COMPLETIONS,
    DEADLINE_HEADER,
    DETOKENIZE,
    EMBEDDINGS,
    RESPONSES,
    TOKENIZE,
    CompletionRequest,
    Limits,
    check_context,
    read_completion,
    read_deadline_ms,
    read_json_object,
    validate_unscheduled,
)
from gateway.errors import BackendUnreachable, Forbidden, NotFound, StoreUnavailable, Unavailable
from gateway.services import SERVICES, Services
from gateway.settings import ApiKey
from policies.classes import effective_class

log = structlog.get_logger("fairgate.request")

REQUEST_ID_HEADER = "X-Request-Id"
QUEUE_WAIT_HEADER = "X-Fairgate-Queue-Wait-Ms"
# headers a scheduled request's answer carries, whoever prepares it (relay, edge, route)
ANSWER_HEADERS = web.RequestKey("fairgate_answer_headers", dict[str, str])
REQUEST_ID = re.compile(r"[0-9A-Za-z_-]{1,128}")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _scheduled(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _scheduled(request, COMPLETIONS)


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _scheduled(request, EMBEDDINGS)


async def responses(request: web.Request) -> web.StreamResponse:
    return await _scheduled(request, RESPONSES)


async def tokenize(request: web.Request) -> web.StreamResponse:
    return await _unscheduled(request, TOKENIZE)


async def detokenize(request: web.Request) -> web.StreamResponse:
    return await _unscheduled(request, DETOKENIZE)


def _known_model(svc: Services, model: str) -> None:
    if model not in svc.settings.models():
        raise NotFound(f"The model '{model}' does not exist", param="model")


def _resolve(svc: Services, request: web.Request, key: ApiKey,
             creq: CompletionRequest) -> tuple[str, str]:
    """(user, class) the request is queued under."""
    _known_model(svc, creq.model)
    requested = request.headers.get("X-Priority-Class")
    klass = effective_class(key.priority_class, requested)
    if klass is None:
        raise Forbidden(f"priority class {requested!r} is not allowed for this key "
                        f"(key class: {key.priority_class}; a request may only lower it)")
    user = key.user
    if key.trusted_end_users and creq.end_user:
        user = f"{key.user}/{creq.end_user}"
    return user, klass


async def _scheduled(request: web.Request, path: str) -> web.StreamResponse:
    arrived = time.monotonic()
    svc = request.app[SERVICES]
    key = await svc.keys.identify(request.headers.get("Authorization"))
    creq = await read_completion(request, path, svc.settings.max_body_bytes,
                                 Limits.of(svc.settings), svc.settings.client_idle_timeout_s)
    user, klass = _resolve(svc, request, key, creq)
    deadline_ms = read_deadline_ms(request.headers.get(DEADLINE_HEADER))
    model = creq.model
    check_context(creq.body, path, svc.pool.max_model_len(model))
    if not svc.pool.any_healthy(model):
        raise Unavailable(f"no healthy backend serves {model!r}",
                          retry_after_s=await svc.admission.waits.drain_retry_after(
                              model, klass))
    request_id = uuid.uuid4().hex
    headers = request[ANSWER_HEADERS] = {REQUEST_ID_HEADER: request_id}
    queued_at = time.monotonic()
    structlog.contextvars.bind_contextvars(request_id=request_id, user=user, model=model,
                                           priority_class=klass)
    log.info("queued")
    status = "error"
    tickets: list[Ticket] = []

    async def forward(ticket: Ticket) -> web.StreamResponse:
        tickets.append(ticket)
        headers.update(ticket.limit_headers)
        headers[QUEUE_WAIT_HEADER] = str(round((time.monotonic() - queued_at) * 1000))
        return await svc.upstream.forward(request, ticket.backend, creq, ticket.priority,
                                          ticket)

    try:
        response = await svc.admission.call(model, user, klass, key.weight, creq.body,
                                            forward, request_id=request_id, arrived_s=arrived,
                                            deadline_ms=deadline_ms, account=key)
        status = str(response.status)
        return response
    except asyncio.CancelledError:
        # a client that hangs up right after the whole answer cancels the handler while
        # it cleans up: it was still served
        if status == "error":
            if tickets and tickets[-1].completed:
                status = "200"
            else:
                status = "client_closed"
                log.info("client_disconnected")
        raise
    finally:
        svc.metrics.requests.labels(model, klass, status).inc()


async def _unscheduled(request: web.Request, path: str) -> web.StreamResponse:
    """Any API key; straight to the least loaded healthy backend of the model (another
    one if the connection is refused)."""
    svc = request.app[SERVICES]
    await svc.keys.identify(request.headers.get("Authorization"))
    body = await read_json_object(request, svc.settings.max_body_bytes,
                                  svc.settings.client_idle_timeout_s)
    validate_unscheduled(body, Limits.of(svc.settings))
    model = str(body["model"])
    _known_model(svc, model)
    candidates = sorted((h for h in svc.pool.for_model(model) if h.healthy), key=_load)
    if not candidates:
        raise Unavailable(f"no healthy backend serves {model!r}")
    for handle in candidates:
        try:
            return await svc.upstream.unscheduled(handle, path, body)
        except BackendUnreachable as exc:
            svc.pool.unreachable(handle, exc)
            if handle is candidates[-1]:
                raise
    raise AssertionError("unreachable")


def _load(handle: BackendHandle) -> tuple[bool, int]:
    """Undrained first, then by the latest snapshot's waiting + running."""
    snap = handle.last
    return handle.drained, (snap.waiting + snap.running) if snap is not None else 0


async def _answer_headers(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """Adds a scheduled request's headers to its answer as it is prepared."""
    if isinstance(request, web.Request):
        for name, value in request.get(ANSWER_HEADERS, {}).items():
            response.headers[name] = value


async def request_status(request: web.Request) -> web.Response:
    """Where a queued request stands: its owner's key or an admin key; 404 once it is no
    longer queued (or was never this key's)."""
    svc = request.app[SERVICES]
    authorization = request.headers.get("Authorization")
    owner = (None if svc.keys.is_admin(authorization)
             else await svc.keys.identify(authorization))
    request_id = request.match_info["id"]
    status = None
    if REQUEST_ID.fullmatch(request_id):
        status = await svc.admission.waits.status(svc.settings.models(), request_id)
    if status is None or (owner is not None and not _owns(owner, status.user)):
        raise NotFound(f"no queued request {request_id!r} for this key: it was dispatched, "
                       "has finished, or is unknown")
    place = status.place
    return web.json_response({
        "id": status.request_id, "object": "fairgate.queued_request",
        "model": status.model, "priority_class": status.klass, "status": "queued",
        "position": place.position, "ahead_in_class": place.ahead_in_class,
        "queued_ms": max(0, round((time.time() - status.enqueued_at) * 1000)),
        "estimated_wait_ms": None if place.wait_s is None else round(place.wait_s * 1000)})


def _owns(key: ApiKey, user: str) -> bool:
    return user == key.user or (key.trusted_end_users and user.startswith(key.user + "/"))


async def own_usage(request: web.Request) -> web.Response:
    """The calling key's limits and what is left of them (a fairgate extension)."""
    svc = request.app[SERVICES]
    key = await svc.keys.identify(request.headers.get("Authorization"))
    return web.json_response(await key_usage(svc, key))


async def key_usage(svc: Services, key: ApiKey) -> dict[str, object]:
    """A key's limits and budgets now (also the admin view, ``gateway/admin.py``)."""
    return {"object": "fairgate.usage", "key_id": key.id, "user": key.user,
            "tenant": key.tenant_name, "limits": await svc.quotas.view(key)}


async def list_models(request: web.Request) -> web.Response:
    svc = request.app[SERVICES]
    await svc.keys.identify(request.headers.get("Authorization"))
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "fairgate"}
            for m in svc.settings.models()]
    return web.json_response({"object": "list", "data": data})


@functools.cache
def _openapi() -> bytes:
    spec = yaml.safe_load((resources.files("gateway") / "static" / "openapi.yaml").read_text())
    return json.dumps(spec).encode()


async def openapi(request: web.Request) -> web.Response:
    """fairgate's own surface (gateway/static/openapi.yaml, kept in sync with the routes
    by tests/fuzz/test_http_fuzz.py)."""
    return web.Response(body=_openapi(), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    svc = request.app[SERVICES]
    await svc.store.ping()
    if not svc.pool.any_healthy():
        raise Unavailable("no healthy backend")
    return web.json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    svc = request.app[SERVICES]
    if svc.settings.metrics_auth:  # off by default: scrapers on a private network
        await svc.keys.require_admin(request.headers.get("Authorization"))
    with contextlib.suppress(StoreUnavailable):  # the gateway's own series still matter
        await svc.inspector.refresh_queue_metrics()
    body = generate_latest(svc.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_routes(app: web.Application) -> None:
    app.on_response_prepare.append(_answer_headers)
    app.router.add_post(CHAT, chat_completions)
    app.router.add_post(COMPLETIONS, completions)
    app.router.add_post(EMBEDDINGS, embeddings)
    app.router.add_post(RESPONSES, responses)
    app.router.add_post(TOKENIZE, tokenize)
    app.router.add_post(DETOKENIZE, detokenize)
    app.router.add_get("/v1/fairgate/requests/{id}", request_status)
    app.router.add_get("/v1/fairgate/usage", own_usage)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
