"""Pure policy decisions, with plain data."""

from __future__ import annotations

import pytest

from policies.backend_choice import Candidate, by_load
from policies.classes import effective_class
from policies.cost import TokenCost, kv_token_seconds
from policies.fairness import POLICIES, RoundRobin, Vtc, charged_prompt, policy_for, predicted_cost
from policies.gates import BackendSnapshot, Gate, GatePolicy, down, evaluate_gate, wider
from policies.priority import vllm_priority
from policies.starvation import FloorPolicy, owed_class, service_order

SNAP = BackendSnapshot(waiting=1, running=10, kv_usage=0.5, tpot_s=0.05, taken_at_s=100.0)


@pytest.mark.parametrize(("snap", "policy", "now", "drained", "limit", "reason"), [
    (SNAP, GatePolicy(), 100.5, False, 2, None),
    (SNAP, GatePolicy(max_waiting=1), 100.5, False, 0, "waiting"),
    (SNAP, GatePolicy(), 102.0, False, 0, "stale"),
    (None, GatePolicy(), 100.0, False, 0, "stale"),
    (SNAP, GatePolicy(max_tpot_ms=50), 100.5, False, 0, "tpot"),
    (SNAP, GatePolicy(max_kv_usage=0.4), 100.5, False, 0, "kv"),
    (SNAP, GatePolicy(), 100.5, True, 0, "drained"),
])
def test_gate(snap: BackendSnapshot | None, policy: GatePolicy, now: float, drained: bool,
              limit: int, reason: str | None) -> None:
    gate = evaluate_gate(snap, policy, now, stale_after_s=1.0, drained=drained)
    assert (gate.limit, gate.reason, gate.open) == (limit, reason, limit > 0)


def test_class_may_only_be_lowered() -> None:
    assert effective_class("interactive", None) == "interactive"
    assert effective_class("interactive", "batch") == "batch"
    assert effective_class("default", "interactive") is None
    assert effective_class("default", "nonsense") is None


def test_vtc_and_round_robin_costs() -> None:
    vtc = Vtc()
    assert vtc.dispatch_cost(100, weight=2.0) == 50.0
    # output × 2 plus the correction of a prompt estimated at 90 but really 100
    assert vtc.settle_charge(100, 90, 10, weight=1.0) == 30.0
    assert vtc.service(100, 10, weight=2.0) == 60.0
    rr = RoundRobin()
    assert rr.dispatch_cost(100, 1.0) == 1.0 and rr.dispatch_cost(100, 2.0) == 0.5
    assert rr.settle_charge(1, 1, 9, 1.0) == 0.0


@pytest.mark.parametrize("name", POLICIES)
def test_the_dispatch_cost_of_a_predicted_hit_is_the_cost_of_the_uncached_tokens(
        name: str) -> None:
    """The scripts charge a dispatch ``predicted_cost`` (the cost stored for the whole
    estimate, less the policy's credit per token predicted cached) without knowing the
    policy: it must be the policy's dispatch cost of the uncached tokens, and dispatch
    plus settle the service of what the engine computed, whatever the prediction."""
    policy = policy_for(name)
    for weight in (0.5, 1.0, 3.0):
        for prompt in (0, 1, 64, 700):
            whole = policy.dispatch_cost(prompt, weight)
            for uncached in (0, prompt // 3, prompt):
                got = predicted_cost(whole, policy.cached_credit(weight), prompt, uncached)
                want = policy.dispatch_cost(uncached, weight)
                assert got == pytest.approx(want), (name, weight, prompt, uncached, got, want)
                for computed in (0, uncached, prompt):
                    total = got + policy.settle_charge(computed, uncached, 9, weight)
                    assert total == pytest.approx(policy.service(computed, 9, weight)), (
                        name, weight, prompt, uncached, computed, total)
    assert charged_prompt(700, None) == 700 and charged_prompt(700, 60) == 60


def test_the_kv_occupancy_term_is_off_by_default_and_charges_what_a_context_held() -> None:
    """Off (``w_kv`` 0, the default) it changes no charge; on, a long context held for
    long costs more than the same tokens held briefly, charged at settle only, so
    dispatch plus settle is still the request's service."""
    assert kv_token_seconds(1000, 100, 2.0) == 1000 * 2.0 + 100 * 1.0
    assert kv_token_seconds(1000, 100, -1.0) == 0.0  # a clock step back holds nothing
    off, on = Vtc(), Vtc(TokenCost(w_kv=0.01))
    assert TokenCost() == TokenCost(1.0, 2.0, 0.0)
    long_held = kv_token_seconds(30_000, 500, 60.0)
    assert off.service(30_000, 500, 1.0, long_held) == off.service(30_000, 500, 1.0)
    assert off.settle_charge(30_000, 30_000, 500, 1.0, long_held) == 1000.0
    brief = kv_token_seconds(30_000, 500, 1.0)
    assert on.service(30_000, 500, 1.0, long_held) > on.service(30_000, 500, 1.0, brief)
    assert on.service(30_000, 500, 2.0, long_held) == pytest.approx(
        (30_000 + 1000 + 0.01 * long_held) / 2)
    total = on.dispatch_cost(30_000, 1.0) + on.settle_charge(30_000, 30_000, 500, 1.0,
                                                              long_held)
    assert total == pytest.approx(on.service(30_000, 500, 1.0, long_held)), total
    assert RoundRobin().service(30_000, 500, 1.0, long_held) == 1.0


def test_priority_class_dominates_rank() -> None:
    assert [vllm_priority(0, r) for r in range(4)] == [0, 1, 2, 3]
    assert vllm_priority(0, 10**6) < vllm_priority(1000, 0)


def test_least_loaded_open_backend_first() -> None:
    cands = [Candidate("a", 2, 10, 0, True), Candidate("b", 0, 5, 1, True),
             Candidate("c", 0, 0, 0, False)]
    assert [c.name for c in by_load(cands)] == ["b", "a"]


def test_starved_class_is_owed_its_floor() -> None:
    policy = FloorPolicy(floors={"default": 0.1, "batch": 0.05}, after_s=30, window=20)
    flood = ["interactive"] * 20
    assert owed_class(policy, {"batch": 0.0}, flood, now_s=10.0) is None  # not yet 30 s
    assert owed_class(policy, {"batch": 0.0}, flood, now_s=31.0) == "batch"
    served = ["batch"] + ["interactive"] * 19
    assert owed_class(policy, {"batch": 0.0}, served, now_s=31.0) is None  # 5 % reached
    assert owed_class(policy, {"batch": 0.0, "default": 0.0}, flood, 31.0) == "default"
    assert owed_class(policy, {}, flood, 31.0) is None  # nothing backlogged
    assert service_order("batch") == ["batch", "interactive", "default"]
    assert service_order(None) == ["interactive", "default", "batch"]


def test_a_starved_class_borrows_the_more_open_gate() -> None:
    own, top = Gate(1, None, 0, 0), Gate(2, None, 0, 10)
    assert wider(own, top) == top
    assert wider(top, own) == top  # its own when it is the more open one
    assert wider(Gate(0, "tpot"), top) == top  # a closed gate borrows an open one
    assert wider(own, Gate(0, "stale")) == own  # a closed top gate lends nothing
    assert wider(own, Gate(1, None, 0, 0)) == own  # a tie keeps its own


def test_a_backend_is_down_only_when_every_gate_is_closed_as_stale_or_drained() -> None:
    stale, drained, busy = Gate(0, "stale"), Gate(0, "drained"), Gate(0, "waiting")
    assert down({"interactive": stale, "batch": stale})
    assert down({"interactive": drained, "batch": drained})
    # busy (it reopens as its requests run), partly open, or no gates at all: not down
    assert not down({"interactive": stale, "batch": busy})
    assert not down({"interactive": Gate(3), "batch": stale})
    assert not down({})


def test_a_start_sent_late_only_makes_the_gate_stricter() -> None:
    """Until its start reaches Redis a request that streams counts as in transit, not as
    started (gateway/scheduling/dispatcher.py holds it while nothing is queued): whenever the gate
    admits one more with the start still held, it admits one with the start delivered."""
    for limit in range(5):
        for free in range(limit + 1):
            for max_inflight in range(4):
                gate = Gate(limit, None, free, max_inflight)
                for in_transit in range(1, 6):
                    for started in range(5):
                        for inflight in (None, *range(6)):
                            held = gate.admits(in_transit, started, inflight)
                            sent = gate.admits(in_transit - 1, started + 1, inflight)
                            assert sent or not held, (gate, in_transit, started, inflight)
