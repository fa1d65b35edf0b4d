"""``gateway.scheduling.dispatcher.Dispatcher``'s decisions on a real Redis, backends set by hand.

No scraping and no dispatch loop: each test sets the backend handles' snapshots and
gates itself, queues requests through :meth:`Dispatcher.acquire` and calls
:meth:`Dispatcher.dispatch_once`. Waits are on events and futures, never on the clock.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from gateway.backends.scrape import BackendPool
from gateway.core.errors import (
    QueueTimeout,
    RateLimited,
    RequestCancelled,
    StoreUnavailable,
)
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import Settings, SettingsHolder, load_settings
from gateway.scheduling.dispatcher import Dispatcher
from gateway.scheduling.settles import Settle
from gateway.services import build_dispatcher, build_pool
from gateway.storage.keys import ModelKeys
from gateway.storage.queue_store import QueueStore
from gateway.storage.records import Grant, QueuedRequest
from gateway.storage.redis_client import connect
from gateway.storage.store import Store
from policies.classes import CLASS_ORDER
from policies.gates import BackendSnapshot, evaluate_gate
from tests.gateway.conftest import KEYS, MODEL, dead_redis_url

REPLICA = "replica-test"
K = ModelKeys(MODEL)
ENQUEUE_WAIT_S = 10.0  # bound on one Redis round trip, never reached when things work


@dataclass
class Pending:
    """A request queued through ``acquire``; its grant arrives on ``future``."""

    request_id: str
    task: asyncio.Task[Grant]
    future: asyncio.Future[Grant]

    @property
    def delivered(self) -> bool:
        """The dispatcher handed it a grant (or failed it): decided synchronously."""
        return self.future.done()

    async def grant(self) -> Grant:
        assert self.delivered, f"no grant was delivered to {self.request_id}"
        return await asyncio.wait_for(self.task, ENQUEUE_WAIT_S)


@dataclass
class Rig:
    settings: Settings
    store: Store
    pool: BackendPool
    metrics: GatewayMetrics
    dispatcher: Dispatcher
    woken: asyncio.Event  # set when the dispatcher is told of new queued work
    pending: list[Pending] = field(default_factory=list)

    async def close(self) -> None:
        """Drop the acquires still waiting (they leave the queue), close the client."""
        for p in self.pending:
            p.task.cancel()
        await asyncio.gather(*(p.task for p in self.pending), return_exceptions=True)
        await self.store.client.aclose()


def make_rig(redis_url: str, session: aiohttp.ClientSession, **overrides: object) -> Rig:
    settings = load_settings(None, **{
        "redis_url": redis_url,
        "backends": [{"name": f"b{i}", "url": f"http://127.0.0.1:9/b{i}", "model": MODEL}
                     for i in range(2)],
        "api_keys": KEYS,
        "snapshot_stale_s": 3600.0,  # hand-made snapshots never go stale mid-test
        **overrides})
    store = Store.over(connect(redis_url), request_ttl_s=600)
    metrics = GatewayMetrics()
    holder = SettingsHolder(settings)
    pool = build_pool(holder, session, store.fleet, metrics)  # the session is never used
    dispatcher = build_dispatcher(holder, store, pool, metrics, REPLICA)
    woken = asyncio.Event()
    wake = dispatcher.signals.wake

    def hooked_wake() -> None:  # acquire() wakes the dispatcher once its enqueue is done
        wake()
        woken.set()

    dispatcher.signals.wake = hooked_wake  # type: ignore[method-assign]
    return Rig(settings, store, pool, metrics, dispatcher, woken)


@pytest.fixture
async def rig(redis: aioredis.Redis, redis_url: str) -> AsyncIterator[Rig]:
    async with aiohttp.ClientSession() as session:
        made = make_rig(redis_url, session)
        # dispatch drops requests of replicas without a heartbeat: this one has one
        await made.store.replicas.heartbeat([MODEL], REPLICA, time.time())
        try:
            yield made
        finally:
            await made.close()


async def set_backend(rig: Rig, name: str, waiting: int, running: int) -> None:
    """What a fresh scrape of ``name`` leaves behind, minus the HTTP: the snapshot in
    Redis (which forgets the dispatches it reflects) and on the handle, with its gates.
    ``handle.drained`` is left as the test set it."""
    handle = rig.pool.handles[name]
    snap = BackendSnapshot(waiting, running, 0.2, 0.02, time.time())
    stored, _, _, _ = await rig.store.fleet.store_snapshot(MODEL, name, snap)
    assert stored
    handle.healthy, handle.last, handle.sent_since_snapshot = True, snap, 0
    handle.gates = {c: evaluate_gate(snap, rig.pool.gate_policies[c], snap.taken_at_s,
                                     math.inf) for c in CLASS_ORDER}


async def queue(rig: Rig, request_id: str, user: str = "alice", klass: str = "interactive",
                timeout_s: float = 120.0) -> Pending:
    """Start an acquire and return once its request is queued in Redis."""
    rig.woken.clear()
    req = QueuedRequest(request_id, user, klass, REPLICA, 1.0, time.time())
    task = asyncio.create_task(rig.dispatcher.acquire(MODEL, req, timeout_s))
    woken = asyncio.create_task(rig.woken.wait())
    await asyncio.wait({task, woken}, timeout=ENQUEUE_WAIT_S,
                       return_when=asyncio.FIRST_COMPLETED)
    woken.cancel()
    if task.done():
        task.result()  # raises what acquire raised (no task is left behind then)
    assert rig.woken.is_set(), f"{request_id} was not queued within {ENQUEUE_WAIT_S}s"
    pending = Pending(request_id, task, rig.dispatcher.waiters[request_id].future)
    rig.pending.append(pending)
    return pending


def dispatches(rig: Rig, backend: str, klass: str = "interactive") -> float:
    value = rig.metrics.registry.get_sample_value(
        "fairgate_dispatches_total",
        {"model": MODEL, "backend": backend, "priority_class": klass})
    return value or 0.0


# --------------------------------------------------------------------------- backend choice


async def test_dispatch_picks_the_least_loaded_open_backend(rig: Rig) -> None:
    await set_backend(rig, "b0", waiting=1, running=6)
    await set_backend(rig, "b1", waiting=0, running=2)
    pending = await queue(rig, "r1")
    assert not pending.delivered
    assert await rig.dispatcher.dispatch_once(MODEL) is False
    grant = await pending.grant()
    assert (grant.request_id, grant.backend, grant.user, grant.klass, grant.rank,
            grant.owner) == ("r1", "b1", "alice", "interactive", 0, REPLICA)
    assert await rig.store.replicas.dispatched(MODEL, "r1") == grant  # Redis agrees
    assert rig.pool.handles["b1"].sent_since_snapshot == 1
    assert rig.pool.handles["b0"].sent_since_snapshot == 0
    assert (dispatches(rig, "b0"), dispatches(rig, "b1")) == (0.0, 1.0)
    assert rig.dispatcher.waiters == {}


async def test_equal_load_breaks_ties_by_name(rig: Rig) -> None:
    await set_backend(rig, "b0", waiting=0, running=3)
    await set_backend(rig, "b1", waiting=1, running=2)
    pending = await queue(rig, "r1")
    await rig.dispatcher.dispatch_once(MODEL)
    assert (await pending.grant()).backend == "b0"


async def test_a_full_gate_passes_the_rest_to_the_next_backend(rig: Rig) -> None:
    # b1 is the least loaded but has room for one more waiting request only
    await set_backend(rig, "b1", waiting=2, running=0)
    await set_backend(rig, "b0", waiting=0, running=9)
    first = await queue(rig, "r1", user="alice")
    second = await queue(rig, "r2", user="bob")
    assert await rig.dispatcher.dispatch_once(MODEL) is False
    grants = {g.request_id: g for g in (await first.grant(), await second.grant())}
    assert sorted(g.backend for g in grants.values()) == ["b0", "b1"]
    assert await rig.store.reads.depths(MODEL) == {"interactive": 0, "default": 0, "batch": 0}


async def test_a_pass_over_many_open_backends_is_one_call(
        redis: aioredis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet's pass costs one Redis call, not one per open backend: at 32 backends and
    a backlog, a pass of one call per backend (until nothing was queued) made the
    dispatch work grow with snapshots × backends × replicas (the fleet bench)."""
    async with aiohttp.ClientSession() as session:
        rig = make_rig(redis_url, session, backends=[
            {"name": f"b{i}", "url": f"http://127.0.0.1:9/b{i}", "model": MODEL}
            for i in range(6)])
        await rig.store.replicas.heartbeat([MODEL], REPLICA, time.time())
        try:
            for i in range(6):  # each has room for one request in transit; b5 the least loaded
                await set_backend(rig, f"b{i}", waiting=2, running=10 - i)
            pending = [await queue(rig, f"r{i}", user=f"u{i}") for i in range(4)]
            calls = Calls(rig.store.queue, monkeypatch, "dispatch_with")
            assert await rig.dispatcher.dispatch_once(MODEL) is False
            backends = [(await p.grant()).backend for p in pending]
            assert calls.counts == {"dispatch_with": 1}, (
                f"a pass over 6 open backends for 4 requests made {calls.counts} calls")
            # one each, least loaded first, and the two backends after the queue emptied
            # were not tried
            assert sorted(backends) == ["b2", "b3", "b4", "b5"], backends
            assert rig.dispatcher.planner.queued[MODEL] == 0
            assert (dispatches(rig, "b0"), dispatches(rig, "b1")) == (0.0, 0.0)
        finally:
            await rig.close()


async def test_a_closed_gate_dispatches_nothing(rig: Rig) -> None:
    max_waiting = rig.settings.classes["interactive"].max_waiting
    await set_backend(rig, "b0", waiting=max_waiting, running=1)
    await set_backend(rig, "b1", waiting=max_waiting + 2, running=0)
    pending = await queue(rig, "r1")
    assert await rig.dispatcher.dispatch_once(MODEL) is False
    assert not pending.delivered
    assert (await rig.store.reads.depths(MODEL))["interactive"] == 1
    assert (await rig.store.reads.request_fields(MODEL, "r1"))["state"] == "queued"
    assert rig.dispatcher.waiters.keys() == {"r1"}
    # the gate opens (a new snapshot): the same request goes out
    await set_backend(rig, "b1", waiting=max_waiting - 1, running=0)
    await rig.dispatcher.dispatch_once(MODEL)
    assert (await pending.grant()).backend == "b1"


async def test_unhealthy_or_stale_backends_get_nothing(rig: Rig) -> None:
    await set_backend(rig, "b0", waiting=0, running=0)
    await set_backend(rig, "b1", waiting=0, running=0)
    rig.pool.handles["b0"].healthy = False
    old = rig.pool.handles["b1"].last
    assert old is not None
    stale_s = rig.settings.fleet.snapshot_stale_s
    rig.pool.handles["b1"].last = BackendSnapshot(0, 0, 0.0, None, time.time() - 2 * stale_s)
    pending = await queue(rig, "r1")
    await rig.dispatcher.dispatch_once(MODEL)
    assert not pending.delivered
    rig.pool.handles["b1"].last = old
    await rig.dispatcher.dispatch_once(MODEL)
    assert (await pending.grant()).backend == "b1"


async def test_gates_two_snapshots_old_admit_nothing_and_are_counted(rig: Rig) -> None:
    """A process whose gates come from a snapshot older than the one before the stored
    one (it fell behind its backend's scrapes) admits nothing there, and
    ``fairgate_dispatch_stale_view_total`` says so; its next snapshot dispatches."""
    await set_backend(rig, "b0", waiting=0, running=0)
    rig.pool.handles["b1"].healthy = False
    handle = rig.pool.handles["b0"]
    assert handle.last is not None
    handle.gates_seen = handle.last.taken_at_s
    for later in (1.0, 2.0):  # another process's scrapes, not applied here
        stored, _, _, _ = await rig.store.fleet.store_snapshot(MODEL, "b0", BackendSnapshot(
            0, 0, 0.2, 0.02, handle.last.taken_at_s + later))
        assert stored
    pending = await queue(rig, "r1")
    await rig.dispatcher.dispatch_once(MODEL)
    assert not pending.delivered
    counted = rig.metrics.registry.get_sample_value(
        "fairgate_dispatch_stale_view_total", {"model": MODEL, "backend": "b0"})
    assert counted is not None and counted >= 1, counted
    handle.gates_seen = handle.last.taken_at_s + 2.0  # it applied the stored snapshot
    await rig.dispatcher.dispatch_once(MODEL)
    assert (await pending.grant()).backend == "b0"
    assert rig.metrics.registry.get_sample_value(
        "fairgate_dispatch_stale_view_total", {"model": MODEL, "backend": "b0"}) == counted


async def test_a_drained_handle_gets_nothing(rig: Rig) -> None:
    await set_backend(rig, "b0", waiting=0, running=0)  # the least loaded, but drained
    await set_backend(rig, "b1", waiting=0, running=5)
    rig.pool.set_drained(rig.pool.handles["b0"], True)
    pending = await queue(rig, "r1")
    await rig.dispatcher.dispatch_once(MODEL)
    assert (await pending.grant()).backend == "b1"
    # drained everywhere: nothing goes out at all
    rig.pool.set_drained(rig.pool.handles["b1"], True)
    waiting = await queue(rig, "r2")
    await rig.dispatcher.dispatch_once(MODEL)
    assert not waiting.delivered
    assert (await rig.store.reads.depths(MODEL))["interactive"] == 1


async def test_drained_in_redis_wins_over_the_handle(rig: Rig) -> None:
    """Another replica drained b0: this replica's handle does not know yet, the script
    does (the drained set in Redis)."""
    await set_backend(rig, "b0", waiting=0, running=0)
    await set_backend(rig, "b1", waiting=0, running=5)
    await rig.store.fleet.set_drained(MODEL, "b0", True)
    pending = await queue(rig, "r1")
    await rig.dispatcher.dispatch_once(MODEL)
    assert (await pending.grant()).backend == "b1"


# --------------------------------------------------------------------------- grants


async def test_grants_follow_fairness_and_reach_each_waiter(rig: Rig) -> None:
    await set_backend(rig, "b0", waiting=2, running=0)  # room for one at a time
    alice = [await queue(rig, f"a{i}", user="alice") for i in range(2)]
    bob = await queue(rig, "b0-req", user="bob")
    await rig.dispatcher.dispatch_once(MODEL)
    assert alice[0].delivered and not alice[1].delivered and not bob.delivered
    await set_backend(rig, "b0", waiting=2, running=1)  # the next snapshot: room for one again
    await rig.dispatcher.dispatch_once(MODEL)
    # alice was charged for her first request: bob goes before her second
    assert bob.delivered and not alice[1].delivered
    assert (await bob.grant()).request_id == "b0-req"
    await set_backend(rig, "b0", waiting=2, running=2)
    await rig.dispatcher.dispatch_once(MODEL)
    assert (await alice[1].grant()).rank == 1  # alice's second in flight: rank 1


async def test_a_grant_for_another_replica_goes_to_its_grant_list(
        rig: Rig, redis: aioredis.Redis) -> None:
    other = "replica-other"
    await rig.store.replicas.heartbeat([MODEL], other, time.time())
    await rig.store.queue.enqueue(MODEL, QueuedRequest("theirs", "carol", "interactive", other,
                                                 1.0, time.time()), 10)
    await set_backend(rig, "b0", waiting=0, running=0)
    await rig.dispatcher.dispatch_once(MODEL)
    assert rig.dispatcher.waiters == {}
    assert await redis.llen(K.grants(other)) == 1
    assert await rig.store.replicas.next_order(MODEL, other, 1.0) == ("theirs", "b0", 0, 0)
    assert await redis.llen(K.grants(REPLICA)) == 0


# --------------------------------------------------------------------------- cancel


async def test_cancel_fails_a_waiting_acquire_with_the_error(rig: Rig) -> None:
    pending = await queue(rig, "r1")
    error = RequestCancelled("an operator cancelled it")
    assert rig.dispatcher.cancel("r1", error) is True
    with pytest.raises(RequestCancelled) as raised:
        await pending.task
    assert raised.value is error
    assert rig.dispatcher.waiters == {}
    assert rig.dispatcher.cancel("r1", error) is False  # told once


async def test_cancel_of_an_unknown_or_granted_request_is_false(rig: Rig) -> None:
    assert rig.dispatcher.cancel("nobody", RequestCancelled("x")) is False
    await set_backend(rig, "b0", waiting=0, running=0)
    pending = await queue(rig, "r1")
    await rig.dispatcher.dispatch_once(MODEL)
    await pending.grant()
    assert rig.dispatcher.cancel("r1", RequestCancelled("x")) is False
    assert (await pending.task).request_id == "r1"


# --------------------------------------------------------------------------- leaving


async def test_a_cancelled_acquire_leaves_the_queue(rig: Rig) -> None:
    pending = await queue(rig, "r1")
    pending.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending.task
    assert await rig.store.reads.depths(MODEL) == {"interactive": 0, "default": 0, "batch": 0}
    assert await rig.store.reads.request_fields(MODEL, "r1") == {}
    assert rig.dispatcher.waiters == {}


async def test_queue_timeout_leaves_the_queue(rig: Rig) -> None:
    pending = await queue(rig, "r1", timeout_s=0.05)
    with pytest.raises(QueueTimeout):
        await pending.task
    assert await rig.store.reads.depths(MODEL) == {"interactive": 0, "default": 0, "batch": 0}
    assert await rig.store.reads.request_fields(MODEL, "r1") == {}
    assert rig.dispatcher.waiters == {}


async def test_per_user_queue_cap(redis: aioredis.Redis, redis_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        capped = make_rig(redis_url, session, max_queued_per_user=1)
        try:
            await queue(capped, "r1", user="alice")
            with pytest.raises(RateLimited) as raised:
                await queue(capped, "r2", user="alice")
            # its Retry-After is the wait estimator's, given by admission (not a setting here)
            assert raised.value.retry_after_s is None, raised.value.retry_after_s
            assert capped.dispatcher.waiters.keys() == {"r1"}
            await queue(capped, "r3", user="bob")  # the cap is per user
        finally:
            await capped.close()


# --------------------------------------------------------------------------- Redis down


async def test_release_while_redis_is_down_defers_the_settle(rig: Rig) -> None:
    await set_backend(rig, "b0", waiting=0, running=0)
    pending = await queue(rig, "r1")
    await rig.dispatcher.dispatch_once(MODEL)
    grant = await pending.grant()
    settles, planner = rig.dispatcher.settles, rig.dispatcher.planner
    live = settles.store
    dead = Store.over(connect(dead_redis_url()), request_ttl_s=600)
    # the release and its decision find Redis down
    settles.store, planner.reads = dead, dead.reads
    try:
        await rig.dispatcher.release(MODEL, grant, 5.0)  # must not raise
    finally:
        settles.store, planner.reads = live, live.reads
        await dead.client.aclose()
    # nothing was settled, and the dispatcher still knows it owes the settle
    assert await live.reads.user_inflight(MODEL) == {"alice": 1}
    assert (await live.reads.request_fields(MODEL, "r1"))["state"] == "dispatched"
    assert list(rig.dispatcher.settles.unsettled) == [Settle(MODEL, grant, 5.0, None, None)]
    # Redis is back: the heartbeat's retry settles it, charge included
    await rig.dispatcher.settles.settle_deferred()
    assert await live.reads.user_inflight(MODEL) == {}
    assert await live.reads.request_fields(MODEL, "r1") == {}
    saved = await live.client.hget(K.saved("interactive"), "alice")
    assert float(saved) == pytest.approx(1.0 + 5.0)  # dispatch cost + settle charge
    assert not rig.dispatcher.settles.unsettled


async def test_a_dispatcher_on_a_dead_redis(rig: Rig) -> None:
    """Every call fails fast with StoreUnavailable or is deferred; none hangs or leaks."""
    dead = Store.over(connect(dead_redis_url()), request_ttl_s=600)
    dispatcher = build_dispatcher(rig.pool.holder, dead, rig.pool, rig.metrics, REPLICA)
    try:
        req = QueuedRequest("r1", "alice", "interactive", REPLICA, 1.0, time.time())
        with pytest.raises(StoreUnavailable):
            await dispatcher.acquire(MODEL, req, 60.0)
        assert dispatcher.waiters == {}
        grant = Grant("r2", "interactive", "alice", 0, REPLICA, "b0", time.time())
        await dispatcher.release(MODEL, grant, 1.0)
        await dispatcher.release(MODEL, grant, 1.0)
        assert len(dispatcher.settles.unsettled) == 2
        await dispatcher.started(MODEL, grant)  # swallowed: only a gate slot at stake
        await set_backend(rig, "b0", waiting=0, running=0)
        with pytest.raises(StoreUnavailable):
            await dispatcher.dispatch_once(MODEL)
    finally:
        await dead.client.aclose()


class Calls:
    """Counts the store's calls by verb."""

    def __init__(self, store: QueueStore, monkeypatch: pytest.MonkeyPatch, *verbs: str) -> None:
        self.counts = dict.fromkeys(verbs, 0)
        for verb in verbs:
            real = getattr(store, verb)

            async def counted(*args: Any, _verb: str = verb, _real: Any = real,
                              **kwargs: Any) -> Any:
                self.counts[_verb] += 1
                return await _real(*args, **kwargs)

            monkeypatch.setattr(store, verb, counted)


async def test_a_ticks_requests_are_queued_and_dispatched_in_one_call(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    await set_backend(rig, "b0", waiting=0, running=0)  # room for three in transit
    rig.dispatcher.signals.beating.set()  # as the heartbeat loop does: the replica is alive
    calls = Calls(rig.store.queue, monkeypatch, "enqueue_many", "dispatch_with")
    acquires = [asyncio.create_task(rig.dispatcher.acquire(
        MODEL, QueuedRequest(f"r{i}", user, "interactive", REPLICA, 1.0, time.time()), 120.0))
        for i, user in enumerate(("alice", "bob", "carol"))]  # admitted in one loop turn
    grants = await asyncio.wait_for(asyncio.gather(*acquires), ENQUEUE_WAIT_S)
    assert [(g.request_id, g.backend) for g in grants] == [
        ("r0", "b0"), ("r1", "b0"), ("r2", "b0")], grants
    assert calls.counts == {"enqueue_many": 1, "dispatch_with": 0}, calls.counts
    for grant in grants:
        await rig.dispatcher.release(MODEL, grant, 1.0)
    assert await rig.store.reads.user_inflight(MODEL) == {}


async def test_a_release_grants_the_next_request_without_a_dispatch_call(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    await set_backend(rig, "b0", waiting=2, running=0)  # room for one request in transit
    first = await queue(rig, "r1")
    await rig.dispatcher.dispatch_once(MODEL)
    second = await queue(rig, "r2", user="bob")
    await rig.dispatcher.dispatch_once(MODEL)
    assert not second.delivered  # the gate is full while r1 is in transit
    calls = Calls(rig.store.queue, monkeypatch, "dispatch_with")
    await rig.dispatcher.release(MODEL, await first.grant(), 1.0)
    assert second.delivered, "the settle did not grant the queued request"
    assert (await second.grant()).backend == "b0"
    assert calls.counts == {"dispatch_with": 0}, calls.counts
    assert rig.dispatcher.planner.queued[MODEL] == 0
    await rig.dispatcher.release(MODEL, await second.grant(), 1.0)
    assert await rig.store.reads.user_inflight(MODEL) == {}


async def test_a_start_rides_on_the_next_call_while_nothing_is_queued(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing queued: a first token makes no call of its own; the next enqueue carries it
    (and its freed slot grants that request), so does another request's settle. Something
    queued: the first token goes at once and its slot grants the queued request."""
    await set_backend(rig, "b0", waiting=2, running=0)  # room for one request in transit
    rig.dispatcher.signals.beating.set()  # as the heartbeat loop does: the replica is alive
    sent, store = K.backend_sent("b0"), rig.store

    async def acquire(request_id: str, user: str) -> Grant:
        req = QueuedRequest(request_id, user, "interactive", REPLICA, 1.0, time.time())
        return await asyncio.wait_for(rig.dispatcher.acquire(MODEL, req, 120.0),
                                      ENQUEUE_WAIT_S)

    first = await acquire("r1", "alice")
    calls = Calls(store.queue, monkeypatch, "mark_started", "enqueue_many",
                  "settle_and_dispatch")
    await rig.dispatcher.started(MODEL, first)
    assert calls.counts["mark_started"] == 0, calls.counts
    assert "started" not in await store.reads.request_fields(MODEL, "r1")
    assert await store.client.zrange(sent, 0, -1) == ["r1"]

    # bob's enqueue carries r1's start: the slot it freed takes bob in the same call
    second = await acquire("r2", "bob")
    assert calls.counts == {"mark_started": 0, "enqueue_many": 1, "settle_and_dispatch": 0}
    assert (await store.reads.request_fields(MODEL, "r1")).get("started") == "1"
    assert await store.client.zrange(sent, 0, -1) == ["r2"]

    # carol queues behind r2 (the gate is full): r2's first token goes at once, grants her
    third = await queue(rig, "r3", user="carol")
    assert not third.delivered
    await rig.dispatcher.started(MODEL, second)
    assert calls.counts["mark_started"] == 1, calls.counts
    assert third.delivered, "the start of r2 was held although carol was queued"
    assert await store.client.zrange(sent, 0, -1) == ["r3"]

    # nothing queued again: r3's start waits, and r2's settle carries it
    await rig.dispatcher.started(MODEL, await third.grant())
    assert calls.counts["mark_started"] == 1, calls.counts
    await rig.dispatcher.release(MODEL, second, 1.0)
    assert (await store.reads.request_fields(MODEL, "r3")).get("started") == "1"
    assert await store.client.zrange(sent, 0, -1) == []
    for grant in (first, await third.grant()):
        await rig.dispatcher.release(MODEL, grant, 1.0)
    assert calls.counts["mark_started"] == 1, calls.counts
    assert await store.reads.user_inflight(MODEL) == {}
