"""Event-driven dispatch: wakes on enqueue, settle and every new backend snapshot.

Any replica may dispatch any request (the Lua script makes the choice atomic and fair
across replicas); a grant for a request whose client another replica holds travels
through that replica's grant list.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections import deque
from dataclasses import dataclass

import structlog

from gateway.backends import BackendPool
from gateway.errors import (
    FairgateError,
    QueueTimeout,
    RateLimited,
    RequestLost,
    StoreUnavailable,
)
from gateway.metrics import GatewayMetrics
from gateway.settings import ReadsSettings, Settings, SettingsHolder
from gateway.store import Grant, Locality, QueuedRequest, Store
from gateway.supervise import supervise
from policies.backend_choice import Candidate, by_load
from policies.classes import CLASS_ORDER
from policies.gates import Gate, wider
from policies.starvation import FloorPolicy, owed_class, service_order

log = structlog.get_logger("fairgate.dispatcher")

# How often a waiting request checks that it is still queued in Redis.
LOST_CHECK_S = 5.0
STORE_RETRY_S = 0.2  # pause of the grant listener while Redis is unreachable
RECONCILE_EVERY = 30  # heartbeats between reconciliations (and after every outage)
RECONCILE_GRACE_S = 5.0


@dataclass(slots=True)
class Waiter:
    request: QueuedRequest
    model: str
    future: asyncio.Future[Grant]


class Dispatcher(ReadsSettings):
    def __init__(self, settings: SettingsHolder, store: Store, pool: BackendPool,
                 metrics: GatewayMetrics, replica_id: str) -> None:
        self.holder = settings
        self.store = store
        self.pool = pool
        self.metrics = metrics
        self.replica_id = replica_id
        self.waiters: dict[str, Waiter] = {}
        self._wake = asyncio.Event()
        self._maybe_work = False
        self._queued: dict[str, int] = {}  # model → depth seen by the latest dispatch
        self._class_view: dict[str, tuple[float, dict[str, float], list[str]]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._beating = asyncio.Event()  # this replica's heartbeat is in Redis
        self._listened: dict[str, float] = {}  # model → its grant listener's last turn
        self._unsettled: deque[tuple[str, Grant, float]] = deque()  # settles Redis missed
        self._tenant_charges: dict[str, float] = {}  # their tenant-level charges, by id
        # grants this replica holds (delivered, not yet released): what "running:<me>"
        # in Redis should say, and what reconcile() makes it say after a Redis restart
        self.held: dict[str, Grant] = {}
        self._store_down = False
        self._beats = 0
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
                         if settings.routing == "locality" else None)

    @property
    def replica_ttl_s(self) -> float:
        return self.settings.replica_ttl_s

    def wake(self) -> None:
        """There may be queued work (an enqueue, a new snapshot, a timer)."""
        self._maybe_work = True
        self._wake.set()

    def wake_freed(self) -> None:
        """A backend slot freed: dispatch only if requests are known to be queued."""
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
            position = await self.store.enqueue(model, req, self.settings.max_queued_per_user)
        except StoreUnavailable:
            self.waiters.pop(req.request_id, None)
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
        self.wake()
        try:
            return await self._await_grant(model, req, future, timeout_s)
        except (FairgateError, asyncio.CancelledError):
            with contextlib.suppress(StoreUnavailable):  # Redis down: AOF keeps it queued
                await self._withdraw(model, req, future)  # and _deliver releases it later
            self.waiters.pop(req.request_id, None)
            raise

    async def _await_grant(self, model: str, req: QueuedRequest,
                           future: asyncio.Future[Grant], timeout_s: float) -> Grant:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                return await asyncio.wait_for(asyncio.shield(future), min(left, LOST_CHECK_S))
            except TimeoutError:
                if not await self.store.request_exists(model, req.request_id):
                    # dropped at dispatch (this replica looked dead) or expired: say so now
                    # instead of waiting out the whole queue timeout
                    self.waiters.pop(req.request_id, None)
                    raise RequestLost("the queued request was lost; retry it") from None
        raise QueueTimeout(f"request waited more than {timeout_s:g}s in the {req.klass} queue")

    async def _withdraw(self, model: str, req: QueuedRequest,
                        future: asyncio.Future[Grant]) -> None:
        if await self.store.cancel(model, req.request_id, req.user, req.klass,
                                   req.tenant_name):
            self.waiters.pop(req.request_id, None)
        elif future.done() and not future.cancelled() and future.exception() is None:
            await self.release(model, future.result(), 0.0)
        elif not future.done():
            future.cancel()  # the grant is on its way: _deliver releases it

    async def release(self, model: str, grant: Grant, charge: float,
                      tenant_charge: float | None = None) -> None:
        """Settle a dispatched request (idempotent) and let the next one go. While Redis
        is down the settle waits in memory and is retried by the heartbeat loop, so no
        in-flight count leaks (a leaked one would hold a gate closed for good)."""
        self.held.pop(grant.request_id, None)
        try:
            await self.store.settle(model, grant, charge, tenant_charge)
        except StoreUnavailable as exc:
            log.warning("settle_deferred", request_id=grant.request_id, error=str(exc))
            self._unsettled.append((model, grant, charge))
            if tenant_charge is not None:
                self._tenant_charges[grant.request_id] = tenant_charge
        finally:
            self.wake_freed()

    async def _settle_deferred(self) -> None:
        while self._unsettled:
            model, grant, charge = self._unsettled[0]
            await self.store.settle(model, grant, charge,
                                    self._tenant_charges.get(grant.request_id))
            self._tenant_charges.pop(grant.request_id, None)
            self._unsettled.popleft()
            self.wake_freed()

    def store_lost(self, error: StoreUnavailable) -> None:
        """Redis is unreachable: every queued client of this replica gets a 503 now
        rather than waiting blind (a batch line retries; running streams go on)."""
        if not self._store_down:
            log.warning("store_lost", waiting=len(self.waiters), error=error.message)
        self._store_down = True
        for request_id in list(self.waiters):
            self.cancel(request_id, StoreUnavailable("connection lost while queued; retry"))

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
        restarts = self.metrics.loop_restarts
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
            await self._wake.wait()
            self._wake.clear()
            forced, self._maybe_work = self._maybe_work, False
            for model in models:
                if not forced and self._queued.get(model, 1) == 0:
                    continue  # a slot freed but nothing is queued: no Redis round trip
                try:
                    while await self.dispatch_once(model):
                        pass
                except StoreUnavailable as exc:
                    log.warning("dispatch_failed", model=model, error=str(exc))
                    self._maybe_work = True  # try again on the next wake-up

    async def dispatch_once(self, model: str) -> bool:
        """Fill every open backend's gate from the queues. True when another pass is
        needed right away (a starved class is being served one request at a time).

        Gates come from this replica's own latest scrape of each backend; the Lua script
        re-checks the shared sent-since-snapshot count, so replicas never overshoot."""
        now = time.time()
        since, recent = await self._class_service(model, now)
        owed = owed_class(self.floors, since, recent, now)
        order = service_order(owed)
        gated: dict[str, dict[str, Gate]] = {}
        candidates = []
        handles = {h.name: h for h in self.pool.for_model(model)}  # stable across awaits
        for h in handles.values():
            snap = h.last if h.healthy else None
            gates = gated[h.name] = dict(h.gates_at(now, self.settings.snapshot_stale_s))
            if owed is not None:  # a starved class borrows the top class's gate
                gates[owed] = wider(gates[owed], gates[CLASS_ORDER[0]])
            waiting, running = (snap.waiting, snap.running) if snap else (0, 0)
            candidates.append(Candidate(h.name, waiting, running, h.sent_since_snapshot,
                                        any(g.open for g in gates.values())))
        # one grant at a time while a starved class is owed its floor, so it gets no more
        burst = 1 if owed is not None else max(self.settings.classes[c].max_waiting
                                                for c in CLASS_ORDER)
        locality = self.locality and dataclasses.replace(self.locality, others=tuple(handles))
        for cand in by_load(candidates):
            grants, self._queued[model] = await self.store.dispatch(
                model, cand.name, gated[cand.name], self.replica_id, now,
                self.replica_ttl_s, order, self.floors.window, burst,
                locality=locality, fit=handles[cand.name].fit)
            handles[cand.name].sent_since_snapshot += len(grants)
            for grant in grants:
                self.metrics.dispatches.labels(model, grant.backend, grant.klass).inc()
                self.metrics.on_dispatch_decision(model, grant.backend, grant.reason,
                                                  grant.matched_blocks, grant.prompt_blocks)
                if grant.owner == self.replica_id:
                    self._deliver(model, grant.request_id, grant.backend, grant.rank)
            if grants and owed is not None:
                self._class_view.pop(model, None)
                return True  # decide again who is owed after each such dispatch
            if self._queued[model] == 0:
                break
        return False

    async def _class_service(self, model: str, now: float
                             ) -> tuple[dict[str, float], list[str]]:
        """Backlog times and recent classes, re-read at most once per scrape interval."""
        cached = self._class_view.get(model)
        if cached is None or now - cached[0] > self.settings.scrape_interval_s:
            since, recent = await self.store.class_service(model)
            cached = self._class_view[model] = (now, since, recent)
        return cached[1], cached[2]

    async def started(self, model: str, grant: Grant) -> None:
        """The backend streams this request's first token: its gate slot frees at once."""
        with contextlib.suppress(StoreUnavailable):
            await self.store.mark_started(model, grant, time.time())
        self.wake_freed()

    def _deliver(self, model: str, request_id: str, backend: str, rank: int) -> None:
        waiter = self.waiters.pop(request_id, None)
        if waiter is not None and not waiter.future.done():
            req = waiter.request
            grant = Grant(request_id, req.klass, req.user, rank, self.replica_id, backend,
                          req.enqueued_at)
            self.held[request_id] = grant
            waiter.future.set_result(grant)
            return
        # Nobody waits (the client left between dispatch and delivery): release it.
        task = asyncio.get_running_loop().create_task(self._release_orphan(model, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_orphan(self, model: str, request_id: str) -> None:
        with contextlib.suppress(StoreUnavailable):
            grant = await self.store.dispatched(model, request_id)
            if grant is not None:
                await self.release(model, grant, 0.0)

    async def _listen(self, model: str) -> None:
        while True:
            try:
                item = await self.store.next_grant(model, self.replica_id, 1.0)
            except StoreUnavailable as exc:
                self.store_lost(exc)
                await asyncio.sleep(STORE_RETRY_S)
                continue
            self._listened[model] = time.time()  # reported with the heartbeat
            if item is not None:
                self._deliver(model, *item)

    async def reconcile(self, model: str, now: float) -> int:
        """Release what Redis says this replica holds but it does not: requests whose
        settle a Redis restart lost (an AOF replays up to its last fsync). Returns the
        count. Grants younger than RECONCILE_GRACE_S may still be on their way here."""
        unsettled = {g.request_id for _, g, _ in self._unsettled}
        released = 0
        for grant, dispatched_at in await self.store.held_by(model, self.replica_id):
            if (grant.request_id in self.held or grant.request_id in unsettled
                    or now - dispatched_at < RECONCILE_GRACE_S):
                continue
            if await self.store.settle(model, grant, 0.0):
                released += 1
        if released:
            log.warning("reconciled_inflight", model=model, released=released)
            self.wake_freed()
        return released

    async def _heartbeat(self, models: list[str]) -> None:
        while True:
            try:
                now = time.time()
                await self.store.heartbeat(models, self.replica_id, now, self._listened)
                self._beating.set()
                await self._settle_deferred()
                recovered, self._store_down = self._store_down, False
                self._beats += 1
                for model in models:
                    if await self.store.reap(model, now, self.replica_ttl_s):
                        log.warning("reaped_dead_replica_requests", model=model)
                    if recovered or self._beats % RECONCILE_EVERY == 0:
                        await self.reconcile(model, now)
            except StoreUnavailable as exc:
                self.store_lost(exc)
            self.wake()  # a periodic safety net for enqueues on other replicas
            await asyncio.sleep(self.settings.replica_heartbeat_s)
