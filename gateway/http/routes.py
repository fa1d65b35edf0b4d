"""HTTP routes: the OpenAI-compatible surface plus the index, health, readiness and metrics.

The OpenAI endpoints are routed from their table (``gateway/proxy/endpoints.py``). The queued
ones (chat, completions, embeddings, the Responses API) go through
:meth:`Admission.call` in the key's class (queued fairly, paced, charged their tokens);
the forwarded ones (vLLM's ``/tokenize`` and ``/detokenize``) are cheap and go straight to
a healthy backend of the model, authenticated but not queued.

Every scheduled answer carries ``X-Request-Id`` from the moment the request is queued (in a
stream's headers too, and on its errors), and ``X-Fairgate-Queue-Wait-Ms`` once it was
dispatched; ``GET /v1/fairgate/requests/{id}`` tells its owner (or an admin) where it stands
while it is queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.backends import adapters
from gateway.backends.adapters import Resolved
from gateway.backends.handle import BackendHandle
from gateway.core.errors import (
    BackendUnreachable,
    FairgateError,
    Forbidden,
    NotFound,
    StoreUnavailable,
    Unavailable,
)
from gateway.core.logs import bind_request
from gateway.core.settings import ApiKey, end_user_name
from gateway.http.index import index
from gateway.http.openapi import openapi_json
from gateway.http.queue_status import QUEUE_STATUS_HEADER, QueueStatus, wants_queue_status
from gateway.proxy.completion_request import (
    DEADLINE_HEADER,
    SESSION_HEADER,
    CompletionRequest,
    Limits,
    check_context,
    read_completion,
    read_deadline_ms,
    read_json_object,
    read_session,
    validate_unscheduled,
)
from gateway.proxy.endpoints import ENDPOINTS, Endpoint, Kind
from gateway.scheduling.admission import Ticket
from gateway.scheduling.waits import Place
from gateway.services import SERVICES, Services
from policies.classes import effective_class

log = structlog.get_logger("fairgate.request")

REQUEST_ID_HEADER = "X-Request-Id"
QUEUE_WAIT_HEADER = "X-Fairgate-Queue-Wait-Ms"
# headers a scheduled request's answer carries, whoever prepares it (relay, edge, route)
ANSWER_HEADERS = web.RequestKey("fairgate_answer_headers", dict[str, str])
REQUEST_ID = re.compile(r"[0-9A-Za-z_-]{1,128}")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def new_request_id() -> str:
    """A random UUID4's 32 hex digits, as ``uuid.uuid4().hex`` without its objects."""
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
    return raw.hex()


def _known_model(svc: Services, model: str) -> Resolved:
    """The base model a request's ``model`` is scheduled on, and the LoRA adapter it
    names (``docs/adapters.md``); an unknown name is a 404."""
    resolved = svc.pool.resolve(model)
    if resolved is None:
        raise NotFound(f"The model '{model}' does not exist", param="model")
    return resolved


def _resolve(svc: Services, request: web.Request, key: ApiKey,
             creq: CompletionRequest) -> tuple[str, str, str]:
    """(model, user, class) the request is queued under: an adapter's request is
    queued on its base model."""
    model = _known_model(svc, creq.model).model
    requested = request.headers.get("X-Priority-Class")
    klass = effective_class(key.priority_class, requested)
    if klass is None:
        raise Forbidden(f"priority class {requested!r} is not allowed for this key "
                        f"(key class: {key.priority_class}; a request may only lower it)")
    user = key.user
    if key.trusted_end_users and creq.end_user:
        user = end_user_name(key.user, creq.end_user)
    return model, user, klass


@dataclass(frozen=True, slots=True)
class _Call:
    """A scheduled request as the edge read it: who calls, what, and how it is queued."""

    key: ApiKey
    creq: CompletionRequest
    model: str
    user: str
    klass: str
    deadline_ms: int | None
    session: str


async def _read_call(request: web.Request, endpoint: Endpoint, svc: Services) -> _Call:
    """The request's key, body, model, user, class, deadline and session; a model none of
    whose backends was judged yet waits for their first scrapes, and a prompt over the
    model's context is refused."""
    key = await svc.keys.identify(request.headers.get("Authorization"))
    creq = await read_completion(request, endpoint, svc.settings.listen.max_body_bytes,
                                 Limits.of(svc.settings))
    model, user, klass = _resolve(svc, request, key, creq)
    deadline_ms = read_deadline_ms(request.headers.get(DEADLINE_HEADER))
    session = (read_session(request.headers.get(SESSION_HEADER), creq)
               if svc.settings.fairness.sessions else "")
    if not svc.pool.any_healthy(model):  # none healthy: admission refuses or holds it
        await svc.pool.first_scrapes(model, svc.settings.fleet.first_scrape_wait_s)
    check_context(creq, svc.pool.max_model_len(model))
    return _Call(key, creq, model, user, klass, deadline_ms, session)


async def _scheduled(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    arrived = time.monotonic()
    svc = request.app[SERVICES]
    call = await _read_call(request, endpoint, svc)
    creq, model, klass = call.creq, call.model, call.klass
    request_id = new_request_id()
    headers = request[ANSWER_HEADERS] = {REQUEST_ID_HEADER: request_id}
    queued_at = time.monotonic()
    bind_request(request_id=request_id, user=call.user, model=model, priority_class=klass)
    log.debug("queued")
    status = "error"
    tickets: list[Ticket] = []
    early = None
    if wants_queue_status(request.headers.get(QUEUE_STATUS_HEADER), creq.stream):
        early = await QueueStatus.open(request, partial(_queued_place, svc, model, request_id),
                                       svc.settings.limits.queue_status_interval_s)

    async def forward(ticket: Ticket) -> web.StreamResponse:
        tickets.append(ticket)
        headers.update(ticket.limit_headers)
        headers[QUEUE_WAIT_HEADER] = str(round((time.monotonic() - queued_at) * 1000))
        return await svc.upstream.forward(request, ticket.backend, creq, ticket.priority,
                                          ticket, ticket.continuation, ticket.mover,
                                          None if early is None else await early.dispatched())

    try:
        response = await svc.admission.call(model, call.user, klass, call.key.weight, creq,
                                            forward, request_id=request_id, arrived_s=arrived,
                                            deadline_ms=call.deadline_ms, account=call.key,
                                            refuse_unready=True, session=call.session)
        status = str(response.status)
        return response
    except FairgateError as exc:
        if early is None:
            raise
        status = str(exc.status)  # refused after its 200: the error is the last event
        log.info("refused_in_stream", error_code=exc.code, status=exc.status)
        return await early.failed(exc)
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
        if early is not None:
            await early.close()
        svc.metrics.child(svc.metrics.edge.requests, model, klass, status).inc()


async def _queued_place(svc: Services, model: str, request_id: str) -> Place | None:
    status = await svc.admission.waits.status([model], request_id)
    return None if status is None else status.place


async def _unscheduled(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    """Any API key; straight to the least loaded healthy backend of the model (another
    one if the connection is refused), within the key's rpm and the user's bound on
    unqueued calls (``Admission.forwarded``), the body within its own size limit."""
    svc = request.app[SERVICES]
    key = await svc.keys.identify(request.headers.get("Authorization"))
    body = await read_json_object(request, min(svc.settings.listen.max_body_bytes,
                                               svc.settings.limits.max_unqueued_body_bytes))
    model, adapter = _known_model(svc, validate_unscheduled(body, Limits.of(svc.settings)))
    if not svc.pool.any_healthy(model):
        await svc.pool.first_scrapes(model, svc.settings.fleet.first_scrape_wait_s)
    candidates = sorted((h for h in svc.pool.for_model(model) if h.healthy
                         and (adapter is None or adapter in svc.pool.adapters_on(h))),
                        key=_load)
    if not candidates:
        having = "" if adapter is None else f" with the adapter {adapter!r}"
        raise Unavailable(f"no healthy backend{having} serves {model!r}")
    async with svc.admission.forwarded(key) as limit_headers:
        request[ANSWER_HEADERS] = limit_headers
        for handle in candidates:
            try:
                return await svc.upstream.unscheduled(handle, endpoint.path, body)
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
    if status is None or (owner is not None and not _owns(owner, status.user, status.tenant)):
        raise NotFound(f"no queued request {request_id!r} for this key: it was dispatched, "
                       "has finished, or is unknown")
    place = status.place
    return web.json_response({
        "id": status.request_id, "object": "fairgate.queued_request",
        "model": status.model, "priority_class": status.klass, "status": "queued",
        "position": place.position, "ahead_in_class": place.ahead_in_class,
        "queued_ms": max(0, round((time.time() - status.enqueued_at) * 1000)),
        "estimated_wait_ms": None if place.wait_s is None else round(place.wait_s * 1000)})


def _owns(key: ApiKey, user: str, tenant: str) -> bool:
    """Was a request of ``user`` queued in ``tenant`` sent with ``key``: its user, or one
    of its trusted end users, in its tenant (the same user name in another tenant is
    someone else)."""
    return tenant == key.tenant_name and (
        user == key.user or (key.trusted_end_users
                             and user.startswith(end_user_name(key.user, ""))))


async def own_usage(request: web.Request) -> web.Response:
    """The calling key's limits and what is left of them (a fairgate extension)."""
    svc = request.app[SERVICES]
    key = await svc.keys.identify(request.headers.get("Authorization"))
    return web.json_response(await key_usage(svc, key))


async def key_usage(svc: Services, key: ApiKey) -> dict[str, object]:
    """A key's limits and budgets now (also the admin view, ``gateway/http/admin/routes.py``)."""
    return {"object": "fairgate.usage", "key_id": key.id, "user": key.user,
            "tenant": key.tenant_name, "limits": await svc.quotas.view(key)}


def _model(model: str, created: int, parent: str | None = None, root: str | None = None
           ) -> dict[str, object]:
    card: dict[str, object] = {"id": model, "object": "model", "created": created,
                               "owned_by": "fairgate"}
    if parent is not None:  # a LoRA adapter, shown as vLLM shows it
        card.update(root=root, parent=parent)
    return card


def _cards(svc: Services) -> list[dict[str, object]]:
    """The models served, then the LoRA adapters on them (``created``: when this gateway
    started, as vLLM's cards carry a time)."""
    created = svc.started_at
    return ([_model(m, created) for m in svc.settings.models()]
            + [_model(a.name, created, a.base_model, a.path)
               for a in adapters.listing(svc.settings, svc.pool.discovered())])


async def list_models(request: web.Request) -> web.Response:
    svc = request.app[SERVICES]
    await svc.keys.identify(request.headers.get("Authorization"))
    return web.json_response({"object": "list", "data": _cards(svc)})


async def retrieve_model(request: web.Request) -> web.Response:
    svc = request.app[SERVICES]
    await svc.keys.identify(request.headers.get("Authorization"))
    model = request.match_info["model"]
    _known_model(svc, model)
    return web.json_response(next((c for c in _cards(svc) if c["id"] == model),
                                  _model(model, svc.started_at)))


async def openapi(request: web.Request) -> web.Response:
    """fairgate's own surface, its OpenAI endpoints generated from their table
    (``gateway/http/openapi.py``)."""
    return web.Response(body=openapi_json(), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    svc = request.app[SERVICES]
    await svc.store.reads.ping()
    if not svc.pool.any_healthy():
        raise Unavailable("no healthy backend")
    return web.json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    svc = request.app[SERVICES]
    if svc.settings.access.metrics_auth:  # off by default: scrapers on a private network
        await svc.keys.require_admin(request.headers.get("Authorization"))
    with contextlib.suppress(StoreUnavailable):  # the gateway's own series still matter
        await svc.inspector.refresh_queue_metrics()
    body = generate_latest(svc.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def endpoint_handler(endpoint: Endpoint, local: dict[str, Handler]) -> Handler:
    """The handler of a table entry: queued and forwarded endpoints share one each; a
    local one is ``local[operation_id]``."""
    if endpoint.kind is Kind.LOCAL:
        return local[endpoint.operation_id]
    serve = _scheduled if endpoint.kind is Kind.QUEUED else _unscheduled

    async def handler(request: web.Request) -> web.StreamResponse:
        return await serve(request, endpoint)
    return handler


def add_endpoint_routes(app: web.Application, local: dict[str, Handler],
                        endpoints: tuple[Endpoint, ...] = ENDPOINTS) -> None:
    """The routes of the table's entries whose handler is here or in ``local``."""
    for endpoint in endpoints:
        if endpoint.kind is not Kind.LOCAL or endpoint.operation_id in local:
            # ".+": a model id may hold a slash ("org/model")
            path = endpoint.path.replace("{model}", "{model:.+}")
            handler = endpoint_handler(endpoint, local)
            if endpoint.method == "GET":  # and HEAD, as aiohttp's add_get
                app.router.add_get(path, handler)
            else:
                app.router.add_route(endpoint.method, path, handler)


def add_routes(app: web.Application) -> None:
    app.on_response_prepare.append(_answer_headers)
    add_endpoint_routes(app, {"listModels": list_models, "retrieveModel": retrieve_model})
    app.router.add_get("/v1/fairgate/requests/{id}", request_status)
    app.router.add_get("/v1/fairgate/usage", own_usage)
    app.router.add_get("/", index)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
