"""``GET /``: where to go from here, as JSON, or as a short HTML page for a browser (a
client whose ``Accept`` names ``text/html``). No key needed: it only names the routes."""

from __future__ import annotations

import html

from aiohttp import web

ABOUT = "fairgate: a fair-scheduling gateway in front of vLLM"
# (path, what it is), the page's order
LINKS: tuple[tuple[str, str], ...] = (
    ("/v1", "the OpenAI-compatible API: the openai SDK's base_url, an API key as Bearer "
            "token (GET /v1/models lists the models)"),
    ("/dashboard", "the operators' live page (an admin key)"),
    ("/metrics", "Prometheus metrics"),
    ("/openapi.json", "the OpenAPI description of every route"),
    ("/health", "liveness"),
    ("/ready", "readiness: Redis answers and a backend is healthy"),
)


def wants_html(accept: str) -> bool:
    """``text/html`` named in ``Accept`` (and not refused with ``q=0``)."""
    for item in accept.split(","):
        kind, *params = (p.strip() for p in item.split(";"))
        if kind.lower() == "text/html":
            return not any(p.replace(" ", "") in ("q=0", "q=0.0", "q=0.00", "q=0.000")
                           for p in params)
    return False


def _page() -> str:
    items = "\n".join(f'    <li><a href="{path}"><code>{path}</code></a>: {html.escape(text)}</li>'
                      for path, text in LINKS)
    return ("<!doctype html>\n<html lang=\"en\">\n<head><meta charset=\"utf-8\">"
            f"<title>fairgate</title></head>\n<body>\n  <h1>fairgate</h1>\n"
            f"  <p>{html.escape(ABOUT)}.</p>\n  <ul>\n{items}\n  </ul>\n</body>\n</html>\n")


async def index(request: web.Request) -> web.Response:
    headers = {"Vary": "Accept"}
    if wants_html(request.headers.get("Accept", "")):
        return web.Response(text=_page(), content_type="text/html", headers=headers)
    return web.json_response({"object": "fairgate.index", "about": ABOUT,
                              "links": [{"href": path, "title": text}
                                        for path, text in LINKS]}, headers=headers)
