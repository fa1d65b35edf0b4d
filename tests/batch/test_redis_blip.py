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
import redis.asyncio as aioredis

from gateway.http.server import GatewayServer
from gateway.storage.embedded_redis import EmbeddedRedis
from gateway.storage.keys import BatchKeys
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
