"""The one Redis boundary: every command fairgate sends passes through this client.

Every adapter that talks to Redis (the queue store, batches, files, the admin read model)
uses the client built here, so "Redis is down" is one exception everywhere:
:class:`~gateway.core.errors.StoreUnavailable` (503 at the edge). The client also records each
command's latency and failures, and counts every command sent (pipelined ones too), a
script by its name (``gateway/storage/lua/<name>.lua``): ``fairgate_redis_commands_total``. A
pipeline is one round trip, recorded in the latency histogram as ``PIPELINE``.

``NoScriptError`` is let through on purpose: redis-py's script objects catch it to load
the script again (a restarted Redis has an empty script cache).
"""

from __future__ import annotations

import hashlib
import time
from importlib import resources
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import NoScriptError, RedisError

from gateway.core.errors import StoreUnavailable
from gateway.core.metrics import RedisMetrics

# Blocking reads wait on purpose: their duration is not Redis latency.
BLOCKING_COMMANDS = frozenset({"BLPOP", "BRPOP", "BLMOVE", "BZPOPMIN", "BZPOPMAX", "XREAD"})


def script_name(text: str) -> str:
    """The ``gateway/storage/lua/<name>.lua`` a registered script's text ends with, or "?"."""
    for entry in (resources.files("gateway.storage") / "lua").iterdir():
        if entry.name.endswith(".lua") and text.endswith(entry.read_text()):
            return entry.name.removesuffix(".lua")
    return "?"


class BoundaryPipeline(Pipeline):
    metrics: RedisMetrics | None = None
    script_names: dict[str, str] = {}  # noqa: RUF012 - replaced per pipeline

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        metrics = self.metrics
        if metrics is not None:
            for args, _ in self.command_stack:
                metrics.count(args, self.script_names)
        started = time.perf_counter()
        try:
            result = await super().execute(raise_on_error)
        except RedisError as exc:
            raise StoreUnavailable(str(exc) or type(exc).__name__) from exc
        if metrics is not None:
            metrics.latency.labels("PIPELINE").observe(time.perf_counter() - started)
        return result


class BoundaryRedis(aioredis.Redis):
    """redis-py's asyncio client with errors mapped once and latency recorded."""

    metrics: RedisMetrics | None = None
    script_names: dict[str, str]  # script SHA1 → name, filled by register_script

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        command = str(args[0]).upper() if args else "?"
        if self.metrics is not None:
            self.metrics.count(args, self.script_names)
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
        pipe = BoundaryPipeline(self.connection_pool, self.response_callbacks, transaction,
                                shard_hint)
        pipe.metrics, pipe.script_names = self.metrics, self.script_names
        return pipe

    def register_script(self, script: Any) -> Any:
        text = script.decode() if isinstance(script, bytes) else str(script)
        names: dict[str, str] = self.__dict__.setdefault("script_names", {})
        names[hashlib.sha1(text.encode()).hexdigest()] = script_name(text)
        return super().register_script(script)


def connect(url: str, metrics: RedisMetrics | None = None, **kwargs: Any) -> BoundaryRedis:
    """A client on ``url`` (``decode_responses`` on: fairgate stores text).

    A broken connection is retried once, at once (a server that closed an idle connection);
    then the error surfaces. redis-py's default (3 retries, exponential backoff up to 10 s)
    would hide a Redis outage for seconds: queued clients would wait instead of getting a
    503, and every loop would stall; fairgate's own loops back off instead."""
    kwargs.setdefault("retry", Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.05), 1))
    client = cast("BoundaryRedis", BoundaryRedis.from_url(url, decode_responses=True, **kwargs))
    client.metrics = metrics
    client.script_names = {}
    return client
