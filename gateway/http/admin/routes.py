"""The admin API's routes, each served by the module of its concern.

Access: ``gateway/http/admin/access.py``; state, drain and cancel: ``gateway/http/admin/ops.py``;
backends added and removed at runtime: ``gateway/http/admin/backends.py``;
runtime keys: ``gateway/http/admin/keys.py``; usage: ``gateway/http/admin/usage.py``; reload:
``gateway/http/admin/reload.py``; the pools' demand and desired replicas:
``gateway/http/admin/pools.py``.
"""

from __future__ import annotations

from aiohttp import web

from gateway.http.admin.backends import add_backend, remove_backend
from gateway.http.admin.keys import create_key, key_limits, list_keys, revoke_key, rotate_key
from gateway.http.admin.ops import (
    cancel_request,
    drain,
    get_backends,
    get_queues,
    get_state,
    undrain,
)
from gateway.http.admin.pools import get_pools
from gateway.http.admin.reload import reload_config
from gateway.http.admin.usage import get_usage


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
    app.router.add_post("/admin/backends", add_backend)
    app.router.add_delete("/admin/backends/{name}", remove_backend)
    app.router.add_post("/admin/backends/{name}/drain", drain)
    app.router.add_post("/admin/backends/{name}/undrain", undrain)
    app.router.add_delete("/admin/requests/{id}", cancel_request)
    app.router.add_post("/admin/reload", reload_config)
    app.router.add_get("/admin/pools", get_pools)
