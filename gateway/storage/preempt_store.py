"""Preemption orders (``gateway/scheduling/preemption.py``): what a decision reads
(``lua/preempt_view.lua``) and the order given to the replica holding a stream
(``lua/preempt.lua``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis

from gateway.storage.keys import ModelKeys
from gateway.storage.records import (
    Preempt,
    PreemptView,
)
from gateway.storage.scripts import Scripts


class PreemptStore:
    """Preemption reads and orders over one Redis client."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._scripts = Scripts(client, ("preempt_view", "preempt"))

    async def preemption_view(self, model: str, classes: Sequence[str],
                              alive_after: float, tenants: int = 1) -> PreemptView:
        """What a preemption decision reads (``lua/preempt_view.lua``): of each class,
        the next request of its first ``tenants`` tenants in fair order."""
        k = ModelKeys(model)
        raw = await self._scripts.call("preempt_view", [k.replicas, k.depth], {
            "prefix": k.prefix, "classes": list(classes), "alive_after": alive_after,
            "tenants": max(1, tenants)})
        return PreemptView([q for q in raw.get("queued") or [] if isinstance(q, dict)],
                           [r for r in raw.get("inflight") or [] if isinstance(r, dict)])

    async def order_preemption(self, model: str, order: Preempt, now: float,
                               max_preemptions: int, settle_s: float, hold_s: float) -> bool:
        """Order the replica that holds ``order``'s stream to preempt it
        (``lua/preempt.lua``); False when refused (see there)."""
        out = await self._preempt(model, order, {
            "now": now, "max": max_preemptions, "settle_s": settle_s,
            "hold_ms": max(1, round(hold_s * 1000))})
        return bool(out["ordered"])

    async def preempt_refused(self, model: str, order: Preempt, grace: bool = False) -> None:
        """This replica could not move the stream ``order`` named: it is not ordered again
        (``grace``: not now, it is within its grace; it may be later), and the backend
        may preempt another at once."""
        await self._preempt(model, order, {"refused": True, "grace": grace})

    async def _preempt(self, model: str, order: Preempt, more: Mapping[str, Any]
                       ) -> dict[str, Any]:
        k = ModelKeys(model)
        keys = [k.request(order.request_id), k.request(order.original),
                k.backend_preempt(order.backend), k.backend_snapshot(order.backend)]
        return await self._scripts.call("preempt", keys, {
            "prefix": k.prefix, "id": order.request_id, "original": order.original,
            "backend": order.backend, **more})
