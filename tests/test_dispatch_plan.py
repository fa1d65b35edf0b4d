"""The executable spec of ``policies/dispatch_plan.py``: one decision's plan from what each
backend shows, with plain data."""

from __future__ import annotations

from policies.classes import CLASS_ORDER
from policies.dispatch_plan import BackendView, dispatch_order
from policies.gates import Gate

TOP, LOW = CLASS_ORDER[0], CLASS_ORDER[-1]
OPEN, SHUT = Gate(3), Gate(0, "waiting")
BURSTS = {c: 2 * (i + 1) for i, c in enumerate(CLASS_ORDER)}


def gates(**by_class: Gate) -> dict[str, Gate]:
    return {c: by_class.get(c, SHUT) for c in CLASS_ORDER}


def test_open_backends_least_loaded_first_and_a_closed_one_left_out() -> None:
    busy = BackendView("busy", gates(**{TOP: OPEN}), waiting=2, running=5)
    idle = BackendView("idle", gates(**{TOP: OPEN}), running=1, sent_since_snapshot=1)
    shut = BackendView("shut", gates())
    plan = dispatch_order([busy, shut, idle], None, BURSTS)
    assert plan.open == ["idle", "busy"], plan
    assert plan.order == list(CLASS_ORDER), plan
    assert plan.burst == max(BURSTS.values()), plan  # the largest class's burst
    assert plan.reachable == ("busy", "shut", "idle"), plan  # closed is not down


def test_an_owed_class_borrows_the_top_gate_and_goes_one_grant_at_a_time() -> None:
    lent = BackendView("b0", gates(**{TOP: OPEN}))
    plan = dispatch_order([lent], LOW, BURSTS)
    assert plan.gates["b0"][LOW] == OPEN, plan.gates  # borrowed: it was shut
    assert plan.gates["b0"][TOP] == OPEN, plan.gates
    assert plan.order[0] == LOW, plan.order
    assert plan.burst == 1, plan
    assert plan.open == ["b0"], plan


def test_no_borrowing_without_an_owed_class() -> None:
    only_top = BackendView("b0", gates(**{TOP: OPEN}))
    plan = dispatch_order([only_top], None, BURSTS)
    assert plan.gates["b0"][LOW] == SHUT, plan.gates


def test_a_down_backend_is_not_reachable_for_locality() -> None:
    stale = BackendView("stale", {c: Gate(0, "stale") for c in CLASS_ORDER})
    drained = BackendView("drained", {c: Gate(0, "drained") for c in CLASS_ORDER})
    full = BackendView("full", gates())
    plan = dispatch_order([stale, drained, full], None, BURSTS)
    assert plan.reachable == ("full",), plan
    assert plan.open == [], plan
