"""The backend list's rules on plain data: the merge of configured and runtime backends,
a discovery's changes, entries as Redis holds them, discovered names, and the event
loop's resolver on loopback names."""

from __future__ import annotations

import pytest

from gateway.backends.discovery import discovered, resolve
from gateway.backends.registry import ADMIN, DNS, Entry, changes, in_force
from gateway.core.settings import Backend, Discovery


def backend(name: str, model: str = "m", url: str | None = None, **more: object) -> Backend:
    return Backend(name=name, url=url or f"http://{name}:8000", model=model, **more)


def test_configured_backends_come_first_and_win_a_name() -> None:
    configured = [backend("b0"), backend("b1")]
    runtime = {"b1": Entry(backend("b1", url="http://elsewhere:1"), ADMIN, 1.0),
               "rt": Entry(backend("rt"), ADMIN, 1.0),
               "dn": Entry(backend("dn"), DNS, 1.0, "svc:8000"),
               "other": Entry(backend("other", model="gone"), ADMIN, 1.0)}
    listed, origins = in_force(configured, ["m"], runtime)
    assert [(b.name, b.url) for b in listed] == [
        ("b0", "http://b0:8000"), ("b1", "http://b1:8000"), ("dn", "http://dn:8000"),
        ("rt", "http://rt:8000")], listed
    assert origins == {"b0": "config", "b1": "config", "rt": ADMIN, "dn": DNS}, origins


def test_a_discovery_adds_new_addresses_retires_gone_ones_and_updates_changed_ones() -> None:
    found = {"a": Entry(backend("a"), DNS, 1.0, "s"),
             "b": Entry(backend("b"), DNS, 1.0, "s"),
             "c": Entry(backend("c"), DNS, 1.0, "s", leaving_since=5.0),
             "d": Entry(backend("d"), DNS, 1.0, "s")}
    wanted = {"a": backend("a"), "c": backend("c"), "d": backend("d", pool="long"),
              "e": backend("e")}
    todo = changes(wanted, found)
    assert [b.name for b in todo.add] == ["e"], todo
    assert todo.retire == ["b"], todo  # c leaves already: it comes back once it is gone
    assert [b.name for b in todo.update] == ["d"], todo
    assert changes({}, found).retire == ["a", "b", "d"]


def test_an_entry_reads_back_as_written() -> None:
    entry = Entry(backend("rt", max_prompt_tokens=4096, pool="short"), DNS, 12.5,
                  "svc:8000", leaving_since=20.0, grace_s=3.0)
    assert Entry.decode(entry.encode()) == entry
    assert entry.migrate_at == 23.0
    for broken in ("{}", "[1]", '{"backend": {"name": "x"}, "origin": "admin", "added_at": 1}'):
        with pytest.raises(ValueError, match="not a runtime backend entry"):
            Entry.decode(broken)


def test_discovered_backends_are_named_by_address_and_port() -> None:
    spec = Discovery(dns_name="vllm.ns.svc", port=8000, model="m", max_prompt_tokens=8192,
                     pool="short")
    found = discovered(spec, ["10.0.0.7", "fd00::7"])
    assert {n: b.url for n, b in found.items()} == {
        "vllm.ns.svc@10.0.0.7:8000": "http://10.0.0.7:8000",
        "vllm.ns.svc@[fd00::7]:8000": "http://[fd00::7]:8000"}, found
    assert all(b.max_prompt_tokens == 8192 and b.pool == "short" and b.model == "m"
               for b in found.values()), found
    assert spec.source == "vllm.ns.svc:8000"


async def test_the_event_loops_resolver_answers_for_loopback_names() -> None:
    assert await resolve("127.0.0.1", 8000) == ["127.0.0.1"]
    localhost = await resolve("localhost", 8000)
    assert localhost and set(localhost) <= {"127.0.0.1", "::1"}, localhost
