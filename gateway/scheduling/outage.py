"""The dispatcher while the store is unreachable (``store_outage``; the local queues of
``local``: ``gateway/scheduling/local.py``).

Every part of the dispatcher that finds the store gone tells :meth:`StoreOutage.lost`; the
heartbeat tells :meth:`StoreOutage.answered` when it answers again. Between the two, with
``fail_closed`` the clients queued here get a 503 (behind Sentinel after
``store_failover_wait_s``, unless the promoted master answers first: then the requests it
does not know are queued there again); with ``local`` they are queued and served here, and
handed back to the store when it answers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import structlog

from gateway.core.errors import StoreUnavailable
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import ReadsSettings, SettingsHolder
from gateway.core.waits import event_set
from gateway.scheduling.grants import Signals, Waiters
from gateway.scheduling.local import LocalScheduler
from gateway.storage.queue_store import QueueStore
from gateway.storage.records import QueuedRequest

log = structlog.get_logger("fairgate.dispatcher")


class StoreOutage(ReadsSettings):
    def __init__(self, settings: SettingsHolder, queue: QueueStore, metrics: GatewayMetrics,
                 local: LocalScheduler, waiters: Waiters, signals: Signals) -> None:
        self.holder = settings
        self.queue = queue
        self.metrics = metrics
        self.local = local
        self.waiters = waiters
        self.signals = signals
        self.down = False
        self._back = asyncio.Event()  # set while the store answers
        self._back.set()
        self._outages = 0
        self.unheard: set[str] = set()  # models whose grant listener failed last
        self._background: set[asyncio.Task[None]] = set()

    @property
    def serves_locally(self) -> bool:
        return self.settings.store_outage == "local"

    def lost(self, error: StoreUnavailable) -> None:
        """Redis is unreachable: every queued client of this replica gets a 503 now
        rather than waiting blind (a batch line retries; running streams go on). Behind
        Sentinel they wait up to ``store_failover_wait_s`` for the promoted master
        first (:meth:`_fail_waiters_after`). With ``store_outage: local`` they are queued
        and served here instead (``gateway/scheduling/local.py``) until the store answers
        again (:meth:`_hand_back`)."""
        if not self.down:
            log.warning("store_lost", waiting=len(self.waiters.waiting), error=error.message,
                        serving_locally=self.serves_locally)
            self._back.clear()
            wait_s = self.settings.failover_wait_s()
            if wait_s > 0 and not self.serves_locally:
                self._outages += 1
                self._background_task(self._fail_waiters_after(self._outages, wait_s))
        self.down = True
        if self.serves_locally:
            self.metrics.dispatch.serving_locally.set(1)
            for waiter in list(self.waiters.waiting.values()):
                if not waiter.future.done():
                    self.local.queue(waiter.model, waiter.request, waiter.future)
            self.dispatch_locally()
        elif self.settings.failover_wait_s() == 0:
            self._fail_waiters()

    async def answered(self) -> bool:
        """The store answered (the heartbeat): after an outage the requests served here
        are handed back, or those it forgot queued again. True when it was down."""
        recovered, self.down = self.down, False
        self._back.set()
        if recovered and self.serves_locally:
            await self._hand_back()
        elif recovered and self.settings.failover_wait_s() > 0:
            await self.requeue_waiters()
        return recovered

    def dispatch_locally(self) -> None:
        """Grant what this replica queues itself while the store is unreachable."""
        for model, grant in self.local.dispatch(time.time(), self.settings.snapshot_stale_s):
            # a grant from the store comes too late
            self.waiters.waiting.pop(grant.request_id, None)
            self.metrics.dispatch.local.labels(model, grant.backend, grant.klass).inc()

    async def _hand_back(self) -> None:
        """The store answers again after this replica served locally: the requests
        granted here leave its queues (they run to their end here), and those still
        queued here go back to it with their arrival time unless it still queues them."""
        queued, served = self.local.take_back()
        self.metrics.dispatch.serving_locally.set(0)
        for wait in served:
            r = wait.request
            await self.queue.cancel(wait.model, r.request_id, r.user, r.klass, r.tenant_name,
                                    r.session)
        await self.requeue_waiters()  # the waiters still queued here
        log.info("store_back", handed_back=len(queued), served_locally=len(served))

    def _fail_waiters(self, spared: frozenset[str] = frozenset()) -> None:
        for request_id, waiter in list(self.waiters.waiting.items()):
            if waiter.model not in spared:
                self.waiters.cancel(request_id,
                                    StoreUnavailable("connection lost while queued; retry"))

    async def _fail_waiters_after(self, outage: int, wait_s: float) -> None:
        """The store is still unreachable ``wait_s`` after the outage began: the queued
        clients get their 503 (a failover takes longer than it may). Behind Redis Cluster
        a model whose grant listener did not fail its last turn (its blocking read fails
        within ``redis_socket_timeout_s`` and a turn on a shard that is gone) lives on a
        shard that answers: its clients stay queued, to be dispatched there as before."""
        await event_set(self._back, wait_s)
        if self.down and outage == self._outages:
            waiting = self.waiters.waiting
            spared = frozenset() if self.settings.redis_cluster is None else frozenset(
                w.model for w in waiting.values()) - self.unheard
            log.warning("store_failover_wait_over", waiting=len(waiting), wait_s=wait_s,
                        models_reachable=sorted(spared), models_unheard=sorted(self.unheard))
            self._fail_waiters(spared)

    async def back_by(self, deadline: float, error: StoreUnavailable) -> bool:
        """A call failed on the store: behind Sentinel, wait until it is back (a
        failover) but not past ``deadline`` (monotonic). True when it is back."""
        if self.settings.failover_wait_s() == 0:
            return False
        self.lost(error)
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        return await event_set(self._back, left)

    async def enqueue_after(self, model: str, req: QueuedRequest,
                            error: StoreUnavailable) -> int:
        """Behind Sentinel: wait for the promoted master (``store_failover_wait_s`` at
        most), then queue the request there, once (the failed call may have reached the
        old master and been replicated). Raises ``error`` otherwise."""
        ends = time.monotonic() + self.settings.failover_wait_s()
        while await self.back_by(ends, error):
            try:
                await self.requeue(model, [req])
                return 1
            except StoreUnavailable as exc:
                error = exc
        raise error

    async def requeue(self, model: str, reqs: list[QueuedRequest]) -> int:
        """Queue again requests the store forgot while their clients wait here (a
        promoted replica missed the last writes), with their first arrival time; the
        ones it still knows stay as they are. Returns how many went in."""
        positions, _ = await self.queue.enqueue_many(
            model, reqs, self.settings.max_queued_per_user, requeue=True)
        again = sum(p > 0 for p in positions)
        if again:
            log.warning("requeued_forgotten", model=model, requests=again)
            self.signals.wake()
        return again

    async def requeue_waiters(self) -> None:
        """After an outage behind Sentinel: every client still queued here whose request
        the (new) master does not know is queued again."""
        by_model: dict[str, list[QueuedRequest]] = {}
        for waiter in list(self.waiters.waiting.values()):
            if not waiter.future.done():
                by_model.setdefault(waiter.model, []).append(waiter.request)
        for model, reqs in by_model.items():
            await self.requeue(model, reqs)

    def _background_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
