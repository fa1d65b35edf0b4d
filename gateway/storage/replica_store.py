"""The replica protocol's reads and writes: a replica's heartbeat, its grant and
preempt-order lists, and the dispatched requests it holds (for reconciling).
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from typing import cast

import redis.asyncio as aioredis

from gateway.storage.keys import ModelKeys
from gateway.storage.records import (
    Grant,
    Preempt,
    grant_from,
)
from gateway.storage.values import GRANT, PREEMPT


class ReplicaStore:
    """One replica's side of the store, over one Redis client."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def heartbeat(self, models: Sequence[str], replica: str, now: float,
                        listened: Mapping[str, float] | None = None,
                        live_since: float | None = None) -> int:
        """Mark ``replica`` alive at ``now``; ``listened``: per model, when its grant
        listener last turned (a grant left unread is a dead replica only if that is old
        too, see ``replica_alive`` in ``lua/_lib.lua``). Returns how many replicas beat
        since ``live_since`` (of the first model; 1 without it or without models)."""
        pipe = self.client.pipeline(transaction=False)
        for model in models:
            k = ModelKeys(model)
            pipe.zadd(k.replicas, {replica: now})
            if listened and model in listened:
                pipe.hset(k.listened, replica, str(listened[model]))
        if models and live_since is not None:
            pipe.zcount(ModelKeys(models[0]).replicas, live_since, "+inf")
        replies = await pipe.execute()
        return max(1, int(replies[-1])) if models and live_since is not None else 1

    async def next_order(self, model: str, replica: str, timeout_s: float
                         ) -> tuple[str, str, int, int | None] | Preempt | None:
        """Block until a grant for one of this replica's requests, or an order to preempt
        one of its streams, arrives (or timeout)."""
        k = ModelKeys(model)
        item = await cast("Awaitable[list[str] | None]", self.client.blpop(
            [k.grants(replica), k.preempts(replica)], timeout=timeout_s))
        if item is None:
            return None
        if item[0] == k.preempts(replica):
            order = PREEMPT.decode(item[1])
            return Preempt(order["request_id"], order["original"], order["backend"])
        raw = item[1]
        if raw.count("\t") == len(GRANT.fields) - 2:  # pushed by an older replica
            raw += "\t"
        entry = GRANT.decode(raw)
        # the prompt tokens its dispatch charged (None: not said, the whole estimate)
        charged = int(entry["charged"]) if entry["charged"] else None
        return entry["request_id"], entry["backend"], int(entry["rank"]), charged

    async def held_by(self, model: str, replica: str) -> list[tuple[Grant, float]]:
        """The dispatched, unsettled requests whose client ``replica`` holds, by Redis,
        each with its dispatch time."""
        k = ModelKeys(model)
        ids = await cast("Awaitable[set[str]]", self.client.smembers(k.running(replica)))
        pipe = self.client.pipeline(transaction=False)
        for request_id in ids:
            pipe.hgetall(k.request(request_id))
        found = []
        for request_id, raw in zip(ids, await pipe.execute(), strict=True):
            if raw.get("state") == "dispatched":
                found.append((grant_from(request_id, raw), float(raw.get("dispatched_at") or 0)))
        return found

    async def dispatched(self, model: str, request_id: str) -> Grant | None:
        """The grant of a dispatched, unsettled request, read back from Redis."""
        k = ModelKeys(model)
        raw = await cast("Awaitable[dict[str, str]]", self.client.hgetall(k.request(request_id)))
        if raw.get("state") != "dispatched":
            return None
        return grant_from(request_id, raw)
