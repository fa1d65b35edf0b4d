"""``fairgate serve --workers N`` as real processes on the real Redis, in front of the
simulator: several workers share the port and one scheduler, a killed worker is replaced,
SIGTERM stops them all, and ``--workers 1`` serves in the process itself."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.runtime.workers import WORKER_HEADER
from gateway.storage.embedded_redis import free_port
from gateway.storage.keys import ModelKeys
from gateway.storage.store import Store
from tests.gateway.conftest import KEYS, MODEL, SimFactory, until
from tests.gateway.test_scheduling import (
    AHEAD_ON_IDLE,
    FLOOD,
    NEWCOMER_BOUND,
    flood_then_newcomers,
    started_order,
)
from tests.sentinel_rig import SentinelRig

START_TIMEOUT_S = 60.0


class Served:
    """A ``fairgate serve`` process: its URL and its log events as they come."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc = proc
        self.url = url
        self.events: list[dict[str, Any]] = []
        self.bad: list[bytes] = []
        self._new = asyncio.Condition()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            if line.startswith(b"{"):
                try:
                    event = json.loads(line)
                except ValueError:  # two workers' lines run together
                    self.bad.append(line)
                    continue
                async with self._new:
                    self.events.append(event)
                    self._new.notify_all()

    async def event(self, name: str, after: int = 0, **fields: Any) -> dict[str, Any]:
        """The first log event ``name`` with ``fields`` from the ``after``-th on (awaited
        until it comes)."""
        def match() -> dict[str, Any] | None:
            return next((e for e in self.events[after:] if e["event"] == name
                         and all(e.get(k) == v for k, v in fields.items())), None)
        async with self._new:
            await asyncio.wait_for(self._new.wait_for(lambda: match() is not None),
                                   START_TIMEOUT_S)
        found = match()
        assert found is not None
        return found

    def ready_pids(self) -> dict[int, int]:
        """worker index → pid of its latest ready process."""
        return {e["worker"]: e["pid"] for e in self.events if e["event"] == "worker_ready"}


@contextlib.asynccontextmanager
async def serve(backend_url: str, redis_url: str | None, tmp_path: Path, workers: int,
                **extra: Any) -> AsyncIterator[Served]:
    port = free_port()
    config = {"listen": {"host": "127.0.0.1", "port": port}, "redis_url": redis_url,
              "backends": [{"name": "b0", "url": backend_url, "model": MODEL}],
              "api_keys": KEYS, "data_dir": str(tmp_path), "scrape_interval_s": 0.02,
              "replica_heartbeat_s": 0.2, **extra}
    path = tmp_path / "fairgate.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FAIRGATE_", "PROMETHEUS_MULTIPROC")) or
           k.startswith("FAIRGATE_TEST_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.runtime.cli", "serve", "--config", str(path),
        "--workers", str(workers), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env)
    assert proc.stdout is not None
    served = Served(proc, f"http://127.0.0.1:{port}")
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
        assert line.decode().strip() == f"fairgate listening on {served.url}"
        async with aiohttp.ClientSession() as session:
            async def ready() -> bool:
                async with session.get(served.url + "/ready") as resp:
                    return resp.status == 200
            await until(ready, "the backend scraped healthy")
        yield served
        assert not served.bad, served.bad[:3]  # every log line whole, one JSON object
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 60)
        served._reader.cancel()


async def one_request(url: str, key: str, prompt: str) -> tuple[int, str | None]:
    """A completion on its own connection (the kernel picks the worker per connection)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
            s.post(url + "/v1/completions", json=body,
                   headers={"Authorization": f"Bearer {key}"}) as resp:
        data = await resp.json()
        assert resp.status == 200, data
        assert data["usage"]["completion_tokens"] == 2
        return resp.status, resp.headers.get(WORKER_HEADER)


async def scrape(url: str) -> tuple[dict[str, float], str | None]:
    """Samples of one ``/metrics`` scrape on a new connection, and the worker that answered."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
            s.get(url + "/metrics") as resp:
        text = await resp.text()
        worker = resp.headers.get(WORKER_HEADER)
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + json.dumps(sample.labels, sort_keys=True)
            samples[key] = sample.value
    return samples, worker


def total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(name + "{"))


async def backend_successes(url: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "vllm:request_success_total")


def children(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie is dead
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


async def test_two_workers_serve_every_request_once_and_share_one_metrics_view(
        sim: SimFactory, redis: aioredis.Redis, redis_url: str, tmp_path: Path) -> None:
    backend = await sim(profile="instant")
    before = await backend_successes(backend.url)
    n = 120
    async with serve(backend.url, redis_url, tmp_path, workers=2) as gw:
        assert set(gw.ready_pids()) == {0, 1}
        keys = ["sk-alice", "sk-bob", "sk-carol", "sk-dflt", "sk-batch"]
        results = await asyncio.gather(*(one_request(gw.url, keys[i % len(keys)], f"p{i}")
                                         for i in range(n)))
        by_worker = {w: sum(1 for _, x in results if x == w) for w in ("0", "1")}
        assert sum(by_worker.values()) == n and all(by_worker.values()), by_worker
        assert await backend_successes(backend.url) - before == n  # none twice, none lost
        store = Store.over(redis, request_ttl_s=60)

        async def settled() -> bool:  # settle runs as each handler unwinds
            return (await store.reads.user_inflight(MODEL) == {}
                    and not any((await store.reads.depths(MODEL)).values()))
        await until(settled, "every request settled in the one shared scheduler")
        # one view: a scrape through either worker counts both workers' requests
        seen: dict[str, float] = {}
        while len(seen) < 2:
            samples, worker = await scrape(gw.url)
            assert worker is not None
            seen[worker] = total(samples, "fairgate_requests_total")
        assert seen == {"0": n, "1": n}


async def test_two_workers_are_one_fair_scheduler(sim: SimFactory, redis: aioredis.Redis,
                                                  redis_url: str, tmp_path: Path) -> None:
    """A's flood and the newcomers B and C spread over both workers' connections; the
    newcomers still overtake the flood, within the bound of two replicas."""
    backend = await sim(max_num_seqs=4)
    async with serve(backend.url, redis_url, tmp_path, workers=2) as gw:
        _, ahead = await flood_then_newcomers(gw.url, gw.url, backend, redis)
        # (a request's one info line, logged by the worker that dispatched it)
        dispatched = {e["worker"] for e in gw.events if e["event"] == "finished"}
    order = started_order([backend])
    assert len(order) == FLOOD + 2  # each request reached vLLM exactly once
    last_newcomer = max(order.index(21), order.index(22))
    bound = NEWCOMER_BOUND + max(0, ahead - AHEAD_ON_IDLE)
    assert last_newcomer <= bound, (last_newcomer, bound, ahead, order[:24])
    assert dispatched == {0, 1}  # both workers took part


async def test_a_killed_worker_is_replaced_and_sigterm_stops_all(
        sim: SimFactory, redis: aioredis.Redis, redis_url: str, tmp_path: Path) -> None:
    backend = await sim(profile="instant")
    async with serve(backend.url, redis_url, tmp_path, workers=2) as gw:
        old = gw.ready_pids()
        mark = len(gw.events)
        os.kill(old[0], signal.SIGKILL)
        exited = await gw.event("worker_exited", mark, worker=0, pid=old[0])
        assert exited["code"] == -signal.SIGKILL
        await gw.event("worker_ready", mark, worker=0)  # the replacement listens
        pids = gw.ready_pids()
        assert pids[0] != old[0] and pids[1] == old[1]
        assert alive(pids[0]) and not alive(old[0])
        results = await asyncio.gather(*(one_request(gw.url, "sk-alice", f"p{i}")
                                         for i in range(40)))
        assert {w for _, w in results} == {"0", "1"}  # the new worker serves too
        gw.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(gw.proc.wait(), 60) == 0
        for pid in pids.values():
            assert not alive(pid)
    assert not any(e.get("level") == "error" for e in gw.events), gw.events


async def test_a_worker_that_cannot_start_is_retried_with_a_growing_pause(
        sim: SimFactory, redis: aioredis.Redis, redis_url: str, tmp_path: Path) -> None:
    """A worker whose config broke after the start (killed, then restarted on the broken
    file) is retried after 0.5, 1, 2, 4 … s (up to 60 s), each attempt logged, while the
    other worker serves; SIGHUP after the fix starts it again."""
    backend = await sim(profile="instant")
    async with serve(backend.url, redis_url, tmp_path, workers=2) as gw:
        path = tmp_path / "fairgate.yaml"
        good = path.read_text()
        path.write_text("backends: [\n")  # not YAML
        mark = len(gw.events)
        os.kill(gw.ready_pids()[0], signal.SIGKILL)
        failures = [await gw.event("worker_start_failed", mark, worker=0, attempt=n)
                    for n in (1, 2, 3, 4)]
        pauses = [f["retry_in_s"] for f in failures]
        assert pauses == [0.5, 1.0, 2.0, 4.0], f"pauses between failed starts: {pauses}"
        assert all(f["code"] == 1 and f["level"] == "error" for f in failures), failures
        assert (await one_request(gw.url, "sk-bob", "meanwhile"))[1] == "1"
        path.write_text(good)
        mark = len(gw.events)
        gw.proc.send_signal(signal.SIGHUP)
        await gw.event("worker_ready", mark, worker=0)
        assert set(await answered_by(gw.url, "sk-alice", 20)) == {"0", "1"}


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    from gateway.core.supervise import Backoff

    backoff = Backoff(0.5, 3.0)
    taken = [backoff.take() for _ in range(5)]
    assert taken == [0.5, 1.0, 2.0, 3.0, 3.0], taken
    backoff.reset()
    assert backoff.take() == 0.5


async def test_one_worker_serves_in_the_process_itself(
        sim: SimFactory, redis: aioredis.Redis, redis_url: str, tmp_path: Path) -> None:
    backend = await sim(profile="instant")
    async with serve(backend.url, redis_url, tmp_path, workers=1) as gw:
        _, worker = await one_request(gw.url, "sk-alice", "hello")
        assert worker is None  # no worker processes, no worker header
        assert children(gw.proc.pid) == []  # no worker processes (the Redis is the test's)
        assert not any(e["event"].startswith("worker_") for e in gw.events)
        gw.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(gw.proc.wait(), 60) == 0


@pytest.mark.parametrize("workers", ["0", "-1"])
async def test_workers_must_be_positive(workers: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.runtime.cli", "serve", "--workers", workers,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 2
    assert b"--workers" in err and b"at least 1" in err


async def answered_by(url: str, key: str, n: int) -> dict[str | None, int]:
    """``n`` requests with ``key``, each on its own connection: worker → 200s it gave."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "ignore_eos": True}
    served: dict[str | None, int] = {}
    for _ in range(n):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                s.post(url + "/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {key}"}) as resp:
            assert resp.status == 200, await resp.text()
            worker = resp.headers.get(WORKER_HEADER)
            served[worker] = served.get(worker, 0) + 1
    return served


async def test_a_config_reload_reaches_every_worker(sim: SimFactory, redis_url: str,
                                                    tmp_path: Path) -> None:
    backend = await sim(profile="instant")
    async with serve(backend.url, redis_url, tmp_path, 2, admin_keys=["sk-admin"]) as served:
        path = tmp_path / "fairgate.yaml"
        config = yaml.safe_load(path.read_text())

        async def add_key(key: str) -> None:
            config["api_keys"].append({"key": key, "user": key, "priority_class": "default"})
            path.write_text(yaml.safe_dump(config))

        # POST /admin/reload through one worker: the supervisor passes SIGHUP to all
        await add_key("sk-new")
        seen = len(served.events)
        async with aiohttp.ClientSession() as http, http.post(
                served.url + "/admin/reload",
                headers={"Authorization": "Bearer sk-admin"}) as resp:
            assert resp.status == 200, await resp.text()
            assert "api_keys" in (await resp.json())["reloaded"]
        for worker in (0, 1):
            await served.event("config_reloaded", after=seen, worker=worker)
        assert set(await answered_by(served.url, "sk-new", 20)) == {"0", "1"}

        # SIGHUP to the supervisor reloads them all the same way
        await add_key("sk-newer")
        seen = len(served.events)
        served.proc.send_signal(signal.SIGHUP)
        for worker in (0, 1):
            await served.event("config_reloaded", after=seen, worker=worker)
        assert set(await answered_by(served.url, "sk-newer", 20)) == {"0", "1"}


async def test_workers_use_the_sentinel_store(sim: SimFactory, tmp_path: Path) -> None:
    """With redis_sentinel the supervisor starts no embedded Redis and passes no URL: each
    worker reads the Sentinel config and registers on the master the sentinels name."""
    rig = SentinelRig()
    try:
        await rig.start()
        backend = await sim()
        sentinel = rig.config().model_dump(mode="json")
        async with serve(backend.url, None, tmp_path, workers=2, redis_sentinel=sentinel) as gw:
            statuses = [(await one_request(gw.url, "sk-alice", f"w{i}"))[0] for i in range(4)]
            assert statuses == [200] * 4, statuses
            async with rig.master_client() as master:
                replicas = await master.zcard(ModelKeys(MODEL).replicas)
            assert replicas == 2, f"{replicas} workers registered on the Sentinel master"
    finally:
        await rig.stop()
