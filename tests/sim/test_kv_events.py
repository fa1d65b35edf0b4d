"""The simulator publishes vLLM's KV events (``--kv-events-config``): numbered batches on
a PUB socket and a replay socket, in vLLM's wire format, with vLLM's block hashes, so the
gateway's index built from them equals the simulator's own cache."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from gateway.backends.kv_events import decode_batch, decode_seq, decode_wire
from loadtest.sim.kv_publisher import KVEventsConfig
from loadtest.sim.server import SimServer
from policies.kv_blocks import external, external_hashes
from policies.kv_index import KVBlockIndex, Removed, Stored
from tests.sim.conftest import MODEL, ServerFactory

zmq = pytest.importorskip("zmq")


async def post(server: SimServer, body: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as http, http.post(
            server.url + "/v1/completions", json={"model": MODEL, **body}) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def replay(endpoint: str, start: int) -> list[list[bytes]]:
    """Every message the replay socket sends for ``start``, the end marker last."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        messages = []
        while True:
            message = await sock.recv_multipart()
            messages.append(message)
            if decode_seq(message[2]) == -1:
                return messages
    finally:
        sock.close()
        ctx.term()


def prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 7 + i * 13) % 30000 + 4 for i in range(n)]


async def test_events_rebuild_the_servers_cache_exactly(make_server: ServerFactory) -> None:
    config = KVEventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                            topic="kv")
    # 8 blocks of 16 tokens: the third 40-token prompt evicts the first one's blocks
    server = await make_server(kv_events=config, kv_blocks=8)
    publisher = server._engine.kv_publisher
    assert publisher is not None
    prompts = [prompt(1), prompt(2), prompt(1)[:32] + prompt(3)[:24], prompt(4), prompt(5)]
    for ids in prompts:
        await post(server, {"prompt": ids, "max_tokens": 2})
    replay_endpoint = publisher.replay_endpoint()
    assert replay_endpoint is not None
    messages = await replay(replay_endpoint, 0)
    *batches, end = messages
    assert end == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""], end
    seqs = [decode_seq(m[2]) for m in batches]
    assert seqs == list(range(len(batches))) and seqs, seqs
    assert all(m[1] == b"kv" for m in batches)

    index = KVBlockIndex()
    stored: list[Stored] = []
    removed = 0
    for message in batches:
        decode_wire(message[3])  # vLLM's structs
        _ts, events = decode_batch(message[3])
        stored += [e for e in events if isinstance(e, Stored)]
        removed += sum(1 for e in events if isinstance(e, Removed))
        index.receive("sim", decode_seq(message[2]), events)
    assert removed > 0, "the small cache evicted nothing"
    # vLLM's hashes of the prompts' token ids, as a real server would publish them
    assert list(stored[0].hashes) == external_hashes(prompts[0], 16), stored[0]
    assert stored[0].token_ids == tuple(prompts[0][:32]) and stored[0].parent is None
    shared = [e for e in stored if e.parent is not None]
    assert shared and shared[0].parent == external_hashes(prompts[0], 16)[1], shared
    pool = server._engine.scheduler.pool
    held = {external(h) for h in pool._cached}
    view = index.view("sim")
    assert view is not None and view.state == "exact", view
    assert set(view.holders) == held, (sorted(view.holders), sorted(held))
    tokens = index.cached_tokens(lambda size: external_hashes(prompts[-1], size), ["sim"])
    assert tokens == {"sim": 32}, tokens


async def test_no_publisher_without_the_flag(server: SimServer) -> None:
    assert server._engine.kv_publisher is None
    assert server._engine.scheduler.pool.take_events() == []


def test_the_flag_parses_like_vllms() -> None:
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false}') is None
    parsed = KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "t", "hwm": 5}')
    assert parsed == KVEventsConfig(topic="t"), parsed
