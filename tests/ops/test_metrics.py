"""/metrics after real traffic: names pass promtool's lint, values follow the traffic."""

from __future__ import annotations

import asyncio
import json
import subprocess

import aiohttp

from gateway.core.metrics import GatewayMetrics
from gateway.core.user_series import OTHER_USERS, UserLabels
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory, complete
from tests.ops.conftest import ADMIN, admin_call, require_tool, samples, total, until, value


async def stream(session: aiohttp.ClientSession, base_url: str, key: str,
                 max_tokens: int) -> int:
    """A streamed chat completion; returns the number of content frames received."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    frames = 0
    async with session.post(base_url + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                frames += bool(delta.get("content"))
    return frames


async def scrape(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(base_url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


async def test_metrics_follow_traffic_and_pass_promtool(sim: SimFactory,
                                                        gateway: GatewayFactory) -> None:
    promtool = require_tool("promtool")
    backend = await sim()
    gw = await gateway([backend], admin_keys=[ADMIN])
    async with aiohttp.ClientSession() as http:
        frames = await asyncio.gather(stream(http, gw.url, "sk-alice", 8),
                                      stream(http, gw.url, "sk-bob", 8))
        assert frames == [8, 8]
        await complete(http, gw.url, "sk-dflt", 4)
        await complete(http, gw.url, "sk-batch", 3)
        async with http.post(gw.url + "/v1/completions", json={},
                             headers={"Authorization": "Bearer sk-nope"}) as resp:
            assert resp.status == 401
        text = await scrape(http, gw.url)

    lint = await asyncio.to_thread(subprocess.run, [promtool, "check", "metrics"],
                                   input=text.encode(), capture_output=True, timeout=60,
                                   check=False)
    assert lint.returncode == 0, (lint.stdout + lint.stderr).decode()

    m = samples(text)
    # streams: TTFT and TPOT per class as the client saw them
    assert value(m, "fairgate_time_to_first_token_seconds_count",
                 priority_class="interactive") == 2
    assert value(m, "fairgate_time_per_output_token_seconds_count",
                 priority_class="interactive") == 2
    ttft = value(m, "fairgate_time_to_first_token_seconds_sum", priority_class="interactive")
    duration = value(m, "fairgate_request_duration_seconds_sum", priority_class="interactive")
    assert ttft is not None and duration is not None and 0 < ttft < duration
    tpot = value(m, "fairgate_time_per_output_token_seconds_sum", priority_class="interactive")
    assert tpot is not None and 0 < tpot / 2 < 1.0
    # non-streamed requests have no TTFT sample, but a duration
    assert value(m, "fairgate_time_to_first_token_seconds_count", priority_class="batch") is None
    assert value(m, "fairgate_request_duration_seconds_count", priority_class="batch") == 1
    # dispatches, their vLLM priority rank, and queue waits
    assert total(m, "fairgate_dispatches_total", backend="b0") == 4
    assert total(m, "fairgate_dispatch_priority_rank_count") == 4
    assert total(m, "fairgate_queue_wait_seconds_count") == 4
    # per-user tokens and fairness counters
    for user in ("alice", "bob"):
        assert value(m, "fairgate_user_tokens_total", model=MODEL, user=user,
                     kind="completion") == 8
        assert value(m, "fairgate_user_requests_total", model=MODEL, user=user) == 1
    service = value(m, "fairgate_user_service_total", model=MODEL, user="dave")
    prompt = value(m, "fairgate_user_tokens_total", model=MODEL, user="dave", kind="prompt")
    assert service is not None and prompt is not None and service == prompt * 1 + 4 * 2
    # backend snapshot and gates
    assert value(m, "fairgate_backend_healthy", backend="b0") == 1
    assert value(m, "fairgate_backend_drained", backend="b0") == 0
    for klass in ("interactive", "default", "batch"):
        assert value(m, "fairgate_gate_open", backend="b0", priority_class=klass) in (0, 1)
    # errors by status/type and Redis latency
    assert value(m, "fairgate_errors_total", status="401", type="invalid_request_error",
                 code="invalid_api_key") == 1
    assert total(m, "fairgate_redis_command_duration_seconds_count", command="EVALSHA") > 0
    assert value(m, "fairgate_queue_depth", model=MODEL, priority_class="interactive") == 0


async def test_queue_gauges_and_drained_gate_while_held(sim: SimFactory,
                                                        gateway: GatewayFactory) -> None:
    backend = await sim()
    gw = await gateway([backend], admin_keys=[ADMIN])
    registry = gw.services.metrics.registry
    async with aiohttp.ClientSession() as http:
        status, _ = await admin_call(http, "POST", gw.url + "/admin/backends/b0/drain")
        assert status == 200

        async def drained_gate() -> bool:
            return registry.get_sample_value("fairgate_gate_closed_reason", {
                "backend": "b0", "priority_class": "interactive", "reason": "drained"}) == 1
        await until(drained_gate, what="the drained gate in /metrics")
        held = [asyncio.create_task(complete(http, gw.url, key, 2))
                for key in ("sk-alice", "sk-alice", "sk-bob")]

        async def queued() -> bool:
            m = samples(await scrape(http, gw.url))
            return value(m, "fairgate_queue_depth", model=MODEL,
                         priority_class="interactive") == 3
        await until(queued, what="3 queued requests in /metrics")
        m = samples(await scrape(http, gw.url))
        oldest = value(m, "fairgate_queue_oldest_wait_seconds", model=MODEL,
                       priority_class="interactive")
        assert oldest is not None and oldest > 0
        assert value(m, "fairgate_gate_open", backend="b0", priority_class="interactive") == 0

        async def drained_time() -> bool:
            # charged when the next snapshot is recorded (the one after the drain's)
            drained_s = value(samples(await scrape(http, gw.url)),
                              "fairgate_gate_closed_seconds_total", backend="b0",
                              priority_class="interactive", reason="drained")
            return drained_s is not None and drained_s > 0
        await until(drained_time, what="the drained gate's closed time in /metrics")
        assert not any(t.done() for t in held)

        status, _ = await admin_call(http, "POST", gw.url + "/admin/backends/b0/undrain")
        assert status == 200
        await asyncio.gather(*held)
        m = samples(await scrape(http, gw.url))
        assert value(m, "fairgate_queue_depth", model=MODEL, priority_class="interactive") == 0
        assert value(m, "fairgate_gate_closed_reason", backend="b0",
                     priority_class="interactive", reason="drained") == 0


async def test_per_user_series_are_bounded(sim: SimFactory, gateway: GatewayFactory) -> None:
    backend = await sim()
    gw = await gateway([backend], metrics_top_users=2)
    async with aiohttp.ClientSession() as http:
        for key in ("sk-alice", "sk-bob", "sk-carol", "sk-dflt"):
            await complete(http, gw.url, key, 3)
        for end_user in ("u1", "u2", "u3"):
            await complete(http, gw.url, "sk-app", 3, user=end_user)
        m = samples(await scrape(http, gw.url))
    users = {dict(labels)["user"] for (name, labels) in m
             if name == "fairgate_user_tokens_total"}
    assert users == {"alice", "bob", OTHER_USERS}
    assert value(m, "fairgate_user_tokens_total", model=MODEL, user=OTHER_USERS,
                 kind="completion") == 5 * 3
    # nothing is lost to the bound: per-user series add up to the model's totals
    assert total(m, "fairgate_user_tokens_total", kind="completion") == value(
        m, "fairgate_tokens_total", model=MODEL, kind="completion") == 7 * 3


def test_idle_users_give_their_series_to_active_ones() -> None:
    labels = UserLabels(top_n=1, idle_s=10.0)
    assert labels.label("a", 0.0) == ("a", [])
    assert labels.label("b", 5.0) == (OTHER_USERS, [])
    assert labels.label("a", 6.0) == ("a", [])
    assert labels.label("b", 17.0) == ("b", ["a"])  # a idle for 11 s
    metrics = GatewayMetrics(top_users=1, user_idle_s=-1.0)
    metrics.dispatch.on_dispatch(MODEL, "b0", "interactive", "a", 0)
    metrics.dispatch.on_dispatch(MODEL, "b0", "interactive", "b", 0)
    r = metrics.registry
    assert r.get_sample_value("fairgate_user_requests_total", {"model": MODEL, "user": "a"}) \
        is None
    assert r.get_sample_value("fairgate_user_requests_total", {"model": MODEL, "user": "b"}) == 1
    metrics.usage.users._next_sweep = 0.0  # the next newcomer may sweep at once
    metrics.dispatch.on_dispatch(MODEL, "b0", "interactive", "a", 0)  # a takes the slot back
    back = r.get_sample_value("fairgate_user_requests_total", {"model": MODEL, "user": "a"})
    assert back == 1, f"a's series, removed and begun again, reads {back}"
