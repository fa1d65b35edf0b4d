"""``tenants``: hierarchical fair share, the fairness benchmark's tenants scenario
(:func:`loadtest.bench.fairness.run_tenants`)."""

from __future__ import annotations

from loadtest.bench.fairness import run_tenants as run

__all__ = ["run"]
