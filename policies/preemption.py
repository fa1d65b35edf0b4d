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
  in the gateway), streamed at least its class's ``min_tokens`` (the grace: a stream is
  never taken within its first tokens), was preempted fewer than its class's
  ``max_preemptions`` times, and costs no more to continue than the recompute budget
  allows now (its prompt plus the tokens generated so far: what its continuation sends
  again; :func:`recompute_allowance`). And either
  - it is of a *lower* class that is ``preemptible`` (across classes), or
  - it is of the *same* class, whose ``fair`` switch is on, the waiting request waits at
    the backend (dispatched there: vLLM gives the freed slot to the first of its queue by
    priority, which is the waiting user's; queued in the gateway, the slot would go to
    what the backend has waiting), and the waiting user is below
    its fair share against the victim's user (:func:`below_fair_share`): after the move the
    victim's user still holds at least as many of the model's running slots as the
    waiting user (across tenants: per unit of tenant weight), and the waiting user's
    fairness score (the scheduler's counter, charged at dispatch and at settle) is lower
    than the victim user's by more than ``fair_gap`` (0 by default: strictly lower; a
    user is never preempted for a user served as much or more).
- Among the candidates: the lowest class first, then the most over-served user (the
  highest fairness score of its class, the counter the scheduler keeps), then the one
  whose loss recomputes least (fewest tokens generated so far: the youngest stream), then
  the request id.

One decision preempts at most one request: one freed slot for one waiting request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from policies.classes import class_rank


@dataclass(frozen=True, slots=True)
class PreemptRule:
    """One class's preemption settings."""

    preemptible: bool = False  # its running requests may be preempted for a higher class
    preempt_after_s: float | None = None  # its waiting requests may preempt (None: never)
    max_preemptions: int = 2  # how often one of its requests may be preempted
    max_kv_usage: float | None = None  # KV usage at which a backend is full for it
    fair: bool = False  # its running requests may be preempted for a user of the class
    # below its fair share (same class)
    min_tokens: int = 0  # the grace: a stream that generated fewer is never preempted


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
    tenant: str = ""  # "": the user is its own tenant


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
    prompt: int = 0  # its prompt's tokens: sent again too
    tenant: str = ""  # "": the user is its own tenant

    @property
    def resend(self) -> int:
        """Tokens its continuation sends again (the most a preemption recomputes)."""
        return self.prompt + self.generated


@dataclass(frozen=True, slots=True)
class Preemption:
    victim: Running
    waiter: Waiting


@dataclass(frozen=True, slots=True)
class Shares:
    """Who holds the model's running slots: by user and by tenant, and the tenants'
    weights (a tenant not listed weighs 1)."""

    users: Mapping[str, int]
    tenants: Mapping[str, int]
    weights: Mapping[str, float]

    @classmethod
    def of(cls, running: Sequence[Running],
           weights: Mapping[str, float] | None = None) -> Shares:
        users: dict[str, int] = {}
        tenants: dict[str, int] = {}
        for r in running:
            users[r.user] = users.get(r.user, 0) + 1
            tenant = r.tenant or r.user
            tenants[tenant] = tenants.get(tenant, 0) + 1
        return cls(users, tenants, weights or {})

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)


def is_full(load: BackendLoad, kv_limit: float | None = None) -> bool:
    """Does the backend run all it can? ``kv_limit``: the waiting class's KV limit."""
    if load.batch > 0 and load.running >= load.batch:
        return True
    return kv_limit is not None and load.kv_usage >= kv_limit


def below_fair_share(waiter: Waiting, victim: Running, shares: Shares,
                     fair_gap: float | None = None) -> bool:
    """Is ``waiter``'s user below its fair share against ``victim``'s user? Taking one
    slot from the victim's user leaves it at least as many of the model's running slots
    as the waiting user then holds (across tenants: each tenant's slots per unit of its
    weight; within one, the users' slots), and the waiting user's fairness score is lower
    by more than ``fair_gap`` (None: 0)."""
    if waiter.user == victim.user or waiter.score is None:
        return False
    if not victim.score - waiter.score > (fair_gap or 0.0):
        return False
    wt, vt = waiter.tenant or waiter.user, victim.tenant or victim.user
    if wt != vt:
        return ((shares.tenants.get(vt, 0) - 1) / shares.weight(vt)
                >= (shares.tenants.get(wt, 0) + 1) / shares.weight(wt))
    return shares.users.get(victim.user, 0) - 1 >= shares.users.get(waiter.user, 0) + 1


def may_preempt(waiter: Waiting, victim: Running, rules: Mapping[str, PreemptRule],
                fair_gap: float | None = None, shares: Shares | None = None) -> bool:
    """May ``waiter`` take ``victim``'s slot (class, switches, cap, grace, fair share)?
    ``shares``: who holds the model's slots (None: taken from the victim alone).
    ``fair_gap`` set turns same-class preemption on for every preemptible class (the
    setting of old; the class switch ``fair`` is the one to use)."""
    rule = rules.get(victim.klass)
    if (rule is None or victim.preemptions >= rule.max_preemptions
            or victim.generated < rule.min_tokens):
        return False
    if class_rank(victim.klass) > class_rank(waiter.klass):
        return rule.preemptible
    if victim.klass != waiter.klass or not (rule.fair or (
            rule.preemptible and fair_gap is not None)):
        return False
    # within a class only for a request waiting at the backend: vLLM gives a freed slot
    # to the first of its queue, by priority, and the waiting user's is first there (its
    # rank is below the over-served user's); for one queued in the gateway the slot would
    # go to what the backend has waiting, most likely the over-served user's own
    return waiter.backend is not None and below_fair_share(
        waiter, victim, shares or Shares.of([victim]), fair_gap)


def recompute_allowance(served: float, recomputed: float, ratio: float,
                        burst: float) -> float:
    """Tokens a preemption may still make the backends compute again: ``ratio`` of the
    tokens ``served`` (prompt and output of the answers streamed), plus a ``burst`` (so
    the first preemption need not wait for the first answers), less what was
    ``recomputed`` already. Every preemption spends its victim's :attr:`Running.resend`,
    so the tokens recomputed stay at most ``ratio × served + burst``."""
    return ratio * served + burst - recomputed


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
           fair_gap: float | None = None, budget: float | None = None,
           tenant_weights: Mapping[str, float] | None = None) -> Preemption | None:
    """The one preemption to make now, or None (see the module's rule). ``budget``: the
    tokens a preemption may recompute now (:func:`recompute_allowance`; None: no bound)."""
    loads = {b.name: b for b in backends}
    shares = Shares.of(running, tenant_weights)
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
                      and (budget is None or r.resend <= budget)
                      and may_preempt(waiter, r, rules, fair_gap, shares)]
        if candidates:
            return Preemption(min(candidates, key=_victim_order), waiter)
    return None
