"""Continuing an answer on another backend, within its budgets: a failure's
(``continue_attempts``) and a move's (``max_moves``, apart), each continuation scheduled
like a request at the head of its user's queue that costs nothing (the original request's
settle charges the whole answer once). ``gateway/proxy/upstream.py`` drives it through
:attr:`Ticket.resumer <gateway.scheduling.ticket.Ticket.resumer>`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import replace

import structlog

from gateway.backends.handle import BackendHandle
from gateway.backends.scrape import BackendPool
from gateway.core.errors import BackendRemoved
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import ReadsSettings, SettingsHolder
from gateway.proxy.moving import FAILOVER, RETRY
from gateway.scheduling.dispatcher import Dispatcher
from gateway.scheduling.running import Running
from gateway.scheduling.ticket import Ticket
from gateway.storage.records import QueuedRequest
from gateway.storage.values import continuation_id
from policies.priority import vllm_priority

log = structlog.get_logger("fairgate.request")


class Continuations(ReadsSettings):
    def __init__(self, settings: SettingsHolder, dispatcher: Dispatcher, pool: BackendPool,
                 metrics: GatewayMetrics,
                 granted_backend: Callable[[str], Awaitable[BackendHandle | None]]) -> None:
        self.holder = settings
        self.dispatcher = dispatcher
        self.pool = pool
        self.metrics = metrics
        self.granted_backend = granted_backend  # the backend a grant names, or None

    def next(self, model: str, queued: QueuedRequest, original: Ticket,
                   running: Running, reason: str, tokens: int, failed: BackendHandle
                   ) -> AbstractAsyncContextManager[Ticket] | None:
        """The next continuation attempt within its budget: a failure's
        (``continue_attempts``) or a move's (``max_moves``, apart: moves on purpose
        never use up what failures may need)."""
        if reason in (FAILOVER, RETRY):
            allowed = original.continuations < self.settings.continue_attempts
            if allowed:
                original.continuations += 1
        else:
            allowed = running.moves < self.settings.max_moves
            if allowed:
                running.moves += 1
        if not allowed:
            self.metrics.moves.continuations.labels(reason, "failed").inc()
            return None
        number = original.continuations + running.moves  # this attempt's, from 1
        return self._continuation(model, queued, reason, tokens, failed, running, number)

    @asynccontextmanager
    async def _continuation(self, model: str, queued: QueuedRequest, reason: str,
                            tokens: int, failed: BackendHandle,
                            running: Running, number: int) -> AsyncIterator[Ticket]:
        """The rest of an answer, scheduled like a request at the head of its user's queue
        (the earliest deadline) that costs nothing: the original request's settle charges
        the whole answer once, so the tokens sent again are charged to nobody (they are
        counted in ``fairgate_continuation_recomputed_tokens_total``). Its gate slot is
        its own; a backend that failed has its gates closed first (one a request was moved
        off on purpose keeps them open)."""
        if reason == FAILOVER:
            self.pool.unreachable(failed, ConnectionError("the answer failed mid-way"))
        paused = time.monotonic()
        # its id names the answer it continues (whoever reads this replica's running set
        # in Redis, preemption, tells the answer's segments apart); the segment it
        # continues leaves its backend as it is queued: the slot vLLM freed counts free
        cont = replace(queued, request_id=continuation_id(queued.request_id, number),
                       cost=0.0, tenant_cost=0.0, credit=0.0, tenant_credit=0.0,
                       enqueued_at=time.time(), deadline_at=0.0, prompt_tokens=tokens,
                       leaves=(running.segment or queued.request_id, running.backend))
        cls_cfg = self.settings.classes[queued.klass]
        grant = await self.dispatcher.acquire(
            model, cont, min(cls_cfg.max_queue_wait_s, self.settings.continue_wait_s))
        backend = await self.granted_backend(grant.backend)
        if backend is None:  # removed by a config reload since the dispatch
            await self.dispatcher.release(model, grant, 0.0, 0.0)
            raise BackendRemoved(f"backend {grant.backend} was just removed")
        priority = vllm_priority(cls_cfg.priority_base, grant.rank,
                                 self.settings.priority_class_gap)
        ticket = Ticket(model, grant, backend, priority, self.dispatcher, None)
        running.backend, running.segment = grant.backend, cont.request_id
        pause = self.metrics.moves.pause.labels(reason)
        ticket.on_started = lambda: pause.observe(time.monotonic() - paused)
        self.metrics.moves.continuations.labels(reason, "continued").inc()
        self.metrics.moves.recomputed_tokens.labels(reason).inc(tokens)
        log.info("continued", request_id=queued.request_id, reason=reason,
                 backend=grant.backend, from_backend=failed.name, resent_tokens=tokens)
        try:
            yield ticket
        finally:
            await asyncio.shield(self.dispatcher.release(model, grant, 0.0, 0.0))
