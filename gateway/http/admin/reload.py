"""``POST /admin/reload`` (admin key): the config reload (``gateway/reload.py``) in this
worker, then in the other workers of ``fairgate serve --workers N``."""

from __future__ import annotations

from aiohttp import web

from gateway.core.worker_signals import reload_siblings
from gateway.http.admin.access import admin_services
from gateway.reload import reload_settings


async def reload_config(request: web.Request) -> web.Response:
    report = reload_settings(await admin_services(request))
    reload_siblings()  # the other workers of `fairgate serve --workers N` reload too
    return web.json_response(report)
