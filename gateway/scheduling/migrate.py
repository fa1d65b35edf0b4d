"""Drain with migrate: once a drained backend's migrate time passes, every process moves
its own running answers off it.

An operator's drain (``POST /admin/backends/{name}/drain`` with ``{"migrate": true,
"grace_s": N}``) stores the time, now + ``grace_s``, beside the drain flag in Redis
(``FleetStore.set_drained``), so every process of every replica, workers too, sees it; each
runs this loop over its own :class:`~gateway.scheduling.running.RunningStreams`. Every
:data:`POLL_S` it looks at the backends its pool knows drained (already read from Redis
with each view refresh) on which it has requests running; only then does it read the
migrate times (one read per model). Past the time, every movable request there is moved
(reason ``drain``): it continues on another backend from its token ids, or is sent again
when nothing reached its client yet. A request that is not movable yet (its first frame
not in) is moved at a later turn; one that cannot be continued runs to its end.
An undrain deletes the time: nothing moves.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from gateway.backends.scrape import BackendPool
from gateway.proxy.moving import DRAIN
from gateway.scheduling.running import RunningStreams
from gateway.storage.fleet_store import FleetStore

log = structlog.get_logger("fairgate.migrate")

POLL_S = 0.25  # how late after its migrate time a drained backend's answers move


class Migrations:
    def __init__(self, store: FleetStore, pool: BackendPool, running: RunningStreams,
                 poll_s: float = POLL_S) -> None:
        self.store = store
        self.pool = pool
        self.running = running
        self.poll_s = poll_s

    async def run(self) -> None:
        while True:
            await self.turn(time.time())
            await asyncio.sleep(self.poll_s)

    async def turn(self, now: float) -> int:
        """Move the running answers of every drained backend whose time came; how many
        were asked to move."""
        by_model: dict[str, list[str]] = {}
        for handle in self.pool.handles.values():
            if handle.drained and self.running.count(handle.name):
                by_model.setdefault(handle.config.model, []).append(handle.name)
        moved = 0
        for model, names in by_model.items():
            times = await self.store.migrate_times(model)
            for name in names:
                at = times.get(name)
                if at is not None and at <= now and (n := self.running.move_backend(
                        name, DRAIN)):
                    log.info("drain_moved", backend=name, moved=n,
                             left=self.running.count(name) - n)
                    moved += n
        return moved
