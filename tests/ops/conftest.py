"""Ops tests: a real gateway + simulator on loopback (fixtures shared with tests/gateway),
plus the system tools the checks need (promtool, chromium, chromedriver).

A missing tool fails the test. For a local run without them, set
FAIRGATE_OPS_TOOLS_OPTIONAL=1 to skip instead (ignored when CI is set).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import gateway, sim  # noqa: F401

ADMIN = "sk-admin"
INSTALL_HINT = "apt-get install -y prometheus chromium chromium-driver (see .ci/run)"


def require_tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    if os.environ.get("FAIRGATE_OPS_TOOLS_OPTIONAL") == "1" and not os.environ.get("CI"):
        pytest.skip(f"{name} not installed and FAIRGATE_OPS_TOOLS_OPTIONAL=1")
    pytest.fail(f"{name} is not installed: {INSTALL_HINT}; "
                "set FAIRGATE_OPS_TOOLS_OPTIONAL=1 to skip locally")


def admin_headers(key: str = ADMIN) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def admin_call(session: aiohttp.ClientSession, method: str, url: str,
                     key: str | None = ADMIN) -> tuple[int, Any]:
    headers = {} if key is None else admin_headers(key)
    async with session.request(method, url, headers=headers) as resp:
        return resp.status, await resp.json()


async def until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 10.0,
                what: str = "condition") -> None:
    """Poll an async predicate, bounded; fails with ``what`` on timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text → {(sample name, labels): value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(parsed: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float | None:
    return parsed.get((name, frozenset(labels.items())))


def total(parsed: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    """Sum over every series of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in parsed.items() if n == name and want <= ls)
