"""First tokens held back (the why: ``gateway/scheduling/dispatcher.py``'s docstring).

A first token matters to the decision only when something is queued that the slot it frees
could take. While the latest decision left nothing queued for the model, :meth:`HeldStarts.
started` holds the start here; the next call to the store for the model takes the starts
held (:meth:`HeldStarts.take`) and puts them back when it fails (:meth:`HeldStarts.hold`).
"""

from __future__ import annotations

import time

from gateway.core.errors import StoreUnavailable
from gateway.scheduling.decision import Planner
from gateway.scheduling.grants import Signals
from gateway.storage.queue_store import QueueStore
from gateway.storage.records import Grant, Start


class HeldStarts:
    """The starts not yet sent, by model."""

    def __init__(self, queue: QueueStore, planner: Planner, signals: Signals) -> None:
        self.queue = queue
        self.planner = planner
        self.signals = signals
        self._starts: dict[str, dict[str, Start]] = {}

    def pending(self, model: str) -> bool:
        return bool(self._starts.get(model))

    def hold(self, model: str, starts: list[Start]) -> None:
        held = self._starts.setdefault(model, {})
        for start in starts:
            held.setdefault(start.request_id, start)

    def take(self, model: str) -> list[Start]:
        """The starts held for ``model``, handed to the call about to go (it puts them
        back when it fails: marking a start twice, or after its settle, changes nothing)."""
        return list(self._starts.pop(model, {}).values())

    async def started(self, model: str, grant: Grant) -> None:
        """The backend streams this request's first token. While nothing is known to be
        queued for the model the start is held, to ride on the model's next call to Redis;
        otherwise it goes at once (with the starts held), its gate slot frees, and the same
        call grants the backend's next requests."""
        if grant.local:
            return  # the store never counted it
        start = Start(grant.request_id, grant.backend, time.time())
        if self.planner.nothing_queued(model):
            self.hold(model, [start])
            return
        starts = [*self.take(model), start]
        try:
            plan, then = await self.planner.fold(model, grant.backend)
            with self.planner.decision(model, grant.backend if then else None):
                done = await self.queue.mark_started(model, grant, start.at, then,
                                                     held=starts[:-1])
        except StoreUnavailable:
            self.hold(model, starts)  # sent with the next call, the settle at the latest
            self.signals.wake_freed()
            return
        if then is None:
            self.signals.wake_freed()
        elif plan is not None and done is not None and self.planner.granted(model, plan, done):
            self.signals.wake()

    async def send(self, model: str) -> None:
        """A backend of the model runs full: the starts held back go now, so that a
        preemption decision, this replica's or another's, sees what runs. Held while
        nothing was queued, they would wait for this replica's next call for the model,
        which gates closed by a slow TPOT may put off until an answer ends."""
        starts = self.take(model)
        try:
            await self.queue.mark_starts(model, starts)
        except StoreUnavailable:
            self.hold(model, starts)
            raise
