"""The composition root: every service of one gateway process, built here and only here.

:func:`running_services` builds the services into one typed :class:`Services` object,
starts the long-lived loops (each supervised: scrape, dispatch, heartbeat, listen, batch,
history, migrate, pools, backends, discovery)
and stops them on exit. Handlers read what they need from it; nothing else constructs a
service.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from gateway.access.auth import KeyRing
from gateway.access.keyring import RuntimeKeys
from gateway.access.sessions import SessionStore
from gateway.backends.assess import ClassGates
from gateway.backends.discovery import DnsDiscovery
from gateway.backends.handle import BackendHandle
from gateway.backends.leases import ScrapeLeases
from gateway.backends.registry import BackendList
from gateway.backends.scrape import AdapterNotes, BackendPool, PoolParts
from gateway.backends.scraper import Scraper
from gateway.backends.snapshots import Snapshots
from gateway.batch.files import FileStore
from gateway.batch.records import BatchStore
from gateway.batch.results import BatchResults
from gateway.batch.runner import BatchRunner
from gateway.core import loop_lag
from gateway.core.errors import StoreUnavailable
from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import ApiKey, Settings, SettingsHolder
from gateway.core.supervise import supervise
from gateway.ops.history import History
from gateway.ops.pools import PoolWatch
from gateway.ops.read_model import Inspector
from gateway.proxy.upstream import Upstream
from gateway.scheduling.adapter_loads import AdapterLoads
from gateway.scheduling.admission import Admission, AdmissionParts
from gateway.scheduling.charging import Charging
from gateway.scheduling.continuations import Continuations
from gateway.scheduling.decision import Planner
from gateway.scheduling.dispatch_loop import DispatchLoop
from gateway.scheduling.dispatcher import Dispatcher, DispatchParts
from gateway.scheduling.grants import Signals, Waiters
from gateway.scheduling.held_starts import HeldStarts
from gateway.scheduling.local import LocalScheduler
from gateway.scheduling.migrate import Migrations
from gateway.scheduling.outage import StoreOutage
from gateway.scheduling.placement import GrantedBackends, Placement
from gateway.scheduling.preemption import Preemptor
from gateway.scheduling.quotas import Quotas
from gateway.scheduling.replicas import ReplicaProtocol
from gateway.scheduling.running import RunningStreams
from gateway.scheduling.settles import Settles
from gateway.scheduling.usage import UsageLedger
from gateway.scheduling.waits import Waits
from gateway.storage.embedded_redis import EmbeddedRedis
from gateway.storage.fleet_store import FleetStore
from gateway.storage.redis_client import (
    BoundaryRedis,
    connect,
    connect_cluster,
    connect_sentinel,
)
from gateway.storage.store import Store
from gateway.storage.store_version import check_store_version
from policies.cost import TokenCost
from policies.fairness import FairnessPolicy, policy_for

log = structlog.get_logger("fairgate.app")

SHUTDOWN_WAIT_S = 5.0


@dataclass(slots=True)
class Services:
    # the settings in force; a reload swaps them (gateway/http/admin/reload.py)
    config: SettingsHolder
    keys: KeyRing  # rebuilt by a reload
    policy: FairnessPolicy
    metrics: GatewayMetrics
    store: Store
    pool: BackendPool
    backends: BackendList  # the backend list in force: configured, admin, dns
    dispatcher: Dispatcher
    admission: Admission
    running: RunningStreams  # this process's dispatched, unsettled requests
    quotas: Quotas
    usage: UsageLedger
    upstream: Upstream
    files: FileStore
    batches: BatchStore
    batch_runner: BatchRunner
    inspector: Inspector
    sessions: SessionStore
    replica_id: str
    redis_url: str  # where the store is (a URL, or the Sentinel master's name and nodes)
    pools: PoolWatch  # each pool's demand, capacity and desired replicas
    started_at: int  # unix seconds: the ``created`` of the models this gateway lists

    @property
    def settings(self) -> Settings:
        return self.config.current


def request_ttl_s(settings: Settings) -> float:
    """How long a request's hash outlives its longest possible queue wait and answer."""
    longest_wait = max(c.max_queue_wait_s for c in settings.classes.values())
    return longest_wait + settings.upstream.upstream_timeout_s + 60


def fairness_policy(settings: Settings) -> FairnessPolicy:
    fairness = settings.fairness
    return policy_for(fairness.policy, TokenCost(
        fairness.vtc_input_weight, fairness.vtc_output_weight, fairness.vtc_kv_weight))


def build_pool(config: SettingsHolder, session: aiohttp.ClientSession, fleet: FleetStore,
               metrics: GatewayMetrics, on_snapshot: Callable[[], None] = lambda: None, *,
               scraper_id: str | None = None) -> BackendPool:
    """The backend pool and its parts (``gateway/backends/scrape.py``) over one dict of
    handles, which the pool fills. ``on_snapshot``: called when a snapshot is taken in
    (gates may have opened); ``scraper_id``: this process, as its scrape leases name it."""
    handles: dict[str, BackendHandle] = {}
    classes = ClassGates(config.current)
    notes = AdapterNotes(config, handles)
    snapshots = Snapshots(config, metrics, classes, notes.adapters_on, on_snapshot)
    scraper = Scraper(config, session, fleet, classes, snapshots)
    leases = ScrapeLeases(
        config, fleet, metrics, handles, scraper, snapshots,
        scraper_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}")
    return BackendPool(config, session, metrics,
                       PoolParts(handles, classes, notes, snapshots, scraper, leases))


def build_dispatcher(config: SettingsHolder, store: Store, pool: BackendPool,
                     metrics: GatewayMetrics, replica_id: str,
                     signals: Signals | None = None,
                     streams: RunningStreams | None = None) -> Dispatcher:
    """The dispatcher and its parts (``gateway/scheduling/dispatcher.py``), each given the
    parts below it. ``signals``: the dispatch loop's wake-up, which the backend pool
    built before it also rings; ``streams``: this process's running answers, which
    preemption orders move."""
    signals = signals if signals is not None else Signals()
    preemptor = Preemptor(config, store.preempts, pool, metrics, streams)
    waiters = Waiters(replica_id)
    # store_outage "local": this replica's own queues while Redis is unreachable
    local = LocalScheduler(pool, replica_id)
    outage = StoreOutage(config, store.queue, metrics, local, waiters, signals)
    planner = Planner(config, store.reads, pool, metrics, replica_id, preemptor, waiters, signals)
    starts = HeldStarts(store.queue, planner, signals)
    settles = Settles(store, local, waiters, starts, planner, signals)
    loop = DispatchLoop(store.queue, planner, starts, settles, preemptor, outage, signals)
    replicas = ReplicaProtocol(config, store, replica_id, waiters, settles, outage, local,
                               preemptor, signals)
    return Dispatcher(config, store, pool, metrics, DispatchParts(
        signals, waiters, local, outage, planner, starts, settles, loop, replicas, preemptor))


def build_admission(config: SettingsHolder, dispatcher: Dispatcher, pool: BackendPool,
                    policy: FairnessPolicy, metrics: GatewayMetrics, replica_id: str,
                    quotas: Quotas | None = None, usage: UsageLedger | None = None,
                    running: RunningStreams | None = None,
                    learn_backend: Callable[[str], Awaitable[bool]] | None = None
                    ) -> Admission:
    """Admission and its parts (``gateway/scheduling/admission.py``). ``running``: this
    process's running answers (a list of its own when not given); ``learn_backend``: reads
    the backend list in force again for a backend a grant names that this process does
    not know yet."""
    running = (running if running is not None
               else RunningStreams(lambda: config.current.upstream.max_moves))
    waits = Waits(config, dispatcher.store.reads)
    adapter_loads = AdapterLoads(config, pool, dispatcher.store.adapters, metrics, replica_id)
    backends = GrantedBackends(pool, learn_backend)
    parts = AdmissionParts(
        waits, adapter_loads, Placement(config, dispatcher, pool, waits, adapter_loads, metrics),
        Charging(config, dispatcher, policy, metrics, quotas, usage),
        Continuations(config, dispatcher, pool, metrics, backends.named), backends)
    return Admission(config, dispatcher, pool, policy, metrics, replica_id, running, parts)


def store_client(settings: Settings, metrics: GatewayMetrics,
                 stack: contextlib.AsyncExitStack) -> tuple[BoundaryRedis, str]:
    """The client of the configured store (an embedded Valkey when none is) and where it
    is, for the logs."""
    options: dict[str, Any] = {"socket_connect_timeout": 2, "health_check_interval": 10,
                               "socket_timeout": settings.store.redis_socket_timeout_s}
    if settings.store.redis_sentinel is not None:
        sentinel = settings.store.redis_sentinel
        where = f"sentinel:{sentinel.master_name}@{','.join(sentinel.nodes)}"
        return connect_sentinel(sentinel, metrics.redis, **options), where
    if settings.store.redis_cluster is not None:
        cluster = settings.store.redis_cluster
        return (connect_cluster(cluster, metrics.redis, socket_connect_timeout=2,
                                socket_timeout=settings.store.redis_socket_timeout_s),
                "cluster:" + ",".join(cluster.nodes))
    redis_url = settings.store.redis_url
    if redis_url is None:
        embedded = EmbeddedRedis(data_dir=None).start()
        stack.callback(embedded.stop)
        redis_url = embedded.url
        log.info("embedded_redis_started", url=redis_url)
    return connect(redis_url, metrics.redis, **options), redis_url


def start_loops(svc: Services) -> list[asyncio.Task[None]]:
    """The long-lived loops of these services, each supervised (restarted after a crash;
    the scrape and dispatch loops supervise their own)."""
    restarts = svc.metrics.process.loop_restarts

    def loop(name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        return asyncio.create_task(supervise(name, run, restarts), name=name)

    return [asyncio.create_task(svc.pool.run(), name="scrape"),
            asyncio.create_task(svc.dispatcher.run(), name="dispatch"),
            loop("batch", svc.batch_runner.run),
            loop("quotas", svc.quotas.run),
            loop("adapters", svc.admission.adapter_loads.run),
            loop("migrate", Migrations(svc.store.fleet, svc.pool, svc.running).run),
            loop("history", svc.inspector.history.run),
            loop("pools", svc.pools.run),
            loop("backends", svc.backends.run),
            loop("discovery", DnsDiscovery(svc.config, svc.backends).run),
            loop("loop_lag", functools.partial(loop_lag.watch, svc.metrics.process.loop_lag))]


async def connections(settings: Settings, metrics: GatewayMetrics,
                      stack: contextlib.AsyncExitStack
                      ) -> tuple[BoundaryRedis, str, aiohttp.ClientSession]:
    """The store's client (its version checked) and where it is, and the HTTP session to
    the backends; both closed by ``stack``."""
    client, redis_url = store_client(settings, metrics, stack)
    stack.push_async_callback(client.aclose)
    await check_store_version(client, redis_url)  # StoreTooOld: `fairgate serve` exits 2
    # vLLM's uvicorn drops idle keep-alive connections after 5 s; reusing one at
    # that moment fails a request, so ours expire first
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
        limit=0, keepalive_timeout=settings.upstream.upstream_keepalive_s))
    stack.push_async_callback(session.close)
    return client, redis_url, session


def build_services(settings: Settings, metrics: GatewayMetrics, client: BoundaryRedis,
                   redis_url: str, session: aiohttp.ClientSession) -> Services:
    """Every service over the store's client and the backends' session, each given what it
    depends on."""
    replica_id = settings.replicas.replica_id or uuid.uuid4().hex[:12]
    policy = fairness_policy(settings)
    config = SettingsHolder(settings)  # the one copy every collaborator reads
    store = Store.over(client, lambda: request_ttl_s(config.current), settings.fleet_models())
    signals = Signals()  # the dispatch loop's wake-up
    pool = build_pool(config, session, store.fleet, metrics,
                      on_snapshot=signals.wake_freed)  # gates may have opened
    running = RunningStreams(lambda: config.current.upstream.max_moves)
    # preemption orders move this process's running answers
    dispatcher = build_dispatcher(config, store, pool, metrics, replica_id, signals, running)
    quotas = Quotas(client, config)
    usage = UsageLedger(client, settings.access.usage_retention_days,
                        lambda: config.current.models())
    backends = BackendList(client, config, pool, store.fleet)
    admission = build_admission(config, dispatcher, pool, policy, metrics, replica_id,
                                quotas, usage, running,
                                learn_backend=backends.learn)  # a grant for one added elsewhere
    upstream = Upstream(session, settings.upstream.upstream_timeout_s,
                        settings.upstream.max_request_s,
                        lambda: config.current.upstream.stream_idle_timeout_s)
    files = FileStore(client, settings.store.data_dir / "files", settings.batch.max_file_bytes)
    batches = BatchStore(client)

    async def account_of(key_id: str) -> ApiKey | None:
        # the key ring in force: a reload replaces services.keys
        return await services.keys.find(key_id)

    runner = BatchRunner(config, admission, upstream, files, batches,
                         BatchResults(files, batches), metrics, replica_id, account_of)
    keyring = KeyRing(settings.api_keys, settings.admin_keys, RuntimeKeys(client, config))
    history = History(config, store, metrics, pool)
    services = Services(
        config, keyring, policy, metrics, store,
        pool, backends, dispatcher, admission, running, quotas, usage, upstream, files,
        batches, runner, Inspector(config, store, pool, metrics, replica_id, history, running),
        SessionStore(client, settings.access.session_ttl_s), replica_id, redis_url,
        pools=PoolWatch(config, store.reads, pool, admission.waits, metrics, batches.backlog),
        started_at=int(time.time()))
    return services


async def first_reads(svc: Services) -> None:
    """What the services read from the store before the first request (an unreachable
    store: their loops read it later)."""
    with contextlib.suppress(StoreUnavailable):  # else the backends loop reads it
        await svc.backends.refresh()  # the runtime backends, before the first request
    if svc.keys.runtime is not None:
        with contextlib.suppress(StoreUnavailable):  # else at the first key lookup
            await svc.keys.runtime.settle_pepper()  # said in the log at start


async def stop_loops(svc: Services, tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the loops, stop the batch runner, and wait for the loops a while."""
    for task in tasks:
        task.cancel()
    await svc.batch_runner.stop()
    # bounded: a library that swallows a cancellation must not hang shutdown
    _, stuck = await asyncio.wait(tasks, timeout=SHUTDOWN_WAIT_S)
    if stuck:  # a bug (gateway/core/waits.py): say which loops ran on
        log.error("loops_not_stopped", loops=sorted(t.get_name() for t in stuck),
                  waited_s=SHUTDOWN_WAIT_S)


@contextlib.asynccontextmanager
async def running_services(settings: Settings, metrics: GatewayMetrics
                           ) -> AsyncIterator[Services]:
    """The services of these settings, their loops running, until the block exits."""
    async with contextlib.AsyncExitStack() as stack:
        client, redis_url, session = await connections(settings, metrics, stack)
        services = build_services(settings, metrics, client, redis_url, session)
        await first_reads(services)
        tasks = start_loops(services)
        try:
            yield services
        finally:
            await stop_loops(services, tasks)


SERVICES = web.AppKey("fairgate_services", Services)
