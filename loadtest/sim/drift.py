"""Measure how far the simulator's wall-clock steps drift from its model under load.

Starts ``fairgate sim`` in a subprocess (or uses ``--url``), runs N concurrent streaming
clients from this process, then reads the server's step statistics (``/debug/steps``)::

    python -m loadtest.sim.drift --clients 256 --requests 3 --max-tokens 200

Prints one JSON object: client-side counts and throughput, the server's step stats
(p50/p99/max of actual/modelled step time, totals) and the server's CPU seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import aiohttp

MODEL = "drift"
_PROMPT_IDS = itertools.count()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _wait_ready(http: aiohttp.ClientSession, url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with http.get(url + "/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.1)  # polling a process we do not control


async def _client(http: aiohttp.ClientSession, url: str, body: dict[str, Any], n: int) -> int:
    frames = 0
    for _ in range(n):
        # A distinct first block per request: no prefix-cache hits, every prompt computed.
        prompt = f"{next(_PROMPT_IDS):08d}{body['prompt'][8:]}"
        async with http.post(url + "/v1/completions", json={**body, "prompt": prompt}) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if b'"finish_reason":null' in line:
                    frames += 1
    return frames


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run the load against ``url`` and collect client and server numbers."""
    body = {
        "model": MODEL,
        "prompt": "x" * (4 * args.prompt_tokens),
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        await _wait_ready(http, url)
        started = time.monotonic()
        frames = await asyncio.gather(
            *(_client(http, url, body, args.requests) for _ in range(args.clients))
        )
        elapsed = time.monotonic() - started
        async with http.get(url + "/debug/steps") as resp:
            steps = await resp.json()
    tokens = sum(frames)
    expected = args.clients * args.requests * args.max_tokens
    return {
        "clients": args.clients,
        "requests": args.clients * args.requests,
        "tokens_received": tokens,
        "tokens_expected": expected,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 1),
        "steps": steps,
    }


def _server_command(args: argparse.Namespace, port: int) -> list[str]:
    return [
        sys.executable, "-m", "loadtest", "sim", "--port", str(port), "--model", MODEL,
        "--profile", args.profile, "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m loadtest.sim.drift``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="use a running simulator instead of starting one")
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--requests", type=int, default=3, help="sequential requests per client")
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--profile", default="h100-llama3.1-8b")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    if args.url:
        result = asyncio.run(measure(args.url, args))
        print(json.dumps(result, indent=2))
        return 0
    port = _free_port()
    proc = subprocess.Popen(_server_command(args, port), stdout=subprocess.DEVNULL)
    try:
        cpu_before = _cpu_seconds(proc.pid)
        result = asyncio.run(measure(f"http://127.0.0.1:{port}", args))
        result["server_cpu_s"] = round(_cpu_seconds(proc.pid) - cpu_before, 2)
        result["server_cpu_share"] = round(result["server_cpu_s"] / result["elapsed_s"], 2)
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
