"""A 500-line batch while its gateway is SIGKILLed and Redis is SIGKILLed and restarted
from its AOF: the batch completes and every custom_id appears exactly once across the
output and error files."""

from __future__ import annotations

import asyncio
import json
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import openai
import redis.asyncio as aioredis

from gateway.storage.embedded_redis import EmbeddedRedis
from gateway.storage.keys import BatchKeys
from tests.gateway.conftest import SimFactory
from tests.processes import FAST, batch_file, replica_config, start_gateway, wait_ready

LINES = 500


async def test_batch_survives_gateway_and_redis_kills(sim: SimFactory, tmp_path: Path) -> None:
    redis = EmbeddedRedis(data_dir=tmp_path / "redis", append_only=True).start()
    backend = await sim(max_num_seqs=32)
    config, port = replica_config(tmp_path, "data", redis.url, [backend.url])
    c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-batch",
                           max_retries=0)
    gw = await start_gateway(config, port, {**FAST, "FAIRGATE_LOG_LEVEL": "warning"})
    try:
        await wait_ready(c)
        f = await c.files.create(file=("in.jsonl", batch_file(LINES, lambda i: 8)), purpose="batch")
        batch = await c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                       completion_window="24h")
        probe = aioredis.Redis.from_url(redis.url, decode_responses=True)
        out_key = BatchKeys(batch.id).out
        for _ in range(6000):  # until a quarter of the lines are done
            if await probe.hlen(out_key) >= LINES // 4:
                break
            await asyncio.sleep(0.01)
        await probe.aclose()
        gw.send_signal(signal.SIGKILL)  # the gateway dies mid-batch...
        await gw.wait()
        redis.kill()  # ...and so does Redis
        redis = EmbeddedRedis(port=redis.port, data_dir=redis.data_dir,
                              append_only=True).start()
        gw = await start_gateway(config, port, {**FAST, "FAIRGATE_LOG_LEVEL": "warning"})
        await wait_ready(c)
        final: Any = None
        for _ in range(3000):
            final = await c.batches.retrieve(batch.id)
            if final.status in {"completed", "failed", "expired", "cancelled"}:
                break
            await asyncio.sleep(0.05)
        assert final is not None and final.status == "completed", final
        texts = [(await c.files.content(fid)).text
                 for fid in (final.output_file_id, final.error_file_id) if fid]
    finally:
        await c.close()
        if gw.returncode is None:
            gw.send_signal(signal.SIGTERM)
            await asyncio.wait_for(gw.wait(), 30)
        redis.stop()
    seen = Counter(json.loads(line)["custom_id"] for text in texts
                   for line in text.splitlines())
    assert set(seen) == {f"line-{i}" for i in range(LINES)}  # none lost
    assert all(n == 1 for n in seen.values()), seen.most_common(3)  # none twice
    counts = final.request_counts
    print(f"SCENARIO batch_faults: lines={LINES} completed={counts.completed} "
          f"failed={counts.failed} recorded_once={len(seen)}")
