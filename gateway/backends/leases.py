"""Who scrapes each backend, and when: the scrape leases in Redis (``lua/scrapers.lua``)
and each backend's scrape loop in the process that holds its lease.

Every process, the holder too, renews or takes its leases and reads what was published
since its last look in one call per model and tick (every ``scrape_interval_s``). The
leases are spread over the processes: each holds at most ceil(backends / processes that
ticked within a lease length), so no replica scrapes for all while the others only read.
A process dies: its leases expire (``lease_s``: three intervals, at least
:data:`LEASE_FLOOR_S`) and the next tick of another takes them. A holder that stops
publishing (its scrapes hang) gives its lease up.

The holder scrapes every ``scrape_interval_s`` while the backend is busy (requests run,
wait or are in flight there, were dispatched to it by any replica, or are queued for its
model), every idle interval once none of that was seen for a whole idle interval; an
enqueue brings it back at once (:meth:`ScrapeLeases.hurry`, or the next tick elsewhere).
Requests that end between two ticks leave no in-flight count to see: the backend's
dispatch counter, moved by every replica's dispatches, stands for them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import structlog

from gateway.backends.handle import BackendHandle
from gateway.backends.scraper import Scraper
from gateway.backends.snapshots import Snapshots
from gateway.core.errors import StoreUnavailable
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import ReadsSettings, SettingsHolder
from gateway.core.waits import event_set
from gateway.storage.fleet_store import FleetStore
from gateway.storage.records import LeaseWish, ScrapeView

log = structlog.get_logger("fairgate.backends")

LEASE_FLOOR_S = 0.5
"""A scrape lease lasts three scrape intervals, never less than this: a holder's tick
that runs late on a loaded machine must not hand its backends to another process."""


class ScrapeLeases(ReadsSettings):
    def __init__(self, settings: SettingsHolder, store: FleetStore, metrics: GatewayMetrics,
                 handles: dict[str, BackendHandle], scraper: Scraper, snapshots: Snapshots,
                 scraper_id: str) -> None:
        self.holder = settings
        self.store = store
        self.metrics = metrics
        self.handles = handles  # the pool's: every backend in force
        self.scraper = scraper
        self.snapshots = snapshots
        self.scraper_id = scraper_id  # this process, as its scrape leases name it
        self._down: set[str] = set()  # models whose leases the store did not answer

    @property
    def lease_s(self) -> float:
        return max(3 * self.settings.scrape_interval_s, LEASE_FLOOR_S)

    @property
    def idle_interval_s(self) -> float:
        """The scrape interval of an idle backend: never more than half the staleness
        bound (its snapshot must not close its gates between two scrapes)."""
        s = self.settings
        return max(s.scrape_interval_s, min(s.idle_scrape_interval_s, s.snapshot_stale_s / 2))

    async def ticks(self) -> None:
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
            lease = h.lease
            keeps = not lease.held or now - max(lease.held_since, lease.published_at) < yield_s
            if not keeps:
                log.warning("scrape_lease_given_up", backend=h.name, silent_s=yield_s)
            wanted.setdefault(h.config.model, []).append(LeaseWish(h.name, keeps, lease.seen))
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
        if self.alone(model):  # degraded mode: every process scrapes for itself
            for h in handles:
                if h.config.model == model:
                    h.lease.wake.set()

    def alone(self, model: str) -> bool:
        """Scraping ``model``'s backends for this process only: the store is unreachable
        for it and ``store_outage: local`` serves on (no lease, no published snapshot
        meanwhile)."""
        return model in self._down and self.settings.store_outage == "local"

    async def give_up(self) -> None:
        """On the way out: the leases this process holds go to the next tick of another."""
        wanted: dict[str, list[LeaseWish]] = {}
        for h in self.handles.values():
            if h.lease.held:
                wanted.setdefault(h.config.model, []).append(
                    LeaseWish(h.name, False, h.lease.seen))
        if wanted:
            await self.store.scrape_leases(self.scraper_id, self.lease_s, wanted)

    def _take_view(self, handle: BackendHandle, view: ScrapeView, queued: bool,
                   now: float, epoch: int) -> None:
        lease = handle.lease
        if view.held != lease.held:
            lease.held, lease.held_since = view.held, now
            log.info("scrape_lease_taken" if view.held else "scrape_lease_lost",
                     backend=handle.name, scraper=self.scraper_id)
            self.metrics.backends.scraping.labels(handle.name).set(1 if view.held else 0)
            if view.held:
                lease.wake.set()  # scrape now
        self.snapshots.read_drained(handle, view.drained, epoch)
        handle.pending_prefill_tokens = view.pending_prefill_tokens
        if view.published is not None:
            self.snapshots.adopt(handle, view.published)
        last = handle.last
        came, lease.dispatches = view.dispatches != lease.dispatches, view.dispatches
        self._note_work(handle, now, queued or came or view.inflight > 0
                        or (last is not None and last.running + last.waiting > 0))

    def _note_work(self, handle: BackendHandle, now: float, seen: bool) -> None:
        """Busy while work was seen within an idle interval: requests that each end
        between two looks must not make a backend that serves a steady stream look
        idle."""
        lease = handle.lease
        if seen:
            lease.active_at = now
        busy = now - lease.active_at < self.idle_interval_s
        if busy and not lease.busy and lease.held:
            lease.wake.set()  # back to the fast interval at once
        lease.busy = busy

    def hurry(self, model: str) -> None:
        """Work was queued for ``model``: its idle backends this process scrapes are
        scraped now and at the fast interval (elsewhere the next tick tells their
        scrapers)."""
        now = time.monotonic()
        for h in self.handles.values():
            if h.config.model == model:
                self._note_work(h, now, True)

    async def scrape_loop(self, handle: BackendHandle) -> None:
        """Scrape the backend while this process holds its lease (or Redis is down and
        each process serves alone), at the fast interval while it is busy, at the idle
        one otherwise; wait for the lease while another process holds it.

        Each wake-up is taken once, whether it scrapes or not: one that came while this
        process held the lease, and stays set after it lost it (given up under load, or a
        Redis outage ended), would otherwise return at once from every wait without ever
        suspending, and the whole event loop would spin here. One that comes during a
        scrape stays set for the next turn: scraped again at once."""
        lease = handle.lease
        while True:
            delay = None
            if lease.held or self.alone(handle.config.model):
                started = time.monotonic()
                await self.scraper.scrape_once(handle)
                interval = (self.settings.scrape_interval_s if lease.busy
                            else self.idle_interval_s)
                delay = max(0.0, started + interval - time.monotonic())
            await event_set(lease.wake, delay)
            lease.wake.clear()
