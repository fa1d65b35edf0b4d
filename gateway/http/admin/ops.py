"""Operating the scheduler: queue and backend state, drain and undrain, cancel a request.

State comes from the read model (``gateway/ops/read_model.py``). One replica's view:
- drain is global: the flag lives in Redis, the dispatch script honours it at once and
  every replica's scraper picks it up within a scrape interval;
- cancelling a request held by another replica removes it from the queue, but that
  replica's client only learns at its queue timeout (504).
"""

from __future__ import annotations

import time

import structlog
from aiohttp import web

from gateway.access.auth import SESSION_COOKIE
from gateway.access.sessions import csrf_token
from gateway.core.errors import NotFound, NotQueued, RequestCancelled
from gateway.http.admin.access import admin_services
from gateway.ops.read_model import usage_today

log = structlog.get_logger("fairgate.admin")


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


async def _set_drained(request: web.Request, drained: bool) -> web.Response:
    svc = await admin_services(request, page_action=True)
    name = request.match_info["name"]
    handle = svc.pool.handles.get(name)
    if handle is None:
        raise NotFound(f"no backend named {name!r}", param="name")
    await svc.store.set_drained(handle.config.model, name, drained)  # every replica
    svc.pool.set_drained(handle, drained)
    log.info("backend_drained" if drained else "backend_undrained", backend=name)
    svc.dispatcher.wake()
    return web.json_response(await svc.inspector.backend(name))


async def drain(request: web.Request) -> web.Response:
    return await _set_drained(request, True)


async def undrain(request: web.Request) -> web.Response:
    return await _set_drained(request, False)


async def cancel_request(request: web.Request) -> web.Response:
    svc = await admin_services(request, page_action=True)
    request_id = request.match_info["id"]
    for model in svc.settings.models():
        fields = await svc.store.request_fields(model, request_id)
        if fields:
            break
    else:
        raise NotFound(f"no queued or running request {request_id!r}", param="id")
    user, klass, owner = fields.get("user", ""), fields.get("class", ""), fields.get("owner")
    if fields.get("state") != "queued" or not await svc.store.cancel(
            model, request_id, user, klass):
        raise NotQueued(f"request {request_id!r} is no longer queued (already dispatched)")
    notified = owner == svc.replica_id and svc.dispatcher.cancel(
        request_id, RequestCancelled("request cancelled by an operator"))
    log.info("cancelled_by_operator", request_id=request_id, model=model, user=user,
             priority_class=klass, owner=owner, client_notified=notified)
    return web.json_response({"id": request_id, "object": "request.cancelled", "model": model,
                              "user": user, "priority_class": klass, "owner": owner,
                              "client_notified": notified})
