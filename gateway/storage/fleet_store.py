"""Fleet state: each backend's snapshot and scrape lease, its prefix index, drains and
migrate times, and what Redis holds about each backend (``BackendState``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from typing import cast

import redis.asyncio as aioredis

from gateway.storage.keys import ModelKeys
from gateway.storage.records import (
    BackendState,
    LeaseWish,
    ScrapeView,
    Stored,
    snapshot_from,
)
from gateway.storage.scripts import Scripts
from gateway.storage.values import PREFILL
from policies.gates import BackendSnapshot, still_unseen


class FleetStore:
    """Backends' shared state over one Redis client."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._scripts = Scripts(client, ("snapshot", "scrapers"))

    async def store_snapshot(self, model: str, backend: str, snap: BackendSnapshot,
                             shared: str = "") -> Stored:
        """Store a snapshot, with what its scraper publishes beside it (``shared``), unless
        a newer one is there."""
        k = ModelKeys(model)
        # the numbers as text, stored as given (a number printed back by Lua loses digits)
        args = {"prefix": k.prefix, "backend": backend, "taken_at": _text(snap.taken_at_s),
                "waiting": _text(snap.waiting), "running": _text(snap.running),
                "kv": _text(snap.kv_usage),
                "tpot": "" if snap.tpot_s is None else _text(snap.tpot_s), "shared": shared}
        keys = [k.backend_snapshot(backend), k.backend_sent(backend), k.backend_inflight(backend),
                k.drained, k.backend_prefill(backend), k.backend_started(backend)]
        out = await self._scripts.call("snapshot", keys, args)
        return Stored(bool(out["stored"]), bool(out["drained"]), int(out["pending"]),
                      str(out["version"]))

    async def publish_failure(self, model: str, backend: str, failures: int) -> str:
        """Publish that the backend's last ``failures`` scrapes failed (its snapshot stays,
        closed by them); returns the snapshot hash's new version."""
        key = ModelKeys(model).backend_snapshot(backend)
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(key, "failures", str(failures))
        pipe.hincrby(key, "v", 1)
        _, version = await pipe.execute()
        return str(version)

    async def scrape_leases(self, holder: str, ttl_s: float,
                            wanted: Mapping[str, Sequence[LeaseWish]]
                            ) -> dict[str, tuple[int, dict[str, ScrapeView]]]:
        """:meth:`scrape_lease` for every model of ``wanted`` (concurrently)."""
        models = [m for m, wishes in wanted.items() if wishes]
        found = await asyncio.gather(*(self.scrape_lease(holder, ttl_s, m, wanted[m])
                                       for m in models))
        return dict(zip(models, found, strict=True))

    async def scrape_lease(self, holder: str, ttl_s: float, model: str,
                           wishes: Sequence[LeaseWish]) -> tuple[int, dict[str, ScrapeView]]:
        """Take, renew or give up ``holder``'s scrape leases of ``model``'s backends
        (``lua/scrapers.lua``, one call), and read what each backend's scraper published
        since ``seen``: (requests queued for the model, backend -> its view)."""
        k = ModelKeys(model)
        keys = [key for w in wishes for key in (
            k.backend_scraper(w.backend), k.backend_snapshot(w.backend),
            k.backend_inflight(w.backend), k.backend_prefill(w.backend),
            k.backend_dispatches(w.backend))]
        arg = {"prefix": k.prefix, "holder": holder, "ttl_ms": int(ttl_s * 1000),
               "backends": [{"name": w.backend, "want": w.want, "seen": w.seen}
                            for w in wishes]}
        out = await self._scripts.call("scrapers", [*keys, k.depth, k.drained, k.scrapers],
                                       arg)
        return int(out["queued"]), {w.backend: ScrapeView(
            bool(row["held"]), bool(row["drained"]), int(row["inflight"]), int(row["pending"]),
            row.get("published"), int(row["dispatches"]))
            for w, row in zip(wishes, out["backends"] or (), strict=True)}

    async def forget_prefixes(self, model: str, backend: str) -> None:
        """Drop a backend's prefix index (it restarted or went away: its cache is gone)."""
        await cast("Awaitable[int]", self.client.delete(ModelKeys(model).backend_prefixes(backend)))

    async def set_drained(self, model: str, backend: str, drained: bool,
                          migrate_at: float | None = None) -> None:
        """Drain (or undrain) a backend for every replica; with ``migrate_at`` (unix s)
        every process moves its running answers off the backend from then on. An undrain,
        or a drain without it, clears a pending migrate."""
        k = ModelKeys(model)
        pipe = self.client.pipeline(transaction=True)
        if drained:
            pipe.sadd(k.drained, backend)
        else:
            pipe.srem(k.drained, backend)
        if drained and migrate_at is not None:
            pipe.hset(k.migrate, backend, repr(migrate_at))
        else:
            pipe.hdel(k.migrate, backend)
        await pipe.execute()

    async def migrate_times(self, model: str) -> dict[str, float]:
        """Drained backends whose running answers move elsewhere, and from when (unix s)."""
        raw = await cast("Awaitable[dict[str, str]]",
                         self.client.hgetall(ModelKeys(model).migrate))
        return {str(name): float(at) for name, at in raw.items()}

    async def backend_states(self, model: str, backends: Sequence[str]) -> dict[str, BackendState]:
        """What Redis holds about each backend (snapshot, sent-since, in flight)."""
        k = ModelKeys(model)
        pipe = self.client.pipeline(transaction=False)
        for name in backends:
            pipe.hgetall(k.backend_snapshot(name))
            pipe.zrange(k.backend_sent(name), 0, -1, withscores=True)
            pipe.get(k.backend_inflight(name))
            pipe.hvals(k.backend_prefill(name))
            pipe.zrange(k.backend_started(name), 0, -1, withscores=True)
        raw = await pipe.execute()
        states = {}
        for i, name in enumerate(backends):
            snap, sent, inflight, prefill, started = raw[5 * i: 5 * i + 5]
            # the started set also keeps what came since the snapshot before, the sent set
            # every request not started yet (snapshot.lua)
            taken_at = float(snap.get("taken_at") or 0)
            since = sum(1 for _, at in sent if at > taken_at)
            unseen = still_unseen(int(float(snap.get("unseen") or 0)), len(sent) - since)
            states[name] = BackendState(snapshot_from(snap), since, int(inflight or 0), unseen,
                                        sum(int(float(PREFILL.decode(v)["tokens"]))
                                            for v in prefill),
                                        sum(1 for _, at in started if at > taken_at))
        return states


def _text(value: float) -> str:
    """A number as redis-py sends an argument: a float's repr, an int's digits."""
    return repr(value) if isinstance(value, float) else str(value)
