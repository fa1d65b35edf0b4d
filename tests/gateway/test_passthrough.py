"""What reaches vLLM: the client's body untouched, plus fairgate's own priority."""

from __future__ import annotations

import aiohttp

from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory
from tests.gateway.test_errors import BrokenBackend


async def test_unknown_fields_pass_through_and_priority_is_fairgates(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    echo = BrokenBackend(await sim(profile="instant"), "echo")
    await echo.start()
    try:
        gw = await gateway([echo])  # type: ignore[list-item]  # only .url is used
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5, "top_k": 7, "guided_json": {"type": "object"},
                "priority": -100, "vendor_extension": {"nested": [1, 2]}}
        async with aiohttp.ClientSession() as session:
            async with session.post(gw.url + "/v1/chat/completions", json=body,
                                    headers={"Authorization": "Bearer sk-dflt"}) as resp:
                assert resp.status == 200
                got = (await resp.json())["echo"]
    finally:
        await echo.stop()
    sent = {k: v for k, v in body.items() if k != "priority"}
    assert {k: got[k] for k in sent} == sent  # every field, unknown ones included, unchanged
    assert got["priority"] == 1000  # default class base + rank 0; the client's -100 is gone
