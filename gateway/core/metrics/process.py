"""This process's health: its event loop's lag (``gateway/core/loop_lag.py``) and the
background loops restarted after a crash (``gateway/core/supervise.py``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.core.metrics.base import Children, MetricGroup

LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ProcessMetrics(MetricGroup):
    def __init__(self, r: CollectorRegistry, child: Children) -> None:
        super().__init__(child)
        self.loop_lag = Histogram(
            "fairgate_event_loop_lag_seconds",
            "How late this process's event loop ran a timer (gateway/core/loop_lag.py): a "
            "busy loop delays every request it serves by as much",
            buckets=LOOP_LAG_BUCKETS, registry=r)
        self.loop_restarts = Counter(
            "fairgate_loop_restarts_total",
            "Background loops restarted after a crash (dispatch, listen, heartbeat, scrape, "
            "batch, history, quotas, migrate, pools)", ["loop"], registry=r)
