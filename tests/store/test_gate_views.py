"""A dispatch decision counts what was sent since the snapshot its gates come from, even
when a newer snapshot was stored meanwhile (``gate_counts`` in lua/_lib.lua,
docs/redis-schema.md "In transit")."""

from __future__ import annotations

import redis.asyncio as aioredis

from gateway.storage.dispatch_call import dispatch_args
from gateway.storage.keys import ModelKeys
from gateway.storage.records import Dispatched
from gateway.storage.store import Store
from policies.gates import BackendSnapshot, Gate
from tests.store.test_scripts import alive, req

M = "m"
K = ModelKeys(M)
BURST = Gate(3)  # what a snapshot with an empty queue admits: max_waiting 3


async def decision(store: Store, now: float, seen: float | None, gate: Gate = BURST
                   ) -> Dispatched:
    [done] = await store.queue.dispatch_with(M, [dispatch_args(
        M, "b1", {"default": gate}, "r1", now, 10.0, max_grants=10, seen=seen)])
    return done


async def decide(store: Store, now: float, seen: float | None, gate: Gate = BURST) -> list[str]:
    return [g.request_id for g in (await decision(store, now, seen, gate)).grants]


async def snapshot(store: Store, taken_at: float, waiting: int, running: int) -> None:
    stored = await store.fleet.store_snapshot(M, "b1", BackendSnapshot(waiting, running, 0.1, None,
                                                                 taken_at))
    assert stored.stored, taken_at


async def flood(store: Store, n: int) -> None:
    await alive(store, "r1")
    for i in range(n):
        await store.queue.enqueue(M, req(f"a{i}", "alice"), 100)


async def test_a_decision_by_the_snapshot_before_counts_what_was_sent_since_it(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await flood(store, 12)
    await snapshot(store, 1000.1, waiting=0, running=4)
    first = await decide(store, 1000.2, seen=1000.1)
    assert len(first) == 3, first
    # the scrape began after those three were sent: it shows them waiting
    await snapshot(store, 1000.3, waiting=3, running=4)
    # a process that has not applied that snapshot yet still decides by the first one:
    # its burst was spent by the three (counted since the newer snapshot, it admitted 3
    # more, and vLLM's queue grew to 6 behind a gate of 3)
    again = await decision(store, 1000.35, seen=1000.1)
    assert again.grants == [], f"the first snapshot's burst was spent again: {again.grants}"
    assert not again.stale_view, "refused by its counts, yet reported as a stale view"
    # decided by the stored one, the same gate counts from it (what it shows waiting is
    # in its own limit, which the scraper computes)
    assert len(await decide(store, 1000.36, seen=1000.3, gate=Gate(1))) == 1
    # two snapshots later, gates of the first one match nothing Redis counts: none
    await snapshot(store, 1000.5, waiting=0, running=4)
    stale = await decision(store, 1000.6, seen=1000.1)
    assert stale.grants == [], f"gates two snapshots old admitted {stale.grants}"
    # and the decision says why (fairgate_dispatch_stale_view_total counts it)
    assert stale.stale_view and stale.backend == "b1", stale
    assert len(await decide(store, 1000.6, seen=1000.5)) == 3


async def test_a_grant_decided_before_a_scrape_began_counts_as_sent_after_it(
        redis: aioredis.Redis) -> None:
    """The decision's caller read its clock (now 1000.05) before the scrape began (1000.1),
    but its call reached Redis after that snapshot was stored: so did the request reach
    the backend, after the scrape. It must count as sent since that snapshot."""
    store = Store.over(redis, 600)
    await flood(store, 3)
    await snapshot(store, 1000.1, waiting=0, running=4)
    [granted] = await decide(store, 1000.05, seen=None, gate=Gate(1))
    score = await redis.zscore(K.backend_sent("b1"), granted)
    assert score is not None and score > 1000.1, f"sent at {score}, before the snapshot"
    assert await decide(store, 1000.2, seen=1000.1, gate=Gate(1)) == []
