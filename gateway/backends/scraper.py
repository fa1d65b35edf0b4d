"""One scrape of a backend by the process that holds its lease (or scrapes for itself
while Redis is unreachable): its ``/metrics`` (and, now and then, ``/v1/models``), each
class's gate and pacing by it, the snapshot published in Redis for the others
(``gateway/backends/published.py``, ``lua/snapshot.lua``) and applied here."""

from __future__ import annotations

import contextlib
import dataclasses
import time

import aiohttp
import structlog

from gateway.backends import adapters
from gateway.backends.assess import ClassGates
from gateway.backends.handle import BackendHandle
from gateway.backends.published import Published
from gateway.backends.snapshots import Snapshots
from gateway.backends.vllm_metrics import (
    OUTPUT,
    PREFIX_CACHE,
    SERVICE,
    MetricsFormatError,
    RawMetrics,
    parse_metrics,
)
from gateway.core.errors import StoreUnavailable
from gateway.core.settings import ReadsSettings, SettingsHolder
from gateway.storage.fleet_store import FleetStore
from gateway.storage.records import Stored
from policies.gates import BackendSnapshot

log = structlog.get_logger("fairgate.backends")


class Scraper(ReadsSettings):
    def __init__(self, settings: SettingsHolder, session: aiohttp.ClientSession,
                 store: FleetStore, gates: ClassGates, snapshots: Snapshots) -> None:
        self.holder = settings
        self.session = session
        self.store = store
        self.gates = gates
        self.snapshots = snapshots

    async def scrape_once(self, handle: BackendHandle) -> None:
        started = time.time()
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.scrape_timeout_s)
            async with self.session.get(handle.config.url + "/metrics", timeout=timeout) as resp:
                resp.raise_for_status()
                raw = parse_metrics(await resp.text())
        except (aiohttp.ClientError, TimeoutError, MetricsFormatError) as exc:
            self.snapshots.failed(handle, exc)
            with contextlib.suppress(StoreUnavailable):
                handle.lease.seen = await self.store.publish_failure(
                    handle.config.model, handle.name, handle.failures)
                handle.lease.published_at = time.monotonic()
            return
        sums = _sums(raw)
        tpot, ttft, prefix_hit_ratio = handle.windows.add(started, sums)
        snap = BackendSnapshot(int(raw.waiting), int(raw.running), raw.kv_usage, tpot, started)
        # back after failures, perhaps restarted: its batch may be smaller now (learnt
        # again from what runs) and its prefix cache is gone
        recovering = not handle.healthy and handle.failures > 0
        pacing = ({c: dataclasses.replace(p, peak_running=0) for c, p in handle.pacing.items()}
                  if recovering else handle.pacing)
        peak = max(0 if recovering else handle.peak_running, snap.running)
        card = handle.card
        if not card.read or (
                raw.lora is not None and time.monotonic() - handle.lease.cards_read_at
                >= self.settings.adapter_refresh_s):
            await self._read_model_card(handle)
        gates, pacing = self.gates.assess(pacing, snap, ttft, peak)
        shared = Published(gates, pacing, peak, prefix_hit_ratio, ttft, sums,
                           card.max_model_len, card.read, card.adapters, raw.lora)
        if not await self._publish(handle, snap, shared):
            return
        if recovering:
            with contextlib.suppress(StoreUnavailable):
                await self.store.forget_prefixes(handle.config.model, handle.name)
        self.snapshots.apply(handle, snap, shared)

    async def _publish(self, handle: BackendHandle, snap: BackendSnapshot,
                       shared: Published) -> bool:
        """Store the snapshot for every process; False: Redis did not take it and this
        process does not serve alone meanwhile (``store_outage: local``)."""
        epoch = handle.drain_epoch
        try:
            stored = await self.store.store_snapshot(handle.config.model, handle.name, snap,
                                                     shared.encode())
        except StoreUnavailable as exc:
            log.warning("snapshot_store_failed", backend=handle.name, error=str(exc))
            if self.settings.store_outage != "local":
                return False
            # degraded mode: this process paces by its own scrape alone
            stored = Stored(True, handle.drained, 0, handle.lease.seen)
        else:
            handle.lease.published_at = time.monotonic()
        self.snapshots.read_drained(handle, stored.drained, epoch)
        if stored.stored:
            handle.pending_prefill_tokens, handle.lease.seen = stored.pending, stored.version
        return True

    async def _read_model_card(self, handle: BackendHandle) -> None:
        """vLLM's /v1/models names each model's ``max_model_len`` (read once) and the
        LoRA adapters loaded on it (read again every ``adapter_refresh_s`` while the
        backend shows vLLM's LoRA gauge)."""
        handle.lease.cards_read_at = time.monotonic()
        card = handle.card
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.scrape_timeout_s)
            async with self.session.get(handle.config.url + "/v1/models",
                                        timeout=timeout) as resp:
                if resp.status != 200:
                    card.read = True  # it has none: the context stays unknown
                    return
                cards = (await resp.json(content_type=None)).get("data") or []
        except (aiohttp.ClientError, TimeoutError):
            return  # tried again with the next scrape
        except (ValueError, AttributeError):
            cards = []  # not vLLM's format: the context stays unknown
        card.read = True
        card.adapters = adapters.adapters_in_cards(cards, handle.config.model)
        for entry in cards:
            if isinstance(entry, dict) and entry.get("id") == handle.config.model:
                value = entry.get("max_model_len")
                card.max_model_len = value if isinstance(value, int) and value > 0 else None


def _sums(raw: RawMetrics) -> dict[str, tuple[float, float]]:
    """The scrape's (sum, count) pairs the windows and the published snapshot carry."""
    sums = dict(raw.sums)
    if raw.prefix_cache is not None:
        sums[PREFIX_CACHE] = raw.prefix_cache
    if raw.service is not None and raw.output is not None:
        sums[SERVICE], sums[OUTPUT] = raw.service, raw.output
    return sums
