"""One scheduled call: queue → grant → (caller talks to the backend) → settle.

Both the OpenAI routes and the Batch API runner go through :func:`admitted`, so every
request, interactive or batch, is queued, paced, prioritised and charged the same way.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import structlog

from gateway.backends import BackendHandle
from gateway.context import Context
from gateway.errors import Unavailable
from gateway.observability import StreamTiming
from gateway.store import Grant, QueuedRequest
from gateway.upstream import Usage
from policies.cost import estimate_prompt_tokens
from policies.priority import vllm_priority

log = structlog.get_logger("fairgate.request")


@dataclass(slots=True)
class Ticket:
    grant: Grant
    backend: BackendHandle
    priority: int
    usage: Usage


@asynccontextmanager
async def admitted(ctx: Context, model: str, user: str, klass: str, weight: float,
                   body: dict[str, object], request_id: str | None = None,
                   arrived_s: float | None = None) -> AsyncIterator[Ticket]:
    """Wait for a grant; on exit release it and charge the user real token counts.

    ``arrived_s`` (monotonic) turns on the client-side TTFT/TPOT metrics of a stream."""
    prompt_est = estimate_prompt_tokens(body)
    queued = QueuedRequest(request_id or uuid.uuid4().hex, user, klass, ctx.replica_id,
                           weight, prompt_est, time.time())
    cls_cfg = ctx.settings.classes[klass]
    grant = await ctx.dispatcher.acquire(model, queued, cls_cfg.max_queue_wait_s)
    waited = time.time() - queued.enqueued_at
    ctx.metrics.queue_wait.labels(klass).observe(waited)
    priority = vllm_priority(cls_cfg.priority_base, grant.rank, ctx.settings.priority_class_gap)
    log.info("dispatched", request_id=queued.request_id, backend=grant.backend,
             wait_s=round(waited, 4), vllm_priority=priority)
    usage = Usage(started=functools.partial(ctx.dispatcher.started, model, grant),
                  timing=StreamTiming(arrived_s) if arrived_s is not None else None)
    backend = ctx.pool.handles.get(grant.backend)
    if backend is None:  # removed by a config reload since the dispatch
        await ctx.dispatcher.release(model, grant, 0.0)
        raise Unavailable(f"backend {grant.backend} was just removed; retry",
                          retry_after_s=ctx.settings.retry_after_s)
    ticket = Ticket(grant, backend, priority, usage)
    ctx.metrics.on_dispatch(model, grant.backend, klass, user, grant.rank)
    try:
        yield ticket
    finally:
        charge = ctx.rule.completion_charge(usage.prompt_tokens or prompt_est, prompt_est,
                                            usage.output_tokens, weight)
        await asyncio.shield(ctx.dispatcher.release(model, grant, charge))
        ctx.metrics.tokens.labels(model, "prompt").inc(usage.prompt_tokens or 0)
        ctx.metrics.tokens.labels(model, "completion").inc(usage.output_tokens)
        s = ctx.settings
        service = ((usage.prompt_tokens or 0) * s.vtc_input_weight
                   + usage.output_tokens * s.vtc_output_weight) / weight
        ctx.metrics.on_finish(model, klass, user, usage, service)
        log.info("finished", request_id=queued.request_id, backend=grant.backend,
                 latency_s=round(time.time() - queued.enqueued_at, 4),
                 output_tokens=usage.output_tokens)
