"""A Redis Cluster shard's master SIGKILLed under load; its replica takes over.

A real Valkey Cluster on loopback (3 masters + 3 replicas, ``cluster-node-timeout`` 1 s),
a gateway serving two models whose hash tags live on different shards, a 2-user flood
of streams on the first model, a control flood on the second, a running batch, and
newcomers who arrive after the kill. The master holding the first model's slot is
killed with SIGKILL. Every request is counted: answered OK, answered with a clean
OpenAI error, or hung (none may hang); the backends' own records show that nothing was
dispatched twice; every batch line has exactly one result; the other model's shard
never notices; the first model is served again once the replica is promoted (the
client refreshes its slot map, the scripts are loaded again on the new master), and its
in-flight counts converge.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gateway.core.settings import load_settings
from gateway.http.server import GatewayServer
from gateway.storage.keys import ModelKeys
from loadtest.sim.cli import slowed
from loadtest.sim.engine import EngineConfig
from loadtest.sim.profiles import DEFAULT_PROFILE, PROFILES
from loadtest.sim.server import SimServer
from loadtest.valkey_cluster import ValkeyCluster
from tests.batch.test_batch_api import wait_status
from tests.gateway.conftest import KEYS, MODEL, until

OTHER = "mistral"  # another master's slot than MODEL's (tests/gateway/test_cluster_paths.py)
FLOOD, CONTROL, LINES = 24, 6, 8
QUEUED_BEHIND = 6  # streams behind one that holds the other model's only slot
FLOOD_USERS = ("sk-alice", "sk-bob")
NEWCOMERS = ("sk-carol", "sk-dflt")
HUNG_AFTER_S = 60.0
NEWCOMER_TRIES = 600  # each newcomer retries a clean error this often, at most


@dataclass
class Outcome:
    status: int | None  # None: hung
    code: str | None = None
    done: bool = False  # a stream that reached [DONE], or a whole non-stream answer
    tokens: int = 0
    max_tokens: int = 0
    answered_at: float = 0.0


async def stream(http: aiohttp.ClientSession, url: str, key: str, model: str,
                 max_tokens: int) -> Outcome:
    """One streamed completion (``max_tokens`` unique: the backend's records name it)."""
    body = {"model": model, "prompt": f"p{max_tokens}", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    try:
        async with asyncio.timeout(HUNG_AFTER_S):
            async with http.post(url + "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
                if resp.status != 200:
                    error = (await resp.json())["error"]
                    return Outcome(resp.status, error["code"], answered_at=time.monotonic())
                out = Outcome(200, max_tokens=max_tokens, answered_at=time.monotonic())
                async for line in resp.content:
                    if line.startswith(b"data: [DONE]"):
                        out.done = True
                    elif line.startswith(b"data: {"):
                        frame = json.loads(line[6:])
                        if "error" in frame:  # the stream's last frame: a clean error
                            out.code = frame["error"].get("code") or "stream_error"
                        elif frame.get("choices"):
                            out.tokens += 1
                return out
    except TimeoutError:
        return Outcome(None, max_tokens=max_tokens)


async def newcomer(http: aiohttp.ClientSession, url: str, key: str, first: int
                   ) -> list[Outcome]:
    """A user arriving after the kill: asks until served (a clean error is retried as
    a client would, after a pause), each try its own request."""
    tries: list[Outcome] = []
    for i in range(NEWCOMER_TRIES):
        out = await stream(http, url, key, MODEL, first + i)
        tries.append(out)
        if (out.status == 200 and out.done) or out.status is None:
            break
        await asyncio.sleep(0.05)  # a client's pause before it retries a 503
    return tries


def batch_lines() -> bytes:
    lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": f"b{i}", "max_tokens": 500 + i,
                                  "ignore_eos": True}})
             for i in range(LINES)]
    return ("\n".join(lines) + "\n").encode()


async def request_hashes(client: Any, k: ModelKeys) -> dict[str, dict[str, str]]:
    """Every request hash of the model left in the store, by name (what a failure shows)."""
    found = {}
    async for name in client.scan_iter(match=k.request_prefix + "*", count=500):
        found[name] = await client.hgetall(name)
    return found


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[ValkeyCluster]:
    c = await asyncio.to_thread(ValkeyCluster(tmp_path / "cluster", node_timeout_ms=1000).start)
    yield c
    c.stop()


@pytest.mark.timeout(300)
async def test_a_shard_master_killed_under_load(cluster: ValkeyCluster, tmp_path: Path) -> None:
    k = ModelKeys(MODEL)
    victim = cluster.master_of(k.depth)
    assert victim.address != cluster.master_of(ModelKeys(OTHER).depth).address
    backends = [SimServer(EngineConfig(model=MODEL, scheduling_policy="priority",
                                       max_num_seqs=4)),
                SimServer(EngineConfig(model=OTHER, scheduling_policy="priority",
                                       max_num_seqs=8))]
    for server in backends:
        await server.start()
    gw = GatewayServer(load_settings(
        None, redis_cluster={"nodes": cluster.addresses}, api_keys=KEYS,
        listen={"host": "127.0.0.1", "port": 0}, data_dir=tmp_path / "data",
        backends=[{"name": f"b-{s.config.model}", "url": s.url, "model": s.config.model}
                  for s in backends],
        scrape_interval_s=0.02, replica_heartbeat_s=0.2, batch_poll_s=0.05))
    await gw.start()
    try:
        for handle in gw.services.pool.handles.values():
            await handle.scraped.wait()
        dispatcher = gw.services.dispatcher
        batcher = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-batch",
                                     max_retries=0)
        f = await batcher.files.create(file=("in.jsonl", batch_lines()), purpose="batch")
        batch = await batcher.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                             completion_window="24h")
        async with aiohttp.ClientSession() as http:
            flood = [asyncio.create_task(stream(http, gw.url, FLOOD_USERS[i % 2], MODEL,
                                                100 + i)) for i in range(FLOOD)]
            control = [asyncio.create_task(stream(http, gw.url, "sk-alice", OTHER, 300 + i))
                       for i in range(CONTROL)]

            def loaded() -> bool:
                return backends[0].engine.num_running >= 2 and len(dispatcher.waiters) >= 5

            await until(loaded, "streams running and clients queued")
            victim.server.kill()
            killed_at = time.monotonic()
            late = [asyncio.create_task(newcomer(http, gw.url, key, 1000 * (n + 1)))
                    for n, key in enumerate(NEWCOMERS)]
            outcomes = await asyncio.gather(*flood)
            controls = await asyncio.gather(*control)
            tries = await asyncio.gather(*late)
        done = await wait_status(batcher, batch.id, {"completed", "failed"}, limit_s=120)
        texts = [(await batcher.files.content(fid)).text
                 for fid in (done.output_file_id, done.error_file_id) if fid]
        await batcher.close()
        store = gw.services.store

        left: dict[str, Any] = {}

        async def converged() -> bool:  # settles retried, the dead replica's reaped
            left["in flight"] = inflight = await store.reads.user_inflight(MODEL)
            left["queued"] = queued = await store.reads.depths(MODEL)
            return inflight == {} and not any(queued.values())

        try:
            await until(converged, "in-flight counts and queues of the model back to zero",
                        timeout_s=60)
        except pytest.fail.Exception:
            left["requests"] = await request_hashes(store.client, k)
            pytest.fail(f"in-flight counts and queues did not converge in 60 s: {left}")
    finally:
        await gw.stop()
        for server in backends:
            await server.stop()

    def kind(o: Outcome) -> str:
        if o.status is None:
            return "hung"
        if o.status == 200 and o.done and not o.code and o.tokens == o.max_tokens:
            return "ok"
        return "clean_error" if o.code else "lost"

    sent = [*outcomes, *[t for attempts in tries for t in attempts]]
    counts = Counter(kind(o) for o in sent)
    assert counts["hung"] == 0 and counts["lost"] == 0, counts
    errors = Counter((o.status, o.code) for o in sent if o.code)
    assert set(errors) <= {(503, "queue_store_unavailable"),
                           (200, "queue_store_unavailable")}, errors
    served = [attempts[-1] for attempts in tries]
    assert all(kind(o) == "ok" for o in served), served  # every newcomer got served
    first_served_s = min(o.answered_at for o in served) - killed_at
    control_kinds = Counter(kind(o) for o in controls)
    assert control_kinds == {"ok": CONTROL}, control_kinds  # the other shard never noticed
    # a batch line preempted for a newcomer leaves an aborted record beside its
    # continuation (prompt + generated ids, max_tokens less what was generated: the same
    # sum): what ran to its end twice ran twice
    records = backends[0].engine.records.values()
    dispatched = Counter(r.prompt_tokens + r.max_tokens for r in records if not r.aborted)
    twice = {t: n for t, n in dispatched.items() if n > 1}
    assert twice == {}, f"ran more than once at the backend: {twice}"
    moved = sum(r.aborted for r in records)
    results = Counter(json.loads(line)["custom_id"] for text in texts
                      for line in text.splitlines())
    assert results == {f"line-{i}": 1 for i in range(LINES)}, results
    print(f"SCENARIO cluster_master_killed: sent={len(sent) + CONTROL} "
          f"ok={counts['ok'] + control_kinds['ok']} clean_error={counts['clean_error']} "
          f"hung={counts['hung']} duplicated={sum(n - 1 for n in dispatched.values())} "
          f"moved={moved} "
          f"lost={counts['lost']} batch_lines={sum(results.values())}/{LINES} "
          f"batch={done.status} first_served_after_kill_s={first_served_s:.2f} "
          f"errors={dict(errors)}")


@pytest.mark.timeout(300)
async def test_a_shard_outage_longer_than_the_wait_fails_only_its_models_clients(
        cluster: ValkeyCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The first model's shard is down longer than ``store_failover_wait_s`` (its failover
    takes ``cluster-node-timeout`` and an election, over a second; the wait here is 0.3 s):
    the client queued for the other model, whose shard answers throughout, stays queued
    and is served when its backend's slot frees (it was answered 503 with the others)."""
    victim = cluster.master_of(ModelKeys(MODEL).depth)
    slow = slowed(PROFILES[DEFAULT_PROFILE], 0.01)  # a 300-token stream lasts 3 s or more
    backends = [SimServer(EngineConfig(model=MODEL, max_num_seqs=4)),
                SimServer(EngineConfig(model=OTHER, profile=slow, max_num_seqs=1))]
    for server in backends:
        await server.start()
    gw = GatewayServer(load_settings(
        None, redis_cluster={"nodes": cluster.addresses}, api_keys=KEYS,
        listen={"host": "127.0.0.1", "port": 0}, data_dir=tmp_path / "data",
        backends=[{"name": f"b-{s.config.model}", "url": s.url, "model": s.config.model}
                  for s in backends],
        scrape_interval_s=0.02, replica_heartbeat_s=0.2, store_failover_wait_s=0.3))
    await gw.start()
    try:
        for handle in gw.services.pool.handles.values():
            await handle.scraped.wait()
        dispatcher = gw.services.dispatcher
        async with aiohttp.ClientSession() as http:
            running = asyncio.create_task(stream(http, gw.url, "sk-alice", OTHER, 300))
            await until(lambda: backends[1].engine.num_running == 1, "the slot taken")
            # vLLM's queue takes a few (pacing: waiting < 3), the rest queue in the gateway
            behind = [asyncio.create_task(stream(http, gw.url, "sk-bob", OTHER, 20 + i))
                      for i in range(QUEUED_BEHIND)]
            await until(lambda: len(dispatcher.waiters) >= 2, "clients queued in the gateway")
            victim.server.kill()
            killed_at = time.monotonic()
            first, *rest = await asyncio.gather(running, *behind)
    finally:
        await gw.stop()
        for server in backends:
            await server.stop()
    logged = capsys.readouterr().err.splitlines()
    waits_over = [line for line in logged if "store_failover_wait_over" in line]
    # what a 500 was (the error boundary logs the exception it did not expect)
    unhandled = [line for line in logged if "unhandled_error" in line]
    assert (first.status, first.done, first.tokens) == (200, True, 300), first
    failed = [o for o in rest if (o.status, o.code, o.done) != (200, None, True)
              or o.tokens != o.max_tokens]
    assert not failed, (failed, waits_over, unhandled)
    # the wait ran out while the shard was down, and spared the other model's clients
    assert waits_over and all(f'"{OTHER}"' in line for line in waits_over), waits_over
    last_s = max(o.answered_at for o in rest) - killed_at
    assert last_s > 0.3, f"the last client was dispatched {last_s:.2f} s after the kill"
