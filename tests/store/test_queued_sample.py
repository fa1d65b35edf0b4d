"""``Store.queued_sample``: the queued requests the pools' demand reads, on a real Redis."""

from __future__ import annotations

import dataclasses

import redis.asyncio as aioredis

from gateway.storage.records import QueuedRequest, QueuedSample
from gateway.storage.store import Store

M = "m"


def req(rid: str, user: str, klass: str, prompt: int, deadline: float | None = None
        ) -> QueuedRequest:
    return QueuedRequest(rid, user, klass, "r1", 1.0, 1000.0 + int(rid[1:]),
                         prompt_tokens=prompt, deadline_at=deadline)


async def test_a_sample_per_class_spread_over_users_with_sizes_and_deadlines(
        redis: aioredis.Redis) -> None:
    store = Store.over(redis, 600)
    await store.replicas.heartbeat([M], "r1", 1000.0)
    for i in range(6):  # alice: 6 interactive requests, bob: 2
        await store.queue.enqueue(M, req(f"a{i}", "alice", "interactive", 100 + i), 100)
    for i in range(2):
        await store.queue.enqueue(M, req(f"b{i}", "bob", "interactive", 50, deadline=2000.0), 100)
    await store.queue.enqueue(M, req("c0", "carol", "batch", 7), 100)

    every = await store.reads.queued_sample(M, 100)
    assert sorted(s.prompt_tokens for s in every if s.klass == "interactive") == [
        50, 50, 100, 101, 102, 103, 104, 105], every
    assert [dataclasses.astuple(s) for s in every if s.klass == "batch"] == [
        ("batch", 7, 1000.0, None)], every
    assert {s.deadline_at for s in every if s.prompt_tokens == 50} == {2000.0}, every

    # at most 4 of a class, from both of its users (2 each), the other class's too
    some = await store.reads.queued_sample(M, 4)
    interactive = [s for s in some if s.klass == "interactive"]
    assert len(interactive) == 4, some
    assert sorted(s.prompt_tokens for s in interactive) == [50, 50, 100, 101], some
    assert QueuedSample("batch", 7, 1000.0, None) in some
    assert await store.reads.queued_sample("empty", 4) == []
