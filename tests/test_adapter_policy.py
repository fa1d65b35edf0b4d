"""policies/adapters.py: an adapter's requests go where it is resident, else where a slot
is free, else anywhere it is available; every available adapter has somewhere to go."""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import given
from hypothesis import strategies as st

from policies.adapters import AdapterHost, preferred, takes

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
