"""The backend pool: one scrape loop per vLLM server, snapshots stored in Redis.

A scrape that fails or times out closes this replica's gates to that backend at once and
stores nothing, so the shared snapshot goes stale and every other replica's gate closes
too; after ``unhealthy_after_failures`` in a row the backend is also marked unhealthy here.
A request that cannot connect to the backend closes its gates the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import structlog

from gateway.backends.vllm_metrics import (
    PREFIX_CACHE,
    TTFT_HISTOGRAMS,
    HistogramWindow,
    MetricsFormatError,
    parse_metrics,
)
from gateway.core.errors import StoreUnavailable
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import Backend, ReadsSettings, Settings, SettingsHolder
from gateway.core.supervise import supervise
from gateway.storage.store import BackendFit, Store
from policies.classes import CLASS_ORDER
from policies.gates import BackendSnapshot, Gate, GatePolicy, evaluate_gate, queued_for_a_slot
from policies.pacing import Pacing, PacingTargets, adjust
from policies.prefill import class_limit, fitting

log = structlog.get_logger("fairgate.backends")


@dataclass
class BackendHandle:
    config: Backend
    tpot: HistogramWindow
    ttft: HistogramWindow
    pacing: dict[str, Pacing]  # each class's allowance (adaptive pacing)
    prefix_hits: HistogramWindow  # vLLM's prefix cache: recent hits / queries (tokens)
    prefix_hit_ratio: float | None = None  # by the latest scrape (None: no recent queries)
    healthy: bool = False
    failures: int = 0
    accepts_priority: bool = True
    drained: bool = False
    last: BackendSnapshot | None = None
    sent_since_snapshot: int = 0  # this replica's dispatches since ``last``
    peak_running: int = 0  # the most requests seen running at once (the batch's size)
    pending_prefill_tokens: int = 0  # by the latest snapshot (policies/prefill.py)
    max_model_len: int | None = None  # from its /v1/models, once it is healthy
    model_card_read: bool = False
    scraped: asyncio.Event = field(default_factory=asyncio.Event)
    # each class's gate by the latest snapshot, computed once when it arrives
    gates: dict[str, Gate] = field(default_factory=lambda: dict.fromkeys(
        CLASS_ORDER, Gate(0, "stale")))
    fit: BackendFit = field(default_factory=BackendFit)  # its prompt range, prefill limits

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
        store: Store,
        metrics: GatewayMetrics,
        on_snapshot: Callable[[], None] = lambda: None,
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

    def taking(self, model: str, prompt_tokens: int) -> list[BackendHandle] | None:
        """The model's backends whose prompt range takes ``prompt_tokens``; None when
        none of them declares a range (all take it)."""
        handles = self.for_model(model)
        if not any(h.fit.prompt_range.bounded for h in handles):
            return None
        ranges = {h.name: h.fit.prompt_range for h in handles}
        names = set(fitting(ranges, prompt_tokens))
        return [h for h in handles if h.name in names]

    def any_healthy(self, model: str | None = None) -> bool:
        handles = self.for_model(model) if model else list(self.handles.values())
        return any(h.healthy for h in handles)

    async def run(self) -> None:
        for handle in self.handles.values():
            self._start(handle)
        try:
            await asyncio.Event().wait()  # until cancelled; scrape loops come and go
        finally:
            for task in self._loops.values():
                task.cancel()
            await asyncio.gather(*self._loops.values(), return_exceptions=True)

    def _start(self, handle: BackendHandle) -> None:
        loop = supervise("scrape", lambda: self._loop(handle), self.metrics.loop_restarts)
        self._loops[handle.name] = asyncio.create_task(loop, name=f"scrape-{handle.name}")

    def set_drained(self, handle: BackendHandle, drained: bool) -> None:
        handle.drained = drained
        self.metrics.backend_drained.labels(handle.name).set(1 if drained else 0)

    def reconcile(self, backends: list[Backend]) -> dict[str, list[str]]:
        """Apply a reloaded backend list: start, stop and re-point scrape loops. Requests
        already at a removed backend finish there; queues are untouched."""
        wanted = {b.name: b for b in backends}
        report: dict[str, list[str]] = {"added": [], "removed": [], "changed": []}
        for name in [n for n in self.handles if n not in wanted]:
            self.handles.pop(name)
            loop = self._loops.pop(name, None)
            if loop is not None:
                loop.cancel()
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
            report["changed" if handle is not None else "added"].append(name)
            self._start(self.handles[name])
        return report

    async def _loop(self, handle: BackendHandle) -> None:
        next_at = time.monotonic()
        while True:
            await self.scrape_once(handle)
            next_at = max(next_at + self.settings.scrape_interval_s, time.monotonic())
            await asyncio.sleep(next_at - time.monotonic())

    async def scrape_once(self, handle: BackendHandle) -> None:
        started = time.time()
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.scrape_timeout_s)
            async with self.session.get(handle.config.url + "/metrics", timeout=timeout) as resp:
                resp.raise_for_status()
                raw = parse_metrics(await resp.text())
        except (aiohttp.ClientError, TimeoutError, MetricsFormatError) as exc:
            self._failed(handle, exc)
            return
        tpot = handle.tpot.add(started, raw.sums)
        ttft = handle.ttft.add(started, raw.sums)
        prefix_hit_ratio = handle.prefix_hits.add(
            started, {} if raw.prefix_cache is None else {PREFIX_CACHE: raw.prefix_cache})
        snap = BackendSnapshot(int(raw.waiting), int(raw.running), raw.kv_usage, tpot, started)
        try:
            stored, handle.drained, pending = await self.store.store_snapshot(
                handle.config.model, handle.name, snap)
        except StoreUnavailable as exc:
            log.warning("snapshot_store_failed", backend=handle.name, error=str(exc))
            if self.settings.store_outage != "local":
                return
            stored, pending = True, 0  # degraded mode paces by this replica's scrape alone
        if not handle.healthy:
            log.info("backend_healthy", backend=handle.name)
            if handle.failures:  # it was down, perhaps restarted: its prefix cache is gone,
                # and its batch may be smaller now (learnt again from what runs)
                with contextlib.suppress(StoreUnavailable):
                    await self.store.forget_prefixes(handle.config.model, handle.name)
                handle.peak_running = 0
                handle.pacing = {c: dataclasses.replace(p, peak_running=0)
                                 for c, p in handle.pacing.items()}
        if not handle.model_card_read:
            await self._read_model_card(handle)
        handle.healthy, handle.failures, handle.last = True, 0, snap
        handle.peak_running = max(handle.peak_running, snap.running)
        handle.prefix_hit_ratio = prefix_hit_ratio
        handle.sent_since_snapshot = 0
        if stored:
            handle.pending_prefill_tokens = pending
        handle.gates = {c: evaluate_gate(snap, self._policy(handle, c, snap, ttft),
                                         snap.taken_at_s, math.inf)
                        for c in self.gate_policies}
        self._record(handle, snap)
        handle.scraped.set()
        self.on_snapshot()

    def _policy(self, handle: BackendHandle, cls: str, snap: BackendSnapshot,
                ttft_s: float | None) -> GatePolicy:
        """The class's gate policy on this backend: its batch as seen so far, and its
        ``max_waiting`` moved by adaptive pacing."""
        policy = dataclasses.replace(self.gate_policies[cls], batch=handle.peak_running)
        if self.pacing_targets is None:
            return policy
        before = handle.pacing[cls]
        after = handle.pacing[cls] = adjust(before, snap, ttft_s, self.pacing_targets[cls])
        self.metrics.record_pacing(handle.name, cls, after.allowance, after.bonus,
                                   after.reason if after.allowance != before.allowance else None)
        return dataclasses.replace(policy, max_waiting=after.max_waiting, free_slots=after.bonus)

    def max_model_len(self, model: str) -> int | None:
        """The smallest context length the model's backends report (None: unknown)."""
        known = [h.max_model_len for h in self.for_model(model) if h.max_model_len]
        return min(known) if known else None

    async def _read_model_card(self, handle: BackendHandle) -> None:
        """vLLM's /v1/models names each model's ``max_model_len``: read it once."""
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
        for card in cards:
            if isinstance(card, dict) and card.get("id") == handle.config.model:
                value = card.get("max_model_len")
                handle.max_model_len = value if isinstance(value, int) and value > 0 else None

    def unreachable(self, handle: BackendHandle, exc: BaseException) -> None:
        """A request could not connect to the backend: close its gates now, as a failed
        scrape does, instead of waiting for its snapshot to go stale."""
        self._failed(handle, exc)

    def _failed(self, handle: BackendHandle, exc: BaseException) -> None:
        # a failed scrape (or connection) closes the gates at once; the next good scrape
        # opens them again
        handle.gates = dict.fromkeys(CLASS_ORDER, Gate(0, "stale"))
        handle.failures += 1
        if handle.healthy and handle.failures >= self.settings.unhealthy_after_failures:
            handle.healthy = False
            log.warning("backend_unhealthy", backend=handle.name, error=repr(exc))
        self.metrics.backend_healthy.labels(handle.name).set(1 if handle.healthy else 0)
        reason = "drained" if handle.drained else "stale"
        self.metrics.record_gates(handle.name, dict.fromkeys(CLASS_ORDER, reason), time.time())

    def _record(self, handle: BackendHandle, snap: BackendSnapshot) -> None:
        m, name = self.metrics, handle.name
        m.backend_waiting.labels(name).set(snap.waiting)
        m.backend_waiting_queued.labels(name).set(
            queued_for_a_slot(snap, handle.peak_running))
        m.backend_running.labels(name).set(snap.running)
        m.backend_kv.labels(name).set(snap.kv_usage)
        m.backend_tpot.labels(name).set(snap.tpot_s or 0.0)
        ratio = handle.prefix_hit_ratio
        m.backend_prefix_hit_ratio.labels(name).set(math.nan if ratio is None else ratio)
        m.backend_healthy.labels(name).set(1)
        m.backend_drained.labels(name).set(1 if handle.drained else 0)
        m.backend_pending_prefill.labels(name).set(handle.pending_prefill_tokens)
        gates = handle.gates_at(snap.taken_at_s, self.settings.snapshot_stale_s)
        shown = handle.shown_gates(gates, handle.pending_prefill_tokens)
        m.record_gates(name, {c: g.reason for c, g in shown.items()}, snap.taken_at_s)
