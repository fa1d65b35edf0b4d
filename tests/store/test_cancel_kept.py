"""A cancelled task stops: neither a timed wait nor a Redis command swallows the
cancellation (Python 3.11's ``asyncio.wait_for`` returns normally when what it waits for
finishes as the task is cancelled, and redis-py sends every command through it once
``socket_timeout`` is set; a gateway whose loops ignored their cancellation never shut
down: tests/gateway/test_cli_serve.py). And a connection redis-py tore down under a
command is the store gone, not a bug of ours."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from gateway.core.waits import event_set
from gateway.storage.redis_client import connect, unavailable

TRIES = 60
STEP_S = 0.00005  # cancel 0, 50 µs, 100 µs, … after the command starts: its connect and send


async def test_a_wait_cancelled_as_its_event_is_set_is_cancelled() -> None:
    event = asyncio.Event()
    waiting = asyncio.create_task(event_set(event, 10.0))
    await asyncio.sleep(0)  # waiting on the event now
    event.set()
    waiting.cancel()  # in the same step: the wait ends both ways at once
    done, _ = await asyncio.wait([waiting], timeout=5.0)
    assert done and waiting.cancelled(), (
        f"the cancellation was lost: {waiting!r} returned "
        f"{waiting.result() if done else 'nothing yet'}")


async def test_a_wait_says_whether_its_event_came() -> None:
    event = asyncio.Event()
    assert await event_set(event, 0.01) is False
    asyncio.get_running_loop().call_soon(event.set)
    assert await event_set(event, 10.0) is True
    assert await event_set(event, None) is True  # set already: no wait


async def test_a_redis_command_cancelled_at_any_moment_is_cancelled(redis_url: str) -> None:
    swallowed: list[float] = []
    cancelled = 0
    for step in range(TRIES):
        client = connect(redis_url, socket_timeout=5.0, socket_connect_timeout=2,
                         health_check_interval=10)  # as gateway/services.py builds it
        try:
            command = asyncio.create_task(client.get("fg:test:cancel-kept"))
            await asyncio.sleep(step * STEP_S)
            if not command.cancel():
                continue  # it had finished already
            done, _ = await asyncio.wait([command], timeout=10.0)
            if command.cancelled():
                cancelled += 1
            else:
                swallowed.append(step * STEP_S)
                assert done, f"a command cancelled {step * STEP_S * 1e6:.0f} µs in hangs"
        finally:
            await client.aclose()
    assert not swallowed, (
        f"commands returned normally although cancelled, at "
        f"{[f'{s * 1e6:.0f} µs' for s in swallowed]} (of {TRIES})")
    assert cancelled > 0, "every command finished before its cancellation: nothing checked"


async def test_a_connection_torn_down_under_redis_py_reads_as_the_store_gone() -> None:
    """redis-py's cluster pipeline sent on a connection another task had closed in a
    failover: ``AttributeError`` from inside redis-py (its writer is None) is the store
    going away, a 503 the client may retry; the same error from our own code is a bug and
    surfaces as one."""
    connection = aioredis.Connection()  # never connected: no writer, as one torn down
    with pytest.raises(AttributeError) as inside:
        await connection._send_packed_command([b"PING"])
    assert unavailable(inside.value), inside.value
    try:
        None.writelines  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as ours:
        assert not unavailable(ours), ours
