"""The dispatch loop: decides on its own only what the calls requests make anyway did not
serve (a new snapshot while requests are known to be queued, a backlog left after them,
the heartbeat's safety net), then checks preemption. Its pass is one call per model,
whatever the number of backends: the open ones in load order until nothing is queued
(``lua/dispatch.lua``)."""

from __future__ import annotations

import contextlib
import time

import structlog

from gateway.core.errors import StoreUnavailable
from gateway.core.waits import event_set
from gateway.scheduling.decision import Planner
from gateway.scheduling.grants import Signals
from gateway.scheduling.held_starts import HeldStarts
from gateway.scheduling.outage import StoreOutage
from gateway.scheduling.preemption import Preemptor
from gateway.scheduling.settles import Settles
from gateway.storage.queue_store import QueueStore

log = structlog.get_logger("fairgate.dispatcher")


class DispatchLoop:
    def __init__(self, queue: QueueStore, planner: Planner, starts: HeldStarts,
                 settles: Settles, preemptor: Preemptor, outage: StoreOutage,
                 signals: Signals) -> None:
        self.queue = queue
        self.planner = planner
        self.starts = starts
        self.settles = settles
        self.preemptor = preemptor
        self.outage = outage
        self.signals = signals

    async def run(self, models: list[str]) -> None:
        # the script drops requests of replicas without a heartbeat: ours must be there
        await self.signals.beating.wait()
        while True:
            # woken by work, or when a preemption check comes due (a request waits on a
            # full backend: nothing else need happen for it to preempt)
            due_in = self.preemptor.recheck_in(time.monotonic())
            await event_set(self.signals.event, due_in)
            forced = self.signals.take_forced()
            if self.outage.down and self.outage.serves_locally:
                self.outage.dispatch_locally()
                continue
            for model in models:
                await self._pass(model, forced)

    async def _pass(self, model: str, forced: bool) -> None:
        # room appeared (a slot freed, a snapshot): a decision only where requests are
        # known to be queued
        queued = forced or self.planner.queued.get(model, 1) > 0
        due = self.preemptor.due(model, time.monotonic())
        if not (queued or due or self.starts.pending(model)):
            return
        try:
            while queued and await self.dispatch_once(model):
                pass
            if queued or due:
                await self._preempt(model)
            else:  # the starts held go, so that the others' gates see what runs
                await self.starts.send(model)
        except StoreUnavailable as exc:
            log.warning("dispatch_failed", model=model, error=str(exc))
            self.signals.maybe_work = True  # try again on the next wake-up

    async def _preempt(self, model: str) -> None:
        """After a pass over ``model``: preemption, when one of its backends is full."""
        full = self.preemptor.full(model, time.time())
        if full and self.starts.pending(model):
            await self.starts.send(model)
        await self.preemptor.check(model, full, self.planner.queued.get(model, 0))

    async def dispatch_once(self, model: str) -> bool:
        """Fill every open backend's gate from the queues. True when another pass is
        needed right away (a starved class is being served one request at a time).

        Gates come from this replica's own latest scrape of each backend; the Lua script
        re-checks the shared sent-since-snapshot count, so replicas never overshoot."""
        plan = await self.planner.plan(model, time.time())
        if not plan.open:
            return False
        starts = self.starts.take(model)
        try:
            with contextlib.ExitStack() as deciding:
                for backend in plan.open:
                    deciding.enter_context(self.planner.decision(model, backend))
                # one call tries the open backends in order, until nothing is queued (or
                # after the first grant while a class is owed its floor)
                decided = await self.queue.dispatch_with(
                    model, [self.planner.dispatch_args(model, plan, b) for b in plan.open],
                    starts, until_grant=plan.owed is not None)
        except StoreUnavailable:
            self.starts.hold(model, starts)
            raise
        again = False
        for done in decided:
            # decide again who is owed after each such dispatch
            again = self.planner.granted(model, plan, done) or again
        self.settles.release_leftovers()
        return again
