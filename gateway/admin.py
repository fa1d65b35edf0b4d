"""The admin API: queue and backend state, drain, cancel, config reload.

Every route needs an admin key (``admin_keys`` in the settings): ``Authorization: Bearer``
or, from the dashboard, its session cookie: for the GETs, and for drain, undrain and
cancel only with the session's CSRF token in ``X-CSRF-Token`` (``gateway/sessions.py``;
``GET /admin/state`` gives it to the page as ``csrf_token``). Reload takes the key only. A
missing or unknown key is 401, a user's API key or a missing or wrong CSRF token 403, in
OpenAI's error format. State comes from the read model (``gateway/read_model.py``).

Limits (one replica's view):
- drain is global: the flag lives in Redis, the dispatch script honours it at once and
  every replica's scraper picks it up within a scrape interval;
- cancelling a request held by another replica removes it from the queue, but that
  replica's client only learns at its queue timeout (504);
- reload re-reads ``api_keys``, ``admin_keys`` and ``backends`` (added, removed or
  re-pointed backends of the models already served: queues and connections stay) and
  swaps in new settings; a new model, or changed classes, fairness, Redis or listen
  settings are reported under ``restart_required`` and not applied.
"""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, date, datetime, timedelta
from typing import Any

import structlog
import yaml
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.auth import SESSION_COOKIE, KeyRing
from gateway.errors import (
    BadRequest,
    CsrfRejected,
    KeyInConfig,
    NoConfigFile,
    NotFound,
    NotQueued,
    RequestCancelled,
)
from gateway.read_model import usage_today
from gateway.routes import key_usage
from gateway.services import SERVICES, Services
from gateway.sessions import CSRF_HEADER, csrf_token, csrf_valid
from gateway.settings import ApiKey, Settings, UsageLimits, load_settings
from gateway.usage import DIMENSIONS, group, to_csv
from gateway.worker_signals import reload_siblings
from policies.classes import CLASS_ORDER

log = structlog.get_logger("fairgate.admin")

RESTART_FIELDS = ("backends", "classes", "fairness", "redis_url", "listen", "replica_id",
                  "vtc_input_weight", "vtc_output_weight", "priority_class_gap", "tenants",
                  "key_pepper")


async def admin_services(request: web.Request, page_action: bool = False) -> Services:
    """The services, once the caller proved to be an operator: an admin key, or without
    one a dashboard session, for a GET, or for a ``page_action`` with its CSRF token."""
    svc = request.app[SERVICES]
    authorization = request.headers.get("Authorization")
    token = request.cookies.get(SESSION_COOKIE)
    if authorization is None and token and (request.method == "GET" or page_action) \
            and await svc.sessions.valid(token, svc.keys):
        if request.method == "GET" or csrf_valid(token, request.headers.get(CSRF_HEADER)):
            return svc
        raise CsrfRejected(f"a dashboard session needs its {CSRF_HEADER} header "
                           "(csrf_token in GET /admin/state) for this request")
    await svc.keys.require_admin(authorization)
    return svc


async def get_state(request: web.Request) -> web.Response:
    svc = await admin_services(request)
    state = await svc.inspector.state()
    state["batches"] = await svc.batches.running()
    state["usage_today"] = await usage_today(svc.usage, svc.quotas, svc.settings.tenants)
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


def _changed(old: Settings, new: Settings) -> list[str]:
    return [f for f in RESTART_FIELDS if getattr(old, f) != getattr(new, f)]


async def reload_config(request: web.Request) -> web.Response:
    report = reload_settings(await admin_services(request))
    reload_siblings()  # the other workers of `fairgate serve --workers N` reload too
    return web.json_response(report)


def reload_settings(svc: Services) -> dict[str, Any]:
    """Re-read the config file into ``svc`` (keys, admin keys, backends); what changed and
    what needs a restart. Raises ``NoConfigFile``/``BadRequest`` and changes nothing when
    there is no file or it is invalid. Also run on SIGHUP (``gateway/worker_signals.py``)."""
    current = svc.settings
    if current.config_file is None:
        raise NoConfigFile("the gateway was started without a config file: nothing to reload")
    try:
        new = load_settings(current.config_file)
    except (ValidationError, FileNotFoundError, yaml.YAMLError) as exc:
        raise BadRequest(f"config file {str(current.config_file)!r} is invalid; "
                         f"nothing reloaded: {exc}") from None
    restart = _changed(current, new)
    reloaded = ["api_keys", "admin_keys"]
    update: dict[str, object] = {"api_keys": new.api_keys, "admin_keys": new.admin_keys}
    backends: dict[str, list[str]] = {}
    if "backends" in restart and new.models() == current.models():
        # same models: re-point the pool in place; queues and connections stay
        backends = svc.pool.reconcile(new.backends)
        update["backends"] = new.backends
        restart.remove("backends")
        reloaded.append("backends")
    svc.settings = current.model_copy(update=update)
    svc.keys = KeyRing(new.api_keys, new.admin_keys, svc.keys.runtime)
    log.info("config_reloaded", api_keys=len(new.api_keys), admin_keys=len(new.admin_keys),
             backends=backends, restart_required=restart)
    return {"reloaded": reloaded, "api_keys": len(new.api_keys), "backends": backends,
            "restart_required": restart}


# -- API keys at runtime (gateway/keyring.py) ----------------------------------------------

NAME = re.compile(r"[A-Za-z0-9._@:-]{1,128}")


class NewKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user: str
    tenant: str | None = None
    priority_class: str = "default"
    weight: float = Field(1.0, gt=0, le=1000, allow_inf_nan=False)
    trusted_end_users: bool = False
    limits: UsageLimits | None = None

    @field_validator("user", "tenant")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not NAME.fullmatch(value):
            raise ValueError("1-128 characters of letters, digits and ._@:-")
        return value

    @field_validator("priority_class")
    @classmethod
    def _known_class(cls, value: str) -> str:
        if value not in CLASS_ORDER:
            raise ValueError(f"must be one of {', '.join(CLASS_ORDER)}")
        return value


class Rotation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grace_s: float | None = Field(None, ge=0, le=30 * 86400, allow_inf_nan=False)


async def _body(request: web.Request, model: type[BaseModel], empty_ok: bool = False) -> Any:
    raw = await request.read()
    if not raw.strip() and empty_ok:
        raw = b"{}"
    try:
        return model.model_validate(json.loads(raw))
    except (ValueError, RecursionError, ValidationError) as exc:
        errors = exc.errors(include_url=False) if isinstance(exc, ValidationError) else None
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors) \
            if errors else "the body must be a JSON object"
        raise BadRequest(f"invalid request body: {detail}") from None


def _config_key(svc: Services, key_id: str) -> ApiKey | None:
    return next((k for k in svc.keys.config_keys() if k.id == key_id), None)


def config_key_record(key: ApiKey) -> dict[str, Any]:
    return {"id": key.id, "object": "fairgate.api_key", "prefix": key.key[:3] + "…",
            "user": key.user, "tenant": key.tenant_name, "priority_class": key.priority_class,
            "weight": key.weight, "trusted_end_users": key.trusted_end_users,
            "limits": key.limits.model_dump(exclude_none=True) if key.limits else {},
            "source": "config", "created": None, "rotated": None, "last_used": None}


def _runtime(svc: Services) -> Any:
    if svc.keys.runtime is None:  # always built by gateway/services.py
        raise NotFound("runtime keys are not available")
    return svc.keys.runtime


async def create_key(request: web.Request) -> web.Response:
    svc = await admin_services(request)
    new = await _body(request, NewKey)
    record, secret = await _runtime(svc).create(new.user, new.tenant, new.priority_class,
                                                new.weight, new.limits, new.trusted_end_users)
    return web.json_response({**record, "key": secret}, status=201)


async def list_keys(request: web.Request) -> web.Response:
    svc = await admin_services(request)
    data = [config_key_record(k) for k in svc.keys.config_keys()]
    data += await _runtime(svc).records()
    return web.json_response({"object": "list", "data": data})


async def revoke_key(request: web.Request) -> web.Response:
    svc = await admin_services(request)
    key_id = request.match_info["id"]
    if _config_key(svc, key_id) is not None:
        raise KeyInConfig(f"key {key_id} is defined in the config file: remove it there "
                          "and reload")
    if not await _runtime(svc).revoke(key_id):
        raise NotFound(f"no key {key_id!r}", param="id")
    return web.json_response({"id": key_id, "object": "fairgate.api_key", "deleted": True})


async def rotate_key(request: web.Request) -> web.Response:
    svc = await admin_services(request)
    key_id = request.match_info["id"]
    rotation = await _body(request, Rotation, empty_ok=True)
    if _config_key(svc, key_id) is not None:
        raise KeyInConfig(f"key {key_id} is defined in the config file: change it there "
                          "and reload")
    grace_s = (svc.settings.key_rotate_grace_s if rotation.grace_s is None
               else rotation.grace_s)
    rotated = await _runtime(svc).rotate(key_id, grace_s)
    if rotated is None:
        raise NotFound(f"no key {key_id!r}", param="id")
    record, secret = rotated
    return web.json_response({**record, "key": secret, "previous_key_valid_s": grace_s})


async def key_limits(request: web.Request) -> web.Response:
    """A key's limits and budgets, and its tenant's, with what is left of them now."""
    svc = await admin_services(request)
    key_id = request.match_info["id"]
    key = await svc.keys.find(key_id)
    if key is None:
        raise NotFound(f"no key {key_id!r}", param="id")
    return web.json_response(await key_usage(svc, key))


# -- usage accounting (gateway/usage.py) -----------------------------------------------------


def _day(request: web.Request, name: str, default: date) -> date:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        return date.fromisoformat(raw)
    except ValueError:
        raise BadRequest(f"'{name}' must be a date, YYYY-MM-DD", param=name) from None


async def get_usage(request: web.Request) -> web.StreamResponse:
    """Usage per UTC day summed along ``group_by`` (``day,tenant,user,key,model,class``;
    default ``tenant,user``) over ``from``..``to`` (dates, inclusive; default today), as
    JSON or, with ``format=csv``, as CSV."""
    svc = await admin_services(request)
    by = [d.strip() for d in request.query.get("group_by", "tenant,user").split(",")
          if d.strip()]
    if not by or any(d not in DIMENSIONS for d in by) or len(set(by)) != len(by):
        raise BadRequest(f"'group_by' must name distinct dimensions of {', '.join(DIMENSIONS)}",
                         param="group_by")
    today = datetime.now(UTC).date()
    first, last = _day(request, "from", today), _day(request, "to", today)
    if first > last:
        raise BadRequest("'from' is after 'to'", param="from")
    oldest = today - timedelta(days=svc.usage.retention_days)
    first, last = max(first, oldest), min(last, today)
    fmt = request.query.get("format", "json")
    if fmt not in ("json", "csv"):
        raise BadRequest("'format' must be json or csv", param="format")
    rows = group(await svc.usage.rows(first, last), by) if first <= last else []
    if fmt == "csv":
        return web.Response(text=to_csv(rows, by), content_type="text/csv", headers={
            "Content-Disposition": f'attachment; filename="fairgate-usage-{first}-{last}.csv"'})
    return web.json_response({"object": "list", "from": first.isoformat(),
                              "to": last.isoformat(), "group_by": by, "data": rows})


def add_admin_routes(app: web.Application) -> None:
    app.router.add_post("/admin/keys", create_key)
    app.router.add_get("/admin/keys", list_keys)
    app.router.add_delete("/admin/keys/{id}", revoke_key)
    app.router.add_post("/admin/keys/{id}/rotate", rotate_key)
    app.router.add_get("/admin/keys/{id}/usage", key_limits)
    app.router.add_get("/admin/usage", get_usage)
    app.router.add_get("/admin/state", get_state)
    app.router.add_get("/admin/queues", get_queues)
    app.router.add_get("/admin/backends", get_backends)
    app.router.add_post("/admin/backends/{name}/drain", drain)
    app.router.add_post("/admin/backends/{name}/undrain", undrain)
    app.router.add_delete("/admin/requests/{id}", cancel_request)
    app.router.add_post("/admin/reload", reload_config)
