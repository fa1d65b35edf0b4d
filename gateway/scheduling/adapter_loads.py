"""Runtime LoRA loads: a request naming a runtime adapter (``runtime: true``) that is
resident on no backend of its base model has it loaded on one (``docs/adapters.md``).

Where it goes, and which adapter makes room for it, is ``policies/adapters.plan_load``;
this module does the I/O:

- **One load per adapter.** The requests of one process that wait for the same adapter
  share one task; the processes of every replica take the model's load lease in Redis
  (``lora:loading``), so one process loads at a time, and each load's outcome is kept
  in Redis (``lora:<adapter>:load``) for the others, which wait for it instead of
  loading again.
- **Bounded wait.** A request waits at most ``adapter_load_wait_s`` for its adapter; a
  load that has no slot yet (every adapter within its minimum residency) is planned
  again until then, then the request gets a 503 ``adapter_not_loaded``.
- **No retry loop.** A load the backend refused (or that failed) is kept as an outcome
  for ``adapter_load_retry_s``: the requests meanwhile get its 502
  ``adapter_load_failed`` at once, from every replica.
- **Unloaded on the way.** A request that reaches a backend just after its adapter left
  it (vLLM answers 404) was not run: ``gone`` forgets the adapter there, and admission
  queues the request again, to be loaded again for it if it is resident nowhere.
- **Queued requests of an unloaded adapter.** ``run`` looks, every ``SWEEP_S``, for
  adapters with requests queued in this process that are resident nowhere (unloaded to
  make room for another) and loads them again, so they are not left waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from typing import Any

import aiohttp
import structlog

from gateway.backends import adapters
from gateway.backends.scrape import BackendHandle, BackendPool
from gateway.core.errors import AdapterLoadFailed, AdapterNotLoaded, StoreUnavailable
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import ReadsSettings, SettingsHolder
from gateway.storage.store import Store
from policies.adapters import LoadHost, LoadPlan, plan_load

log = structlog.get_logger("fairgate.adapters")

POLL_S = 0.05
"""How often a request waiting for another process's load (or for a slot) looks again."""
SWEEP_S = 0.5
"""How often queued requests of adapters resident nowhere are looked for."""


class AdapterLoads(ReadsSettings):
    def __init__(self, settings: SettingsHolder, pool: BackendPool, store: Store,
                 metrics: GatewayMetrics, holder: str) -> None:
        self.holder = settings
        self.pool = pool
        self.store = store
        self.metrics = metrics
        self.owner = holder  # this process, as the load lease names it
        self._loads: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._last_used: dict[tuple[str, str], float] = {}  # (backend, adapter) -> unix s
        self.queued: Counter[tuple[str, str]] = Counter()  # (model, adapter) -> requests

    def runtime(self, adapter: str | None) -> bool:
        return adapter is not None and adapters.runtime_adapter(self.settings, adapter)

    def resident(self, model: str, adapter: str) -> bool:
        return any(adapter in self.pool.adapters_on(h) for h in self.pool.for_model(model))

    def used(self, backend: str, adapter: str) -> None:
        """A request for ``adapter`` was dispatched to ``backend``."""
        self._last_used[(backend, adapter)] = time.time()

    async def gone(self, model: str, backend: str, adapter: str) -> None:
        """``backend`` answered that it does not have ``adapter`` (unloaded while a request
        was on its way there): it is resident there no more, for this process now and for
        every replica's next load (its load's outcome naming that backend is forgotten)."""
        self.pool.note_adapter(backend, adapter, False)
        with contextlib.suppress(StoreUnavailable):
            outcome = await self.store.adapter_load(model, adapter)
            if outcome is not None and outcome.get("backend") == backend \
                    and "error" not in outcome:
                await self.store.record_adapter_unload(model, backend, adapter)

    async def ensure(self, model: str, adapter: str) -> None:
        """Return once ``adapter`` is resident on a backend of ``model``, loading it if
        needed; AdapterLoadFailed or AdapterNotLoaded when it cannot be."""
        if self.resident(model, adapter):
            return
        gauge = self.metrics.adapter_requests.labels(model, adapter, "loading")
        gauge.inc()
        try:
            await asyncio.shield(self._load_task(model, adapter))
        finally:
            gauge.dec()

    def _load_task(self, model: str, adapter: str) -> asyncio.Task[None]:
        key = (model, adapter)
        task = self._loads.get(key)
        if task is None:
            task = self._loads[key] = asyncio.create_task(self._bring(model, adapter),
                                                          name=f"lora-load:{adapter}")
            task.add_done_callback(lambda t: self._done(key, t))
        return task

    def _done(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self._loads.get(key) is task:
            del self._loads[key]
        if not task.cancelled():
            task.exception()  # seen (its waiters got it, if any)

    async def _bring(self, model: str, adapter: str) -> None:
        wait_s = self.settings.adapter_load_wait_s
        deadline = time.monotonic() + wait_s
        while not self.resident(model, adapter):
            outcome = await self.store.adapter_load(model, adapter)
            if outcome is not None:  # a load another process (or this one) made
                if "error" in outcome:
                    raise AdapterLoadFailed(str(outcome["error"]))
                if str(outcome.get("backend")) in self.pool.handles:
                    self.pool.note_adapter(str(outcome["backend"]), adapter, True)
                    continue
            left = deadline - time.monotonic()
            if left <= 0:
                why = ("none had a slot for it" if self._hosts(model, adapter)
                       else "no healthy backend may load it")
                raise AdapterNotLoaded(
                    f"the LoRA adapter {adapter!r} is resident on no backend of {model!r} "
                    f"and {why} within adapter_load_wait_s ({wait_s:g} s)")
            if await self.store.lock_adapter_loads(model, self.owner, left + 5.0):
                try:
                    plan = await self._plan(model, adapter)
                    if plan is not None:
                        await self._carry_out(model, adapter, plan, left)
                        continue
                finally:
                    with contextlib.suppress(StoreUnavailable):
                        await asyncio.shield(self.store.unlock_adapter_loads(model, self.owner))
            await asyncio.sleep(min(POLL_S, max(0.0, left)))

    def _hosts(self, model: str, adapter: str) -> list[BackendHandle]:
        """The healthy, open backends of ``model`` where ``adapter`` may be loaded."""
        return [h for h in self.pool.for_model(model)
                if h.healthy and not h.drained and h.leaving_since is None
                and adapter in adapters.runtime_on(self.settings, h.config)]

    async def _plan(self, model: str, adapter: str) -> LoadPlan | None:
        handles = self._hosts(model, adapter)
        if not handles or self.resident(model, adapter):
            return None
        loaded_at = await self.store.adapters_loaded_at(model, [h.name for h in handles])
        now = time.time()
        hosts = []
        for h in handles:
            loaded = self.pool.adapters_on(h)
            active = frozenset(h.lora.active) if h.lora else frozenset()
            last = h.last
            load = (last.waiting + last.running if last else 0) + h.sent_since_snapshot
            hosts.append(LoadHost(
                h.name, loaded, h.lora.max_lora if h.lora else None, load, active,
                loaded & set(adapters.runtime_on(self.settings, h.config)),
                loaded_at.get(h.name, {}),
                {a: now if a in active else self._last_used.get((h.name, a), 0.0)
                 for a in loaded}))
        return plan_load(adapter, hosts, now, self.settings.adapter_min_residency_s)

    async def _carry_out(self, model: str, adapter: str, plan: LoadPlan, left_s: float) -> None:
        handle = self.pool.handles[plan.backend]
        timeout = aiohttp.ClientTimeout(total=max(left_s, 1.0))
        if plan.unload is not None:
            # no request of it goes there from now on (before vLLM forgets its name)
            self.pool.note_adapter(plan.backend, plan.unload, False)
            status, message = await self._post(handle, "/v1/unload_lora_adapter",
                                                {"lora_name": plan.unload}, timeout)
            if status not in (200, 404):  # 404: it is gone already
                self.pool.note_adapter(plan.backend, plan.unload, True)
                self.metrics.adapter_unloads.labels(plan.backend, plan.unload, "failed").inc()
                await self._failed(model, adapter, plan.backend, status, (
                    f"backend {plan.backend} could not unload the LoRA adapter "
                    f"{plan.unload!r} to make room for {adapter!r}: {message}"))
            self.metrics.adapter_unloads.labels(plan.backend, plan.unload, "unloaded").inc()
            await self.store.record_adapter_unload(model, plan.backend, plan.unload)
            log.info("adapter_unloaded", backend=plan.backend, adapter=plan.unload,
                     room_for=adapter)
        path = adapters.runtime_on(self.settings, handle.config)[adapter]
        status, message = await self._post(handle, "/v1/load_lora_adapter",
                                            {"lora_name": adapter, "lora_path": path}, timeout)
        if status != 200 and not (status == 400 and "already been loaded" in message):
            self.metrics.adapter_loads.labels(plan.backend, adapter, "failed").inc()
            hint = (" (its runtime LoRA routes are off: VLLM_ALLOW_RUNTIME_LORA_UPDATING)"
                    if status == 404 and "lora" not in message.lower() else "")
            await self._failed(model, adapter, plan.backend, status, (
                f"backend {plan.backend} could not load the LoRA adapter {adapter!r} from "
                f"{path!r}: {message}{hint}"))
        self.metrics.adapter_loads.labels(plan.backend, adapter, "loaded").inc()
        self.pool.note_adapter(plan.backend, adapter, True)
        await self.store.record_adapter_load(
            model, adapter, {"backend": plan.backend},
            3 * self.settings.adapter_refresh_s + 5.0, loaded_at=time.time())
        log.info("adapter_loaded", backend=plan.backend, adapter=adapter, unloaded=plan.unload)

    async def _failed(self, model: str, adapter: str, backend: str, status: int,
                      message: str) -> None:
        """Keep a failed load's outcome (no process tries again for
        ``adapter_load_retry_s``) and raise it."""
        log.warning("adapter_load_failed", backend=backend, adapter=adapter, status=status,
                    error=message)
        with contextlib.suppress(StoreUnavailable):
            await self.store.record_adapter_load(
                model, adapter, {"backend": backend, "status": status, "error": message},
                self.settings.adapter_load_retry_s)
        raise AdapterLoadFailed(message)

    async def _post(self, handle: BackendHandle, path: str, body: dict[str, Any],
                    limit: aiohttp.ClientTimeout) -> tuple[int, str]:
        """POST to the backend: its status and its message (0: no answer)."""
        try:
            async with self.pool.session.post(handle.config.url + path, json=body,
                                               timeout=limit) as resp:
                text = await resp.text()
                return resp.status, _message(resp.status, text)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return 0, f"no answer ({type(exc).__name__}: {exc})"

    async def run(self) -> None:
        """Load again the adapters resident nowhere that have requests queued here."""
        while True:
            await asyncio.sleep(SWEEP_S)
            for (model, adapter), count in list(self.queued.items()):
                if (count > 0 and (model, adapter) not in self._loads
                        and self.runtime(adapter) and not self.resident(model, adapter)):
                    self._load_task(model, adapter)


def _message(status: int, text: str) -> str:
    """vLLM's error message (OpenAI-shaped, or FastAPI's ``detail``), else the text."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        body = json.loads(text)
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return f"{status} {error['message']}"
        if body.get("detail"):
            return f"{status} {body['detail']}"
    return f"{status} {text[:200]}" if status else text[:200]
