"""The one Redis boundary: every command fairgate sends passes through this client.

Every adapter that talks to Redis (the queue store, batches, files, the admin read model)
uses the client built here, so "Redis is down" is one exception everywhere:
:class:`~gateway.core.errors.StoreUnavailable` (503 at the edge). The client also records each
command's latency and failures, and counts every command sent (pipelined ones too), a
script by its name (``gateway/storage/lua/<name>.lua``): ``fairgate_redis_commands_total``. A
pipeline is one round trip, recorded in the latency histogram as ``PIPELINE``.

With Redis Sentinel (:func:`connect_sentinel`) the client is the same boundary on a
``SentinelConnectionPool``: each new connection asks the sentinels for the master, so
after a failover the next command reaches the promoted replica; until then every command
fails as ``StoreUnavailable``.

Each command and pipeline runs in :class:`~gateway.core.waits.KeepCancel`: redis-py sends
through ``asyncio.wait_for`` once ``socket_timeout`` is set, which on Python 3.11 can
swallow the task's cancellation; the boundary raises it again. The plain and Sentinel
clients' connections send in the calling task instead (``gateway/storage/connection.py``:
no task and no loop turn per command); a Sentinel lookup and the cluster client's
connections still go through ``wait_for``.

``NoScriptError`` is let through on purpose: redis-py's script objects catch it to load
the script again (a restarted Redis, or a promoted replica, has an empty script cache).

A Redis Cluster (setting ``redis_cluster``) gets the same boundary over redis-py's
cluster client (:func:`connect_cluster`): it routes each command and script by its
first key's slot (every script's keys share one hash tag, ``gateway/storage/keys.py``),
follows MOVED and ASK itself, and after a broken connection refreshes its slot map and
tries once more, at once, before the error surfaces (a shard's failover reads as a short
outage of that shard's models, then their commands reach the promoted replica).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from importlib import resources
from typing import Any, cast

import redis
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import Connection, ConnectionPool, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    CrossSlotTransactionError,
    NoScriptError,
    RedisClusterException,
    RedisError,
)

from gateway.core.errors import StoreUnavailable
from gateway.core.metrics.redis import RedisMetrics
from gateway.core.settings import RedisCluster as RedisClusterSettings
from gateway.core.settings import RedisSentinel, addresses
from gateway.core.waits import KeepCancel
from gateway.storage import connection as connection_module
from gateway.storage.connection import (
    IN_PLACE,
    InPlaceSentinelConnection,
    InPlaceSentinelSSLConnection,
)


def script_name(text: str) -> str:
    """The ``gateway/storage/lua/<name>.lua`` a registered script's text ends with, or "?"."""
    for entry in (resources.files("gateway.storage") / "lua").iterdir():
        if entry.name.endswith(".lua") and text.endswith(entry.read_text()):
            return entry.name.removesuffix(".lua")
    return "?"


# redis-py's cluster client refuses a command or a transaction whose keys lie in several
# slots before sending it: a bug, never an outage
CROSS_SLOT = "same key slot"


def unavailable(exc: Exception) -> bool:
    """Whether a redis-py error means "the store cannot answer now" (mapped to
    :class:`StoreUnavailable`): any Redis error, and a cluster client's own (no node
    reachable, a slot no node serves during a failover); keys of several slots in one
    call are a bug and surface as they are. redis-py's cluster pipeline may also send on
    a connection another task tore down during a failover (``AttributeError`` on its
    writer, raised inside redis-py): the store going away too."""
    if isinstance(exc, RedisError) or _torn_down(exc):
        return True
    return (isinstance(exc, RedisClusterException)
            and not isinstance(exc, CrossSlotTransactionError) and CROSS_SLOT not in str(exc))


REDIS_PY = os.path.dirname(redis.__file__) + os.sep
# redis-py's connection as sent in place (connection.py): its writer may be gone too
IN_PLACE_SEND = connection_module.__file__


def _torn_down(exc: Exception) -> bool:
    if not isinstance(exc, AttributeError):
        return False
    frame = exc.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    name = "" if frame is None else frame.tb_frame.f_code.co_filename
    return name.startswith(REDIS_PY) or name == IN_PLACE_SEND


class PipelineBoundary:
    """What both pipelines (plain and cluster) add: each command counted, errors mapped,
    one round trip recorded as ``PIPELINE``."""

    metrics: RedisMetrics | None = None
    script_names: dict[str, str] = {}  # noqa: RUF012 - replaced per pipeline

    def queued(self) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    async def execute(self, raise_on_error: bool = True, *rest: Any) -> list[Any]:
        metrics = self.metrics
        if metrics is not None:
            for args in self.queued():
                metrics.count(args, self.script_names)
        started = time.perf_counter()
        try:
            with KeepCancel():  # redis-py's send swallows one on Python 3.11
                result: list[Any] = await super().execute(  # type: ignore[misc]
                    raise_on_error, *rest)
        except Exception as exc:
            if not unavailable(exc):
                raise
            raise StoreUnavailable(str(exc) or type(exc).__name__) from exc
        if metrics is not None:
            metrics.observe("PIPELINE", time.perf_counter() - started)
        return result


# (type: ignore[misc] on these classes: redis-py's own bases disagree on command_info,
# which mypy checks again for a class with two bases)
class BoundaryPipeline(PipelineBoundary, Pipeline):  # type: ignore[misc]
    def queued(self) -> list[tuple[Any, ...]]:
        return [args for args, _ in self.command_stack]


class BoundaryClusterPipeline(PipelineBoundary, ClusterPipeline):  # type: ignore[misc]
    def queued(self) -> list[tuple[Any, ...]]:
        return [cmd.args for cmd in self._execution_strategy._command_queue]  # type: ignore[attr-defined]


class CommandBoundary:
    """What both clients (plain and cluster) add to redis-py's: errors mapped once,
    commands counted by name (a script by its file's name), latency recorded."""

    metrics: RedisMetrics | None = None
    script_names: dict[str, str]  # script SHA1 → name, filled by register_script

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        metrics = self.metrics
        if metrics is not None:
            metrics.count(args, self.script_names)
        started = time.perf_counter()
        try:
            with KeepCancel():  # redis-py's send swallows one on Python 3.11
                result = await super().execute_command(*args, **options)  # type: ignore[misc]
        except NoScriptError:
            raise
        except Exception as exc:
            if not unavailable(exc):
                raise
            if metrics is not None:
                metrics.errors.labels(str(args[0]).upper() if args else "?").inc()
            raise StoreUnavailable(str(exc) or type(exc).__name__) from exc
        if metrics is not None:
            metrics.observe(args[0] if args else "?", time.perf_counter() - started)
        return result

    def register_script(self, script: Any) -> Any:
        text = script.decode() if isinstance(script, bytes) else str(script)
        names: dict[str, str] = self.__dict__.setdefault("script_names", {})
        names[hashlib.sha1(text.encode()).hexdigest()] = script_name(text)
        return super().register_script(script)  # type: ignore[misc]


class BoundaryRedis(CommandBoundary, aioredis.Redis):  # type: ignore[misc]
    """redis-py's asyncio client with errors mapped once and latency recorded."""

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        pipe = BoundaryPipeline(self.connection_pool, self.response_callbacks, transaction,
                                shard_hint)
        pipe.metrics, pipe.script_names = self.metrics, self.script_names
        return pipe

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        for sentinel in self.__dict__.get("sentinels", ()):  # connect_sentinel's
            await sentinel.aclose()


class BoundaryCluster(CommandBoundary, RedisCluster):  # type: ignore[misc]
    """redis-py's asyncio cluster client behind the same boundary. A pipeline without a
    transaction sends each node its share in one round trip; a transaction (MULTI) must
    keep to one slot, as every caller's does (one hash tag)."""

    def pipeline(self, transaction: Any | None = None,
                 shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            raise ValueError("shard_hint is not supported on a Redis Cluster")
        pipe = BoundaryClusterPipeline(self, transaction)  # type: ignore[abstract]
        pipe.metrics, pipe.script_names = self.metrics, self.script_names
        return pipe

    async def script_load(self, script: Any) -> str:
        """Load a script on every node the client knows, replicas too, each on its own:
        a script object reloads after NOSCRIPT, and redis-py would load it on the
        primaries of a slot map a failover left stale (the promoted replica, where the
        script runs next, among the replicas), so the next call found NOSCRIPT again. A
        node that cannot be reached (the dead master) is skipped."""
        results = await asyncio.gather(
            *(self.execute_command("SCRIPT LOAD", script, target_nodes=node)
              for node in self.get_nodes()), return_exceptions=True)
        if not results:  # no slot map yet
            return str(await super().script_load(script))
        for result in results:
            if isinstance(result, str):
                return result
        error = next(r for r in results if isinstance(r, BaseException))
        raise error


def _no_backoff_retry() -> Retry:
    """Once more, at once, after a broken connection only: a command that timed out
    (``socket_timeout``) may still run (a frozen server runs what it had buffered when it
    resumes), so it is not sent a second time."""
    return Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.05), 1,
                 supported_errors=(RedisConnectionError,))


def _boundary(client: aioredis.Redis, metrics: RedisMetrics | None) -> BoundaryRedis:
    boundary = cast("BoundaryRedis", client)
    boundary.metrics = metrics
    boundary.script_names = {}
    return boundary


def connect(url: str, metrics: RedisMetrics | None = None, **kwargs: Any) -> BoundaryRedis:
    """A client on ``url`` (``decode_responses`` on: fairgate stores text).

    A broken connection is retried once, at once (a server that closed an idle connection);
    then the error surfaces, as a timed-out command's does at once. redis-py's default (3
    retries, exponential backoff up to 10 s) would hide a Redis outage for seconds: queued
    clients would wait instead of getting a 503, and every loop would stall; fairgate's
    own loops back off instead."""
    kwargs.setdefault("retry", _no_backoff_retry())
    # redis-py's URL parsing, then its connection class sending in place (connection.py)
    options: dict[str, Any] = {**kwargs, "decode_responses": True, **parse_url(url)}
    kind = options.get("connection_class", Connection)
    options["connection_class"] = IN_PLACE.get(kind, kind)
    return _boundary(BoundaryRedis.from_pool(ConnectionPool(**options)), metrics)


def connect_sentinel(config: RedisSentinel, metrics: RedisMetrics | None = None,
                     **kwargs: Any) -> BoundaryRedis:
    """A client on the master the sentinels of ``config`` name, as :func:`connect`'s.

    Every new connection asks the sentinels first (``SentinelConnectionPool``): after a
    failover the next command reaches the promoted replica; between the master's death
    and the promotion commands fail (``StoreUnavailable``), which the dispatcher waits
    out (``store_failover_wait_s``). ``kwargs`` go to every connection, the sentinels'
    too (timeouts)."""
    kwargs.setdefault("retry", _no_backoff_retry())
    tls = {k: v for k, v in (("ssl_ca_certs", config.ssl_ca_certs),
                             ("ssl_certfile", config.ssl_certfile),
                             ("ssl_keyfile", config.ssl_keyfile)) if v is not None}
    to_sentinels: dict[str, Any] = {
        k: v for k, v in kwargs.items() if k.startswith("socket_")}
    to_sentinels.update(username=config.sentinel_username, password=_secret(
        config.sentinel_password), decode_responses=True)
    if config.sentinel_ssl:
        to_sentinels.update(ssl=True, **tls)
    to_master = dict(kwargs, db=config.db, username=config.username,
                     password=_secret(config.password), decode_responses=True,
                     connection_class=InPlaceSentinelConnection)
    if config.ssl:
        to_master.update(connection_class=InPlaceSentinelSSLConnection, **tls)
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        config.addresses(), sentinel_kwargs=to_sentinels)
    client = sentinel.master_for(config.master_name, redis_class=BoundaryRedis, **to_master)
    client.__dict__["sentinels"] = sentinel.sentinels
    return _boundary(client, metrics)


def _secret(value: Any) -> str | None:
    return None if value is None else str(value.get_secret_value())


def connect_cluster(config: RedisClusterSettings, metrics: RedisMetrics | None = None,
                    **kwargs: Any) -> BoundaryRedis:
    """A client on the Redis Cluster that ``config.nodes`` (``host:port`` each, any of
    its nodes) lead to; it discovers the rest, and its slot map, at the first command.

    The same retry policy as :func:`connect`: after a broken connection or a slot no node
    serves, the slot map is refreshed and the command tried once more at once; then the
    error surfaces (fairgate's loops back off; a client gets a 503). Typed as the plain
    client: the cluster client offers the same commands to every adapter."""
    kwargs.setdefault("retry", _no_backoff_retry())
    if config.username is not None:
        kwargs.setdefault("username", config.username)
    if config.password is not None:
        kwargs.setdefault("password", config.password.get_secret_value())
    seeds = [ClusterNode(host, port) for host, port in addresses(config.nodes)]
    client = BoundaryCluster(startup_nodes=seeds, decode_responses=True, ssl=config.ssl,
                             **kwargs)
    return _boundary(cast("aioredis.Redis", client), metrics)
