"""Preemption for fairness: which running request gives its slot to one that waits.

vLLM's priority scheduler reorders only its waiting queue; it never takes a sequence slot
back from a running request. When every slot of a backend runs long batch generations,
an interactive newcomer waits until one of them ends, however fair the queue in front of
it was. The gateway owns every stream and can continue one elsewhere from its token ids
(``gateway/proxy/continuation.py``), so it can take the slot back itself.

The rule, on plain data (``gateway/scheduling/preemption.py`` gathers it from Redis and
carries the decision out):

- A backend is **full** when it runs as many requests as its batch holds (``running`` ≥
  the most seen running at once, the observed ``max_num_seqs``: vLLM does not export it)
  or its KV usage reaches the waiting class's ``max_kv_usage``.
- A request **waits** for preemption when its class has a ``preempt_after_s`` and it has
  waited that long for its first token: queued in the gateway while every backend of its
  model is full, or dispatched to a full backend and waiting there.
- Its **victim** runs on a full backend where it waits (any full one for a request queued
  in the gateway), in a *lower* class that is ``preemptible``, and was preempted fewer
  than that class's ``max_preemptions`` times; with ``fair_gap`` set, a request of the
  *same* preemptible class may be taken too when its user's fairness score exceeds the
  waiting user's by at least ``fair_gap`` (a user far below its fair share).
- Among the candidates: the lowest class first, then the most over-served user (the
  highest fairness score of its class, the counter the scheduler keeps), then the one
  whose loss recomputes least (fewest tokens generated so far), then the request id.

One decision preempts at most one request: one freed slot for one waiting request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from policies.classes import class_rank


@dataclass(frozen=True, slots=True)
class PreemptRule:
    """One class's preemption settings."""

    preemptible: bool = False  # its running requests may be preempted
    preempt_after_s: float | None = None  # its waiting requests may preempt (None: never)
    max_preemptions: int = 2  # how often one of its requests may be preempted
    max_kv_usage: float | None = None  # KV usage at which a backend is full for it


@dataclass(frozen=True, slots=True)
class BackendLoad:
    """What the latest snapshot of a backend says about its batch."""

    name: str
    running: int
    batch: int  # the most requests seen running at once (0: unknown)
    kv_usage: float = 0.0


@dataclass(frozen=True, slots=True)
class Waiting:
    """A request that has not streamed its first token yet."""

    klass: str
    user: str
    waited_s: float
    backend: str | None = None  # dispatched there and waiting; None: queued in the gateway
    score: float | None = None  # its user's fairness score in its class (None: unknown)


@dataclass(frozen=True, slots=True)
class Running:
    """A request that streams on ``backend``."""

    request_id: str
    backend: str
    klass: str
    user: str
    score: float = 0.0  # its user's fairness score in its class: higher = more served
    generated: int = 0  # tokens generated so far: what its continuation sends again
    preemptions: int = 0


@dataclass(frozen=True, slots=True)
class Preemption:
    victim: Running
    waiter: Waiting


def is_full(load: BackendLoad, kv_limit: float | None = None) -> bool:
    """Does the backend run all it can? ``kv_limit``: the waiting class's KV limit."""
    if load.batch > 0 and load.running >= load.batch:
        return True
    return kv_limit is not None and load.kv_usage >= kv_limit


def may_preempt(waiter: Waiting, victim: Running, rules: Mapping[str, PreemptRule],
                fair_gap: float | None = None) -> bool:
    """May ``waiter`` take ``victim``'s slot (class, preemptible, cap, fair share)?"""
    rule = rules.get(victim.klass)
    if rule is None or not rule.preemptible or victim.preemptions >= rule.max_preemptions:
        return False
    if class_rank(victim.klass) > class_rank(waiter.klass):
        return True
    return (victim.klass == waiter.klass and fair_gap is not None
            and waiter.score is not None and victim.score - waiter.score >= fair_gap)


def overdue(waiter: Waiting, rules: Mapping[str, PreemptRule]) -> bool:
    """Has ``waiter`` waited long enough to preempt?"""
    rule = rules.get(waiter.klass)
    return (rule is not None and rule.preempt_after_s is not None
            and waiter.waited_s >= rule.preempt_after_s)


def next_decision_in(waiting: Sequence[Waiting], rules: Mapping[str, PreemptRule],
                     full: Set[str]) -> float | None:
    """Seconds until the rule may decide otherwise for these waiting requests: when the
    first of them that may preempt (queued, or waiting on one of the ``full`` backends)
    has waited long enough (0 when one has already: what it could take may change with
    the next snapshot); None when none may."""
    left = [rule.preempt_after_s - w.waited_s for w in waiting
            if (w.backend is None or w.backend in full)
            and (rule := rules.get(w.klass)) is not None and rule.preempt_after_s is not None]
    return max(0.0, min(left)) if left else None


def _victim_order(r: Running) -> tuple[int, float, int, str]:
    return (-class_rank(r.klass), -r.score, r.generated, r.request_id)


def _waiter_order(w: Waiting) -> tuple[int, float, str]:
    return (class_rank(w.klass), -w.waited_s, w.user)


def choose(waiting: Sequence[Waiting], running: Sequence[Running],
           backends: Sequence[BackendLoad], rules: Mapping[str, PreemptRule],
           fair_gap: float | None = None) -> Preemption | None:
    """The one preemption to make now, or None (see the module's rule)."""
    loads = {b.name: b for b in backends}
    for waiter in sorted(waiting, key=_waiter_order):
        if not overdue(waiter, rules):
            continue
        kv_limit = rules[waiter.klass].max_kv_usage
        full = {name for name, load in loads.items() if is_full(load, kv_limit)}
        if waiter.backend is not None:
            where = {waiter.backend} & full
        else:  # queued in the gateway: only when no backend of its model has room
            where = full if full == set(loads) else set()
        candidates = [r for r in running if r.backend in where
                      and may_preempt(waiter, r, rules, fair_gap)]
        if candidates:
            return Preemption(min(candidates, key=_victim_order), waiter)
    return None
