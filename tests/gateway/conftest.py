"""A gateway in front of simulated vLLM backends, all on loopback, on a real Redis."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from openai.types.chat import ChatCompletionMessageParam

from gateway.core.settings import Settings, load_settings
from gateway.http.server import GatewayServer
from loadtest.sim.engine import EngineConfig
from loadtest.sim.server import SimServer

MODEL = "llama-3.1-8b"
KEYS = [
    {"key": "sk-alice", "user": "alice", "priority_class": "interactive"},
    {"key": "sk-bob", "user": "bob", "priority_class": "interactive"},
    {"key": "sk-carol", "user": "carol", "priority_class": "interactive"},
    {"key": "sk-dflt", "user": "dave", "priority_class": "default"},
    {"key": "sk-batch", "user": "bert", "priority_class": "batch"},
    {"key": "sk-app", "user": "app", "priority_class": "interactive", "trusted_end_users": True},
]

SimFactory = Callable[..., Awaitable[SimServer]]
GatewayFactory = Callable[..., Awaitable[GatewayServer]]


@pytest.fixture
async def sim() -> AsyncIterator[SimFactory]:
    started: list[SimServer] = []

    async def make(**overrides: Any) -> SimServer:
        reject = overrides.pop("reject_priority", False)
        runtime_lora = overrides.pop("allow_runtime_lora_updating", False)
        fail_on = overrides.pop("fail_on", None)
        config = EngineConfig(model=MODEL, **{"scheduling_policy": "priority", **overrides})
        server = SimServer(config, reject_priority=reject,
                           allow_runtime_lora_updating=runtime_lora, fail_on=fail_on)
        await server.start()
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop()


async def assert_settled(server: GatewayServer) -> None:
    """Every exit path must have released its in-flight state and queue entries."""
    store = server.services.store
    for _ in range(200):  # settle() runs as the handler unwinds: give it a bounded moment
        if await store.reads.user_inflight(MODEL) == {} and not any(
                (await store.reads.depths(MODEL)).values()):
            return
        await asyncio.sleep(0.01)
    assert await store.reads.user_inflight(MODEL) == {}
    assert await store.reads.depths(MODEL) == {"interactive": 0, "default": 0, "batch": 0}


async def complete(session: aiohttp.ClientSession, base_url: str, key: str, max_tokens: int,
                   prompt: str = "hello", **extra: Any) -> dict[str, Any]:
    """A non-streaming completion through the gateway; returns the JSON body."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            **extra}
    async with session.post(base_url + "/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as resp:
        data: dict[str, Any] = await resp.json()
        assert resp.status == 200, data
        return data


def gateway_settings(redis_url: str, backends: list[SimServer], **overrides: Any) -> Settings:
    """Backends ``b0``, ``b1``, … (``backend_options``: more fields of some, by name)."""
    options = overrides.pop("backend_options", {})
    values: dict[str, Any] = {
        "redis_url": redis_url,
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"name": f"b{i}", "url": s.url, "model": MODEL, **options.get(f"b{i}", {})}
                     for i, s in enumerate(backends)],
        "api_keys": KEYS,
        "scrape_interval_s": 0.02,
        "replica_heartbeat_s": 0.2,
    }
    values.update(overrides)
    return load_settings(None, **values)


@pytest.fixture
async def gateway(redis: aioredis.Redis, redis_url: str) -> AsyncIterator[GatewayFactory]:
    started: list[GatewayServer] = []

    async def make(backends: list[SimServer], **overrides: Any) -> GatewayServer:
        server = GatewayServer(gateway_settings(redis_url, backends, **overrides))
        await server.start()
        started.append(server)
        for handle in list(server.services.pool.handles.values()):  # discovery adds more
            await handle.scraped.wait()
        return server

    yield make
    for server in started:
        await assert_settled(server)
    for server in started:
        await server.stop()


# --------------------------------------------------------------------------- helpers shared
# by the test files here: raw HTTP calls, OpenAI error shape, bounded waits, a busy backend

CHAT = "/v1/chat/completions"
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
CONDITION_TIMEOUT_S = 15.0


async def until(condition: Callable[[], bool | Awaitable[bool]], what: str,
                timeout_s: float = CONDITION_TIMEOUT_S) -> None:
    """Await a condition (polled), failing the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if not isinstance(value, bool):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for: {what}")
        await asyncio.sleep(0.01)


async def store_is_idle(gw: GatewayServer) -> None:
    """Wait (bounded) until nothing is queued or in flight, then assert it."""
    store = gw.services.store

    async def idle() -> bool:
        return (await store.reads.user_inflight(MODEL) == {}
                and all(n == 0 for n in (await store.reads.depths(MODEL)).values()))

    await until(idle, "store counters back to zero")
    assert await store.reads.user_inflight(MODEL) == {}
    assert await store.reads.depths(MODEL) == {"interactive": 0, "default": 0, "batch": 0}


def auth(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


async def call(session: aiohttp.ClientSession, method: str, url: str, *,
               key: str | None = "sk-alice", json: Any = None, data: Any = None,
               headers: dict[str, str] | None = None
               ) -> tuple[int, dict[str, Any], Mapping[str, str]]:
    """One raw request; returns (status, decoded JSON body, response headers)."""
    hdrs = {**auth(key), **(headers or {})}
    async with session.request(method, url, json=json, data=data, headers=hdrs) as resp:
        body = await resp.json(content_type=None)
        return resp.status, body, resp.headers


def assert_error(body: dict[str, Any], *, type_: str, param: str | None = None,
                 code: str | None = None) -> str:
    """Check the OpenAI error shape exactly; returns the message."""
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["type"] == type_, err
    assert err["param"] == param, err
    assert err["code"] == code, err
    return str(err["message"])


def long_chat(tokens: int = 2000) -> dict[str, Any]:
    return {"model": MODEL, "messages": HI, "max_tokens": tokens, "ignore_eos": True}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


class BusyBackend:
    """Long requests occupying a ``max_num_seqs=1`` backend: one running, one waiting.

    With the interactive gate at ``max_waiting=1`` the gateway then sends nothing more,
    so further requests stay queued in Redis. Uses its own session so that closing it
    drops the long requests (the gateway then aborts them upstream and settles).
    """

    def __init__(self, gw: GatewayServer, backend: SimServer) -> None:
        self.gw, self.backend = gw, backend
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        self.tasks: list[asyncio.Task[Any]] = []

    def send(self, key: str, body: dict[str, Any] | None = None) -> asyncio.Task[Any]:
        task = asyncio.create_task(call(self.session, "POST", self.gw.url + CHAT, key=key,
                                        json=body or long_chat()))
        self.tasks.append(task)
        return task

    async def fill(self, key: str = "sk-alice") -> None:
        engine, handle = self.backend.engine, self.gw.services.pool.handles["b0"]
        self.send(key)
        await until(lambda: engine.num_running == 1, "first long request running")
        self.send(key)
        await until(lambda: engine.num_waiting == 1, "second long request waiting in vLLM")
        # the gateway's own view: a snapshot showing the waiting request closes the gate
        await until(lambda: handle.last is not None and handle.last.waiting == 1
                    and handle.last.running == 1, "a snapshot with the backend full")

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.session.close()


BusyFactory = Callable[[GatewayServer, SimServer], BusyBackend]


@pytest.fixture
async def busy() -> AsyncIterator[BusyFactory]:
    made: list[BusyBackend] = []

    def make(gw: GatewayServer, backend: SimServer) -> BusyBackend:
        made.append(BusyBackend(gw, backend))
        return made[-1]

    yield make
    for b in made:
        await b.close()


def dead_redis_url() -> str:
    """A Redis URL nothing listens on (connections are refused)."""
    return f"redis://127.0.0.1:{closed_port()}/0"
