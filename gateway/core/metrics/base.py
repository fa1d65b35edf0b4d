"""What every group of the gateway's metrics shares: buckets, the multiprocess mode of
shared gauges, and the cache of each metric's children by label set."""

from __future__ import annotations

import os
from typing import Any, Final

from prometheus_client.metrics import MetricWrapperBase

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
SHARED: Final = "livemostrecent"
"""Multiprocess mode of a gauge set from state every worker sees alike."""


def multiprocess_dir() -> str | None:
    """The directory workers share their metrics through, or None (one process)."""
    return os.environ.get(MULTIPROC_DIR_ENV) or None


class Children:
    """``metric.labels(*labels)``, resolved once per label set: labels() costs more than
    inc() or set(). The request path's and the snapshots' children; a removed label set
    leaves here too (:meth:`remove`). One per :class:`~gateway.core.metrics.GatewayMetrics`,
    shared by its groups."""

    def __init__(self) -> None:
        self._found: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def __call__(self, metric: Any, *labels: str) -> Any:
        key = (metric, labels)
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = metric.labels(*labels)
        return found

    def remove(self, metric: Any, labels: tuple[str, ...]) -> None:
        self._found.pop((metric, labels), None)
        metric.remove(*labels)


class MetricGroup:
    """One concern's metrics (its attributes), declared on the registry given."""

    def __init__(self, child: Children) -> None:
        self.child = child

    def declared(self) -> list[MetricWrapperBase]:
        return [m for m in vars(self).values() if isinstance(m, MetricWrapperBase)]

    def forget_backend(self, backend: str) -> int:
        """Remove every series of this group labelled with ``backend`` (and, in a group
        that keeps some, what it kept of it). The number of series removed."""
        removed = 0
        for metric in self.declared():
            names: tuple[str, ...] = metric._labelnames  # prometheus_client: no public getter
            if "backend" not in names:
                continue
            at = names.index("backend")
            for labels in [k for k in list(metric._metrics) if k[at] == backend]:
                self.child.remove(metric, tuple(labels))
                removed += 1
        return removed
