"""Preemption for fairness on plain data (policies/preemption.py)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.classes import CLASS_ORDER, SPECS, class_rank
from policies.preemption import (
    BackendLoad,
    PreemptRule,
    Running,
    Shares,
    Waiting,
    below_fair_share,
    choose,
    is_full,
    may_preempt,
    next_decision_in,
    recompute_allowance,
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
    assert choose([dataclasses.replace(poor, backend=None)],
                  [batch("r1", "bert", score=5000.0), batch("r2", "bert", score=5000.0)],
                  [FULL], rules, fair_gap=1000.0) is None  # queued in the gateway: no
    # bert holds two slots, ben none: one moved leaves bert as many as ben
    rich = [batch("r1", "bert", score=5000.0), batch("r2", "bert", score=5000.0)]
    assert choose([poor], rich, [FULL], rules) is None  # no fair_gap, no fair switch: off
    assert choose([poor], rich, [FULL], rules, fair_gap=1000.0) is not None
    close = [batch("r1", "bert", score=500.0), batch("r2", "bert", score=500.0)]
    assert choose([poor], close, [FULL], rules, fair_gap=1000.0) is None


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
    st.one_of(st.none(), st.floats(0.5, 1)), st.booleans(), st.integers(0, 64))
    for c in CLASS_ORDER})


@settings(max_examples=300, deadline=None)
@given(st.lists(waitings, max_size=5), st.lists(runnings, max_size=10), loads[0], loads[1],
       rule_sets, st.one_of(st.none(), st.floats(0, 1e4)))
def test_property_a_victim_is_allowed_and_the_best_of_its_waiter(
        waiting: list[Waiting], running: list[Running], b0: BackendLoad, b1: BackendLoad,
        rules: dict[str, PreemptRule], gap: float | None) -> None:
    chosen = choose(waiting, running, [b0, b1], rules, gap)
    loads_by = {"b0": b0, "b1": b1}
    shares = Shares.of(running)
    if chosen is None:
        # nobody overdue could take anybody's slot on a full backend where it waits
        for w in waiting:
            rule = rules[w.klass]
            if rule.preempt_after_s is None or w.waited_s < rule.preempt_after_s:
                continue
            full = {n for n, ld in loads_by.items() if is_full(ld, rule.max_kv_usage)}
            where = ({w.backend} & full if w.backend else full if len(full) == 2 else set())
            assert not [r for r in running if r.backend in where
                        and may_preempt(w, r, rules, gap, shares)], (w, running)
        return
    w, v = chosen.waiter, chosen.victim
    rule = rules[v.klass]
    assert v.preemptions < rule.max_preemptions and v.generated >= rule.min_tokens, chosen
    assert class_rank(v.klass) >= class_rank(w.klass), chosen
    if v.klass == w.klass:  # for fairness: a user below its share, never a richer one
        assert (rule.fair or (rule.preemptible and gap is not None)), chosen
        assert w.backend == v.backend, chosen  # waiting there: the freed slot is its
        assert w.user != v.user and w.score is not None and w.score < v.score, chosen
        assert below_fair_share(w, v, shares, gap), chosen
    else:
        assert rule.preemptible, chosen
    assert w.waited_s >= (rules[w.klass].preempt_after_s or 0), chosen
    assert is_full(loads_by[v.backend], rules[w.klass].max_kv_usage), chosen
    assert w.backend in (None, v.backend), chosen
    for other in running:  # no allowed candidate of the same waiter ranks before it
        if other.backend == v.backend and may_preempt(w, other, rules, gap, shares):
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


# ----------------------------------------------------------------- fair share, by default

DEFAULTS = {c.name: PreemptRule(c.preemptible, None if c.preempt_after_ms is None
                                else c.preempt_after_ms / 1000, c.max_preemptions, None,
                                c.fair_preemption, c.preempt_grace_tokens)
            for c in SPECS.values()}
FULL8 = BackendLoad("b0", running=8, batch=8)


def heavy(count: int = 8, user: str = "hank", score: float = 9000.0, first: int = 40,
          klass: str = "interactive") -> list[Running]:
    """``count`` streams of one user, the i-th with ``first + 10 i`` tokens so far."""
    return [Running(f"h{i}", "b0", klass, user, score, first + 10 * i, prompt=20)
            for i in range(count)]


def test_by_default_a_newcomer_takes_the_heavy_users_youngest_stream_past_its_grace() -> None:
    newcomer = Waiting("interactive", "nina", waited_s=0.6, backend="b0", score=0.0)
    streams = [*heavy(first=40), Running("young", "b0", "interactive", "hank", 9000.0,
                                         SPECS["interactive"].preempt_grace_tokens - 1)]
    chosen = choose([newcomer], streams, [FULL8], DEFAULTS)
    assert chosen is not None and chosen.victim.request_id == "h0", chosen
    # queued in the gateway it takes nothing: the freed slot would go to what vLLM has
    # waiting (the heavy user's), not to it
    queued = Waiting("interactive", "nina", waited_s=0.6, score=0.0)
    assert choose([queued], streams, [FULL8], DEFAULTS) is None
    # not before its class's wait
    early = Waiting("interactive", "nina", waited_s=0.4, backend="b0", score=0.0)
    assert choose([early], streams, [FULL8], DEFAULTS) is None


def test_the_per_class_switch_turns_fair_preemption_off() -> None:
    off = {**DEFAULTS, "interactive": dataclasses.replace(DEFAULTS["interactive"], fair=False)}
    newcomer = Waiting("interactive", "nina", waited_s=5.0, backend="b0", score=0.0)
    assert choose([newcomer], heavy(), [FULL8], off) is None


def test_never_for_a_user_served_as_much_or_more() -> None:
    streams = heavy(score=500.0)
    for score in (500.0, 501.0, None):
        waiter = Waiting("interactive", "nina", waited_s=5.0, backend="b0", score=score)
        assert choose([waiter], streams, [FULL8], DEFAULTS) is None, score
    # with a gap set, only a user further below than the gap
    waiter = Waiting("interactive", "nina", waited_s=5.0, backend="b0", score=100.0)
    assert choose([waiter], streams, [FULL8], DEFAULTS, fair_gap=400.0) is None
    assert choose([waiter], streams, [FULL8], DEFAULTS, fair_gap=399.0) is not None


def test_never_within_the_grace_or_past_the_cap() -> None:
    grace = SPECS["interactive"].preempt_grace_tokens
    waiter = Waiting("interactive", "nina", waited_s=5.0, backend="b0", score=0.0)
    fresh = [dataclasses.replace(r, generated=grace - 1) for r in heavy()]
    assert choose([waiter], fresh, [FULL8], DEFAULTS) is None
    capped = [dataclasses.replace(r, preemptions=SPECS["interactive"].max_preemptions)
              for r in heavy()]
    assert choose([waiter], capped, [FULL8], DEFAULTS) is None


def test_a_user_at_its_fair_share_takes_nothing() -> None:
    """Two users holding 4 and 4, or 5 and 3: one slot moved would not even them out more
    (5, 3 → 4, 4 would; 4, 4 → 3, 5 would not)."""
    def split(a: int, b: int) -> list[Running]:
        return [*heavy(a, "hank"), *(dataclasses.replace(r, request_id=f"n{i}", user="nina",
                                                         score=10.0)
                                     for i, r in enumerate(heavy(b)))]
    waiter = Waiting("interactive", "nina", waited_s=5.0, backend="b0", score=10.0)
    assert choose([waiter], split(4, 4), [FULL8], DEFAULTS) is None
    chosen = choose([waiter], split(5, 3), [FULL8], DEFAULTS)
    assert chosen is not None and chosen.victim.user == "hank", chosen
    assert choose([waiter], split(4, 3), [FULL8], DEFAULTS) is None


def test_across_tenants_only_beyond_their_weights() -> None:
    """Tenant acme (weight 3) holds 6 slots, tenant solo (weight 1) 2: per unit of weight
    acme holds 2, solo 2 → no. With acme at weight 1, it holds 6 per unit: yes."""
    acme = [dataclasses.replace(r, tenant="acme") for r in heavy(6)]
    solo = [Running(f"s{i}", "b0", "interactive", "sol", 10.0, 100, tenant="solo")
            for i in range(2)]
    waiter = Waiting("interactive", "sol", waited_s=5.0, backend="b0", score=5.0,
                     tenant="solo")
    assert choose([waiter], acme + solo, [FULL8], DEFAULTS,
                  tenant_weights={"acme": 3.0}) is None
    chosen = choose([waiter], acme + solo, [FULL8], DEFAULTS, tenant_weights={"acme": 1.0})
    assert chosen is not None and chosen.victim.tenant == "acme", chosen


def test_the_recompute_budget_bounds_what_a_preemption_sends_again() -> None:
    waiter = Waiting("interactive", "nina", waited_s=5.0, backend="b0", score=0.0)
    streams = heavy(first=100)  # resend 120, 130, ...
    assert choose([waiter], streams, [FULL8], DEFAULTS, budget=119.0) is None
    chosen = choose([waiter], streams, [FULL8], DEFAULTS, budget=125.0)
    assert chosen is not None and chosen.victim.resend == 120, chosen
    assert recompute_allowance(10_000, 300, 0.05, 100) == 300.0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 400)), max_size=60),
       st.floats(0, 0.2), st.integers(0, 2000))
def test_property_the_recomputed_tokens_stay_within_the_budget(
        events: list[tuple[int, int]], ratio: float, burst: int) -> None:
    """Tokens served and preemptions in any order: a preemption made only when its resend
    fits the allowance keeps what was recomputed within ratio × served + burst."""
    served = recomputed = 0.0
    for served_now, resend in events:
        served += served_now
        if resend <= recompute_allowance(served, recomputed, ratio, burst):
            recomputed += resend
        assert recomputed <= ratio * served + burst + 1e-6, (recomputed, served)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(names, st.integers(0, 200), st.floats(0, 1e4)), min_size=1,
                max_size=12), names, st.one_of(st.none(), st.floats(0, 1e4)))
def test_property_a_fair_preemption_evens_the_slots_out_and_never_favours_the_richer(
        streams: list[tuple[str, int, float]], who: str, score: float | None) -> None:
    """Whoever holds the slots, a same-class preemption by default leaves the victim's
    user at least as many slots as the waiting user, never takes a stream in its grace,
    and never serves a user whose score is not strictly lower."""
    running = [Running(f"r{i}", "b0", "interactive", u, s, g)
               for i, (u, g, s) in enumerate(streams)]
    full = BackendLoad("b0", running=len(running), batch=len(running))
    waiter = Waiting("interactive", who, waited_s=5.0, backend="b0", score=score)
    chosen = choose([waiter], running, [full], DEFAULTS)
    if chosen is None:
        return
    held = Shares.of(running).users
    v = chosen.victim
    assert held[v.user] - 1 >= held.get(who, 0) + 1, (held, chosen)
    assert v.generated >= SPECS["interactive"].preempt_grace_tokens, chosen
    assert score is not None and score < v.score, chosen
