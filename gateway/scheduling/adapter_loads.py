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
- **Demand orders the slots.** Each process publishes, every ``SWEEP_S`` and when a load
  starts, its requests waiting per adapter (for a load or in the queue; their count and
  the oldest's admission) in Redis (``lora:demand``); an adapter waiting for a load
  tries for the lease only when it is the first, by ``policies/adapters.load_order`` over
  every replica's demand, of the adapters that can be placed now; a victim is the one
  with the least demand (``plan_load``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import structlog

from gateway.backends import adapters
from gateway.backends.handle import BackendHandle
from gateway.backends.scrape import BackendPool
from gateway.core.errors import AdapterLoadFailed, AdapterNotLoaded, StoreUnavailable
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import ReadsSettings, SettingsHolder
from gateway.storage.adapter_store import AdapterStore
from policies.adapters import Demand, LoadHost, LoadPlan, load_order, plan_load

log = structlog.get_logger("fairgate.adapters")

POLL_S = 0.05
"""How often a request waiting for another process's load (or for a slot) looks again."""
SWEEP_S = 0.5
"""How often queued requests of adapters resident nowhere are looked for, and this
process's demand is published."""
DEMAND_FRESH_S = 4 * SWEEP_S
"""A replica's published demand older than this no longer counts (it is gone)."""
STARVE_SHARE = 0.25
"""An adapter whose oldest request has waited this share of ``adapter_load_wait_s`` goes
before those with more requests waiting (``load_order``)."""


class AdapterLoads(ReadsSettings):
    def __init__(self, settings: SettingsHolder, pool: BackendPool, store: AdapterStore,
                 metrics: GatewayMetrics, holder: str) -> None:
        self.holder = settings
        self.pool = pool
        self.store = store
        self.metrics = metrics
        self.owner = holder  # this process, as the load lease names it
        self._loads: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._last_used: dict[tuple[str, str], float] = {}  # (backend, adapter) -> unix s
        # (model, adapter) -> admission (unix s) of each request waiting for it here
        self._waiting: dict[tuple[str, str], list[float]] = {}
        self._published: set[str] = set()  # models whose demand this process published
        self._turns: dict[str, tuple[float, str | None]] = {}  # model -> (when, first)
        self._turn_locks: dict[str, asyncio.Lock] = {}

    def runtime(self, adapter: str | None) -> bool:
        return adapter is not None and adapters.runtime_adapter(self.settings, adapter)

    def resident(self, model: str, adapter: str) -> bool:
        return any(adapter in self.pool.adapters_on(h) for h in self.pool.for_model(model))

    @contextlib.contextmanager
    def waiting(self, model: str, adapter: str, since: float) -> Iterator[None]:
        """A request admitted at ``since`` (unix s) waits for ``adapter`` meanwhile: for
        its load or in the queue (its demand, ``docs/adapters.md``)."""
        key = (model, adapter)
        self._waiting.setdefault(key, []).append(since)
        try:
            yield
        finally:
            left = self._waiting[key]
            left.remove(since)
            if not left:
                del self._waiting[key]

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

    async def ensure(self, model: str, adapter: str, since: float | None = None) -> None:
        """Return once ``adapter`` is resident on a backend of ``model``, loading it if
        needed (for a request admitted at ``since``, unix s); AdapterLoadFailed or
        AdapterNotLoaded when it cannot be."""
        if self.resident(model, adapter):
            return
        gauge = self.metrics.adapters.requests.labels(model, adapter, "loading")
        gauge.inc()
        try:
            with self.waiting(model, adapter, time.time() if since is None else since):
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
            self._turns.pop(model, None)  # one more adapter waits: order them again
        return task

    def _done(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self._loads.get(key) is task:
            del self._loads[key]
        if not task.cancelled():
            task.exception()  # seen (its waiters got it, if any)

    async def _bring(self, model: str, adapter: str) -> None:
        wait_s = self.settings.adapter_load_wait_s
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(StoreUnavailable):
            await self._publish(model)  # the other replicas order it among theirs
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
            if await self._first(model) == adapter \
                    and await self.store.lock_adapter_loads(model, self.owner, left + 5.0):
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

    def _demand(self, model: str) -> dict[str, tuple[int, float]]:
        """This process's requests waiting per adapter of ``model``: (count, oldest)."""
        return {a: (len(times), min(times)) for (m, a), times in self._waiting.items()
                if m == model}

    async def _publish(self, model: str) -> None:
        mine = self._demand(model)
        loading = {a for (m, a) in self._loads if m == model}
        await self.store.publish_adapter_demand(
            model, self.owner, {a: (n, since, a in loading) for a, (n, since) in mine.items()},
            time.time())
        if mine:
            self._published.add(model)
        else:
            self._published.discard(model)

    async def _fleet_demand(self, model: str) -> tuple[dict[str, Demand], set[str]]:
        """Every fresh replica's demand (this one's as it is now) and the adapters some
        replica is loading."""
        now = time.time()
        found = await self.store.adapter_demand(model, now - DEMAND_FRESH_S, skip=self.owner)
        mine = self._demand(model)
        loading = {a for a, (_, _, flag) in found.items() if flag}
        loading |= {a for (m, a) in self._loads if m == model}
        demand = {a: Demand(n, since) for a, (n, since, _) in found.items()}
        for a, (n, since) in mine.items():
            had = demand.get(a)
            demand[a] = Demand(n + (had.requests if had else 0),
                               min(since, had.since) if had else since)
        return demand, loading

    async def _first(self, model: str) -> str | None:
        """The adapter whose turn it is to load (``load_order`` of the adapters some
        replica waits to load that can be placed now); worked out at most once per
        ``POLL_S`` for all of this process's waiting loads."""
        lock = self._turn_locks.setdefault(model, asyncio.Lock())
        async with lock:
            at, first = self._turns.get(model, (float("-inf"), None))
            if time.monotonic() - at < POLL_S:
                return first
            first = await self._work_out_first(model)
            self._turns[model] = (time.monotonic(), first)
            return first

    async def _work_out_first(self, model: str) -> str | None:
        demand, loading = await self._fleet_demand(model)
        hosts = await self._load_hosts(model)
        now = time.time()
        starve_s = STARVE_SHARE * self.settings.adapter_load_wait_s
        waiting = {a: d for a, d in demand.items()
                   if a in loading and self.runtime(a) and not self.resident(model, a)}
        for adapter in load_order(waiting, now, starve_s):
            outcome = await self.store.adapter_load(model, adapter)
            if outcome is not None and "error" not in outcome \
                    and str(outcome.get("backend")) in self.pool.handles:
                self.pool.note_adapter(str(outcome["backend"]), adapter, True)
                continue  # another replica loaded it
            if outcome is not None:
                continue  # its load failed: its requests get the error
            options = [h for h in hosts if adapter in adapters.runtime_on(
                self.settings, self.pool.handles[h.name].config)]
            if plan_load(adapter, options, now, self.settings.adapter_min_residency_s,
                         demand, starve_s) is not None:
                return adapter
        return None

    async def _load_hosts(self, model: str) -> list[LoadHost]:
        """The healthy, open backends of ``model`` as the load decision sees them."""
        handles = [h for h in self.pool.for_model(model)
                   if h.healthy and not h.drained and h.leaving_since is None]
        loaded_at = await self.store.adapters_loaded_at(model, [h.name for h in handles])
        now = time.time()
        hosts = []
        for h in handles:
            loaded = self.pool.adapters_on(h)
            active = frozenset(h.card.lora.active) if h.card.lora else frozenset()
            last = h.last
            load = (last.waiting + last.running if last else 0) + h.sent_since_snapshot
            times = loaded_at.get(h.name, {})
            hosts.append(LoadHost(
                h.name, loaded, h.card.lora.max_lora if h.card.lora else None, load, active,
                loaded & set(adapters.runtime_on(self.settings, h.config)),
                {a: at for a, (at, _) in times.items()},
                {a: now if a in active else self._last_used.get((h.name, a), 0.0)
                 for a in loaded},
                {a: took for a, (_, took) in times.items() if took is not None}))
        return hosts

    async def _plan(self, model: str, adapter: str) -> LoadPlan | None:
        names = {h.name for h in self._hosts(model, adapter)}
        if not names or self.resident(model, adapter):
            return None
        hosts = [h for h in await self._load_hosts(model) if h.name in names]
        demand, _ = await self._fleet_demand(model)
        return plan_load(adapter, hosts, time.time(), self.settings.adapter_min_residency_s,
                         demand, STARVE_SHARE * self.settings.adapter_load_wait_s)

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
                self.metrics.adapters.unloads.labels(plan.backend, plan.unload, "failed").inc()
                await self._failed(model, adapter, plan.backend, status, (
                    f"backend {plan.backend} could not unload the LoRA adapter "
                    f"{plan.unload!r} to make room for {adapter!r}: {message}"))
            self.metrics.adapters.unloads.labels(plan.backend, plan.unload, "unloaded").inc()
            await self.store.record_adapter_unload(model, plan.backend, plan.unload)
            log.info("adapter_unloaded", backend=plan.backend, adapter=plan.unload,
                     room_for=adapter)
        path = adapters.runtime_on(self.settings, handle.config)[adapter]
        started = time.monotonic()
        status, message = await self._post(handle, "/v1/load_lora_adapter",
                                            {"lora_name": adapter, "lora_path": path}, timeout)
        took_s = time.monotonic() - started
        if status != 200 and not (status == 400 and "already been loaded" in message):
            self.metrics.adapters.loads.labels(plan.backend, adapter, "failed").inc()
            hint = (" (its runtime LoRA routes are off: VLLM_ALLOW_RUNTIME_LORA_UPDATING)"
                    if status == 404 and "lora" not in message.lower() else "")
            await self._failed(model, adapter, plan.backend, status, (
                f"backend {plan.backend} could not load the LoRA adapter {adapter!r} from "
                f"{path!r}: {message}{hint}"))
        self.metrics.adapters.loads.labels(plan.backend, adapter, "loaded").inc()
        self.pool.note_adapter(plan.backend, adapter, True)
        await self.store.record_adapter_load(
            model, adapter, {"backend": plan.backend},
            3 * self.settings.adapter_refresh_s + 5.0, loaded_at=time.time(), load_s=took_s)
        self._turns.pop(model, None)  # the slots changed: order the waiting ones again
        log.info("adapter_loaded", backend=plan.backend, adapter=adapter, unloaded=plan.unload,
                 load_s=round(took_s, 3))

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
        """Load again the adapters resident nowhere that have requests queued here, and
        publish this process's demand."""
        while True:
            await asyncio.sleep(SWEEP_S)
            for model, adapter in list(self._waiting):
                if ((model, adapter) not in self._loads
                        and self.runtime(adapter) and not self.resident(model, adapter)):
                    self._load_task(model, adapter)
            for model in {m for m, _ in self._waiting} | self._published:
                with contextlib.suppress(StoreUnavailable):
                    await self._publish(model)


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
