"""An unexpected exception in a handler (issue 10, item 12): the client gets a plain
OpenAI-format 500 without internals, and the gateway's JSON log line says what failed —
exception type, message and the formatted traceback — not just ``exc_info: true``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gateway.storage.embedded_redis import free_port
from tests.gateway.conftest import KEYS, MODEL, SimFactory

MARKER = "injected-fault-5d2e91"
PROMPT = "PROMPT-TEXT-77aa must never be logged"

# `fairgate serve` with one handler dependency broken: the class resolution of every
# completion request raises an exception nobody expects.
SERVE_BROKEN = f"""
import sys
import gateway.http.routes

def broken(*args, **kwargs):
    raise ZeroDivisionError({MARKER!r})

gateway.http.routes.effective_class = broken
from gateway.runtime.cli import main
sys.exit(main(["serve", "--config", sys.argv[1], "--workers", "1"]))
"""


async def test_unhandled_error_logs_type_message_and_traceback(sim: SimFactory, redis_url: str,
                                                               tmp_path: Path) -> None:
    backend = await sim(profile="instant")
    port = free_port()
    path = tmp_path / "fairgate.yaml"
    path.write_text(yaml.safe_dump({
        "redis_url": redis_url, "listen": {"host": "127.0.0.1", "port": port},
        "backends": [{"name": "b1", "url": backend.url, "model": MODEL}],
        "api_keys": KEYS, "data_dir": str(tmp_path)}))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SERVE_BROKEN, str(path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "FAIRGATE_SCRAPE_INTERVAL_S": "0.02"})
    assert proc.stdout is not None and proc.stderr is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.startswith(b"fairgate listening on"), line
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            for _ in range(300):  # until the first scrape made the backend healthy
                async with http.get(base + "/ready") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.02)
            async with http.post(base + "/v1/chat/completions", headers={
                    "Authorization": "Bearer sk-alice"}, json={
                    "model": MODEL, "max_tokens": 3,
                    "messages": [{"role": "user", "content": PROMPT}]}) as resp:
                status, answer = resp.status, await resp.json()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    raw = (await proc.stderr.read()).decode()

    # the client: OpenAI's format, no internals
    assert status == 500
    error: dict[str, Any] = answer["error"]
    assert error["type"] == "internal_error" and "gateway logs" in error["message"]
    assert MARKER not in json.dumps(answer) and "Traceback" not in json.dumps(answer)

    # the log: one JSON line that names the failure and where it happened
    events = [json.loads(x) for x in raw.splitlines() if x.strip()]
    crashes = [e for e in events if e["event"] == "unhandled_error"]
    assert len(crashes) == 1, raw
    crash = crashes[0]
    assert crash["level"] == "error" and crash["path"] == "/v1/chat/completions"
    assert crash.get("exc_info") is not True, crash
    assert crash["exc_type"] == "ZeroDivisionError"
    assert crash["exc_message"] == MARKER
    trace = crash["exception"]
    assert trace.startswith("Traceback (most recent call last):"), trace
    assert "gateway/http/routes.py" in trace and "in _resolve" in trace
    assert trace.rstrip().endswith(f"ZeroDivisionError: {MARKER}")
    # a traceback carries no local variables: never the prompt or a key
    assert PROMPT not in raw
    for secret in [k["key"] for k in KEYS]:
        assert secret not in raw, secret
