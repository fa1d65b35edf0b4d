"""Everything a request handler needs, built once per app and stored under one AppKey."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from gateway.auth import KeyRing
from gateway.backends import BackendPool
from gateway.dispatcher import Dispatcher
from gateway.observability import GatewayMetrics
from gateway.settings import Settings
from gateway.store import Store
from gateway.upstream import Upstream
from policies.fairness import ScoreRule


@dataclass(slots=True)
class Context:
    settings: Settings
    keys: KeyRing
    rule: ScoreRule
    metrics: GatewayMetrics
    store: Store
    pool: BackendPool
    dispatcher: Dispatcher
    upstream: Upstream
    replica_id: str
    redis_url: str


CONTEXT = web.AppKey("fairgate_context", Context)
