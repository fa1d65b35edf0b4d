"""The backend pool: each vLLM server scraped by one process of all replicas and workers,
its snapshot published in Redis for the others.

A lease in Redis per backend (``lua/scrapers.lua``) names the process that scrapes it. The
holder scrapes, works out each class's gate and pacing, and publishes them with the
snapshot (``gateway/backends/published.py``, ``lua/snapshot.lua``); every process, the
holder too, renews or takes its leases and reads what was published since its last look
in one call per model and tick (every ``scrape_interval_s``). The leases are spread over
the processes: each holds at most ceil(backends / processes that ticked within a lease
length), so no replica scrapes for all while the others only read. A process dies: its
leases expire (``lease_s``: three intervals, at least :data:`LEASE_FLOOR_S`) and the next
tick of another takes them. A holder that stops publishing (its scrapes hang) gives its
lease up.

The holder scrapes every ``scrape_interval_s`` while the backend is busy (requests run,
wait or are in flight there, were dispatched to it by any replica, or are queued for its
model), every idle interval once none of that was seen for a whole idle interval; an
enqueue brings it back at once (:meth:`BackendPool.hurry`, or the next tick elsewhere).
Requests that end between two ticks leave no in-flight count to see: the backend's
dispatch counter, moved by every replica's dispatches, stands for them.

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
import math
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
import structlog

from gateway.backends import adapters
from gateway.backends.adapters import Resolved
from gateway.backends.published import Published
from gateway.backends.vllm_metrics import (
    OUTPUT,
    PREFIX_CACHE,
    SERVICE,
    TTFT_HISTOGRAMS,
    HistogramWindow,
    LoraState,
    MetricsFormatError,
    parse_metrics,
)
from gateway.core.errors import StoreUnavailable
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import Backend, ReadsSettings, Settings, SettingsHolder
from gateway.core.supervise import supervise
from gateway.core.waits import event_set
from gateway.storage.fleet_store import FleetStore
from gateway.storage.records import (
    BackendFit,
    BackendState,
    LeaseWish,
    ScrapeView,
    Stored,
    snapshot_from,
)
from policies.classes import CLASS_ORDER
from policies.gates import BackendSnapshot, Gate, GatePolicy, evaluate_gate, queued_for_a_slot
from policies.pacing import Pacing, PacingTargets, adjust
from policies.prefill import class_limit, fitting

log = structlog.get_logger("fairgate.backends")

LEASE_FLOOR_S = 0.5
"""A scrape lease lasts three scrape intervals, never less than this: a holder's tick
that runs late on a loaded machine must not hand its backends to another process."""
SERVICE_WINDOW_S = 30.0
"""A backend's service rate (``BackendHandle.service``) is measured over this window."""


@dataclass
class BackendHandle:
    config: Backend
    tpot: HistogramWindow
    ttft: HistogramWindow
    pacing: dict[str, Pacing]  # each class's allowance (adaptive pacing)
    prefix_hits: HistogramWindow  # vLLM's prefix cache: recent hits / queries (tokens)
    prefix_hit_ratio: float | None = None  # by the latest scrape (None: no recent queries)
    # vLLM's token and request counters (SERVICE, OUTPUT pairs): the service rate and the
    # output tokens per request, every process's view of what the scraper published
    service: HistogramWindow = field(
        default_factory=lambda: HistogramWindow(SERVICE_WINDOW_S, (OUTPUT,)))
    healthy: bool = False
    failures: int = 0
    accepts_priority: bool = True
    drained: bool = False
    # bumped by each drain/undrain this process writes: a drain flag read from Redis by a
    # call that began before it is older than it and is not taken
    drain_epoch: int = 0
    last: BackendSnapshot | None = None
    sent_since_snapshot: int = 0  # this replica's dispatches since ``last``
    peak_running: int = 0  # the most requests seen running at once (the batch's size)
    pending_prefill_tokens: int = 0  # by the latest snapshot (policies/prefill.py)
    max_model_len: int | None = None  # from its /v1/models, once it is healthy
    model_card_read: bool = False
    adapters: tuple[str, ...] = ()  # the LoRA adapters its /v1/models lists
    lora: LoraState | None = None  # its vllm:lora_requests_info (None: LoRA off)
    cards_read_at: float = 0.0  # monotonic s of the scraper's last /v1/models read
    scraped: asyncio.Event = field(default_factory=asyncio.Event)
    judged: asyncio.Event = field(default_factory=asyncio.Event)  # scraped, or failed, once
    # each class's gate by the latest snapshot, computed once when it arrives, and that
    # snapshot's taken_at (unix s; None: none yet): a decision by them counts what was sent
    # since it (gate_counts in gateway/storage/lua/_lib.lua)
    gates: dict[str, Gate] = field(default_factory=lambda: dict.fromkeys(
        CLASS_ORDER, Gate(0, "stale")))
    gates_seen: float | None = None
    fit: BackendFit = field(default_factory=BackendFit)  # its prompt range, prefill limits
    held: bool = False  # this process holds its scrape lease: scrapes it and publishes
    held_since: float = 0.0  # monotonic s
    published_at: float = 0.0  # monotonic s of this process's last publication
    seen: str = ""  # the version of its published snapshot this process read last
    busy: bool = True  # scraped at the configured interval (False: the idle one)
    active_at: float = field(default_factory=time.monotonic)  # monotonic s: work last seen
    dispatches: int = 0  # its dispatch counter (all replicas) as this process read it last
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # lease taken, or work came
    # where it comes from: "config" (the file), "admin" (POST /admin/backends) or "dns"
    # (discovery); and since when (unix s) it is leaving, drained until nothing runs there
    # (gateway/backends/registry.py)
    origin: str = "config"
    leaving_since: float | None = None

    @property
    def name(self) -> str:
        return self.config.name

    def shown_gates(self, gates: dict[str, Gate], pending: int) -> dict[str, Gate]:
        """``gates`` as operators see them: an open one that ``pending`` prefill tokens
        fill (policies/prefill.py) shows as closed by ``prefill_tokens``. Display only: the
        dispatch script applies that gate to each request with its own size."""
        return {c: Gate(g.limit, "prefill_tokens")
                if g.reason is None and 0 < self.fit.prefill_limits.get(c, 0) <= pending
                else g for c, g in gates.items()}

    def badge_gates(self, state: BackendState, now_s: float,
                    stale_after_s: float) -> dict[str, Gate]:
        """Each class's gate as operators see it now (the dashboard's badges and its
        gates-closed chart): in force at ``now_s``, with pending prefill shown, once the
        requests in transit that Redis holds (``state``) count against it."""
        in_transit = state.sent_since_snapshot + state.unseen
        return {c: g.after(in_transit, state.started_since_snapshot, state.inflight)
                for c, g in self.shown_gates(self.gates_at(now_s, stale_after_s),
                                             state.pending_prefill_tokens).items()}

    def gates_at(self, now_s: float, stale_after_s: float) -> dict[str, Gate]:
        """The gates in force now: the snapshot's, unless drained, unhealthy or stale."""
        if self.drained:
            return dict.fromkeys(CLASS_ORDER, Gate(0, "drained"))
        if not self.healthy or self.last is None or now_s - self.last.taken_at_s > stale_after_s:
            return dict.fromkeys(CLASS_ORDER, Gate(0, "stale"))
        return self.gates


class BackendPool(ReadsSettings):
    def __init__(
        self,
        settings: SettingsHolder,
        session: aiohttp.ClientSession,
        store: FleetStore,
        metrics: GatewayMetrics,
        on_snapshot: Callable[[], None] = lambda: None,
        *,
        scraper_id: str | None = None,
    ) -> None:
        self.holder = settings
        self.session = session
        self.store = store
        self.metrics = metrics
        self.on_snapshot = on_snapshot
        self.gate_policies: dict[str, GatePolicy] = {}
        self.pacing_targets: dict[str, PacingTargets] | None = None
        self.handles: dict[str, BackendHandle] = {}
        self._derive(settings.current)
        self.handles = {b.name: self._handle(b) for b in settings.current.backends}
        self._loops: dict[str, asyncio.Task[None]] = {}
        # this process, as its scrape leases name it
        self.scraper_id = scraper_id or (
            f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}")
        self._down: set[str] = set()  # models whose leases the store did not answer
        # runtime adapter loads/unloads not yet in the backends' listings: backend ->
        # adapter -> (loaded, until monotonic s) (note_adapter)
        self._noted: dict[str, dict[str, tuple[bool, float]]] = {}
        settings.on_swap(self._derive)

    def _derive(self, settings: Settings) -> None:
        """The classes' gate policies and pacing targets, and each backend's prefill
        limits, of these settings (a lowered ``max_waiting`` caps the pacing at once)."""
        self.gate_policies = {c: settings.classes[c].gate() for c in CLASS_ORDER}
        self.pacing_targets = ({c: settings.classes[c].pacing_targets() for c in CLASS_ORDER}
                               if settings.pacing == "adaptive" else None)
        for handle in self.handles.values():
            handle.fit = self._fit(settings, handle.config)
            handle.pacing = {c: dataclasses.replace(
                p, allowance=min(p.allowance, float(self.gate_policies[c].max_waiting)))
                for c, p in handle.pacing.items()}

    @staticmethod
    def _fit(settings: Settings, config: Backend) -> BackendFit:
        return BackendFit(config.prompt_range(), {
            c: class_limit(settings.classes[c].max_waiting_prefill_tokens,
                           config.max_num_batched_tokens) for c in CLASS_ORDER},
            settings.prefill_backfill_s)

    def _handle(self, config: Backend) -> BackendHandle:
        window_s = self.settings.tpot_window_s
        pacing = {c: Pacing(float(p.max_waiting)) for c, p in self.gate_policies.items()}
        return BackendHandle(config, HistogramWindow(window_s),
                             HistogramWindow(window_s, TTFT_HISTOGRAMS), pacing,
                             HistogramWindow(window_s, (PREFIX_CACHE,)),
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
        found = adapters.configured_on(self.settings, handle.config) | set(handle.adapters)
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

    def note_adapter(self, backend: str, adapter: str, loaded: bool) -> None:
        """A runtime load (or unload) of ``adapter`` on ``backend``, in force here before
        the backend's /v1/models shows it: until its listing agrees, for three
        ``adapter_refresh_s`` at most. The backend's listing is read again at its next
        scrape (when this process scrapes it)."""
        until = time.monotonic() + 3 * self.settings.adapter_refresh_s + 5.0
        self._noted.setdefault(backend, {})[adapter] = (loaded, until)
        handle = self.handles.get(backend)
        if handle is not None:
            handle.cards_read_at = 0.0

    def discovered(self) -> dict[str, set[str]]:
        """The adapters the backends list, by base model."""
        found: dict[str, set[str]] = {}
        for h in list(self.handles.values()):
            found.setdefault(h.config.model, set()).update(h.adapters)
        return found

    def resolve(self, name: str) -> Resolved | None:
        """The base model and adapter a request's ``model`` names (None: unknown)."""
        return adapters.resolve(name, self.settings, self.discovered())

    def fit(self, handle: BackendHandle) -> BackendFit:
        """What ``handle`` takes, for a dispatch decision: its prompt range and prefill
        limits, and, when its model has adapters anywhere, the adapters it has."""
        model = handle.config.model
        if not any(a.base_model == model for a in self.settings.adapters) and not any(
                h.adapters for h in self.for_model(model)):
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
            self.metrics.first_scrape_waits.labels(model).inc()
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

    @property
    def lease_s(self) -> float:
        return max(3 * self.settings.scrape_interval_s, LEASE_FLOOR_S)

    @property
    def idle_interval_s(self) -> float:
        """The scrape interval of an idle backend: never more than half the staleness
        bound (its snapshot must not close its gates between two scrapes)."""
        s = self.settings
        return max(s.scrape_interval_s, min(s.idle_scrape_interval_s, s.snapshot_stale_s / 2))

    async def run(self) -> None:
        for handle in self.handles.values():
            if handle.name not in self._loops:  # a runtime backend read before may run
                self._start(handle)
        leases = asyncio.create_task(
            supervise("scrape", self._lease_loop, self.metrics.loop_restarts),
            name="scrape-leases")
        try:
            await asyncio.Event().wait()  # until cancelled; scrape loops come and go
        finally:
            for task in [leases, *self._loops.values()]:
                task.cancel()
            await asyncio.gather(leases, *self._loops.values(), return_exceptions=True)
            with contextlib.suppress(StoreUnavailable, TimeoutError):
                await asyncio.wait_for(self._give_up_leases(), self.lease_s)

    async def _lease_loop(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(self.settings.scrape_interval_s)

    async def tick(self) -> None:
        """Renew or take this process's scrape leases, give up those it stopped serving,
        and take in what the backends' scrapers published since the last tick."""
        now = time.monotonic()
        yield_s = self.settings.snapshot_stale_s + self.settings.scrape_timeout_s
        handles = dict(self.handles)  # a reload may change them while Redis answers
        epochs = {name: h.drain_epoch for name, h in handles.items()}
        wanted: dict[str, list[LeaseWish]] = {}
        for h in handles.values():
            keeps = not h.held or now - max(h.held_since, h.published_at) < yield_s
            if not keeps:
                log.warning("scrape_lease_given_up", backend=h.name, silent_s=yield_s)
            wanted.setdefault(h.config.model, []).append(LeaseWish(h.name, keeps, h.seen))
        # one call per model, each on its own: behind Redis Cluster a model whose shard
        # is failing over must not stop the others' leases and snapshots
        models = list(wanted)
        found = await asyncio.gather(*(self.store.scrape_lease(
            self.scraper_id, self.lease_s, m, wanted[m]) for m in models),
            return_exceptions=True)
        for model, result in zip(models, found, strict=True):
            if isinstance(result, StoreUnavailable):
                self._lost(model, result, handles.values())
                continue
            if isinstance(result, BaseException):
                raise result
            self._down.discard(model)
            queued, views = result
            for name, view in views.items():
                handle = handles[name]
                if self.handles.get(name) is handle:
                    self._take_view(handle, view, queued > 0, now, epochs[name])

    def _lost(self, model: str, error: StoreUnavailable,
              handles: Iterable[BackendHandle]) -> None:
        """The store did not answer for ``model``'s leases."""
        if model in self._down:
            return
        log.warning("scrape_leases_failed", model=model, error=str(error))
        self._down.add(model)
        if self._alone(model):  # degraded mode: every process scrapes for itself
            for h in handles:
                if h.config.model == model:
                    h.wake.set()

    def _alone(self, model: str) -> bool:
        """Scraping ``model``'s backends for this process only: the store is unreachable
        for it and ``store_outage: local`` serves on (no lease, no published snapshot
        meanwhile)."""
        return model in self._down and self.settings.store_outage == "local"

    async def _give_up_leases(self) -> None:
        """On the way out: the leases this process holds go to the next tick of another."""
        wanted: dict[str, list[LeaseWish]] = {}
        for h in self.handles.values():
            if h.held:
                wanted.setdefault(h.config.model, []).append(LeaseWish(h.name, False, h.seen))
        if wanted:
            await self.store.scrape_leases(self.scraper_id, self.lease_s, wanted)

    def _take_view(self, handle: BackendHandle, view: ScrapeView, queued: bool,
                   now: float, epoch: int) -> None:
        if view.held != handle.held:
            handle.held, handle.held_since = view.held, now
            log.info("scrape_lease_taken" if view.held else "scrape_lease_lost",
                     backend=handle.name, scraper=self.scraper_id)
            self.metrics.backend_scraping.labels(handle.name).set(1 if view.held else 0)
            if view.held:
                handle.wake.set()  # scrape now
        self._read_drained(handle, view.drained, epoch)
        handle.pending_prefill_tokens = view.pending_prefill_tokens
        if view.published is not None:
            self._adopt(handle, view.published)
        last = handle.last
        came, handle.dispatches = view.dispatches != handle.dispatches, view.dispatches
        self._note_work(handle, now, queued or came or view.inflight > 0
                        or (last is not None and last.running + last.waiting > 0))

    def _note_work(self, handle: BackendHandle, now: float, seen: bool) -> None:
        """Busy while work was seen within an idle interval: requests that each end
        between two looks must not make a backend that serves a steady stream look
        idle."""
        if seen:
            handle.active_at = now
        busy = now - handle.active_at < self.idle_interval_s
        if busy and not handle.busy and handle.held:
            handle.wake.set()  # back to the fast interval at once
        handle.busy = busy

    def hurry(self, model: str) -> None:
        """Work was queued for ``model``: its idle backends this process scrapes are
        scraped now and at the fast interval (elsewhere the next tick tells their
        scrapers)."""
        now = time.monotonic()
        for h in self.handles.values():
            if h.config.model == model:
                self._note_work(h, now, True)

    def _adopt(self, handle: BackendHandle, raw: dict[str, str]) -> None:
        """Take in what another process (or this one, before a restart) published."""
        handle.seen = raw.get("v", "")
        snap = snapshot_from(raw)
        try:
            shared = Published.decode(raw["shared"]) if "shared" in raw else None
        except ValueError as exc:
            log.warning("published_snapshot_unreadable", backend=handle.name, error=str(exc))
            return
        failures = int(raw.get("failures") or 0)
        last = handle.last
        if (snap is not None and shared is not None
                and (last is None or snap.taken_at_s > last.taken_at_s)):
            for window in (handle.tpot, handle.ttft, handle.prefix_hits, handle.service):
                window.add(snap.taken_at_s, shared.sums)
            if failures == 0:
                self._apply(handle, snap, shared)
                return
            handle.last = snap
        if failures:
            self._mark_failures(handle, failures, "published by its scraper")

    def _start(self, handle: BackendHandle) -> None:
        loop = supervise("scrape", lambda: self._loop(handle), self.metrics.loop_restarts)
        self._loops[handle.name] = asyncio.create_task(loop, name=f"scrape-{handle.name}")

    def set_drained(self, handle: BackendHandle, drained: bool) -> None:
        """This process wrote the backend's drain flag to Redis: take it at once, and
        ignore the flag in any Redis answer to a call that began before."""
        handle.drain_epoch += 1
        self._show_drained(handle, drained)

    def _read_drained(self, handle: BackendHandle, drained: bool, epoch: int) -> None:
        """The drain flag as Redis answered a call begun at ``epoch`` (another process's
        drain, or this one's after a restart)."""
        if epoch == handle.drain_epoch and drained != handle.drained:
            self._show_drained(handle, drained)

    def _show_drained(self, handle: BackendHandle, drained: bool) -> None:
        handle.drained = drained
        self.metrics.backend_drained.labels(handle.name).set(1 if drained else 0)

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
            loop = self._loops.pop(name, None)
            if loop is not None:
                loop.cancel()
            self.metrics.forget_backend(name)
            report["removed"].append(name)
        for name, config in wanted.items():
            handle = self.handles.get(name)
            if handle is not None and handle.config == config:
                continue
            if handle is not None:
                loop = self._loops.pop(name, None)
                if loop is not None:
                    loop.cancel()
            self.handles[name] = self._handle(config)
            self.handles[name].origin = origins.get(name, "config")
            report["changed" if handle is not None else "added"].append(name)
            self._start(self.handles[name])
        return report

    async def _loop(self, handle: BackendHandle) -> None:
        """Scrape the backend while this process holds its lease (or Redis is down and
        each process serves alone), at the fast interval while it is busy, at the idle
        one otherwise; wait for the lease while another process holds it.

        Each wake-up is taken once, whether it scrapes or not: one that came while this
        process held the lease, and stays set after it lost it (given up under load, or a
        Redis outage ended), would otherwise return at once from every wait without ever
        suspending, and the whole event loop would spin here. One that comes during a
        scrape stays set for the next turn: scraped again at once."""
        while True:
            delay = None
            if handle.held or self._alone(handle.config.model):
                started = time.monotonic()
                await self.scrape_once(handle)
                interval = (self.settings.scrape_interval_s if handle.busy
                            else self.idle_interval_s)
                delay = max(0.0, started + interval - time.monotonic())
            await event_set(handle.wake, delay)
            handle.wake.clear()

    async def scrape_once(self, handle: BackendHandle) -> None:
        started = time.time()
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.scrape_timeout_s)
            async with self.session.get(handle.config.url + "/metrics", timeout=timeout) as resp:
                resp.raise_for_status()
                raw = parse_metrics(await resp.text())
        except (aiohttp.ClientError, TimeoutError, MetricsFormatError) as exc:
            self._failed(handle, exc)
            with contextlib.suppress(StoreUnavailable):
                handle.seen = await self.store.publish_failure(
                    handle.config.model, handle.name, handle.failures)
                handle.published_at = time.monotonic()
            return
        sums = dict(raw.sums)
        if raw.prefix_cache is not None:
            sums[PREFIX_CACHE] = raw.prefix_cache
        if raw.service is not None and raw.output is not None:
            sums[SERVICE], sums[OUTPUT] = raw.service, raw.output
        handle.service.add(started, sums)
        tpot = handle.tpot.add(started, sums)
        ttft = handle.ttft.add(started, sums)
        prefix_hit_ratio = handle.prefix_hits.add(started, sums)
        snap = BackendSnapshot(int(raw.waiting), int(raw.running), raw.kv_usage, tpot, started)
        # back after failures, perhaps restarted: its batch may be smaller now (learnt
        # again from what runs) and its prefix cache is gone
        recovering = not handle.healthy and handle.failures > 0
        pacing = ({c: dataclasses.replace(p, peak_running=0) for c, p in handle.pacing.items()}
                  if recovering else handle.pacing)
        peak = max(0 if recovering else handle.peak_running, snap.running)
        if not handle.model_card_read or (
                raw.lora is not None
                and time.monotonic() - handle.cards_read_at >= self.settings.adapter_refresh_s):
            await self._read_model_card(handle)
        gates, pacing = self._assess(pacing, snap, ttft, peak)
        shared = Published(gates, pacing, peak, prefix_hit_ratio, ttft, sums,
                           handle.max_model_len, handle.model_card_read, handle.adapters,
                           raw.lora)
        epoch = handle.drain_epoch
        try:
            stored = await self.store.store_snapshot(handle.config.model, handle.name, snap,
                                                     shared.encode())
        except StoreUnavailable as exc:
            log.warning("snapshot_store_failed", backend=handle.name, error=str(exc))
            if self.settings.store_outage != "local":
                return
            # degraded mode: this process paces by its own scrape alone
            stored = Stored(True, handle.drained, 0, handle.seen)
        else:
            handle.published_at = time.monotonic()
        self._read_drained(handle, stored.drained, epoch)
        if stored.stored:
            handle.pending_prefill_tokens, handle.seen = stored.pending, stored.version
        if recovering:
            with contextlib.suppress(StoreUnavailable):
                await self.store.forget_prefixes(handle.config.model, handle.name)
        self._apply(handle, snap, shared)

    def _assess(self, pacing: dict[str, Pacing], snap: BackendSnapshot, ttft_s: float | None,
                peak: int) -> tuple[dict[str, Gate], dict[str, Pacing]]:
        """Each class's gate by this snapshot, and its pacing after it: the class's gate
        policy with the batch as seen so far, its ``max_waiting`` moved by adaptive
        pacing."""
        gates, after = {}, dict(pacing)
        for cls, base in self.gate_policies.items():
            policy = dataclasses.replace(base, batch=peak)
            if self.pacing_targets is not None:
                p = after[cls] = adjust(pacing[cls], snap, ttft_s, self.pacing_targets[cls])
                policy = dataclasses.replace(policy, max_waiting=p.max_waiting,
                                             free_slots=p.bonus)
            gates[cls] = evaluate_gate(snap, policy, snap.taken_at_s, math.inf)
        return gates, after

    def _apply(self, handle: BackendHandle, snap: BackendSnapshot, shared: Published) -> None:
        """A new snapshot, scraped here or published by the backend's scraper: its gates,
        pacing and numbers become this process's view."""
        if not handle.healthy:
            log.info("backend_healthy", backend=handle.name)
        before = handle.pacing
        handle.healthy, handle.failures, handle.last = True, 0, snap
        handle.sent_since_snapshot = 0
        handle.peak_running, handle.prefix_hit_ratio = shared.peak_running, shared.prefix_hit_ratio
        handle.max_model_len, handle.model_card_read = shared.max_model_len, shared.model_card_read
        handle.adapters, handle.lora = shared.adapters, shared.lora
        handle.gates, handle.gates_seen = dict(shared.gates), snap.taken_at_s
        if self.pacing_targets is not None:
            handle.pacing = {c: shared.pacing.get(c, p) for c, p in before.items()}
            for cls, after in handle.pacing.items():
                changed = after.allowance != before[cls].allowance
                self.metrics.record_pacing(handle.name, cls, after.allowance, after.bonus,
                                           after.reason if changed else None)
        self._record(handle, snap)
        handle.scraped.set()
        handle.judged.set()
        self.on_snapshot()

    def max_model_len(self, model: str) -> int | None:
        """The smallest context length the model's backends report (None: unknown)."""
        known = [h.max_model_len for h in self.for_model(model) if h.max_model_len]
        return min(known) if known else None

    async def _read_model_card(self, handle: BackendHandle) -> None:
        """vLLM's /v1/models names each model's ``max_model_len`` (read once) and the
        LoRA adapters loaded on it (read again every ``adapter_refresh_s`` while the
        backend shows vLLM's LoRA gauge)."""
        handle.cards_read_at = time.monotonic()
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.scrape_timeout_s)
            async with self.session.get(handle.config.url + "/v1/models",
                                        timeout=timeout) as resp:
                if resp.status != 200:
                    handle.model_card_read = True  # it has none: the context stays unknown
                    return
                cards = (await resp.json(content_type=None)).get("data") or []
        except (aiohttp.ClientError, TimeoutError):
            return  # tried again with the next scrape
        except (ValueError, AttributeError):
            cards = []  # not vLLM's format: the context stays unknown
        handle.model_card_read = True
        handle.adapters = adapters.adapters_in_cards(cards, handle.config.model)
        for card in cards:
            if isinstance(card, dict) and card.get("id") == handle.config.model:
                value = card.get("max_model_len")
                handle.max_model_len = value if isinstance(value, int) and value > 0 else None

    def unreachable(self, handle: BackendHandle, exc: BaseException) -> None:
        """A request could not connect to the backend: close its gates now, as a failed
        scrape does, instead of waiting for its snapshot to go stale."""
        self._failed(handle, exc)

    def _failed(self, handle: BackendHandle, exc: BaseException) -> None:
        self._mark_failures(handle, handle.failures + 1, repr(exc))

    def _mark_failures(self, handle: BackendHandle, failures: int, error: str) -> None:
        # a failed scrape (or connection) closes the gates at once; the next good scrape
        # opens them again
        handle.gates = dict.fromkeys(CLASS_ORDER, Gate(0, "stale"))
        handle.failures = failures
        if handle.healthy and handle.failures >= self.settings.unhealthy_after_failures:
            handle.healthy = False
            log.warning("backend_unhealthy", backend=handle.name, error=error)
        self.metrics.backend_healthy.labels(handle.name).set(1 if handle.healthy else 0)
        reason = "drained" if handle.drained else "stale"
        self.metrics.record_gates(handle.name, dict.fromkeys(CLASS_ORDER, reason), time.time())
        handle.judged.set()

    def _record(self, handle: BackendHandle, snap: BackendSnapshot) -> None:
        m, name = self.metrics, handle.name
        m.child(m.backend_waiting, name).set(snap.waiting)
        m.child(m.backend_waiting_queued, name).set(queued_for_a_slot(snap, handle.peak_running))
        m.child(m.backend_running, name).set(snap.running)
        m.child(m.backend_kv, name).set(snap.kv_usage)
        m.child(m.backend_tpot, name).set(snap.tpot_s or 0.0)
        ratio = handle.prefix_hit_ratio
        m.child(m.backend_prefix_hit_ratio, name).set(math.nan if ratio is None else ratio)
        m.child(m.backend_healthy, name).set(1)
        m.child(m.backend_drained, name).set(1 if handle.drained else 0)
        m.child(m.backend_pending_prefill, name).set(handle.pending_prefill_tokens)
        lora = handle.lora
        m.record_adapters(name, self.adapters_on(handle), lora.active if lora else (),
                          lora.max_lora if lora else None)
        gates = handle.gates_at(snap.taken_at_s, self.settings.snapshot_stale_s)
        shown = handle.shown_gates(gates, handle.pending_prefill_tokens)
        m.record_gates(name, {c: g.reason for c, g in shown.items()}, snap.taken_at_s)
