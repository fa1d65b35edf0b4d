"""``BatchStore.backlog``: the lines of unfinished batches without a result yet and the
earliest expiry, what the pools' autoscaling weighs against a batch's completion window."""

from __future__ import annotations

import redis.asyncio as aioredis

from gateway.batch.records import Backlog, BatchStore


async def test_lines_left_of_running_batches_and_their_earliest_expiry(
        redis: aioredis.Redis) -> None:
    batches = BatchStore(redis)
    assert await batches.backlog() == Backlog(0, None)
    first = await batches.create("alice", "file-a", "/v1/chat/completions", "24h", None, 10)
    second = await batches.create("bob", "file-b", "/v1/chat/completions", "24h", None, 4)
    done = await batches.create("carol", "file-c", "/v1/chat/completions", "24h", None, 50)
    assert await batches.transition(first["id"], ("validating",), "in_progress",
                                    "in_progress_at")
    assert await batches.transition(done["id"], ("validating",), "completed", "completed_at")
    for i in range(3):  # three of the first batch's lines have a result
        assert await batches.record(first["id"], f"line-{i}", {"ok": True}, ok=i != 2)
    left = await batches.backlog()
    # 7 of the first, 4 of the second (validating); a completed batch counts for nothing
    assert left == Backlog(7 + 4, float(min(first["expires_at"], second["expires_at"]))), left
