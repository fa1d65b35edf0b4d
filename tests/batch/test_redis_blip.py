"""Redis killed (SIGKILL) and restarted from its AOF under a running batch: the gateway
answers 503 meanwhile, nothing wedges, and the batch finishes with every line exactly
once in its output file."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from gateway.http.server import GatewayServer
from gateway.storage.embedded_redis import EmbeddedRedis
from gateway.storage.keys import ACTIVE_BATCHES, BatchKeys
from tests.gateway.conftest import MODEL, SimFactory, gateway_settings

LINES = 40


def batch_file() -> bytes:
    lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": f"p{i}", "max_tokens": 40 + i,
                                  "ignore_eos": True}})
             for i in range(LINES)]
    return ("\n".join(lines) + "\n").encode()


async def until(predicate: Any, what: str, tries: int = 2000) -> None:
    for _ in range(tries):
        if await predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_batch_survives_a_redis_restart(sim: SimFactory, tmp_path: Path) -> None:
    server = EmbeddedRedis(data_dir=tmp_path / "redis", append_only=True).start()
    probe = aioredis.Redis.from_url(server.url, decode_responses=True)
    backend = await sim(max_num_seqs=8)
    gateway = GatewayServer(gateway_settings(server.url, [backend],
                                             data_dir=str(tmp_path / "data"),
                                             batch_poll_s=0.05, batch_lease_s=2.0))
    await gateway.start()
    c = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sk-batch", max_retries=0)
    try:
        f = await c.files.create(file=("in.jsonl", batch_file()), purpose="batch")
        batch = await c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                       completion_window="24h")
        out_key = BatchKeys(batch.id).out

        async def some_done() -> bool:
            return bool(await probe.hlen(out_key) >= LINES // 4)

        await until(some_done, "a quarter of the lines")
        server.kill()
        await probe.aclose()

        async def answers_503() -> bool:
            try:
                await c.batches.retrieve(batch.id)
            except openai.APIStatusError as exc:
                assert exc.status_code == 503 and exc.code == "queue_store_unavailable"
                return True
            return False

        await until(answers_503, "a 503 while Redis is down")
        server = EmbeddedRedis(port=server.port, data_dir=server.data_dir,
                               append_only=True).start()

        async def finished() -> bool:
            status = (await c.batches.retrieve(batch.id)).status
            return status in {"completed", "failed", "expired", "cancelled"}

        await until(finished, "the batch to finish", tries=6000)
        final = await c.batches.retrieve(batch.id)
        assert final.status == "completed", final
        assert final.request_counts is not None
        assert (final.request_counts.completed, final.request_counts.failed) == (LINES, 0)
        assert final.output_file_id is not None
        text = (await c.files.content(final.output_file_id)).text
    finally:
        await c.close()
        await gateway.stop()
        server.stop()
    custom_ids = [json.loads(x)["custom_id"] for x in text.splitlines()]
    assert custom_ids == [f"line-{i}" for i in range(LINES)]  # each line once, in order
    ran = Counter(r.max_tokens - 40 for r in backend.engine.records.values()
                  if r.finished_s is not None and not r.aborted)
    # every line ran to completion; one whose answer came back while Redis was down
    # could not be recorded and ran again
    assert set(ran) == set(range(LINES)), ran


async def test_a_batch_whose_record_redis_lost_is_a_404_and_the_runner_lets_go(
        sim: SimFactory, tmp_path: Path) -> None:
    """Redis restarted **empty** (no AOF) under a running batch: its record is gone, so
    ``GET /v1/batches/{id}`` answers 404 (never a 500 on a record without its ``doc``),
    the runner drops the batch without writing half a record back and keeps serving new
    batches; a record left without its ``doc`` (a result written after the loss) reads as
    missing too."""
    server = EmbeddedRedis(data_dir=tmp_path / "redis").start()
    probe = aioredis.Redis.from_url(server.url, decode_responses=True)
    backend = await sim(max_num_seqs=8)
    gateway = GatewayServer(gateway_settings(server.url, [backend],
                                             data_dir=str(tmp_path / "data"),
                                             batch_poll_s=0.05, batch_lease_s=2.0))
    await gateway.start()
    runner = gateway.services.batch_runner
    c = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sk-batch", max_retries=0)
    try:
        f = await c.files.create(file=("in.jsonl", batch_file()), purpose="batch")
        batch = await c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                       completion_window="24h")
        keys = BatchKeys(batch.id)

        async def some_done() -> bool:
            return bool(await probe.hlen(keys.out) >= LINES // 4)

        await until(some_done, "a quarter of the lines")
        server.kill()
        server = EmbeddedRedis(port=server.port, data_dir=server.data_dir).start()  # empty

        async def let_go() -> bool:
            return batch.id not in runner.running

        await until(let_go, "the runner to drop the lost batch", tries=6000)
        with pytest.raises(openai.NotFoundError) as lost:
            await c.batches.retrieve(batch.id)
        assert batch.id in str(lost.value), lost.value
        left = [k for k in (keys.hash, keys.out, keys.err) if await probe.exists(k)]
        assert left == [], f"the lost batch left {left} behind"

        # a record holding results but no doc (what a late result used to write)
        await probe.hset(keys.hash, mapping={"output_file_id": "file-x", "total": 40})
        await probe.sadd(ACTIVE_BATCHES, batch.id)
        with pytest.raises(openai.NotFoundError):
            await c.batches.retrieve(batch.id)
        listed = [b.id async for b in c.batches.list()]
        assert batch.id not in listed, listed
        await runner._claim_new()  # the runner's poll reads it without crashing
        await until(let_go, "the runner to drop the record without a doc", tries=6000)

        # the runner still runs new batches
        f = await c.files.create(file=("in.jsonl", batch_file()), purpose="batch")
        again = await c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                       completion_window="24h")

        async def finished() -> bool:
            status = (await c.batches.retrieve(again.id)).status
            return status in {"completed", "failed", "expired", "cancelled"}

        await until(finished, "the new batch to finish", tries=6000)
        final = await c.batches.retrieve(again.id)
        assert final.status == "completed" and final.request_counts is not None, final
        assert final.request_counts.completed == LINES, final.request_counts
        restarts = gateway.services.metrics.registry.get_sample_value(
            "fairgate_loop_restarts_total", {"loop": "batch"})
        assert not restarts, f"the batch loop restarted {restarts} times"
    finally:
        await c.close()
        await probe.aclose()
        await gateway.stop()
        server.stop()
