"""The gateway's everyday paths on a Redis Cluster (real Valkey, 3 masters + 3 replicas):
two models whose hash tags live on different shards; requests, streams, a tick of
concurrent users, limits, runtime keys, files and a batch, usage, the admin views and
the metrics. A script or a transaction over keys of several slots would fail here
(CROSSSLOT, or the client's own refusal) where a single Redis accepts it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
from redis.crc import key_slot

from gateway.core.settings import load_settings
from gateway.http.server import GatewayServer
from gateway.storage.keys import ModelKeys
from loadtest.sim.engine import EngineConfig
from loadtest.sim.server import SimServer
from loadtest.valkey_cluster import ValkeyCluster
from tests.batch.test_batch_api import jsonl, wait_status
from tests.gateway.conftest import KEYS, MODEL, call, until

OTHER = "mistral"  # its hash tag's slot is on another master than MODEL's
ADMIN = "sk-admin"
LIMITED = {"key": "sk-lim", "user": "lim", "tenant": "small", "limits": {"rpm": 2}}


@pytest.fixture
async def sims() -> AsyncIterator[list[SimServer]]:
    servers = [SimServer(EngineConfig(model=m, scheduling_policy="priority", profile="instant"))
               for m in (MODEL, OTHER)]
    for server in servers:
        await server.start()
    yield servers
    for server in servers:
        await server.stop()


@pytest.fixture
async def gw(sims: list[SimServer], cluster_nodes: list[str],
             tmp_path: Path) -> AsyncIterator[GatewayServer]:
    settings = load_settings(
        None, redis_cluster={"nodes": cluster_nodes},
        listen={"host": "127.0.0.1", "port": 0}, scrape_interval_s=0.02,
        replica_heartbeat_s=0.2,
        backends=[{"name": f"b-{s.config.model}", "url": s.url, "model": s.config.model}
                  for s in sims],
        api_keys=[*KEYS, LIMITED], admin_keys=[ADMIN], data_dir=tmp_path,
        batch_poll_s=0.05, key_pepper="test-pepper")
    server = GatewayServer(settings)
    await server.start()
    for handle in server.services.pool.handles.values():
        await handle.scraped.wait()
    yield server
    store = server.services.store

    async def idle() -> bool:
        for model in (MODEL, OTHER):
            if (await store.reads.user_inflight(model)
                    or any((await store.reads.depths(model)).values())):
                return False
        return True

    await until(idle, "nothing queued or in flight on either model")
    await server.stop()


def sdk(gw: GatewayServer, key: str = "sk-alice") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def test_the_two_models_live_on_different_shards(valkey_cluster: ValkeyCluster) -> None:
    shards = {m: valkey_cluster.master_of(ModelKeys(m).depth).address for m in (MODEL, OTHER)}
    assert shards[MODEL] != shards[OTHER], shards
    slots = {m: key_slot(ModelKeys(m).depth.encode()) for m in (MODEL, OTHER)}
    assert slots[MODEL] != slots[OTHER], slots


async def test_requests_and_streams_of_two_models_on_a_cluster(gw: GatewayServer) -> None:
    clients = {key: sdk(gw, key) for key in ("sk-alice", "sk-bob", "sk-carol", "sk-dflt")}
    try:
        async def ask(key: str, model: str, i: int) -> int:
            answer = await clients[key].chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=3,
                extra_body={"ignore_eos": True})
            assert answer.usage is not None, answer
            return answer.usage.completion_tokens

        jobs = [ask(key, model, i) for i in range(4) for key in clients
                for model in (MODEL, OTHER)]
        tokens = await asyncio.wait_for(asyncio.gather(*jobs), 60)
        assert tokens == [3] * len(jobs), tokens

        stream = await clients["sk-alice"].chat.completions.create(
            model=OTHER, messages=[{"role": "user", "content": "stream"}], max_tokens=5,
            stream=True, extra_body={"ignore_eos": True})
        pieces = [chunk.choices[0].delta.content async for chunk in stream
                  if chunk.choices and chunk.choices[0].delta.content]
        assert len(pieces) == 5, pieces
    finally:
        for client in clients.values():
            await client.close()
    registry = gw.services.metrics.registry
    for model in (MODEL, OTHER):
        served = registry.get_sample_value("fairgate_user_requests_total",
                                           {"model": model, "user": "alice"})
        assert served is not None and served >= 4, (model, served)


async def test_limits_keys_files_batches_usage_and_admin_on_a_cluster(
        gw: GatewayServer) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        # a key's rpm limit: the third request in a minute is refused
        limited = sdk(gw, "sk-lim")
        outcomes = []
        for _ in range(3):
            try:
                await limited.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                                 extra_body={"ignore_eos": True})
                outcomes.append("ok")
            except openai.RateLimitError:
                outcomes.append("429")
        await limited.close()
        assert outcomes == ["ok", "ok", "429"], outcomes

        # a runtime key: created, used, rotated, revoked
        status, created, _ = await call(http, "POST", gw.url + "/admin/keys", key=ADMIN,
                                        json={"user": "erin", "priority_class": "default"})
        assert status == 201, created
        status, body, _ = await call(http, "POST", gw.url + "/v1/completions",
                                     key=created["key"], json={
                                         "model": OTHER, "prompt": "hi", "max_tokens": 2})
        assert status == 200, body
        status, rotated, _ = await call(http, "POST",
                                        gw.url + f"/admin/keys/{created['id']}/rotate",
                                        key=ADMIN, json={"grace_s": 0})
        assert status == 200, rotated
        status, body, _ = await call(http, "DELETE", gw.url + f"/admin/keys/{created['id']}",
                                     key=ADMIN)
        assert status == 200, body

        # a file and a batch of five lines, each line answered once
        batcher = sdk(gw, "sk-batch")
        try:
            f = await batcher.files.create(file=("in.jsonl", jsonl(5)), purpose="batch")
            batch = await batcher.batches.create(input_file_id=f.id,
                                                 endpoint="/v1/chat/completions",
                                                 completion_window="24h")
            done = await wait_status(batcher, batch.id, {"completed", "failed"})
            assert done.status == "completed" and done.output_file_id, done
            text = (await batcher.files.content(done.output_file_id)).text
            ids = sorted(json.loads(line)["custom_id"] for line in text.splitlines())
            assert ids == [f"req-{i}" for i in range(5)], ids
            listed = [x.id for x in (await batcher.files.list()).data]
            assert f.id in listed, listed
            assert (await batcher.files.delete(f.id)).deleted
        finally:
            await batcher.close()

        # the usage export sums both models' hashes, each on its own shard
        status, usage, _ = await call(http, "GET", gw.url + "/admin/usage?group_by=model,user",
                                      key=ADMIN)
        assert status == 200, usage
        rows = {(r["model"], r["user"]): r for r in usage["data"]}
        assert rows[(MODEL, "lim")]["requests"] == 3, rows
        assert rows[(MODEL, "lim")]["errors"] == 1, rows
        assert rows[(OTHER, "erin")]["requests"] == 1, rows
        assert rows[(MODEL, "bert")]["requests"] == 5, rows

        # the operators' views
        status, state, _ = await call(http, "GET", gw.url + "/admin/state", key=ADMIN)
        assert status == 200, state
        text = json.dumps(state)
        assert MODEL in text and OTHER in text, sorted(state)
        async with http.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
        assert resp.status == 200 and 'script="settle"' in metrics, metrics[:400]
