"""Admin API on a real gateway: auth, queues, drain, cancel, reload."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.scheduling import dispatcher as dispatcher_module
from gateway.storage.keys import ModelKeys
from loadtest.sim.server import SimServer
from tests.gateway.conftest import KEYS, MODEL, GatewayFactory, SimFactory, complete
from tests.ops.conftest import ADMIN, admin_call, until

ROUTES = [("GET", "/admin/state"), ("GET", "/admin/queues"), ("GET", "/admin/backends"),
          ("GET", "/admin/pools"),
          ("POST", "/admin/backends/b0/drain"), ("POST", "/admin/backends/b0/undrain"),
          ("DELETE", "/admin/requests/0123"), ("POST", "/admin/reload")]


def assert_openai_error(body: Any, type_: str, code: str) -> None:
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert (body["error"]["type"], body["error"]["code"]) == (type_, code), body


async def test_admin_routes_need_an_admin_key(sim: SimFactory,
                                              gateway: GatewayFactory) -> None:
    gw = await gateway([await sim()], admin_keys=[ADMIN])
    async with aiohttp.ClientSession() as http:
        for method, path in ROUTES:
            status, body = await admin_call(http, method, gw.url + path, key=None)
            assert status == 401, (path, body)
            assert_openai_error(body, "invalid_request_error", "invalid_api_key")
            status, body = await admin_call(http, method, gw.url + path, key="sk-wrong")
            assert status == 401, (path, body)
            status, body = await admin_call(http, method, gw.url + path, key="sk-alice")
            assert status == 403, (path, body)
            assert_openai_error(body, "permission_error", "admin_key_required")
        # an admin key is not an API key: it cannot send completions
        async with http.post(gw.url + "/v1/completions", json={"model": MODEL},
                             headers={"Authorization": f"Bearer {ADMIN}"}) as resp:
            assert resp.status == 401
        status, body = await admin_call(http, "GET", gw.url + "/admin/backends")
        assert status == 200
        assert [(b["name"], b["healthy"], b["drained"]) for b in body["data"]] == [
            ("b0", True, False)]
        assert set(body["data"][0]["gates"]) == {"interactive", "default", "batch"}


async def queued_users(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    status, body = await admin_call(http, "GET", url + "/admin/queues")
    assert status == 200, body
    return {u["user"]: u for u in body["data"][MODEL]["interactive"]["users"]}


async def test_drain_sends_new_work_elsewhere_and_in_flight_finishes(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    b0, b1 = await sim(), await sim()
    gw = await gateway([b0, b1], admin_keys=[ADMIN])
    async with aiohttp.ClientSession() as http:
        base = gw.url + "/admin/backends/"
        assert (await admin_call(http, "POST", base + "b1/drain"))[0] == 200
        long = asyncio.create_task(complete(http, gw.url, "sk-alice", 200))
        await b0.engine.wait_until(lambda: len(b0.engine.records) == 1)
        status, body = await admin_call(http, "POST", base + "b0/drain")
        assert status == 200 and body["drained"] is True, (status, body)
        gate = body["gates"]["interactive"]
        assert (gate["open"], gate["limit"], gate["reason"], gate["max_inflight"]) == (
            False, 0, "drained", 0), gate
        assert (await admin_call(http, "POST", base + "b1/undrain"))[0] == 200
        more = [asyncio.create_task(complete(http, gw.url, k, 3))
                for k in ("sk-bob", "sk-carol", "sk-dflt", "sk-bob")]
        await asyncio.gather(*more)
        assert len(b0.engine.records) == 1 and len(b1.engine.records) == 4
        assert not long.done()  # still streaming on the drained backend...
        data = await long
        assert data["usage"]["completion_tokens"] == 200  # ...and finished there
        assert (await admin_call(http, "POST", base + "b1/drain"))[0] == 200
        assert (await admin_call(http, "POST", base + "b0/undrain"))[0] == 200
        await complete(http, gw.url, "sk-bob", 3)
        assert len(b0.engine.records) == 2
        status, body = await admin_call(http, "POST", base + "nope/drain")
        assert status == 404, body


async def alice_completion(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    """A small completion of sk-alice: its status and JSON body."""
    async with http.post(url + "/v1/completions",
                         json={"model": MODEL, "prompt": "hello", "max_tokens": 3},
                         headers={"Authorization": "Bearer sk-alice"}) as resp:
        return resp.status, await resp.json()


async def test_cancel_a_queued_request(sim: SimFactory, gateway: GatewayFactory) -> None:
    backend = await sim()
    gw = await gateway([backend], admin_keys=[ADMIN])
    async with aiohttp.ClientSession() as http:
        assert (await admin_call(http, "POST", gw.url + "/admin/backends/b0/drain"))[0] == 200
        waiting = asyncio.create_task(alice_completion(http, gw.url))
        other = asyncio.create_task(complete(http, gw.url, "sk-bob", 3))

        async def both_queued() -> bool:
            return set(await queued_users(http, gw.url)) == {"alice", "bob"}
        await until(both_queued, what="alice and bob queued")
        request_id = (await queued_users(http, gw.url))["alice"]["oldest_request_id"]

        status, got = await admin_call(http, "DELETE", gw.url + f"/admin/requests/{request_id}")
        assert status == 200, got
        assert (got["id"], got["user"], got["client_notified"]) == (request_id, "alice", True)
        status, answer = await asyncio.wait_for(waiting, 10)
        assert status == 409
        assert_openai_error(answer, "invalid_request_error", "request_cancelled")
        assert set(await queued_users(http, gw.url)) == {"bob"}
        status, got = await admin_call(http, "DELETE", gw.url + f"/admin/requests/{request_id}")
        assert status == 404, got

        # bob's request still runs once the backend is back; a running one is not cancellable
        assert (await admin_call(http, "POST", gw.url + "/admin/backends/b0/undrain"))[0] == 200
        await other
        long = asyncio.create_task(complete(http, gw.url, "sk-carol", 200))
        await backend.engine.wait_until(lambda: len(backend.engine.records) == 2)
        keys = [k async for k in gw.services.store.client.scan_iter(
            ModelKeys(MODEL).request_prefix + "*")]
        assert len(keys) == 1
        running_id = keys[0].rsplit(":", 1)[1]
        status, got = await admin_call(http, "DELETE", gw.url + f"/admin/requests/{running_id}")
        assert status == 409
        assert_openai_error(got, "invalid_request_error", "request_not_queued")
        assert (await long)["usage"]["completion_tokens"] == 200


async def test_a_lost_check_during_an_operator_cancel_still_answers_409(
        sim: SimFactory, gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The waiter checks now and then that its request is still queued; an operator's
    cancel removes it from Redis before telling the waiter. A check in between took the
    absence for a lost request: the client got 503 ``queued_request_lost`` instead of
    the cancel's 409 (seen from the dashboard's cancel on a loaded machine)."""
    monkeypatch.setattr(dispatcher_module, "LOST_CHECK_S", 0.05)
    backend = await sim()
    gw = await gateway([backend], admin_keys=[ADMIN])
    store = gw.services.store
    looked = asyncio.Event()
    real_exists, real_cancel = store.reads.request_exists, store.queue.cancel

    async def exists(model: str, request_id: str) -> bool:
        found = await real_exists(model, request_id)
        if not found:
            looked.set()
        return found

    async def cancel(*args: Any) -> bool:
        done = await real_cancel(*args)
        await asyncio.wait_for(looked.wait(), 30)  # the waiter looked for it meanwhile
        return done

    monkeypatch.setattr(store.reads, "request_exists", exists)
    monkeypatch.setattr(store.queue, "cancel", cancel)
    async with aiohttp.ClientSession() as http:
        assert (await admin_call(http, "POST", gw.url + "/admin/backends/b0/drain"))[0] == 200
        waiting = asyncio.create_task(alice_completion(http, gw.url))

        async def queued() -> bool:
            return set(await queued_users(http, gw.url)) == {"alice"}
        await until(queued, what="alice queued")
        request_id = (await queued_users(http, gw.url))["alice"]["oldest_request_id"]
        status, got = await admin_call(http, "DELETE", gw.url + f"/admin/requests/{request_id}")
        assert status == 200 and got["client_notified"], (status, got)
        status, answer = await asyncio.wait_for(waiting, 30)
        assert status == 409, (status, answer)
        assert_openai_error(answer, "invalid_request_error", "request_cancelled")


def write_config(path: Path, redis_url: str, backends: list[SimServer],
                 keys: list[dict[str, Any]]) -> None:
    path.write_text(yaml.safe_dump({
        "redis_url": redis_url, "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"name": f"b{i}", "url": s.url, "model": MODEL}
                     for i, s in enumerate(backends)],
        "api_keys": keys, "admin_keys": [ADMIN, "sk-admin-2"],
        "scrape_interval_s": 0.02, "replica_heartbeat_s": 0.2,  # as the gateway fixture's
    }))


async def test_reload_rereads_keys_and_backends(
        sim: SimFactory, gateway: GatewayFactory, redis_url: str, tmp_path: Path) -> None:
    backend = await sim()
    path = tmp_path / "fairgate.yaml"
    write_config(path, redis_url, [backend], KEYS)
    gw = await gateway([backend], admin_keys=[ADMIN], config_file=path)
    newcomer = {"key": "sk-new", "user": "newbie", "priority_class": "interactive"}
    without_bob = [k for k in KEYS if k["key"] != "sk-bob"]
    write_config(path, redis_url, [backend], [*without_bob, newcomer])
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/completions", json={"model": MODEL},
                             headers={"Authorization": "Bearer sk-new"}) as resp:
            assert resp.status == 401  # not before the reload
        status, got = await admin_call(http, "POST", gw.url + "/admin/reload")
        assert status == 200, got
        assert got["reloaded"] == ["api_keys", "admin_keys"]
        assert got["restart_required"] == []
        data = await complete(http, gw.url, "sk-new", 2)
        assert data["usage"]["completion_tokens"] == 2
        async with http.post(gw.url + "/v1/completions", json={"model": MODEL},
                             headers={"Authorization": "Bearer sk-bob"}) as resp:
            assert resp.status == 401
        assert (await admin_call(http, "GET", gw.url + "/admin/queues", key="sk-admin-2"))[0] \
            == 200

        # backends of the same model are applied in place: add one, then drop the first
        second = await sim()
        write_config(path, redis_url, [backend, second], [*without_bob, newcomer])
        status, got = await admin_call(http, "POST", gw.url + "/admin/reload")
        assert status == 200 and got["restart_required"] == [], got
        assert got["backends"] == {"added": ["b1"], "removed": [], "changed": []}
        await asyncio.wait_for(gw.services.pool.handles["b1"].scraped.wait(), 10)
        write_config(path, redis_url, [second], [*without_bob, newcomer])
        path.write_text(path.read_text().replace("name: b0", "name: b1"))
        status, got = await admin_call(http, "POST", gw.url + "/admin/reload")
        assert got["backends"]["removed"] == ["b0"], got
        assert list(gw.services.pool.handles) == ["b1"]
        before = len(backend.engine.records)
        await complete(http, gw.url, "sk-new", 3)
        assert len(backend.engine.records) == before  # the removed backend gets nothing
        assert any(r.max_tokens == 3 for r in second.engine.records.values())
        # a broken file changes nothing
        path.write_text("api_keys: [{key: 1}]\n")
        status, got = await admin_call(http, "POST", gw.url + "/admin/reload")
        assert status == 400, got
        await complete(http, gw.url, "sk-new", 2)


async def test_reload_without_a_config_file(sim: SimFactory, gateway: GatewayFactory) -> None:
    gw = await gateway([await sim()], admin_keys=[ADMIN])
    async with aiohttp.ClientSession() as http:
        status, got = await admin_call(http, "POST", gw.url + "/admin/reload")
    assert status == 409
    assert_openai_error(got, "invalid_request_error", "no_config_file")


@pytest.mark.parametrize("path", ["/admin/state", "/admin/queues"])
async def test_state_lists_queues_backends_and_shares(sim: SimFactory, gateway: GatewayFactory,
                                                      path: str) -> None:
    gw = await gateway([await sim()], admin_keys=[ADMIN])
    async with aiohttp.ClientSession() as http:
        await complete(http, gw.url, "sk-alice", 4)
        await complete(http, gw.url, "sk-bob", 2)
        status, got = await admin_call(http, "GET", gw.url + path)
    assert status == 200
    if path == "/admin/queues":
        assert got["data"][MODEL]["interactive"]["depth"] == 0
        return
    model = got["models"][MODEL]
    assert model["backends"][0]["name"] == "b0"
    assert model["backends"][0]["dispatch_rate_per_s"] > 0
    shares = {s["user"]: s["share"] for s in model["service_shares"]}
    assert set(shares) == {"alice", "bob"} and shares["alice"] > shares["bob"]
    assert abs(sum(shares.values()) - 1) < 1e-9
