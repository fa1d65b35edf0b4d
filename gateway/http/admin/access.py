"""Who may call the admin API: an admin key, or a dashboard session (with its CSRF token).

Every admin route needs an admin key (``admin_keys`` in the settings): ``Authorization:
Bearer`` or, from the dashboard, its session cookie: for the GETs, and for drain, undrain
and cancel only with the session's CSRF token in ``X-CSRF-Token``
(``gateway/access/sessions.py``; ``GET /admin/state`` gives it to the page as ``csrf_token``).
Reload and the key routes take the key only. A missing or unknown key is 401, a user's API
key or a missing or wrong CSRF token 403, in OpenAI's error format.
"""

from __future__ import annotations

from aiohttp import web

from gateway.access.auth import SESSION_COOKIE
from gateway.access.sessions import CSRF_HEADER, csrf_valid
from gateway.core.errors import CsrfRejected
from gateway.services import SERVICES, Services


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
