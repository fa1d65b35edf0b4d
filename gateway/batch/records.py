"""Batch records in Redis, shaped like OpenAI's Batch object.

The batch hash (``fg:{batches}:batch:<id>``) holds the batch (static fields as JSON in
``doc``, status and timestamps as plain fields); results live in its ``:out`` / ``:err``
hashes keyed by ``custom_id`` and written with HSETNX, so a line is recorded at most once
and the request counts are simply their sizes. Every key is built in
``gateway/storage/keys.py``, all under one hash tag (a batch's creation is one MULTI on a
Redis Cluster too).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, NamedTuple

import redis.asyncio as aioredis

from gateway.core.errors import NotFound
from gateway.core.settings import OWNER_SEPARATOR, owner_id
from gateway.storage.keys import ACTIVE_BATCHES, BatchKeys, user_batches
from gateway.storage.scripts import load_script

WINDOW_S = {"24h": 24 * 3600}
TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
              "cancelling_at", "cancelled_at")
FINAL = ("completed", "failed", "expired", "cancelled")


class Backlog(NamedTuple):
    lines: int  # of unfinished batches, without a result yet
    expires_at: float | None  # the earliest such batch's (unix s); None: none


class BatchStore:
    def __init__(self, client: aioredis.Redis) -> None:
        # redis-py's asyncio stubs type every reply as ``Awaitable[T] | T``
        self.client: Any = client
        self._transition = client.register_script(load_script("batch_transition"))
        self._lease = client.register_script(load_script("lease"))

    async def create(self, user: str, input_file_id: str, endpoint: str, window: str,
                     metadata: dict[str, str] | None, total: int,
                     weight: float = 1.0, key_id: str | None = None,
                     tenant: str | None = None) -> dict[str, Any]:
        batch_id = "batch_" + uuid.uuid4().hex
        now = int(time.time())
        doc = {"id": batch_id, "user": user, "endpoint": endpoint,
               "input_file_id": input_file_id, "completion_window": window,
               "metadata": metadata, "weight": weight, "key_id": key_id, "tenant": tenant,
               "created_at": now,
               "expires_at": now + WINDOW_S[window]}
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(BatchKeys(batch_id).hash,
                  mapping={"doc": json.dumps(doc), "status": "validating", "total": total})
        pipe.zadd(user_batches(owner_id(user, tenant)),
                  {batch_id: time.time()})  # ties: sub-second order
        pipe.sadd(ACTIVE_BATCHES, batch_id)
        await pipe.execute()
        return await self.get(owner_id(user, tenant), batch_id)

    async def raw(self, batch_id: str) -> dict[str, str] | None:
        keys = BatchKeys(batch_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(keys.hash)
        pipe.hlen(keys.out)
        pipe.hlen(keys.err)
        fields, done, failed = await pipe.execute()
        if "doc" not in fields or "status" not in fields:
            return None  # none, or a remnant of one Redis lost (a result written after)
        return {**fields, "completed": str(done), "failed": str(failed)}

    async def get(self, owner: str, batch_id: str) -> dict[str, Any]:
        """``owner``'s batch (``ApiKey.owner``); anyone else's is a 404."""
        raw = await self.raw(batch_id)
        if raw is None or batch_owner(json.loads(raw["doc"])) != owner:
            raise NotFound(f"No such Batch object: {batch_id}", param="batch_id")
        return to_openai(raw)

    async def page(self, owner: str, limit: int,
                   after: str | None) -> tuple[list[dict[str, Any]], bool]:
        """``owner``'s batches, newest first. A named tenant's user's batches created
        before owners named their tenant are listed under the bare user: read from there
        too, and only its own kept (the user of the same name in another tenant, or of
        its own, shared that list)."""
        lists = [owner]
        _, _, bare = owner.rpartition(OWNER_SEPARATOR)
        if bare != owner:
            lists.append(bare)
        scored: dict[str, float] = {}
        for name in lists:
            for batch_id, score in await self.client.zrevrange(user_batches(name), 0, -1,
                                                               withscores=True):
                scored[batch_id] = score
        ids = sorted(scored, key=lambda i: scored[i], reverse=True)
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        batches: list[dict[str, Any]] = []
        more = False
        for batch_id in ids:
            raw = await self.raw(batch_id)
            if raw is None or batch_owner(json.loads(raw["doc"])) != owner:
                continue
            if len(batches) == limit:
                more = True
                break
            batches.append(to_openai(raw))
        return batches, more

    async def transition(self, batch_id: str, allowed: tuple[str, ...], status: str,
                         stamp: str | None = None) -> bool:
        args: list[str | int] = [",".join(allowed), status, stamp or "", int(time.time())]
        return bool(await self._transition(keys=[BatchKeys(batch_id).hash], args=args))

    async def set_fields(self, batch_id: str, **fields: str | int) -> None:
        await self.client.hset(BatchKeys(batch_id).hash, mapping=fields)

    async def record(self, batch_id: str, custom_id: str, line: dict[str, Any],
                     ok: bool) -> bool:
        """Store one line's result unless it has one already (exactly once)."""
        keys = BatchKeys(batch_id)
        target = keys.out if ok else keys.err
        return bool(await self.client.hsetnx(target, custom_id, json.dumps(line)))

    async def done_ids(self, batch_id: str) -> set[str]:
        keys = BatchKeys(batch_id)
        out = await self.client.hkeys(keys.out)
        err = await self.client.hkeys(keys.err)
        return set(out) | set(err)

    async def results(self, batch_id: str, ok: bool) -> dict[str, str]:
        keys = BatchKeys(batch_id)
        found: dict[str, str] = await self.client.hgetall(keys.out if ok else keys.err)
        return found

    async def lease(self, batch_id: str, holder: str, lease_s: float) -> bool:
        """Take or renew the right to run a batch (one runner at a time)."""
        keys = [BatchKeys(batch_id).lease]
        return bool(await self._lease(keys=keys, args=[holder, int(lease_s * 1000)]))

    async def active(self) -> list[str]:
        return sorted(await self.client.smembers(ACTIVE_BATCHES))

    async def running(self) -> list[dict[str, Any]]:
        """Unfinished batches with their owner and progress (for operators)."""
        found = []
        for batch_id in await self.active():
            raw = await self.raw(batch_id)
            if raw is not None:
                found.append({"id": batch_id, "user": json.loads(raw["doc"])["user"],
                              "status": raw["status"], "total": int(raw["total"]),
                              "completed": int(raw["completed"]),
                              "failed": int(raw["failed"])})
        return found

    async def backlog(self) -> Backlog:
        """The lines of unfinished batches without a result yet, and the earliest time
        one of those batches expires (its completion window): the batch backlog the
        pools' autoscaling weighs (``gateway/ops/pools.py``)."""
        lines, expires = 0, None
        for batch_id in await self.active():
            raw = await self.raw(batch_id)
            if raw is None or raw["status"] not in ("validating", "in_progress"):
                continue
            left = int(raw["total"]) - int(raw["completed"]) - int(raw["failed"])
            if left > 0:
                lines += left
                at = float(json.loads(raw["doc"])["expires_at"])
                expires = at if expires is None else min(expires, at)
        return Backlog(lines, expires)

    async def retire(self, batch_id: str) -> None:
        await self.client.srem(ACTIVE_BATCHES, batch_id)

    async def forget(self, batch_id: str) -> None:
        """Drop what is left of a batch whose record Redis lost (restarted empty): the
        results written since and its place among the active batches."""
        keys = BatchKeys(batch_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(keys.hash, keys.out, keys.err, keys.lease)
        pipe.srem(ACTIVE_BATCHES, batch_id)
        await pipe.execute()


def batch_owner(doc: dict[str, Any]) -> str:
    """The owner of a batch record: its user in its tenant (records made before owners
    named their tenant hold both, so they are read the same way)."""
    return owner_id(str(doc["user"]), doc.get("tenant"))


def to_openai(raw: dict[str, str]) -> dict[str, Any]:
    doc = json.loads(raw["doc"])
    batch: dict[str, Any] = {
        "id": doc["id"], "object": "batch", "endpoint": doc["endpoint"],
        "errors": json.loads(raw["errors"]) if raw.get("errors") else None,
        "input_file_id": doc["input_file_id"], "completion_window": doc["completion_window"],
        "status": raw["status"],
        "output_file_id": raw.get("output_file_id"), "error_file_id": raw.get("error_file_id"),
        "created_at": doc["created_at"], "expires_at": doc["expires_at"],
        "request_counts": {"total": int(raw["total"]), "completed": int(raw["completed"]),
                           "failed": int(raw["failed"])},
        "metadata": doc["metadata"],
    }
    for stamp in TIMESTAMPS:
        batch[stamp] = int(raw[stamp]) if raw.get(stamp) else None
    return batch
