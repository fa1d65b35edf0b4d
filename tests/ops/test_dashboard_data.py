"""What the dashboard reads beyond one replica's memory: service shares kept in Redis for
every replica (share.lua on a real Redis, two replicas), the history every process adds
to in Redis and its TTFT quantiles, and CSRF on the page's writes (drain, undrain,
cancel)."""

from __future__ import annotations

import math
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from gateway.access.auth import SESSION_COOKIE
from gateway.access.sessions import CSRF_HEADER, csrf_token
from gateway.ops.history import TTFT_RATIO, fine_quantile, ttft_bound, ttft_bucket
from gateway.storage.keys import ModelKeys
from gateway.storage.store import Store
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory, complete
from tests.ops.conftest import ADMIN, admin_call, admin_headers, until

K = ModelKeys("m")


async def test_service_shares_decay_cap_and_expire_in_redis(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    assert await store.shares.service_shares("m") == {}
    await store.shares.add_service("m", {"alice": 30.0, "bob": 10.0}, 1000.0, 60.0, 3, 120)
    assert await store.shares.service_shares("m") == {"alice": 0.75, "bob": 0.25}
    # one half-life later, bob's new 10 weighs twice his old 10: 30 : (10 + 20)
    await store.shares.add_service("m", {"bob": 10.0}, 1060.0, 60.0, 3, 120)
    shares = await store.shares.service_shares("m")
    assert math.isclose(shares["alice"], 0.5) and math.isclose(shares["bob"], 0.5)
    # bounded: past the cap the smallest goes
    await store.shares.add_service("m", {"carol": 100.0, "dave": 200.0}, 1060.0, 60.0, 3, 120)
    assert set(await store.shares.service_shares("m")) == {"dave", "carol", "bob"}
    # 30 half-lives later the scores are rebased (no overflow), the ratios kept
    later = 1060.0 + 30 * 60
    await store.shares.add_service("m", {"erin": 1e-300}, later, 60.0, 10, 120)
    assert float(await redis.get(K.service_epoch)) == later
    top = max(score for _, score in await redis.zrange(K.service, 0, -1, withscores=True))
    assert top < 1.0  # 200 × 2^-30, not 200 × 2^30
    shares = await store.shares.service_shares("m")
    assert list(shares)[:3] == ["dave", "carol", "bob"]
    assert math.isclose(shares["dave"] / shares["carol"], 2.0)
    assert 0 < await redis.ttl(K.service) <= 120 and 0 < await redis.ttl(K.service_epoch) <= 120


def test_fine_quantile_reads_the_bucket_bound_never_above_the_slowest() -> None:
    assert fine_quantile(0.5, {}, None) is None
    ttfts = [0.2, 0.4, 17.8]
    counts: dict[int, float] = {}
    for t in ttfts:
        counts[ttft_bucket(t)] = counts.get(ttft_bucket(t), 0) + 1
    p50 = fine_quantile(0.5, counts, max(ttfts))
    assert p50 is not None and 0.4 <= p50 <= 0.4 * TTFT_RATIO, p50
    # the slowest first token seen bounds p99: 17.8 s, not a coarse bucket's 30 s
    assert fine_quantile(0.99, counts, max(ttfts)) == 17.8


@given(st.lists(st.floats(min_value=0.0, max_value=600.0), min_size=1, max_size=200),
       st.sampled_from([0.5, 0.9, 0.99]))
def test_fine_quantile_is_at_most_five_percent_high(ttfts: list[float], q: float) -> None:
    counts: dict[int, float] = {}
    for t in ttfts:
        counts[ttft_bucket(t)] = counts.get(ttft_bucket(t), 0) + 1
        assert t <= ttft_bound(ttft_bucket(t)) + 1e-12, (t, ttft_bucket(t))
    got = fine_quantile(q, counts, max(ttfts))
    exact = sorted(ttfts)[max(0, math.ceil(q * len(ttfts)) - 1)]  # the sample at rank q·n
    assert got is not None and exact - 1e-9 <= got <= max(exact * TTFT_RATIO, 0.001) + 1e-9, (
        got, exact)


async def test_shares_cover_every_replica_and_history_samples(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    backend = await sim()
    first = await gateway([backend], admin_keys=[ADMIN])
    second = await gateway([backend], admin_keys=[ADMIN])
    async with aiohttp.ClientSession() as http:
        await complete(http, first.url, "sk-alice", 8)
        await complete(http, second.url, "sk-bob", 2)

        async def both_seen() -> bool:  # the other replica's history loop adds within a tick
            _, state = await admin_call(http, "GET", first.url + "/admin/state")
            return len(state["models"][MODEL]["service_shares"]) == 2
        await until(both_seen, what="bob's service, served by the second replica")
        for gw in (first, second):  # each process adds its interval to the shared history
            added = await gw.services.inspector.history.sample()
            assert added["n"] == 1 and f"q:{MODEL}:interactive" in added, added
        views: list[dict[str, object]] = []

        async def one_picture() -> bool:
            """Both replicas show the same samples (read again if an interval ended in
            between)."""
            views.clear()
            for gw in (first, second):
                status, state = await admin_call(http, "GET", gw.url + "/admin/state")
                assert status == 200 and state["csrf_token"] is None  # Bearer: no token
                model = state["models"][MODEL]
                shares = {s["user"]: s["share"] for s in model["service_shares"]}
                assert set(shares) == {"alice", "bob"} and shares["alice"] > shares["bob"]
                assert len(model["replica_service_shares"]) == 1  # its own client only
                views.append(state["history"])
            return views[0] == views[1]
        await until(one_picture, what=f"the same history on both replicas: {views}")
        history: dict[str, Any] = views[0]  # type: ignore[assignment]
        assert history["window_s"] == 900 and history["scope"] == "all workers and replicas"
        samples = history["samples"]
        assert sum(s["processes"] for s in samples) >= 2, samples
        assert all(s["models"][MODEL]["depth"] == {"interactive": 0, "default": 0, "batch": 0}
                   for s in samples if s["models"][MODEL]["depth"] is not None), samples
        # two requests, dispatched by either replica's dispatcher (grants go to the owner)
        dispatched = sum(s["models"][MODEL]["dispatch_rate_per_s"] * s["interval_s"]
                         for s in samples)
        assert math.isclose(dispatched, 2), samples


async def test_page_writes_need_the_sessions_csrf_token(sim: SimFactory,
                                                        gateway: GatewayFactory) -> None:
    gw = await gateway([await sim()], admin_keys=[ADMIN])
    drain = gw.url + "/admin/backends/b0/drain"
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        async with http.post(gw.url + "/dashboard/login", data={"key": ADMIN},
                             allow_redirects=False) as resp:
            token = resp.cookies[SESSION_COOKIE].value
        cookie = {SESSION_COOKIE: token}
        async with http.get(gw.url + "/admin/state", cookies=cookie) as resp:
            assert (await resp.json())["csrf_token"] == csrf_token(token) != token
        for headers in ({}, {CSRF_HEADER: "nope"}, {CSRF_HEADER: csrf_token("other")}):
            async with http.post(drain, cookies=cookie, headers=headers) as resp:
                body = await resp.json()
                assert resp.status == 403 and body["error"]["code"] == "csrf_token_invalid"
            async with http.delete(gw.url + "/admin/requests/x", cookies=cookie,
                                   headers=headers) as resp:
                assert resp.status == 403
        assert not gw.services.pool.handles["b0"].drained
        ok = {CSRF_HEADER: csrf_token(token)}
        async with http.post(drain, cookies=cookie, headers=ok) as resp:
            assert resp.status == 200 and (await resp.json())["drained"] is True
        async with http.post(gw.url + "/admin/backends/b0/undrain", cookies=cookie,
                             headers=ok) as resp:
            assert resp.status == 200 and (await resp.json())["drained"] is False
        async with http.delete(gw.url + "/admin/requests/x", cookies=cookie,
                               headers=ok) as resp:
            assert resp.status == 404  # past the CSRF check
        # reload is not a page action: the key only
        async with http.post(gw.url + "/admin/reload", cookies=cookie, headers=ok) as resp:
            assert resp.status == 401
        # a forged cookie with its matching token is still no session
        forged = {SESSION_COOKIE: "forged"}
        async with http.post(drain, cookies=forged,
                             headers={CSRF_HEADER: csrf_token("forged")}) as resp:
            assert resp.status == 401
        # the Bearer key needs no CSRF token
        async with http.post(gw.url + "/admin/backends/b0/undrain",
                             headers=admin_headers()) as resp:
            assert resp.status == 200
