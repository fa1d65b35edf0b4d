"""A request whose connection to its backend fails before anything was sent is queued
once more and served by another backend; the dead backend's gates close at once."""

from __future__ import annotations

import aiohttp

from gateway.storage.keys import ModelKeys
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory, complete


async def test_connection_refused_is_retried_on_another_backend(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    first, second = await sim(profile="instant"), await sim(profile="instant")
    # slow scrapes and long-lived snapshots: b0 still looks open after it died
    gw = await gateway([first, second], scrape_interval_s=5.0, snapshot_stale_s=30.0)
    await first.stop()  # b0 refuses connections now; its last snapshot says it is idle
    b0 = gw.services.pool.handles["b0"]
    assert b0.gates["interactive"].open
    async with aiohttp.ClientSession() as http:
        data = await complete(http, gw.url, "sk-alice", 3)
    assert data["usage"]["completion_tokens"] == 3
    assert len(second.engine.records) == 1  # served by b1
    assert not b0.gates["interactive"].open and b0.gates["interactive"].reason == "stale"
    # the refused attempt cost alice nothing: her fairness score is one request's service
    saved = await gw.services.store.client.hget(ModelKeys(MODEL).saved("interactive"), "alice")
    expected = gw.services.policy.service(data["usage"]["prompt_tokens"], 3, 1.0)
    assert abs(float(saved) - expected) < 1e-9, (saved, expected)
