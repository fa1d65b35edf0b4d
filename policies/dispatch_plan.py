"""One model's dispatch plan from what each backend shows: the pure part of the
dispatcher's decision (``gateway/scheduling/decision.py`` reads the inputs and carries the
plan to the store).

A starved class owed its floor (``policies/starvation.py``) borrows the top class's gate
on every backend and is served one grant at a time; otherwise one decision may make as many
grants as the largest class's ``max_waiting``. The backends with an open gate are tried
least loaded first (``policies/backend_choice.py``), and locality may leave a request only
for a backend that is not down (``policies/gates.py`` ``down``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from policies.backend_choice import Candidate, by_load
from policies.classes import CLASS_ORDER
from policies.gates import Gate, down, wider
from policies.starvation import service_order


@dataclass(frozen=True, slots=True)
class BackendView:
    """One backend as this replica sees it: its gates (one per class) and its load.
    ``waiting`` and ``running`` are its snapshot's (0 without a healthy one)."""

    name: str
    gates: Mapping[str, Gate]
    waiting: int = 0
    running: int = 0
    sent_since_snapshot: int = 0


@dataclass(frozen=True, slots=True)
class DispatchOrder:
    """What a decision tries: classes in ``order``, at most ``burst`` grants, the ``open``
    backends least loaded first with the ``gates`` they dispatch by, and the backends a
    request may be left waiting for (``reachable``: not down)."""

    order: list[str]
    burst: int
    gates: dict[str, dict[str, Gate]]
    open: list[str]
    reachable: tuple[str, ...]


def dispatch_order(backends: Sequence[BackendView], owed: str | None,
                   max_waiting: Mapping[str, int]) -> DispatchOrder:
    """The plan of one decision over ``backends`` while ``owed`` (a class owed its
    starvation floor, or None) is; ``max_waiting`` is each class's burst."""
    gates: dict[str, dict[str, Gate]] = {}
    candidates = []
    for b in backends:
        own = gates[b.name] = dict(b.gates)
        if owed is not None:  # a starved class borrows the top class's gate
            own[owed] = wider(own[owed], own[CLASS_ORDER[0]])
        candidates.append(Candidate(b.name, b.waiting, b.running, b.sent_since_snapshot,
                                    any(g.open for g in own.values())))
    # one grant at a time while a starved class is owed its floor, so it gets no more
    burst = 1 if owed is not None else max(max_waiting[c] for c in CLASS_ORDER)
    return DispatchOrder(service_order(owed), burst, gates,
                         [c.name for c in by_load(candidates)],
                         tuple(name for name, own in gates.items() if not down(own)))
