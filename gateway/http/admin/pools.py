"""The pools' demand, capacity and desired replicas (``GET /admin/pools``).

The view the ``pools`` loop computed last (``gateway/ops/pools.py``), the same numbers
``/metrics`` shows as ``fairgate_pool_*``; computed now when the loop has not run yet.
"""

from __future__ import annotations

from aiohttp import web

from gateway.http.admin.access import admin_services


async def get_pools(request: web.Request) -> web.Response:
    svc = await admin_services(request)
    watch = svc.pools
    views = watch.views if watch.computed_at is not None else await watch.refresh()
    return web.json_response({"object": "list", "replica_id": svc.replica_id,
                              "computed_at": watch.computed_at,
                              "data": list(views.values())})
