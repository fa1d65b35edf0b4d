"""``fairgate demo``: embedded Redis + two simulated H100 backends + the gateway.

Quiet by design: the banner is what a newcomer reads, so the log shows warnings only
(``FAIRGATE_LOG_LEVEL=info`` brings back the per-request lines), and the key pepper is
drawn per start (the demo's store lives only as long as the demo), so ``fairgate serve``'s
warning about a missing ``key_pepper`` does not apply.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import tempfile
from pathlib import Path
from typing import Any

import yaml

from gateway.core.logs import configure_logging
from gateway.core.settings import load_settings
from gateway.http.server import GatewayServer
from gateway.runtime.serve import fail, port_in_use, port_taken, port_taken_message
from gateway.runtime.workers import Supervisor, default_workers
from loadtest.sim.engine import EngineConfig
from loadtest.sim.server import SimServer

DEMO_MODEL = "llama-3.1-8b"
DEMO_ADMIN_KEY = "sk-admin"
DEMO_KEYS: list[dict[str, Any]] = [
    {"key": "sk-alice", "user": "alice", "priority_class": "interactive"},
    {"key": "sk-bob", "user": "bob", "priority_class": "interactive"},
    {"key": "sk-app", "user": "app", "priority_class": "default", "trusted_end_users": True},
    {"key": "sk-batch", "user": "batch", "priority_class": "batch"},
]

BANNER = """\
fairgate demo is up: {url}/v1  (model {model}, backends {backends})
keys: sk-alice, sk-bob (interactive), sk-app (default, end users via "user"), sk-batch (batch)
dashboard: {url}/dashboard?key={admin}  (admin key {admin})
try it from another terminal: make try{port_arg}  (one chat request with the openai SDK)
metrics: {url}/metrics   ready: {url}/ready   stop: Ctrl-C
logs: {level} and above (FAIRGATE_LOG_LEVEL=info: a line per request step)
"""


PORT_CHANGE = "pick another with --port (make run PORT=...)"
DEMO_LOG_LEVEL = "warning"


def log_level() -> str:
    """The demo's log level: ``FAIRGATE_LOG_LEVEL`` when set, else warnings only."""
    return os.environ.get("FAIRGATE_LOG_LEVEL") or DEMO_LOG_LEVEL


def banner(url: str, port: int, sims: list[SimServer]) -> str:
    return BANNER.format(url=url, model=DEMO_MODEL, admin=DEMO_ADMIN_KEY,
                         backends=", ".join(s.url for s in sims),
                         port_arg="" if port == 8000 else f" PORT={port}",
                         level=log_level())


async def run_demo(host: str, port: int, workers: int = 1) -> int:
    """Serve until SIGINT/SIGTERM (0), or 2 with one line when ``port`` is taken.

    ``workers`` > 1: that many gateway processes (``gateway/runtime/workers.py``) in front of the
    simulated backends, which stay in this process."""
    if port_taken(host, port):
        return fail(port_taken_message(host, port, PORT_CHANGE))
    configure_logging(log_level())
    sims = [SimServer(EngineConfig(model=DEMO_MODEL, scheduling_policy="priority"))
            for _ in range(2)]
    gateway: GatewayServer | None = None
    try:
        for sim in sims:
            await sim.start()
        config: dict[str, Any] = {
            "listen": {"host": host, "port": port},
            "backends": [{"name": f"sim{i}", "url": s.url, "model": DEMO_MODEL}
                         for i, s in enumerate(sims)],
            "api_keys": DEMO_KEYS,
            "admin_keys": [DEMO_ADMIN_KEY],
            "operations": {"log_level": log_level()},
            # the demo's store is new at each start: so may the pepper of its keys be
            "access": {"key_pepper": os.environ.get("FAIRGATE_ACCESS__KEY_PEPPER")
                       or os.environ.get("FAIRGATE_KEY_PEPPER") or secrets.token_hex(32)},
        }
        if workers > 1:
            with tempfile.TemporaryDirectory(prefix="fairgate-demo-") as tmp:
                path = Path(tmp) / "fairgate.yaml"
                path.write_text(yaml.safe_dump(config))
                supervisor = Supervisor(load_settings(path), str(path), workers)
                return await supervisor.run(lambda s: banner(s.url, s.port, sims))
        settings = load_settings(None, **config)
        gateway = GatewayServer(settings)
        try:
            await gateway.start()
        except OSError as exc:
            if not port_in_use(exc):
                raise
            return fail(port_taken_message(host, port, PORT_CHANGE))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(banner(gateway.url, gateway.port, sims), flush=True)
        await stop.wait()
        return 0
    finally:
        if gateway is not None:
            await gateway.stop()
        for sim in sims:
            await sim.stop()


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        "demo", help="embedded Redis + two simulated backends + the gateway")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="gateway processes (default: one per core; 1: in this process)")
    parser.set_defaults(
        run=lambda args: asyncio.run(run_demo(args.host, args.port, max(1, args.workers))))
    return parser
