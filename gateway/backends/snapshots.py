"""A backend's snapshots, scraped here or published by its scraper, and its failures
become this process's view of it (its :class:`~gateway.backends.handle.BackendHandle`)
and its ``fairgate_backend_*``, gate and pacing series."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import structlog

from gateway.backends.assess import ClassGates
from gateway.backends.handle import BackendHandle
from gateway.backends.published import Published
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import ReadsSettings, SettingsHolder
from gateway.storage.records import snapshot_from
from policies.classes import CLASS_ORDER
from policies.gates import BackendSnapshot, Gate, queued_for_a_slot

log = structlog.get_logger("fairgate.backends")


class Snapshots(ReadsSettings):
    def __init__(self, settings: SettingsHolder, metrics: GatewayMetrics, gates: ClassGates,
                 adapters_on: Callable[[BackendHandle], frozenset[str]],
                 on_snapshot: Callable[[], None]) -> None:
        self.holder = settings
        self.metrics = metrics
        self.gates = gates
        self.adapters_on = adapters_on
        self.on_snapshot = on_snapshot

    def adopt(self, handle: BackendHandle, raw: dict[str, str]) -> None:
        """Take in what another process (or this one, before a restart) published."""
        handle.lease.seen = raw.get("v", "")
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
            handle.windows.add(snap.taken_at_s, shared.sums)
            if failures == 0:
                self.apply(handle, snap, shared)
                return
            handle.last = snap
        if failures:
            self.mark_failures(handle, failures, "published by its scraper")

    def apply(self, handle: BackendHandle, snap: BackendSnapshot, shared: Published) -> None:
        """A new snapshot, scraped here or published by the backend's scraper: its gates,
        pacing and numbers become this process's view."""
        if not handle.healthy:
            log.info("backend_healthy", backend=handle.name)
        before = handle.pacing
        handle.healthy, handle.failures, handle.last = True, 0, snap
        handle.sent_since_snapshot = 0
        handle.peak_running, handle.prefix_hit_ratio = shared.peak_running, shared.prefix_hit_ratio
        card = handle.card  # one object for the handle's life: changed in place
        card.max_model_len, card.read = shared.max_model_len, shared.model_card_read
        card.adapters, card.lora = shared.adapters, shared.lora
        handle.gates, handle.gates_seen = dict(shared.gates), snap.taken_at_s
        if self.gates.pacing_targets is not None:
            handle.pacing = {c: shared.pacing.get(c, p) for c, p in before.items()}
            for cls, after in handle.pacing.items():
                changed = after.allowance != before[cls].allowance
                self.metrics.gates.record_pacing(handle.name, cls, after.allowance,
                                                 after.bonus, after.reason if changed else None)
        self._record(handle, snap)
        handle.scraped.set()
        handle.judged.set()
        self.on_snapshot()

    def failed(self, handle: BackendHandle, exc: BaseException) -> None:
        """A scrape of the backend, or a request's connection to it, failed."""
        self.mark_failures(handle, handle.failures + 1, repr(exc))

    def mark_failures(self, handle: BackendHandle, failures: int, error: str) -> None:
        # a failed scrape (or connection) closes the gates at once; the next good scrape
        # opens them again
        handle.gates = dict.fromkeys(CLASS_ORDER, Gate(0, "stale"))
        handle.failures = failures
        if handle.healthy and handle.failures >= self.settings.fleet.unhealthy_after_failures:
            handle.healthy = False
            log.warning("backend_unhealthy", backend=handle.name, error=error)
        self.metrics.backends.healthy.labels(handle.name).set(1 if handle.healthy else 0)
        handle.recorded = None  # the next snapshot sets every gauge again
        reason = "drained" if handle.drained else "stale"
        self.metrics.gates.record(handle.name, dict.fromkeys(CLASS_ORDER, reason), time.time())
        handle.judged.set()

    def set_drained(self, handle: BackendHandle, drained: bool) -> None:
        """This process wrote the backend's drain flag to Redis: take it at once, and
        ignore the flag in any Redis answer to a call that began before."""
        handle.drain_epoch += 1
        self._show_drained(handle, drained)

    def read_drained(self, handle: BackendHandle, drained: bool, epoch: int) -> None:
        """The drain flag as Redis answered a call begun at ``epoch`` (another process's
        drain, or this one's after a restart)."""
        if epoch == handle.drain_epoch and drained != handle.drained:
            self._show_drained(handle, drained)

    def _show_drained(self, handle: BackendHandle, drained: bool) -> None:
        handle.drained = drained
        self.metrics.backends.drained.labels(handle.name).set(1 if drained else 0)
        handle.recorded = None

    def _record(self, handle: BackendHandle, snap: BackendSnapshot) -> None:
        m, name = self.metrics, handle.name
        ratio = handle.prefix_hit_ratio
        values = (snap.waiting, queued_for_a_slot(snap, handle.peak_running), snap.running,
                  snap.kv_usage, snap.tpot_s or 0.0, math.nan if ratio is None else ratio,
                  handle.drained, handle.pending_prefill_tokens)
        # every process adopts every snapshot (a fleet's: hundreds a second): the gauges
        # are set only when a value changed since this process last set them
        if values != handle.recorded:
            handle.recorded = values
            b = m.backends
            for gauge, value in zip((b.waiting, b.waiting_queued, b.running, b.kv, b.tpot,
                                     b.prefix_hit_ratio), values, strict=False):
                m.child(gauge, name).set(value)
            m.child(b.healthy, name).set(1)
            m.child(b.drained, name).set(1 if handle.drained else 0)
            m.child(b.pending_prefill, name).set(handle.pending_prefill_tokens)
        lora = handle.card.lora
        m.adapters.record(name, self.adapters_on(handle), lora.active if lora else (),
                          lora.max_lora if lora else None)
        gates = handle.gates_at(snap.taken_at_s, self.settings.fleet.snapshot_stale_s)
        shown = handle.shown_gates(gates, handle.pending_prefill_tokens)
        m.gates.record(name, {c: g.reason for c, g in shown.items()}, snap.taken_at_s)
