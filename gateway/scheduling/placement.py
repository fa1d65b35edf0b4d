"""Whether and where a request may queue, and its wait for a grant: the admission
decision of :class:`~gateway.scheduling.admission.Admission`.

- :meth:`Placement.check_fit` — the one owner of "no healthy backend": a prompt no
  backend of the model takes (length-aware pools, 400), a LoRA adapter resident nowhere
  (a 503, or its runtime load awaited), none of the backends that take it healthy (a 503
  now, or held for a cold start).
- :meth:`Placement.refuse_unmeetable` — 429 ``deadline_unmeetable`` before queueing when
  the wait estimate already exceeds the first-token deadline.
- :meth:`Placement.acquire` — queue the request and wait for its grant (counted as
  queued for its adapter; a cold start waits for a backend to become ready).
- :meth:`GrantedBackends.named` — the backend a grant names (learned from the shared
  list when another process added it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from gateway.backends import adapters
from gateway.backends.handle import BackendHandle
from gateway.backends.scrape import BackendPool
from gateway.core.errors import DeadlineUnmeetable, PromptFitsNoBackend, Unavailable
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import ReadsSettings, SettingsHolder
from gateway.proxy.completion_request import CompletionRequest
from gateway.scheduling.adapter_loads import AdapterLoads
from gateway.scheduling.dispatcher import Dispatcher
from gateway.scheduling.waits import Waits
from gateway.storage.records import Grant, QueuedRequest
from policies.prefill import no_fit_message
from policies.wait_estimate import DEADLINE_MARGIN, fits_deadline

log = structlog.get_logger("fairgate.request")


class Placement(ReadsSettings):
    def __init__(self, settings: SettingsHolder, dispatcher: Dispatcher, pool: BackendPool,
                 waits: Waits, adapter_loads: AdapterLoads, metrics: GatewayMetrics) -> None:
        self.holder = settings
        self.dispatcher = dispatcher
        self.pool = pool
        self.waits = waits
        self.adapter_loads = adapter_loads
        self.metrics = metrics

    async def check_fit(self, model: str, klass: str, creq: CompletionRequest,
                         prompt_tokens: int, refuse_unready: bool,
                         adapter: str | None = None) -> bool:
        """The one owner of "no healthy backend". With length-aware pools
        (``policies/prefill.py``): a prompt no backend of the model takes is refused (400);
        it never waits for, or goes to, a backend outside its range. When none of the
        backends that take it (``refuse_unready``: of the model, else only of a
        length-aware pool) is healthy: a 503 now, or with ``cold_start_wait_s`` True (it
        is cold: :meth:`acquire` waits for one of them). A request naming a LoRA
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
        if (taking is None and not refuse_unready) or self.ready(model, prompt_tokens, adapter):
            return False
        if self.settings.fleet.cold_start_wait_s > 0:
            return True
        raise Unavailable(self.unready(model, prompt_tokens, adapter),
                          retry_after_s=await self.waits.drain_retry_after(model, klass))

    def ready(self, model: str, prompt_tokens: int, adapter: str | None = None) -> bool:
        """Whether a healthy backend of the model (with ``adapter``) takes a prompt of
        ``prompt_tokens``."""
        taking = self.pool.taking(model, prompt_tokens, adapter)
        return any(h.healthy for h in (self.pool.for_model(model) if taking is None
                                       else taking))

    def unready(self, model: str, prompt_tokens: int, adapter: str | None = None) -> str:
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

    async def acquire(self, model: str, adapter: str | None, queued: QueuedRequest,
                               timeout_s: float, cold: bool, admitted_s: float) -> Grant:
        """:meth:`_queued`; for a request naming a LoRA adapter, counted as queued for
        it (its demand orders the slots; a runtime adapter unloaded meanwhile is loaded
        again for it, ``AdapterLoads.run``), its dispatch noted as the adapter's use and its wait
        since admission (``admitted_s``, monotonic; its load included) observed."""
        if adapter is None:
            return await self._queued(model, queued, timeout_s, cold)
        gauge = self.metrics.adapters.requests.labels(model, adapter, "queued")
        gauge.inc()
        since = time.time() - (time.monotonic() - admitted_s)
        try:
            with self.adapter_loads.waiting(model, adapter, since):
                grant = await self._queued(model, queued, timeout_s, cold)
        finally:
            gauge.dec()
        self.adapter_loads.used(grant.backend, adapter)
        self.metrics.adapters.wait.labels(model, adapter).observe(time.monotonic() - admitted_s)
        return grant

    async def _queued(self, model: str, queued: QueuedRequest, timeout_s: float,
                       cold: bool) -> Grant:
        """Queue the request and wait for its grant. ``cold``: no backend that takes it
        is healthy (a pool at zero): it waits for one to become ready (started on demand,
        or added by a reload) at most ``cold_start_wait_s``, then leaves the queue with a
        503; once one is ready, the class's own limits bound its wait as any request's."""
        if not cold:
            return await self.dispatcher.acquire(model, queued, timeout_s)
        wait_s = self.settings.fleet.cold_start_wait_s
        log.info("cold_start_wait", request_id=queued.request_id, wait_s=wait_s)
        task = asyncio.ensure_future(self.dispatcher.acquire(model, queued, timeout_s))
        try:
            await asyncio.wait({task}, timeout=min(wait_s, timeout_s))
            if task.done() or self.ready(model, queued.prompt_tokens, queued.adapter):
                return await task
            task.cancel()  # leaves the queue (released, if a grant came meanwhile)
            try:
                return await task  # a grant that came as it was cancelled
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
            raise Unavailable(f"{self.unready(model, queued.prompt_tokens, queued.adapter)}: "
                              f"none became ready within cold_start_wait_s ({wait_s:g} s)")
        finally:
            if not task.done():
                task.cancel()

    async def refuse_unmeetable(self, model: str, queued: QueuedRequest, left_s: float,
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


class GrantedBackends:
    """The backend a grant names: one this process does not know yet (added at runtime by
    another process, which dispatched to it before this one's next read of the list) is
    learned from the shared list first."""

    def __init__(self, pool: BackendPool,
                 learn_backend: Callable[[str], Awaitable[bool]] | None = None) -> None:
        self.pool = pool
        # reads the backend list in force again for a backend this process does not know
        # yet (whether it knows it then); services.py passes it
        self.learn_backend = learn_backend

    async def named(self, name: str) -> BackendHandle | None:
        """The backend ``name``; None when it is in force nowhere (removed since the
        dispatch)."""
        backend = self.pool.handles.get(name)
        if backend is None and self.learn_backend is not None and await self.learn_backend(name):
            backend = self.pool.handles.get(name)
            log.info("backend_learned_from_grant", backend=name)
        return backend
