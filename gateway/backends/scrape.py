"""The backend pool: every vLLM backend in force (:meth:`BackendPool.reconcile`), this
process's view of each (``gateway/backends/handle.py``) and the reads that choose among
them (by model, prompt range, adapter, health).

Each backend is scraped by one process of all replicas and workers, its snapshot
published in Redis for the others: who scrapes when is ``gateway/backends/leases.py``,
one scrape ``scraper.py``, what a snapshot (or a failure) makes of the view
``snapshots.py``.

A scrape that fails or times out closes the holder's gates to that backend at once and is
published, so every process closes them on its next tick; after
``unhealthy_after_failures`` in a row the backend is also marked unhealthy. A snapshot
that stops coming goes stale and closes the gates too. A request that cannot connect to
the backend closes this process's gates the same way until the next snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp
import structlog

from gateway.backends import adapters
from gateway.backends.adapters import Resolved
from gateway.backends.assess import ClassGates
from gateway.backends.handle import BackendHandle, MetricWindows
from gateway.backends.leases import ScrapeLeases
from gateway.backends.scraper import Scraper
from gateway.backends.snapshots import Snapshots
from gateway.core.errors import StoreUnavailable
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import Backend, ReadsSettings, Settings, SettingsHolder
from gateway.core.supervise import supervise
from gateway.storage.records import BackendFit
from policies.classes import CLASS_ORDER
from policies.gates import GatePolicy
from policies.pacing import PacingTargets
from policies.prefill import class_limit, fitting

log = structlog.get_logger("fairgate.backends")


class AdapterNotes(ReadsSettings):
    """The runtime adapter loads and unloads not yet in the backends' listings, and the
    adapters available on a backend with them (:meth:`BackendPool.adapters_on`)."""

    def __init__(self, settings: SettingsHolder, handles: dict[str, BackendHandle]) -> None:
        self.holder = settings
        self.handles = handles  # the pool's: every backend in force
        # backend -> adapter -> (loaded, until monotonic s)
        self._noted: dict[str, dict[str, tuple[bool, float]]] = {}

    def adapters_on(self, handle: BackendHandle) -> frozenset[str]:
        found = adapters.configured_on(self.settings, handle.config) | set(handle.card.adapters)
        noted = self._noted.get(handle.name)
        if not noted:
            return found
        now = time.monotonic()
        for adapter, (loaded, until) in list(noted.items()):
            if until < now or (adapter in found) == loaded:  # its listing agrees by now
                del noted[adapter]
            elif loaded:
                found = found | {adapter}
            else:
                found = found - {adapter}
        return found

    def note(self, backend: str, adapter: str, loaded: bool) -> None:
        until = time.monotonic() + 3 * self.settings.lora.adapter_refresh_s + 5.0
        self._noted.setdefault(backend, {})[adapter] = (loaded, until)
        handle = self.handles.get(backend)
        if handle is not None:
            handle.lease.cards_read_at = 0.0


@dataclass(frozen=True, slots=True)
class PoolParts:
    """The pool's parts over its handles, built by the composition root
    (``gateway/services.py``, ``build_pool``)."""

    handles: dict[str, BackendHandle]  # every backend in force; the pool fills it
    classes: ClassGates
    notes: AdapterNotes
    snapshots: Snapshots
    scraper: Scraper
    leases: ScrapeLeases


class BackendPool(ReadsSettings):
    def __init__(self, settings: SettingsHolder, session: aiohttp.ClientSession,
                 metrics: GatewayMetrics, parts: PoolParts) -> None:
        self.holder = settings
        self.session = session  # to the backends (runtime adapter loads use it too)
        self.metrics = metrics
        self.classes = parts.classes
        self.handles = parts.handles
        self.handles.update({b.name: self._handle(b) for b in settings.current.backends})
        self._loops: dict[str, asyncio.Task[None]] = {}
        self.notes = parts.notes
        self.snapshots = parts.snapshots
        self.scraper = parts.scraper
        self.leases = parts.leases
        settings.on_swap(self._derive)

    @property
    def scraper_id(self) -> str:
        return self.leases.scraper_id

    @property
    def lease_s(self) -> float:
        return self.leases.lease_s

    @property
    def gate_policies(self) -> dict[str, GatePolicy]:
        return self.classes.policies

    @property
    def pacing_targets(self) -> dict[str, PacingTargets] | None:
        return self.classes.pacing_targets

    def _derive(self, settings: Settings) -> None:
        """The classes' gate policies and pacing targets, and each backend's prefill
        limits and windows, of these settings (a lowered ``max_waiting`` caps the pacing at
        once; a new ``tpot_window_s`` spans the samples already kept)."""
        self.classes.derive(settings)
        for handle in self.handles.values():
            handle.fit = self._fit(settings, handle.config)
            handle.windows.resize(settings.pacing.tpot_window_s)
            handle.pacing = self.classes.capped(handle.pacing)

    @staticmethod
    def _fit(settings: Settings, config: Backend) -> BackendFit:
        return BackendFit(config.prompt_range(), {
            c: class_limit(settings.classes[c].max_waiting_prefill_tokens,
                           config.max_num_batched_tokens) for c in CLASS_ORDER},
            settings.pacing.prefill_backfill_s)

    def _handle(self, config: Backend) -> BackendHandle:
        # the one place the TPOT window's length goes into a backend's windows
        return BackendHandle(config, MetricWindows.over(self.settings.pacing.tpot_window_s),
                             self.classes.initial_pacing(),
                             fit=self._fit(self.settings, config))

    def for_model(self, model: str) -> list[BackendHandle]:
        return [h for h in self.handles.values() if h.config.model == model]

    def taking(self, model: str, prompt_tokens: int,
               adapter: str | None = None) -> list[BackendHandle] | None:
        """The model's backends whose prompt range takes ``prompt_tokens`` and where
        ``adapter`` (if any) is available; None when none of them declares a range and no
        adapter is asked for (all take it)."""
        handles = self.for_model(model)
        if adapter is not None:
            handles = [h for h in handles if adapter in self.adapters_on(h)]
        elif not any(h.fit.prompt_range.bounded for h in handles):
            return None
        ranges = {h.name: h.fit.prompt_range for h in handles}
        names = set(fitting(ranges, prompt_tokens))
        return [h for h in handles if h.name in names]

    def adapters_on(self, handle: BackendHandle) -> frozenset[str]:
        """The LoRA adapters available on ``handle``: those its /v1/models lists and
        those the config puts there, corrected by the runtime loads and unloads noted
        since (:meth:`note_adapter`)."""
        return self.notes.adapters_on(handle)

    def note_adapter(self, backend: str, adapter: str, loaded: bool) -> None:
        """A runtime load (or unload) of ``adapter`` on ``backend``, in force here before
        the backend's /v1/models shows it: until its listing agrees, for three
        ``adapter_refresh_s`` at most. The backend's listing is read again at its next
        scrape (when this process scrapes it)."""
        self.notes.note(backend, adapter, loaded)

    def discovered(self) -> dict[str, set[str]]:
        """The adapters the backends list, by base model."""
        found: dict[str, set[str]] = {}
        for h in list(self.handles.values()):
            found.setdefault(h.config.model, set()).update(h.card.adapters)
        return found

    def resolve(self, name: str) -> Resolved | None:
        """The base model and adapter a request's ``model`` names (None: unknown)."""
        return adapters.resolve(name, self.settings, self.discovered())

    def fit(self, handle: BackendHandle) -> BackendFit:
        """What ``handle`` takes, for a dispatch decision: its prompt range and prefill
        limits, and, when its model has adapters anywhere, the adapters it has."""
        model = handle.config.model
        if not any(a.base_model == model for a in self.settings.adapters) and not any(
                h.card.adapters for h in self.for_model(model)):
            return handle.fit
        return dataclasses.replace(handle.fit, adapters=self.adapters_on(handle))

    def any_healthy(self, model: str | None = None) -> bool:
        handles = self.for_model(model) if model else list(self.handles.values())
        return any(h.healthy for h in handles)

    async def first_scrapes(self, model: str, timeout_s: float) -> bool:
        """Right after the start (or a reload that added backends): wait, at most
        ``timeout_s``, until a backend of ``model`` is healthy or each was scraped or
        failed once, so a request that came before the first scrape is not told there is
        no healthy backend. Whether one is healthy."""
        handles = self.for_model(model)
        pending = {asyncio.ensure_future(h.judged.wait()) for h in handles
                   if not h.judged.is_set()}
        if pending:
            log.info("waiting_for_first_scrape", model=model, backends=len(pending))
            self.metrics.backends.first_scrape_waits.labels(model).inc()
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            while pending and not any(h.healthy for h in handles):
                left = deadline - asyncio.get_running_loop().time()
                done, pending = await asyncio.wait(pending, timeout=max(left, 0),
                                                   return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    break
        finally:
            for task in pending:
                task.cancel()
        return any(h.healthy for h in handles)

    async def run(self) -> None:
        for handle in self.handles.values():
            if handle.name not in self._loops:  # a runtime backend read before may run
                self._start(handle)
        leases = asyncio.create_task(
            supervise("scrape", self.leases.ticks, self.metrics.process.loop_restarts),
            name="scrape-leases")
        try:
            await asyncio.Event().wait()  # until cancelled; scrape loops come and go
        finally:
            for task in [leases, *self._loops.values()]:
                task.cancel()
            await asyncio.gather(leases, *self._loops.values(), return_exceptions=True)
            with contextlib.suppress(StoreUnavailable, TimeoutError):
                await asyncio.wait_for(self.leases.give_up(), self.lease_s)

    async def tick(self) -> None:
        """One lease tick (:meth:`ScrapeLeases.tick`)."""
        await self.leases.tick()

    async def scrape_once(self, handle: BackendHandle) -> None:
        await self.scraper.scrape_once(handle)

    def hurry(self, model: str) -> None:
        """Work was queued for ``model`` (:meth:`ScrapeLeases.hurry`)."""
        self.leases.hurry(model)

    def set_drained(self, handle: BackendHandle, drained: bool) -> None:
        """This process wrote the backend's drain flag (:meth:`Snapshots.set_drained`)."""
        self.snapshots.set_drained(handle, drained)

    def unreachable(self, handle: BackendHandle, exc: BaseException) -> None:
        """A request could not connect to the backend: close its gates now, as a failed
        scrape does, instead of waiting for its snapshot to go stale."""
        self.snapshots.failed(handle, exc)

    def _start(self, handle: BackendHandle) -> None:
        loop = supervise("scrape", lambda: self.leases.scrape_loop(handle),
                         self.metrics.process.loop_restarts)
        self._loops[handle.name] = asyncio.create_task(loop, name=f"scrape-{handle.name}")

    def reconcile(self, backends: Sequence[Backend], origins: Mapping[str, str] | None = None
                  ) -> dict[str, list[str]]:
        """Apply the backend list in force (``gateway/backends/registry.py`` owns it):
        start, stop and re-point scrape loops; ``origins``: where each comes from (default
        "config"). Requests already at a removed backend finish there; queues are
        untouched; a removed backend's series leave ``/metrics``."""
        wanted = {b.name: b for b in backends}
        origins = origins or {}
        for name, current in self.handles.items():
            current.origin = origins.get(name, "config")
        report: dict[str, list[str]] = {"added": [], "removed": [], "changed": []}
        for name in [n for n in self.handles if n not in wanted]:
            self.handles.pop(name)
            self._stop(name)
            self.metrics.forget_backend(name)
            report["removed"].append(name)
        for name, config in wanted.items():
            handle = self.handles.get(name)
            if handle is not None and handle.config == config:
                continue
            if handle is not None:
                self._stop(name)
            self.handles[name] = self._handle(config)
            self.handles[name].origin = origins.get(name, "config")
            report["changed" if handle is not None else "added"].append(name)
            self._start(self.handles[name])
        return report

    def _stop(self, name: str) -> None:
        loop = self._loops.pop(name, None)
        if loop is not None:
            loop.cancel()

    def max_model_len(self, model: str) -> int | None:
        """The smallest context length the model's backends report (None: unknown)."""
        known = [h.card.max_model_len for h in self.for_model(model) if h.card.max_model_len]
        return min(known) if known else None
