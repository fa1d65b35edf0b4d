"""``lua/scrapers.lua`` (scrape leases, reading published snapshots) and the snapshot's
publication (``lua/snapshot.lua`` with its shared numbers, ``Store.publish_failure``)
against a real Redis server."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from gateway.storage.keys import ModelKeys
from gateway.storage.records import LeaseWish
from gateway.storage.store import Store
from policies.gates import BackendSnapshot
from tests.store.test_scripts import alive, dispatch, req

M = "m"
K = ModelKeys(M)


async def test_a_lease_is_taken_when_free_renewed_by_its_holder_only_and_given_up(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    wish = {M: [LeaseWish("b1", True), LeaseWish("b2", True)]}
    a = await store.fleet.scrape_leases("A", 5.0, wish)
    b = await store.fleet.scrape_leases("B", 5.0, wish)
    assert [v.held for v in a[M][1].values()] == [True, True], a
    assert [v.held for v in b[M][1].values()] == [False, False], b
    assert await redis.get(K.backend_scraper("b1")) == "A"
    assert 4000 < await redis.pttl(K.backend_scraper("b1")) <= 5000
    await store.fleet.scrape_leases("A", 5.0, {M: [LeaseWish("b1", False)]})  # A gives b1 up
    b = await store.fleet.scrape_leases("B", 5.0, wish)
    assert (b[M][1]["b1"].held, b[M][1]["b2"].held) == (True, False), b
    assert await redis.get(K.backend_scraper("b1")) == "B"


async def test_the_leases_are_shared_by_the_processes_that_tick(
        redis: aioredis.Redis) -> None:
    """A holds both leases; B ticks: A's share is now ceil(2 / 2) = 1, so A gives one
    up at its next tick and B takes it at its own. Once B stops ticking for a lease
    length it no longer counts, and A takes the lease B's expiry freed."""
    store = Store.over(redis, 600)
    wish = {M: [LeaseWish("b1", True), LeaseWish("b2", True)]}

    def held(got: dict) -> list[bool]:  # type: ignore[type-arg]
        return [v.held for v in got[M][1].values()]

    assert held(await store.fleet.scrape_leases("A", 5.0, wish)) == [True, True]
    assert held(await store.fleet.scrape_leases("B", 0.2, wish)) == [False, False]
    a = held(await store.fleet.scrape_leases("A", 5.0, wish))
    assert sorted(a) == [False, True], f"A above its share of 1 still holds {a}"
    b = held(await store.fleet.scrape_leases("B", 0.2, wish))
    assert b == [not x for x in a], f"B took {b} of what A gave up ({a})"
    assert sorted(held(await store.fleet.scrape_leases("A", 5.0, wish))) == [False, True]
    assert await redis.zcard(K.scrapers) == 2
    for _ in range(100):  # B silent: its lease (PX 0.2 s) expires, and a lease length
        a = held(await store.fleet.scrape_leases("A", 0.2, wish))  # after its last tick its entry
        if a == [True, True]:  # leaves the processes counted: bounded wait for both
            break
        await asyncio.sleep(0.01)
    assert a == [True, True], f"A alone again holds {a}"
    assert await redis.zrange(K.scrapers, 0, -1) == ["A"]
    # a process giving every lease up (its shutdown) stops counting at once: B alone
    await store.fleet.scrape_leases("A", 5.0, {M: [LeaseWish("b1", False), LeaseWish("b2", False)]})
    assert await redis.zcard(K.scrapers) == 0
    assert held(await store.fleet.scrape_leases("B", 5.0, wish)) == [True, True]
    assert await redis.zrange(K.scrapers, 0, -1) == ["B"]


async def test_an_expired_lease_goes_to_the_next_taker(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.fleet.scrape_leases("A", 0.05, {M: [LeaseWish("b1", True)]})
    for _ in range(100):  # PX expiry: bounded wait for Redis to drop it
        if not await redis.exists(K.backend_scraper("b1")):
            break
        await asyncio.sleep(0.01)
    got = await store.fleet.scrape_leases("B", 5.0, {M: [LeaseWish("b1", True)]})
    assert got[M][1]["b1"].held, got


async def test_a_published_snapshot_is_read_once_per_version(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    got = await store.fleet.scrape_leases("B", 5.0, {M: [LeaseWish("b1", True)]})
    assert got[M][1]["b1"].published is None  # nothing published yet
    snap = BackendSnapshot(2, 5, 0.5, 0.02, 1000.0)
    stored = await store.fleet.store_snapshot(M, "b1", snap, '{"x":1}')
    assert stored.stored and stored.version == "1", stored
    got = await store.fleet.scrape_leases("B", 5.0, {M: [LeaseWish("b1", True, "")]})
    raw = got[M][1]["b1"].published
    assert raw is not None and raw["shared"] == '{"x":1}' and raw["v"] == "1", raw
    assert raw["failures"] == "0" and float(raw["taken_at"]) == 1000.0, raw
    again = await store.fleet.scrape_leases("B", 5.0, {M: [LeaseWish("b1", True, "1")]})
    assert again[M][1]["b1"].published is None, again  # unchanged since version 1
    assert await store.fleet.publish_failure(M, "b1", 2) == "2"
    failed = await store.fleet.scrape_leases("B", 5.0, {M: [LeaseWish("b1", True, "1")]})
    raw = failed[M][1]["b1"].published
    assert raw is not None and raw["failures"] == "2" and raw["v"] == "2", raw
    newer = await store.fleet.store_snapshot(
        M, "b1", BackendSnapshot(0, 0, 0.0, None, 1001.0), "{}")
    assert newer.version == "3" and await redis.hget(K.backend_snapshot("b1"), "failures") == "0"
    older = await store.fleet.store_snapshot(M, "b1", BackendSnapshot(0, 0, 0.0, None, 999.0), "{}")
    assert not older.stored and older.version == "0", older


async def test_the_tick_reads_queued_in_flight_and_drained(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    for i in range(3):
        await store.queue.enqueue(M, req(f"a{i}", "a"), 10)
    assert await dispatch(store, backend="b1") is not None
    await store.fleet.set_drained(M, "b2", True)
    queued, views = (await store.fleet.scrape_leases("A", 5.0, {
        M: [LeaseWish("b1", True), LeaseWish("b2", True)]}))[M]
    assert queued == 2, queued
    assert (views["b1"].inflight, views["b1"].drained) == (1, False), views
    assert (views["b2"].inflight, views["b2"].drained) == (0, True), views
