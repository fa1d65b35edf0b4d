"""The chaos tier's fixtures (the gateway's), and the event loops a test may ask for.

A test marked ``@pytest.mark.asyncio(loop_factories=list(LOOPS))`` runs once on each loop
``fairgate serve`` may pick (asyncio's own, and uvloop when installed: the ``dev`` and
``fast`` extras install it); every other test runs on asyncio's loop, as before."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Mapping

import pytest

from tests.gateway.conftest import gateway, sim  # noqa: F401  (shared fixtures)

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def _loops() -> dict[str, LoopFactory]:
    loops: dict[str, LoopFactory] = {"asyncio": asyncio.new_event_loop}
    if importlib.util.find_spec("uvloop") is not None:
        import uvloop

        loops["uvloop"] = uvloop.new_event_loop
    return loops


LOOPS = ("asyncio", "uvloop")  # a loop not installed is skipped, saying so


def pytest_asyncio_loop_factories(config: pytest.Config,
                                  item: pytest.Item) -> Mapping[str, LoopFactory]:
    marker = item.get_closest_marker("asyncio")
    if marker is not None and marker.kwargs.get("loop_factories"):
        return _loops()
    return {"asyncio": asyncio.new_event_loop}
