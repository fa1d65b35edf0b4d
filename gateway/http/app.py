"""The aiohttp application: the error boundary, the routes, and the services' lifetime."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from gateway.core.edge import error_boundary
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import Settings
from gateway.http.admin.routes import add_admin_routes
from gateway.http.batch_routes import add_batch_routes
from gateway.http.client_guard import AUTHENTICATED, REQUESTED, client_guard
from gateway.http.dashboard import add_dashboard_routes
from gateway.http.routes import add_routes
from gateway.services import SERVICES, running_services


def create_app(settings: Settings, metrics: GatewayMetrics | None = None) -> web.Application:
    metrics = metrics or GatewayMetrics(top_users=settings.operations.metrics_top_users,
                                        user_idle_s=settings.operations.metrics_user_idle_s)
    # the guard outside the boundary: it closes the connection after a cut body's 408
    app = web.Application(middlewares=[client_guard(settings.listen.client_idle_timeout_s,
                                                    settings.listen.min_body_bytes_per_s),
                                       error_boundary(metrics, _retry_after)],
                          client_max_size=settings.listen.max_body_bytes)
    app[AUTHENTICATED] = set()
    app[REQUESTED] = set()
    app.cleanup_ctx.append(_services(settings, metrics))
    add_routes(app)
    add_batch_routes(app)
    add_admin_routes(app)
    add_dashboard_routes(app)
    return app


def _retry_after(request: web.Request) -> int:
    """An error's ``Retry-After`` when it carries none: the wait estimator's floor."""
    return request.app[SERVICES].admission.waits.retry_after(None)


def _services(settings: Settings, metrics: GatewayMetrics
              ) -> Callable[[web.Application], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        async with running_services(settings, metrics) as services:
            app[SERVICES] = services
            yield

    return lifetime
