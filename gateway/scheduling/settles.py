"""Releasing grants: a dispatched request's settle, the settles Redis missed, and the
grants nobody here takes (``gateway/scheduling/grants.py`` ``Leftover``).

While requests are queued the slot a settle frees grants its backend's next requests in
the same call (``lua/lib/dispatch.lua``). While Redis is down a settle waits here and the
heartbeat retries it (:meth:`Settles.settle_deferred`), so no in-flight count leaks (a
leaked one would hold a gate closed for good).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

from gateway.core.errors import StoreUnavailable
from gateway.scheduling.decision import Planner
from gateway.scheduling.grants import Signals, Waiters
from gateway.scheduling.held_starts import HeldStarts
from gateway.scheduling.local import LocalScheduler
from gateway.storage.records import Grant, Start
from gateway.storage.store import Store
from gateway.storage.values import UsageCounts

log = structlog.get_logger("fairgate.dispatcher")


@dataclass(frozen=True, slots=True)
class Settle:
    """A settle Redis missed, retried by the heartbeat loop."""

    model: str
    grant: Grant
    charge: float
    tenant_charge: float | None
    usage: UsageCounts | None
    starts: tuple[Start, ...] = ()  # held starts it carries


class Settles:
    def __init__(self, store: Store, local: LocalScheduler, waiters: Waiters,
                 starts: HeldStarts, planner: Planner, signals: Signals) -> None:
        self.store = store
        self.local = local
        self.waiters = waiters
        self.starts = starts
        self.planner = planner
        self.signals = signals
        self.unsettled: deque[Settle] = deque()  # settles Redis missed
        self._background: set[asyncio.Task[None]] = set()

    async def release(self, model: str, grant: Grant, charge: float,
                      tenant_charge: float | None = None,
                      usage: UsageCounts | None = None) -> None:
        """Settle a dispatched request (idempotent), with its ``usage`` counts, and let the
        next one go: while requests are queued the freed slot grants its backend's next
        ones in the same call. While Redis is down the settle waits in memory and is
        retried by the heartbeat loop."""
        self.waiters.held.pop(grant.request_id, None)
        if grant.local:  # granted here while the store was unreachable: settled here
            self.local.release(model, grant, charge, tenant_charge)
            self.signals.wake_freed()
            return
        starts = self.starts.take(model)
        try:
            plan, then = await self.planner.fold(model, grant.backend)
            with self.planner.decision(model, grant.backend if then else None):
                _, done = await self.store.queue.settle_and_dispatch(
                    model, grant, charge, tenant_charge, usage, then, starts)
        except StoreUnavailable as exc:
            log.warning("settle_deferred", request_id=grant.request_id, error=str(exc))
            self.unsettled.append(Settle(model, grant, charge, tenant_charge, usage,
                                         tuple(starts)))
            self.signals.wake_freed()
            return
        if plan is None or done is None or self.planner.granted(model, plan, done):
            self.signals.wake_freed()
        self.release_leftovers()

    def unsettled_ids(self) -> set[str]:
        return {s.grant.request_id for s in self.unsettled}

    async def settle_deferred(self) -> None:
        while self.unsettled:
            s = self.unsettled[0]
            await self.store.queue.settle_and_dispatch(s.model, s.grant, s.charge, s.tenant_charge,
                                                 s.usage, starts=s.starts)
            self.unsettled.popleft()
            self.signals.wake_freed()

    def release_leftovers(self) -> None:
        """Release the grants the latest deliveries found nobody to take, in the
        background (a second grant of a request running here frees only its slot)."""
        for left in self.waiters.take_leftovers():
            if left.duplicate is not None:
                self._background_task(self._release_duplicate(left.model, left.duplicate))
            else:
                self._background_task(self._release_orphan(left.model, left.request_id))

    async def _release_duplicate(self, model: str, grant: Grant) -> None:
        with contextlib.suppress(StoreUnavailable):  # else reconcile() releases it
            if await self.store.queue.settle(model, grant, 0.0):
                self.signals.wake_freed()

    async def _release_orphan(self, model: str, request_id: str) -> None:
        with contextlib.suppress(StoreUnavailable):
            grant = await self.store.replicas.dispatched(model, request_id)
            if grant is not None:
                await self.release(model, grant, 0.0)

    def _background_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
