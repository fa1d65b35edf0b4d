"""Guaranteed tenant shares on plain data (``policies/fairness.py`` owed_tenant, and the
two-level engine's model ``TwoLevel`` that the Redis scripts follow:
tests/store/test_lua_fairness_spec.py): a backlogged tenant gets at least its
``min_share`` of every window of dispatches, whatever the weights, and without shares the
order is the scores' alone."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.fairness import TwoLevel, owed_tenant, remember_tenant

NAMES = ["A", "B", "C", "D"]


def test_the_most_owed_backlogged_tenant_is_owed() -> None:
    shares = [("A", 0.3), ("B", 0.5), ("C", 0.2)]
    recent = ["A"] * 2 + ["X"] * 8  # 10 dispatches: A has 2 (owes 1), B 0 (owes 5), C 0 (2)
    assert owed_tenant(shares, {"A", "B", "C"}, recent, 10) == "B"
    assert owed_tenant(shares, {"A", "C"}, recent, 10) == "C"  # B has nothing queued
    assert owed_tenant(shares, {"A"}, recent, 10) == "A"
    # its share met (3 of 10): nobody is owed, the scores decide
    assert owed_tenant(shares, {"A"}, ["A"] * 3 + ["X"] * 7, 10) is None
    # only the last `window` dispatches count (newest first)
    assert owed_tenant(shares, {"A"}, ["X"] * 7 + ["A"] * 3, 7) == "A"
    assert owed_tenant(shares, {"A"}, ["A"] * 3 + ["X"] * 7, 7) is None
    # no dispatch yet: every backlogged tenant with a share is owed; ties to the first name
    assert owed_tenant([("A", 0.5), ("B", 0.5)], {"A", "B"}, [], 10) == "A"
    assert owed_tenant([("A", 0.0)], {"A"}, [], 10) is None
    assert owed_tenant([], {"A"}, [], 10) is None


def test_remember_keeps_the_window_newest_first() -> None:
    assert remember_tenant(["B", "A"], "C", 3) == ["C", "B", "A"]
    assert remember_tenant(["B", "A", "A"], "C", 3) == ["C", "B", "A"]


def test_an_owed_tenant_is_served_whatever_its_score() -> None:
    engine = TwoLevel(min_share=(("A", 0.3),), window=10)
    engine.enqueue("A", "a1", 1.0, 1.0)
    engine.enqueue("B", "b1", 1.0, 1.0)
    engine.tenants["A"] = 1000.0  # far more served than B: the scores pick B
    engine.recent_tenants = ["B"] * 10  # but A had none of the last 10 dispatches
    pick = engine.pick()
    assert pick is not None and pick.tenant == "A", pick
    engine.serve(pick)
    assert engine.recent_tenants[0] == "A", engine.recent_tenants


@st.composite
def scenes(draw: st.DrawFn, max_shared: int) -> dict[str, Any]:
    """Tenants flooding the queue: weights, users, guaranteed shares (at most 1 in all, on
    at most ``max_shared`` of them), a window, and each request's cost factor."""
    count = draw(st.integers(2, len(NAMES)))
    tenants = NAMES[:count]
    shared = draw(st.lists(st.sampled_from(tenants), min_size=1, max_size=max_shared,
                           unique=True))
    parts = draw(st.lists(st.integers(1, 20), min_size=len(shared), max_size=len(shared)))
    total = draw(st.sampled_from([1.0, 0.9, 0.5, 0.3]))
    shares = {t: total * p / sum(parts) for t, p in zip(shared, parts, strict=True)}
    return {
        "weights": {t: draw(st.sampled_from([1.0, 2.0, 9.0, 50.0])) for t in tenants},
        "users": {t: draw(st.integers(1, 3)) for t in tenants},
        "shares": tuple(sorted(shares.items())),
        "window": draw(st.integers(3, 60)),
        "costs": draw(st.lists(st.sampled_from([0.5, 1.0, 1.0, 3.0]), min_size=1,
                               max_size=8)),
    }


def flood(scene: dict[str, Any], dispatches: int) -> list[str]:
    """Every user keeps a request queued; the tenants served, in dispatch order."""
    engine = TwoLevel(min_share=scene["shares"], window=scene["window"])
    costs = scene["costs"]
    sent = 0

    def enqueue(tenant: str, user: str) -> None:
        nonlocal sent
        cost = costs[sent % len(costs)]
        sent += 1
        engine.enqueue(tenant, user, cost, cost / scene["weights"][tenant])

    for tenant, users in scene["users"].items():
        for i in range(users):
            enqueue(tenant, f"{tenant}{i}")
    served = []
    for _ in range(dispatches):
        pick = engine.pick()
        assert pick is not None
        engine.serve(pick)
        enqueue(pick.tenant, pick.user)
        served.append(pick.tenant)
    return served


def shortfalls(scene: dict[str, Any], served: list[str]) -> list[tuple[int, str, float]]:
    """(dispatch, tenant, by how many dispatches it was below its share of the window
    ending there) for each tenant with a share, at each dispatch."""
    window = scene["window"]
    out = []
    for end in range(1, len(served) + 1):
        seen = served[max(0, end - window):end]
        for tenant, share in scene["shares"]:
            out.append((end, tenant, share * len(seen) - seen.count(tenant)))
    return out


@settings(max_examples=150, deadline=None)
@given(scenes(max_shared=1))
def test_a_tenant_with_a_share_gets_it_in_every_window_less_one_dispatch(
        scene: dict[str, Any]) -> None:
    """One tenant with a guaranteed share, backlogged throughout against heavier ones:
    in every window of dispatches (and every prefix of the first) it has its share of
    them, less one dispatch at most."""
    served = flood(scene, 3 * scene["window"] + 5)
    worst = max(shortfalls(scene, served), key=lambda s: s[2])
    assert worst[2] <= 1 + 1e-9, (
        f"{worst[1]} short by {worst[2]:.3f} at dispatch {worst[0]}: {served}")


@settings(max_examples=150, deadline=None)
@given(scenes(max_shared=len(NAMES)))
def test_tenants_with_shares_each_get_theirs_in_every_window_less_two_dispatches(
        scene: dict[str, Any]) -> None:
    """Several tenants with shares (up to 1 in all): two may be owed at once and one
    dispatch serves one, so each has its share of every window less two dispatches at
    most."""
    served = flood(scene, 3 * scene["window"] + 5)
    worst = max(shortfalls(scene, served), key=lambda s: s[2])
    assert worst[2] <= 2 + 1e-9, (
        f"{worst[1]} short by {worst[2]:.3f} at dispatch {worst[0]}: {served}")


WORKLOAD = st.lists(st.one_of(
    st.tuples(st.just("enqueue"), st.sampled_from(NAMES), st.integers(0, 2),
              st.sampled_from([0.5, 1.0, 2.0]), st.sampled_from([0.1, 1.0, 9.0])),
    st.tuples(st.just("dispatch"))), max_size=60)


@settings(max_examples=150, deadline=None)
@given(WORKLOAD, st.lists(st.sampled_from(["X", "Y"]), max_size=2, unique=True),
       st.sampled_from([0.0, 0.3, 1.0]))
def test_without_shares_on_backlogged_tenants_the_order_is_unchanged(
        ops: list[tuple[Any, ...]], absent: list[str], share: float) -> None:
    """Shares of 0, or only for tenants that never queue: every pick is the one the
    engine without shares makes."""
    plain = TwoLevel()
    shared = TwoLevel(min_share=tuple((t, share) for t in absent)
                      + tuple((t, 0.0) for t in NAMES[:2]), window=5)
    for step, op in enumerate(ops):
        if op[0] == "enqueue":
            _, tenant, user, cost, tcost = op
            for engine in (plain, shared):
                engine.enqueue(tenant, f"{tenant}{user}", cost, tcost, f"r{step}")
        else:
            want, got = plain.pick(), shared.pick()
            assert got == want, f"step {step} of {ops}: with shares {got}, without {want}"
            if want is not None:
                plain.serve(want)
                shared.serve(got)  # type: ignore[arg-type]
