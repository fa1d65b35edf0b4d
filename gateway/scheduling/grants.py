"""The dispatcher's bookkeeping of clients and grants, below every other part of it
(``gateway/scheduling/dispatcher.py`` draws the parts): who waits here for a grant, which
grants this replica holds, and the wake-up of the dispatch loop.

:class:`Waiters` hands a grant to the client that waits for it (:meth:`Waiters.deliver`).
A grant nobody here takes (the client left between dispatch and delivery, or the request
runs here already and a failed-over store granted it again) is a :class:`Leftover`: kept
until the part that settles (``gateway/scheduling/settles.py``) releases it, right after
the call that delivered it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import structlog

from gateway.core.errors import FairgateError
from gateway.storage.records import Grant, QueuedRequest

log = structlog.get_logger("fairgate.dispatcher")


class Signals:
    """The dispatch loop's wake-up, and whether this replica's heartbeat is in Redis."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.maybe_work = False
        self.beating = asyncio.Event()  # this replica's heartbeat is in Redis

    def wake(self) -> None:
        """There may be queued work (an enqueue, a new snapshot, a timer)."""
        self.maybe_work = True
        self.event.set()

    def wake_freed(self) -> None:
        """Room may have appeared (a backend slot freed, a new snapshot): dispatch only
        where requests are known to be queued. Of the replicas, the one that queued a
        request still waiting saw it queued at its latest call (every call returns the
        model's depth), so it is woken; the others need not decide (the heartbeat's
        forced pass is the safety net)."""
        self.event.set()

    def take_forced(self) -> bool:
        """After a wake-up: whether it was for possible work anywhere (a forced pass)."""
        self.event.clear()
        forced, self.maybe_work = self.maybe_work, False
        return forced


@dataclass(slots=True)
class Waiter:
    request: QueuedRequest
    model: str
    future: asyncio.Future[Grant]


@dataclass(frozen=True, slots=True)
class Leftover:
    """A grant no client here takes, to release: ``duplicate`` is the second grant of a
    request that runs here already (only its slot is freed); None: an orphan (its client
    is gone), released whole."""

    model: str
    request_id: str
    duplicate: Grant | None = None


class Waiters:
    """The clients waiting here for a grant, and the grants this replica holds."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.waiting: dict[str, Waiter] = {}
        # grants this replica holds (delivered, not yet released): what "running:<me>"
        # in Redis should say, and what reconcile() makes it say after a Redis restart
        self.held: dict[str, Grant] = {}
        self.leftovers: list[Leftover] = []  # taken by Settles.release_leftovers
        self._cancelling: set[str] = set()  # ids an operator's cancel is removing

    def deliver(self, model: str, request_id: str, backend: str, rank: int,
                charged_prompt: int | None = None) -> None:
        running = self.held.get(request_id)
        if running is not None:
            # granted again (a failed-over store lost the first dispatch and still queued
            # it): it runs here already, never twice; that second grant's slot is freed
            log.warning("duplicate_grant_released", request_id=request_id, backend=backend)
            self.leftovers.append(Leftover(model, request_id, dataclasses.replace(
                running, backend=backend, rank=rank)))
            return
        waiter = self.waiting.pop(request_id, None)
        if waiter is not None and not waiter.future.done():
            req = waiter.request
            grant = Grant(request_id, req.klass, req.user, rank, self.replica_id, backend,
                          req.enqueued_at, charged_prompt=charged_prompt)
            self.held[request_id] = grant
            waiter.future.set_result(grant)
            return
        # Nobody waits (the client left between dispatch and delivery, or a failed-over
        # store granted a request that already ran here): release it.
        self.leftovers.append(Leftover(model, request_id))

    def take_leftovers(self) -> list[Leftover]:
        taken, self.leftovers = self.leftovers, []
        return taken

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

    def being_cancelled(self, request_id: str) -> bool:
        return request_id in self._cancelling

    def cancel(self, request_id: str, error: FairgateError) -> bool:
        """Fail a request this replica holds while it waits for its grant (an operator
        removed it from the queue). True when its client was told."""
        waiter = self.waiting.pop(request_id, None)
        if waiter is None or waiter.future.done():
            return False
        waiter.future.set_exception(error)
        return True
