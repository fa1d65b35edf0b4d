"""When will a queued request be dispatched? Position, wait estimate and Retry-After.

Pure: plain numbers in, a decision out. The gateway reads the queue's picture from Redis
and the dispatch rate it measured (:class:`DispatchMeter`), and asks:

- :func:`ahead_in_class` — how many requests of its own class go before it. Users are
  served smallest score first and each dispatch adds its cost to its user's score
  (``policies/fairness.py``), so another user with score ``s_v`` gets its requests in
  while ``s_v + k·cost`` stays below the score this request's user will have when it is
  its turn (its own score plus one cost per request of its own queued before it). Every
  request is assumed to cost what this one costs (the other users' costs are not read).
- :func:`estimate_wait_s` — the time those requests, and the higher classes' backlog,
  take at the measured dispatch rate. Classes go in strict order, except that a lower
  class backlogged for ``starvation_after_s`` is owed its floor share
  (``policies/starvation.py``): from then on it drains at ``floor × rate`` while the
  higher backlog lasts. Lower classes owed their floor take their share of the rate too.
  Requests that arrive later in higher classes are not foreseen: an estimate, not a
  promise. ``None`` when nothing was measured yet (the gateway then refuses nothing early);
  when nothing was dispatched for a while, :meth:`DispatchMeter.idle_bound` stands in.
- :func:`retry_after_s` — a ``Retry-After`` from an estimate, within a floor and ceiling.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

RATE_WINDOW_S = 10.0  # the dispatch rate is measured over this moving window
MIN_SPAN_S = 1.0  # a rate is never measured over less time than this (one event ≠ ∞/s)
RETRY_AFTER_CEILING_S = 60  # the longest Retry-After fairgate sends


@dataclass(frozen=True, slots=True)
class UserQueue:
    """Another user's queue in the request's class: its score and how many are queued."""

    score: float
    queued: int


def ahead_in_class(own_score: float, own_index: int, cost: float,
                   others: Iterable[UserQueue]) -> int:
    """Requests of the same class dispatched before this one: the ``own_index`` requests
    of its own user queued before it, and each other user's requests whose score stays
    below the score its user reaches by then (ties count as ahead)."""
    step = cost if cost > 0 else 1.0
    turn = own_score + own_index * step
    ahead = own_index
    for other in others:
        if other.queued <= 0:
            continue
        served = math.floor((turn - other.score) / step) + 1 if turn >= other.score else 0
        ahead += min(other.queued, served)
    return ahead


def estimate_wait_s(ahead: int, higher_backlog: int, rate: float | None, floor: float = 0.0,
                    floor_in_s: float = 0.0, lower_share: float = 0.0) -> float | None:
    """Seconds until a request is dispatched, ``ahead`` requests of its class and
    ``higher_backlog`` of higher classes before it, at ``rate`` dispatches/s of the model.

    ``floor``: the class's starvation floor share, owed after ``floor_in_s`` more seconds
    of backlog (0: now). ``lower_share``: what lower classes owed their floor take of the
    rate. ``None`` when the request waits behind others and no rate was measured."""
    if ahead <= 0 and higher_backlog <= 0:
        return 0.0
    if rate is None or rate <= 0:
        return None
    capacity = rate * max(0.0, 1.0 - min(lower_share, 0.5))
    if higher_backlog <= 0:
        return ahead / capacity
    high_alone_s = higher_backlog / capacity
    if floor <= 0 or floor >= 1:
        return high_alone_s + ahead / capacity
    # strict order until the floor is owed, then the class gets `floor` of the dispatches
    before = min(max(floor_in_s, 0.0), high_alone_s)
    left_high = higher_backlog - capacity * before
    shared_s = left_high / ((1.0 - floor) * capacity)
    if ahead <= floor * capacity * shared_s:
        return before + ahead / (floor * capacity)
    return before + shared_s + (ahead - floor * capacity * shared_s) / capacity


def retry_after_s(estimate_s: float | None, floor_s: int,
                  ceiling_s: int = RETRY_AFTER_CEILING_S) -> int:
    """Whole seconds for ``Retry-After``: the estimate rounded up, within
    [``floor_s``, ``ceiling_s``]; ``floor_s`` when there is no estimate."""
    if estimate_s is None or not math.isfinite(estimate_s):
        return floor_s
    return max(floor_s, min(ceiling_s, math.ceil(estimate_s)))


class DispatchMeter:
    """Dispatches per second per key (e.g. ``(model, class)``) over a moving window.

    Times are the caller's clock (monotonic seconds). A key's rate is its events in the
    window divided by the window, or by the time since the meter's first event when that
    is shorter (at least ``MIN_SPAN_S``); ``None`` until a key has an event."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._events: dict[Hashable, deque[float]] = {}
        self._since: float | None = None

    def record(self, key: Hashable, now: float) -> None:
        if self._since is None:
            self._since = now
        self._events.setdefault(key, deque()).append(now)
        self._prune(key, now)

    def rate(self, key: Hashable, now: float) -> float | None:
        events = self._prune(key, now)
        if not events or self._since is None:
            return None
        span = max(MIN_SPAN_S, min(self.window_s, now - self._since))
        return len(events) / span

    def total(self, keys: Iterable[Hashable], now: float) -> float | None:
        """The summed rate of ``keys``; ``None`` when none has an event."""
        rates = [r for r in (self.rate(k, now) for k in keys) if r is not None]
        return sum(rates) if rates else None

    def idle_bound(self, started_s: float, now: float) -> float | None:
        """With no event in the window: the fastest rate that is consistent with it (at
        most one event over the time watched since ``started_s``, at most the window) —
        so requests queued behind others while nothing is dispatched (a cold start
        behind a full backend) are not estimated to wait nothing. ``None`` within
        ``MIN_SPAN_S`` of ``started_s``."""
        watched = min(self.window_s, now - started_s)
        return None if watched < MIN_SPAN_S else 1.0 / watched

    def _prune(self, key: Hashable, now: float) -> deque[float] | None:
        events = self._events.get(key)
        if events is None:
            return None
        while events and events[0] <= now - self.window_s:
            events.popleft()
        if not events:
            del self._events[key]
            return None
        return events


class Ewma:
    """Exponentially weighted mean of observations; ``None`` before the first."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


# A queued request can still be overtaken after the estimate: users who arrive later with
# smaller fairness scores go first. A deadline is taken as meetable only when the estimate
# leaves this share of the time left unused (measured: `fairgate bench deadlines`).
DEADLINE_MARGIN = 0.8


def fits_deadline(wait_s: float, left_s: float) -> bool:
    """Whether a queue wait estimate fits ``left_s`` (with the margin)."""
    return wait_s <= left_s * DEADLINE_MARGIN
