"""The gateway's own Prometheus metrics (``fairgate_*``), on a registry passed in, in
groups by concern, each in its module here with the hooks that feed it: ``queue``,
``edge`` (what the client saw), ``dispatch``, ``gates`` (and pacing), ``backends``,
``adapters``, ``usage`` (per user and tenant, service shares), ``redis``, ``process``,
``moves`` (preemption, continuation), ``pools`` and ``batch``. Callers record through
``metrics.<group>.<metric or hook>``.

Several worker processes (``fairgate serve --workers N``, ``gateway/runtime/workers.py``) share
one view through prometheus_client's multiprocess mode: each worker writes its values to
files in ``PROMETHEUS_MULTIPROC_DIR`` and ``registry`` then collects every worker's files,
so a scrape through any worker sees the same totals. Counters and histograms sum across
workers (a dead worker's counts stay in the sums); the gauges are set from shared state
(queue depths read from Redis, backend scrapes every worker makes), so they report the
most recent value any live worker set (``livemostrecent``). In that mode an idle user's
per-user series are not removed (prometheus_client cannot remove a label set there); the
number of user label values is still bounded by ``metrics_top_users``.
"""

from __future__ import annotations

import warnings

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from gateway.core.metrics.adapters import AdapterMetrics
from gateway.core.metrics.backends import BackendMetrics
from gateway.core.metrics.base import Children, MetricGroup, multiprocess_dir
from gateway.core.metrics.batch import BatchMetrics
from gateway.core.metrics.dispatch import DispatchMetrics
from gateway.core.metrics.edge import EdgeMetrics
from gateway.core.metrics.gates import GateMetrics
from gateway.core.metrics.moves import MoveMetrics
from gateway.core.metrics.pools import PoolMetrics
from gateway.core.metrics.process import ProcessMetrics
from gateway.core.metrics.queue import QueueMetrics
from gateway.core.metrics.redis import RedisMetrics
from gateway.core.metrics.usage import UsageMetrics


class GatewayMetrics:
    """The groups, on one registry, sharing one cache of children (``child``)."""

    def __init__(self, registry: CollectorRegistry | None = None, top_users: int = 20,
                 user_idle_s: float = 3600.0) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.multiprocess = multiprocess_dir() is not None
        if self.multiprocess:
            # the metrics write to this process's files (their registry is never
            # scraped); the registry scraped collects every worker's files
            r = CollectorRegistry()
            MultiProcessCollector(self.registry)  # type: ignore[no-untyped-call]
            warnings.filterwarnings("ignore", "Removal of labels", UserWarning)
        self.child = child = Children()
        self.queue = QueueMetrics(r, child)
        self.usage = UsageMetrics(r, child, top_users, user_idle_s, self.multiprocess)
        self.edge = EdgeMetrics(r, child, self.usage)
        self.dispatch = DispatchMetrics(r, child, self.usage)
        self.gates = GateMetrics(r, child)
        self.backends = BackendMetrics(r, child)
        self.adapters = AdapterMetrics(r, child)
        self.redis = RedisMetrics(r, child)
        self.process = ProcessMetrics(r, child)
        self.moves = MoveMetrics(r, child)
        self.pools = PoolMetrics(r, child)
        self.batch = BatchMetrics(r, child)

    def groups(self) -> list[MetricGroup]:
        return [g for g in vars(self).values() if isinstance(g, MetricGroup)]

    def forget_backend(self, backend: str) -> int:
        """``backend`` left the list in force (``BackendPool.reconcile``): remove every
        series labelled with it, so a removed backend neither exports its last values
        forever nor keeps an alert on its last health firing, and what this process kept
        of it. The number of series removed (in multiprocess mode the workers' files keep
        theirs until the workers restart, as for idle users)."""
        return sum(group.forget_backend(backend) for group in self.groups())
