"""`fairgate serve --config FILE` as a real process, on embedded Redis defaults."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis
import yaml

from gateway.embedded_redis import free_port
from tests.gateway.conftest import KEYS, MODEL, SimFactory, complete


async def test_serve_from_yaml_with_embedded_redis(sim: SimFactory, tmp_path: Path) -> None:
    backend = await sim(profile="instant")
    port = free_port()
    config = {"listen": {"host": "127.0.0.1", "port": port},
              "backends": [{"name": "b1", "url": backend.url, "model": MODEL}],
              "api_keys": KEYS, "data_dir": str(tmp_path)}
    path = tmp_path / "fairgate.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--config", str(path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "FAIRGATE_SCRAPE_INTERVAL_S": "0.02"})
    assert proc.stdout is not None and proc.stderr is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.decode().strip() == f"fairgate listening on http://127.0.0.1:{port}"
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            for _ in range(300):  # until the first scrape made the backend healthy
                async with session.get(base + "/ready") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.02)
            data = await complete(session, base, "sk-alice", 3)
            assert data["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    logs = [json.loads(x) for x in (await proc.stderr.read()).decode().splitlines()
            if x.startswith("{")]
    redis_url = next(e["url"] for e in logs if e["event"] == "embedded_redis_started")
    client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=1)
    try:
        try:
            await client.ping()
            raise AssertionError("embedded Redis outlived the gateway")
        except (ConnectionError, OSError, aioredis.ConnectionError):
            pass
    finally:
        await client.aclose()
    assert not any(e.get("level") == "error" for e in logs)
