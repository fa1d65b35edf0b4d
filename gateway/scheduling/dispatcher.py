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

The parts, each over the ones below it and never back up (the composition root,
``gateway/services.py``, builds each and hands it to those above):

- ``grants.py``: the clients waiting here, the grants held here, the loop's wake-up;
- ``outage.py``: the store-outage mode (beside ``local.py``, its local queues);
- ``decision.py``: a decision's inputs and what it returned (the rule:
  ``policies/dispatch_plan.py``);
- ``held_starts.py``: the first tokens held back;
- ``settles.py``: releases, deferred settles, grants nobody here takes;
- ``dispatch_loop.py``: the dispatch loop and its pass;
- ``replicas.py``: the replica protocol (grant listeners, heartbeat, reconcile);
- :class:`Dispatcher` here: what admission calls: a request's enqueue (a tick's in one
  call), its wait for a grant, its withdrawal; release and start go to their parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import dataclass

from gateway.backends.scrape import BackendPool
from gateway.core.errors import (
    FairgateError,
    QueueTimeout,
    RateLimited,
    StoreUnavailable,
)
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import ReadsSettings, SettingsHolder
from gateway.core.supervise import supervise
from gateway.scheduling.decision import Plan, Planner
from gateway.scheduling.dispatch_loop import DispatchLoop
from gateway.scheduling.grants import Signals, Waiter, Waiters
from gateway.scheduling.held_starts import HeldStarts
from gateway.scheduling.local import LocalScheduler
from gateway.scheduling.outage import StoreOutage
from gateway.scheduling.preemption import Preemptor
from gateway.scheduling.replicas import ReplicaProtocol
from gateway.scheduling.settles import Settles
from gateway.storage.records import Dispatched, Grant, QueuedRequest
from gateway.storage.store import Store
from gateway.storage.values import UsageCounts

# How often a waiting request checks that it is still queued in Redis.
LOST_CHECK_S = 5.0


@dataclass(frozen=True, slots=True)
class DispatchParts:
    """The dispatcher's parts, built by the composition root (``gateway/services.py``)."""

    signals: Signals
    waiters: Waiters
    local: LocalScheduler
    outage: StoreOutage
    planner: Planner
    starts: HeldStarts
    settles: Settles
    loop: DispatchLoop
    replicas: ReplicaProtocol
    preemptor: Preemptor


class Dispatcher(ReadsSettings):
    """What admission, the batch runner and the admin routes call: acquire a grant
    (queued with the tick's other requests, awaited, withdrawn when its client leaves),
    release it, its first token; and the loops of the parts, supervised."""

    def __init__(self, settings: SettingsHolder, store: Store, pool: BackendPool,
                 metrics: GatewayMetrics, parts: DispatchParts) -> None:
        self.holder = settings
        self.store = store
        self.pool = pool
        self.metrics = metrics
        self.parts = parts
        self.signals = parts.signals
        self.outage = parts.outage
        self.planner = parts.planner
        self.starts = parts.starts
        self.settles = parts.settles
        self.replicas = parts.replicas
        self.local = parts.local
        self.preemptor = parts.preemptor
        self._clients = parts.waiters
        # a tick's requests to enqueue, by model, each with the future of its position
        self._to_enqueue: dict[str, list[tuple[QueuedRequest, asyncio.Future[int]]]] = {}
        self._background: set[asyncio.Task[None]] = set()

    @property
    def waiters(self) -> dict[str, Waiter]:
        """The clients waiting here for a grant, by request id."""
        return self._clients.waiting

    @property
    def held(self) -> dict[str, Grant]:
        """The grants this replica holds (delivered, not yet released), by request id."""
        return self._clients.held

    def wake(self) -> None:
        """There may be queued work (an enqueue, a new snapshot, a timer)."""
        self.signals.wake()

    def wake_freed(self) -> None:
        """Room may have appeared: dispatch where requests are known to be queued."""
        self.signals.wake_freed()

    def cancelling(self, request_id: str) -> contextlib.AbstractContextManager[None]:
        """An operator cancels ``request_id``: its waiter takes its absence from Redis
        for the cancel (409), not for a lost request (503)."""
        return self._clients.cancelling(request_id)

    def cancel(self, request_id: str, error: FairgateError) -> bool:
        """Fail a request waiting here for its grant. True when its client was told."""
        return self._clients.cancel(request_id, error)

    async def release(self, model: str, grant: Grant, charge: float,
                      tenant_charge: float | None = None,
                      usage: UsageCounts | None = None) -> None:
        """Settle a dispatched request (``gateway/scheduling/settles.py``)."""
        await self.settles.release(model, grant, charge, tenant_charge, usage)

    async def started(self, model: str, grant: Grant) -> None:
        """The backend streams this request's first token
        (``gateway/scheduling/held_starts.py``)."""
        await self.starts.started(model, grant)
        self.settles.release_leftovers()

    async def dispatch_once(self, model: str) -> bool:
        """One pass of the dispatch loop over ``model`` (``dispatch_loop.py``)."""
        return await self.parts.loop.dispatch_once(model)

    async def plan(self, model: str, now: float) -> Plan:
        return await self.planner.plan(model, now)

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
                if self.outage.serves_locally:
                    self.outage.lost(exc)  # queued here with the others this replica holds
                    position = 1
                else:
                    position = await self.outage.enqueue_after(model, req, exc)
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
                await self._withdraw(model, req, future)  # and a late grant is released
            self.waiters.pop(req.request_id, None)
            raise

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
                            or self._clients.being_cancelled(req.request_id)):
                        continue  # still queued, or an operator's cancel tells it now
                    # The store forgot it while its client waits here: dropped at dispatch
                    # or reaped while this replica looked dead (a stall past
                    # replica_ttl_s), or a promoted replica missed the last writes. It goes
                    # in again with its first arrival time; a grant of the first dispatch
                    # still on its way is released (Waiters.deliver), never run twice.
                    await self.outage.requeue(model, [req])
                except StoreUnavailable:
                    if self.settings.failover_wait_s() > 0:
                        continue  # the outage mode bounds the wait
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
            future.cancel()  # the grant is on its way: its delivery releases it

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
        planner = self.planner
        starts = self.starts.take(model)
        try:
            # with a backlog the loop decides: no plan is worked out for a decision not made
            plan = (await planner.plan(model, time.time())
                    if planner.queued.get(model, 0) == 0 and self.signals.beating.is_set()
                    else None)
            target = plan.open[0] if plan is not None and plan.open else None
            if target is not None and planner.deciding(model, target):
                target = None  # a decision on its way: the loop follows it
            then = planner.dispatch_args(model, plan, target) if plan and target else None
            with planner.decision(model, target):
                positions, done = await self.store.queue.enqueue_many(
                    model, [r for r, _ in batch], self.settings.max_queued_per_user, then,
                    starts)
        except (Exception, asyncio.CancelledError) as exc:
            self.starts.hold(model, starts)
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
            planner.queued[model] = max(planner.queued.get(model, 0), 1)  # starts go at once
        again = done is not None and plan is not None and planner.granted(model, plan, done)
        self.settles.release_leftovers()
        if done is None or plan is None or again or done.depth > 0:
            self.wake()

    async def run(self) -> None:
        """The dispatch loop, the heartbeat and one grant listener per model, each
        supervised (restarted after a crash)."""
        models = self.settings.models()
        restarts = self.metrics.process.loop_restarts
        replicas, loop = self.replicas, self.parts.loop
        loops = [supervise("heartbeat", lambda: replicas.heartbeat(models), restarts),
                 supervise("dispatch", lambda: loop.run(models), restarts)]
        loops += [supervise("listen", functools.partial(replicas.listen, model), restarts)
                  for model in models]
        tasks = [asyncio.create_task(coro) for coro in loops]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
