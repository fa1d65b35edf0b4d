"""``fairgate serve --workers N``: N gateway processes on one port, under a supervisor.

Each worker is a whole gateway replica (``gateway/runtime/serve.py``'s serving path, its own replica
id) listening on the same port with SO_REUSEPORT, so the kernel spreads connections over
the workers. They share one Redis, hence one scheduler, as replicas on several hosts do.

The parent process (:class:`Supervisor`) serves nothing itself:

- it holds the port (bound with SO_REUSEPORT, never listening: port 0 resolves once, and
  no other program takes the port while a worker restarts);
- it starts the embedded Redis when none is configured, so all workers share it (a
  configured Redis or Redis Cluster reaches each worker through its environment);
- it gives the workers one metrics directory (``PROMETHEUS_MULTIPROC_DIR``): a scrape of
  ``/metrics`` through any worker sees every worker's counts (``gateway/core/metrics.py``);
- it restarts a worker that exits (backoff 0.1 s doubling to 5 s, reset once a worker
  has served 10 s), each time under a new replica id: the dead worker's queued requests
  and held slots are reaped as any dead replica's;
- a worker that exits before it listens (a config file broken since the start, a store
  it cannot reach) is retried after 0.5 s doubling to 60 s, each attempt logged
  (``worker_start_failed`` with the next pause), not every few seconds forever; SIGHUP
  (the operator fixed the config) retries it at once. A worker of the first start that
  never listens stops the supervisor instead: that setup cannot work;
- on SIGTERM/SIGINT it sends SIGTERM to every worker, each drains as ``fairgate serve``
  does, and it exits 0 once all have exited.

A worker writes ``"<index> <pid>"`` to the supervisor's ready pipe once it listens, and
gets SIGTERM (drains) if the supervisor dies without stopping it. Responses carry
``X-Fairgate-Worker: <index>``.

A config reload reaches every worker: ``POST /admin/reload`` through any worker, or SIGHUP
to the supervisor, which passes SIGHUP on to each worker (``gateway/core/worker_signals.py``).
Drain is global already (a flag in Redis).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web
from structlog.typing import EventDict

from gateway.core import event_loop
from gateway.core.logs import configure_logging
from gateway.core.metrics.base import MULTIPROC_DIR_ENV
from gateway.core.settings import Settings, legacy, load_settings
from gateway.core.supervise import Backoff
from gateway.core.worker_signals import RELOAD_SIGNAL, WORKER_INDEX_ENV
from gateway.http.server import GatewayServer
from gateway.runtime.serve import (
    EXIT_USAGE,
    SERVE_PORT_CHANGE,
    fail,
    port_in_use,
    port_taken_message,
    run_gateway,
)
from gateway.storage.embedded_redis import EmbeddedRedis

log = structlog.get_logger("fairgate.workers")

READY_FD_ENV = "FAIRGATE_WORKER_READY_FD"
WORKER_HEADER = "X-Fairgate-Worker"

RESTART_BACKOFF_S = (0.1, 5.0)  # a worker that served, then exited: first pause, cap
START_BACKOFF_S = (0.5, 60.0)  # a worker that exited before it listened
STABLE_AFTER_S = 10.0  # a worker that served this long restarts at the shortest backoff
STOP_TIMEOUT_S = 90.0  # a worker still draining after this is killed
PR_SET_PDEATHSIG = 1


def default_workers() -> int:
    """One worker per core this process may run on."""
    return max(1, len(os.sched_getaffinity(0)))


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``(host, port)`` with SO_REUSEPORT and never listening: the
    workers bind beside it; the kernel gives connections only to listening sockets."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass
class Worker:
    index: int
    process: asyncio.subprocess.Process | None = None
    generation: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # served once, any generation
    ready_at: float | None = None  # when this generation listened (monotonic)
    retry_now: asyncio.Event = field(default_factory=asyncio.Event)  # SIGHUP: skip the pause


class Supervisor:
    """Runs ``count`` workers of the gateway configured by ``config`` (``--config``, or
    ``FAIRGATE_CONFIG`` and the environment, as ``fairgate serve``)."""

    def __init__(self, settings: Settings, config: str | None, count: int) -> None:
        self.settings = settings
        self.config = config
        self.count = count
        self.port = settings.listen.port
        self.stopping = asyncio.Event()
        self.failed: int | None = None
        self.workers = [Worker(i) for i in range(count)]

    @property
    def url(self) -> str:
        return f"http://{self.settings.listen.host}:{self.port}"

    async def run(self, banner: Callable[[Supervisor], str] | None = None) -> int:
        """Serve until SIGINT/SIGTERM: 0; a worker that cannot start: its exit status (2
        with one line for a taken port). ``banner`` replaces the "listening" line."""
        host = self.settings.listen.host
        try:
            reservation = reserve_port(host, self.port)
        except OSError as exc:
            if not port_in_use(exc):
                raise
            return fail(port_taken_message(host, self.port, SERVE_PORT_CHANGE))
        self.port = int(reservation.getsockname()[1])
        with contextlib.ExitStack() as stack:
            stack.callback(reservation.close)
            # the workers read the config file and the environment as this process did
            # (a Sentinel's too; a cluster's passed on whole, as it may come from
            # overrides); an embedded Valkey is started once, here, and shared
            url = self.settings.store.redis_url
            store = {"FAIRGATE_STORE__REDIS_URL": url} if url else {}
            if self.settings.store.redis_cluster is not None:
                store["FAIRGATE_STORE__REDIS_CLUSTER"] = self.settings.store.redis_cluster.env()
            if self.settings.embedded_store():
                embedded = EmbeddedRedis(data_dir=None).start()
                stack.callback(embedded.stop)
                store["FAIRGATE_STORE__REDIS_URL"] = embedded.url
                log.info("embedded_redis_started", url=embedded.url)
            metrics_dir = os.environ.get(MULTIPROC_DIR_ENV)
            if not metrics_dir:
                metrics_dir = tempfile.mkdtemp(prefix="fairgate-metrics-")
                stack.callback(shutil.rmtree, metrics_dir, True)
            ready_r, ready_w = os.pipe()
            for fd in (ready_r, ready_w):
                stack.callback(os.close, fd)
            env = {**os.environ, **store,
                   "FAIRGATE_LISTEN__PORT": str(self.port), MULTIPROC_DIR_ENV: metrics_dir,
                   READY_FD_ENV: str(ready_w)}
            return await self._supervise(env, ready_w, ready_r, banner)

    async def _supervise(self, env: dict[str, str], ready_w: int, ready_r: int,
                         banner: Callable[[Supervisor], str] | None) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        loop.add_signal_handler(RELOAD_SIGNAL, self._reload_all)
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(ready_r, "rb", closefd=False))
        tasks = [asyncio.create_task(self._keep(w, env, ready_w)) for w in self.workers]
        readiness = asyncio.create_task(self._read_ready(reader))
        try:
            all_ready: asyncio.Future[Any] = asyncio.ensure_future(
                asyncio.gather(*(w.ready.wait() for w in self.workers)))
            stopped: asyncio.Future[Any] = asyncio.create_task(self.stopping.wait())
            await asyncio.wait([all_ready, stopped], return_when=asyncio.FIRST_COMPLETED)
            all_ready.cancel()
            if not self.stopping.is_set():
                print(banner(self) if banner else f"fairgate listening on {self.url}",
                      flush=True)
                log.info("workers_ready", workers=self.count, url=self.url)
            await stopped
            await self._stop_all()
            await asyncio.gather(*tasks)
        finally:
            for task in (*tasks, readiness):
                task.cancel()
            await asyncio.gather(*tasks, readiness, return_exceptions=True)
            transport.close()
            for sig in (signal.SIGINT, signal.SIGTERM, RELOAD_SIGNAL):
                loop.remove_signal_handler(sig)
        return self.failed or 0

    def _reload_all(self) -> None:
        """SIGHUP: every live worker re-reads the config file; one waiting to be started
        again is started now."""
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(RELOAD_SIGNAL)
            else:
                worker.retry_now.set()
        log.info("workers_reload", workers=self.count)

    async def _read_ready(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            index, pid = (int(x) for x in line.split())
            worker = self.workers[index]
            if worker.process is not None and worker.process.pid == pid:
                worker.ready_at = time.monotonic()
                worker.ready.set()
                log.info("worker_ready", worker=index, pid=pid)

    async def _keep(self, worker: Worker, env: dict[str, str], ready_w: int) -> None:
        """Run ``worker``, restarting it whenever it exits, until the supervisor stops."""
        crashes, failed_starts = Backoff(*RESTART_BACKOFF_S), Backoff(*START_BACKOFF_S)
        attempt = 0
        while not self.stopping.is_set():
            worker.generation += 1
            worker.ready_at = None
            worker.retry_now.clear()
            process = await self._spawn(worker, env, ready_w)
            code = await process.wait()
            _mark_dead(process.pid)
            if self.stopping.is_set():
                return
            log.warning("worker_exited", worker=worker.index, pid=process.pid, code=code)
            if not worker.ready.is_set():  # never served: a setup that cannot work
                self.failed = code if code == EXIT_USAGE else 1
                self.stopping.set()
                return
            if worker.ready_at is None:  # it could not start (its config, its store)
                attempt += 1
                pause = failed_starts.take()
                log.error("worker_start_failed", worker=worker.index, code=code,
                          attempt=attempt, retry_in_s=pause)
            else:
                attempt = 0
                failed_starts.reset()
                if time.monotonic() - worker.ready_at > STABLE_AFTER_S:
                    crashes.reset()
                pause = crashes.take()
            await self._pause(worker, pause)

    async def _pause(self, worker: Worker, pause_s: float) -> None:
        """Wait ``pause_s`` before a restart, less if the supervisor stops or SIGHUP asks
        for a retry now."""
        waits = [asyncio.create_task(e.wait()) for e in (self.stopping, worker.retry_now)]
        try:
            await asyncio.wait(waits, timeout=pause_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        if worker.retry_now.is_set() and not self.stopping.is_set():
            log.info("worker_retry_now", worker=worker.index)

    async def _spawn(self, worker: Worker, env: dict[str, str], ready_w: int
                     ) -> asyncio.subprocess.Process:
        child_env = {**env, WORKER_INDEX_ENV: str(worker.index)}
        replica_id = self.settings.replicas.replica_id
        if replica_id:  # never reused: the reaper must see the old one die
            child_env["FAIRGATE_REPLICAS__REPLICA_ID"] = (
                f"{replica_id}-w{worker.index}g{worker.generation}")
        config = ["--config", self.config] if self.config else []
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.runtime.workers", *config,
            stdin=asyncio.subprocess.DEVNULL,
            env=child_env, pass_fds=(ready_w,), preexec_fn=_term_with_parent)
        worker.process = process
        log.info("worker_started", worker=worker.index, pid=process.pid)
        return process

    async def _stop_all(self) -> None:
        live = [w.process for w in self.workers
                if w.process is not None and w.process.returncode is None]
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        waits = [asyncio.create_task(p.wait()) for p in live]
        if not waits:
            return
        _, late = await asyncio.wait(waits, timeout=STOP_TIMEOUT_S)
        for process in live:
            if process.returncode is None:
                log.error("worker_killed", pid=process.pid, after_s=STOP_TIMEOUT_S)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
        if late:
            await asyncio.wait(late)


def _mark_dead(pid: int) -> None:
    """Drop a dead worker's live gauges from the shared metrics (its counts stay)."""
    if os.environ.get(MULTIPROC_DIR_ENV) is None:
        return  # the supervisor passes the directory to its workers only
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


def _term_with_parent() -> None:  # pragma: no cover - runs in the child
    """The worker gets SIGTERM (drains) if the supervisor dies without stopping it."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def serve_workers(settings: Settings, config: str | None, count: int) -> int:
    return asyncio.run(Supervisor(settings, config, count).run())


# -- one worker -----------------------------------------------------------------------------


async def _run_worker(settings: Settings, index: int, ready_fd: int) -> int:

    server = GatewayServer(settings, reuse_port=True)
    worker_id = str(index)

    async def tag(_: web.Request, response: web.StreamResponse) -> None:
        response.headers[WORKER_HEADER] = worker_id

    server.app.on_response_prepare.append(tag)

    def ready(_: GatewayServer) -> None:
        os.write(ready_fd, f"{index} {os.getpid()}\n".encode())

    return await run_gateway(settings, server, ready)


def _tag_logs(index: int) -> None:
    """Every log line of this worker says ``"worker": index`` (request lines clear their
    context variables, so not through those)."""

    def add_worker(_: Any, __: str, event: EventDict) -> EventDict:
        event.setdefault("worker", index)
        return event

    config = structlog.get_config()
    structlog.configure(processors=[add_worker, *config["processors"]])


def _metrics_without_pid_checks() -> None:
    """prometheus_client's multiprocess values call ``os.getpid()`` (a system call) on
    every ``inc``, ``set`` and ``observe``, to notice a ``fork``; a worker is started by
    ``exec`` and never forks, so its pid is read once here. Before the first metric is
    built: each value class keeps its own open files (two on one pid's file would write
    over each other)."""
    from prometheus_client import values

    if os.environ.get(MULTIPROC_DIR_ENV):
        pid = os.getpid()
        values.ValueClass = values.MultiProcessValue(lambda: pid)  # type: ignore[no-untyped-call]


def worker_main(argv: Sequence[str] | None = None) -> int:
    """``python -m gateway.runtime.workers [--config FILE]``, started by :class:`Supervisor`."""
    _metrics_without_pid_checks()
    args = list(sys.argv[1:] if argv is None else argv)
    config = args[1] if args[:1] == ["--config"] else None
    index = int(os.environ[WORKER_INDEX_ENV])
    ready_fd = int(os.environ[READY_FD_ENV])
    with legacy.held_lines():  # the supervisor said them
        settings = load_settings(config)
    configure_logging(settings.operations.log_level, settings.operations.log_sample_above_per_s)
    _tag_logs(index)
    return event_loop.run(_run_worker(settings, index, ready_fd), settings.listen.event_loop)


if __name__ == "__main__":
    raise SystemExit(worker_main())
