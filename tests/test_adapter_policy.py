"""policies/adapters.py: an adapter's requests go where it is resident, else where a slot
is free, else anywhere it is available; every available adapter has somewhere to go. A
runtime load: a free slot first, else the victim with the least demand past its minimum
residency (nine times its measured load); the waiting adapter with the most demand goes
first, a cold one once it has waited ``starve_s`` (a bounded wait)."""

from __future__ import annotations

import random
from collections.abc import Iterable

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.adapters import (
    RESIDENCY_FLOOR_S,
    AdapterHost,
    Demand,
    LoadHost,
    LoadPlan,
    load_order,
    plan_load,
    preferred,
    residency_s,
    takes,
)

SQL, CHAT, SUMM = "sql", "chat", "summ"


def host(name: str, available: Iterable[str], active: Iterable[str] = (),
         slots: int | None = 2) -> AdapterHost:
    return AdapterHost(name, frozenset(available), frozenset(active), slots)


def test_resident_first_then_a_free_slot_then_anywhere_it_is() -> None:
    running_sql = host("b0", {SQL, CHAT}, {SQL})
    free = host("b1", {SQL, CHAT})
    full = host("b2", {SQL, CHAT, SUMM}, {SUMM, "x"})
    hosts = [running_sql, free, full]
    assert preferred(SQL, hosts) == ["b0"]
    assert preferred(CHAT, hosts) == ["b0", "b1"]  # both have a free slot
    assert preferred(SUMM, hosts) == ["b2"]
    assert preferred(SUMM, [host("b3", {SUMM}, {"x", "y"})]) == ["b3"]  # full: still goes
    assert preferred("nowhere", hosts) == []


def test_an_oversubscribed_backend_proves_no_residency() -> None:
    # three adapters with requests on two slots: one of them waits, the gauge does not
    # say which, so none counts as resident there
    crowded = host("b0", {SQL, CHAT, SUMM}, {SQL, CHAT, SUMM})
    quiet = host("b1", {SQL})
    assert preferred(SQL, [crowded, quiet]) == ["b1"]


def test_unknown_slots_count_as_free() -> None:
    assert preferred(SQL, [host("b0", {SQL}, {CHAT}, slots=None), host("b1", {SQL}, {CHAT}, 1)]
                     ) == ["b0"]


names = st.sampled_from(["a", "b", "c", "d", "e"])
hosts_st = st.lists(st.builds(
    AdapterHost, st.sampled_from(["b0", "b1", "b2", "b3"]), st.frozensets(names),
    st.frozensets(names), st.one_of(st.none(), st.integers(1, 3))),
    max_size=4, unique_by=lambda h: h.name)


@given(hosts_st)
def test_takes_covers_every_available_adapter_and_only_those(hosts: list[AdapterHost]) -> None:
    chosen = takes(hosts)
    for h in hosts:
        assert chosen[h.name] <= h.available, (h, chosen)
    available = {a for h in hosts for a in h.available}
    covered = {a for adapters in chosen.values() for a in adapters}
    assert covered == available, (hosts, chosen)


# --------------------------------------------------------------------------- runtime loads

def loader(name: str, loaded: Iterable[str], slots: int | None = 2, load: int = 0,
           active: Iterable[str] = (), loaded_at: dict[str, float] | None = None,
           last_used: dict[str, float] | None = None,
           unloadable: Iterable[str] | None = None) -> LoadHost:
    loaded = frozenset(loaded)
    return LoadHost(name, loaded, slots, load, frozenset(active),
                    loaded if unloadable is None else frozenset(unloadable),
                    loaded_at or {}, last_used or {})


NOW, RESIDENCY = 1000.0, 30.0


def test_a_resident_adapter_is_not_loaded_again() -> None:
    assert plan_load(SQL, [loader("b0", {SQL}), loader("b1", ())], NOW, RESIDENCY) is None


def test_a_free_slot_on_the_least_loaded_backend() -> None:
    hosts = [loader("b0", (), load=5), loader("b1", {CHAT}, load=1),
             loader("b2", {CHAT, SUMM}, load=0)]  # full
    assert plan_load(SQL, hosts, NOW, RESIDENCY) == LoadPlan("b1")
    assert plan_load(SQL, [loader("b0", {CHAT, SUMM}, slots=None)], NOW,
                     RESIDENCY) == LoadPlan("b0")  # unknown slots: taken as free


def test_no_slot_free_unloads_the_least_recently_used_idle_adapter() -> None:
    full = loader("b0", {CHAT, SUMM, "x"}, slots=3, active={"x"},
                  last_used={CHAT: NOW - 50, SUMM: NOW - 100, "x": NOW - 500})
    assert plan_load(SQL, [full], NOW, RESIDENCY) == LoadPlan("b0", SUMM)


def test_a_busy_adapter_makes_room_only_when_none_is_idle() -> None:
    busy = loader("b0", {CHAT, SUMM}, active={CHAT, SUMM}, last_used={CHAT: NOW, SUMM: NOW - 1})
    assert plan_load(SQL, [busy], NOW, RESIDENCY) == LoadPlan("b0", SUMM)
    idle_there = loader("b1", {"x", "y"}, load=9, active={"x"})
    assert plan_load(SQL, [busy, idle_there], NOW, RESIDENCY) == LoadPlan("b1", "y")


def test_an_adapter_stays_its_minimum_residency() -> None:
    fresh = loader("b0", {CHAT, SUMM}, loaded_at={CHAT: NOW - 5, SUMM: NOW - 29.9})
    assert plan_load(SQL, [fresh], NOW, RESIDENCY) is None  # ask again later
    assert plan_load(SQL, [fresh], NOW + 0.2, RESIDENCY) == LoadPlan("b0", SUMM)


def test_only_adapters_the_gateway_can_load_back_are_unloaded() -> None:
    started_with = loader("b0", {CHAT, SUMM}, unloadable={SUMM}, last_used={CHAT: 0.0})
    assert plan_load(SQL, [started_with], NOW, RESIDENCY) == LoadPlan("b0", SUMM)
    assert plan_load(SQL, [loader("b0", {CHAT, SUMM}, unloadable=())], NOW, RESIDENCY) is None


load_hosts = st.lists(st.builds(
    loader, st.sampled_from(["b0", "b1", "b2"]), st.frozensets(names, max_size=4),
    st.one_of(st.none(), st.integers(1, 3)), st.integers(0, 5), st.frozensets(names),
    st.dictionaries(names, st.floats(NOW - 100, NOW)),
    st.dictionaries(names, st.floats(0, NOW)), st.one_of(st.none(), st.frozensets(names))),
    min_size=1, max_size=3, unique_by=lambda h: h.name)


@given(names, load_hosts)
def test_a_plan_only_loads_where_it_may(adapter: str, hosts: list[LoadHost]) -> None:
    plan = plan_load(adapter, hosts, NOW, RESIDENCY)
    resident = any(adapter in h.loaded for h in hosts)
    if plan is None:
        # nothing to do, or no slot free and nothing may go yet
        assert resident or all(not h.free and h.victim(NOW, RESIDENCY) is None
                               for h in hosts), (adapter, hosts)
        return
    assert not resident, (adapter, hosts, plan)
    host = next(h for h in hosts if h.name == plan.backend)
    if plan.unload is None:
        assert host.free, (host, plan)
        assert host.load == min(h.load for h in hosts if h.free), (hosts, plan)
    else:
        assert not any(h.free for h in hosts), (hosts, plan)
        assert plan.unload in host.loaded & host.unloadable, (host, plan)
        loaded_at = host.loaded_at.get(plan.unload, float("-inf"))
        assert NOW - loaded_at >= RESIDENCY, (host, plan)  # never within its residency
        if plan.unload in host.active:  # busy only when no backend has an idle victim
            assert all(h.victim(NOW, RESIDENCY) in h.active for h in hosts
                       if h.victim(NOW, RESIDENCY) is not None), (hosts, plan)


# ------------------------------------------------------- residency from the measured load

def test_the_minimum_residency_is_nine_loads_at_least_the_floor_or_the_override() -> None:
    assert residency_s(0.5) == 4.5  # loading is then a tenth of the slot's time
    assert residency_s(0.01) == RESIDENCY_FLOOR_S
    assert residency_s(None) == RESIDENCY_FLOOR_S  # not measured
    assert residency_s(0.5, 30.0) == 30.0 and residency_s(9.0, 0.0) == 0.0  # the setting


def test_an_adapter_stays_nine_times_its_measured_load() -> None:
    fresh = LoadHost("b0", frozenset({CHAT, SUMM}), 2, unloadable=frozenset({CHAT, SUMM}),
                     loaded_at={CHAT: NOW - 4.0, SUMM: NOW - 1.0},
                     load_s={CHAT: 0.5, SUMM: 0.05})
    # SUMM loaded fast (floor 1 s) may go; CHAT's 0.5 s load keeps it 4.5 s
    assert plan_load(SQL, [fresh], NOW, None) == LoadPlan("b0", SUMM)
    only_chat = LoadHost("b0", frozenset({CHAT, SUMM}), 2, unloadable=frozenset({CHAT}),
                         loaded_at={CHAT: NOW - 4.0}, load_s={CHAT: 0.5})
    assert plan_load(SQL, [only_chat], NOW, None) is None
    assert plan_load(SQL, [only_chat], NOW + 0.6, None) == LoadPlan("b0", CHAT)


@given(st.floats(0.001, 60.0), st.floats(0.0, 1e4))
def test_loading_is_at_most_a_tenth_of_a_slots_time(load_s: float, start: float) -> None:
    """Back-to-back loads into one slot, each as early as the rule allows."""
    loads, t = 0, start
    while t < start + 100 * (load_s + residency_s(load_s)):
        t += load_s + residency_s(load_s)
        loads += 1
    assert loads * load_s <= 0.1 * (t - start) + 1e-9, (loads, load_s, t - start)


# ------------------------------------------------------------------ demand orders slots

def test_the_waiting_adapter_with_the_most_requests_goes_first() -> None:
    waiting = {"cold": Demand(1, NOW - 5), "hot": Demand(9, NOW - 1), "warm": Demand(3, NOW - 2)}
    assert load_order(waiting, NOW, starve_s=15) == ["hot", "warm", "cold"]
    tie = {"b": Demand(2, NOW - 1), "a": Demand(2, NOW - 3)}
    assert load_order(tie, NOW, starve_s=15) == ["a", "b"]  # the longest wait


def test_past_starve_s_the_longest_waiting_goes_first_whatever_the_demand() -> None:
    waiting = {"cold": Demand(1, NOW - 20), "older": Demand(1, NOW - 40), "hot": Demand(9, NOW)}
    assert load_order(waiting, NOW, starve_s=15) == ["older", "cold", "hot"]


def test_an_adapter_without_demand_makes_room_before_one_with_demand() -> None:
    full = loader("b0", {CHAT, SUMM}, last_used={CHAT: NOW - 100, SUMM: NOW - 1})
    wanted = {CHAT: Demand(2, NOW - 1), SQL: Demand(5, NOW - 1)}
    # CHAT is the least recently used, but requests wait for it: SUMM goes
    assert plan_load(SQL, [full], NOW, RESIDENCY, wanted) == LoadPlan("b0", SUMM)
    both = {**wanted, SUMM: Demand(1, NOW - 1)}
    assert plan_load(SQL, [full], NOW, RESIDENCY, both) == LoadPlan("b0", SUMM)  # fewer
    busy = loader("b0", {CHAT, SUMM}, active={SUMM}, last_used={CHAT: NOW - 100})
    assert plan_load(SQL, [busy], NOW, RESIDENCY, wanted) == LoadPlan("b0", SUMM)


def test_an_adapter_with_demand_is_displaced_only_by_more_demand_or_a_starving_one() -> None:
    full = loader("b0", {CHAT, SUMM})
    wanted = {CHAT: Demand(3, NOW - 1), SUMM: Demand(3, NOW - 1), SQL: Demand(2, NOW - 1)}
    assert plan_load(SQL, [full], NOW, RESIDENCY, wanted, starve_s=15) is None
    more = {**wanted, SQL: Demand(4, NOW - 1)}
    assert plan_load(SQL, [full], NOW, RESIDENCY, more, starve_s=15) == LoadPlan("b0", CHAT)
    starving = {**wanted, SQL: Demand(1, NOW - 15)}
    assert plan_load(SQL, [full], NOW, RESIDENCY, starving, starve_s=15) == LoadPlan("b0", CHAT)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.floats(0.05, 2.0), st.integers(1, 6), st.randoms())
def test_a_cold_adapter_with_a_request_waiting_is_loaded_within_the_bound(
        slots: int, load_s: float, hot: int, rng: random.Random) -> None:
    """Popular adapters (many requests each, always some waiting for a slot) against one
    cold adapter with one request: it is loaded by ``starve_s`` + its victim's minimum
    residency + two loads (one may be under way when it starves: the victim can be the
    adapter that load brings; then its own), whatever the popular ones do. Loads are one
    at a time, each as soon as the first adapter in ``load_order`` that can be placed
    may be."""
    starve_s, step_s = 15.0, 0.1
    hots = [f"h{i}" for i in range(slots + hot)]
    loaded = {a: 0.0 for a in hots[:slots]}
    t, since = 0.0, {a: rng.uniform(0.01, 5.0) for a in hots}  # after the cold one
    bound = starve_s + residency_s(load_s) + 2 * load_s + step_s + 1e-6  # float steps
    while "cold" not in loaded:
        assert t <= bound, (t, bound, loaded)
        demand = {a: Demand(rng.randint(1, 9), since[a]) for a in hots}
        demand["cold"] = Demand(1, 0.0)
        host = LoadHost("b0", frozenset(loaded), slots, unloadable=frozenset(loaded),
                        loaded_at=loaded, load_s=dict.fromkeys(loaded, load_s))
        waiting = {a: d for a, d in demand.items() if a not in loaded}
        for adapter in load_order(waiting, t, starve_s):
            plan = plan_load(adapter, [host], t, None, demand, starve_s)
            if plan is not None:
                if plan.unload is not None:
                    del loaded[plan.unload]
                    since[plan.unload] = t  # its requests queue again
                t += load_s
                loaded[adapter] = t
                break
        else:
            t += step_s
    assert t <= bound, (t, bound)
