"""Operating the scheduler: queue and backend state, drain and undrain, cancel a request.

State comes from the read model (``gateway/ops/read_model.py``). One replica's view:
- drain is global: the flag lives in Redis, the dispatch script honours it at once and
  every replica's scraper picks it up within a scrape interval; a drain with
  ``{"migrate": true, "grace_s": N}`` also stores when the backend's running answers move
  elsewhere, and every process moves its own then (``gateway/scheduling/migrate.py``);
- cancelling a request held by another replica removes it from the queue, but that
  replica's client only learns at its queue timeout (504).
"""

from __future__ import annotations

import math
import time
from typing import Any

import structlog
from aiohttp import web

from gateway.access.auth import SESSION_COOKIE
from gateway.access.sessions import csrf_token
from gateway.core.errors import (
    BackendLeaving,
    BadRequest,
    NotFound,
    NotQueued,
    RequestCancelled,
)
from gateway.http.admin.access import admin_services
from gateway.ops.read_model import usage_today
from gateway.proxy.completion_request import read_json_object

log = structlog.get_logger("fairgate.admin")

MAX_GRACE_S = 3600.0  # a drain's grace before its running answers move: at most an hour
MAX_DRAIN_BODY_BYTES = 4096


async def get_state(request: web.Request) -> web.Response:
    svc = await admin_services(request)
    state = await svc.inspector.state()
    state["batches"] = await svc.batches.running()
    state["usage_today"] = await usage_today(svc.usage, svc.quotas, svc.settings.tenants)
    state["grafana_url"] = svc.settings.grafana_url
    token = request.cookies.get(SESSION_COOKIE)
    # the page's token for drain/undrain/cancel; a Bearer caller needs none
    state["csrf_token"] = (csrf_token(token) if token and "Authorization" not in request.headers
                           else None)
    return web.json_response(state)


async def get_queues(request: web.Request) -> web.Response:
    svc = await admin_services(request)
    now = time.time()
    data = {m: await svc.inspector.queues(m, now) for m in svc.settings.models()}
    return web.json_response({"object": "list", "data": data})


async def get_backends(request: web.Request) -> web.Response:
    svc = await admin_services(request)
    now = time.time()
    data = [b for m in svc.settings.models() for b in await svc.inspector.backends(m, now)]
    return web.json_response({"object": "list", "data": data})


def drain_grace_s(body: dict[str, Any]) -> float | None:
    """A drain's options: the grace before its running answers move (``None``: they are
    not moved, today's drain). ``BadRequest`` for anything but ``migrate`` (a boolean)
    and ``grace_s`` (0 to :data:`MAX_GRACE_S` seconds, with ``migrate``)."""
    for name in body:
        if name not in ("migrate", "grace_s"):
            raise BadRequest(f"unknown drain option {name!r} (known: migrate, grace_s)",
                             param=name)
    migrate = body.get("migrate", False)
    if not isinstance(migrate, bool):
        raise BadRequest("migrate must be true or false", param="migrate")
    grace = body.get("grace_s")
    if grace is None:
        return 0.0 if migrate else None
    if not migrate:
        raise BadRequest("grace_s needs \"migrate\": true", param="grace_s")
    if (isinstance(grace, bool) or not isinstance(grace, int | float)
            or not math.isfinite(grace) or not 0 <= grace <= MAX_GRACE_S):
        raise BadRequest(f"grace_s must be a number of seconds from 0 to {MAX_GRACE_S:g}",
                         param="grace_s")
    return float(grace)


async def _set_drained(request: web.Request, drained: bool) -> web.Response:
    svc = await admin_services(request, page_action=True)
    name = request.match_info["name"]
    handle = svc.pool.handles.get(name)
    if handle is None:
        raise NotFound(f"no backend named {name!r}", param="name")
    if not drained and handle.leaving_since is not None:
        raise BackendLeaving(f"backend {name!r} is being removed: it stays drained until "
                             "nothing runs there", param="name")
    grace_s = None
    if drained and request.body_exists:
        grace_s = drain_grace_s(await read_json_object(request, MAX_DRAIN_BODY_BYTES))
    migrate_at = None if grace_s is None else time.time() + grace_s
    # every replica; an undrain (or a drain without migrate) cancels a pending migrate
    await svc.store.fleet.set_drained(handle.config.model, name, drained, migrate_at)
    svc.pool.set_drained(handle, drained)
    log.info("backend_drained" if drained else "backend_undrained", backend=name,
             migrate_at=migrate_at)
    svc.dispatcher.wake()
    answer = await svc.inspector.backend(name)
    # what Redis holds now: a view refresh that read the flag before the change may apply
    # the old one to this process's pool until its next refresh
    answer["drained"] = drained
    return web.json_response(answer)


async def drain(request: web.Request) -> web.Response:
    return await _set_drained(request, True)


async def undrain(request: web.Request) -> web.Response:
    return await _set_drained(request, False)


async def cancel_request(request: web.Request) -> web.Response:
    svc = await admin_services(request, page_action=True)
    request_id = request.match_info["id"]
    for model in svc.settings.models():
        fields = await svc.store.reads.request_fields(model, request_id)
        if fields:
            break
    else:
        raise NotFound(f"no queued or running request {request_id!r}", param="id")
    user, klass, owner = fields.get("user", ""), fields.get("class", ""), fields.get("owner")
    with svc.dispatcher.cancelling(request_id):
        if fields.get("state") != "queued" or not await svc.store.queue.cancel(
                model, request_id, user, klass):
            raise NotQueued(f"request {request_id!r} is no longer queued (already dispatched)")
        notified = owner == svc.replica_id and svc.dispatcher.cancel(
            request_id, RequestCancelled("request cancelled by an operator"))
    log.info("cancelled_by_operator", request_id=request_id, model=model, user=user,
             priority_class=klass, owner=owner, client_notified=notified)
    return web.json_response({"id": request_id, "object": "request.cancelled", "model": model,
                              "user": user, "priority_class": klass, "owner": owner,
                              "client_notified": notified})
