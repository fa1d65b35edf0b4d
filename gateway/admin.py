"""The admin API: queue and backend state, drain, cancel, config reload.

Every route needs an admin key (``admin_keys`` in the settings): ``Authorization: Bearer``
or, for read-only GETs from the dashboard, its session cookie. A missing or unknown key is
401, a user's API key 403, both in OpenAI's error format.

Limits (one replica's view):
- drain is global: the flag lives in Redis, the dispatch script honours it at once and
  every replica's scraper picks it up within a scrape interval;
- cancelling a request held by another replica removes it from the queue, but that
  replica's client only learns at its queue timeout (504);
- reload re-reads ``api_keys``, ``admin_keys`` and ``backends`` (added, removed or
  re-pointed backends of the models already served: queues and connections stay); a new
  model, or changed classes, fairness, Redis or listen settings are reported under
  ``restart_required`` and not applied.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Awaitable, Mapping
from typing import Any, cast

import structlog
import yaml
from aiohttp import web
from pydantic import ValidationError
from redis.exceptions import RedisError

from gateway.auth import KeyRing
from gateway.batch_routes import BATCH
from gateway.context import CONTEXT, Context
from gateway.errors import (
    BadRequest,
    FairgateError,
    Forbidden,
    NotFound,
    StoreUnavailable,
    Unauthorized,
)
from gateway.keys import ModelKeys
from gateway.settings import Settings, load_settings
from policies.classes import CLASS_ORDER
from policies.gates import evaluate_gate

log = structlog.get_logger("fairgate.admin")

SESSION_COOKIE = "fairgate_admin"
USERS_SCANNED = 1000  # per (model, class): bounds the Redis reads of one state request
TOP_USERS = 20
RESTART_FIELDS = ("backends", "classes", "fairness", "redis_url", "listen", "replica_id",
                  "vtc_input_weight", "vtc_output_weight", "priority_class_gap")


class AdminRequired(Forbidden):
    code = "admin_key_required"


class RequestCancelled(FairgateError):
    """The client's answer when an operator cancels its queued request."""

    status, type, code = 409, "invalid_request_error", "request_cancelled"


class NotQueued(FairgateError):
    status, type, code = 409, "invalid_request_error", "request_not_queued"


class NoConfigFile(FairgateError):
    status, type, code = 409, "invalid_request_error", "no_config_file"


# -------------------------------------------------------------------------- auth


def session_token(admin_key: str) -> str:
    """The dashboard cookie: derived from the key, so the key itself is never stored."""
    return hmac.new(admin_key.encode(), b"fairgate-dashboard", hashlib.sha256).hexdigest()


class AdminKeys:
    """The admin keys in force: the settings' until a reload replaces them."""

    def __init__(self) -> None:
        self.reloaded: list[str] | None = None

    def current(self, ctx: Context) -> list[str]:
        return ctx.settings.admin_keys if self.reloaded is None else self.reloaded


ADMIN_KEYS = web.AppKey("fairgate_admin_keys", AdminKeys)


def valid_session(request: web.Request, token: str | None) -> bool:
    if not token:
        return False
    keys = request.app[ADMIN_KEYS].current(request.app[CONTEXT])
    return any(hmac.compare_digest(token, session_token(k)) for k in keys)


def require_admin(request: web.Request) -> None:
    """401 without a valid key, 403 for a user's key; GETs may use the dashboard cookie."""
    ctx = request.app[CONTEXT]
    authorization = request.headers.get("Authorization")
    if authorization is None and request.method == "GET" and valid_session(
            request, request.cookies.get(SESSION_COOKIE)):
        return
    if ctx.keys.is_admin(authorization):  # raises Unauthorized when missing
        return
    try:
        ctx.keys.identify(authorization)
    except Unauthorized:
        raise
    raise AdminRequired("this route needs an admin key")


# -------------------------------------------------------------------------- state


async def queue_state(ctx: Context, model: str, now: float) -> dict[str, Any]:
    """Per class: depth, oldest wait, and the users with the most queued requests."""
    k = ModelKeys(model)
    client = ctx.store.client
    try:
        pipe = client.pipeline(transaction=False)
        for klass in CLASS_ORDER:
            pipe.zrange(k.active(klass), 0, USERS_SCANNED - 1, withscores=True)
        pipe.hgetall(k.depth)
        *actives, depth = await pipe.execute()
        pairs = [(klass, str(user), float(score))
                 for klass, members in zip(CLASS_ORDER, actives, strict=True)
                 for user, score in members]
        pipe = client.pipeline(transaction=False)
        for klass, user, _ in pairs:
            pipe.llen(k.queue(klass, user))
            pipe.lindex(k.queue(klass, user), 0)
        heads = await pipe.execute()
        pipe = client.pipeline(transaction=False)
        for i in range(len(pairs)):
            pipe.hget(k.request(str(heads[2 * i + 1] or "")), "enqueued_at")
        enqueued = await pipe.execute()
    except RedisError as exc:
        raise StoreUnavailable(str(exc)) from exc
    classes: dict[str, dict[str, Any]] = {
        c: {"depth": int(depth.get(c, 0)), "oldest_wait_s": None, "active_users": 0, "users": []}
        for c in CLASS_ORDER}
    for i, (klass, user, score) in enumerate(pairs):
        wait = now - float(enqueued[i]) if enqueued[i] else None
        entry = classes[klass]
        entry["active_users"] += 1
        entry["users"].append({"user": user, "queued": int(heads[2 * i]), "score": score,
                               "oldest_wait_s": wait, "oldest_request_id": heads[2 * i + 1]})
        if wait is not None and (entry["oldest_wait_s"] is None or wait > entry["oldest_wait_s"]):
            entry["oldest_wait_s"] = wait
    for entry in classes.values():
        entry["users"].sort(key=lambda u: (-u["queued"], u["score"]))
        del entry["users"][TOP_USERS:]
    return classes


async def backend_state(ctx: Context, model: str, now: float) -> list[dict[str, Any]]:
    handles = ctx.pool.for_model(model)
    states = await ctx.store.backend_states(model, [h.name for h in handles])
    out = []
    for h in handles:
        st = states[h.name]
        snap = st.snapshot if h.healthy else None
        gates = {}
        for klass in CLASS_ORDER:
            gate = evaluate_gate(snap, ctx.settings.classes[klass].gate(), now,
                                 ctx.settings.snapshot_stale_s, h.drained)
            is_open = gate.limit > st.sent_since_snapshot
            # open by the snapshot but its burst already used: full until the next scrape
            reason = gate.reason or (None if is_open else "waiting")
            gates[klass] = {"open": is_open, "limit": gate.limit, "reason": reason}
        out.append({
            "name": h.name, "url": h.config.url, "model": model, "healthy": h.healthy,
            "drained": h.drained, "accepts_priority": h.accepts_priority,
            "snapshot": None if st.snapshot is None else {
                "waiting": st.snapshot.waiting, "running": st.snapshot.running,
                "kv_usage": st.snapshot.kv_usage,
                "tpot_ms": None if st.snapshot.tpot_s is None else st.snapshot.tpot_s * 1000,
                "age_s": now - st.snapshot.taken_at_s},
            "sent_since_snapshot": st.sent_since_snapshot, "inflight": st.inflight,
            "gates": gates, "dispatch_rate_per_s": ctx.metrics.dispatch_rate(h.name),
        })
    return out


async def refresh_queue_metrics(ctx: Context) -> None:
    """Queue depth and oldest wait gauges, read from Redis at scrape time."""
    now = time.time()
    for model in ctx.settings.models():
        try:
            classes = await queue_state(ctx, model, now)
        except StoreUnavailable:
            return
        for klass, entry in classes.items():
            ctx.metrics.queue_depth.labels(model, klass).set(entry["depth"])
            ctx.metrics.queue_oldest_wait.labels(model, klass).set(entry["oldest_wait_s"] or 0.0)


async def full_state(ctx: Context) -> dict[str, Any]:
    now = time.time()
    models = {}
    for model in ctx.settings.models():
        shares = ctx.metrics.shares.get(model)
        share_list = [] if shares is None else [
            {"user": u, "share": s} for u, s in shares.shares(time.monotonic()).items()]
        inflight = await ctx.store.user_inflight(model)
        models[model] = {
            "queues": await queue_state(ctx, model, now),
            "backends": await backend_state(ctx, model, now),
            "service_shares": share_list[:TOP_USERS],
            "inflight_by_user": dict(sorted(inflight.items(), key=lambda kv: -kv[1])[:TOP_USERS]),
        }
    return {"replica_id": ctx.replica_id, "time": now, "fairness": ctx.settings.fairness,
            "models": models}


# -------------------------------------------------------------------------- routes


async def get_state(request: web.Request) -> web.Response:
    require_admin(request)
    state = await full_state(request.app[CONTEXT])
    state["batches"] = await request.app[BATCH].batches.running()
    return web.json_response(state)


async def get_queues(request: web.Request) -> web.Response:
    require_admin(request)
    ctx = request.app[CONTEXT]
    now = time.time()
    data = {m: await queue_state(ctx, m, now) for m in ctx.settings.models()}
    return web.json_response({"object": "list", "data": data})


async def get_backends(request: web.Request) -> web.Response:
    require_admin(request)
    ctx = request.app[CONTEXT]
    now = time.time()
    data = [b for m in ctx.settings.models() for b in await backend_state(ctx, m, now)]
    return web.json_response({"object": "list", "data": data})


async def _set_drained(request: web.Request, drained: bool) -> web.Response:
    require_admin(request)
    ctx = request.app[CONTEXT]
    name = request.match_info["name"]
    handle = ctx.pool.handles.get(name)
    if handle is None:
        raise NotFound(f"no backend named {name!r}", param="name")
    await ctx.store.set_drained(handle.config.model, name, drained)  # every replica
    handle.drained = drained
    ctx.metrics.backend_drained.labels(name).set(1 if drained else 0)
    log.info("backend_drained" if drained else "backend_undrained", backend=name)
    ctx.dispatcher.wake()
    states = await backend_state(ctx, handle.config.model, time.time())
    return web.json_response(next(b for b in states if b["name"] == name))


async def drain(request: web.Request) -> web.Response:
    return await _set_drained(request, True)


async def undrain(request: web.Request) -> web.Response:
    return await _set_drained(request, False)


async def _find_request(ctx: Context, request_id: str) -> tuple[str, Mapping[str, str]]:
    for model in ctx.settings.models():
        try:
            fields = await cast("Awaitable[dict[str, str]]", ctx.store.client.hgetall(
                ModelKeys(model).request(request_id)))
        except RedisError as exc:
            raise StoreUnavailable(str(exc)) from exc
        if fields:
            return model, fields
    raise NotFound(f"no queued or running request {request_id!r}", param="id")


async def cancel_request(request: web.Request) -> web.Response:
    require_admin(request)
    ctx = request.app[CONTEXT]
    request_id = request.match_info["id"]
    model, fields = await _find_request(ctx, request_id)
    user, klass, owner = fields.get("user", ""), fields.get("class", ""), fields.get("owner")
    if fields.get("state") != "queued" or not await ctx.store.cancel(
            model, request_id, user, klass):
        raise NotQueued(f"request {request_id!r} is no longer queued (already dispatched)")
    notified = False
    if owner == ctx.replica_id:
        waiter = ctx.dispatcher.waiters.pop(request_id, None)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_exception(RequestCancelled("request cancelled by an operator"))
            notified = True
    log.info("cancelled_by_operator", request_id=request_id, model=model, user=user,
             priority_class=klass, owner=owner, client_notified=notified)
    return web.json_response({"id": request_id, "object": "request.cancelled", "model": model,
                              "user": user, "priority_class": klass, "owner": owner,
                              "client_notified": notified})


def _changed(old: Settings, new: Settings) -> list[str]:
    return [f for f in RESTART_FIELDS if getattr(old, f) != getattr(new, f)]


async def reload_config(request: web.Request) -> web.Response:
    require_admin(request)
    ctx = request.app[CONTEXT]
    path = ctx.settings.config_file
    if path is None:
        raise NoConfigFile("the gateway was started without a config file: nothing to reload")
    try:
        new = load_settings(path)
    except (ValidationError, FileNotFoundError, yaml.YAMLError) as exc:
        raise BadRequest(f"config file {str(path)!r} is invalid; nothing reloaded: {exc}") from None
    ctx.keys = KeyRing(new.api_keys, new.admin_keys)
    request.app[ADMIN_KEYS].reloaded = list(new.admin_keys)
    restart = _changed(ctx.settings, new)
    reloaded = ["api_keys", "admin_keys"]
    backends: dict[str, list[str]] = {}
    if "backends" in restart and new.models() == ctx.settings.models():
        # same models: re-point the pool in place; queues and connections stay
        backends = ctx.pool.reconcile(new.backends)
        ctx.settings.backends = new.backends
        restart.remove("backends")
        reloaded.append("backends")
    log.info("config_reloaded", api_keys=len(new.api_keys), admin_keys=len(new.admin_keys),
             backends=backends, restart_required=restart)
    return web.json_response({"reloaded": reloaded, "api_keys": len(new.api_keys),
                              "backends": backends, "restart_required": restart})


def add_admin_routes(app: web.Application) -> None:
    app[ADMIN_KEYS] = AdminKeys()
    app.router.add_get("/admin/state", get_state)
    app.router.add_get("/admin/queues", get_queues)
    app.router.add_get("/admin/backends", get_backends)
    app.router.add_post("/admin/backends/{name}/drain", drain)
    app.router.add_post("/admin/backends/{name}/undrain", undrain)
    app.router.add_delete("/admin/requests/{id}", cancel_request)
    app.router.add_post("/admin/reload", reload_config)
