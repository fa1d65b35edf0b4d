"""How many backends a pool needs: its queued demand against its measured service rate.

Pure: plain numbers in, a replica count out; the caller passes the clock and the previous
:class:`ScaleState` and keeps the one returned. ``gateway/ops/pools.py`` reads the inputs
(queues in Redis, the backends' published counters, the wait estimator) and publishes the
answer as ``fairgate_pool_desired_replicas{pool}``; ``docs/autoscaling.md`` explains it.

**The need** (:func:`replicas_needed`, fractional replicas). Work is counted in tokens the
GPU computes: a queued request's estimated uncached prompt tokens plus its expected output
tokens. ``μ`` is one backend's measured service rate (tokens/s). Classes are served in
strict order, so a class with a queue-wait target ``T`` waits behind its own backlog and
every higher class's. Little's law (a queue of ``B`` drained within ``T`` needs a rate of
``B / T``) on top of the load the pool serves now (``λ``, tokens/s, of the classes at or
above it) gives, for each targeted class ``c``::

    need_c = (Σ_{k ≤ c} λ_k / ρ + Σ_{k ≤ c} B_k / T_c) / μ

``ρ`` is the target utilization (``autoscale.target_utilization``, 1 by default): the share
of each backend's rate the load served now may take. Below 1 it keeps spare capacity for
a burst: new backends take a cold start to come, and a pool sized for its load at ρ
absorbs a step of 1/ρ× its load meanwhile (ρ = 0.25: a 4× step) instead of refusing
or missing the step's requests until they arrive.

A class without a target (batch) only fills idle capacity: its own throughput buys
nothing. Its backlog counts only through its completion window: with ``L`` seconds left
of it (times :data:`WINDOW_MARGIN`), the whole queue ahead of and in it must drain in
time::

    need_batch = (Σ_targeted λ_k / ρ + Σ_all B_k / (L · margin)) / μ

which exceeds the replicas there are (at least one) only when the window is at risk
(:func:`window_at_risk`).
The pool needs the largest of these, and never less than one backend while anything is
queued or running there (a pool at zero reports 1: scale from zero).

**Room for a burst over the usual load** (:func:`with_burst_baseline`, optional:
``autoscale.burst_baseline_s`` > 0). Sized on the load now, the room of ρ < 1 grows with
the burst itself: at a 4× peak, ρ = 0.25 asks for room for another 4× on top of it. With
a baseline window ``W`` the room is kept over the pool's *usual* targeted load instead,
``λ_base``: the :data:`BASELINE_QUANTILE` quantile of its targeted load over the last
``W`` seconds, which a burst shorter than about three quarters of ``W`` does not move.
The targeted classes' load terms then take the load now at ρ = 1, and one more need
joins them::

    need_burst = λ_base / ρ / μ

**The decision** (:func:`decide`): up at once to ``ceil(need)``; down only when even
``need × (1 + headroom)`` fits in fewer replicas (hysteresis), and only after that held
for ``scale_down_delay_s`` without a break, to the largest count seen meanwhile — so the
answer never drops twice within one delay, and never drops within a delay of rising.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

BASELINE_QUANTILE = 0.25
"""The burst baseline: this quantile of the targeted load over ``burst_baseline_s``."""
BURST = "burst room"  # the burst baseline's need, beside the classes' in class_needs
WINDOW_MARGIN = 0.8
"""A batch backlog is planned to finish within this share of its completion window."""
EPSILON = 1e-9  # a need of 2.0000000001 replicas (float noise) is 2
MAX_NEED = 10_000.0  # replicas: the answer's bound (a window already past needs "all")


@dataclass(frozen=True, slots=True)
class ClassDemand:
    """One class's demand on a pool, in service order."""

    klass: str
    queued_tokens: float  # estimated uncached prompt + expected output tokens queued
    queued_requests: float
    served_tokens_per_s: float  # its share of what the pool serves now (λ)
    target_s: float | None  # its queue-wait target; None: fills idle capacity (batch)


@dataclass(frozen=True, slots=True)
class PoolDemand:
    """What one pool (a model and prompt range) is asked for and what it has."""

    classes: Sequence[ClassDemand]
    backend_tokens_per_s: float | None  # μ: one backend's measured rate (None: never measured)
    ready: int  # backends that take work now
    running: int = 0  # requests running at its backends
    window_left_s: float | None = None  # the earliest untargeted (batch) deadline left
    utilization: float = 1.0  # ρ: the share of μ the targeted classes' load may use
    # λ_base (tokens/s): the usual targeted load the burst room is kept over; None: the
    # load now (ρ applies to it)
    burst_load: float | None = None

    @property
    def queued(self) -> float:
        return sum(c.queued_requests for c in self.classes)

    @property
    def targeted_load(self) -> float:
        """What the classes with a target are served now (tokens/s)."""
        return sum(max(0.0, c.served_tokens_per_s) for c in self.classes
                   if c.target_s is not None)


@dataclass(frozen=True, slots=True)
class ScaleRules:
    headroom: float = 0.2  # scale down only when need × (1 + headroom) fits in fewer
    scale_down_delay_s: float = 300.0
    min_replicas: int = 0
    max_replicas: int | None = None
    burst_baseline_s: float = 0.0  # W; 0: the burst room is sized on the load now


@dataclass(frozen=True, slots=True)
class ScaleState:
    """The decision carried from one call to the next."""

    desired: int = 0
    below_since: float | None = None  # since when fewer replicas would do (None: not now)
    below_max: int = 0  # the most replicas needed since then


def class_needs(pool: PoolDemand) -> dict[str, float]:
    """Each class's need in replicas (see the module's formula); empty when no rate was
    ever measured."""
    mu = pool.backend_tokens_per_s
    if mu is None or mu <= 0:
        return {}
    needs: dict[str, float] = {}
    load = backlog = 0.0
    rho = max(pool.utilization, EPSILON)
    for c in pool.classes:
        backlog += max(0.0, c.queued_tokens)
        if c.target_s is None:
            continue
        load += max(0.0, c.served_tokens_per_s) / (1.0 if pool.burst_load is not None else rho)
        needs[c.klass] = (load + backlog / max(c.target_s, EPSILON)) / mu
    if pool.burst_load is not None:
        needs[BURST] = pool.burst_load / rho / mu
    window = pool.window_left_s
    untargeted = [c for c in pool.classes if c.target_s is None and c.queued_tokens > 0]
    if untargeted:
        left = max(0.0, window if window is not None else math.inf) * WINDOW_MARGIN
        needs[untargeted[0].klass] = (load + (backlog / left if left > 0 else math.inf)) / mu
    return {k: min(v, MAX_NEED) for k, v in needs.items()}


def replicas_needed(pool: PoolDemand) -> float:
    """The pool's need in (fractional) replicas: its largest class need, at least one
    backend while anything is queued or running; with no measured rate, the replicas
    there are (at least one while there is work)."""
    floor = 1.0 if pool.queued > 0 or pool.running > 0 else 0.0
    needs = class_needs(pool)
    if pool.backend_tokens_per_s is None or pool.backend_tokens_per_s <= 0:
        return max(float(pool.ready), floor) if floor else 0.0
    return max([floor, *needs.values()])


def with_burst_baseline(pool: PoolDemand, rules: ScaleRules,
                        loads: tuple[tuple[float, float], ...], now_s: float
                        ) -> tuple[PoolDemand, tuple[tuple[float, float], ...]]:
    """``pool`` with its burst baseline (see the module), and the (time, targeted load)
    samples of the window to pass to the next call; ``pool`` unchanged without a window."""
    window = rules.burst_baseline_s
    if window <= 0:
        return pool, ()
    kept = (*((t, x) for t, x in loads if now_s - t < window), (now_s, pool.targeted_load))
    ordered = sorted(x for _, x in kept)
    base = ordered[int(BASELINE_QUANTILE * (len(ordered) - 1))]
    return dataclasses.replace(pool, burst_load=base), kept


def window_at_risk(pool: PoolDemand, klass: str) -> bool:
    """Whether an untargeted class's backlog misses its completion window at the
    replicas there are (at least the one its queued requests get anyway)."""
    need = class_needs(pool).get(klass)
    return need is not None and need > max(pool.ready, 1) + EPSILON


def _bounded(n: int, rules: ScaleRules, floor: int) -> int:
    n = max(n, floor, rules.min_replicas)
    if rules.max_replicas is not None:
        n = min(n, max(rules.max_replicas, floor))
    return n


def decide(pool: PoolDemand, rules: ScaleRules, state: ScaleState,
           now_s: float) -> ScaleState:
    """The desired replicas now, from the need and the previous state (see the module)."""
    need = replicas_needed(pool)
    floor = 1 if need > 0 else 0
    up = _bounded(math.ceil(need - EPSILON), rules, floor)
    if up >= state.desired:
        return ScaleState(up)
    down = _bounded(math.ceil(need * (1 + rules.headroom) - EPSILON), rules, floor)
    if down >= state.desired:
        return ScaleState(state.desired)  # inside the band: hold, the delay starts over
    if state.below_since is None:
        return ScaleState(state.desired, now_s, down)
    below_max = min(max(state.below_max, down), state.desired - 1)
    if now_s - state.below_since >= rules.scale_down_delay_s:
        return ScaleState(below_max)
    return ScaleState(state.desired, state.below_since, below_max)
