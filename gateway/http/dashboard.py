"""``/dashboard``: a live page for operators, plain HTML/JS/CSS shipped in the package.

Browsers cannot easily send ``Authorization`` headers, so besides the header the page
accepts the admin key from a login form (POST) or, on loopback only, ``?key=`` once;
either opens a server-side session (``gateway/access/sessions.py``: it expires, logout ends it,
removing the key ends it) in an HttpOnly, SameSite=Strict cookie and redirects to the
bare URL. The page then polls ``GET /admin/state`` with that cookie, and drains, undrains
and cancels, after a confirmation, with the cookie plus the session's CSRF token that
``/admin/state`` hands it (checked in ``gateway/http/admin/routes.py``).
"""

from __future__ import annotations

import ipaddress
import time
from importlib import resources

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from gateway.access.auth import SESSION_COOKIE
from gateway.core.errors import BadRequest, FairgateError, LoginThrottled
from gateway.services import SERVICES
from policies.login_throttle import LoginFailures

ASSETS = {"dashboard.js": "application/javascript", "dashboard.css": "text/css"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
# failed logins by client address (policies/login_throttle.py)
LOGIN_FAILURES = web.AppKey("fairgate_login_failures", LoginFailures)


def _static(name: str) -> str:
    return (resources.files("gateway.http") / "static" / name).read_text()


def _login_page(status: int, message: str = "") -> web.Response:
    html = _static("login.html").replace("{{message}}", message)
    return web.Response(text=html, status=status, content_type="text/html",
                        headers=SECURITY_HEADERS)


def _loopback(remote: str | None) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False


def _admin_key_id(request: web.Request, key: str) -> str | None:
    try:
        return request.app[SERVICES].keys.admin_id(f"Bearer {key}")
    except FairgateError:
        return None


def _see_dashboard() -> web.Response:
    return web.Response(status=303, headers={**SECURITY_HEADERS, "Location": "/dashboard"})


async def _logged_in(request: web.Request, key_id: str) -> web.Response:
    sessions = request.app[SERVICES].sessions
    response = _see_dashboard()
    response.set_cookie(SESSION_COOKIE, await sessions.open(key_id),
                        max_age=int(sessions.ttl_s), path="/", httponly=True,
                        samesite="Strict")
    return response


async def dashboard(request: web.Request) -> web.StreamResponse:
    key = request.query.get("key")
    if key is not None:
        # a key in a URL ends up in histories and proxy logs: loopback only
        if not _loopback(request.remote):
            return _login_page(403, "Sign in with the form; ?key= works only on loopback.")
        if (key_id := _admin_key_id(request, key)) is not None:
            return await _logged_in(request, key_id)
        return _login_page(401, "That is not an admin key.")
    svc = request.app[SERVICES]
    authorization = request.headers.get("Authorization")
    if authorization is not None:
        await svc.keys.require_admin(authorization)  # 401/403 as JSON for API clients
    elif not await svc.sessions.valid(request.cookies.get(SESSION_COOKIE), svc.keys):
        return _login_page(401)
    return web.Response(text=_static("dashboard.html"), content_type="text/html",
                        headers=SECURITY_HEADERS)


async def login(request: web.Request) -> web.StreamResponse:
    """The login form: a wrong key counts against the client's address; too many within
    ``login_failure_window_s`` and the address waits (429) before its form is read."""
    settings = request.app[SERVICES].settings
    failures, client, now = request.app[LOGIN_FAILURES], request.remote or "", time.monotonic()
    wait_s = failures.retry_after_s(client, now, settings.access.login_max_failures,
                                    settings.access.login_failure_window_s)
    if wait_s is not None:
        raise LoginThrottled(f"too many failed logins from this address; retry in {wait_s}s",
                             retry_after_s=wait_s)
    key = await _form_key(request)
    if key and (key_id := _admin_key_id(request, key)) is not None:
        return await _logged_in(request, key_id)
    failures.failed(client, now, settings.access.login_failure_window_s)
    return _login_page(401, "That is not an admin key.")


async def _form_key(request: web.Request) -> str:
    """The form's ``key``; a form that does not parse (not UTF-8, an unknown charset, a
    multipart body without its boundary) is a 400."""
    try:
        form = await request.post()
    except (ValueError, LookupError, HttpProcessingError) as exc:
        raise BadRequest(f"malformed login form: {exc}") from None
    return str(form.get("key", ""))


async def logout(request: web.Request) -> web.StreamResponse:
    await request.app[SERVICES].sessions.close(request.cookies.get(SESSION_COOKIE))
    response = _see_dashboard()
    response.del_cookie(SESSION_COOKIE, path="/")
    return response


async def asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in ASSETS:
        raise web.HTTPNotFound()
    return web.Response(text=_static(name), content_type=ASSETS[name],
                        headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})


def add_dashboard_routes(app: web.Application) -> None:
    app[LOGIN_FAILURES] = LoginFailures()
    app.router.add_get("/dashboard", dashboard)
    app.router.add_post("/dashboard/login", login)
    app.router.add_post("/dashboard/logout", logout)
    app.router.add_get("/dashboard/static/{name}", asset)
