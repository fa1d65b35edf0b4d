"""Runtime LoRA loads (``gateway/scheduling/adapter_loads.py``): one process loads at a
time per model, the outcome of each adapter's last load is kept for the others, and each
replica publishes its requests waiting per adapter.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, cast

import redis.asyncio as aioredis

from gateway.storage.keys import ModelKeys


class AdapterStore:
    """Adapter loads and demand over one Redis client."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def lock_adapter_loads(self, model: str, holder: str, ttl_s: float) -> bool:
        """Take the model's adapter-load lease for ``holder`` (False: another holds it)."""
        return bool(await cast("Awaitable[bool | None]", self.client.set(
            ModelKeys(model).lora_loading, holder, nx=True, px=max(1, int(ttl_s * 1000)))))

    async def unlock_adapter_loads(self, model: str, holder: str) -> None:
        """Give the lease back, if ``holder`` still has it."""
        key = ModelKeys(model).lora_loading
        if await cast("Awaitable[str | None]", self.client.get(key)) == holder:
            await cast("Awaitable[int]", self.client.delete(key))

    async def adapter_load(self, model: str, adapter: str) -> dict[str, Any] | None:
        """The outcome of the adapter's last load ({backend} or {backend, error,
        status}), while it is kept."""
        raw = await cast("Awaitable[str | None]",
                         self.client.get(ModelKeys(model).lora_load(adapter)))
        if not raw:
            return None
        value = json.loads(raw)
        return value if isinstance(value, dict) else None

    async def record_adapter_load(self, model: str, adapter: str, outcome: Mapping[str, Any],
                                  keep_s: float, loaded_at: float | None = None,
                                  load_s: float = 0.0) -> None:
        """Keep a load's outcome ``keep_s``; a load that succeeded also records when
        (unix s) the adapter came to its backend and how long its load took."""
        k = ModelKeys(model)
        pipe = self.client.pipeline(transaction=True)
        pipe.set(k.lora_load(adapter), json.dumps(dict(outcome)),
                 px=max(1, int(keep_s * 1000)))
        if loaded_at is not None:
            pipe.hset(k.backend_lora(str(outcome["backend"])), adapter,
                      f"{loaded_at!r} {load_s!r}")
        await pipe.execute()

    async def record_adapter_unload(self, model: str, backend: str, adapter: str) -> None:
        """The adapter left ``backend``: its load's outcome and time are forgotten."""
        k = ModelKeys(model)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(k.lora_load(adapter))
        pipe.hdel(k.backend_lora(backend), adapter)
        await pipe.execute()

    async def adapters_loaded_at(self, model: str, backends: Sequence[str]
                                 ) -> dict[str, dict[str, tuple[float, float | None]]]:
        """backend -> adapter -> (when (unix s) the gateway loaded it there, how long the
        load took (s; None: not recorded))."""
        k = ModelKeys(model)
        pipe = self.client.pipeline(transaction=False)
        for name in backends:
            pipe.hgetall(k.backend_lora(name))
        raw = await pipe.execute()
        return {name: {str(a): _loaded_at(str(v)) for a, v in found.items()}
                for name, found in zip(backends, raw, strict=True)}

    async def publish_adapter_demand(self, model: str, replica: str,
                                     demand: Mapping[str, tuple[int, float, bool]],
                                     now: float) -> None:
        """This replica's requests waiting per adapter (count, oldest admission (unix s),
        whether it is loading the adapter), as of ``now``; none: its field is removed."""
        key = ModelKeys(model).lora_demand
        if demand:
            await cast("Awaitable[int]", self.client.hset(key, replica, json.dumps(
                {"at": now, "adapters": {a: list(d) for a, d in demand.items()}})))
        else:
            await cast("Awaitable[int]", self.client.hdel(key, replica))

    async def adapter_demand(self, model: str, fresh_after: float, skip: str = ""
                             ) -> dict[str, tuple[int, float, bool]]:
        """Requests waiting per adapter summed over the replicas (but ``skip``) that
        published after ``fresh_after`` (unix s): (count, oldest admission, whether one
        of them is loading it)."""
        raw = await cast("Awaitable[dict[str, str]]",
                         self.client.hgetall(ModelKeys(model).lora_demand))
        out: dict[str, tuple[int, float, bool]] = {}
        for replica, value in raw.items():
            entry = json.loads(value)
            if replica == skip or float(entry.get("at", 0.0)) < fresh_after:
                continue  # a replica gone (or stalled): its demand no longer counts
            for adapter, (count, since, loading) in entry.get("adapters", {}).items():
                had = out.get(adapter, (0, float("inf"), False))
                out[adapter] = (had[0] + int(count), min(had[1], float(since)),
                                had[2] or bool(loading))
        return out


def _loaded_at(value: str) -> tuple[float, float | None]:
    """A ``bk:<backend>:lora`` field: "loaded_at load_s" (or "loaded_at", as written
    before the load time was kept)."""
    parts = value.split()
    return float(parts[0]), (float(parts[1]) if len(parts) > 1 else None)
