"""policies/adapters.py: an adapter's requests go where it is resident, else where a slot
is free, else anywhere it is available; every available adapter has somewhere to go."""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import given
from hypothesis import strategies as st

from policies.adapters import AdapterHost, LoadHost, LoadPlan, plan_load, preferred, takes

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
