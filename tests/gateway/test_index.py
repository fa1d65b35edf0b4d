"""``GET /``: the entry points, as JSON for a program and as HTML for a browser, each link
a route that answers."""

from __future__ import annotations

import re

import aiohttp
import pytest

from gateway.http.index import LINKS, wants_html
from tests.gateway.conftest import GatewayFactory, SimFactory

ENTRY_POINTS = ["/v1", "/dashboard", "/metrics", "/openapi.json"]
BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


@pytest.mark.parametrize(("accept", "html"), [
    ("", False), ("*/*", False), ("application/json", False), (BROWSER, True),
    ("text/html", True), ("application/json, text/html;q=0.5", True),
    ("text/html;q=0", False), ("TEXT/HTML", True),
])
def test_who_gets_the_page(accept: str, html: bool) -> None:
    assert wants_html(accept) is html, accept


async def test_json_and_html_name_the_entry_points(sim: SimFactory,
                                                   gateway: GatewayFactory) -> None:
    gw = await gateway([await sim(profile="instant")], admin_keys=["sk-admin"])
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/") as resp:  # aiohttp sends Accept: */*
            assert resp.status == 200, await resp.text()
            assert resp.content_type == "application/json", resp.content_type
            assert resp.headers.get("Vary") == "Accept", dict(resp.headers)
            body = await resp.json()
        hrefs = [link["href"] for link in body["links"]]
        assert body["object"] == "fairgate.index" and hrefs[:4] == ENTRY_POINTS, body
        assert all(link["title"] for link in body["links"]), body

        async with http.get(gw.url + "/", headers={"Accept": BROWSER}) as resp:
            assert resp.status == 200 and resp.content_type == "text/html", resp.content_type
            page = await resp.text()
        linked = re.findall(r'<a href="([^"]+)">', page)
        assert linked == hrefs, page

        # every link answers: the API with a key, the rest without one
        for href in hrefs:
            url = gw.url + ("/v1/models" if href == "/v1" else href)
            async with http.get(url, headers={"Authorization": "Bearer sk-admin"}
                                if href == "/dashboard" else
                                {"Authorization": "Bearer sk-alice"}) as resp:
                assert resp.status == 200, (href, resp.status, await resp.text())
    assert [path for path, _ in LINKS] == hrefs
