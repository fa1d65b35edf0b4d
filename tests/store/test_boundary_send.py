"""The Redis boundary's own costs cut without changing what is sent: replies are parsed by
hiredis, a command is written
in the calling task (no ``asyncio.wait_for`` task per command, gateway/storage/connection.py),
a script's arguments are encoded by orjson where it writes what ``json.dumps`` did, and
each latency child is kept per command."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
from redis._parsers.hiredis import _AsyncHiredisParser

from gateway.core.metrics import GatewayMetrics
from gateway.storage.connection import InPlaceConnection
from gateway.storage.redis_client import connect
from gateway.storage.scripts import encode_args


async def test_a_command_is_sent_without_a_wait_for_task(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    client = connect(redis_url, socket_timeout=5.0, socket_connect_timeout=2)
    waited: list[Any] = []
    real = asyncio.wait_for

    async def recording(aw: Any, *limit: Any, **named: Any) -> Any:
        waited.append(aw)
        return await real(aw, *limit, **named)

    try:
        await client.ping()  # type: ignore[misc]  # connected: its first send is redis-py's
        monkeypatch.setattr(asyncio, "wait_for", recording)
        await client.set("fairgate-test:send", "1")
        assert await client.get("fairgate-test:send") == "1"
        pipe = client.pipeline(transaction=True)
        pipe.incr("fairgate-test:sent")
        pipe.get("fairgate-test:send")
        assert (await pipe.execute())[1] == "1"
        pooled = client.connection_pool._available_connections
        kinds = {type(c) for c in pooled}
        parsers = {type(c._parser) for c in pooled}
    finally:
        await client.aclose()
    assert kinds == {InPlaceConnection}, kinds
    # hiredis (a dependency) parses the replies, not redis-py's Python parser
    assert parsers == {_AsyncHiredisParser}, parsers
    assert not waited, f"{len(waited)} sends went through asyncio.wait_for: {waited}"


async def test_a_script_arguments_read_the_same_in_lua(redis: aioredis.Redis) -> None:
    """What Lua's cjson decodes from orjson's bytes is what it decoded from json.dumps's
    text; what orjson would write otherwise (NaN as null, a None, a 70-bit integer) is
    json.dumps's text as before."""
    args = {"user": "zoë 🚀", "n": 3, "x": 0.1, "big": 1e16, "small": 1e-05, "ok": True,
            "list": [1, "a", {"k": 2.5}], "empty": []}
    encoded = encode_args(args)
    assert isinstance(encoded, bytes) and orjson.loads(encoded) == args
    echo = "return cjson.encode(cjson.decode(ARGV[1]))"
    ours = await redis.eval(echo, 0, encoded)  # type: ignore[misc]
    before = await redis.eval(echo, 0, json.dumps(args))  # type: ignore[misc]
    assert json.loads(ours) == json.loads(before), (ours, before)
    for odd in ({"x": float("nan")}, {"x": float("inf")}, {"x": None},
                {"n": 2 ** 70}, {"u": "\ud800"}):
        assert encode_args(odd) == json.dumps(odd), odd


def test_latency_children_are_kept_per_command_and_blocking_reads_skipped() -> None:
    metrics = GatewayMetrics()
    redis_metrics = metrics.redis
    for _ in range(3):
        redis_metrics.observe("GET", 0.001)
    redis_metrics.observe("blpop", 1.0)

    def count(command: str) -> float | None:
        return metrics.registry.get_sample_value(
            "fairgate_redis_command_duration_seconds_count", {"command": command})

    assert count("GET") == 3, count("GET")
    assert count("BLPOP") is None, count("BLPOP")
