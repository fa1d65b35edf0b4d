"""Gateway replicas and batch files for tests that kill real processes."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import yaml

from gateway.storage.embedded_redis import die_with_parent, free_port
from tests.gateway.conftest import KEYS, MODEL

# fast enough for a test to see a dead replica, a lost lease and a new snapshot
FAST = {"FAIRGATE_REPLICA_TTL_S": "1", "FAIRGATE_BATCH_LEASE_S": "1",
        "FAIRGATE_REPLICA_HEARTBEAT_S": "0.2", "FAIRGATE_SCRAPE_INTERVAL_S": "0.02",
        "FAIRGATE_BATCH_POLL_S": "0.05"}


def replica_config(where: Path, name: str, redis_url: str, backend_urls: list[str],
                   **extra: Any) -> tuple[Path, int]:
    """A config file for one replica process on a free port (its data in ``where/name``):
    backends ``b0``, ``b1``, … of the test model and the test keys; returns (file, port)."""
    port = free_port()
    config = where / f"{name}.yaml"
    config.write_text(yaml.safe_dump({
        "redis_url": redis_url, "data_dir": str(where / name),
        "listen": {"host": "127.0.0.1", "port": port},
        "backends": [{"name": f"b{i}", "url": url, "model": MODEL}
                     for i, url in enumerate(backend_urls)],
        "api_keys": KEYS, **extra}))
    return config, port


async def start_gateway(config: Path, port: int, env: dict[str, str] | None = None
                        ) -> asyncio.subprocess.Process:
    """``fairgate serve --config`` in a process that dies with the test; returns once it
    listens on ``port``."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.runtime.cli", "serve", "--config", str(config),
        "--workers", "1",  # one replica per process: a kill here is a replica's crash
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        preexec_fn=die_with_parent, env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    assert f":{port}" in line.decode(), line
    return proc


async def until_ready(url: str) -> None:
    """Until ``GET /ready`` answers 200 (Redis reachable, a backend scraped healthy)."""
    async with aiohttp.ClientSession() as http:
        for _ in range(1000):
            try:
                async with http.get(url + "/ready") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.02)
    raise AssertionError(f"{url} never became ready")


async def wait_ready(c: openai.AsyncOpenAI) -> None:
    for _ in range(1000):
        try:
            await c.models.list()
            return
        except openai.APIError:
            await asyncio.sleep(0.02)
    raise AssertionError("gateway did not answer")


def batch_file(lines: int, max_tokens: Callable[[int], int]) -> bytes:
    """A /v1/completions batch input: ``line-<i>`` with ``max_tokens(i)``."""
    rows = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"model": MODEL, "prompt": f"p{i}",
                                 "max_tokens": max_tokens(i), "ignore_eos": True}})
            for i in range(lines)]
    return ("\n".join(rows) + "\n").encode()
