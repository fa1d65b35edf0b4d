"""``fairgate sim`` as a process: parses its flags, serves, exits cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import re
import signal
import sys

import aiohttp

from loadtest.cli import build_parser
from loadtest.sim.cli import config_from_args


def test_flags_map_to_engine_config() -> None:
    args = build_parser().parse_args(
        ["sim", "--port", "0", "--model", "m", "--profile", "cpu-tiny", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "512", "--scheduling-policy", "priority",
         "--kv-blocks", "100", "--max-model-len", "1024", "--reject-priority", "--seed", "7"]
    )  # fmt: skip
    config = config_from_args(args)
    assert config.cost.name == "cpu-tiny"
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (8, 512)
    assert config.scheduling_policy == "priority"
    assert (config.num_kv_blocks, config.model_len, config.seed) == (100, 1024, 7)
    assert args.reject_priority is True


async def test_serves_until_sigterm() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loadtest", "sim", "--port", "0", "--model", "m",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        match = re.search(r"on (http://\S+)", line)
        assert match, line
        async with (
            aiohttp.ClientSession() as http,
            http.get(match.group(1) + "/v1/models") as resp,
        ):
            assert (await resp.json())["data"][0]["id"] == "m"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
