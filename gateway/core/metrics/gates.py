"""Each (backend, class) gate and its adaptive pacing, by the latest snapshot
(``gateway/backends/``)."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.core.metrics.base import SHARED, Children, MetricGroup
from policies.gates import GATE_REASONS


class GateMetrics(MetricGroup):
    def __init__(self, r: CollectorRegistry, child: Children) -> None:
        super().__init__(child)
        self._state: dict[str, tuple[float, dict[str, str | None]]] = {}
        self._pacing: dict[tuple[str, str], tuple[float, int]] = {}  # as last set
        self.closed = Counter(
            "fairgate_gate_closed_total",
            "Backend snapshots that closed a class's gate, by reason",
            ["backend", "priority_class", "reason"], registry=r)
        self.closed_time = Counter(
            "fairgate_gate_closed_seconds_total",
            "Time a class's gate to a backend was closed, by reason",
            ["backend", "priority_class", "reason"], registry=r)
        self.open = Gauge(
            "fairgate_gate_open", "1 when the class's gate to the backend is open",
            ["backend", "priority_class"], registry=r, multiprocess_mode=SHARED)
        self.reason = Gauge(
            "fairgate_gate_closed_reason",
            "1 for the reason a class's gate to the backend is closed now",
            ["backend", "priority_class", "reason"], registry=r, multiprocess_mode=SHARED)
        self.pacing_allowance = Gauge(
            "fairgate_pacing_allowance",
            "Requests of the class adaptive pacing lets wait at the backend now (at most "
            "max_waiting)", ["backend", "priority_class"], registry=r, multiprocess_mode=SHARED)
        self.pacing_free_slots = Gauge(
            "fairgate_pacing_free_slots",
            "Free batch slots the latest snapshot's burst may fill too (adaptive pacing, "
            "while nothing waits): requests sent into them start at once and do not wait",
            ["backend", "priority_class"], registry=r, multiprocess_mode=SHARED)
        self.pacing_changes = Counter(
            "fairgate_pacing_changes_total", "Changes of the pacing allowance, by reason",
            ["backend", "priority_class", "reason"], registry=r)

    def record(self, backend: str, reasons: Mapping[str, str | None], now: float) -> None:
        """Record each class's gate state; the time since the last call is charged to the
        reasons that held until now."""
        previous = self._state.get(backend)
        if previous is not None:
            elapsed = max(0.0, now - previous[0])
            for klass, reason in previous[1].items():
                if reason is not None:
                    self.child(self.closed_time, backend, klass, reason).inc(elapsed)
        self._state[backend] = (now, dict(reasons))
        for klass, reason in reasons.items():
            # the gauges change only with the reason (every process records every
            # snapshot of the fleet: hundreds a second)
            if previous is None or klass not in previous[1] or previous[1][klass] != reason:
                self.child(self.open, backend, klass).set(1 if reason is None else 0)
                for r in GATE_REASONS:
                    self.child(self.reason, backend, klass, r).set(1 if r == reason else 0)
            if reason is not None:
                self.child(self.closed, backend, klass, reason).inc()

    def record_pacing(self, backend: str, cls: str, allowance: float, free_slots: int,
                      changed_for: str | None) -> None:
        """The allowance and free slots now, and the reason the allowance just changed
        (None: unchanged)."""
        if self._pacing.get((backend, cls)) != (allowance, free_slots):  # changed: set
            self._pacing[backend, cls] = (allowance, free_slots)
            self.child(self.pacing_allowance, backend, cls).set(allowance)
            self.child(self.pacing_free_slots, backend, cls).set(free_slots)
        if changed_for is not None:
            self.child(self.pacing_changes, backend, cls, changed_for).inc()

    def forget_backend(self, backend: str) -> int:
        self._state.pop(backend, None)
        for key in [k for k in self._pacing if k[0] == backend]:
            del self._pacing[key]
        return super().forget_backend(backend)
