"""LoRA in the simulator, as vLLM 0.32 serves it: adapter slots per step, the load and
unload endpoints, /v1/models with ``parent``, the 404 for an unknown adapter and the
``vllm:lora_requests_info`` gauge."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.cli import build_parser
from loadtest.sim.cli import config_from_args
from loadtest.sim.engine import EngineConfig
from loadtest.sim.lora import parse_lora_module
from loadtest.sim.profiles import PROFILES
from loadtest.sim.scheduler import Scheduler, SchedulerLimits
from loadtest.sim.sequence import Sequence
from loadtest.sim.server import SimServer
from tests.sim.conftest import MODEL, ServerFactory

_arrival = itertools.count()
STATIC = (("sql", "/adapters/sql"), ("chat", "/adapters/chat"))


def seq(request_id: str, lora: str | None, output: int = 3) -> Sequence:
    return Sequence(request_id, 0, float(next(_arrival)), 8, output, lora=lora)


def step(sched: Scheduler) -> set[str]:
    plan = sched.schedule()
    sched.update(plan)
    return {c.seq.request_id for c in plan.chunks}


def test_a_step_runs_at_most_max_loras_adapters() -> None:
    sched = Scheduler(SchedulerLimits(max_loras=1))
    for s in (seq("a1", "a"), seq("b1", "b"), seq("a2", "a"), seq("base", None)):
        sched.add(s)
    # b1 needs a second slot: skipped, while a2 and the base request behind it go in
    assert step(sched) == {"a1", "a2", "base"}
    assert [s.request_id for s in sched.waiting.ordered()] == ["b1"]
    assert sched.lora_activity() == {"a": (0, 2), "b": (1, 0)}
    while sched.running:
        step(sched)
    assert step(sched) == {"b1"}, "b1 runs once adapter a left the batch"


def test_skipped_requests_keep_their_place() -> None:
    sched = Scheduler(SchedulerLimits(max_loras=2, max_num_seqs=1))
    for s in (seq("a", "a", output=2), seq("b", "b"), seq("c", "c"), seq("d", "d")):
        sched.add(s)
    step(sched)
    assert [s.request_id for s in sched.waiting.ordered()] == ["b", "c", "d"]


def test_mixed_adapters_cost_more_per_step() -> None:
    profile = PROFILES["h100-llama3.1-8b"]
    none, one, two = (profile.lora_time_s(n, 16) for n in (0, 1, 2))
    assert none == 0.0 and 0 < one < two, (none, one, two)
    # rank 16 on Llama-3.1-8B: 84 MB of weights per adapter at 3.35 TB/s
    assert two - one == pytest.approx(2 * 81_920 * 32 * 16 / 3.35e12), two - one


def test_flags_map_to_engine_config() -> None:
    args = build_parser().parse_args(
        ["sim", "--model", "m", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8",
         "--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/chat"}',
         "--lora-load-s", "0.5", "--allow-runtime-lora-updating"]
    )  # fmt: skip
    config = config_from_args(args)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 3, 8)
    assert config.lora_modules == (("sql", "/a/sql"), ("chat", "/a/chat"))
    assert config.lora_load_s == 0.5 and args.allow_runtime_lora_updating
    with pytest.raises(ValueError, match="Invalid --lora-modules"):
        parse_lora_module("no-equals-sign")
    with pytest.raises(ValueError, match="need enable_lora"):
        EngineConfig(model="m", lora_modules=STATIC)


@pytest.mark.parametrize("flag", ["--max-num-seqs", "--max-num-batched-tokens", "--kv-blocks",
                                  "--max-model-len", "--max-lora-rank"])
def test_an_engine_of_no_size_is_refused(flag: str) -> None:
    args = build_parser().parse_args(["sim", "--model", "m", flag, "0"])
    name = flag[2:].replace("-", "_")
    with pytest.raises(ValueError, match=f"{name} must be at least 1, got 0"):
        config_from_args(args)  # `fairgate sim` prints it as one line and exits 2


async def post(server: SimServer, path: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(server.url + path, json=body) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.text()


async def models(server: SimServer) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.get(server.url + "/v1/models") as resp:
        return list((await resp.json())["data"])


async def test_static_adapters_are_listed_and_served(make_server: ServerFactory) -> None:
    server = await make_server(enable_lora=True, lora_modules=STATIC)
    cards = await models(server)
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        (MODEL, MODEL, None), ("sql", "/adapters/sql", MODEL), ("chat", "/adapters/chat", MODEL)
    ], cards
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as oai:
        answer = await oai.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert answer.model == "sql", answer.model
        with pytest.raises(openai.NotFoundError) as missing:
            await oai.completions.create(model="nope", prompt="hi", max_tokens=3)
    assert missing.value.body == {
        "message": f"The model `nope` does not exist. Valid aliases: {MODEL}.",
        "type": "NotFoundError", "param": "model", "code": 404,
    }, missing.value.body  # fmt: skip


async def test_runtime_load_and_unload_like_vllm(make_server: ServerFactory) -> None:
    server = await make_server(
        enable_lora=True, lora_load_s=0.05, allow_runtime_lora_updating=True
    )
    loop = asyncio.get_running_loop()
    started = loop.time()
    load = asyncio.ensure_future(
        post(server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"})
    )
    assert "sql" not in [c["id"] for c in await models(server)], "listed before its load ended"
    assert await load == (200, "Success: LoRA adapter 'sql' added successfully.")
    assert loop.time() - started >= 0.05, "the load took less than lora_load_s"
    assert [c["parent"] for c in await models(server)] == [None, MODEL]
    invalid = "InvalidUserInput"
    cases: list[tuple[str, dict[str, Any], int, str, str]] = [
        ("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"}, 400, invalid,
         "The lora adapter 'sql' has already been loaded. If you want to load the adapter "
         "in place, set 'load_inplace' to True."),
        ("/v1/load_lora_adapter", {"lora_name": MODEL, "lora_path": "/x"}, 400, invalid,
         f"The lora adapter '{MODEL}' conflicts with a served base model."),
        ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "/x"}, 400, invalid,
         "Both 'lora_name' and 'lora_path' must be provided."),
        ("/v1/unload_lora_adapter", {"lora_name": "other"}, 404, "NotFoundError",
         "The lora adapter 'other' cannot be found."),
        ("/v1/unload_lora_adapter", {"lora_name": ""}, 400, invalid,
         "'lora_name' needs to be provided to unload a LoRA adapter."),
    ]  # fmt: skip
    for path, body, status, kind, message in cases:
        got = await post(server, path, body)
        assert got == (status, {"error": {"message": message, "type": kind, "param": None,
                                          "code": status}}), (path, body, got)  # fmt: skip
    status, missing = await post(server, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and "lora_path" in missing["error"]["message"], missing
    inplace = {"lora_name": "sql", "lora_path": "/a/sql2", "load_inplace": True}
    assert (await post(server, "/v1/load_lora_adapter", inplace))[0] == 200
    assert await post(server, "/v1/unload_lora_adapter", {"lora_name": "sql"}) == (
        200, "Success: LoRA adapter 'sql' removed successfully.")  # fmt: skip
    assert [c["id"] for c in await models(server)] == [MODEL]
    assert (server.loras.loads, server.loras.unloads) == (2, 1)


async def test_runtime_endpoints_need_the_flag(make_server: ServerFactory) -> None:
    server = await make_server(enable_lora=True)
    status, _ = await post(server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"})
    assert status == 404, status


def lora_info(text: str) -> dict[str, str]:
    """The labels of the newest ``vllm:lora_requests_info`` series (its value: a time)."""
    samples = [
        s for f in text_string_to_metric_families(text) for s in f.samples
        if s.name == "vllm:lora_requests_info"
    ]  # fmt: skip
    assert samples, "no vllm:lora_requests_info"
    return dict(max(samples, key=lambda s: s.value).labels)


async def scrape(http: aiohttp.ClientSession, server: SimServer) -> str:
    async with http.get(server.url + "/metrics") as resp:
        return await resp.text()


async def test_slots_and_the_gauge_over_http(make_server: ServerFactory) -> None:
    server = await make_server(
        profile="h100-llama3.1-8b", enable_lora=True, max_loras=1, lora_modules=STATIC
    )
    engine = server.engine
    endless = {"prompt": "hi", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as http:
        assert lora_info(await scrape(http, server)) == {
            "max_lora": "1", "waiting_lora_adapters": "", "running_lora_adapters": ""}
        sql = await http.post(server.url + "/v1/completions", json={"model": "sql", **endless})
        await sql.content.readuntil(b"\n\n")
        chat = await http.post(server.url + "/v1/completions", json={"model": "chat", **endless})
        assert chat.status == 200
        await asyncio.wait_for(engine.wait_until(lambda: len(engine.records) == 2), 10)
        # the one slot is sql's: a base-model request still runs, chat's waits
        async with http.post(server.url + "/v1/completions",
                             json={"model": MODEL, "prompt": "x", "max_tokens": 2}) as base:
            assert base.status == 200 and (await base.json())["model"] == MODEL
        assert (engine.num_running, engine.num_waiting) == (1, 1), engine.lora_activity()
        labels = lora_info(await scrape(http, server))
        assert labels == {"max_lora": "1", "waiting_lora_adapters": "sql,chat",
                          "running_lora_adapters": "sql,chat"}, labels  # fmt: skip
        sql.close()
        await asyncio.wait_for(chat.content.readuntil(b"\n\n"), 10)  # chat got the slot
        chat.close()
        await asyncio.wait_for(engine.wait_until(lambda: engine.num_running == 0), 10)
        labels = lora_info(await scrape(http, server))
    assert labels["running_lora_adapters"] == "", labels


async def test_without_lora_an_adapter_name_is_unknown(server: SimServer) -> None:
    text = (await post(server, "/v1/completions", {"model": "sql", "prompt": "x"}))[1]
    assert text["error"]["code"] == 404, text
    async with aiohttp.ClientSession() as http:
        assert "lora_requests_info" not in await scrape(http, server)
