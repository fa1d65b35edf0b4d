"""policies/autoscale.py on plain data: the need (Little's law on the measured rate), the
batch window's risk, hysteresis and the scale-down delay."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.autoscale import (
    ClassDemand,
    PoolDemand,
    ScaleRules,
    ScaleState,
    class_needs,
    decide,
    replicas_needed,
    window_at_risk,
    with_burst_baseline,
)

MU = 1000.0  # one backend serves 1,000 tokens/s


def pool(interactive: float = 0.0, default: float = 0.0, batch: float = 0.0, *,
         served: tuple[float, float] = (0.0, 0.0), ready: int = 1, running: int = 0,
         mu: float | None = MU, window_left_s: float | None = None,
         targets: tuple[float, float] = (2.0, 10.0), utilization: float = 1.0) -> PoolDemand:
    """A pool with this many queued tokens per class (one request per 100 tokens)."""
    return PoolDemand(
        (ClassDemand("interactive", interactive, interactive / 100, served[0], targets[0]),
         ClassDemand("default", default, default / 100, served[1], targets[1]),
         ClassDemand("batch", batch, batch / 100, 0.0, None)),
        mu, ready, running, window_left_s, utilization)


# ------------------------------------------------------------------------------ the need


def test_littles_law_on_the_backlog_and_the_load() -> None:
    # 4,000 interactive tokens within 2 s need 2,000 tokens/s: two backends; the 500
    # tokens/s served now add half of one
    assert replicas_needed(pool(4000)) == pytest.approx(2.0)
    assert replicas_needed(pool(4000, served=(500, 0))) == pytest.approx(2.5)


def test_a_target_utilization_keeps_room_for_a_burst_of_its_inverse() -> None:
    # 1,500 tokens/s served now at ρ = 0.25: sized for 6,000 tokens/s, i.e. 6 backends at
    # ρ = 1 would be needed for a 4x step, and the pool has them before it comes; the
    # backlog's term is not scaled (it is work to drain, not load to absorb)
    assert replicas_needed(pool(served=(1500, 0), utilization=0.25)) == pytest.approx(6.0)
    assert replicas_needed(pool(served=(1500, 0))) == pytest.approx(1.5)
    assert replicas_needed(pool(4000, served=(1500, 0), utilization=0.25)) == \
        pytest.approx(8.0)
    # and after the 4x step, served at ρ = 1 what it was sized for at 0.25
    stepped = replicas_needed(pool(served=(6000, 0)))
    assert stepped == pytest.approx(replicas_needed(pool(served=(1500, 0), utilization=0.25)))


def test_a_burst_baseline_keeps_the_room_over_the_usual_load_not_over_the_burst() -> None:
    """ρ = 0.25 on the load now asks, at a 4x peak, for room for another 4x on top of it
    (the autoscale bench's fleet at 5 backends through the peak); over a baseline window
    the room stays sized on the usual load, and the peak is served at ρ = 1."""
    rules, rho = ScaleRules(burst_baseline_s=120.0), 0.25
    loads: tuple[tuple[float, float], ...] = ()
    needs = []
    # 40 s at 1,500 tokens/s, then 60 s of a 4x step, one sample each 2 s
    for t in range(0, 100, 2):
        served = 1500.0 if t < 40 else 6000.0
        demand, loads = with_burst_baseline(pool(served=(served, 0), utilization=rho),
                                            rules, loads, float(t))
        needs.append(replicas_needed(demand))
    assert needs[10] == pytest.approx(6.0), needs[:20]  # room for the 4x before it comes
    # through the peak: the 4x load at ρ = 1, not 4 x that (24 backends)
    assert max(needs) == pytest.approx(6.0), needs
    assert replicas_needed(pool(served=(6000, 0), utilization=rho)) == pytest.approx(24.0)
    # the window forgets: a load that stays 4x for a whole window becomes the usual one
    for t in range(100, 260, 2):
        demand, loads = with_burst_baseline(pool(served=(6000, 0), utilization=rho),
                                            rules, loads, float(t))
    assert replicas_needed(demand) == pytest.approx(24.0)
    assert min(t for t, _ in loads) > 258.0 - 120.0, loads[:3]  # the older ones left
    # no window: unchanged, and no samples kept
    assert with_burst_baseline(pool(served=(1500, 0)), ScaleRules(), loads, 0.0) == \
        (pool(served=(1500, 0)), ())


def test_a_lower_class_waits_behind_the_higher_ones() -> None:
    # default (target 10 s) waits behind interactive's 4,000 tokens too: (4000 + 16000)
    # / 10 s = 2 backends; interactive alone needs 4000 / 2 s = 2 backends
    needs = class_needs(pool(4000, 16000))
    assert needs == {"interactive": pytest.approx(2.0), "default": pytest.approx(2.0)}
    assert class_needs(pool(4000, 36000))["default"] == pytest.approx(4.0)


def test_batch_backlog_adds_nothing_while_its_window_is_safe() -> None:
    # a million batch tokens, a day left: far less than one backend's day of work
    p = pool(batch=1_000_000, window_left_s=86400, ready=1)
    assert replicas_needed(p) == 1.0, class_needs(p)
    assert not window_at_risk(p, "batch")


def test_batch_backlog_buys_backends_when_its_window_is_at_risk() -> None:
    # 8 million tokens in 1,000 s (× 0.8 margin) need 10 backends of 1,000 tokens/s
    p = pool(batch=8_000_000, window_left_s=1000, ready=2)
    assert window_at_risk(p, "batch")
    assert replicas_needed(p) == pytest.approx(10.0)
    # a pool at zero: its queued batch gets one backend anyway; at risk only beyond it
    assert not window_at_risk(pool(batch=1000, window_left_s=1000, ready=0), "batch")
    assert window_at_risk(pool(batch=1_000_000, window_left_s=1000, ready=0), "batch")


def test_never_below_one_while_anything_is_queued_or_running() -> None:
    assert replicas_needed(pool(1)) == 1.0
    assert replicas_needed(pool(batch=1, window_left_s=86400)) == 1.0
    assert replicas_needed(pool(running=1)) == 1.0
    assert replicas_needed(pool()) == 0.0


def test_a_pool_at_zero_with_nothing_measured_asks_for_one() -> None:
    assert replicas_needed(pool(5000, ready=0, mu=None)) == 1.0
    # with no rate the need is what there is: nothing to compare the backlog with
    assert replicas_needed(pool(5000, ready=3, mu=None)) == 3.0
    assert replicas_needed(pool(ready=3, mu=None)) == 0.0


# -------------------------------------------------------------------------- the decision


RULES = ScaleRules(headroom=0.2, scale_down_delay_s=60.0)


def test_up_at_once() -> None:
    state = decide(pool(4000), RULES, ScaleState(1), 0.0)
    assert state == ScaleState(2)
    assert decide(pool(5, ready=0), RULES, ScaleState(0), 0.0).desired == 1


def test_down_only_after_the_delay_to_the_most_needed_meanwhile() -> None:
    state = ScaleState(4)
    state = decide(pool(2000), RULES, state, 0.0)  # need 1 (×1.2 → 2): fewer would do
    assert (state.desired, state.below_since) == (4, 0.0)
    state = decide(pool(3000), RULES, state, 30.0)  # need 1.5 (×1.2 → 2)
    assert state.desired == 4
    state = decide(pool(2000), RULES, state, 60.0)
    assert state == ScaleState(2)


def test_the_band_holds_and_restarts_the_delay() -> None:
    state = decide(pool(2000), RULES, ScaleState(3), 0.0)
    assert state.below_since == 0.0
    # need 2.4 → 3 with headroom: inside the band, the pending scale-down is forgotten
    state = decide(pool(4800), RULES, state, 30.0)
    assert state == ScaleState(3)
    state = decide(pool(2000), RULES, state, 70.0)
    assert (state.desired, state.below_since) == (3, 70.0)


def test_min_and_max_replicas() -> None:
    rules = dataclasses.replace(RULES, min_replicas=2, max_replicas=3)
    assert decide(pool(), rules, ScaleState(0), 0.0).desired == 2
    assert decide(pool(100_000), rules, ScaleState(2), 0.0).desired == 3
    # a max of 0 still lets a queued request have its one backend
    assert decide(pool(1), dataclasses.replace(RULES, max_replicas=0), ScaleState(0),
                  0.0).desired == 1


# ------------------------------------------------------------------- properties (random)

tokens = st.floats(0, 1e7, allow_nan=False)
demands = st.builds(pool, tokens, tokens, tokens,
                    served=st.tuples(st.floats(0, 1e5), st.floats(0, 1e5)),
                    ready=st.integers(0, 50), running=st.integers(0, 100),
                    mu=st.one_of(st.none(), st.floats(1, 1e5)),
                    window_left_s=st.one_of(st.none(), st.floats(0, 1e5)))
states = st.builds(ScaleState, st.integers(0, 100),
                   st.one_of(st.none(), st.floats(0, 1000)), st.integers(0, 100))
rules = st.builds(ScaleRules, st.floats(0, 1), st.floats(0, 1000), st.integers(0, 5),
                  st.one_of(st.none(), st.integers(0, 100)))


@settings(max_examples=300, deadline=None)
@given(demands, rules, states, st.floats(0, 2000), st.floats(0, 1e7),
       st.sampled_from(["interactive", "default", "batch"]))
def test_monotone_in_demand(p: PoolDemand, r: ScaleRules, s: ScaleState, now: float,
                            more: float, klass: str) -> None:
    grown = dataclasses.replace(p, classes=[
        dataclasses.replace(c, queued_tokens=c.queued_tokens + more,
                            queued_requests=c.queued_requests + (1 if more else 0))
        if c.klass == klass else c for c in p.classes])
    assert replicas_needed(grown) >= replicas_needed(p) - 1e-6
    before, after = decide(p, r, s, now).desired, decide(grown, r, s, now).desired
    assert after >= before, (before, after)


@settings(max_examples=300, deadline=None)
@given(demands, rules, states, st.floats(0, 2000))
def test_never_below_one_while_queued_or_running(p: PoolDemand, r: ScaleRules,
                                                 s: ScaleState, now: float) -> None:
    desired = decide(p, r, s, now).desired
    if p.queued > 0 or p.running > 0:
        assert desired >= 1, (p, desired)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(demands, st.floats(0.01, 100)), min_size=2, max_size=30),
       rules)
def test_never_flaps_inside_the_delay(steps: list[tuple[PoolDemand, float]],
                                      r: ScaleRules) -> None:
    """Over any sequence of demands, the answer drops only a full delay after it last
    rose, and two drops are a full delay apart."""
    state, now = ScaleState(), 0.0
    last_change: float | None = None
    for p, dt in steps:
        now += dt
        after = decide(p, r, state, now)
        if after.desired < state.desired:
            assert last_change is None or now - last_change >= r.scale_down_delay_s, (
                f"dropped {state.desired}→{after.desired} {now - last_change} s after "
                "the last change")
        if after.desired != state.desired:
            last_change = now
        state = after
