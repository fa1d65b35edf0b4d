"""policies/share_ratio.py: served share against entitled share, on plain data."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from policies.share_ratio import Account, ShareRatios, share_ratios


def test_four_to_one_served_at_weights_four_and_one_is_exactly_fair() -> None:
    accounts = {"heavy": Account(800.0, 4.0, "", 4.0), "light": Account(200.0, 1.0, "", 1.0)}
    ratios = share_ratios(accounts, {"heavy", "light"})
    assert ratios.tenants == {}  # no named tenant: each user is its own
    assert math.isclose(ratios.users["heavy"], 1.0) and math.isclose(ratios.users["light"], 1.0)


def test_fairness_by_replica_shows_far_from_one() -> None:
    # 3 replicas each fair over its own ingress (heavy only enters replica 1), each with a
    # third of the backend: heavy 4/5 of a third, light the rest
    heavy, light = 4 / 15, 11 / 15
    ratios = share_ratios({"heavy": Account(heavy, 4.0, "", 4.0),
                           "light": Account(light, 1.0, "", 1.0)}, {"heavy", "light"})
    assert math.isclose(ratios.users["heavy"], (4 / 15) / 0.8), ratios
    assert ratios.users["heavy"] < 0.34 and ratios.users["light"] > 3.6, ratios


def test_only_backlogged_users_compete_and_are_reported() -> None:
    accounts = {"a": Account(50.0), "b": Account(50.0), "idle": Account(400.0)}
    ratios = share_ratios(accounts, {"a", "b", "unknown"})
    assert ratios.users == {"a": 1.0, "b": 1.0}  # idle's service is not theirs to share


def test_tenants_then_users() -> None:
    accounts = {
        "r1": Account(300.0, 1.0, "research", 2.0), "r2": Account(100.0, 1.0, "research", 2.0),
        "p1": Account(200.0, 1.0, "product", 1.0), "solo": Account(0.0, 3.0, "", 1.0),
    }
    ratios = share_ratios(accounts, {"r1", "r2", "p1"})
    # research (weight 2) got 400 of 600 = its 2/3: fair; within it r1 took 3/4, not 1/2
    assert math.isclose(ratios.tenants["research"], 1.0)
    assert math.isclose(ratios.tenants["product"], 1.0)
    assert math.isclose(ratios.users["r1"], (300 / 600) / (2 / 3 / 2))
    assert math.isclose(ratios.users["r2"], (100 / 600) / (2 / 3 / 2))
    assert "solo" not in ratios.users


def test_nothing_served_yet_reports_nothing() -> None:
    assert share_ratios({"a": Account(0.0), "b": Account(0.0)}, {"a", "b"}) == ShareRatios()
    assert share_ratios({}, set()) == ShareRatios()


weights = st.floats(0.1, 10.0)
# none or a real amount (token costs): a subnormal service, 5e-324 x 0.5, rounds to none,
# and a user with none has no share to scale (hypothesis found that one)
services = st.one_of(st.just(0.0), st.floats(1e-3, 1e6))


@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict[str, Account], set[str]]:
    tenants = draw(st.lists(st.tuples(st.sampled_from(["", "t1", "t2", "t3"]), weights),
                            min_size=1, max_size=4))
    tenant_weight = dict(tenants)
    users = draw(st.dictionaries(st.text("abcdef", min_size=1, max_size=3),
                                 st.tuples(st.sampled_from(sorted(tenant_weight)), weights,
                                           services), min_size=1, max_size=8))
    accounts = {u: Account(s, w, t, tenant_weight[t]) for u, (t, w, s) in users.items()}
    backlogged = draw(st.sets(st.sampled_from(sorted(users))))
    return accounts, backlogged


@given(workloads(), st.floats(0.01, 100.0))
def test_scaling_service_or_weights_changes_nothing(
        work: tuple[dict[str, Account], set[str]], k: float) -> None:
    accounts, backlogged = work
    base = share_ratios(accounts, backlogged)
    more = share_ratios({u: Account(a.service * k, a.weight, a.tenant, a.tenant_weight)
                         for u, a in accounts.items()}, backlogged)
    heavier = share_ratios({u: Account(a.service, a.weight * k, a.tenant, a.tenant_weight * k)
                            for u, a in accounts.items()}, backlogged)
    for other in (more, heavier):
        assert set(other.users) == set(base.users) and set(other.tenants) == set(base.tenants)
        for u, r in base.users.items():
            assert math.isclose(other.users[u], r, rel_tol=1e-6, abs_tol=1e-9), (u, r, other)


@given(workloads())
def test_service_in_proportion_to_entitlement_reads_one(
        work: tuple[dict[str, Account], set[str]]) -> None:
    accounts, backlogged = work
    backlogged = {u for u in backlogged if accounts[u].tenant == ""} or backlogged
    # serve each backlogged user exactly its entitled share; nobody else anything
    own = {u: accounts[u].tenant or u for u in backlogged}
    tw = {t: max(accounts[u].tenant_weight for u in backlogged if own[u] == t)
          for t in own.values()}
    inner = {t: sum(accounts[u].weight for u in backlogged if own[u] == t) for t in tw}
    fair = {u: Account(tw[own[u]] / sum(tw.values()) * accounts[u].weight / inner[own[u]],
                       accounts[u].weight, accounts[u].tenant, accounts[u].tenant_weight)
            for u in backlogged}
    ratios = share_ratios(fair, backlogged)
    assert set(ratios.users) == backlogged
    for r in (*ratios.users.values(), *ratios.tenants.values()):
        assert math.isclose(r, 1.0, rel_tol=1e-9), ratios


@given(workloads())
def test_tenant_ratios_average_to_one_at_their_weights(
        work: tuple[dict[str, Account], set[str]]) -> None:
    accounts, backlogged = work
    competing = {accounts[u].tenant or u for u in backlogged}
    only = {u: a for u, a in accounts.items() if (a.tenant or u) in competing}
    ratios = share_ratios(only, backlogged)
    if not ratios.users:
        return
    # every user its own tenant here: the entitled-share-weighted mean of the ratios is 1
    flat = {u: Account(a.service, 1.0, "", a.tenant_weight) for u, a in only.items()
            if u in backlogged}
    flat_ratios = share_ratios(flat, backlogged)
    tw = {u: a.tenant_weight for u, a in flat.items()}
    if not flat_ratios.users:
        return
    mean = sum(flat_ratios.users[u] * tw[u] for u in flat_ratios.users) / sum(tw.values())
    assert math.isclose(mean, 1.0, rel_tol=1e-9), flat_ratios
