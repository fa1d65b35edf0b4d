"""Event-driven dispatch: wakes on enqueue, settle and every new backend snapshot.

Any replica may dispatch any request (the Lua script makes the choice atomic and fair
across replicas); a grant for a request whose client another replica holds travels
through that replica's grant list.

The decision rides on the calls a request makes anyway: a tick's enqueues go in one call
that also dispatches to the least loaded open backend, and a started or settled request
whose slot frees grants its backend's next requests in the same call (``lua/lib/
dispatch.lua``). The dispatch loop runs the decision on its own only for what those did
not serve: a new snapshot while requests are known to be queued, a backlog left after
them, the heartbeat's safety net. Its pass is one call per model, whatever the number of
backends: the open ones in load order until nothing is queued (``lua/dispatch.lua``).

A first token matters to the decision only when something is queued that the slot it
frees could take. While the latest decision left nothing queued for the model (on any
replica: its depth is the model's), the start is held here and rides on the next call
that goes to Redis for the model anyway: the next enqueue, a settle (its own, at the
latest), a start sent at once, the dispatch loop's next pass (after each snapshot).
Until then the request counts as in transit, which only makes the gate stricter
(``policies/gates.py`` Gate.admits), and a snapshot taken after the first token shows it
running anyway; a replica that dies holding starts is reaped as if its requests never
streamed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections import deque
from collections.abc import Coroutine, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from gateway.backends.handle import BackendHandle
from gateway.backends.scrape import BackendPool
from gateway.core.errors import (
    FairgateError,
    QueueTimeout,
    RateLimited,
    StoreUnavailable,
)
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import ReadsSettings, Settings, SettingsHolder
from gateway.core.supervise import supervise
from gateway.core.waits import event_set
from gateway.scheduling.local import LocalScheduler
from gateway.scheduling.preemption import Preemptor
from gateway.storage.dispatch_call import dispatch_args
from gateway.storage.records import (
    BackendFit,
    Dispatched,
    Grant,
    Locality,
    Preempt,
    QueuedRequest,
    Start,
)
from gateway.storage.store import Store
from gateway.storage.values import UsageCounts
from policies.adapters import AdapterHost
from policies.adapters import takes as adapter_takes
from policies.backend_choice import Candidate, by_load
from policies.classes import CLASS_ORDER
from policies.gates import Gate, down, wider
from policies.locality import routing_for
from policies.starvation import FloorPolicy, owed_class, service_order

log = structlog.get_logger("fairgate.dispatcher")

# How often a waiting request checks that it is still queued in Redis.
LOST_CHECK_S = 5.0
STORE_RETRY_S = 0.2  # pause of the grant listener while Redis is unreachable
# the grant listener's blocking read: below the store's socket timeout
# (redis_socket_timeout_s, at least 2 s), which would take a longer one for a frozen store
STORE_BLOCK_S = 1.0
RECONCILE_EVERY = 30  # heartbeats between reconciliations (and after every outage)
RECONCILE_GRACE_S = 5.0
# Idle end users forgotten per model per heartbeat, at most (lua/forget.lua): a few
# milliseconds of Redis, and 200 a second outpaces any plausible arrival of new end users
# (17 million a day per replica).
FORGET_PER_PASS = 200


@dataclass(slots=True)
class Waiter:
    request: QueuedRequest
    model: str
    future: asyncio.Future[Grant]


@dataclass(frozen=True, slots=True)
class Plan:
    """One model's dispatch inputs at ``now``: the class order (a starved class owed its
    floor first), how many grants one decision may make, each backend's gates, and its
    open backends, least loaded first."""

    now: float
    owed: str | None
    order: list[str]
    burst: int
    gates: dict[str, dict[str, Gate]]
    open: list[str]
    handles: dict[str, BackendHandle]
    locality: Locality | None
    # the LoRA adapters each open backend takes in this pass (policies/adapters.py);
    # None: the model has no adapters
    adapters: Mapping[str, frozenset[str]] | None = None
    # the snapshot each backend's gates come from (taken_at, unix s; None: none yet)
    seen: Mapping[str, float | None] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Settle:
    """A settle Redis missed, retried by the heartbeat loop."""

    model: str
    grant: Grant
    charge: float
    tenant_charge: float | None
    usage: UsageCounts | None
    starts: tuple[Start, ...] = ()  # held starts it carries


class Dispatcher(ReadsSettings):
    def __init__(self, settings: SettingsHolder, store: Store, pool: BackendPool,
                 metrics: GatewayMetrics, replica_id: str) -> None:
        self.holder = settings
        self.store = store
        self.pool = pool
        self.metrics = metrics
        self.replica_id = replica_id
        # preemption for fairness: checked after each dispatch pass, its orders carried
        # out when this replica's listener reads them
        self.preemptor = Preemptor(settings, store.preempts, pool, metrics)
        self.waiters: dict[str, Waiter] = {}
        self._cancelling: set[str] = set()  # ids an operator's cancel is removing
        self._wake = asyncio.Event()
        self._maybe_work = False
        self._queued: dict[str, int] = {}  # model → depth seen by the latest dispatch
        self._class_view: dict[str, tuple[float, dict[str, float], list[str]]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._beating = asyncio.Event()  # this replica's heartbeat is in Redis
        self._listened: dict[str, float] = {}  # model → its grant listener's last turn
        self._unheard: set[str] = set()  # models whose grant listener failed last
        self._unsettled: deque[Settle] = deque()  # settles Redis missed
        # a tick's requests to enqueue, by model, each with the future of its position
        self._to_enqueue: dict[str, list[tuple[QueuedRequest, asyncio.Future[int]]]] = {}
        # first tokens not yet sent, by model: they ride on its next call to Redis
        self._starts: dict[str, dict[str, Start]] = {}
        # decisions on their way to Redis, by (model, backend): while one is, a settle or a
        # start does not fold another in but wakes the dispatch loop, which takes every
        # slot freed meanwhile in one decision (under load, folds would each make one)
        self._deciding: dict[tuple[str, str], int] = {}
        # grants this replica holds (delivered, not yet released): what "running:<me>"
        # in Redis should say, and what reconcile() makes it say after a Redis restart
        self.held: dict[str, Grant] = {}
        self._store_down = False
        self._store_back = asyncio.Event()  # set while the store answers
        self._store_back.set()
        self._outages = 0
        self._beats = 0
        # store_outage "local": this replica's own queues while Redis is unreachable
        self.local = LocalScheduler(pool, replica_id)
        self.floors: FloorPolicy
        self.locality: Locality | None
        self._derive(settings.current)
        settings.on_swap(self._derive)

    def _derive(self, settings: Settings) -> None:
        """The starvation floors and the locality rule of these settings."""
        self.floors = FloorPolicy(settings.class_floors, settings.starvation_after_s,
                                  settings.starvation_window)
        self.locality = (Locality(settings.locality_slack, settings.locality_candidates,
                                  settings.prefix_index_size, settings.prefix_index_ttl_s,
                                  settings.locality_max_imbalance)
                         if settings.routing != "least_loaded" else None)

    @property
    def replica_ttl_s(self) -> float:
        return self.settings.replica_ttl_s

    def wake(self) -> None:
        """There may be queued work (an enqueue, a new snapshot, a timer)."""
        self._maybe_work = True
        self._wake.set()

    def wake_freed(self) -> None:
        """Room may have appeared (a backend slot freed, a new snapshot): dispatch only
        where requests are known to be queued. Of the replicas, the one that queued a
        request still waiting saw it queued at its latest call (every call returns the
        model's depth), so it is woken; the others need not decide (the heartbeat's
        forced pass is the safety net)."""
        self._wake.set()

    async def acquire(self, model: str, req: QueuedRequest, timeout_s: float) -> Grant:
        """Queue a request and wait for its grant.

        Raises RateLimited when the user's queue is full and QueueTimeout after
        ``timeout_s``. On timeout or cancellation (client gone) the request leaves the
        queue; if it was dispatched meanwhile, its in-flight state is released.
        """
        future: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        self.waiters[req.request_id] = Waiter(req, model, future)
        try:
            try:
                position = await self._enqueue(model, req)
            except StoreUnavailable as exc:
                if self._serves_locally:
                    self.store_lost(exc)  # queued here with the others this replica holds
                    position = 1
                else:
                    position = await self._enqueue_after_outage(model, req, exc)
        except StoreUnavailable:
            self.waiters.pop(req.request_id, None)
            if future.done() and not future.cancelled():
                future.exception()  # store_lost's 503: this one is raised instead
            raise
        except asyncio.CancelledError:
            # The script may have run although its reply was never read: take it back.
            await self._withdraw(model, req, future)
            raise
        if position < 0:
            self.waiters.pop(req.request_id, None)
            raise RateLimited(
                f"user {req.user!r} already has {self.settings.max_queued_per_user} requests "
                "queued for this model")  # Retry-After: the wait estimator's (admission)
        try:
            return await self._await_grant(model, req, future, timeout_s)
        except (FairgateError, asyncio.CancelledError):
            with contextlib.suppress(StoreUnavailable):  # Redis down: AOF keeps it queued
                await self._withdraw(model, req, future)  # and _deliver releases it later
            self.waiters.pop(req.request_id, None)
            raise

    async def _enqueue_after_outage(self, model: str, req: QueuedRequest,
                                    error: StoreUnavailable) -> int:
        """Behind Sentinel: wait for the promoted master (``store_failover_wait_s`` at
        most), then queue the request there, once (the failed call may have reached the
        old master and been replicated). Raises ``error`` otherwise."""
        ends = time.monotonic() + self.settings.failover_wait_s()
        while await self._store_back_by(ends, error):
            try:
                await self._requeue(model, [req])
                return 1
            except StoreUnavailable as exc:
                error = exc
        raise error

    async def _await_grant(self, model: str, req: QueuedRequest,
                           future: asyncio.Future[Grant], timeout_s: float) -> Grant:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                async with asyncio.timeout(min(left, LOST_CHECK_S)):
                    return await asyncio.shield(future)
            except TimeoutError:
                if self.local.holds(req.request_id):
                    continue  # queued here while the store is unreachable
                try:
                    if (await self.store.reads.request_exists(model, req.request_id)
                            or req.request_id in self._cancelling):
                        continue  # still queued, or an operator's cancel tells it now
                    # The store forgot it while its client waits here: dropped at dispatch
                    # or reaped while this replica looked dead (a stall past
                    # replica_ttl_s), or a promoted replica missed the last writes. It goes
                    # in again with its first arrival time; a grant of the first dispatch
                    # still on its way is released by _deliver, never run twice.
                    await self._requeue(model, [req])
                except StoreUnavailable:
                    if self.settings.failover_wait_s() > 0:
                        continue  # store_lost bounds the wait
                    raise
        raise QueueTimeout(f"request waited more than {timeout_s:g}s in the {req.klass} queue")

    async def _withdraw(self, model: str, req: QueuedRequest,
                        future: asyncio.Future[Grant]) -> None:
        if self.local.cancel(req.request_id):
            self.waiters.pop(req.request_id, None)
            return
        if await self.store.queue.cancel(model, req.request_id, req.user, req.klass,
                                   req.tenant_name, req.session):
            self.waiters.pop(req.request_id, None)
        elif future.done() and not future.cancelled() and future.exception() is None:
            await self.release(model, future.result(), 0.0)
        elif not future.done():
            future.cancel()  # the grant is on its way: _deliver releases it

    def _enqueue(self, model: str, req: QueuedRequest) -> asyncio.Future[int]:
        """Queue ``req`` with the other requests of this event-loop turn (one Redis call
        for them all, :meth:`_flush`); the future holds its user's queue length."""
        loop = asyncio.get_running_loop()
        position: asyncio.Future[int] = loop.create_future()
        batch = self._to_enqueue.setdefault(model, [])
        batch.append((req, position))
        if len(batch) == 1:
            task = loop.create_task(self._flush(model))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return position

    async def _flush(self, model: str) -> None:
        """Enqueue a tick's requests and dispatch to the least loaded open backend in the
        same call; the dispatch loop is woken only when that left work queued."""
        batch = [(r, f) for r, f in self._to_enqueue.pop(model, []) if not f.done()]
        if not batch:
            return
        self.pool.hurry(model)  # an idle backend's scrapes go back to the fast interval
        done: Dispatched | None = None
        starts = self._take_starts(model)
        try:
            # with a backlog the loop decides: no plan is worked out for a decision not made
            plan = (await self.plan(model, time.time())
                    if self._queued.get(model, 0) == 0 and self._beating.is_set() else None)
            target = plan.open[0] if plan is not None and plan.open else None
            if target is not None and self._deciding.get((model, target)):
                target = None  # a decision on its way: the loop follows it
            then = self._dispatch_args(model, plan, target) if plan and target else None
            with self._decision(model, target):
                positions, done = await self.store.queue.enqueue_many(
                    model, [r for r, _ in batch], self.settings.max_queued_per_user, then,
                    starts)
        except (Exception, asyncio.CancelledError) as exc:
            self._hold(model, starts)
            for _, position in batch:
                if not position.done():
                    position.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for (_, position), queued in zip(batch, positions, strict=True):
            if not position.done():
                position.set_result(queued)
        if done is None and any(p > 0 for p in positions):  # queued, no decision yet:
            self._queued[model] = max(self._queued.get(model, 0), 1)  # starts go at once
        if done is None or plan is None or self._granted(model, plan, done) or done.depth > 0:
            self.wake()

    async def release(self, model: str, grant: Grant, charge: float,
                      tenant_charge: float | None = None,
                      usage: UsageCounts | None = None) -> None:
        """Settle a dispatched request (idempotent), with its ``usage`` counts, and let the
        next one go: while requests are queued the freed slot grants its backend's next
        ones in the same call. While Redis is down the settle waits in memory and is
        retried by the heartbeat loop, so no in-flight count leaks (a leaked one would
        hold a gate closed for good)."""
        self.held.pop(grant.request_id, None)
        if grant.local:  # granted here while the store was unreachable: settled here
            self.local.release(model, grant, charge, tenant_charge)
            self.wake_freed()
            return
        starts = self._take_starts(model)
        try:
            plan, then = await self._fold(model, grant.backend)
            with self._decision(model, grant.backend if then else None):
                _, done = await self.store.queue.settle_and_dispatch(
                    model, grant, charge, tenant_charge, usage, then, starts)
        except StoreUnavailable as exc:
            log.warning("settle_deferred", request_id=grant.request_id, error=str(exc))
            self._unsettled.append(Settle(model, grant, charge, tenant_charge, usage,
                                          tuple(starts)))
            self.wake_freed()
            return
        if plan is None or done is None or self._granted(model, plan, done):
            self.wake_freed()

    async def _settle_deferred(self) -> None:
        while self._unsettled:
            s = self._unsettled[0]
            await self.store.queue.settle_and_dispatch(s.model, s.grant, s.charge, s.tenant_charge,
                                                 s.usage, starts=s.starts)
            self._unsettled.popleft()
            self.wake_freed()

    @property
    def _serves_locally(self) -> bool:
        return self.settings.store_outage == "local"

    def store_lost(self, error: StoreUnavailable) -> None:
        """Redis is unreachable: every queued client of this replica gets a 503 now
        rather than waiting blind (a batch line retries; running streams go on). Behind
        Sentinel they wait up to ``store_failover_wait_s`` for the promoted master
        first (:meth:`_fail_waiters_after`). With ``store_outage: local`` they are queued
        and served here instead (``gateway/scheduling/local.py``) until the store answers
        again (:meth:`_hand_back`)."""
        if not self._store_down:
            log.warning("store_lost", waiting=len(self.waiters), error=error.message,
                        serving_locally=self._serves_locally)
            self._store_back.clear()
            wait_s = self.settings.failover_wait_s()
            if wait_s > 0 and not self._serves_locally:
                self._outages += 1
                self._background_task(self._fail_waiters_after(self._outages, wait_s))
        self._store_down = True
        if self._serves_locally:
            self.metrics.dispatch.serving_locally.set(1)
            for waiter in list(self.waiters.values()):
                if not waiter.future.done():
                    self.local.queue(waiter.model, waiter.request, waiter.future)
            self._dispatch_locally()
        elif self.settings.failover_wait_s() == 0:
            self._fail_waiters()

    def _dispatch_locally(self) -> None:
        """Grant what this replica queues itself while the store is unreachable."""
        for model, grant in self.local.dispatch(time.time(), self.settings.snapshot_stale_s):
            self.waiters.pop(grant.request_id, None)  # a grant from the store comes too late
            self.metrics.dispatch.local.labels(model, grant.backend, grant.klass).inc()

    async def _hand_back(self) -> None:
        """The store answers again after this replica served locally: the requests
        granted here leave its queues (they run to their end here), and those still
        queued here go back to it with their arrival time unless it still queues them."""
        queued, served = self.local.take_back()
        self.metrics.dispatch.serving_locally.set(0)
        for wait in served:
            r = wait.request
            await self.store.queue.cancel(wait.model, r.request_id, r.user, r.klass, r.tenant_name,
                                    r.session)
        await self._requeue_waiters()  # the waiters still queued here
        log.info("store_back", handed_back=len(queued), served_locally=len(served))

    def _fail_waiters(self, spared: frozenset[str] = frozenset()) -> None:
        for request_id, waiter in list(self.waiters.items()):
            if waiter.model not in spared:
                self.cancel(request_id, StoreUnavailable("connection lost while queued; retry"))

    async def _fail_waiters_after(self, outage: int, wait_s: float) -> None:
        """The store is still unreachable ``wait_s`` after the outage began: the queued
        clients get their 503 (a failover takes longer than it may). Behind Redis Cluster
        a model whose grant listener did not fail its last turn (its blocking read fails
        within ``redis_socket_timeout_s`` and a turn on a shard that is gone) lives on a
        shard that answers: its clients stay queued, to be dispatched there as before."""
        await event_set(self._store_back, wait_s)
        if self._store_down and outage == self._outages:
            spared = frozenset() if self.settings.redis_cluster is None else frozenset(
                w.model for w in self.waiters.values()) - self._unheard
            log.warning("store_failover_wait_over", waiting=len(self.waiters), wait_s=wait_s,
                        models_reachable=sorted(spared), models_unheard=sorted(self._unheard))
            self._fail_waiters(spared)

    async def _store_back_by(self, deadline: float, error: StoreUnavailable) -> bool:
        """A call failed on the store: behind Sentinel, wait until it is back (a
        failover) but not past ``deadline`` (monotonic). True when it is back."""
        if self.settings.failover_wait_s() == 0:
            return False
        self.store_lost(error)
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        return await event_set(self._store_back, left)

    async def _requeue(self, model: str, reqs: list[QueuedRequest]) -> int:
        """Queue again requests the store forgot while their clients wait here (a
        promoted replica missed the last writes), with their first arrival time; the
        ones it still knows stay as they are. Returns how many went in."""
        positions, _ = await self.store.queue.enqueue_many(
            model, reqs, self.settings.max_queued_per_user, requeue=True)
        again = sum(p > 0 for p in positions)
        if again:
            log.warning("requeued_forgotten", model=model, requests=again)
            self.wake()
        return again

    async def _requeue_waiters(self) -> None:
        """After an outage behind Sentinel: every client still queued here whose request
        the (new) master does not know is queued again."""
        by_model: dict[str, list[QueuedRequest]] = {}
        for waiter in list(self.waiters.values()):
            if not waiter.future.done():
                by_model.setdefault(waiter.model, []).append(waiter.request)
        for model, reqs in by_model.items():
            await self._requeue(model, reqs)

    def _background_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @contextlib.contextmanager
    def cancelling(self, request_id: str) -> Iterator[None]:
        """An operator cancels ``request_id`` (removes it from Redis, then tells its
        client with :meth:`cancel`): meanwhile its waiter does not take its absence from
        Redis for a lost request (503) instead of the cancel (409)."""
        self._cancelling.add(request_id)
        try:
            yield
        finally:
            self._cancelling.discard(request_id)

    def cancel(self, request_id: str, error: FairgateError) -> bool:
        """Fail a request this replica holds while it waits for its grant (an operator
        removed it from the queue). True when its client was told."""
        waiter = self.waiters.pop(request_id, None)
        if waiter is None or waiter.future.done():
            return False
        waiter.future.set_exception(error)
        return True

    async def run(self) -> None:
        """The dispatch loop, the heartbeat and one grant listener per model, each
        supervised (restarted after a crash)."""
        models = self.settings.models()
        restarts = self.metrics.process.loop_restarts
        loops = [supervise("heartbeat", lambda: self._heartbeat(models), restarts),
                 supervise("dispatch", lambda: self._dispatch_loop(models), restarts)]
        loops += [supervise("listen", functools.partial(self._listen, model), restarts)
                  for model in models]
        tasks = [asyncio.create_task(coro) for coro in loops]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _dispatch_loop(self, models: list[str]) -> None:
        # the script drops requests of replicas without a heartbeat: ours must be there
        await self._beating.wait()
        while True:
            # woken by work, or when a preemption check comes due (a request waits on a
            # full backend: nothing else need happen for it to preempt)
            due_in = self.preemptor.recheck_in(time.monotonic())
            await event_set(self._wake, due_in)
            self._wake.clear()
            forced, self._maybe_work = self._maybe_work, False
            if self._store_down and self._serves_locally:
                self._dispatch_locally()
                continue
            for model in models:
                # room appeared (a slot freed, a snapshot): a decision only where requests
                # are known to be queued
                queued = forced or self._queued.get(model, 1) > 0
                due = self.preemptor.due(model, time.monotonic())
                if not (queued or due or self._starts.get(model)):
                    continue
                try:
                    while queued and await self.dispatch_once(model):
                        pass
                    if queued or due:
                        await self._preempt(model)
                    else:  # the starts held go, so that the others' gates see what runs
                        await self._send_held_starts(model)
                except StoreUnavailable as exc:
                    log.warning("dispatch_failed", model=model, error=str(exc))
                    self._maybe_work = True  # try again on the next wake-up

    async def _preempt(self, model: str) -> None:
        """After a pass over ``model``: preemption, when one of its backends is full."""
        full = self.preemptor.full(model, time.time())
        if full and self._starts.get(model):
            await self._send_held_starts(model)
        await self.preemptor.check(model, full, self._queued.get(model, 0))

    async def dispatch_once(self, model: str) -> bool:
        """Fill every open backend's gate from the queues. True when another pass is
        needed right away (a starved class is being served one request at a time).

        Gates come from this replica's own latest scrape of each backend; the Lua script
        re-checks the shared sent-since-snapshot count, so replicas never overshoot."""
        plan = await self.plan(model, time.time())
        if not plan.open:
            return False
        starts = self._take_starts(model)
        try:
            with contextlib.ExitStack() as deciding:
                for backend in plan.open:
                    deciding.enter_context(self._decision(model, backend))
                # one call tries the open backends in order, until nothing is queued (or
                # after the first grant while a class is owed its floor)
                decided = await self.store.queue.dispatch_with(
                    model, [self._dispatch_args(model, plan, b) for b in plan.open], starts,
                    until_grant=plan.owed is not None)
        except StoreUnavailable:
            self._hold(model, starts)
            raise
        again = False
        for done in decided:
            # decide again who is owed after each such dispatch
            again = self._granted(model, plan, done) or again
        return again

    async def plan(self, model: str, now: float) -> Plan:
        """The inputs of the model's dispatch decisions at ``now`` (``policies/``: the
        starvation floor, the gates, the borrowing, the backend order)."""
        since, recent = await self._class_service(model, now)
        owed = owed_class(self.floors, since, recent, now)
        gated: dict[str, dict[str, Gate]] = {}
        seen: dict[str, float | None] = {}
        candidates = []
        handles = {h.name: h for h in self.pool.for_model(model)}  # stable across awaits
        for h in handles.values():
            snap = h.last if h.healthy else None
            gates = gated[h.name] = dict(h.gates_at(now, self.settings.snapshot_stale_s))
            seen[h.name] = h.gates_seen
            if owed is not None:  # a starved class borrows the top class's gate
                gates[owed] = wider(gates[owed], gates[CLASS_ORDER[0]])
            waiting, running = (snap.waiting, snap.running) if snap else (0, 0)
            candidates.append(Candidate(h.name, waiting, running, h.sent_since_snapshot,
                                        any(g.open for g in gates.values())))
        # one grant at a time while a starved class is owed its floor, so it gets no more
        burst = 1 if owed is not None else max(self.settings.classes[c].max_waiting
                                                for c in CLASS_ORDER)
        open_ = [c.name for c in by_load(candidates)]
        adapters = self._adapter_placement([handles[name] for name in open_])
        locality = None  # least_loaded: configured, or auto with one backend
        if (self.locality is not None
                and routing_for(self.settings.routing, len(handles)) == "locality"):
            # a request is never left for a backend that is down (its prefix index would
            # hold a killed backend's continuations until they time out), nor for one
            # that does not take it (another length pool, an adapter it lacks)
            others = tuple(name for name in handles if not down(gated[name]))
            locality = dataclasses.replace(self.locality, others=others, fits={
                name: self._fit(handles[name], adapters) for name in others})
        return Plan(now, owed, service_order(owed), burst, gated, open_, handles, locality,
                    adapters, seen)

    def _adapter_placement(self, open_: list[BackendHandle]
                           ) -> Mapping[str, frozenset[str]] | None:
        """Which adapters each open backend takes: where each is resident first
        (``policies/adapters.py``); None when the model has no adapters."""
        if not open_ or self.pool.fit(open_[0]).adapters is None:
            return None
        return adapter_takes([AdapterHost(
            h.name, self.pool.adapters_on(h),
            frozenset(h.card.lora.active) if h.card.lora else frozenset(),
            h.card.lora.max_lora if h.card.lora else None) for h in open_])

    def _fit(self, handle: BackendHandle, adapters: Mapping[str, frozenset[str]] | None
             ) -> BackendFit:
        """What a backend takes: its prompt range, and the adapters the placement gives
        it (``adapters``, :meth:`_adapter_placement`; those it has when not placed)."""
        fit = self.pool.fit(handle)
        if fit.adapters is not None and adapters is not None and handle.name in adapters:
            fit = dataclasses.replace(fit, adapters=adapters[handle.name])
        return fit

    def _dispatch_args(self, model: str, plan: Plan, backend: str) -> dict[str, Any]:
        fit = self._fit(plan.handles[backend], plan.adapters)
        return dispatch_args(model, backend, plan.gates[backend], self.replica_id, plan.now,
                             self.replica_ttl_s, plan.order, self.floors.window, plan.burst,
                             locality=plan.locality, fit=fit,
                             sessions=self.settings.sessions, seen=plan.seen.get(backend))

    async def _fold(self, model: str, backend: str
                    ) -> tuple[Plan | None, dict[str, Any] | None]:
        """The decision a started or settled request on ``backend`` folds in: none while
        nothing is known to be queued for the model, while another decision for the backend
        is on its way (the caller wakes the dispatch loop), or when the backend is not
        open."""
        if self._queued.get(model, 1) == 0 or self._deciding.get((model, backend)):
            return None, None
        plan = await self.plan(model, time.time())
        if backend not in plan.open:
            return plan, None
        return plan, self._dispatch_args(model, plan, backend)

    @contextlib.contextmanager
    def _decision(self, model: str, backend: str | None) -> Iterator[None]:
        """A call that carries a decision for ``backend`` (None: none) is on its way."""
        if backend is None:
            yield
            return
        key = (model, backend)
        self._deciding[key] = self._deciding.get(key, 0) + 1
        try:
            yield
        finally:
            if self._deciding[key] == 1:
                del self._deciding[key]
            else:
                self._deciding[key] -= 1

    def _granted(self, model: str, plan: Plan, done: Dispatched) -> bool:
        """Take in what a decision returned, whichever call made it: deliver this
        replica's grants (the others went to their replicas' grant lists), note what is
        still queued and the class service picture. True when the decision must be made
        again at once (a starved class is served one request at a time)."""
        self._queued[model] = done.depth
        self._class_view[model] = (plan.now, done.backlogged_since, done.recent)
        if done.stale_view:
            self.metrics.child(self.metrics.dispatch.stale_view, model, done.backend).inc()
        if done.grants and self.preemptor.soon(model, time.monotonic()):
            self._wake.set()  # a grant may wait on a full backend: check it (no forced pass)
        for grant in done.grants:
            handle = plan.handles.get(grant.backend)
            if handle is not None:
                handle.sent_since_snapshot += 1
            self.metrics.child(self.metrics.dispatch.dispatches, model, grant.backend,
                               grant.klass).inc()
            self.metrics.dispatch.on_decision(model, grant.backend, grant.reason,
                                              grant.matched_blocks, grant.prompt_blocks)
            if grant.owner == self.replica_id:
                self._deliver(model, grant.request_id, grant.backend, grant.rank,
                              grant.charged_prompt)
        if done.grants and plan.owed is not None:
            self._class_view.pop(model, None)
            return True
        return False

    async def _class_service(self, model: str, now: float
                             ) -> tuple[dict[str, float], list[str]]:
        """Backlog times and recent classes, as the latest decision returned them, read
        again when older than a scrape interval."""
        cached = self._class_view.get(model)
        if cached is None or now - cached[0] > self.settings.scrape_interval_s:
            since, recent = await self.store.reads.class_service(model)
            cached = self._class_view[model] = (now, since, recent)
        return cached[1], cached[2]

    async def started(self, model: str, grant: Grant) -> None:
        """The backend streams this request's first token. While nothing is known to be
        queued for the model the start is held, to ride on the model's next call to Redis;
        otherwise it goes at once (with the starts held), its gate slot frees, and the same
        call grants the backend's next requests."""
        if grant.local:
            return  # the store never counted it
        start = Start(grant.request_id, grant.backend, time.time())
        if self._queued.get(model, 1) == 0:
            self._hold(model, [start])
            return
        starts = [*self._take_starts(model), start]
        try:
            plan, then = await self._fold(model, grant.backend)
            with self._decision(model, grant.backend if then else None):
                done = await self.store.queue.mark_started(model, grant, start.at, then,
                                                     held=starts[:-1])
        except StoreUnavailable:
            self._hold(model, starts)  # sent with the next call, the settle at the latest
            self.wake_freed()
            return
        if then is None:
            self.wake_freed()
        elif plan is not None and done is not None and self._granted(model, plan, done):
            self.wake()

    async def _send_held_starts(self, model: str) -> None:
        """A backend of the model runs full: the starts held back go now, so that a
        preemption decision, this replica's or another's, sees what runs. Held while
        nothing was queued, they would wait for this replica's next call for the model,
        which gates closed by a slow TPOT may put off until an answer ends."""
        starts = self._take_starts(model)
        try:
            await self.store.queue.mark_starts(model, starts)
        except StoreUnavailable:
            self._hold(model, starts)
            raise

    def _hold(self, model: str, starts: list[Start]) -> None:
        held = self._starts.setdefault(model, {})
        for start in starts:
            held.setdefault(start.request_id, start)

    def _take_starts(self, model: str) -> list[Start]:
        """The starts held for ``model``, handed to the call about to go (it puts them
        back when it fails: marking a start twice, or after its settle, changes nothing)."""
        return list(self._starts.pop(model, {}).values())

    def _deliver(self, model: str, request_id: str, backend: str, rank: int,
                 charged_prompt: int | None = None) -> None:
        running = self.held.get(request_id)
        if running is not None:
            # granted again (a failed-over store lost the first dispatch and still queued
            # it): it runs here already, never twice; that second grant's slot is freed
            log.warning("duplicate_grant_released", request_id=request_id, backend=backend)
            self._background_task(self._release_duplicate(
                model, dataclasses.replace(running, backend=backend, rank=rank)))
            return
        waiter = self.waiters.pop(request_id, None)
        if waiter is not None and not waiter.future.done():
            req = waiter.request
            grant = Grant(request_id, req.klass, req.user, rank, self.replica_id, backend,
                          req.enqueued_at, charged_prompt=charged_prompt)
            self.held[request_id] = grant
            waiter.future.set_result(grant)
            return
        # Nobody waits (the client left between dispatch and delivery, or a failed-over
        # store granted a request that already ran here): release it.
        self._background_task(self._release_orphan(model, request_id))

    async def _release_duplicate(self, model: str, grant: Grant) -> None:
        with contextlib.suppress(StoreUnavailable):  # else reconcile() releases it
            if await self.store.queue.settle(model, grant, 0.0):
                self.wake_freed()

    async def _release_orphan(self, model: str, request_id: str) -> None:
        with contextlib.suppress(StoreUnavailable):
            grant = await self.store.replicas.dispatched(model, request_id)
            if grant is not None:
                await self.release(model, grant, 0.0)

    async def _listen(self, model: str) -> None:
        while True:
            try:
                item = await self.store.replicas.next_order(model, self.replica_id, STORE_BLOCK_S)
            except StoreUnavailable as exc:
                self._unheard.add(model)
                self.store_lost(exc)
                await asyncio.sleep(STORE_RETRY_S)
                continue
            self._listened[model] = time.time()  # reported with the heartbeat
            self._unheard.discard(model)
            if isinstance(item, Preempt):
                self.preemptor.carry_out(model, item)
            elif item is not None:
                self._deliver(model, *item)

    async def reconcile(self, model: str, now: float) -> int:
        """Release what Redis says this replica holds but it does not: requests whose
        settle a Redis restart lost (an AOF replays up to its last fsync). Returns the
        count. Grants younger than RECONCILE_GRACE_S may still be on their way here; an
        older one whose client still waits here is delivered to it."""
        unsettled = {s.grant.request_id for s in self._unsettled}
        released = 0
        for grant, dispatched_at in await self.store.replicas.held_by(model, self.replica_id):
            if (grant.request_id in self.held or grant.request_id in unsettled
                    or now - dispatched_at < RECONCILE_GRACE_S):
                continue
            if grant.request_id in self.waiters:
                # its grant never arrived (popped from a store that died before
                # answering): its client still waits here, so it goes now
                self._deliver(model, grant.request_id, grant.backend, grant.rank,
                              grant.charged_prompt)
                continue
            if await self.store.queue.settle(model, grant, 0.0):
                released += 1
        if released:
            log.warning("reconciled_inflight", model=model, released=released)
            self.wake_freed()
        return released

    async def forget_idle(self, model: str, now: float) -> int:
        """One bounded pass over the model's trusted-key end users idle past
        ``end_user_idle_s``: their fairness state is forgotten. Returns how many."""
        forgotten, _ = await self.store.queue.forget_idle(
            model, now, self.settings.end_user_idle_s, FORGET_PER_PASS)
        if forgotten:
            log.info("forgot_idle_end_users", model=model, forgotten=forgotten)
        return forgotten

    async def _heartbeat(self, models: list[str]) -> None:
        while True:
            try:
                now = time.time()
                self.local.replicas = await self.store.replicas.heartbeat(
                    models, self.replica_id, now, self._listened, now - self.replica_ttl_s)
                self._beating.set()
                recovered, self._store_down = self._store_down, False
                self._store_back.set()
                if recovered and self._serves_locally:
                    await self._hand_back()
                elif recovered and self.settings.failover_wait_s() > 0:
                    await self._requeue_waiters()
                await self._settle_deferred()
                self._beats += 1
                for model in models:
                    if await self.store.queue.reap(model, now, self.replica_ttl_s):
                        log.warning("reaped_dead_replica_requests", model=model)
                    await self.forget_idle(model, now)
                    if recovered or self._beats % RECONCILE_EVERY == 0:
                        await self.reconcile(model, now)
            except StoreUnavailable as exc:
                self.store_lost(exc)
            self.wake()  # a periodic safety net for enqueues on other replicas
            await asyncio.sleep(self.settings.replica_heartbeat_s)
