"""Service shares: each user's decayed service across replicas (``lua/share.lua``), and
who each user is (tenant, weights), as the share ratio reads them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import cast

import redis.asyncio as aioredis

from gateway.storage.keys import ModelKeys
from gateway.storage.records import (
    Who,
)
from gateway.storage.scripts import Scripts
from policies.share_ratio import Account


class ShareStore:
    """The models' decayed service over one Redis client."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._scripts = Scripts(client, ("share",))

    async def add_service(self, model: str, amounts: Mapping[str, float], now: float,
                          half_life_s: float, cap: int, ttl_s: float,
                          who: Mapping[str, Who] | None = None) -> int:
        """Add each user's service to the model's decayed shares (every replica's), and
        record who the users of ``who`` are; returns the number of users kept (at most
        ``cap``)."""
        k = ModelKeys(model)
        args = {"prefix": k.prefix, "now": now, "half_life": half_life_s, "cap": cap,
                "ttl": int(ttl_s), "amounts": dict(amounts),
                "who": {user: w.encode() for user, w in (who or {}).items()}}
        out = await self._scripts.call("share", [k.service, k.service_epoch, k.service_who],
                                       args)
        return int(out["kept"])

    async def service_shares(self, model: str) -> dict[str, float]:
        """Each user's share of the model's decayed service across replicas, largest
        first (at most the cap kept by ``add_service``)."""
        raw = await cast("Awaitable[list[tuple[str, float]]]", self.client.zrange(
            ModelKeys(model).service, 0, -1, desc=True, withscores=True))
        total = sum(score for _, score in raw)
        return {} if total <= 0 else {user: score / total for user, score in raw if score > 0}

    async def service_accounts(self, model: str) -> dict[str, Account]:
        """Each user's decayed service across replicas at weight 1 (its score times its
        key's weight), with its tenant and weights (``policies/share_ratio.py``); one
        round trip."""
        k = ModelKeys(model)
        pipe = self.client.pipeline(transaction=False)
        pipe.zrange(k.service, 0, -1, withscores=True)
        pipe.hgetall(k.service_who)
        scores, entries = await pipe.execute()
        accounts = {}
        for user, score in scores:
            who = Who.decode(entries.get(user))
            accounts[str(user)] = Account(float(score) * who.weight, who.weight, who.tenant,
                                          who.tenant_weight)
        return accounts
