"""Starvation protection: a guaranteed minimum share for backlogged lower classes.

Classes are served in strict order (interactive > default > batch), which can starve the
lower ones forever under sustained load. A lower class that has been backlogged for
``after_s`` is owed a floor: whenever its share of the last ``window`` dispatches is below
its floor, it goes first for one dispatch, using the top class's gate (its own gate, e.g.
batch's "only when the backend queue is empty", would never open under saturation). So
under continuous interactive saturation batch gets about its floor (5 %, set in
``policies/classes.py``) and no more; when the load stops, batch's own gate opens and it
fills the backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from policies.classes import CLASS_ORDER, default_floors


@dataclass(frozen=True, slots=True)
class FloorPolicy:
    floors: Mapping[str, float] = field(default_factory=default_floors)
    after_s: float = 30.0
    window: int = 100


def owed_class(policy: FloorPolicy, backlogged_since: Mapping[str, float],
               recent: Sequence[str], now_s: float) -> str | None:
    """The lower class owed its floor right now, if any (higher classes first)."""
    for klass in CLASS_ORDER[1:]:
        floor = policy.floors.get(klass, 0.0)
        since = backlogged_since.get(klass)
        if floor <= 0 or since is None or now_s - since < policy.after_s:
            continue
        served = sum(1 for c in recent[: policy.window] if c == klass)
        if served < floor * max(len(recent[: policy.window]), 1):
            return klass
    return None


def remember(recent: Sequence[str], klass: str, kept: int) -> list[str]:
    """The classes of the latest dispatches, newest first, after one of ``klass`` (the
    ``recent`` list ``gateway/storage/lua/lib/inflight.lua`` keeps, ``kept`` long)."""
    return [klass, *recent][:kept]


def service_order(owed: str | None) -> list[str]:
    """Classes in the order the next dispatch tries them."""
    if owed is None:
        return list(CLASS_ORDER)
    return [owed, *(c for c in CLASS_ORDER if c != owed)]
