"""Read queries operators, wait estimates and the dashboard need (queue depths, queued
users and samples, a request's place and hash), and the dashboard history every process
adds to (``lua/history.lua``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import cast

import redis.asyncio as aioredis

from gateway.storage.keys import HISTORY_INDEX, ModelKeys, history_key
from gateway.storage.records import (
    QueuedSample,
    QueuedUser,
)
from gateway.storage.scripts import Scripts
from policies.classes import CLASS_ORDER


class ReadStore:
    """Reads (and the shared history) over one Redis client."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._scripts = Scripts(client, ("history",))

    async def ping(self) -> bool:
        return bool(await cast("Awaitable[bool]", self.client.ping()))

    async def class_service(self, model: str) -> tuple[dict[str, float], list[str]]:
        """(class → backlogged since, classes of the latest dispatches, newest first)."""
        k = ModelKeys(model)
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(k.backlogged_since)
        pipe.lrange(k.recent, 0, -1)
        since, recent = await pipe.execute()
        return {c: float(t) for c, t in since.items()}, list(recent)

    async def request_fields(self, model: str, request_id: str) -> dict[str, str]:
        """A queued or running request's hash (empty when there is none)."""
        return await cast("Awaitable[dict[str, str]]",
                          self.client.hgetall(ModelKeys(model).request(request_id)))

    async def request_exists(self, model: str, request_id: str) -> bool:
        return bool(await self.client.exists(ModelKeys(model).request(request_id)))

    async def depths(self, model: str) -> dict[str, int]:
        raw = await cast("Awaitable[dict[str, str]]", self.client.hgetall(ModelKeys(model).depth))
        return {c: int(raw.get(c, 0)) for c in CLASS_ORDER}

    async def user_inflight(self, model: str) -> dict[str, int]:
        raw = await cast("Awaitable[dict[str, str]]",
                         self.client.hgetall(ModelKeys(model).user_inflight))
        return {u: int(v) for u, v in raw.items()}

    async def queued_users(self, model: str, per_class: int) -> list[QueuedUser]:
        """The first ``per_class`` active users of each class, in the first ``per_class``
        active tenants, with their queue heads; each with its tenant's score."""
        k = ModelKeys(model)
        pipe = self.client.pipeline(transaction=False)
        for klass in CLASS_ORDER:
            pipe.zrange(k.active(klass), 0, per_class - 1, withscores=True)
        actives = await pipe.execute()
        tenants = [(klass, str(tenant), float(score))
                   for klass, members in zip(CLASS_ORDER, actives, strict=True)
                   for tenant, score in members]
        pipe = self.client.pipeline(transaction=False)
        for klass, tenant, _ in tenants:
            pipe.zrange(k.users(klass, tenant), 0, per_class - 1)
        members = await pipe.execute()
        pairs = [(klass, str(user), score, tenant)
                 for (klass, tenant, score), users in zip(tenants, members, strict=True)
                 for user in users]
        pipe = self.client.pipeline(transaction=False)
        for klass, user, _, tenant in pairs:
            pipe.llen(k.queue(klass, user, tenant))
            pipe.lindex(k.queue(klass, user, tenant), 0)
        heads = await pipe.execute()
        pipe = self.client.pipeline(transaction=False)
        for i in range(len(pairs)):
            pipe.hget(k.request(str(heads[2 * i + 1] or "")), "enqueued_at")
        enqueued = await pipe.execute()
        return [QueuedUser(klass, user, score, int(heads[2 * i]), heads[2 * i + 1],
                           float(enqueued[i]) if enqueued[i] else None,
                           "" if tenant == user else tenant)
                for i, (klass, user, score, tenant) in enumerate(pairs)]

    async def queued_sample(self, model: str, per_class: int) -> list[QueuedSample]:
        """Up to ``per_class`` queued requests of each class, spread over the queues of
        its first active tenants and users (a sample: the caller scales it to the
        class's depth)."""
        users = await self.queued_users(model, per_class)
        k = ModelKeys(model)
        per_user = {c: max(1, per_class // max(1, sum(u.klass == c for u in users)))
                    for c in CLASS_ORDER}
        pipe = self.client.pipeline(transaction=False)
        for u in users:
            pipe.lrange(k.queue(u.klass, u.user, u.tenant or u.user), 0, per_user[u.klass] - 1)
        queues = await pipe.execute()
        picked: list[tuple[str, str]] = []
        taken = dict.fromkeys(CLASS_ORDER, 0)
        for u, ids in zip(users, queues, strict=True):
            for request_id in ids[:per_class - taken[u.klass]]:
                picked.append((u.klass, str(request_id)))
            taken[u.klass] = min(per_class, taken[u.klass] + len(ids))
        pipe = self.client.pipeline(transaction=False)
        for _, request_id in picked:
            pipe.hmget(k.request(request_id), ["ptok", "enqueued_at", "deadline"])
        rows = await pipe.execute()
        return [QueuedSample(klass, int(float(ptok or 0)), float(at),
                             float(deadline) if deadline else None)
                for (klass, _), (ptok, at, deadline) in zip(picked, rows, strict=True)
                if at is not None]

    async def queue_place(self, model: str, klass: str, user: str,
                          request_id: str | None, tenant: str | None = None
                          ) -> tuple[float | None, int | None]:
        """(the score of the user's tenant among its class's active tenants, the request's
        index in its user's queue, or without ``request_id`` the queue's length); None when
        absent. For the wait estimate. ``tenant`` None: the request's (its hash), else the
        user's own."""
        k = ModelKeys(model)
        session = None
        if tenant is None and request_id is not None:
            tenant, session = await cast("Awaitable[list[str | None]]", self.client.hmget(
                k.request(request_id), ["tenant", "session"]))
        tenant = tenant or user
        pipe = self.client.pipeline(transaction=False)
        pipe.zscore(k.active(klass), tenant)
        if request_id is None:
            pipe.llen(k.queue(klass, user, tenant))
        else:  # its index in its session's queue, with sessions on
            pipe.lpos(k.queue(klass, user, tenant, session), request_id)
        score, index = await pipe.execute()
        return (None if score is None else float(score)), (None if index is None else int(index))

    async def add_history(self, start_ms: int, sums: Mapping[str, float],
                          maxima: Mapping[str, float], ttl_s: float) -> None:
        """Add one process's counts for the interval that began at ``start_ms`` (unix ms)
        to the dashboard history every process shares (``lua/history.lua``)."""
        bucket = history_key(start_ms)
        await self._scripts.call("history", [bucket, HISTORY_INDEX], {
            "bucket": bucket, "index": HISTORY_INDEX, "start": start_ms, "ttl": ttl_s,
            "sum": sums, "max": maxima})

    async def history(self, since_ms: int) -> list[tuple[int, dict[str, float]]]:
        """The shared history's intervals that began at ``since_ms`` or later, oldest
        first: (start in unix ms, its fields)."""
        names = await cast("Awaitable[list[tuple[str, float]]]", self.client.zrangebyscore(
            HISTORY_INDEX, since_ms, "+inf", withscores=True))
        if not names:
            return []
        pipe = self.client.pipeline(transaction=False)
        for name, _ in names:
            pipe.hgetall(name)
        rows = await pipe.execute()
        return [(int(start), {f: float(v) for f, v in raw.items()})
                for (_, start), raw in zip(names, rows, strict=True) if raw]
