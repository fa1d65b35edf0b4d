"""The one Redis boundary: every command fairgate sends passes through this client.

Every adapter that talks to Redis (the queue store, batches, files, the admin read model)
uses the client built here, so "Redis is down" is one exception everywhere:
:class:`~gateway.errors.StoreUnavailable` (503 at the edge). The client also records each
command's latency and failures.

``NoScriptError`` is let through on purpose: redis-py's script objects catch it to load
the script again (a restarted Redis has an empty script cache).
"""

from __future__ import annotations

import time
from typing import Any, cast

import redis.asyncio as aioredis
from prometheus_client import Counter, Histogram
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import NoScriptError, RedisError

from gateway.errors import StoreUnavailable

# Blocking reads wait on purpose: their duration is not Redis latency.
BLOCKING_COMMANDS = frozenset({"BLPOP", "BRPOP", "BLMOVE", "BZPOPMIN", "BZPOPMAX", "XREAD"})


class RedisMetrics:
    """Where the boundary reports (owned by :class:`~gateway.metrics.GatewayMetrics`)."""

    def __init__(self, latency: Histogram, errors: Counter) -> None:
        self.latency = latency
        self.errors = errors


class BoundaryPipeline(Pipeline):
    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        try:
            return await super().execute(raise_on_error)
        except RedisError as exc:
            raise StoreUnavailable(str(exc) or type(exc).__name__) from exc


class BoundaryRedis(aioredis.Redis):
    """redis-py's asyncio client with errors mapped once and latency recorded."""

    metrics: RedisMetrics | None = None

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        command = str(args[0]).upper() if args else "?"
        started = time.perf_counter()
        try:
            result = await super().execute_command(  # type: ignore[no-untyped-call]
                *args, **options)
        except NoScriptError:
            raise
        except RedisError as exc:
            if self.metrics is not None:
                self.metrics.errors.labels(command).inc()
            raise StoreUnavailable(str(exc) or type(exc).__name__) from exc
        if self.metrics is not None and command not in BLOCKING_COMMANDS:
            self.metrics.latency.labels(command).observe(time.perf_counter() - started)
        return result

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        return BoundaryPipeline(self.connection_pool, self.response_callbacks, transaction,
                                shard_hint)


def connect(url: str, metrics: RedisMetrics | None = None, **kwargs: Any) -> BoundaryRedis:
    """A client on ``url`` (``decode_responses`` on: fairgate stores text).

    A broken connection is retried once, at once (a server that closed an idle connection);
    then the error surfaces. redis-py's default (3 retries, exponential backoff up to 10 s)
    would hide a Redis outage for seconds: queued clients would wait instead of getting a
    503, and every loop would stall; fairgate's own loops back off instead."""
    kwargs.setdefault("retry", Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.05), 1))
    client = cast("BoundaryRedis", BoundaryRedis.from_url(url, decode_responses=True, **kwargs))
    client.metrics = metrics
    return client
