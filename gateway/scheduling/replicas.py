"""The replica protocol: how replicas share one store's queues.

Any replica may dispatch any request; a grant for a request whose client another replica
holds travels through that replica's grant list, which its listener reads
(:meth:`ReplicaProtocol.listen`, one per model, with the preemption orders for the streams
it holds). The heartbeat keeps this replica alive in Redis (the dispatch script drops the
requests of replicas without one), reaps the requests of dead replicas, retries the
settles Redis missed, forgets idle end users and, every ``RECONCILE_EVERY`` beats and after
every outage, reconciles what Redis says this replica holds with what it does hold.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from gateway.core.errors import StoreUnavailable
from gateway.core.settings import ReadsSettings, SettingsHolder
from gateway.scheduling.grants import Signals, Waiters
from gateway.scheduling.local import LocalScheduler
from gateway.scheduling.outage import StoreOutage
from gateway.scheduling.preemption import Preemptor
from gateway.scheduling.settles import Settles
from gateway.storage.records import Preempt
from gateway.storage.store import Store

log = structlog.get_logger("fairgate.dispatcher")

STORE_RETRY_S = 0.2  # pause of the grant listener while Redis is unreachable
# the grant listener's blocking read: below the store's socket timeout
# (redis_socket_timeout_s, at least 2 s), which would take a longer one for a frozen store
STORE_BLOCK_S = 1.0
RECONCILE_EVERY = 30  # heartbeats between reconciliations (and after every outage)
RECONCILE_GRACE_S = 5.0
# Idle end users forgotten per model per heartbeat, at most (lua/forget.lua): a few
# milliseconds of Redis, and 200 a second outpaces any plausible arrival of new end users
# (17 million a day per replica).
FORGET_PER_PASS = 200


class ReplicaProtocol(ReadsSettings):
    def __init__(self, settings: SettingsHolder, store: Store, replica_id: str,
                 waiters: Waiters, settles: Settles, outage: StoreOutage,
                 local: LocalScheduler, preemptor: Preemptor, signals: Signals) -> None:
        self.holder = settings
        self.store = store
        self.replica_id = replica_id
        self.waiters = waiters
        self.settles = settles
        self.outage = outage
        self.local = local
        self.preemptor = preemptor
        self.signals = signals
        self.listened: dict[str, float] = {}  # model → its grant listener's last turn
        self.beats = 0

    async def listen(self, model: str) -> None:
        while True:
            try:
                item = await self.store.replicas.next_order(model, self.replica_id, STORE_BLOCK_S)
            except StoreUnavailable as exc:
                self.outage.unheard.add(model)
                self.outage.lost(exc)
                await asyncio.sleep(STORE_RETRY_S)
                continue
            self.listened[model] = time.time()  # reported with the heartbeat
            self.outage.unheard.discard(model)
            if isinstance(item, Preempt):
                self.preemptor.carry_out(model, item)
            elif item is not None:
                self.waiters.deliver(model, *item)
                self.settles.release_leftovers()

    async def reconcile(self, model: str, now: float) -> int:
        """Release what Redis says this replica holds but it does not: requests whose
        settle a Redis restart lost (an AOF replays up to its last fsync). Returns the
        count. Grants younger than RECONCILE_GRACE_S may still be on their way here; an
        older one whose client still waits here is delivered to it."""
        unsettled = self.settles.unsettled_ids()
        released = 0
        for grant, dispatched_at in await self.store.replicas.held_by(model, self.replica_id):
            if (grant.request_id in self.waiters.held or grant.request_id in unsettled
                    or now - dispatched_at < RECONCILE_GRACE_S):
                continue
            if grant.request_id in self.waiters.waiting:
                # its grant never arrived (popped from a store that died before
                # answering): its client still waits here, so it goes now
                self.waiters.deliver(model, grant.request_id, grant.backend, grant.rank,
                                     grant.charged_prompt)
                self.settles.release_leftovers()
                continue
            if await self.store.queue.settle(model, grant, 0.0):
                released += 1
        if released:
            log.warning("reconciled_inflight", model=model, released=released)
            self.signals.wake_freed()
        return released

    async def forget_idle(self, model: str, now: float) -> int:
        """One bounded pass over the model's trusted-key end users idle past
        ``end_user_idle_s``: their fairness state is forgotten. Returns how many."""
        forgotten, _ = await self.store.queue.forget_idle(
            model, now, self.settings.end_user_idle_s, FORGET_PER_PASS)
        if forgotten:
            log.info("forgot_idle_end_users", model=model, forgotten=forgotten)
        return forgotten

    async def heartbeat(self, models: list[str]) -> None:
        while True:
            try:
                await self._beat(models)
            except StoreUnavailable as exc:
                self.outage.lost(exc)
            self.signals.wake()  # a periodic safety net for enqueues on other replicas
            await asyncio.sleep(self.settings.replica_heartbeat_s)

    async def _beat(self, models: list[str]) -> None:
        now = time.time()
        ttl_s = self.settings.replica_ttl_s
        self.local.replicas = await self.store.replicas.heartbeat(
            models, self.replica_id, now, self.listened, now - ttl_s)
        self.signals.beating.set()
        recovered = await self.outage.answered()
        await self.settles.settle_deferred()
        self.beats += 1
        for model in models:
            if await self.store.queue.reap(model, now, ttl_s):
                log.warning("reaped_dead_replica_requests", model=model)
            await self.forget_idle(model, now)
            if recovered or self.beats % RECONCILE_EVERY == 0:
                await self.reconcile(model, now)
