"""Fair share across models on plain data (``policies/fleet.py``): with counters spanning
the models, a tenant on two models and a tenant on one stay within one model's bound of
each other in weighted service; a model's floor (the newcomer lift) stays its own; the
cost factor enters as a smaller weight."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.fairness import TwoLevel
from policies.fleet import Fleet, factor_of, fleet_weight

costs = st.integers(1, 40).map(lambda n: n / 4)


@given(costs, costs, st.integers(0, 4).map(lambda n: n / 4), st.integers(20, 200))
def test_a_tenant_on_two_models_gets_one_share(a_cost: float, b_cost: float,
                                               other_part: float, rounds: int) -> None:
    """Each round x serves once (a and b both backlogged) and y serves a once, at most
    what b's request costs: a's and b's service differ by at most one request of each
    plus y's, however long it runs (per model, a's lead would grow every round)."""
    y_cost = b_cost * other_part
    fleet = Fleet()
    served = {"A": 0.0, "B": 0.0}
    bound = a_cost + b_cost + y_cost
    for step in range(rounds):
        fleet.enqueue("x", "A", "a", a_cost, a_cost)
        fleet.enqueue("x", "B", "b", b_cost, b_cost)
        fleet.enqueue("y", "A", "a", y_cost, y_cost)
        picked = fleet.dispatch("x")
        assert picked is not None
        served[picked[0]] += a_cost if picked[0] == "A" else b_cost
        assert fleet.dispatch("y") == ("A", "a")
        served["A"] += y_cost
        gap = abs(served["A"] - served["B"])
        assert gap <= bound, f"round {step}: served {served}, gap {gap} > {bound}"


def test_per_model_the_same_workload_gives_a_two_shares() -> None:
    x, y = TwoLevel(), TwoLevel()
    served = {"A": 0.0, "B": 0.0}
    for _ in range(100):
        x.enqueue("A", "a", 1.0, 1.0)
        x.enqueue("B", "b", 1.0, 1.0)
        y.enqueue("A", "a", 1.0, 1.0)
        picked = x.dispatch()
        assert picked is not None and y.dispatch() == ("A", "a")
        served[picked[0]] += 1.0
        served["A"] += 1.0
    assert served == {"A": 150.0, "B": 50.0}, served


def test_a_charge_counts_where_the_member_is_known_and_the_lift_stays_per_model() -> None:
    fleet = Fleet()
    fleet.enqueue("x", "A", "a", 5.0, 5.0)
    fleet.enqueue("y", "B", "b", 1.0, 1.0)
    assert fleet.dispatch("x") == ("A", "a")
    fleet.settle("x", "A", "a", 3.0, 3.0)
    # y never saw A: no score made up for it there; x's own saved score holds the 8
    assert "A" not in fleet.engines["y"].tenants and "A" not in fleet.engines["y"].saved_tenants
    assert fleet.engines["x"].saved_tenants == {"A": 8.0}
    fleet.enqueue("y", "A", "a", 1.0, 1.0)  # joins y at y's floor (B's 0), not at 8
    assert fleet.engines["y"].tenants == {"A": 0.0, "B": 0.0}
    assert fleet.dispatch("y") == ("A", "a")  # ties go to the smaller name
    # its charge on y counts on x, where A is saved
    assert fleet.engines["x"].saved_tenants == {"A": 9.0}
    assert fleet.engines["y"].saved_tenants == {"A": 1.0}


def test_the_cost_factor_divides_the_weight() -> None:
    assert fleet_weight(2.0, 8.0) == 0.25 and fleet_weight(1.0, 1.0) == 1.0
    assert factor_of({"big": 8.0}, "big") == 8.0 and factor_of({"big": 8.0}, "small") == 1.0
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="cost factor"):
            fleet_weight(1.0, bad)
