"""One scraper per backend across replicas: the scrape lease, the published snapshot, the
staleness rule on a published snapshot, and the idle scrape interval.

Scrapes are counted where they land, at the simulated backend (``SimServer.scrapes``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from gateway.backends.published import Published
from gateway.backends.scrape import BackendPool
from gateway.core.errors import StoreUnavailable
from gateway.http.server import GatewayServer
from gateway.storage.keys import ModelKeys
from gateway.storage.store import Store
from loadtest.sim.engine import EngineConfig
from loadtest.sim.server import SimServer
from policies.classes import CLASS_ORDER
from policies.gates import BackendSnapshot, Gate
from policies.pacing import Pacing
from tests.gateway.conftest import (
    MODEL,
    GatewayFactory,
    SimFactory,
    complete,
    gateway_settings,
    until,
)

K = ModelKeys(MODEL)
OTHER = "mistral"
WINDOW_S = 2.0


async def scrapes_over(backends: list[SimServer], window_s: float) -> tuple[list[int], float]:
    """Each backend's scrapes over a window of about ``window_s`` (the measured length)."""
    before, start = [b.scrapes for b in backends], time.monotonic()
    await asyncio.sleep(window_s)  # a measuring window, not a wait for an event
    return [b.scrapes - n for b, n in zip(backends, before, strict=True)], \
        time.monotonic() - start


def holders(gateways: list[GatewayServer], name: str) -> list[str]:
    return [gw.services.pool.scraper_id for gw in gateways
            if gw.services.pool.handles[name].lease.held]


async def test_three_replicas_scrape_each_backend_once_per_interval_between_them(
        sim: SimFactory, gateway: GatewayFactory, redis: aioredis.Redis) -> None:
    backends = [await sim(profile="instant"), await sim(profile="instant")]
    interval = 0.05
    # idle as fast as busy: the expected rate is one scrape per interval either way
    replicas = [await gateway(backends, scrape_interval_s=interval,
                              idle_scrape_interval_s=interval) for _ in range(3)]
    for name in ("b0", "b1"):
        await until(lambda n=name: len(holders(replicas, n)) == 1, f"one scraper of {name}")
    counts, elapsed = await scrapes_over(backends, WINDOW_S)
    most = 1.2 * elapsed / interval + 2
    print(f"\nscrapes per backend over {elapsed:.2f}s by 3 replicas: {counts} "
          f"(one scraper at {interval}s: {elapsed / interval:.0f}; at most {most:.0f})")
    for name, count in zip(("b0", "b1"), counts, strict=True):
        assert 0 < count <= most, (
            f"{name} was scraped {count} times in {elapsed:.2f}s by 3 replicas: one "
            f"scraper every {interval}s makes at most {most:.0f}")

        async def one_holder_owns_the_lease(n: str = name) -> bool:
            # (on a loaded machine a renewal can come late and the lease move between
            # replicas: then one holds it again, and Redis names that one)
            held = holders(replicas, n)
            return len(held) == 1 and await redis.get(K.backend_scraper(n)) == held[0]
        await until(one_holder_owns_the_lease, f"the lease of {name} named its one holder")
    # every replica dispatches by the same published gates, and reads fresh snapshots
    for name in ("b0", "b1"):
        views = [gw.services.pool.handles[name] for gw in replicas]
        assert all(h.healthy for h in views), [h.failures for h in views]
        ages = [time.time() - h.last.taken_at_s for h in views if h.last is not None]
        stale_s = replicas[0].services.settings.fleet.snapshot_stale_s
        assert len(ages) == 3 and max(ages) < stale_s, (
            f"snapshot ages of {name} per replica: {ages}")
    async with aiohttp.ClientSession() as session:
        for gw in replicas:
            await complete(session, gw.url, "sk-alice", 2)


async def test_the_leases_are_spread_evenly_over_the_replicas(
        sim: SimFactory, gateway: GatewayFactory, redis: aioredis.Redis) -> None:
    """Six backends, three replicas started one after the other: the first takes every
    lease, then each one that joins takes its share, ceil(6 / 3) = 2, from the free ones
    the others give up above theirs; every backend keeps exactly one scraper."""
    backends = [await sim(profile="instant") for _ in range(6)]
    names = [f"b{i}" for i in range(6)]
    replicas = [await gateway(backends, scrape_interval_s=0.05)]
    await until(lambda: all(len(holders(replicas, n)) == 1 for n in names),
                "the first replica holding every lease")

    def held_by(gw: GatewayServer) -> int:
        return sum(h.lease.held for h in gw.services.pool.handles.values())

    assert held_by(replicas[0]) == 6, held_by(replicas[0])
    replicas += [await gateway(backends, scrape_interval_s=0.05) for _ in range(2)]

    seen: list[object] = []

    async def spread() -> bool:
        leases = [await redis.get(K.backend_scraper(n)) for n in names]
        seen[:] = [[held_by(gw) for gw in replicas], leases]
        # (a lease may be free in Redis for a moment while it changes hands, before the
        # giver's handle has its tick's reply: seen in CI; not spread yet)
        return (sorted(held_by(gw) for gw in replicas) == [2, 2, 2]
                and all(len(holders(replicas, n)) == 1 for n in names)
                and None not in leases
                and sorted(leases) == sorted(h for n in names for h in holders(replicas, n)))
    try:
        await until(spread, "two leases held by each of the three replicas")
    except pytest.fail.Exception:
        pytest.fail(f"leases not spread: held per replica, then each backend's lease: {seen}")
    print(f"\nleases per replica: {[held_by(gw) for gw in replicas]}")
    # every replica still reads every backend's fresh snapshot and serves
    now = time.time()
    for gw in replicas:
        for h in gw.services.pool.handles.values():
            assert h.healthy and h.last is not None and (
                now - h.last.taken_at_s < gw.services.settings.fleet.snapshot_stale_s), (
                gw.services.pool.scraper_id, h.name, h.failures, h.last)
    async with aiohttp.ClientSession() as session:
        for gw in replicas:
            await complete(session, gw.url, "sk-alice", 1)


def published(taken_at: float) -> tuple[BackendSnapshot, str]:
    """An idle backend's snapshot with open gates, as a scraper publishes it."""
    snap = BackendSnapshot(0, 0, 0.0, None, taken_at)
    gates = {c: Gate(3, None, 0, 0) for c in CLASS_ORDER}
    shared = Published(gates, {c: Pacing(3.0) for c in CLASS_ORDER}, 0, None, None, {},
                       None, True)
    return snap, shared.encode()


async def test_a_stale_published_snapshot_closes_the_gate_then_the_lease_moves(
        sim: SimFactory, redis: aioredis.Redis, redis_url: str) -> None:
    """A scraper that stops publishing (here: a process that took the lease and vanished):
    the snapshot it left goes stale and closes every reader's gates; its lease runs out
    and a reader takes it over and scrapes."""
    backend = await sim(profile="instant")
    stale_s, ghost_lease_s = 0.3, 3.0
    await redis.set(K.backend_scraper("b0"), "ghost", px=int(ghost_lease_s * 1000))
    gw = GatewayServer(gateway_settings(redis_url, [backend], snapshot_stale_s=stale_s))
    snap, shared = published(time.time())
    await Store.over(redis, 60.0).fleet.store_snapshot(MODEL, "b0", snap, shared)
    await gw.start()
    try:
        pool: BackendPool = gw.services.pool
        handle = pool.handles["b0"]
        await asyncio.wait_for(handle.scraped.wait(), 10)  # the ghost's snapshot, read
        assert not handle.lease.held and backend.scrapes == 0, (handle.lease.held, backend.scrapes)
        assert handle.last == snap, handle.last

        def gates() -> dict[str, Gate]:
            return handle.gates_at(time.time(), stale_s)

        await until(lambda: all(g.reason == "stale" for g in gates().values()),
                    "the published snapshot going stale")
        holder = await redis.get(K.backend_scraper("b0"))
        plan = await gw.services.dispatcher.plan(MODEL, time.time())
        assert holder == "ghost" and plan.open == [], (
            f"stale while {holder!r} holds the lease: gates {gates()}, open {plan.open}")
        assert backend.scrapes == 0, f"scraped {backend.scrapes} times under another's lease"

        lost_at = time.monotonic()
        bound = ghost_lease_s + pool.lease_s + 5.0
        await until(lambda: handle.lease.held, "the lease taken over", timeout_s=bound)
        await until(lambda: backend.scrapes > 0 and all(g.open for g in gates().values()),
                    "the new scraper's snapshot opening the gates", timeout_s=bound)
        print(f"\nlease taken over {time.monotonic() - lost_at:.2f}s after the stale "
              f"snapshot was seen (ghost lease {ghost_lease_s}s, bound {bound}s)")
        assert await redis.get(K.backend_scraper("b0")) == pool.scraper_id
        async with aiohttp.ClientSession() as session:
            await complete(session, gw.url, "sk-alice", 2)
    finally:
        await gw.stop()


async def test_a_failed_scrape_is_published_to_every_replica(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    backend = await sim(profile="instant")
    a, b = await gateway([backend]), await gateway([backend])
    scraper, reader = (a, b) if a.services.pool.handles["b0"].lease.held else (b, a)
    await until(lambda: scraper.services.pool.handles["b0"].lease.held, "a scraper")
    await backend.stop()  # every scrape fails from now on
    handle = reader.services.pool.handles["b0"]
    failures = reader.services.settings.fleet.unhealthy_after_failures
    await until(lambda: not handle.healthy, "the reader marking the backend unhealthy")
    assert handle.failures >= failures and all(
        g.reason == "stale" for g in handle.gates_at(time.time(), 60.0).values()), (
        handle.failures, handle.gates)
    assert not reader.services.pool.any_healthy(MODEL)


async def test_an_idle_backend_is_scraped_slowly_and_fast_again_once_work_comes(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    backend = await sim(max_num_seqs=1)
    fast, idle = 0.02, 0.4
    gw = await gateway([backend], scrape_interval_s=fast, idle_scrape_interval_s=idle)
    handle = gw.services.pool.handles["b0"]
    await until(lambda: not handle.lease.busy, "the backend seen idle")
    (idle_count,), elapsed = await scrapes_over([backend], WINDOW_S)
    most_idle = 1.2 * elapsed / idle + 2
    print(f"\nidle: {idle_count} scrapes in {elapsed:.2f}s (at most {most_idle:.0f})")
    assert idle_count <= most_idle, (
        f"an idle backend was scraped {idle_count} times in {elapsed:.2f}s: the idle "
        f"interval {idle}s allows {most_idle:.0f}")
    async with aiohttp.ClientSession() as session:
        long = asyncio.create_task(complete(session, gw.url, "sk-alice", 2000))
        await until(lambda: handle.lease.busy and backend.engine.num_running == 1,
                    "the backend busy with a long request")
        (busy_count,), busy_s = await scrapes_over([backend], WINDOW_S)
        assert not long.done(), "the long request ended inside the window"
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)
    print(f"busy: {busy_count} scrapes in {busy_s:.2f}s (fast interval {fast}s)")
    assert busy_count > 1.2 * busy_s / idle + 2, (
        f"a busy backend was scraped {busy_count} times in {busy_s:.2f}s: no faster "
        f"than the idle interval {idle}s")


async def test_replicas_with_nothing_queued_make_no_dispatch_call_per_snapshot(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """Every replica adopts every published snapshot. A snapshot used to force a dispatch
    pass on each of them, a Redis call each even with nothing queued: dispatch work grew
    with snapshots × replicas (the fleet bench: 11.5 dispatch calls a request at four
    replicas). A snapshot now wakes a decision only where requests are known to be
    queued; the heartbeat's forced pass stays the safety net."""
    backends = [await sim(profile="instant"), await sim(profile="instant")]
    interval, heartbeat = 0.05, 0.5
    replicas = [await gateway(backends, scrape_interval_s=interval,
                              idle_scrape_interval_s=interval, replica_heartbeat_s=heartbeat)
                for _ in range(3)]
    adopted = [0] * len(replicas)
    calls = [0] * len(replicas)
    for i, gw in enumerate(replicas):
        pool, store = gw.services.pool, gw.services.store
        woken, dispatch_with = pool.snapshots.on_snapshot, store.queue.dispatch_with

        def snapshot(i: int = i, woken: Any = woken) -> None:
            adopted[i] += 1
            woken()

        async def counted(*args: Any, i: int = i, real: Any = dispatch_with,
                          **kwargs: Any) -> Any:
            calls[i] += 1
            return await real(*args, **kwargs)

        pool.snapshots.on_snapshot = snapshot
        store.queue.dispatch_with = counted  # type: ignore[method-assign]
    await asyncio.sleep(WINDOW_S)  # a measuring window, not a wait for an event
    most = WINDOW_S / heartbeat + 2  # the heartbeat's passes
    print(f"\nidle {WINDOW_S}s, 3 replicas: snapshots adopted {adopted}, dispatch calls "
          f"{calls} (at most {most:.0f} each)")
    assert min(adopted) >= 10, f"too few snapshots to tell: {adopted}"
    assert max(calls) <= most, (
        f"idle replicas made {calls} dispatch calls for {adopted} snapshots adopted in "
        f"{WINDOW_S}s: more than the heartbeat's {most:.0f}")
    # and requests through every replica are still served
    async with aiohttp.ClientSession() as session:
        done = await asyncio.wait_for(asyncio.gather(*(
            complete(session, replicas[i % 3].url, f"sk-{user}", 4)
            for i, user in enumerate(("alice", "bob", "alice", "bob") * 3))), 60)
    assert len(done) == 12


async def test_a_wake_up_left_set_after_the_lease_is_gone_does_not_spin_the_event_loop(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """Under load a process gives its lease up (or a Redis outage ends) while a wake-up
    of that backend's scrape loop is set; the loop, no longer scraping, must take the
    wake-up and wait. It used to return from every wait at once without suspending: the
    event loop spun there for good (a whole test run hung on it). A thread clears the
    wake-up after a while so that this test fails instead of hanging."""
    backends = [await sim(profile="instant")]
    replicas = [await gateway(backends) for _ in range(2)]
    await until(lambda: len(holders(replicas, "b0")) == 1, "one scraper of b0")
    other = next(gw for gw in replicas if not gw.services.pool.handles["b0"].lease.held)
    handle = other.services.pool.handles["b0"]
    rescued: list[float] = []

    def rescue() -> None:  # from another thread: what the event loop cannot do itself
        if handle.lease.wake.is_set():
            rescued.append(time.monotonic())
            handle.lease.wake._value = False  # type: ignore[attr-defined]

    watchdog = threading.Timer(5.0, rescue)
    watchdog.start()
    try:
        handle.lease.wake.set()  # as the lease tick leaves it when the lease was just taken
        for _ in range(5):
            await asyncio.sleep(0)
        taken = not handle.lease.wake.is_set()
    finally:
        watchdog.cancel()
    assert not rescued and taken, (
        f"the non-holder's scrape loop did not take its wake-up (spun until a thread "
        f"cleared it: {bool(rescued)})")


async def test_a_backend_serving_short_requests_of_another_replica_is_scraped_fast(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """A steady stream of short requests, queued and dispatched by a replica that does
    not hold the backend's scrape lease: each ends between two ticks of the holder, so
    the holder sees nothing queued, nothing in flight and nothing running, and used to
    scrape the backend at the idle interval while it served (the fleet bench: 2-3 scrapes
    a second under load instead of 10, snapshots up to a second old). The dispatches since
    its latest snapshot, which every replica's dispatches add to, make it busy."""
    backend = await sim(profile="instant")
    fast, idle = 0.05, 0.45
    replicas = [await gateway([backend], scrape_interval_s=fast, idle_scrape_interval_s=idle)
                for _ in range(2)]
    await until(lambda: len(holders(replicas, "b0")) == 1, "one scraper of b0")
    holder = next(gw for gw in replicas if gw.services.pool.handles["b0"].lease.held)
    sender = next(gw for gw in replicas if gw is not holder)
    handle = holder.services.pool.handles["b0"]
    await until(lambda: not handle.lease.busy, "the backend seen idle by its scraper")
    sent: list[asyncio.Task[dict[str, Any]]] = []
    async with aiohttp.ClientSession() as session:
        async def stream() -> None:  # 10 short requests a second through the other replica
            while True:
                sent.append(asyncio.create_task(complete(session, sender.url, "sk-alice", 1)))
                await asyncio.sleep(0.1)

        task = asyncio.create_task(stream())
        await asyncio.sleep(3 * idle)  # the stream under way
        (count,), elapsed = await scrapes_over([backend], WINDOW_S)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.gather(*sent)
    print(f"\nserving: {count} scrapes in {elapsed:.2f}s (fast {fast}s, idle {idle}s)")
    assert count >= 0.5 * elapsed / fast, (
        f"a backend serving 10 requests a second was scraped {count} times in "
        f"{elapsed:.2f}s: at the idle interval ({idle}s), not the fast one ({fast}s)")


async def test_a_model_whose_store_shard_fails_does_not_stop_another_models_snapshots(
        sim: SimFactory, gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind Redis Cluster each model lives on one shard. While one model's shard fails
    over, a replica's lease tick must still read the other models' published snapshots:
    one tick for every model used to fail whole, so on every replica but the scraper the
    healthy shard's snapshots went stale and its gates closed until the other was back."""
    other = SimServer(EngineConfig(model=OTHER, scheduling_policy="priority"))
    await other.start()
    try:
        backends = [await sim(), other]
        replicas = [await gateway(backends, backend_options={"b1": {"model": OTHER}})
                    for _ in range(2)]
        await until(lambda: len(holders(replicas, "b1")) == 1, "one scraper of b1")
        reader = next(gw for gw in replicas if not gw.services.pool.handles["b1"].lease.held)
        scripts = reader.services.store.fleet._scripts
        real = scripts.run

        async def shard_down(name: str, keys: Any, args: Any) -> Any:
            if name == "scrapers" and K.drained in keys:
                raise StoreUnavailable("the shard of the first model fails over")
            return await real(name, keys, args)

        monkeypatch.setattr(scripts, "run", shard_down)
        handle = reader.services.pool.handles["b1"]
        since = time.time()
        taken: list[float | None] = []

        def fresh() -> bool:
            taken.append(None if handle.last is None else handle.last.taken_at_s - since)
            return handle.last is not None and handle.last.taken_at_s > since + 0.5

        try:
            await until(fresh, "the other model's published snapshots still read",
                        timeout_s=10)
        except pytest.fail.Exception:
            pytest.fail("the other model's snapshots were not read while the first's shard "
                        f"failed (the last looks' snapshot times after its start, s: "
                        f"{taken[-5:]})")
    finally:
        await other.stop()
