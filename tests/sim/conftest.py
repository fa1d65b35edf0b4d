"""Fixtures: in-process simulator servers on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from loadtest.sim.engine import EngineConfig
from loadtest.sim.server import SimServer

MODEL = "sim-model"
ServerFactory = Callable[..., Awaitable[SimServer]]


@pytest.fixture
async def make_server() -> AsyncIterator[ServerFactory]:
    """Start ``SimServer``s with config overrides; all are stopped after the test."""
    servers: list[SimServer] = []

    async def factory(
        reject_priority: bool = False, allow_runtime_lora_updating: bool = False,
        **overrides: Any,
    ) -> SimServer:
        options: dict[str, Any] = {"model": MODEL, "profile": "instant", **overrides}
        server = SimServer(
            EngineConfig(**options), reject_priority=reject_priority,
            allow_runtime_lora_updating=allow_runtime_lora_updating,
        )  # fmt: skip
        await server.start()
        servers.append(server)
        return server

    yield factory
    for server in servers:
        await server.stop()


@pytest.fixture
async def server(make_server: ServerFactory) -> SimServer:
    """A default server with the zero-cost profile."""
    return await make_server()
