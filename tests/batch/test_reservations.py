"""``Reservations``: a batch line refused ``insufficient_quota`` tries again only once
another line's reservation settled (pure asyncio, no Redis)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.batch.runner import Reservations
from gateway.core.errors import InsufficientQuota


async def test_a_refused_line_waits_for_a_settle_and_fails_alone_without_one() -> None:
    res = Reservations()
    release = asyncio.Event()

    async def holder() -> None:  # a line admitted, its reservation held until it ends
        with res.entering():
            await release.wait()

    running = asyncio.create_task(holder())
    await asyncio.sleep(0)
    seen = res.settles
    with pytest.raises(InsufficientQuota), res.entering():  # a line refused meanwhile
        raise InsufficientQuota("over the day")
    assert res.settles == seen, f"a refused line counted as a settle: {res.settles}"
    waiting = asyncio.create_task(res.settled_since(seen))
    await asyncio.sleep(0.01)
    assert not waiting.done(), "gave up while another line still held its reservation"
    release.set()
    await running
    assert await asyncio.wait_for(waiting, 5) is True, "not woken by the settle"
    # nothing else in admission: the refusal is final at once
    seen = res.settles
    assert await asyncio.wait_for(res.settled_since(seen), 5) is False
