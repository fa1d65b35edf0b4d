"""``fairgate sim``: run a simulated vLLM server until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys
from typing import Any

from gateway.backends.vllm_metrics import WANTED
from loadtest.sim.disagg import (
    DEFAULT_TRANSFER_BYTES_PER_S,
    DEFAULT_TRANSFER_LATENCY_S,
    ROLES,
    KVTransfer,
)
from loadtest.sim.embeddings import DEFAULT_DIMENSIONS
from loadtest.sim.engine import EngineConfig
from loadtest.sim.kv_publisher import KVEventsConfig
from loadtest.sim.lora import parse_lora_module
from loadtest.sim.profiles import DEFAULT_PROFILE, PROFILES, Profile
from loadtest.sim.scheduler import POLICIES
from loadtest.sim.server import SimServer

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


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
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    parser.add_argument(
        "--max-loras", type=int, default=1, help="distinct adapters in one batch (vLLM's)"
    )
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument(
        "--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
        help="adapters loaded at start: name=path or JSON {\"name\", \"path\"}",
    )  # fmt: skip
    parser.add_argument(
        "--lora-load-s", type=float, default=0.0,
        help="how long a runtime POST /v1/load_lora_adapter takes",
    )  # fmt: skip
    parser.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        default=os.environ.get(RUNTIME_LORA_ENV, "").lower() in ("1", "true"),
        help=f"serve /v1/load_lora_adapter and /v1/unload_lora_adapter "
        f"(default: vLLM's {RUNTIME_LORA_ENV} environment variable)",
    )  # fmt: skip
    parser.add_argument(
        "--step-overhead-ms", type=float, default=0.0,
        help="added to the modelled time of every engine step (a slower engine, e.g. "
        "for streams that must last on a loaded machine)",
    )  # fmt: skip
    parser.add_argument(
        "--metrics", choices=("all", "gateway"), default="all",
        help="what GET /metrics shows: all of vLLM's families, or only the samples "
        "fairgate's scraper reads (cheap to render: many simulators in one process)",
    )  # fmt: skip
    parser.add_argument(
        "--role", choices=ROLES, default="both",
        help="disaggregated prefill/decode: a prefill server (vLLM's kv_producer) answers "
        "kv_transfer_params to do_remote_decode; a decode server (kv_consumer) takes them "
        "and pulls the prompt's KV instead of computing it; both: colocated (default)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-transfer-gbps", type=float, default=DEFAULT_TRANSFER_BYTES_PER_S / 1e9,
        help="a decode server's modelled KV pull rate, GB/s (128 KiB of KV per token)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-transfer-latency-ms", type=float, default=DEFAULT_TRANSFER_LATENCY_S * 1000,
        help="a decode server's modelled fixed cost per KV pull",
    )  # fmt: skip
    parser.add_argument(
        "--kv-events-config", default=None, metavar="JSON",
        help="vLLM's flag: publish KV-cache events over ZMQ, e.g. '{\"enable_kv_cache_events\": "
        "true, \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' "
        "(needs pyzmq, the sim extra)",
    )  # fmt: skip
    parser.set_defaults(run=run)
    return parser


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the engine config from parsed arguments."""
    return EngineConfig(
        model=args.model,
        profile=slowed(PROFILES[args.profile], args.step_overhead_ms / 1000),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy,
        kv_blocks=args.kv_blocks,
        max_model_len=args.max_model_len,
        seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        lora_modules=tuple(parse_lora_module(item) for item in args.lora_modules),
        lora_load_s=args.lora_load_s,
        kv_events=KVEventsConfig.parse(args.kv_events_config) if args.kv_events_config else None,
        kv_transfer=KVTransfer(
            role=args.role,
            bytes_per_s=args.kv_transfer_gbps * 1e9,
            latency_s=args.kv_transfer_latency_ms / 1000,
        ),
    )


def slowed(profile: Profile, extra_s: float) -> Profile:
    """``profile`` with ``extra_s`` more fixed cost per step."""
    if extra_s == 0:
        return profile
    if extra_s < 0:
        raise ValueError(f"--step-overhead-ms must be at least 0, got {extra_s * 1000:g}")
    return dataclasses.replace(profile, step_overhead_s=profile.step_overhead_s + extra_s)


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
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
            metrics_only=WANTED if args.metrics == "gateway" else None,
        )
        for i in range(args.count)
    ]
    asyncio.run(serve(*servers))
    return 0
