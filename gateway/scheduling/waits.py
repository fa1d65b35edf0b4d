"""Wait estimates of queued requests: the measured dispatch rate and the queue's picture.

:class:`Waits` measures the grants this replica's requests receive (a
:class:`~policies.wait_estimate.DispatchMeter` per model and class), reads where a request
stands from Redis (its user's score and queue, the other users of its class, the higher
classes' backlog, the starvation floor's timing) and asks ``policies/wait_estimate.py``
for its position and expected wait. The same estimate gives every ``Retry-After``.

Each replica measures the grants of its own clients: with several replicas behind one
load balancer the rate it sees is its share, and its estimates are longer than the truth.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.core.errors import StoreUnavailable
from gateway.core.settings import ReadsSettings, SettingsHolder
from gateway.storage.read_store import ReadStore
from gateway.storage.records import QueuedUser
from policies.classes import CLASS_ORDER, class_rank
from policies.wait_estimate import (
    DispatchMeter,
    Ewma,
    UserQueue,
    ahead_in_class,
    estimate_wait_s,
    retry_after_s,
)

PICTURE_USERS = 128  # users read per class for an estimate (the smallest scores)
PICTURE_TTL_S = 0.1  # the other users' queues are re-read at most this often per model


@dataclass(frozen=True, slots=True)
class Place:
    """Where a queued (or about to be queued) request stands."""

    position: int  # requests expected to be dispatched before it, all classes
    ahead_in_class: int
    wait_s: float | None  # None: nothing measured yet


@dataclass(frozen=True, slots=True)
class QueuedStatus:
    request_id: str
    model: str
    user: str
    klass: str
    enqueued_at: float
    place: Place
    tenant: str = ""  # the tenant it is queued in ("": the one named after its user)


class Waits(ReadsSettings):
    def __init__(self, settings: SettingsHolder, store: ReadStore) -> None:
        self.holder = settings
        self.store = store
        self.meter = DispatchMeter()
        self.started_s = time.monotonic()
        self._pictures: dict[str, tuple[float, list[QueuedUser], dict[str, float]]] = {}
        self._to_first_token: dict[str, Ewma] = {}

    def dispatched(self, model: str, klass: str) -> None:
        self.meter.record((model, klass), time.monotonic())

    def first_token(self, model: str, after_dispatch_s: float) -> None:
        """A stream's first token came ``after_dispatch_s`` after its dispatch."""
        self._to_first_token.setdefault(model, Ewma()).add(after_dispatch_s)

    def to_first_token_s(self, model: str) -> float:
        """The recent time from dispatch to first token (0 before any was measured): the
        part of a first-token deadline the queue cannot use."""
        ewma = self._to_first_token.get(model)
        return 0.0 if ewma is None or ewma.value is None else ewma.value

    def rate(self, model: str) -> float | None:
        """The model's measured dispatches per second (every class); with none in the
        window, the fastest rate consistent with that."""
        now = time.monotonic()
        measured = self.meter.total([(model, c) for c in CLASS_ORDER], now)
        return measured if measured is not None else self.meter.idle_bound(self.started_s, now)

    async def place(self, model: str, klass: str, user: str, cost: float,
                    request_id: str | None = None, head: bool = False) -> Place:
        """A queued request's place (``request_id``), that of a new request of ``user``
        with dispatch cost ``cost`` if it were queued now, or (``head``) that of the
        user's oldest queued request."""
        depths = await self.store.depths(model)
        rank = class_rank(klass)
        higher = sum(depths[c] for c in CLASS_ORDER[:rank])
        if higher == 0 and depths[klass] == 0:
            return Place(0, 0, 0.0)
        score, index = await self.store.queue_place(model, klass, user, request_id)
        queued, since = await self._picture(model)
        users = [u for u in queued if u.klass == klass]
        others = [UserQueue(u.score, u.queued) for u in users if u.user != user]
        if score is None:  # a newcomer is lifted to the smallest active score
            score = min((u.score for u in users), default=0.0)
        ahead = ahead_in_class(score, 0 if head else index or 0, cost, others)
        floor_in_s, lower_share = self._floors(klass, depths, since)
        wait = estimate_wait_s(ahead, higher, self.rate(model),
                               self.settings.class_floors.get(klass, 0.0), floor_in_s,
                               lower_share)
        return Place(higher + ahead, ahead, wait)

    async def _picture(self, model: str) -> tuple[list[QueuedUser], dict[str, float]]:
        """The active users of every class and since when each class is backlogged,
        re-read at most every ``PICTURE_TTL_S`` (many deadlines arriving at once)."""
        now = time.monotonic()
        cached = self._pictures.get(model)
        if cached is None or now - cached[0] > PICTURE_TTL_S:
            users = await self.store.queued_users(model, PICTURE_USERS)
            since, _ = await self.store.class_service(model)
            cached = self._pictures[model] = (now, users, since)
        return cached[1], cached[2]

    def _floors(self, klass: str, depths: dict[str, int], since: dict[str, float]
                ) -> tuple[float, float]:
        """(seconds until ``klass`` is owed its floor, the share lower classes owed
        theirs take now)."""
        after = self.settings.starvation_after_s
        now = time.time()
        began = since.get(klass)
        floor_in_s = after if began is None else max(0.0, began + after - now)
        lower_share = sum(self.settings.class_floors.get(c, 0.0)
                          for c in CLASS_ORDER[class_rank(klass) + 1:]
                          if depths.get(c) and c in since and since[c] + after <= now)
        return floor_in_s, lower_share

    async def status(self, models: list[str], request_id: str) -> QueuedStatus | None:
        """A queued request's status, looked up in every model; None when it is not
        queued (dispatched, finished, expired or unknown)."""
        for model in models:
            fields = await self.store.request_fields(model, request_id)
            if not fields:
                continue
            if fields.get("state") != "queued":
                return None
            klass, user = fields["class"], fields["user"]
            place = await self.place(model, klass, user, float(fields.get("cost") or 0.0),
                                     request_id)
            return QueuedStatus(request_id, model, user, klass,
                                float(fields.get("enqueued_at") or 0.0), place,
                                fields.get("tenant") or user)
        return None

    def retry_after(self, wait_s: float | None) -> int:
        """``Retry-After`` for a wait estimate (the settings' ``retry_after_s`` as floor)."""
        return retry_after_s(wait_s, self.settings.retry_after_s)

    async def estimator(self, model: str, klass: str, depths: dict[str, int] | None = None
                        ) -> Callable[[int], float | None]:
        """The wait of a request of ``klass`` with a given number of its class before it
        (behind every higher class's backlog, ``depths``: the model's, read when None), at
        the measured rate: one read of Redis for many estimates (the pools' wait
        quantiles, ``gateway/ops/pools.py``)."""
        if depths is None:
            depths = await self.store.depths(model)
        higher = sum(depths[c] for c in CLASS_ORDER[:class_rank(klass)])
        _, since = await self._picture(model)
        floor_in_s, lower_share = self._floors(klass, depths, since)
        rate, floor = self.rate(model), self.settings.class_floors.get(klass, 0.0)
        return lambda ahead: estimate_wait_s(ahead, higher, rate, floor, floor_in_s,
                                             lower_share)

    async def drain_retry_after(self, model: str, klass: str) -> int:
        """``Retry-After`` when a request of ``klass`` is turned away: the time the
        measured rate takes to drain what is queued in its class and above (the floor
        when Redis cannot say or nothing was measured)."""
        wait: float | None = None
        with contextlib.suppress(StoreUnavailable):
            depths = await self.store.depths(model)
            wait = (await self.estimator(model, klass, depths))(depths[klass])
        return self.retry_after(wait)

    async def next_turn_retry_after(self, model: str, klass: str, user: str,
                                    cost: float) -> int:
        """``Retry-After`` for a user whose queue is full: the estimate of its next
        dispatch (a slot in its queue frees then)."""
        wait: float | None = None
        with contextlib.suppress(StoreUnavailable):
            wait = (await self.place(model, klass, user, cost, head=True)).wait_s
        return self.retry_after(wait)
