"""``fairgate demo``: embedded Redis + two simulated H100 backends + the gateway."""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

from gateway.server import GatewayServer
from gateway.settings import load_settings
from loadtest.sim.engine import EngineConfig
from loadtest.sim.server import SimServer

DEMO_MODEL = "llama-3.1-8b"
DEMO_KEYS: list[dict[str, Any]] = [
    {"key": "sk-alice", "user": "alice", "priority_class": "interactive"},
    {"key": "sk-bob", "user": "bob", "priority_class": "interactive"},
    {"key": "sk-app", "user": "app", "priority_class": "default", "trusted_end_users": True},
    {"key": "sk-batch", "user": "batch", "priority_class": "batch"},
]

BANNER = """\
fairgate demo is up: {url}/v1  (model {model}, backends {backends})
keys: sk-alice, sk-bob (interactive), sk-app (default, end users via "user"), sk-batch (batch)
try:
  python -c 'import openai; c = openai.OpenAI(base_url="{url}/v1", api_key="sk-alice"); \\
print(c.chat.completions.create(model="{model}", \\
messages=[{{"role": "user", "content": "hi"}}]).choices[0].message.content)'
metrics: {url}/metrics   ready: {url}/ready   stop: Ctrl-C
"""


async def run_demo(host: str, port: int) -> None:
    sims = [SimServer(EngineConfig(model=DEMO_MODEL, scheduling_policy="priority"))
            for _ in range(2)]
    for sim in sims:
        await sim.start()
    settings = load_settings(
        None,
        listen={"host": host, "port": port},
        backends=[{"name": f"sim{i}", "url": s.url, "model": DEMO_MODEL}
                  for i, s in enumerate(sims)],
        api_keys=DEMO_KEYS,
        admin_keys=["sk-admin"],
    )
    gateway = GatewayServer(settings)
    await gateway.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(BANNER.format(url=gateway.url, model=DEMO_MODEL,
                        backends=", ".join(s.url for s in sims)), flush=True)
    try:
        await stop.wait()
    finally:
        await gateway.stop()
        for sim in sims:
            await sim.stop()


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        "demo", help="embedded Redis + two simulated backends + the gateway")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.set_defaults(run=lambda args: asyncio.run(run_demo(args.host, args.port)) or 0)
    return parser
