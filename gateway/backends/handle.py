"""One backend as this process sees it (:class:`BackendHandle`), in parts by who writes
them: the view of its latest snapshot (the handle's own fields: written when a snapshot
is applied or a scrape fails, read by every dispatch decision), what its model card says
(:class:`ModelCard`), this process's scraping of it (:class:`ScrapeLease`: the lease tick
and the scrape loop) and vLLM's counters over recent scrapes (:class:`MetricWindows`: each
scrape, or each snapshot published)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from gateway.backends.vllm_metrics import (
    OUTPUT,
    PREFIX_CACHE,
    TTFT_HISTOGRAMS,
    HistogramWindow,
    LoraState,
)
from gateway.core.settings import Backend
from gateway.storage.records import BackendFit, BackendState
from policies.classes import CLASS_ORDER
from policies.gates import BackendSnapshot, Gate
from policies.pacing import Pacing

SERVICE_WINDOW_S = 30.0
"""A backend's service rate (``MetricWindows.service``) is measured over this window."""


@dataclass
class MetricWindows:
    """vLLM's histograms and counters over recent scrapes: the scraper adds each scrape,
    every process each snapshot published (their sums)."""

    tpot: HistogramWindow
    ttft: HistogramWindow
    prefix_hits: HistogramWindow  # vLLM's prefix cache: recent hits / queries (tokens)
    # vLLM's token and request counters (SERVICE, OUTPUT pairs): the service rate and the
    # output tokens per request
    service: HistogramWindow

    @classmethod
    def over(cls, window_s: float) -> MetricWindows:
        """Windows of ``window_s`` (the TPOT window; the service rate's is fixed)."""
        return cls(HistogramWindow(window_s), HistogramWindow(window_s, TTFT_HISTOGRAMS),
                   HistogramWindow(window_s, (PREFIX_CACHE,)),
                   HistogramWindow(SERVICE_WINDOW_S, (OUTPUT,)))

    def resize(self, window_s: float) -> None:
        """A new TPOT window (a reload): the samples kept span it from the next scrape."""
        for window in (self.tpot, self.ttft, self.prefix_hits):
            window.window_s = window_s

    def add(self, at_s: float, sums: dict[str, tuple[float, float]]
            ) -> tuple[float | None, float | None, float | None]:
        """One scrape's sums: (mean TPOT, mean TTFT, prefix hit ratio) over the windows."""
        self.service.add(at_s, sums)
        return (self.tpot.add(at_s, sums), self.ttft.add(at_s, sums),
                self.prefix_hits.add(at_s, sums))


@dataclass
class ScrapeLease:
    """This process's scraping of the backend: written by the lease tick and the scrape
    loop (``gateway/backends/leases.py``, ``scraper.py``)."""

    held: bool = False  # this process holds its scrape lease: scrapes it and publishes
    held_since: float = 0.0  # monotonic s
    published_at: float = 0.0  # monotonic s of this process's last publication
    seen: str = ""  # the version of its published snapshot this process read last
    busy: bool = True  # scraped at the configured interval (False: the idle one)
    active_at: float = field(default_factory=time.monotonic)  # monotonic s: work last seen
    dispatches: int = 0  # its dispatch counter (all replicas) as this process read it last
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # lease taken, or work came
    cards_read_at: float = 0.0  # monotonic s of the scraper's last /v1/models read


@dataclass
class ModelCard:
    """What the backend's ``/v1/models`` and vLLM's LoRA gauge say: written by its
    scraper's read of ``/v1/models`` and by each snapshot applied."""

    max_model_len: int | None = None  # from its /v1/models, once it is healthy
    read: bool = False  # /v1/models was read (or the backend has none)
    adapters: tuple[str, ...] = ()  # the LoRA adapters its /v1/models lists
    lora: LoraState | None = None  # its vllm:lora_requests_info (None: LoRA off)


@dataclass
class BackendHandle:
    config: Backend
    windows: MetricWindows
    pacing: dict[str, Pacing]  # each class's allowance (adaptive pacing)
    lease: ScrapeLease = field(default_factory=ScrapeLease)
    prefix_hit_ratio: float | None = None  # by the latest scrape (None: no recent queries)
    healthy: bool = False
    failures: int = 0
    accepts_priority: bool = True  # written by the upstream (a backend that refuses it)
    drained: bool = False
    # bumped by each drain/undrain this process writes: a drain flag read from Redis by a
    # call that began before it is older than it and is not taken
    drain_epoch: int = 0
    last: BackendSnapshot | None = None
    sent_since_snapshot: int = 0  # this replica's dispatches since ``last`` (dispatcher)
    peak_running: int = 0  # the most requests seen running at once (the batch's size)
    pending_prefill_tokens: int = 0  # by the latest snapshot (policies/prefill.py)
    card: ModelCard = field(default_factory=ModelCard)
    # the backend gauges' values as this process last set them from a snapshot (None: to
    # set again): ``Snapshots._record`` sets them only when one changed
    recorded: tuple[object, ...] | None = None
    scraped: asyncio.Event = field(default_factory=asyncio.Event)
    judged: asyncio.Event = field(default_factory=asyncio.Event)  # scraped, or failed, once
    # each class's gate by the latest snapshot, computed once when it arrives, and that
    # snapshot's taken_at (unix s; None: none yet): a decision by them counts what was sent
    # since it (gate_counts in gateway/storage/lua/_lib.lua)
    gates: dict[str, Gate] = field(default_factory=lambda: dict.fromkeys(
        CLASS_ORDER, Gate(0, "stale")))
    gates_seen: float | None = None
    fit: BackendFit = field(default_factory=BackendFit)  # its prompt range, prefill limits
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
