"""fairgate needs Redis 7.0 (issue 43, item 4): on 6.2 ``SET … NX GET`` fails, so runtime
keys answered 503 "syntax error" and unknown keys 503 instead of 401. The start refuses
such a store in one line; the check passes on the real servers the suite runs."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from gateway.core.metrics import GatewayMetrics
from gateway.core.settings import RedisCluster
from gateway.storage.redis_client import connect, connect_cluster
from gateway.storage.store_version import (
    StoreTooOld,
    check_store_version,
    server_name,
    servers,
    version_problem,
)
from tests.gateway.conftest import KEYS, MODEL
from tests.gateway.test_cli_serve import _one_line, _run


@pytest.mark.parametrize(("info", "refused"), [
    ({"redis_version": "6.2.5"}, "runs Redis 6.2.5; fairgate needs Redis 7.0 (or Valkey 7.2) "
                                 "or later"),
    ({"redis_version": "6.0.16"}, "runs Redis 6.0.16"),
    ({"redis_version": "5.0.14"}, "runs Redis 5.0.14"),
    ({"redis_version": "7.0.0"}, None),
    ({"redis_version": "7.4.2"}, None),
    ({"redis_version": "10.0.1"}, None),  # compared as numbers, not as text
    ({"redis_version": "7.2.4", "valkey_version": "8.1.0"}, None),
    ({"redis_version": "7.2.4", "valkey_version": "7.2.5"}, None),
    ({"redis_version": "unknown"}, None),  # not a version: not judged
])
def test_the_minimum_version(info: dict[str, str], refused: str | None) -> None:
    problem = version_problem(info)
    if refused is None:
        assert problem is None, problem
    else:
        assert problem is not None and refused in problem, problem


def test_a_cluster_answer_is_read_per_node() -> None:
    answer = {"10.0.0.1:6379": {"redis_version": "7.2.4"},
              "10.0.0.2:6379": {"redis_version": "6.2.5"}}
    found = sorted(str(s["redis_version"]) for s in servers(answer))
    assert found == ["6.2.5", "7.2.4"], found
    assert server_name({"redis_version": "7.2.4", "valkey_version": "8.1.0"}) == \
        "Valkey 8.1.0 (redis_version 7.2.4)"


async def test_the_suites_servers_pass(redis_url: str, cluster_nodes: list[str]) -> None:
    client = connect(redis_url)
    try:
        info = await client.info("server")
        assert version_problem(info) is None, server_name(info)
        await check_store_version(client, redis_url)
    finally:
        await client.aclose()
    metrics = GatewayMetrics()
    cluster = connect_cluster(RedisCluster(nodes=cluster_nodes), metrics.redis)
    try:
        await check_store_version(cluster, "cluster")
        nodes = len(cluster.get_nodes())  # type: ignore[attr-defined]
        asked = metrics.registry.get_sample_value(
            "fairgate_redis_commands_total", {"command": "INFO", "script": ""})
        assert nodes >= 3 and asked == 1 + nodes, f"INFO sent {asked} times, {nodes} nodes"
    finally:
        await cluster.aclose()


@contextlib.asynccontextmanager
async def redis_62() -> AsyncIterator[str]:
    """A server that speaks RESP as Redis 6.2.5 would to what a start sends: PING, INFO
    naming its version, anything else an error (6.2 refuses ``SET … NX GET`` as "syntax
    error"; CLIENT SETINFO, new in 7.2, as unknown, which redis-py ignores). Its URL."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                count = int((await reader.readline())[1:])
                words = []
                for _ in range(count):
                    size = int((await reader.readline())[1:])
                    words.append((await reader.readexactly(size + 2))[:-2].decode())
                if words[0].upper() == "INFO":
                    text = b"# Server\r\nredis_version:6.2.5\r\nredis_mode:standalone\r\n"
                    writer.write(b"$%d\r\n%s\r\n" % (len(text), text))
                elif words[0].upper() == "PING":  # redis-py's health check
                    writer.write(b"+PONG\r\n")
                else:
                    writer.write(b"-ERR syntax error\r\n")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0"
    finally:
        server.close()
        await server.wait_closed()


async def test_serve_refuses_a_redis_62_in_one_line(tmp_path: Path) -> None:
    async with redis_62() as url:
        with pytest.raises(StoreTooOld, match=r"runs Redis 6\.2\.5"):
            client = connect(url)
            try:
                await check_store_version(client, url)
            finally:
                await client.aclose()
        path = tmp_path / "fairgate.yaml"
        path.write_text(yaml.safe_dump({
            "redis_url": url, "listen": {"host": "127.0.0.1", "port": 0},
            "backends": [{"name": "b1", "url": "http://127.0.0.1:9", "model": MODEL}],
            "api_keys": KEYS, "data_dir": str(tmp_path), "workers": 1}))
        code, out, err = await _run(sys.executable, "-m", "gateway.runtime.cli", "serve",
                                    "--config", str(path))
    assert (code, out) == (2, ""), (code, out, err)
    line = _one_line(err)
    assert line == (f"fairgate: the store at {url} runs Redis 6.2.5; fairgate needs Redis "
                    "7.0 (or Valkey 7.2) or later"), line
