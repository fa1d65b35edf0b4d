"""LoRA adapters in the dispatch script, against a real Redis: a request naming an
adapter is queued with its base model's and goes only to a backend that has it; fairness
counts it with the user's base-model requests (``docs/adapters.md``)."""

from __future__ import annotations

import dataclasses

import redis.asyncio as aioredis

from gateway.storage.records import BackendFit, QueuedRequest
from gateway.storage.store import Store
from tests.store.test_scripts import ALL_OPEN, M, alive, req


def named(rid: str, user: str, adapter: str | None) -> QueuedRequest:
    return dataclasses.replace(req(rid, user), adapter=adapter)


async def granted(store: Store, backend: str, adapters: frozenset[str] | None,
                  want: int = 8) -> list[str]:
    found, _ = await store.queue.dispatch(M, backend, ALL_OPEN, "r1", 1000.0, 10.0, max_grants=want,
                                    fit=BackendFit(adapters=adapters))
    return [g.request_id for g in found]


async def test_a_backend_takes_only_the_adapters_it_has(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    await store.queue.enqueue(M, named("a-chat", "alice", "chat"), 10)
    await store.queue.enqueue(M, named("a-base", "alice", None), 10)
    await store.queue.enqueue(M, named("b-sql", "bob", "sql"), 10)
    await store.queue.enqueue(M, named("c-chat", "carol", "chat"), 10)
    # alice's head names chat, which b0 lacks: her base request goes, then bob's sql
    assert await granted(store, "b0", frozenset({"sql"}), want=2) == ["a-base", "b-sql"]
    assert await granted(store, "b0", frozenset({"sql"})) == []  # the chat ones stay
    got = await granted(store, "b1", frozenset({"chat"}))
    assert sorted(got) == ["a-chat", "c-chat"], got
    assert await store.reads.depths(M) == {"interactive": 0, "default": 0, "batch": 0}


async def test_adapter_and_base_requests_share_the_users_score(redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await alive(store, "r1")
    for i in range(3):
        await store.queue.enqueue(M, named(f"a{i}", "alice", "chat" if i % 2 else None), 10)
        await store.queue.enqueue(M, named(f"b{i}", "bob", None), 10)
    order = [rid for _ in range(6) for rid in await granted(store, "b0", frozenset({"chat"}),
                                                            want=1)]
    users = [rid[0] for rid in order]
    assert users == ["a", "b", "a", "b", "a", "b"], order
