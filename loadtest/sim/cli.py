"""``fairgate sim``: run a simulated vLLM server until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

from loadtest.sim.embeddings import DEFAULT_DIMENSIONS
from loadtest.sim.engine import EngineConfig
from loadtest.sim.profiles import DEFAULT_PROFILE, PROFILES
from loadtest.sim.scheduler import POLICIES
from loadtest.sim.server import SimServer


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register the ``sim`` subcommand on an argparse subparsers object."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "sim", help="run a simulated vLLM server", description=__doc__
    )
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument(
        "--count", type=int, default=1,
        help="servers in this process, on --port, --port + 1, … (port 0: each a free one)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--scheduling-policy", choices=POLICIES, default="fcfs")
    parser.add_argument("--kv-blocks", type=int, default=None, help="default: the profile's")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the profile's")
    parser.add_argument(
        "--reject-priority", action="store_true", help="answer 400 to non-zero priority"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="automatic prefix caching, as in vLLM V1 (default: on)",
    )  # fmt: skip
    parser.add_argument(
        "--enable-prompt-tokens-details", action="store_true",
        help="report the prompt's cached tokens in usage, as vLLM's flag does",
    )  # fmt: skip
    parser.add_argument(
        "--embedding-dimensions", type=int, default=DEFAULT_DIMENSIONS,
        help="length of /v1/embeddings vectors",
    )  # fmt: skip
    parser.set_defaults(run=run)
    return parser


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the engine config from parsed arguments."""
    return EngineConfig(
        model=args.model,
        profile=args.profile,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy,
        kv_blocks=args.kv_blocks,
        max_model_len=args.max_model_len,
        seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
    )


async def serve(*servers: SimServer) -> None:
    """Run ``servers`` until SIGINT or SIGTERM; one line each names its URL."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        for server in servers:
            await server.start()
            print(f"fairgate sim: serving {server.config.model!r} on {server.url}", flush=True)
        await stop.wait()
    finally:
        for server in servers:
            await server.stop()


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fairgate sim``."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"fairgate sim: {exc}", file=sys.stderr)
        return 2
    if args.embedding_dimensions < 1:
        print("fairgate sim: --embedding-dimensions must be at least 1", file=sys.stderr)
        return 2
    if args.count < 1:
        print("fairgate sim: --count must be at least 1", file=sys.stderr)
        return 2
    servers = [
        SimServer(
            config,
            host=args.host,
            port=args.port + i if args.port else 0,
            reject_priority=args.reject_priority,
            embedding_dimensions=args.embedding_dimensions,
        )
        for i in range(args.count)
    ]
    asyncio.run(serve(*servers))
    return 0
