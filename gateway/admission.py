"""One scheduled call: queue → grant → (caller talks to the backend) → settle.

Both the OpenAI routes and the Batch API runner go through :meth:`Admission.admitted`, so
every request, interactive or batch, is queued, paced, prioritised and charged the same
way. The :class:`Ticket` it yields is the relay's listener: it hears the first token (the
gate slot frees at once), the token counts and the end of the answer.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import structlog

from gateway.backends import BackendHandle, BackendPool
from gateway.dispatcher import Dispatcher
from gateway.errors import BackendRemoved, BackendUnreachable
from gateway.metrics import GatewayMetrics, StreamTiming
from gateway.settings import Settings
from gateway.store import Grant, QueuedRequest
from policies.cost import estimate_prompt_tokens
from policies.fairness import FairnessPolicy
from policies.priority import vllm_priority

log = structlog.get_logger("fairgate.request")

T = TypeVar("T")


@dataclass(slots=True)
class Ticket:
    """An admitted request: where it runs, with which priority, and what came back."""

    model: str
    grant: Grant
    backend: BackendHandle
    priority: int
    dispatcher: Dispatcher
    timing: StreamTiming | None
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    completed: bool = False
    unsent: bool = False  # nothing reached the backend: the dispatch cost is refunded
    _started: bool = field(default=False, repr=False)

    async def first_token(self) -> None:
        if not self._started:
            self._started = True
            await self.dispatcher.started(self.model, self.grant)

    def tokens_sent(self, frames: int) -> None:
        if self.timing is not None:
            self.timing.token_frames_sent()

    def usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens or None
        self.completion_tokens = completion_tokens

    def end(self, completed: bool) -> None:
        self.completed = completed


class Admission:
    def __init__(self, settings: Settings, dispatcher: Dispatcher, pool: BackendPool,
                 policy: FairnessPolicy, metrics: GatewayMetrics, replica_id: str) -> None:
        self.settings = settings
        self.dispatcher = dispatcher
        self.pool = pool
        self.policy = policy
        self.metrics = metrics
        self.replica_id = replica_id

    async def call(self, model: str, user: str, klass: str, weight: float,
                   body: dict[str, object], send: Callable[[Ticket], Awaitable[T]],
                   request_id: str | None = None, arrived_s: float | None = None) -> T:
        """:meth:`admitted` around ``send(ticket)``. When the connection to the backend
        fails before anything was sent (nothing reached its engine), the backend's gates
        close and the request is queued once more, for another backend."""
        for attempt in (1, 2):
            async with self.admitted(model, user, klass, weight, body, request_id,
                                     arrived_s) as ticket:
                try:
                    return await send(ticket)
                except BackendUnreachable as exc:
                    ticket.unsent = True
                    self.pool.unreachable(ticket.backend, exc)
                    if attempt == 2:
                        raise
            log.warning("backend_unreachable_retry", backend=ticket.grant.backend)
        raise AssertionError("unreachable")

    @asynccontextmanager
    async def admitted(self, model: str, user: str, klass: str, weight: float,
                       body: dict[str, object], request_id: str | None = None,
                       arrived_s: float | None = None) -> AsyncIterator[Ticket]:
        """Wait for a grant; on exit release it and charge the user real token counts.

        ``arrived_s`` (monotonic) turns on the client-side TTFT/TPOT metrics of a stream.
        Metrics and the ``finished`` log are recorded before the release is awaited, so
        they do not depend on the client staying connected."""
        prompt_est = estimate_prompt_tokens(body)
        queued = QueuedRequest(request_id or uuid.uuid4().hex, user, klass, self.replica_id,
                               self.policy.dispatch_cost(prompt_est, weight), time.time())
        cls_cfg = self.settings.classes[klass]
        grant = await self.dispatcher.acquire(model, queued, cls_cfg.max_queue_wait_s)
        waited = time.time() - queued.enqueued_at
        self.metrics.queue_wait.labels(klass).observe(waited)
        priority = vllm_priority(cls_cfg.priority_base, grant.rank,
                                 self.settings.priority_class_gap)
        log.info("dispatched", request_id=queued.request_id, backend=grant.backend,
                 wait_s=round(waited, 4), vllm_priority=priority)
        backend = self.pool.handles.get(grant.backend)
        if backend is None:  # removed by a config reload since the dispatch
            await self.dispatcher.release(model, grant, 0.0)
            raise BackendRemoved(f"backend {grant.backend} was just removed; retry",
                                 retry_after_s=self.settings.retry_after_s)
        timing = StreamTiming(arrived_s) if arrived_s is not None else None
        ticket = Ticket(model, grant, backend, priority, self.dispatcher, timing)
        self.metrics.on_dispatch(model, grant.backend, klass, user, grant.rank)
        try:
            yield ticket
        finally:
            prompt = ticket.prompt_tokens or prompt_est
            output = ticket.completion_tokens
            charge = (-queued.cost if ticket.unsent
                      else self.policy.settle_charge(prompt, prompt_est, output, weight))
            self.metrics.on_finish(model, klass, user, ticket.prompt_tokens or 0, output,
                                   self.policy.service(ticket.prompt_tokens or 0, output,
                                                       weight), timing)
            log.info("finished", request_id=queued.request_id, backend=grant.backend,
                     latency_s=round(time.time() - queued.enqueued_at, 4),
                     output_tokens=output, completed=ticket.completed)
            await asyncio.shield(self.dispatcher.release(model, grant, charge))
