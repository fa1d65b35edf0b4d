"""Backends added and removed at runtime, end to end: real Valkey, simulated vLLM backends
on loopback, the openai SDK, two gateway replicas sharing the Redis.

A backend added by the admin API serves the next request (the only other one drained,
so nothing else could); the other replica sees it and serves with it too; removed, it
leaves every replica. One removed while a stream runs there drains first: the stream
moves and ends with its full text. Bad bodies get OpenAI-style 400/404/409 answers and
change nothing. Backends found by a DNS name (``localhost``) come and go with its answer.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from openai import AsyncOpenAI

from gateway.backends.registry import BackendList
from gateway.http.server import GatewayServer
from gateway.storage.keys import RUNTIME_BACKENDS
from tests.chaos.test_continuation import MAX_TOKENS, reference
from tests.conftest import OpenAIClients
from tests.gateway.conftest import HI, MODEL, GatewayFactory, SimFactory, until
from tests.ops.conftest import ADMIN, admin_headers, samples
from tests.ops.test_drain_migrate import rest, running_stream
from tests.ops.test_reload import config

FAST = {"admin_keys": [ADMIN], "backends_refresh_s": 0.1}


async def admin(http: aiohttp.ClientSession, method: str, url: str, body: Any = None,
                key: str | None = ADMIN, raw: bytes | None = None) -> tuple[int, Any]:
    kwargs: dict[str, Any] = {"data": raw} if raw is not None else (
        {} if body is None else {"json": body})
    headers = {} if key is None else admin_headers(key)
    async with http.request(method, url, headers=headers, **kwargs) as resp:
        return resp.status, await resp.json()


async def names(http: aiohttp.ClientSession, gw: GatewayServer) -> dict[str, str]:
    """GET /admin/backends: each backend's origin, by name."""
    status, rows = await admin(http, "GET", gw.url + "/admin/backends")
    assert status == 200, rows
    return {b["name"]: b["origin"] for b in rows["data"]}


async def scraped(gw: GatewayServer, name: str) -> None:
    pool = gw.services.pool
    await until(lambda: name in pool.handles and pool.handles[name].scraped.is_set(),
                f"backend {name} in the pool and scraped")


async def test_an_added_backend_serves_the_next_request_on_every_replica(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    s0, s1 = await sim(), await sim()
    gw1 = await gateway([s0], **FAST)
    gw2 = await gateway([s0], **FAST)
    async with aiohttp.ClientSession() as http:
        assert (await admin(http, "POST", gw1.url + "/admin/backends/b0/drain"))[0] == 200
        status, row = await admin(http, "POST", gw1.url + "/admin/backends", {
            "name": "rt0", "url": s1.url + "/", "model": MODEL, "pool": "extra",
            "max_num_batched_tokens": 4096})
        assert status == 201, row
        assert (row["name"], row["origin"], row["url"], row["pool"], row["drained"]) == (
            "rt0", "admin", s1.url, "extra", False), row
        for i, gw in enumerate((gw1, gw2)):  # the second replica learns it from Redis
            await scraped(gw, "rt0")
            assert await names(http, gw) == {"b0": "config", "rt0": "admin"}
            status, state = await admin(http, "GET", gw.url + "/admin/state")  # the dashboard's
            shown = {b["name"]: b["origin"] for b in state["models"][MODEL]["backends"]}
            assert shown == {"b0": "config", "rt0": "admin"}, shown
            served = len(s1.engine.records)
            async with AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice",
                                   max_retries=0) as oai:
                answer = await oai.chat.completions.create(
                    model=MODEL, messages=HI, max_tokens=4 + i,
                    extra_body={"ignore_eos": True})
            assert answer.usage is not None and answer.usage.completion_tokens == 4 + i, answer
            assert len(s1.engine.records) == served + 1, (i, len(s1.engine.records))
        assert len(s0.engine.records) == 0, "the drained backend served"

        # removed through the other replica: nothing ran there, so it is gone at once
        status, gone = await admin(http, "DELETE", gw2.url + "/admin/backends/rt0")
        assert (status, gone) == (200, {"name": "rt0", "object": "fairgate.backend",
                                        "removed": True}), (status, gone)
        for gw in (gw1, gw2):
            await until(lambda gw=gw: "rt0" not in gw.services.pool.handles,
                        f"rt0 gone from {gw.url}")
            assert await names(http, gw) == {"b0": "config"}
        assert await gw1.services.store.client.hgetall(RUNTIME_BACKENDS) == {}
        status, body = await admin(http, "DELETE", gw1.url + "/admin/backends/rt0")
        assert status == 404 and body["error"]["param"] == "name", (status, body)
        await admin(http, "POST", gw1.url + "/admin/backends/b0/undrain")


async def test_a_grant_for_a_backend_added_elsewhere_is_served_not_refused(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """The second replica reads the runtime backends only at start (a refresh an hour
    away): it learns the backend the first one added from the grants for it, and serves
    every request queued with it, none 503 ``backend_removed``."""
    s0, s1 = await sim(), await sim()
    # started first, the second replica holds b0's scrape lease: the first one, below its
    # share of the leases, takes the added backend's
    gw2 = await gateway([s0], admin_keys=[ADMIN], backends_refresh_s=3600.0)
    gw1 = await gateway([s0], **FAST)
    flood = 12
    async with aiohttp.ClientSession() as http:
        assert (await admin(http, "POST", gw1.url + "/admin/backends/b0/drain"))[0] == 200
        async with AsyncOpenAI(base_url=gw2.url + "/v1", api_key="sk-alice",
                               max_retries=0) as oai:
            calls = [asyncio.ensure_future(oai.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=2, user=f"u{i}",
                extra_body={"ignore_eos": True})) for i in range(flood)]
            store = gw2.services.store

            async def all_queued() -> bool:
                return sum((await store.reads.depths(MODEL)).values()) == flood
            await until(all_queued, f"{flood} requests queued on the second replica")
            assert "rt0" not in gw2.services.pool.handles
            status, row = await admin(http, "POST", gw1.url + "/admin/backends",
                                      {"name": "rt0", "url": s1.url, "model": MODEL})
            assert status == 201, row
            done = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 15)
        failed = [repr(r) for r in done if isinstance(r, BaseException)]
        assert not failed, f"{len(failed)} of {flood} failed: {failed[:3]}"
        assert len(s1.engine.records) == flood, len(s1.engine.records)
        assert "rt0" in gw2.services.pool.handles  # learned from a grant, not the refresh
        assert (await admin(http, "POST", gw1.url + "/admin/backends/b0/undrain"))[0] == 200


async def test_a_backend_removed_under_a_stream_drains_and_the_stream_ends_whole(
        sim: SimFactory, gateway: GatewayFactory, openai_clients: OpenAIClients) -> None:
    sims = [await sim(), await sim()]
    gw = await gateway(sims[:1], **FAST)
    svc = gw.services
    moved = svc.metrics.moves.continuations.labels("drain", "continued")
    async with aiohttp.ClientSession() as http:
        assert (await admin(http, "POST", gw.url + "/admin/backends/b0/drain"))[0] == 200
        status, row = await admin(http, "POST", gw.url + "/admin/backends",
                                  {"name": "rt0", "url": sims[1].url, "model": MODEL})
        assert status == 201, row
        await scraped(gw, "rt0")
        want = await reference(sims[1].url, True, 7)
        stream, got = await running_stream(openai_clients(gw.url, "sk-alice"), 7)
        [entry] = svc.running.entries()
        assert entry.backend == "rt0", entry
        assert (await admin(http, "POST", gw.url + "/admin/backends/b0/undrain"))[0] == 200

        status, row = await admin(http, "DELETE", gw.url + "/admin/backends/rt0")
        assert status == 202, row
        assert (row["removed"], row["drained"], row["origin"]) == (False, True, "admin"), row
        assert row["leaving_since"] is not None and row["migrate_at"] is not None, row
        # an undrain cannot keep it while it leaves
        status, body = await admin(http, "POST", gw.url + "/admin/backends/rt0/undrain")
        assert status == 409 and body["error"]["code"] == "backend_leaving", (status, body)

        text, usage = await rest(stream, got)
        assert text == want and usage.completion_tokens == MAX_TOKENS, (text, usage)
        await until(lambda: "rt0" not in svc.pool.handles, "rt0 removed once drained")
        assert await names(http, gw) == {"b0": "config"}
    assert moved._value.get() == 1, "the stream did not move off the leaving backend"
    assert len(sims[0].engine.records) == 1, "the continuation did not run on b0"


BAD_BODIES: list[tuple[Any, int, str | None, str | None]] = [
    ({"url": "http://127.0.0.1:9", "model": MODEL}, 400, "name", None),
    ({"name": "", "url": "http://127.0.0.1:9", "model": MODEL}, 400, "name", None),
    ({"name": "a b", "url": "http://127.0.0.1:9", "model": MODEL}, 400, "name", None),
    ({"name": "bell\x07", "url": "http://127.0.0.1:9", "model": MODEL}, 400, "name", None),
    ({"name": "a/b", "url": "http://127.0.0.1:9", "model": MODEL}, 400, "name", None),
    ({"name": 7, "url": "http://127.0.0.1:9", "model": MODEL}, 400, "name", None),
    ({"name": "x", "url": "ftp://127.0.0.1:9", "model": MODEL}, 400, "url", None),
    ({"name": "x", "url": "not a url", "model": MODEL}, 400, "url", None),
    ({"name": "x", "url": "http://", "model": MODEL}, 400, "url", None),
    ({"name": "x", "url": "http://127.0.0.1:99999", "model": MODEL}, 400, "url", None),
    ({"name": "x", "url": "http://u:p@127.0.0.1:9", "model": MODEL}, 400, "url", None),
    # issue 43: a URL that would split a request line or a header, and names that a
    # client normalising paths could not remove again (DELETE /admin/backends/..)
    ({"name": "x", "url": "http://127.0.0.1:9/\r\nX-Evil: 1", "model": MODEL}, 400, "url",
     None),
    ({"name": "x", "url": "http://127.0.0.1:9/a b", "model": MODEL}, 400, "url", None),
    ({"name": "x", "url": " http://127.0.0.1:9", "model": MODEL}, 400, "url", None),
    ({"name": "..", "url": "http://127.0.0.1:9", "model": MODEL}, 400, "name", None),
    ({"name": ".", "url": "http://127.0.0.1:9", "model": MODEL}, 400, "name", None),
    ({"name": "a" * 65, "url": "http://127.0.0.1:9", "model": MODEL}, 400, "name", None),
    ({"name": "a:b", "url": "http://127.0.0.1:9", "model": MODEL}, 400, "name", None),
    ({"name": "x", "url": "http://127.0.0.1:9", "model": "nope"}, 400, "model", None),
    ({"name": "x", "url": "http://127.0.0.1:9", "model": MODEL, "weight": 2}, 400,
     "weight", None),
    ({"name": "x", "url": "http://127.0.0.1:9", "model": MODEL, "min_prompt_tokens": 10,
      "max_prompt_tokens": 5}, 400, None, None),
    ({"name": "x", "url": "http://127.0.0.1:9", "model": MODEL,
      "max_num_batched_tokens": 0}, 400, "max_num_batched_tokens", None),
    ([1], 400, None, None),
    ({"name": "b0", "url": "http://127.0.0.1:9", "model": MODEL}, 409, "name",
     "backend_exists"),
]


async def test_bad_bodies_get_openai_errors_and_change_nothing(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    s0 = await sim()
    gw = await gateway([s0], **FAST)
    url = gw.url + "/admin/backends"
    async with aiohttp.ClientSession() as http:
        for body, want, param, code in [*BAD_BODIES, (
                {"name": "x", "url": s0.url, "model": MODEL}, 409, "url", "backend_exists")]:
            status, answer = await admin(http, "POST", url, body)
            assert status == want, (body, status, answer)
            err = answer["error"]
            assert err["type"] == "invalid_request_error" and err["message"], (body, answer)
            if param is not None:
                assert err["param"] == param, (body, answer)
            assert err["code"] == code, (body, answer)
        status, answer = await admin(http, "POST", url, raw=b"{not json")
        assert status == 400, answer
        assert (await admin(http, "POST", url, {}, key=None))[0] == 401
        assert (await admin(http, "POST", url, {}, key="sk-alice"))[0] == 403
        assert await names(http, gw) == {"b0": "config"}, "a refused body changed the list"

        new = {"name": "rt0", "url": "http://127.0.0.1:9", "model": MODEL}
        assert (await admin(http, "POST", url, new))[0] == 201
        status, answer = await admin(http, "POST", url, {**new, "url": "http://127.0.0.1:10"})
        assert status == 409 and answer["error"]["code"] == "backend_exists", answer
        for path, body, want, code in [
                ("/nope", None, 404, None), ("/b0", None, 409, "backend_not_removable"),
                ("/rt0", {"grace_s": -1}, 400, None), ("/rt0", {"grace": 1}, 400, None),
                ("/rt0", {"grace_s": "1"}, 400, None)]:
            status, answer = await admin(http, "DELETE", url + path, body)
            assert (status, answer["error"]["code"]) == (want, code), (path, body, answer)
        assert await names(http, gw) == {"b0": "config", "rt0": "admin"}
        status, answer = await admin(http, "DELETE", url + "/rt0", {"grace_s": 5})
        assert status == 200 and answer["removed"], answer  # nothing ran on it


async def test_backends_found_by_a_dns_name_come_and_go_with_its_answer(
        sim: SimFactory, gateway: GatewayFactory, redis_url: str, tmp_path: Path,
        openai_clients: OpenAIClients) -> None:
    """The discovery resolves ``localhost`` with the event loop's resolver: its
    127.0.0.1 is a backend (its ::1, where a system lists one, is one too, and stays
    unhealthy: the simulators listen on 127.0.0.1). A reload pointing the discovery at
    another port makes that answer's backends leave (a stream there moves) and the new
    ones come."""
    dns_name = "localhost"
    s0, s1, s2 = await sim(), await sim(), await sim()
    path = tmp_path / "fairgate.yaml"

    def write(port: int) -> None:
        path.write_text(yaml.safe_dump(config(redis_url, [s0], discovery=[{
            "dns_name": dns_name, "port": port, "model": MODEL, "refresh_s": 0.1,
            "pool": "found"}], backends_refresh_s=0.1)))

    write(s1.port)
    gw = await gateway([s0], **FAST, config_file=path, discovery=[{
        "dns_name": dns_name, "port": s1.port, "model": MODEL, "refresh_s": 0.1,
        "pool": "found"}])
    svc = gw.services
    first, second = f"{dns_name}@127.0.0.1:{s1.port}", f"{dns_name}@127.0.0.1:{s2.port}"
    async with aiohttp.ClientSession() as http:
        assert (await admin(http, "POST", gw.url + "/admin/backends/b0/drain"))[0] == 200
        await scraped(gw, first)
        shown = await names(http, gw)
        assert shown[first] == "dns" and shown["b0"] == "config", shown
        assert svc.pool.handles[first].config.pool == "found"
        status, body = await admin(http, "DELETE", gw.url + "/admin/backends/" + first)
        assert status == 409 and body["error"]["code"] == "backend_not_removable", body

        want = await reference(s1.url, True, 9)
        stream, got = await running_stream(openai_clients(gw.url, "sk-alice"), 9)
        [entry] = svc.running.entries()
        assert entry.backend == first, entry
        write(s2.port)  # the Service's pods moved: the old answer leaves
        status, report = await admin(http, "POST", gw.url + "/admin/reload")
        assert status == 200 and "discovery" in report["reloaded"], report
        text, usage = await rest(stream, got)
        assert text == want and usage.completion_tokens == MAX_TOKENS, (text, usage)
        await until(lambda: first not in svc.pool.handles, f"{first} removed")
        await scraped(gw, second)
        assert len(s2.engine.records) == 1, "the moved stream did not continue on the new one"
        shown = await names(http, gw)
        assert first not in shown and shown[second] == "dns", shown
        await admin(http, "POST", gw.url + "/admin/backends/b0/undrain")
    assert isinstance(svc.backends, BackendList)


async def test_a_reload_keeps_the_runtime_backends_and_the_file_wins_a_name(
        sim: SimFactory, gateway: GatewayFactory, redis_url: str, tmp_path: Path) -> None:
    s0, s1, s2 = await sim(), await sim(), await sim()
    path = tmp_path / "fairgate.yaml"

    def write(backends: list[dict[str, str]]) -> None:
        path.write_text(yaml.safe_dump({**config(redis_url, [s0], backends_refresh_s=0.1),
                                        "backends": backends}))

    b0 = {"name": "b0", "url": s0.url, "model": MODEL}
    gw = await gateway([s0], **FAST, config_file=path)
    pool = gw.services.pool
    async with aiohttp.ClientSession() as http:
        status, row = await admin(http, "POST", gw.url + "/admin/backends",
                                  {"name": "rt0", "url": s1.url, "model": MODEL})
        assert status == 201, row
        write([b0, {"name": "b1", "url": s2.url, "model": MODEL}])
        status, report = await admin(http, "POST", gw.url + "/admin/reload")
        assert status == 200 and report["backends"]["added"] == ["b1"], report
        assert await names(http, gw) == {"b0": "config", "b1": "config", "rt0": "admin"}

        # the file names rt0 (elsewhere): its backend is in force, the entry waits
        write([b0, {"name": "rt0", "url": s2.url, "model": MODEL}])
        status, report = await admin(http, "POST", gw.url + "/admin/reload")
        assert status == 200, report
        assert report["backends"] == {"added": [], "removed": ["b1"], "changed": ["rt0"]}, report
        assert await names(http, gw) == {"b0": "config", "rt0": "config"}
        assert pool.handles["rt0"].config.url == s2.url
        status, body = await admin(http, "DELETE", gw.url + "/admin/backends/rt0")
        assert status == 409 and body["error"]["code"] == "backend_not_removable", body

        write([b0])  # dropped from the file: the runtime entry is in force again
        status, report = await admin(http, "POST", gw.url + "/admin/reload")
        assert status == 200 and report["backends"]["changed"] == ["rt0"], report
        assert await names(http, gw) == {"b0": "config", "rt0": "admin"}
        assert pool.handles["rt0"].config.url == s1.url
        status, gone = await admin(http, "DELETE", gw.url + "/admin/backends/rt0")
        assert status == 200 and gone["removed"], gone


async def series_of(http: aiohttp.ClientSession, gw: GatewayServer, backend: str) -> list[str]:
    """The series on the gateway's ``/metrics`` labelled ``backend=<backend>``."""
    async with http.get(gw.url + "/metrics") as resp:
        assert resp.status == 200, resp.status
        parsed = samples(await resp.text())
    return sorted(name for name, labels in parsed if ("backend", backend) in labels)


async def test_a_removed_backend_leaves_metrics(sim: SimFactory, gateway: GatewayFactory) -> None:
    """Added, used, seen unhealthy, removed by the admin API: none of its series stays on
    /metrics (they did, forever, and an alert on its last health with them)."""
    s0, s1 = await sim(), await sim()
    gw = await gateway([s0], **FAST)
    async with aiohttp.ClientSession() as http:
        assert (await admin(http, "POST", gw.url + "/admin/backends/b0/drain"))[0] == 200
        status, row = await admin(http, "POST", gw.url + "/admin/backends",
                                  {"name": "rt0", "url": s1.url, "model": MODEL})
        assert status == 201, row
        await scraped(gw, "rt0")
        async with AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice",
                               max_retries=0) as oai:
            answer = await oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
        assert answer.usage is not None and answer.usage.completion_tokens == 3, answer
        await s1.stop()  # unhealthy now, as the probe's removed backends were
        handle = gw.services.pool.handles["rt0"]
        await until(lambda: not handle.healthy, "rt0 seen unhealthy")
        before = await series_of(http, gw, "rt0")
        assert "fairgate_backend_healthy" in before and "fairgate_dispatches_total" in before, \
            before

        status, gone = await admin(http, "DELETE", gw.url + "/admin/backends/rt0")
        assert status == 200 and gone["removed"], (status, gone)
        await until(lambda: "rt0" not in gw.services.pool.handles, "rt0 removed")
        after = await series_of(http, gw, "rt0")
        assert after == [], f"{len(after)} series of the removed rt0 left: {after}"
        assert "fairgate_backend_healthy" in await series_of(http, gw, "b0")  # others stay
        await admin(http, "POST", gw.url + "/admin/backends/b0/undrain")


async def test_a_backend_a_reload_removes_leaves_metrics(
        sim: SimFactory, gateway: GatewayFactory, redis_url: str, tmp_path: Path) -> None:
    s0, s1 = await sim(), await sim()
    path = tmp_path / "fairgate.yaml"
    path.write_text(yaml.safe_dump(config(redis_url, [s0, s1])))
    gw = await gateway([s0, s1], **FAST, config_file=path)
    async with aiohttp.ClientSession() as http:
        assert (await admin(http, "POST", gw.url + "/admin/backends/b0/drain"))[0] == 200
        async with AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice",
                               max_retries=0) as oai:
            await oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
        assert "fairgate_dispatches_total" in await series_of(http, gw, "b1")
        path.write_text(yaml.safe_dump(config(redis_url, [s0])))
        status, report = await admin(http, "POST", gw.url + "/admin/reload")
        assert status == 200 and report["backends"]["removed"] == ["b1"], report
        after = await series_of(http, gw, "b1")
        assert after == [], f"{len(after)} series of the removed b1 left: {after}"
        await admin(http, "POST", gw.url + "/admin/backends/b0/undrain")
