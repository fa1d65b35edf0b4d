"""Structured logs of `fairgate serve` (stderr not a terminal → JSON lines): at ``info`` one
``finished`` line per request with its context, wait, backend, latency and tokens; at
``debug`` the ``queued`` and ``dispatched`` steps before it; never a prompt, a completion or
a key."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.gateway.conftest import KEYS, MODEL, SimFactory
from tests.ops.conftest import ADMIN

PROMPT = "PROMPT-TEXT-0b1c9f must never be logged"
BOGUS_KEY = "sk-bogus-4f1e7d"


async def post(http: aiohttp.ClientSession, url: str, key: str, body: dict[str, Any]
               ) -> tuple[int, bytes]:
    async with http.post(url + "/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {key}"}) as resp:
        return resp.status, await resp.read()


@pytest.mark.parametrize("level,steps", [("info", ["finished"]),
                                         ("debug", ["queued", "dispatched", "finished"])])
async def test_lifecycle_events_without_prompts_or_keys(sim: SimFactory, redis_url: str,
                                                        tmp_path: Path, level: str,
                                                        steps: list[str]) -> None:
    backend = await sim(profile="instant")
    path = tmp_path / "fairgate.yaml"
    path.write_text(yaml.safe_dump({
        # port 0: the kernel's free port, read from the banner (a port picked here before
        # the gateway binds can be taken by another test's server meanwhile: exit 2)
        "redis_url": redis_url, "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"name": "b1", "url": backend.url, "model": MODEL}],
        "api_keys": KEYS, "admin_keys": [ADMIN], "data_dir": str(tmp_path),
        "operations": {"log_level": level}}))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.runtime.cli", "serve", "--config", str(path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "FAIRGATE_SCRAPE_INTERVAL_S": "0.02"})
    assert proc.stdout is not None and proc.stderr is not None
    logged = bytearray()

    async def drain(stream: asyncio.StreamReader) -> None:
        # the log lines read as they come: a full pipe (64 KiB) would block the gateway's
        # writes, its event loop with them, and every request until the test timed out
        while chunk := await stream.read(65536):
            logged.extend(chunk)
    draining = asyncio.create_task(drain(proc.stderr))
    messages = [{"role": "user", "content": PROMPT}]
    outputs: list[bytes] = []
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if not line.startswith(b"fairgate listening on"):
            await asyncio.wait_for(proc.wait(), 30)
            await draining
            raise AssertionError(f"the gateway did not start (exit {proc.returncode}): "
                                 f"{line!r} {bytes(logged[-2000:])!r}")
        base = line.split()[-1].decode()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            for _ in range(300):  # until the first scrape made the backend healthy
                async with http.get(base + "/ready") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.02)
            for stream in (False, True):
                status, out = await post(http, base, "sk-alice", {
                    "model": MODEL, "messages": messages, "max_tokens": 5, "stream": stream})
                assert status == 200, out
                outputs.append(out)
            status, _ = await post(http, base, "sk-bob", {"model": "no-such-model",
                                                          "messages": messages})
            assert status == 404
            status, _ = await post(http, base, BOGUS_KEY, {"model": MODEL, "messages": messages})
            assert status == 401
            async with http.get(base + "/admin/state",
                                headers={"Authorization": f"Bearer {ADMIN}"}) as resp:
                assert resp.status == 200
    except Exception as exc:  # (a request that timed out, a status): what the gateway said
        exc.add_note(f"the gateway's log so far: {bytes(logged[-3000:])!r}")
        raise
    finally:
        if proc.returncode is None:  # (one that did not start has exited already)
            proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        await asyncio.wait_for(draining, 30)
    raw = logged.decode()
    lines = [x for x in raw.splitlines() if x.strip()]
    events = [json.loads(x) for x in lines]  # every line is one JSON object

    # nothing the client sent or got back, and no key, is in the logs
    assert PROMPT not in raw and "PROMPT-TEXT" not in raw
    completion = json.loads(outputs[0])["choices"][0]["message"]["content"]
    assert completion and completion not in raw
    for secret in [k["key"] for k in KEYS] + [ADMIN, BOGUS_KEY]:
        assert secret not in raw, secret

    ok = [e for e in events if e.get("user") == "alice"]
    ids = {e["request_id"] for e in ok if e["event"] == "finished"}
    assert len(ids) == 2, ok
    for rid in ids:
        request_lines([e for e in ok if e.get("request_id") == rid], level, steps)
    rejected = {e["status"]: e for e in events if e["event"] == "rejected"}
    assert rejected[404]["code"] == "model_not_found" and rejected[404]["path"] == \
        "/v1/chat/completions"
    assert rejected[401]["code"] == "invalid_api_key"


def request_lines(lines_of: list[dict[str, Any]], level: str, steps: list[str]) -> None:
    """One served request's lines: ``steps`` in order, the last one with everything."""
    assert [e["event"] for e in lines_of] == steps, lines_of
    for e in lines_of:
        assert (e["model"], e["priority_class"]) == (MODEL, "interactive"), e
        assert e["level"] == ("info" if e["event"] == "finished" else "debug"), e
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", e["timestamp"]), e
    finished = lines_of[-1]  # everything an operator reads of a request, in one line
    assert finished["backend"] == "b1" and finished["completed"] is True, finished
    assert 0 <= finished["wait_s"] <= finished["latency_s"], finished
    assert isinstance(finished["vllm_priority"], int), finished
    assert finished["output_tokens"] == 5, finished
    if level == "debug":
        dispatched = lines_of[1]
        assert (dispatched["backend"], dispatched["vllm_priority"]) == \
            ("b1", finished["vllm_priority"]), (dispatched, finished)
        assert dispatched["wait_s"] == finished["wait_s"], (dispatched, finished)
