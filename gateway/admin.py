"""The admin API's routes, each served by the module of its concern.

Access: ``gateway/admin_access.py``; state, drain and cancel: ``gateway/admin_ops.py``;
runtime keys: ``gateway/admin_keys.py``; usage: ``gateway/admin_usage.py``; reload:
``gateway/reload.py``.
"""

from __future__ import annotations

from aiohttp import web

from gateway.admin_keys import create_key, key_limits, list_keys, revoke_key, rotate_key
from gateway.admin_ops import cancel_request, drain, get_backends, get_queues, get_state, undrain
from gateway.admin_usage import get_usage
from gateway.reload import reload_config


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
