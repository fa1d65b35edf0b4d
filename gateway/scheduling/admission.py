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
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TypeVar

import structlog

from gateway.backends import adapters
from gateway.backends.scrape import BackendHandle, BackendPool
from gateway.core.errors import (
    AdapterGone,
    BackendRemoved,
    BackendUnreachable,
    DeadlineUnmeetable,
    PromptFitsNoBackend,
    QueueTimeout,
    RateLimited,
    RateLimitExceeded,
    StoreUnavailable,
    Unavailable,
    UpstreamTimeout,
)
from gateway.core.metrics import GatewayMetrics, StreamTiming
from gateway.core.settings import ApiKey, ReadsSettings, SettingsHolder
from gateway.proxy.completion_request import CompletionRequest
from gateway.proxy.moving import DRAIN as DRAIN  # the reasons, re-exported
from gateway.proxy.moving import FAILOVER, RETRY, Mover
from gateway.proxy.moving import PREEMPT as PREEMPT
from gateway.scheduling.adapter_loads import AdapterLoads
from gateway.scheduling.dispatcher import Dispatcher
from gateway.scheduling.quotas import Held, Quotas
from gateway.scheduling.running import Running, RunningStreams
from gateway.scheduling.usage import UsageLedger
from gateway.scheduling.waits import Waits
from gateway.storage.store import Grant, QueuedRequest
from gateway.storage.values import continuation_id
from policies.cost import (
    estimate_prompt_tokens,
    kv_token_seconds,
    output_token_bound,
    prompt_token_bound,
)
from policies.fairness import FairnessPolicy, charged_prompt, tenant_of
from policies.fleet import fleet_weight
from policies.locality import prefix_chain, routing_for
from policies.prefill import no_fit_message
from policies.priority import vllm_priority
from policies.wait_estimate import DEADLINE_MARGIN, fits_deadline

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
    waits: Waits | None = None  # hears the dispatch-to-first-token time of a stream
    dispatched_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None  # monotonic, when its first token streamed
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, found in the backend's prefix cache
    completed: bool = False
    cancelled: bool = False  # its caller ended it (a client that hung up, a batch cancelled)
    unsent: bool = False  # nothing reached the backend: the dispatch cost is refunded
    # a whole (non-streamed) answer: nothing of it is counted until all of it came
    whole: bool = False
    timed_out: bool = False  # cut by upstream_timeout_s / max_request_s before its answer
    # (prompt, output) tokens it can cost at most: what a whole answer cut short is charged
    bound: tuple[int, int] = (0, 0)
    limit_headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-*
    usage_recorded: bool = False  # its usage counts rode on its settle
    # continuing the answer elsewhere: (reason, tokens to resend, the failed backend) → a
    # ticket for the rest, or None when no more continuations are allowed
    resumer: Callable[[str, int, BackendHandle],
                      AbstractAsyncContextManager[Ticket] | None] | None = None
    continuations: int = 0
    mover: Mover = field(default_factory=Mover)  # the relay's: moves the answer on purpose
    on_started: Callable[[], None] | None = None
    _started: bool = field(default=False, repr=False)

    def continuation(self, reason: str, tokens: int,
                     failed: BackendHandle) -> AbstractAsyncContextManager[Ticket] | None:
        """A ticket for the rest of this answer on another backend (``reason``: failover,
        or a move's: drain, preempt; ``tokens``: what the continuation sends again), or
        ``None``."""
        return None if self.resumer is None else self.resumer(reason, tokens, failed)

    async def first_token(self) -> None:
        if not self._started:
            self._started = True
            self.first_token_s = time.monotonic()
            if self.on_started is not None:
                self.on_started()
            if self.waits is not None and self.timing is not None:
                self.waits.first_token(self.model, time.monotonic() - self.dispatched_s)
            await self.dispatcher.started(self.model, self.grant)

    def tokens_sent(self, frames: int) -> None:
        if self.timing is not None:
            self.timing.token_frames_sent()

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> None:
        self.prompt_tokens = prompt_tokens or None
        self.completion_tokens = completion_tokens
        self.cached_tokens = cached_tokens

    def end(self, completed: bool) -> None:
        self.completed = completed

    def ended_by(self, exc: BaseException) -> None:
        """Its caller's code raised ``exc``: cancelled (a client that hung up, a batch
        cancelled), or the timeout cut its answer."""
        self.cancelled = self.cancelled or isinstance(exc, asyncio.CancelledError)
        self.timed_out = self.timed_out or isinstance(exc, UpstreamTimeout)

    @property
    def cut(self) -> bool:
        """A whole answer sent to its backend and cut before it came (its client left, a
        batch was cancelled, or the timeout fired): vLLM reports nothing of it, yet may
        have generated up to its output bound before it aborted it."""
        return (self.whole and not self.unsent and not self.completed
                and self.prompt_tokens is None and not self.completion_tokens  # no usage
                and (self.cancelled or self.timed_out))

    def charged(self, prompt_est: int) -> tuple[int, int]:
        """The (prompt, output) tokens it is charged: what the backend reported (the
        prompt's estimate when it said nothing); a :attr:`cut` whole answer its
        :attr:`bound`, so no one can generate for free by hanging up (docs/
        tenants-and-limits.md); nothing when nothing reached the backend."""
        if self.unsent:
            return 0, 0
        if self.cut:
            return self.bound
        return self.prompt_tokens or prompt_est, self.completion_tokens


def estimate(creq: CompletionRequest) -> int:
    """The prompt tokens of a request before a backend tokenized it, read from its
    endpoint's prompt field."""
    return estimate_prompt_tokens(creq.prompt)


class Admission(ReadsSettings):
    def __init__(self, settings: SettingsHolder, dispatcher: Dispatcher, pool: BackendPool,
                 policy: FairnessPolicy, metrics: GatewayMetrics, replica_id: str,
                 quotas: Quotas | None = None, usage: UsageLedger | None = None,
                 running: RunningStreams | None = None) -> None:
        self.holder = settings
        self.running = (running if running is not None
                        else RunningStreams(lambda: self.settings.max_moves))
        self.quotas = quotas
        self.usage = usage
        self.dispatcher = dispatcher
        self.pool = pool
        self.policy = policy
        self.metrics = metrics
        self.replica_id = replica_id
        self.waits = Waits(settings, dispatcher.store)
        # runtime LoRA loads (docs/adapters.md); services.py runs its sweep
        self.adapter_loads = AdapterLoads(settings, pool, dispatcher.store, metrics, replica_id)
        self.forwarding: dict[str, int] = {}  # per user: unqueued calls at the backends
        # reads the backend list in force again for a backend a grant names that this
        # process does not know yet (whether it knows it then): another process added it
        # and dispatched to it before this one's next read (services.py sets it)
        self.learn_backend: Callable[[str], Awaitable[bool]] | None = None

    @asynccontextmanager
    async def forwarded(self, account: ApiKey) -> AsyncIterator[dict[str, str]]:
        """An unqueued call (``/tokenize``, ``/detokenize``): one of the user's at most
        ``max_unqueued_per_user`` at once on this replica, and a request against the
        key's and tenant's limits (rpm, max_concurrent; no tokens reserved). Yields the
        ``x-ratelimit-*`` headers; 429 ``rate_limit_exceeded`` when either refuses."""
        user, bound = account.user, self.settings.max_unqueued_per_user
        if self.forwarding.get(user, 0) >= bound:
            self.metrics.on_limit_refused(account.tenant_name, RateLimitExceeded.code)
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
                    self.metrics.on_limit_refused(account.tenant_name, exc.code or "")
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
        held: Held | None = None
        prompt_est = estimate(creq)
        bound = self.bound(model, creq)
        if account is not None and self.quotas is not None:
            try:
                held = await self.quotas.admit(account, request_id, sum(bound))
            except RateLimitExceeded as exc:
                self.metrics.on_limit_refused(account.tenant_name, exc.code or "")
                await self._record_usage(account, model, klass, 0, 0, error=True)
                raise
        ticket: Ticket | None = None
        cancelled = False
        try:
            async with self._admitted(model, user, klass, weight, creq, request_id,
                                      arrived_s, deadline_ms=deadline_ms,
                                      account=account, refuse_unready=refuse_unready,
                                      session=session, bound=bound) as ticket:
                if held is not None:
                    ticket.limit_headers = held.headers
                yield ticket
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            prompt, output = (0, 0) if ticket is None else ticket.charged(prompt_est)
            if held is not None and self.quotas is not None:
                with contextlib.suppress(StoreUnavailable):
                    await asyncio.shield(self.quotas.settle(held, prompt + output))
            if account is not None:
                await self._record_usage(
                    account, model, klass, prompt, output,
                    error=not (cancelled or (ticket is not None and ticket.completed)),
                    stored=ticket is not None and ticket.usage_recorded, cancelled=cancelled)

    def _locality(self, model: str) -> bool:
        """Whether the model routes by locality (its requests' prompts are hashed)."""
        return routing_for(self.settings.routing,
                           len(self.pool.for_model(model))) == "locality"

    def bound(self, model: str, creq: CompletionRequest) -> tuple[int, int]:
        """The (prompt, output) tokens the request can cost at most; their sum is
        ``policies/cost.max_cost_tokens``, what limits and budgets reserve: the model's
        context length bounds a request that sets no output limit (the
        ``max_output_tokens`` setting until a backend reported it)."""
        context = self.pool.max_model_len(model) or self.settings.max_output_tokens
        return (prompt_token_bound(creq.prompt),
                output_token_bound(creq.prompt, creq.output, context))

    async def _record_usage(self, account: ApiKey, model: str, klass: str, prompt: int,
                            output: int, error: bool, stored: bool = False,
                            cancelled: bool = False) -> None:
        self.metrics.on_tenant_usage(account.tenant_name, klass, prompt, output, error)
        if self.usage is not None and not stored:
            with contextlib.suppress(StoreUnavailable):
                await asyncio.shield(self.usage.record(account, model, klass, prompt, output,
                                                       error, cancelled=cancelled))

    @asynccontextmanager
    async def _admitted(self, model: str, user: str, klass: str, weight: float,
                        creq: CompletionRequest, request_id: str,
                        arrived_s: float | None = None, *, deadline_ms: int | None = None,
                        account: ApiKey | None = None, refuse_unready: bool = False,
                        session: str = "", bound: tuple[int, int] = (0, 0)
                        ) -> AsyncIterator[Ticket]:
        """Wait for a grant; on exit release it and charge the user and its tenant (the
        ``account`` key's tenant, see ``policies/fairness.tenant_of``) real token counts,
        the key's usage recorded with the release (one Redis call).

        ``arrived_s`` (monotonic) turns on the client-side TTFT/TPOT metrics of a stream.
        ``deadline_ms``: the first-token deadline from arrival (default: the class's
        ``ttft_slo_ms``). Metrics and the ``finished`` log are recorded before the release
        is awaited, so they do not depend on the client staying connected.

        ``refuse_unready``: a client waits on its connection, so when no healthy backend of
        the model takes the request it is refused (503) at once, or held for one up to
        ``cold_start_wait_s`` (scale from zero); otherwise (a batch line) it waits in the
        queue like any other (a length-aware pool's is always checked).

        ``session``: with sessions on, the session it is queued in within its user's
        share ("": the user's default session); ignored with sessions off. ``bound``:
        the (prompt, output) tokens it can cost at most, what a whole answer cut short is
        charged (:attr:`Ticket.cut`)."""
        prompt_est = estimate(creq)
        # a request naming a LoRA adapter is queued on its base model (docs/adapters.md)
        adapter = creq.model if creq.model != model else None
        admitted_s = time.monotonic()
        cold = await self._check_fit(model, klass, creq, prompt_est, refuse_unready, adapter)
        tenant, tenant_weight = tenant_of(
            account.user if account else user, account.tenant if account else None, weight,
            {name: t.weight for name, t in self.settings.tenants.items()})
        self.metrics.on_queued(model, user, "" if tenant == user else tenant, weight,
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
                               session=session if self.settings.sessions else None,
                               credit=self.policy.cached_credit(cw),
                               tenant_credit=self.policy.cached_credit(ctw))
        cls_cfg = self.settings.classes[klass]
        if deadline_ms is None:
            deadline_ms = cls_cfg.ttft_slo_ms
        timeout_s = cls_cfg.max_queue_wait_s
        if deadline_ms is not None:
            # what the queue may use: the deadline left minus the measured time from
            # dispatch to first token
            left_s = (deadline_ms / 1000 - (time.monotonic() - (arrived_s or time.monotonic()))
                      - self.waits.to_first_token_s(model))
            await self._refuse_unmeetable(model, queued, left_s, deadline_ms)
            timeout_s = min(timeout_s, left_s)
            # its user's queue serves earliest deadline first (enqueue.lua)
            queued = replace(queued, deadline_at=time.time() + left_s)
        try:
            grant = await self._acquire_adapter(model, adapter, queued, timeout_s, cold,
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
                    model, klass, user, queued.cost)
            raise
        except Unavailable as exc:  # no backend became ready for a cold start
            if not isinstance(exc, StoreUnavailable):  # that one: the edge's floor
                exc.retry_after_s = await self.waits.drain_retry_after(model, klass)
            raise
        self.waits.dispatched(model, klass)
        waited = time.time() - queued.enqueued_at
        self.metrics.child(self.metrics.queue_wait, klass).observe(waited)
        priority = vllm_priority(cls_cfg.priority_base, grant.rank,
                                 self.settings.priority_class_gap)
        log.info("dispatched", request_id=queued.request_id, backend=grant.backend,
                 wait_s=round(waited, 4), vllm_priority=priority)
        backend = await self._granted_backend(grant.backend)
        if backend is None:  # removed by a config reload since the dispatch
            await self.dispatcher.release(model, grant, 0.0)
            raise BackendRemoved(f"backend {grant.backend} was just removed; retry",
                                 retry_after_s=self.waits.retry_after(None))
        timing = StreamTiming(arrived_s) if arrived_s is not None else None
        ticket = Ticket(model, grant, backend, priority, self.dispatcher, timing, self.waits,
                        whole=not creq.stream, bound=bound)
        running = Running(queued.request_id, model, user, tenant, klass, grant.backend,
                          ticket.dispatched_s, ticket.mover)
        ticket.resumer = partial(self._continued, model, queued, ticket, running)
        self.metrics.on_dispatch(model, grant.backend, klass, user, grant.rank)
        self.running.add(running)
        try:
            yield ticket
        except BaseException as exc:
            ticket.ended_by(exc)
            raise
        finally:
            self.running.remove(running)
            # a whole answer cut short: its bound (Ticket.charged)
            prompt, output = ticket.charged(prompt_est)
            # what the GPU computed: the prompt tokens its prefix cache lacked (dispatch
            # charged those the backend's prefix index predicted uncached; the settle
            # corrects that to what the backend reports)
            computed = prompt - min(ticket.cached_tokens, prompt)
            charged = charged_prompt(prompt_est, grant.charged_prompt)
            dispatched, tenant_dispatched = queued.charged(grant.charged_prompt)
            # the KV cache it held, from its first token (else its dispatch) to now
            kv = kv_token_seconds(prompt, output, time.monotonic()
                                  - (ticket.first_token_s or ticket.dispatched_s))
            charge = (-dispatched if ticket.unsent
                      else self.policy.settle_charge(computed, charged, output, cw, kv))
            tenant_charge = (-tenant_dispatched if ticket.unsent else
                             self.policy.settle_charge(computed, charged, output, ctw, kv))
            reported = ticket.completion_tokens  # the metrics count what vLLM reported
            self.metrics.on_finish(model, klass, user, ticket.prompt_tokens or 0, reported,
                                   self.policy.service(
                                       (ticket.prompt_tokens or 0) - ticket.cached_tokens,
                                       reported, weight, kv), timing, ticket.cached_tokens)
            log.info("finished", request_id=queued.request_id, backend=grant.backend,
                     latency_s=round(time.time() - queued.enqueued_at, 4),
                     output_tokens=reported, completed=ticket.completed,
                     **({"charged_bound": ticket.bound} if ticket.cut else {}))
            usage = None
            if account is not None and self.usage is not None:
                sent = not ticket.unsent
                usage = self.usage.counts(account, model, klass, prompt if sent else 0,
                                          output if sent else 0,
                                          cached_tokens=ticket.cached_tokens if sent else 0,
                                          error=not (ticket.completed or ticket.cancelled),
                                          cancelled=ticket.cancelled)
                ticket.usage_recorded = True
            await asyncio.shield(self.dispatcher.release(model, grant, charge, tenant_charge,
                                                         usage))

    def _continued(self, model: str, queued: QueuedRequest, original: Ticket,
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
            self.metrics.continuations.labels(reason, "failed").inc()
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
        backend = await self._granted_backend(grant.backend)
        if backend is None:  # removed by a config reload since the dispatch
            await self.dispatcher.release(model, grant, 0.0, 0.0)
            raise BackendRemoved(f"backend {grant.backend} was just removed")
        priority = vllm_priority(cls_cfg.priority_base, grant.rank,
                                 self.settings.priority_class_gap)
        ticket = Ticket(model, grant, backend, priority, self.dispatcher, None)
        running.backend, running.segment = grant.backend, cont.request_id
        pause = self.metrics.continuation_pause.labels(reason)
        ticket.on_started = lambda: pause.observe(time.monotonic() - paused)
        self.metrics.continuations.labels(reason, "continued").inc()
        self.metrics.continuation_recomputed_tokens.labels(reason).inc(tokens)
        log.info("continued", request_id=queued.request_id, reason=reason,
                 backend=grant.backend, from_backend=failed.name, resent_tokens=tokens)
        try:
            yield ticket
        finally:
            await asyncio.shield(self.dispatcher.release(model, grant, 0.0, 0.0))

    async def _granted_backend(self, name: str) -> BackendHandle | None:
        """The backend a grant names: one this process does not know yet (added at
        runtime by another process, which dispatched to it before this one's next read of
        the list) is learned from the shared list first; None when it is in force
        nowhere (removed since the dispatch)."""
        backend = self.pool.handles.get(name)
        if backend is None and self.learn_backend is not None and await self.learn_backend(name):
            backend = self.pool.handles.get(name)
            log.info("backend_learned_from_grant", backend=name)
        return backend

    async def _acquire_adapter(self, model: str, adapter: str | None, queued: QueuedRequest,
                               timeout_s: float, cold: bool, admitted_s: float) -> Grant:
        """:meth:`_acquire`; for a request naming a LoRA adapter, counted as queued for
        it (its demand orders the slots; a runtime adapter unloaded meanwhile is loaded
        again for it, ``AdapterLoads.run``), its dispatch noted as the adapter's use and its wait
        since admission (``admitted_s``, monotonic; its load included) observed."""
        if adapter is None:
            return await self._acquire(model, queued, timeout_s, cold)
        gauge = self.metrics.adapter_requests.labels(model, adapter, "queued")
        gauge.inc()
        since = time.time() - (time.monotonic() - admitted_s)
        try:
            with self.adapter_loads.waiting(model, adapter, since):
                grant = await self._acquire(model, queued, timeout_s, cold)
        finally:
            gauge.dec()
        self.adapter_loads.used(grant.backend, adapter)
        self.metrics.adapter_wait.labels(model, adapter).observe(time.monotonic() - admitted_s)
        return grant

    async def _check_fit(self, model: str, klass: str, creq: CompletionRequest,
                         prompt_tokens: int, refuse_unready: bool,
                         adapter: str | None = None) -> bool:
        """The one owner of "no healthy backend". With length-aware pools
        (``policies/prefill.py``): a prompt no backend of the model takes is refused (400);
        it never waits for, or goes to, a backend outside its range. When none of the
        backends that take it (``refuse_unready``: of the model, else only of a
        length-aware pool) is healthy: a 503 now, or with ``cold_start_wait_s`` True (it
        is cold: :meth:`_acquire` waits for one of them). A request naming a LoRA
        ``adapter`` only counts the backends having it: none at all is a 503 at once, or,
        for a runtime adapter, waits for its load (``adapter_loads.py``)."""
        if (adapter is not None and not self.adapter_loads.resident(model, adapter)
                and self.adapter_loads.runtime(adapter)):
            await self.adapter_loads.ensure(model, adapter)
        if adapter is not None and not any(adapter in self.pool.adapters_on(h)
                                           for h in self.pool.for_model(model)):
            raise Unavailable(adapters.loaded_nowhere(self.settings, model, adapter),
                              retry_after_s=await self.waits.drain_retry_after(model, klass))
        taking = self.pool.taking(model, prompt_tokens, adapter)
        if taking is not None and not taking:
            ranges = {h.name: h.fit.prompt_range for h in self.pool.for_model(model)}
            raise PromptFitsNoBackend(no_fit_message(model, prompt_tokens, ranges),
                                      param=creq.prompt.field or None)
        if (taking is None and not refuse_unready) or self._ready(model, prompt_tokens, adapter):
            return False
        if self.settings.cold_start_wait_s > 0:
            return True
        raise Unavailable(self._unready(model, prompt_tokens, adapter),
                          retry_after_s=await self.waits.drain_retry_after(model, klass))

    def _ready(self, model: str, prompt_tokens: int, adapter: str | None = None) -> bool:
        """Whether a healthy backend of the model (with ``adapter``) takes a prompt of
        ``prompt_tokens``."""
        taking = self.pool.taking(model, prompt_tokens, adapter)
        return any(h.healthy for h in (self.pool.for_model(model) if taking is None
                                       else taking))

    def _unready(self, model: str, prompt_tokens: int, adapter: str | None = None) -> str:
        """The 503's text when no backend that takes a request is healthy."""
        taking = self.pool.taking(model, prompt_tokens, adapter)
        if taking is None:
            return f"no healthy backend serves {model!r}"
        names = ", ".join(sorted(h.name for h in taking))
        if adapter is not None:
            return (f"no healthy backend of {model!r} has the adapter {adapter!r} and takes "
                    f"a prompt of about {prompt_tokens} tokens (those that do: {names})")
        return (f"no healthy backend of {model!r} takes a prompt of about {prompt_tokens} "
                f"tokens (those that do: {names})")

    async def _acquire(self, model: str, queued: QueuedRequest, timeout_s: float,
                       cold: bool) -> Grant:
        """Queue the request and wait for its grant. ``cold``: no backend that takes it
        is healthy (a pool at zero): it waits for one to become ready (started on demand,
        or added by a reload) at most ``cold_start_wait_s``, then leaves the queue with a
        503; once one is ready, the class's own limits bound its wait as any request's."""
        if not cold:
            return await self.dispatcher.acquire(model, queued, timeout_s)
        wait_s = self.settings.cold_start_wait_s
        log.info("cold_start_wait", request_id=queued.request_id, wait_s=wait_s)
        task = asyncio.ensure_future(self.dispatcher.acquire(model, queued, timeout_s))
        try:
            await asyncio.wait({task}, timeout=min(wait_s, timeout_s))
            if task.done() or self._ready(model, queued.prompt_tokens, queued.adapter):
                return await task
            task.cancel()  # leaves the queue (released, if a grant came meanwhile)
            try:
                return await task  # a grant that came as it was cancelled
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
            raise Unavailable(f"{self._unready(model, queued.prompt_tokens, queued.adapter)}: "
                              f"none became ready within cold_start_wait_s ({wait_s:g} s)")
        finally:
            if not task.done():
                task.cancel()

    async def _refuse_unmeetable(self, model: str, queued: QueuedRequest, left_s: float,
                                 deadline_ms: int) -> None:
        """429 ``deadline_unmeetable`` before queueing when the estimate exceeds what is
        left of the deadline; ``Retry-After``: when the estimate would fit."""
        if left_s > 0:
            place = await self.waits.place(model, queued.klass, queued.user, queued.cost)
            if place.wait_s is None or fits_deadline(place.wait_s, left_s):
                return  # (nothing measured yet: admitted)
            wait_ms = round(place.wait_s * 1000)
            message = (f"the estimated queue wait ({wait_ms} ms, {place.position} requests "
                       f"ahead) exceeds the first-token deadline of {deadline_ms} ms")
            retry = place.wait_s - left_s * DEADLINE_MARGIN
        else:
            message = (f"the first-token deadline of {deadline_ms} ms leaves no time to queue "
                       f"(dispatch to first token takes about "
                       f"{round(self.waits.to_first_token_s(model) * 1000)} ms)")
            retry = None
        log.info("deadline_unmeetable", request_id=queued.request_id, deadline_ms=deadline_ms)
        raise DeadlineUnmeetable(message, retry_after_s=self.waits.retry_after(retry))

