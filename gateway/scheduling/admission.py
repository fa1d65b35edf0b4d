"""One scheduled call: queue → grant → (caller talks to the backend) → settle.

Both the OpenAI routes and the Batch API runner go through :meth:`Admission.admitted`, so
every request, interactive or batch, is queued, paced, prioritised and charged the same
way. The :class:`Ticket` it yields is the relay's listener: it hears the first token (the
gate slot frees at once), the token counts and the end of the answer.

A request may carry a deadline for its first token (``X-Fairgate-Deadline-Ms``, or its
class's ``ttft_slo_ms``): refused at once when the wait estimate (``gateway/scheduling/waits.py``)
already exceeds it, and taken out of the queue, never dispatched, when it passes while
queued (the path of the ``max_queue_wait_s`` timeout). Both answer 429
``deadline_unmeetable``; every ``Retry-After`` comes from the measured dispatch rate.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

import structlog

from gateway.backends.scrape import BackendPool
from gateway.core.errors import (
    AdapterGone,
    BackendRemoved,
    BackendUnreachable,
    DeadlineUnmeetable,
    QueueTimeout,
    RateLimited,
    StoreUnavailable,
    Unavailable,
)
from gateway.core.metrics import GatewayMetrics
from gateway.core.metrics.edge import StreamTiming
from gateway.core.settings import ApiKey, ReadsSettings, SettingsHolder
from gateway.proxy.completion_request import CompletionRequest
from gateway.proxy.moving import DRAIN as DRAIN  # the reasons, re-exported
from gateway.proxy.moving import PREEMPT as PREEMPT
from gateway.scheduling.adapter_loads import AdapterLoads
from gateway.scheduling.charging import Charging, Payer
from gateway.scheduling.continuations import Continuations
from gateway.scheduling.dispatcher import Dispatcher
from gateway.scheduling.placement import GrantedBackends, Placement
from gateway.scheduling.quotas import Held
from gateway.scheduling.running import Running, RunningStreams
from gateway.scheduling.ticket import Ticket as Ticket  # re-exported
from gateway.scheduling.waits import Waits
from gateway.storage.records import Grant, QueuedRequest
from policies.cost import estimate_prompt_tokens, output_token_bound, prompt_token_bound
from policies.fairness import FairnessPolicy, tenant_of
from policies.fleet import fleet_weight
from policies.locality import prefix_chain, routing_for
from policies.priority import vllm_priority

log = structlog.get_logger("fairgate.request")

T = TypeVar("T")


def estimate(creq: CompletionRequest) -> int:
    """The prompt tokens of a request before a backend tokenized it."""
    return estimate_prompt_tokens(creq.prompt)


@dataclass(frozen=True, slots=True)
class AdmissionParts:
    """Admission's parts, built by the composition root (``gateway/services.py``,
    ``build_admission``)."""

    waits: Waits
    adapter_loads: AdapterLoads
    placement: Placement
    charging: Charging
    continuations: Continuations
    backends: GrantedBackends  # the backend a grant names


class Admission(ReadsSettings):
    """One scheduled call, from its reservation to its settle. Its parts, by concern:
    :class:`~gateway.scheduling.placement.Placement` (whether and where it may queue, its
    wait for a grant), :class:`~gateway.scheduling.charging.Charging` (limits, budgets,
    usage and the fairness charges) and
    :class:`~gateway.scheduling.continuations.Continuations` (the rest of an answer
    elsewhere)."""

    def __init__(self, settings: SettingsHolder, dispatcher: Dispatcher, pool: BackendPool,
                 policy: FairnessPolicy, metrics: GatewayMetrics, replica_id: str,
                 running: RunningStreams, parts: AdmissionParts) -> None:
        self.holder = settings
        self.running = running
        self.dispatcher = dispatcher
        self.pool = pool
        self.policy = policy
        self.metrics = metrics
        self.replica_id = replica_id
        self.waits = parts.waits
        # runtime LoRA loads (docs/adapters.md); services.py runs its sweep
        self.adapter_loads = parts.adapter_loads
        self.placement = parts.placement
        self.charging = parts.charging
        self.continuations = parts.continuations
        self.backends = parts.backends

    def forwarded(self, account: ApiKey) -> AbstractAsyncContextManager[dict[str, str]]:
        """An unqueued call within its limits (:meth:`Charging.forwarded`)."""
        return self.charging.forwarded(account)

    async def call(self, model: str, user: str, klass: str, weight: float,
                   creq: CompletionRequest, send: Callable[[Ticket], Awaitable[T]],
                   request_id: str | None = None, arrived_s: float | None = None,
                   deadline_ms: int | None = None, account: ApiKey | None = None,
                   refuse_unready: bool = False, session: str = "") -> T:
        """:meth:`admitted` around ``send(ticket)``. When nothing reached the backend's
        engine, the request is queued once more: the connection failed (the backend's
        gates close, so it goes to another), or the backend no longer had the LoRA adapter
        it names (unloaded while it was on its way: it is resident there no more, so it
        goes where the adapter is, or has it loaded again)."""
        for attempt in (1, 2):
            async with self.admitted(model, user, klass, weight, creq, request_id,
                                     arrived_s, deadline_ms=deadline_ms,
                                     account=account, refuse_unready=refuse_unready,
                                     session=session) as ticket:
                try:
                    return await send(ticket)
                except BackendUnreachable as exc:
                    ticket.unsent = True
                    self.pool.unreachable(ticket.backend, exc)
                    if attempt == 2:
                        raise
                    reason = "backend_unreachable_retry"
                except AdapterGone:
                    ticket.unsent = True
                    await self.adapter_loads.gone(model, ticket.grant.backend, creq.model)
                    if attempt == 2:
                        raise
                    reason = "adapter_gone_retry"
            log.warning(reason, backend=ticket.grant.backend)
        raise AssertionError("unreachable")

    @asynccontextmanager
    async def admitted(self, model: str, user: str, klass: str, weight: float,
                       creq: CompletionRequest, request_id: str | None = None,
                       arrived_s: float | None = None, *, deadline_ms: int | None = None,
                       account: ApiKey | None = None, refuse_unready: bool = False,
                       session: str = "") -> AsyncIterator[Ticket]:
        """:meth:`_admitted` within the limits and budgets of ``account`` (its key and
        tenant, ``gateway/scheduling/quotas.py``): charged before queueing the most it can
        cost (:meth:`bound`), corrected at the end to what the backend reported, and its
        usage recorded (``gateway/scheduling/usage.py``)."""
        request_id = request_id or uuid.uuid4().hex
        bound = self.bound(model, creq)
        prompt_est = estimate(creq)  # read once: the queue's charge and the settle's
        held: Held | None = await self.charging.reserve(account, model, klass, request_id,
                                                        sum(bound))
        ticket: Ticket | None = None
        cancelled = False
        try:
            async with self._admitted(model, user, klass, weight, creq, request_id,
                                      arrived_s, deadline_ms=deadline_ms,
                                      account=account, refuse_unready=refuse_unready,
                                      session=session, bound=bound,
                                      prompt_est=prompt_est) as ticket:
                if held is not None:
                    ticket.limit_headers = held.headers
                yield ticket
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            await self.charging.unreserve(held, account, model, klass, ticket, prompt_est,
                                          cancelled)

    def _locality(self, model: str) -> bool:
        """Whether the model routes by locality (its requests' prompts are hashed)."""
        return routing_for(self.settings.routing.mode,
                           len(self.pool.for_model(model))) == "locality"

    def bound(self, model: str, creq: CompletionRequest) -> tuple[int, int]:
        """The (prompt, output) tokens the request can cost at most; their sum is
        ``policies/cost.max_cost_tokens``, what limits and budgets reserve: the model's
        context length bounds a request that sets no output limit (the
        ``max_output_tokens`` setting until a backend reported it)."""
        context = self.pool.max_model_len(model) or self.settings.limits.max_output_tokens
        return (prompt_token_bound(creq.prompt),
                output_token_bound(creq.prompt, creq.output, context))

    @asynccontextmanager
    async def _admitted(self, model: str, user: str, klass: str, weight: float,
                        creq: CompletionRequest, request_id: str,
                        arrived_s: float | None = None, *, deadline_ms: int | None = None,
                        account: ApiKey | None = None, refuse_unready: bool = False,
                        session: str = "", bound: tuple[int, int] = (0, 0),
                        prompt_est: int) -> AsyncIterator[Ticket]:
        """Wait for a grant; on exit release it and charge the user and its tenant (the
        ``account`` key's tenant, see ``policies/fairness.tenant_of``) real token counts,
        the key's usage recorded with the release (one Redis call:
        :meth:`Charging.settle`).

        ``arrived_s`` (monotonic) turns on the client-side TTFT/TPOT metrics of a stream.
        ``deadline_ms``: the first-token deadline from arrival (default: the class's
        ``ttft_slo_ms``).

        ``refuse_unready``: a client waits on its connection, so when no healthy backend of
        the model takes the request it is refused (503) at once, or held for one up to
        ``cold_start_wait_s`` (scale from zero); otherwise (a batch line) it waits in the
        queue like any other (a length-aware pool's is always checked).

        ``session``: with sessions on, the session it is queued in within its user's
        share ("": the user's default session); ignored with sessions off. ``bound``:
        the (prompt, output) tokens it can cost at most, what a whole answer cut short is
        charged (:attr:`Ticket.cut`); ``prompt_est``: its prompt's :func:`estimate`."""
        # a request naming a LoRA adapter is queued on its base model (docs/adapters.md)
        adapter = creq.model if creq.model != model else None
        admitted_s = time.monotonic()
        cold = await self.placement.check_fit(model, klass, creq, prompt_est, refuse_unready,
                                              adapter)
        queued, payer = self._queued(model, user, klass, weight, creq, request_id, prompt_est,
                                     adapter, account, session)
        grant, queued = await self._granted(model, queued, adapter, cold, admitted_s,
                                            arrived_s, deadline_ms)
        timing = StreamTiming(arrived_s) if arrived_s is not None else None
        ticket = await self._ticket(model, queued, grant, timing, whole=not creq.stream,
                                    bound=bound)
        running = Running(queued.request_id, model, user, queued.tenant, klass, grant.backend,
                          ticket.dispatched_s, ticket.mover)
        ticket.resumer = partial(self.continuations.next, model, queued, ticket, running)
        self.metrics.dispatch.on_dispatch(model, grant.backend, klass, user, grant.rank)
        self.running.add(running)
        try:
            yield ticket
        except BaseException as exc:
            ticket.ended_by(exc)
            raise
        finally:
            self.running.remove(running)
            await self.charging.settle(payer, queued, grant, ticket, timing)

    def _queued(self, model: str, user: str, klass: str, weight: float,
                creq: CompletionRequest, request_id: str, prompt_est: int,
                adapter: str | None, account: ApiKey | None, session: str
                ) -> tuple[QueuedRequest, Payer]:
        """The request as it is queued (its dispatch cost to its user and tenant, its
        prompt's prefix chain with locality routing, its session) and who pays for it."""
        tenant, tenant_weight = tenant_of(
            account.user if account else user, account.tenant if account else None, weight,
            {name: t.weight for name, t in self.settings.tenants.items()})
        self.metrics.usage.on_queued(model, user, "" if tenant == user else tenant, weight,
                               tenant_weight)
        # the weights its charges are divided by: fleet scope multiplies the model's
        # charges by its cost factor (policies/fleet.py; 1 per model)
        factor = self.settings.cost_factor(model)
        cw, ctw = fleet_weight(weight, factor), fleet_weight(tenant_weight, factor)
        queued = QueuedRequest(request_id, user, klass, self.replica_id,
                               self.policy.dispatch_cost(prompt_est, cw), time.time(),
                               (prefix_chain(creq.prompt) if self._locality(model) else ()),
                               tenant, self.policy.dispatch_cost(prompt_est, ctw),
                               prompt_tokens=prompt_est, whole=not creq.stream,
                               adapter=adapter,
                               session=session if self.settings.fairness.sessions else None,
                               credit=self.policy.cached_credit(cw),
                               tenant_credit=self.policy.cached_credit(ctw))
        return queued, Payer(model, klass, user, weight, cw, ctw, prompt_est, account)

    async def _granted(self, model: str, queued: QueuedRequest, adapter: str | None,
                       cold: bool, admitted_s: float, arrived_s: float | None,
                       deadline_ms: int | None) -> tuple[Grant, QueuedRequest]:
        """Queue the request within its class's wait limit and its first-token deadline
        (refused at once when the estimate already exceeds it) and wait for its grant;
        every refusal says when to retry."""
        klass, cls_cfg = queued.klass, self.settings.classes[queued.klass]
        if deadline_ms is None:
            deadline_ms = cls_cfg.ttft_slo_ms
        timeout_s = cls_cfg.max_queue_wait_s
        if deadline_ms is not None:
            # what the queue may use: the deadline left minus the measured time from
            # dispatch to first token
            left_s = (deadline_ms / 1000 - (time.monotonic() - (arrived_s or time.monotonic()))
                      - self.waits.to_first_token_s(model))
            await self.placement.refuse_unmeetable(model, queued, left_s, deadline_ms)
            timeout_s = min(timeout_s, left_s)
            # its user's queue serves earliest deadline first (enqueue.lua)
            queued = replace(queued, deadline_at=time.time() + left_s)
        try:
            grant = await self.placement.acquire(model, adapter, queued, timeout_s, cold,
                                                 admitted_s)
        except QueueTimeout as exc:
            if timeout_s < cls_cfg.max_queue_wait_s:  # the deadline, not the class's limit
                raise DeadlineUnmeetable(
                    f"the first-token deadline of {deadline_ms} ms passed while the request "
                    "was queued; it left the queue before dispatch", retry_after_s=
                    await self.waits.drain_retry_after(model, klass)) from None
            exc.retry_after_s = await self.waits.drain_retry_after(model, klass)
            raise
        except RateLimited as exc:
            if exc.code == RateLimited.code:  # the user's queue is full (not a subclass's)
                exc.retry_after_s = await self.waits.next_turn_retry_after(
                    model, klass, queued.user, queued.cost)
            raise
        except Unavailable as exc:  # no backend became ready for a cold start
            if not isinstance(exc, StoreUnavailable):  # that one: the edge's floor
                exc.retry_after_s = await self.waits.drain_retry_after(model, klass)
            raise
        return grant, queued

    async def _ticket(self, model: str, queued: QueuedRequest, grant: Grant,
                      timing: StreamTiming | None, whole: bool, bound: tuple[int, int]
                      ) -> Ticket:
        """The granted request's ticket: its backend (a grant for one removed since is
        released, 503) and its vLLM priority."""
        klass = queued.klass
        self.waits.dispatched(model, klass)
        waited = time.time() - queued.enqueued_at
        self.metrics.child(self.metrics.queue.wait, klass).observe(waited)
        priority = vllm_priority(self.settings.classes[klass].priority_base, grant.rank,
                                 self.settings.fairness.priority_class_gap)
        log.debug("dispatched", request_id=queued.request_id, backend=grant.backend,
                  wait_s=round(waited, 4), vllm_priority=priority)
        backend = await self.backends.named(grant.backend)
        if backend is None:  # removed by a config reload since the dispatch
            await self.dispatcher.release(model, grant, 0.0)
            raise BackendRemoved(f"backend {grant.backend} was just removed; retry",
                                 retry_after_s=self.waits.retry_after(None))
        return Ticket(model, grant, backend, priority, self.dispatcher, timing, self.waits,
                      whole=whole, bound=bound, wait_s=waited)
