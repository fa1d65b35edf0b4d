"""Hierarchical fair share on plain data: a request's tenant and weights
(``policies/fairness.tenant_of``), the two-level engine's model (``TwoLevel``, which the
Redis scripts follow: tests/store/test_fairness.py), its bounds, and the users locality
compares under tenants (``policies/locality.within_slack``)."""

from __future__ import annotations

import pytest

from policies.fairness import RoundRobin, TwoLevel, Vtc, level_bounds, tenant_of
from policies.locality import choose, within_slack


def test_a_request_belongs_to_its_keys_tenant_or_to_one_named_after_its_user() -> None:
    tenants = {"research": 2.0, "carol": 3.0}
    assert tenant_of("alice", "research", 1.0, tenants) == ("research", 2.0)
    assert tenant_of("bob", "unlisted", 5.0, tenants) == ("unlisted", 1.0)
    # no tenant on the key: its own tenant, weighing the key's weight unless listed
    assert tenant_of("dave", None, 4.0, tenants) == ("dave", 4.0)
    assert tenant_of("carol", None, 4.0, tenants) == ("carol", 3.0)
    # a trusted app's end users: users of the app key's tenant, named or its own (never
    # a tenant each: the tenant follows the key, not the end user)
    assert tenant_of("app", "research", 1.0, tenants) == ("research", 2.0)
    assert tenant_of("app", None, 1.0, tenants) == ("app", 1.0)


def shares(users: dict[str, str], weights: dict[str, float], dispatches: int,
           user_weights: dict[str, float] | None = None) -> dict[str, int]:
    """Requests served per user, every user flooding equal requests (cost 1 / weight)."""
    engine = TwoLevel()
    for user, tenant in users.items():
        for _ in range(dispatches):
            engine.enqueue(tenant, user, 1.0 / (user_weights or {}).get(user, 1.0),
                           1.0 / weights[tenant])
    served = dict.fromkeys(users, 0)
    for _ in range(dispatches):
        picked = engine.dispatch()
        assert picked is not None
        served[picked[1]] += 1
    return served


@pytest.mark.parametrize(("b_weight", "b_share"), [(1.0, 1 / 2), (2.0, 2 / 3)])
def test_a_tenant_of_one_user_gets_its_tenant_share(b_weight: float, b_share: float) -> None:
    users = {"a1": "A", "a2": "A", "a3": "A", "b1": "B"}
    served = shares(users, {"A": 1.0, "B": b_weight}, 600)
    assert abs(served["b1"] - 600 * b_share) <= 2  # RoundRobin's bound: 2 requests
    assert max(served[u] for u in ("a1", "a2", "a3")) - min(
        served[u] for u in ("a1", "a2", "a3")) <= 2


def test_users_share_their_tenants_part_by_weight() -> None:
    users = {"a1": "A", "a2": "A", "b1": "B"}
    served = shares(users, {"A": 1.0, "B": 1.0}, 600, {"a1": 2.0})
    assert abs(served["b1"] - 300) <= 2
    assert abs(served["a1"] - 200) <= 2 and abs(served["a2"] - 100) <= 2


def test_without_tenants_the_order_is_the_one_level_engine() -> None:
    """Every user its own tenant at its key weight: the tenant level alone decides, and it
    is the one-level engine (smallest score first, ties by name)."""
    costs = {"alice": 3.0, "bob": 1.0, "carol": 2.0}
    engine = TwoLevel()
    flat = dict.fromkeys(costs, 0.0)
    left = dict.fromkeys(costs, 50)
    for user, cost in costs.items():
        for _ in range(50):
            engine.enqueue(user, user, cost, cost)
    for _ in range(150):
        expected = min((u for u in flat if left[u]), key=lambda u: (flat[u], u))
        flat[expected] += costs[expected]
        left[expected] -= 1
        assert engine.dispatch() == (expected, expected)
    assert engine.dispatch() is None


def test_an_idle_user_of_an_idle_tenant_returns_where_its_tenant_left() -> None:
    engine = TwoLevel()
    for _ in range(10):
        engine.enqueue("A", "a1", 1.0, 1.0)
    while engine.dispatch() is not None:
        pass
    engine.enqueue("A", "a2", 1.0, 1.0)  # never served: saved score 0
    assert engine.users["A"]["a2"] == 10.0  # lifted to where a1 left, not 0


def test_settle_charges_both_levels_active_or_saved() -> None:
    engine = TwoLevel()
    engine.enqueue("A", "a1", 1.0, 0.5)
    engine.enqueue("A", "a1", 1.0, 0.5)
    assert engine.dispatch() == ("A", "a1")
    engine.settle("A", "a1", 4.0, 2.0)
    assert (engine.users["A"]["a1"], engine.tenants["A"]) == (5.0, 2.5)
    assert engine.dispatch() == ("A", "a1")
    engine.settle("A", "a1", 4.0, 2.0)  # both idle now: charged to the saved scores
    assert (engine.saved_users["A"]["a1"], engine.saved_tenants["A"]) == (10.0, 5.0)


def test_level_bounds_are_the_policys_at_each_level_plus_the_slack() -> None:
    vtc = Vtc()
    assert level_bounds(vtc, 400.0, 800.0, 4, 100.0, 200.0) == (
        vtc.bound(400.0, 4, 100.0), vtc.bound(800.0, 4, 200.0))
    assert level_bounds(RoundRobin(), 1.0, 0.5, 4, 0.0, 0.0, slack=3.0) == (5.0, 4.0)


def test_locality_compares_users_within_the_slack_at_both_levels() -> None:
    tenants = [(100.0, [(10.0, "a1"), (55.0, "a2"), (61.0, "a3")]),
               (140.0, [(0.0, "b1"), (20.0, "b2")]),
               (151.0, [(0.0, "c1")])]
    # A's a3 is 51 above a1; C is 51 above A
    assert within_slack(tenants, 50.0, 8) == ["a1", "a2", "b1", "b2"]
    assert within_slack(tenants, 50.0, 3) == ["a1", "a2", "b1"]
    assert within_slack(tenants, 0.0, 8) == ["a1"]
    assert within_slack([], 50.0, 8) == []
    # without tenants (one user each) it is the users within the slack, as choose() takes
    flat = [(100.0, [(0.0, "u0")]), (120.0, [(0.0, "u1")]), (160.0, [(0.0, "u2")])]
    assert within_slack(flat, 50.0, 8) == ["u0", "u1"]
    chains = {"u0": [("x",)], "u1": [("c1",)]}
    assert choose([(0.0, chains[u]) for u in within_slack(flat, 50.0, 8)], {"c1"}, 50.0,
                  8) == (1, 0)
