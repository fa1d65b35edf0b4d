"""What a request is charged: the limits and budgets of its key and tenant
(``gateway/scheduling/quotas.py``: the most it can cost reserved before it queues,
corrected to what the backend reported at the end), its key's usage record
(``gateway/scheduling/usage.py``), and its user's and tenant's fairness charges at the
settle (``policies/fairness.py``: what the GPU computed, corrected from the dispatch's
estimate), sent with the release of its grant. Unqueued calls (``/tokenize``,
``/detokenize``) are bounded here too (:meth:`Charging.forwarded`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import structlog

from gateway.core.errors import RateLimitExceeded, StoreUnavailable
from gateway.core.metrics import GatewayMetrics
from gateway.core.metrics.edge import StreamTiming
from gateway.core.settings import ApiKey, ReadsSettings, SettingsHolder
from gateway.scheduling.dispatcher import Dispatcher
from gateway.scheduling.quotas import Held, Quotas
from gateway.scheduling.ticket import Ticket
from gateway.scheduling.usage import UsageLedger
from gateway.storage.records import Grant, QueuedRequest
from policies.cost import kv_token_seconds
from policies.fairness import FairnessPolicy, charged_prompt

log = structlog.get_logger("fairgate.request")


@dataclass(frozen=True, slots=True)
class Payer:
    """Who pays for a request, and how much its charges are divided by: its user's and
    its tenant's weights with the model's fleet cost factor (``policies/fleet.py``)."""

    model: str
    klass: str
    user: str
    weight: float
    user_weight: float  # the user's weight with the fleet factor
    tenant_weight: float  # the tenant's, likewise
    prompt_est: int  # the prompt's estimate, what the dispatch charged
    account: ApiKey | None = None


class Charging(ReadsSettings):
    def __init__(self, settings: SettingsHolder, dispatcher: Dispatcher,
                 policy: FairnessPolicy, metrics: GatewayMetrics,
                 quotas: Quotas | None = None, usage: UsageLedger | None = None) -> None:
        self.holder = settings
        self.dispatcher = dispatcher
        self.policy = policy
        self.metrics = metrics
        self.quotas = quotas
        self.usage = usage
        self.forwarding: dict[str, int] = {}  # per user: unqueued calls at the backends

    @asynccontextmanager
    async def forwarded(self, account: ApiKey) -> AsyncIterator[dict[str, str]]:
        """An unqueued call (``/tokenize``, ``/detokenize``): one of the user's at most
        ``max_unqueued_per_user`` at once on this replica, and a request against the
        key's and tenant's limits (rpm, max_concurrent; no tokens reserved). Yields the
        ``x-ratelimit-*`` headers; 429 ``rate_limit_exceeded`` when either refuses."""
        user, bound = account.user, self.settings.limits.max_unqueued_per_user
        if self.forwarding.get(user, 0) >= bound:
            self.metrics.usage.on_limit_refused(account.tenant_name, RateLimitExceeded.code)
            raise RateLimitExceeded(f"Rate limit reached for user {user!r}: {bound} "
                                    "concurrent tokenizer calls. Please try again in 1s.",
                                    retry_after_s=1)
        self.forwarding[user] = self.forwarding.get(user, 0) + 1
        try:
            held = None
            if self.quotas is not None:
                try:
                    held = await self.quotas.admit(account, uuid.uuid4().hex, 0)
                except RateLimitExceeded as exc:
                    self.metrics.usage.on_limit_refused(account.tenant_name, exc.code or "")
                    raise
            try:
                yield held.headers if held is not None else {}
            finally:
                if held is not None and self.quotas is not None:
                    with contextlib.suppress(StoreUnavailable):
                        await asyncio.shield(self.quotas.settle(held, 0))
        finally:
            left = self.forwarding.pop(user) - 1
            if left:
                self.forwarding[user] = left

    async def reserve(self, account: ApiKey | None, model: str, klass: str,
                      request_id: str, tokens: int) -> Held | None:
        """Charge the key's and tenant's limits ``tokens`` (the most the request can
        cost) before it queues; 429 when they refuse (its usage recorded as an error)."""
        if account is None or self.quotas is None:
            return None
        try:
            return await self.quotas.admit(account, request_id, tokens)
        except RateLimitExceeded as exc:
            self.metrics.usage.on_limit_refused(account.tenant_name, exc.code or "")
            await self.record_usage(account, model, klass, 0, 0, error=True)
            raise

    async def unreserve(self, held: Held | None, account: ApiKey | None, model: str,
                        klass: str, ticket: Ticket | None, prompt_est: int,
                        cancelled: bool) -> None:
        """Correct the reservation to what the request is charged and record its usage
        (unless it rode on the settle)."""
        prompt, output = (0, 0) if ticket is None else ticket.charged(prompt_est)
        if held is not None and self.quotas is not None:
            with contextlib.suppress(StoreUnavailable):
                await asyncio.shield(self.quotas.settle(held, prompt + output))
        if account is not None:
            await self.record_usage(
                account, model, klass, prompt, output,
                error=not (cancelled or (ticket is not None and ticket.completed)),
                stored=ticket is not None and ticket.usage_recorded, cancelled=cancelled)

    async def record_usage(self, account: ApiKey, model: str, klass: str, prompt: int,
                            output: int, error: bool, stored: bool = False,
                            cancelled: bool = False) -> None:
        self.metrics.usage.on_tenant_usage(account.tenant_name, klass, prompt, output, error)
        if self.usage is not None and not stored:
            with contextlib.suppress(StoreUnavailable):
                await asyncio.shield(self.usage.record(account, model, klass, prompt, output,
                                                       error, cancelled=cancelled))

    async def settle(self, payer: Payer, queued: QueuedRequest, grant: Grant, ticket: Ticket,
                     timing: StreamTiming | None) -> None:
        """Release the grant with its user's and tenant's charges: what the GPU computed
        (the prompt tokens its prefix cache lacked: dispatch charged those the backend's
        prefix index predicted uncached, the settle corrects that to what the backend
        reports), a whole answer cut short its bound (:meth:`Ticket.charged`), a refund
        when nothing reached the backend; its usage counts ride on the release. Metrics
        and the ``finished`` log come first: they do not depend on the client staying
        connected."""
        prompt, output = ticket.charged(payer.prompt_est)
        computed = prompt - min(ticket.cached_tokens, prompt)
        charged = charged_prompt(payer.prompt_est, grant.charged_prompt)
        dispatched, tenant_dispatched = queued.charged(grant.charged_prompt)
        # the KV cache it held, from its first token (else its dispatch) to now
        kv = kv_token_seconds(prompt, output, time.monotonic()
                              - (ticket.first_token_s or ticket.dispatched_s))
        settle = self.policy.settle_charge
        charge = (-dispatched if ticket.unsent
                  else settle(computed, charged, output, payer.user_weight, kv))
        tenant_charge = (-tenant_dispatched if ticket.unsent
                         else settle(computed, charged, output, payer.tenant_weight, kv))
        self._finished(payer, queued, grant, ticket, timing, kv)
        usage = None
        if payer.account is not None and self.usage is not None:
            sent = not ticket.unsent
            usage = self.usage.counts(payer.account, payer.model, payer.klass,
                                      prompt if sent else 0, output if sent else 0,
                                      cached_tokens=ticket.cached_tokens if sent else 0,
                                      error=not (ticket.completed or ticket.cancelled),
                                      cancelled=ticket.cancelled)
            ticket.usage_recorded = True
        await asyncio.shield(self.dispatcher.release(payer.model, grant, charge,
                                                     tenant_charge, usage))

    def _finished(self, payer: Payer, queued: QueuedRequest, grant: Grant, ticket: Ticket,
                  timing: StreamTiming | None, kv: float) -> None:
        """The metrics (what vLLM reported) and the ``finished`` log."""
        reported = ticket.completion_tokens
        self.metrics.edge.on_finish(payer.model, payer.klass, payer.user, ticket.prompt_tokens or 0,
                               reported, self.policy.service(
                                   (ticket.prompt_tokens or 0) - ticket.cached_tokens,
                                   reported, payer.weight, kv), timing, ticket.cached_tokens)
        log.info("finished", request_id=queued.request_id, backend=grant.backend,
                 wait_s=round(ticket.wait_s, 4), vllm_priority=ticket.priority,
                 latency_s=round(time.time() - queued.enqueued_at, 4),
                 output_tokens=reported, completed=ticket.completed,
                 **({"charged_bound": ticket.bound} if ticket.cut else {}))
