"""Preemption for fairness on plain data (policies/preemption.py)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.classes import CLASS_ORDER, class_rank
from policies.preemption import (
    BackendLoad,
    PreemptRule,
    Running,
    Waiting,
    choose,
    is_full,
    may_preempt,
    next_decision_in,
)

RULES = {
    "interactive": PreemptRule(preemptible=False, preempt_after_s=0.5, max_preemptions=2),
    "default": PreemptRule(preemptible=False, preempt_after_s=2.0, max_preemptions=2),
    "batch": PreemptRule(preemptible=True, preempt_after_s=None, max_preemptions=2),
}
FULL = BackendLoad("b0", running=4, batch=4)
ROOM = BackendLoad("b1", running=3, batch=4)


def batch(rid: str, user: str = "bert", score: float = 0.0, generated: int = 10,
          preemptions: int = 0, backend: str = "b0") -> Running:
    return Running(rid, backend, "batch", user, score, generated, preemptions)


def test_full_by_batch_size_or_by_the_class_kv_limit() -> None:
    assert is_full(FULL) and not is_full(ROOM)
    assert not is_full(BackendLoad("b", running=9, batch=0))  # batch size unknown
    assert is_full(BackendLoad("b", running=1, batch=4, kv_usage=0.95), kv_limit=0.9)
    assert not is_full(BackendLoad("b", running=1, batch=4, kv_usage=0.95))


def test_an_overdue_interactive_request_takes_the_most_served_batch_users_slot() -> None:
    waiter = Waiting("interactive", "alice", waited_s=0.6, backend="b0")
    running = [batch("r1", "bert", score=10.0), batch("r2", "ben", score=50.0, generated=90),
               batch("r3", "ben", score=50.0, generated=20)]
    chosen = choose([waiter], running, [FULL], RULES)
    assert chosen is not None and chosen.victim.request_id == "r3", chosen  # fewest tokens
    assert chosen.waiter == waiter


def test_no_preemption_before_the_threshold_on_a_backend_with_room_or_past_the_cap() -> None:
    running = [batch("r1")]
    early = Waiting("interactive", "alice", waited_s=0.4, backend="b0")
    assert choose([early], running, [FULL], RULES) is None
    late = Waiting("interactive", "alice", waited_s=5.0, backend="b1")
    assert choose([late], [batch("r1", backend="b1")], [FULL, ROOM], RULES) is None
    capped = Waiting("interactive", "alice", waited_s=5.0, backend="b0")
    assert choose([capped], [batch("r1", preemptions=2)], [FULL], RULES) is None


def test_a_request_queued_in_the_gateway_preempts_only_when_every_backend_is_full() -> None:
    queued = Waiting("interactive", "alice", waited_s=1.0)
    both_full = [FULL, BackendLoad("b1", running=4, batch=4)]
    assert choose([queued], [batch("r1", backend="b1")], [FULL, ROOM], RULES) is None
    chosen = choose([queued], [batch("r1", backend="b1")], both_full, RULES)
    assert chosen is not None and chosen.victim.request_id == "r1"


def test_interactive_is_never_preempted_by_default_and_batch_never_preempts() -> None:
    waiter = Waiting("interactive", "alice", waited_s=9.0, backend="b0")
    victim = Running("r1", "b0", "interactive", "bob", score=99.0)
    assert not may_preempt(waiter, victim, RULES)
    assert choose([Waiting("batch", "ben", waited_s=999.0, backend="b0")],
                  [batch("r1")], [FULL], RULES) is None


def test_same_class_only_for_a_user_far_below_its_fair_share() -> None:
    rules = {**RULES, "batch": PreemptRule(True, 1.0, 2)}
    poor = Waiting("batch", "ben", waited_s=2.0, backend="b0", score=100.0)
    rich = batch("r1", "bert", score=5000.0)
    assert choose([poor], [rich], [FULL], rules) is None  # no fair_gap: off
    assert choose([poor], [rich], [FULL], rules, fair_gap=1000.0) is not None
    close = batch("r1", "bert", score=500.0)
    assert choose([poor], [close], [FULL], rules, fair_gap=1000.0) is None


names = st.sampled_from(["u1", "u2", "u3"])
classes = st.sampled_from(CLASS_ORDER)
backends = st.sampled_from(["b0", "b1"])
runnings = st.builds(Running, st.uuids().map(str), backends, classes, names,
                     st.floats(0, 1e4), st.integers(0, 500), st.integers(0, 3))
waitings = st.builds(Waiting, classes, names, st.floats(0, 5),
                     st.one_of(st.none(), backends), st.one_of(st.none(), st.floats(0, 1e4)))
loads = st.builds(BackendLoad, st.just("b0"), st.integers(0, 8), st.integers(0, 8),
                  st.floats(0, 1)), st.builds(BackendLoad, st.just("b1"), st.integers(0, 8),
                                              st.integers(0, 8), st.floats(0, 1))
rule_sets = st.fixed_dictionaries({c: st.builds(
    PreemptRule, st.booleans(), st.one_of(st.none(), st.floats(0, 3)), st.integers(0, 3),
    st.one_of(st.none(), st.floats(0.5, 1))) for c in CLASS_ORDER})


@settings(max_examples=300, deadline=None)
@given(st.lists(waitings, max_size=5), st.lists(runnings, max_size=10), loads[0], loads[1],
       rule_sets, st.one_of(st.none(), st.floats(0, 1e4)))
def test_property_a_victim_is_allowed_and_the_best_of_its_waiter(
        waiting: list[Waiting], running: list[Running], b0: BackendLoad, b1: BackendLoad,
        rules: dict[str, PreemptRule], gap: float | None) -> None:
    chosen = choose(waiting, running, [b0, b1], rules, gap)
    loads_by = {"b0": b0, "b1": b1}
    if chosen is None:
        # nobody overdue could take anybody's slot on a full backend where it waits
        for w in waiting:
            rule = rules[w.klass]
            if rule.preempt_after_s is None or w.waited_s < rule.preempt_after_s:
                continue
            full = {n for n, ld in loads_by.items() if is_full(ld, rule.max_kv_usage)}
            where = ({w.backend} & full if w.backend else full if len(full) == 2 else set())
            assert not [r for r in running if r.backend in where
                        and may_preempt(w, r, rules, gap)], (w, running)
        return
    w, v = chosen.waiter, chosen.victim
    rule = rules[v.klass]
    assert rule.preemptible and v.preemptions < rule.max_preemptions, chosen
    assert class_rank(v.klass) >= class_rank(w.klass), chosen
    assert w.waited_s >= (rules[w.klass].preempt_after_s or 0), chosen
    assert is_full(loads_by[v.backend], rules[w.klass].max_kv_usage), chosen
    assert w.backend in (None, v.backend), chosen
    for other in running:  # no allowed candidate of the same waiter ranks before it
        if other.backend == v.backend and may_preempt(w, other, rules, gap):
            assert (-class_rank(other.klass), -other.score, other.generated,
                    other.request_id) >= (-class_rank(v.klass), -v.score, v.generated,
                                          v.request_id), (other, v)


def test_the_next_decision_comes_when_the_first_waiter_may_preempt() -> None:
    fresh = Waiting("interactive", "alice", 0.2, "b0")  # 0.3 s before its 0.5 s
    older = Waiting("default", "carol", 1.5, None)  # 0.5 s before its 2 s
    assert next_decision_in([fresh, older], RULES, {"b0"}) == 0.3
    # on a backend with room it takes no slot: only the queued one counts
    assert next_decision_in([fresh, older], RULES, {"b1"}) == 0.5
    assert next_decision_in([Waiting("interactive", "a", 0.9, "b0")], RULES, {"b0"}) == 0.0
    # batch never preempts: nothing to come back for
    assert next_decision_in([Waiting("batch", "b", 0.0, None)], RULES, {"b0"}) is None
    assert next_decision_in([], RULES, {"b0"}) is None


@settings(max_examples=300, deadline=None)
@given(st.lists(waitings, max_size=5), st.lists(runnings, max_size=10), loads[0], loads[1],
       rule_sets, st.one_of(st.none(), st.floats(0, 1e4)), st.floats(0, 0.999))
def test_property_nothing_is_decided_before_the_next_decision(
        waiting: list[Waiting], running: list[Running], b0: BackendLoad, b1: BackendLoad,
        rules: dict[str, PreemptRule], gap: float | None, part: float) -> None:
    """The dispatch loop sleeps until ``next_decision_in``: had it checked at any moment
    before, with the same running requests and loads, nothing would have been chosen."""
    if choose(waiting, running, [b0, b1], rules, gap) is not None:
        return
    limits = {r.max_kv_usage for r in rules.values()}
    full = {ld.name for ld in (b0, b1) if any(is_full(ld, kv) for kv in limits)}
    left = next_decision_in(waiting, rules, full)
    later = 10.0 if left is None else left * part
    aged = [dataclasses.replace(w, waited_s=w.waited_s + later) for w in waiting]
    assert choose(aged, running, [b0, b1], rules, gap) is None, (left, later)
