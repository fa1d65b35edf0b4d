"""The event loop ``fairgate serve`` runs: uvloop when installed (a runtime dependency on
CPython outside Windows), asyncio's own when asked or when uvloop is missing, and a log
line naming it."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
from structlog.testing import capture_logs

from gateway.core import event_loop

HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None


async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_when_asked() -> None:
    with capture_logs() as logs:
        module = event_loop.run(loop_module(), "asyncio")
    assert module.startswith("asyncio")
    assert {"event": "event_loop", "loop": "asyncio", "log_level": "info"} in logs


@pytest.mark.skipif(not HAS_UVLOOP, reason="uvloop not installed")
def test_uvloop_by_default_when_installed() -> None:
    with capture_logs() as logs:
        module = event_loop.run(loop_module())
    assert module.startswith("uvloop")
    assert {"event": "event_loop", "loop": "uvloop", "log_level": "info"} in logs


def test_auto_without_uvloop_is_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvloop" else real(name, *a))
    assert event_loop.loop_factory("auto") == ("asyncio", None)
    with pytest.raises(RuntimeError, match="fairgate\\[fast\\]"):
        event_loop.loop_factory("uvloop")
