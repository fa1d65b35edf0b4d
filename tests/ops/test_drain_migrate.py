"""Drain with migrate through the admin API, in one gateway process: the options are
validated (OpenAI-style 400s), the migrate time is stored beside the drain flag and shown
in the backend's state, a drain without migrate keeps today's behaviour (running answers
run to their end where they are), and an undrain cancels a pending migrate."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from gateway.core.errors import BadRequest
from gateway.http.admin.ops import MAX_GRACE_S, drain_grace_s
from gateway.http.server import GatewayServer
from gateway.scheduling.migrate import Migrations
from tests.chaos.test_continuation import CUT_AFTER, MAX_TOKENS, reference, sdk_args
from tests.conftest import OpenAIClients
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory
from tests.ops.conftest import ADMIN, admin_headers

FAR_S = 10 * MAX_GRACE_S  # a turn of the migrate loop long after any grace


async def post(http: aiohttp.ClientSession, url: str, body: Any = None) -> tuple[int, Any]:
    kwargs: dict[str, Any] = {} if body is None else {"json": body}
    async with http.post(url, headers=admin_headers(), **kwargs) as resp:
        return resp.status, await resp.json()


async def backend_row(http: aiohttp.ClientSession, gw: GatewayServer, name: str
                      ) -> dict[str, Any]:
    async with http.get(gw.url + "/admin/backends", headers=admin_headers()) as resp:
        rows = (await resp.json())["data"]
    return next(b for b in rows if b["name"] == name)


@pytest.mark.parametrize(("body", "param"), [
    ({"migrate": "yes"}, "migrate"), ({"migrate": 1}, "migrate"),
    ({"grace_s": 5}, "grace_s"), ({"migrate": True, "grace_s": -1}, "grace_s"),
    ({"migrate": True, "grace_s": MAX_GRACE_S + 1}, "grace_s"),
    ({"migrate": True, "grace_s": "30"}, "grace_s"), ({"migrate": True, "grace_s": True},
                                                      "grace_s"),
    ({"migrate": True, "grace_s": float("inf")}, "grace_s"), ({"grace": 5}, "grace"),
])
def test_drain_options_are_checked(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        drain_grace_s(body)
    assert caught.value.param == param, (body, caught.value.message)


def test_drain_options() -> None:
    assert drain_grace_s({}) is None and drain_grace_s({"migrate": False}) is None
    assert drain_grace_s({"migrate": True}) == 0.0
    assert drain_grace_s({"migrate": True, "grace_s": 12}) == 12.0
    assert drain_grace_s({"migrate": True, "grace_s": MAX_GRACE_S}) == MAX_GRACE_S


async def test_the_admin_drain_stores_and_clears_the_migrate_time(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    gw = await gateway([await sim(), await sim()], admin_keys=[ADMIN])
    drain = gw.url + "/admin/backends/b0/drain"
    async with aiohttp.ClientSession() as http:
        for body in ({"migrate": "yes"}, [1], {"migrate": True, "grace_s": -1}):
            status, answer = await post(http, drain, body)
            assert status == 400 and answer["error"]["type"] == "invalid_request_error", (
                body, status, answer)
        row = await backend_row(http, gw, "b0")
        assert not row["drained"] and row["migrate_at"] is None, row  # nothing changed
        status, answer = await post(http, drain)  # no body: today's drain
        assert status == 200 and answer["drained"] and answer["migrate_at"] is None, answer
        before = time.time()
        status, answer = await post(http, drain, {"migrate": True, "grace_s": 30})
        after = time.time()
        assert status == 200 and answer["running"] == 0, answer
        assert before + 30 <= answer["migrate_at"] <= after + 30, (before, answer)
        assert (await backend_row(http, gw, "b0"))["migrate_at"] == answer["migrate_at"]
        assert await gw.services.store.fleet.migrate_times(MODEL) == {"b0": answer["migrate_at"]}
        status, answer = await post(http, drain)  # drained again without migrate
        assert answer["migrate_at"] is None and answer["drained"], answer
        await post(http, drain, {"migrate": True})
        status, answer = await post(http, gw.url + "/admin/backends/b0/undrain")
        assert status == 200 and not answer["drained"] and answer["migrate_at"] is None
    assert await gw.services.store.fleet.migrate_times(MODEL) == {}


async def running_stream(oai: AsyncOpenAI, i: int) -> tuple[Any, list[str]]:
    """A chat stream through the SDK, read up to ``CUT_AFTER`` content chunks."""
    stream: Any = await oai.chat.completions.create(
        **sdk_args(True, i), stream=True, stream_options={"include_usage": True})
    got: list[str] = []
    async for chunk in stream:
        got += [c.delta.content or "" for c in chunk.choices]
        if len(got) >= CUT_AFTER:
            return stream, got
    raise AssertionError(f"the stream ended after {len(got)} chunks")


async def rest(stream: Any, got: list[str]) -> tuple[str, Any]:
    usage = None
    async for chunk in stream:
        got += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    return "".join(got), usage


async def test_without_migrate_or_after_an_undrain_nothing_moves(
        sim: SimFactory, gateway: GatewayFactory, openai_clients: OpenAIClients) -> None:
    sims = [await sim(), await sim()]
    gw = await gateway(sims, admin_keys=[ADMIN])
    oai = openai_clients(gw.url, "sk-alice")
    svc = gw.services
    migrations = Migrations(svc.store.fleet, svc.pool, svc.running)
    m = svc.metrics
    async with aiohttp.ClientSession() as http:
        # a drain without migrate: the stream runs to its end where it is
        want = await reference(sims[0].url, True, 5)
        stream, got = await running_stream(oai, 5)
        [entry] = svc.running.entries()
        drain = f"{gw.url}/admin/backends/{entry.backend}/drain"
        assert (await post(http, drain))[0] == 200
        assert await migrations.turn(time.time() + FAR_S) == 0
        text, usage = await rest(stream, got)
        assert text == want and usage.completion_tokens == MAX_TOKENS, (text, usage)
        assert m.moves.continuations.labels("drain", "continued")._value.get() == 0
        await post(http, f"{gw.url}/admin/backends/{entry.backend}/undrain")

        # a migrate cancelled by an undrain: nothing moves, even long after its time
        want = await reference(sims[0].url, True, 6)
        stream, got = await running_stream(oai, 6)
        [entry] = svc.running.entries()
        drain = f"{gw.url}/admin/backends/{entry.backend}/drain"
        assert (await post(http, drain, {"migrate": True, "grace_s": MAX_GRACE_S}))[0] == 200
        assert (await post(http, drain.replace("/drain", "/undrain")))[0] == 200
        assert await migrations.turn(time.time() + FAR_S) == 0
        # … while a pending one moves it once its time came (the control)
        assert (await post(http, drain, {"migrate": True, "grace_s": MAX_GRACE_S}))[0] == 200
        assert await migrations.turn(time.time()) == 0  # not yet
        assert await migrations.turn(time.time() + FAR_S) == 1
        text, usage = await rest(stream, got)
        assert text == want and usage.completion_tokens == MAX_TOKENS, (text, usage)
    assert m.moves.continuations.labels("drain", "continued")._value.get() == 1
    assert m.moves.continuations.labels("failover", "continued")._value.get() == 0


@pytest.mark.parametrize("read", ["scrape_lease", "store_snapshot"])
async def test_a_drain_is_not_undone_by_a_redis_answer_read_before_it(
        sim: SimFactory, gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch,
        read: str) -> None:
    """The lease tick and the scrape both read the drain flag from Redis. An answer read
    before this process's own drain (or undrain) and taken after it must not undo it:
    that stale read left a re-drained backend undrained here, so its migrate never ran."""
    gw = await gateway([await sim()])
    pool, store = gw.services.pool, gw.services.store.fleet
    handle = pool.handles["b0"]
    answered, go_on = asyncio.Event(), asyncio.Event()
    real = getattr(store, read)

    async def read_then_wait(*args: Any, **kwargs: Any) -> Any:
        found = await real(*args, **kwargs)
        if not answered.is_set():  # the first answer only: others pass
            answered.set()
            await go_on.wait()
        return found

    monkeypatch.setattr(store, read, read_then_wait)
    call = pool.tick() if read == "scrape_lease" else pool.scrape_once(handle)
    task = asyncio.create_task(call)
    await answered.wait()  # Redis answered "not drained" …
    await store.set_drained(MODEL, "b0", True)  # … then the admin drain, as ops.py does
    pool.set_drained(handle, True)
    go_on.set()
    await task
    assert handle.drained, f"the {read} answer read before the drain undid it"
    # a later read (another process's undrain, say) is taken as before
    monkeypatch.setattr(store, read, real)
    await store.set_drained(MODEL, "b0", False)
    await (pool.tick() if read == "scrape_lease" else pool.scrape_once(handle))
    assert not handle.drained, f"a {read} answer after an undrain elsewhere was not taken"
