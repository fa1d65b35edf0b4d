"""``fairgate_redis_commands_total``: every Redis command the gateway sends is counted at
the one Redis boundary, a Lua script by its name, pipelined commands too."""

from __future__ import annotations

import aiohttp
import redis.asyncio as aioredis

from gateway.core.metrics import GatewayMetrics
from gateway.storage.redis_client import connect
from tests.gateway.conftest import GatewayFactory, SimFactory, complete


def commands(metrics: GatewayMetrics) -> dict[tuple[str, str], float]:
    found: dict[tuple[str, str], float] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "fairgate_redis_commands_total":
                found[(sample.labels["command"], sample.labels["script"])] = sample.value
    return found


async def test_a_request_counts_its_scripts_by_name(sim: SimFactory, gateway: GatewayFactory
                                                     ) -> None:
    backend = await sim(profile="instant")
    gw = await gateway([backend])
    metrics = gw.services.metrics
    before = commands(metrics)
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            await complete(session, gw.url, "sk-alice", 2)
    after = commands(metrics)

    def sent(command: str, script: str = "") -> float:
        return after.get((command, script), 0.0) - before.get((command, script), 0.0)

    # the dispatch rides on the enqueue and the settle (tests/gateway/test_round_trips.py)
    for script in ("enqueue", "settle"):
        assert sent("EVALSHA", script) >= 3, (script, after)
    assert not any(script == "?" for _, script in after)  # every script known by name


async def test_plain_and_pipelined_commands_are_counted(redis: aioredis.Redis, redis_url: str
                                                        ) -> None:
    metrics = GatewayMetrics()
    client = connect(redis_url, metrics.redis)
    try:
        await client.set("fairgate-test:a", "1")
        pipe = client.pipeline(transaction=False)
        pipe.get("fairgate-test:a")
        pipe.get("fairgate-test:a")
        pipe.incr("fairgate-test:n")
        assert await pipe.execute() == ["1", "1", 1]
    finally:
        await client.aclose()
    found = commands(metrics)
    assert found[("SET", "")] == 1
    assert found[("GET", "")] == 2
    assert found[("INCRBY", "")] == 1
    pipelines = metrics.registry.get_sample_value(
        "fairgate_redis_command_duration_seconds_count", {"command": "PIPELINE"})
    assert pipelines == 1  # one round trip for the three
