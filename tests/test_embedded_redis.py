from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections import deque

import pytest
import redis as redis_sync

from gateway.storage import embedded_redis
from gateway.storage.embedded_redis import EmbeddedRedis, EmbeddedRedisError


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_starts_answers_and_stops_without_leftovers() -> None:
    server = EmbeddedRedis().start()
    assert server.process is not None
    pid = server.process.pid
    data_dir = server.data_dir
    client = redis_sync.Redis.from_url(server.url)
    assert client.ping()
    client.set("k", "v")
    assert client.get("k") == b"v"
    client.close()
    server.stop()
    assert not _alive(pid)
    assert not data_dir.exists()


def test_server_dies_with_a_killed_parent() -> None:
    script = textwrap.dedent(
        """
        import sys, time
        from gateway.storage.embedded_redis import EmbeddedRedis
        s = EmbeddedRedis().start()
        print(s.process.pid, s.port, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child_pid, port = (int(x) for x in parent.stdout.readline().split())
    assert redis_sync.Redis(port=port).ping()
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the kernel's process table: no event to await
    assert not _alive(child_pid)


def test_port_in_use_fails_clearly() -> None:
    with EmbeddedRedis() as first:
        with pytest.raises(EmbeddedRedisError):
            EmbeddedRedis(port=first.port, start_timeout_s=3).start()


async def test_fixture_gives_clean_database(redis) -> None:  # type: ignore[no-untyped-def]
    assert await redis.dbsize() == 0
    await redis.set("leftover", 1)


def test_free_port_never_hands_out_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two picks drew one port: the second is drawn again (a cluster node once got its
    own port as its bus port and exited with ``Address already in use``)."""
    draws = iter([5, 5, 6])
    monkeypatch.setattr(embedded_redis.secrets, "randbelow", lambda n: next(draws))
    monkeypatch.setattr(embedded_redis, "_bindable", lambda host, port: True)
    monkeypatch.setattr(embedded_redis, "_handed_out", deque(maxlen=8))  # this test's own
    ports = [embedded_redis.free_port(), embedded_redis.free_port()]
    low = embedded_redis.PICK_FROM
    assert ports == [low + 5, low + 6], ports


def test_free_port_skips_a_bound_port_and_stays_below_the_ephemeral_range(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A port another socket holds is drawn again; every port comes from below the range
    the kernel gives outgoing connections their local ports from (one of those took a
    port picked for a gateway before it bound it)."""
    taken, spare = embedded_redis.free_port(), embedded_redis.free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        low = embedded_redis.PICK_FROM
        draws = iter([taken - low, spare - low])
        monkeypatch.setattr(embedded_redis.secrets, "randbelow", lambda n: next(draws))
        monkeypatch.setattr(embedded_redis, "_handed_out", deque(maxlen=8))
        port = embedded_redis.free_port()
    assert port == spare, (taken, spare, port)
    ephemeral = embedded_redis._ephemeral_start()
    assert low <= taken < ephemeral, (taken, ephemeral)
