"""``/dashboard``: a live page for operators, plain HTML/JS/CSS shipped in the package.

Browsers cannot easily send ``Authorization`` headers, so besides the header the page
accepts the admin key from a login form (POST) or ``?key=`` once; either sets an HttpOnly,
SameSite=Strict session cookie derived from the key and redirects to the bare URL. The
page then polls ``GET /admin/state`` with that cookie.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

from gateway.auth import SESSION_COOKIE, session_token
from gateway.errors import FairgateError
from gateway.services import SERVICES

ASSETS = {"dashboard.js": "application/javascript", "dashboard.css": "text/css"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
COOKIE_MAX_AGE_S = 12 * 3600


def _static(name: str) -> str:
    return (resources.files("gateway") / "static" / name).read_text()


def _login_page(status: int, message: str = "") -> web.Response:
    html = _static("login.html").replace("{{message}}", message)
    return web.Response(text=html, status=status, content_type="text/html",
                        headers=SECURITY_HEADERS)


def _admin_key_valid(request: web.Request, key: str) -> bool:
    try:
        return request.app[SERVICES].keys.is_admin(f"Bearer {key}")
    except FairgateError:
        return False


def _see_dashboard() -> web.Response:
    return web.Response(status=303, headers={**SECURITY_HEADERS, "Location": "/dashboard"})


def _logged_in(key: str) -> web.Response:
    response = _see_dashboard()
    response.set_cookie(SESSION_COOKIE, session_token(key), max_age=COOKIE_MAX_AGE_S,
                        path="/", httponly=True, samesite="Strict")
    return response


async def dashboard(request: web.Request) -> web.StreamResponse:
    key = request.query.get("key")
    if key is not None:
        if _admin_key_valid(request, key):
            return _logged_in(key)
        return _login_page(401, "That is not an admin key.")
    keys = request.app[SERVICES].keys
    authorization = request.headers.get("Authorization")
    if authorization is not None:
        keys.require_admin(authorization)  # 401/403 as JSON for API clients
    elif not keys.valid_session(request.cookies.get(SESSION_COOKIE)):
        return _login_page(401)
    return web.Response(text=_static("dashboard.html"), content_type="text/html",
                        headers=SECURITY_HEADERS)


async def login(request: web.Request) -> web.StreamResponse:
    form = await request.post()
    key = str(form.get("key", ""))
    if key and _admin_key_valid(request, key):
        return _logged_in(key)
    return _login_page(401, "That is not an admin key.")


async def logout(request: web.Request) -> web.StreamResponse:
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
    app.router.add_get("/dashboard", dashboard)
    app.router.add_post("/dashboard/login", login)
    app.router.add_post("/dashboard/logout", logout)
    app.router.add_get("/dashboard/static/{name}", asset)
