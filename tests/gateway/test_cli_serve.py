"""`fairgate serve --config FILE` (and `fairgate demo`) as real processes: embedded Redis
defaults, and the one-line refusals of a setup that cannot work."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml

from gateway.core.settings import load_settings
from gateway.runtime import cli
from gateway.storage.embedded_redis import free_port
from loadtest.demo import BANNER
from tests.gateway.conftest import KEYS, MODEL, SimFactory, complete

# a process start and stop, bounded: a hang fails, a loaded runner is slow
START_S = 90.0


@pytest.mark.timeout(300)
async def test_serve_from_yaml_with_embedded_redis(sim: SimFactory, tmp_path: Path) -> None:
    backend = await sim(profile="instant")
    port = free_port()
    config = {"listen": {"host": "127.0.0.1", "port": port},
              "backends": [{"name": "b1", "url": backend.url, "model": MODEL}],
              "api_keys": KEYS, "data_dir": str(tmp_path)}
    path = tmp_path / "fairgate.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.runtime.cli", "serve", "--config", str(path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "FAIRGATE_SCRAPE_INTERVAL_S": "0.02"})
    assert proc.stdout is not None and proc.stderr is not None
    try:
        # a loaded CI runner (a vLLM server compiling beside) took over 30 s to start it
        line = await asyncio.wait_for(proc.stdout.readline(), START_S)
        assert line.decode().strip() == f"fairgate listening on http://127.0.0.1:{port}"
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            for _ in range(300):  # until the first scrape made the backend healthy
                async with session.get(base + "/ready") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.02)
            data = await complete(session, base, "sk-alice", 3)
            assert data["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), START_S) == 0
    logs = [json.loads(x) for x in (await proc.stderr.read()).decode().splitlines()
            if x.startswith("{")]
    redis_url = next(e["url"] for e in logs if e["event"] == "embedded_redis_started")
    client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=1)
    try:
        try:
            await client.ping()
            raise AssertionError("embedded Redis outlived the gateway")
        except (ConnectionError, OSError, aioredis.ConnectionError):
            pass
    finally:
        await client.aclose()
    assert not any(e.get("level") == "error" for e in logs)


def _env(**extra: str) -> dict[str, str]:
    """This environment without FAIRGATE_* settings (a developer's shell may set some)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FAIRGATE_") or k.startswith("FAIRGATE_TEST_")}
    return {**env, **extra}


FAIRGATE = str(Path(sys.executable).with_name("fairgate"))  # the console script


async def _run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=env or _env())
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _listening_socket() -> socket.socket:
    """A port some other program already listens on."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def _one_line(stderr: str) -> str:
    """The one line a person reads on stderr (the log's JSON lines before it aside)."""
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("{")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


async def test_serve_on_a_port_in_use_says_so_in_one_line(tmp_path: Path) -> None:
    with _listening_socket() as taken:
        port = taken.getsockname()[1]
        path = tmp_path / "fairgate.yaml"
        path.write_text(yaml.safe_dump({
            "listen": {"host": "127.0.0.1", "port": port},
            "backends": [{"name": "b1", "url": "http://127.0.0.1:9", "model": MODEL}],
            "api_keys": KEYS, "data_dir": str(tmp_path), "log_level": "warning"}))
        code, out, err = await _run(sys.executable, "-m", "gateway.runtime.cli", "serve",
                                     "--config", str(path))
    assert code == 2
    assert out == ""
    line = _one_line(err)
    assert f"port {port} on 127.0.0.1 is already in use" in line
    assert "listen.port" in line and "FAIRGATE_LISTEN__PORT" in line


@pytest.mark.parametrize(("config", "missing"), [
    ({"api_keys": KEYS}, "no backends configured"),
    ({"backends": [{"name": "b1", "url": "http://127.0.0.1:9", "model": MODEL}]},
     "no api_keys configured"),
    (None, "no backends and no api_keys configured"),
])
async def test_serve_without_backends_or_keys_refuses_to_start(
        tmp_path: Path, config: dict[str, object] | None, missing: str) -> None:
    args = [sys.executable, "-m", "gateway.runtime.cli", "serve"]
    if config is not None:
        path = tmp_path / "fairgate.yaml"
        path.write_text(yaml.safe_dump(config))
        args += ["--config", str(path)]
    code, out, err = await _run(*args)
    assert code == 2
    assert out == ""
    line = _one_line(err)
    assert missing in line
    assert (str(tmp_path / "fairgate.yaml") if config is not None else "--config") in line


@pytest.mark.parametrize(("change", "problem"), [
    ({"backends": [{"name": "b1", "url": "http://127.0.0.1:9", "model": MODEL},
                   {"name": "b2", "url": "http://127.0.0.1:10", "model": MODEL,
                    "role": "prefill"}]}, "backends.1.role: unknown key"),
    ({"classes": {"batch": {"max_waiting": -5}}},
     "classes.batch.max_waiting: Input should be greater than or equal to 0"),
    ({"backends": [{"name": "..", "url": "ftp://127.0.0.1:9", "model": MODEL}]},
     "backends.0.url: must be an http:// or https:// URL with a host"),
])
async def test_serve_with_an_invalid_config_names_the_setting_in_one_line(
        tmp_path: Path, change: dict[str, object], problem: str) -> None:
    """issue 43: the key and its place on one line, exit status 2, no traceback."""
    path = tmp_path / "fairgate.yaml"
    path.write_text(yaml.safe_dump({
        "backends": [{"name": "b1", "url": "http://127.0.0.1:9", "model": MODEL}],
        "api_keys": KEYS, "data_dir": str(tmp_path), **change}))
    code, out, err = await _run(sys.executable, "-m", "gateway.runtime.cli", "serve",
                                "--config", str(path))
    assert (code, out) == (2, ""), (code, out, err)
    line = _one_line(err)
    assert line.startswith(f"fairgate: config file {str(path)!r} is invalid: "), line
    assert problem in line, line


async def test_serve_with_invalid_settings_from_the_environment_says_so(
        tmp_path: Path) -> None:
    """Without a config file, a FAIRGATE_* variable at fault is one line too (a
    traceback before)."""
    env = _env(FAIRGATE_CLASSES='{"default": {"max_queue_wait_s": -1}}',
               FAIRGATE_DATA_DIR=str(tmp_path))
    code, out, err = await _run(sys.executable, "-m", "gateway.runtime.cli", "serve", env=env)
    assert (code, out) == (2, ""), (code, out, err)
    line = _one_line(err)
    assert line == ("fairgate: invalid settings: classes.default.max_queue_wait_s: Input "
                    "should be greater than 0"), line


async def test_serve_with_a_missing_config_file_says_so(tmp_path: Path) -> None:
    code, _, err = await _run(sys.executable, "-m", "gateway.runtime.cli", "serve", "--config",
                              str(tmp_path / "nope.yaml"))
    assert code == 2
    assert "config file not found" in _one_line(err)


async def test_demo_on_a_port_in_use_names_the_port_and_the_flag(tmp_path: Path) -> None:
    with _listening_socket() as taken:
        port = taken.getsockname()[1]
        code, out, err = await _run(FAIRGATE, "demo", "--port", str(port),
                                    env=_env(FAIRGATE_LOG_LEVEL="warning"))
    assert code == 2
    assert "fairgate demo is up" not in out
    line = _one_line(err)
    assert f"port {port} on 127.0.0.1 is already in use" in line and "--port" in line


@pytest.mark.timeout(300)
async def test_demo_banner_names_the_dashboard_and_the_admin_key(tmp_path: Path) -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        FAIRGATE, "demo", "--port", str(port),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, cwd=tmp_path,
        env=_env(FAIRGATE_LOG_LEVEL="warning"))
    assert proc.stdout is not None
    try:
        banner = [(await asyncio.wait_for(proc.stdout.readline(), START_S)).decode()
                  for _ in range(5)]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), START_S) == 0
    url = f"http://127.0.0.1:{port}"
    assert banner[0].startswith(f"fairgate demo is up: {url}/v1")
    assert f"dashboard: {url}/dashboard?key=sk-admin" in banner[2]
    assert "admin key sk-admin" in banner[2]
    assert f"make try PORT={port}" in banner[3]


@pytest.mark.timeout(300)
async def test_demo_opens_with_its_banner_and_stays_quiet_per_request(tmp_path: Path) -> None:
    """What `make run` shows: the banner first (no log lines before it, no key_pepper
    warning), then at most one line for a request, shutdown included."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        FAIRGATE, "demo", "--port", str(port), "--workers", "2",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=tmp_path,
        env=_env())
    assert proc.stdout is not None
    url = f"http://127.0.0.1:{port}"
    head: list[str] = []
    try:
        while not head or "stop: Ctrl-C" not in head[-1]:  # the banner's 5th line
            line = await asyncio.wait_for(proc.stdout.readline(), START_S)
            assert line, f"the demo ended before its banner: {head}"
            head.append(line.decode())
        assert head[0].startswith(f"fairgate demo is up: {url}/v1"), f"first lines: {head}"
        head.append((await asyncio.wait_for(proc.stdout.readline(), START_S)).decode())
        assert head[-1].startswith("logs: warning and above"), f"first lines: {head}"
        async with aiohttp.ClientSession() as http:
            answer = await complete(http, url, "sk-alice", 5)
        assert answer["usage"]["completion_tokens"] == 5, answer
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = await asyncio.wait_for(proc.communicate(), START_S)
    assert proc.returncode == 0, rest
    assert len(head) == len(BANNER.splitlines()), f"first lines: {head}"
    after = rest.decode().splitlines()
    assert len(after) <= 1, f"{len(after)} lines after the banner for one request: {after}"
    assert "key_pepper" not in "".join(head) + rest.decode(), f"{head} {after}"


async def test_a_bind_lost_after_the_check_stops_what_started(
        redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _listening_socket() as taken:
        port = taken.getsockname()[1]
        settings = load_settings(
            None, redis_url=redis_url, listen={"host": "127.0.0.1", "port": port},
            backends=[{"name": "b1", "url": "http://127.0.0.1:9", "model": MODEL}],
            api_keys=KEYS, data_dir=tmp_path)
        before = set(asyncio.all_tasks())
        assert await cli.run_gateway(settings) == 2
    assert set(asyncio.all_tasks()) == before  # scrape, dispatch and batch loops stopped
    line = _one_line(capsys.readouterr().err)
    assert f"port {port} on 127.0.0.1 is already in use" in line
