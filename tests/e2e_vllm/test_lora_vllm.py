"""LoRA adapters on two real vLLM servers (CPU, the tiny model, ``--enable-lora
--max-loras 2``, runtime loading allowed) through fairgate (``docs/adapters.md``).

Three tiny random adapters are written at test time (``make_tiny_adapter.py``): ``a``
is loaded on cpu0 and ``b`` on cpu1 at start (``--lora-modules``), ``c`` on neither. All
three are configured as runtime adapters (the gateway may load them). By vLLM's own
counters and listings:

- requests for a resident adapter go where it is loaded (no load anywhere);
- concurrent requests for ``c`` make the gateway load it once, on one server (vLLM's
  log line for each load: its HTTP metrics leave ``/v1/load_lora_adapter`` out, their
  excluded handler ``/load`` being a pattern that matches it), where they all run;
- while requests of every adapter run, the gateway's view of each server (its
  ``/metrics``: adapters loaded and active, slots) is what vLLM shows (its
  ``vllm:lora_requests_info`` gauge and ``/v1/models``); once they end, both show none
  active.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from gateway.backends.adapters import adapters_in_cards
from gateway.backends.vllm_metrics import LORA_INFO
from gateway.core.settings import load_settings
from gateway.http.server import GatewayServer
from tests.e2e_vllm.conftest import (
    SERVED_MODEL,
    VllmServer,
    _stop,
    launch,
    skip_requested,
    wait_healthy,
)
from tests.e2e_vllm.make_tiny_adapter import write_adapter
from tests.gateway.conftest import KEYS

pytestmark = pytest.mark.vllm

LORA_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
RUNTIME_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
MAX_NUM_SEQS = 4  # 2 cores, two servers: small batches
LOADED = re.compile(r"Loaded new LoRA adapter: name '([^']*)'")  # vLLM logs each load
LONG_TOKENS = 2000  # streams held open while compared (the context is 2,048)
WAIT_S = 60.0


@dataclass(frozen=True)
class LoraFleet:
    servers: list[VllmServer]  # cpu0 with ``a`` loaded, cpu1 with ``b``
    paths: dict[str, Path]  # a, b, c


@pytest.fixture(scope="module")
def lora_fleet(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraFleet]:
    """Two LoRA servers, started together, stopped after the module."""
    if skip_requested():
        pytest.skip("FAIRGATE_SKIP_VLLM=1")
    python = request.getfixturevalue("vllm_python")
    model_dir = request.getfixturevalue("tiny_model_dir")
    root = tmp_path_factory.mktemp("adapters")
    paths = {name: write_adapter(root / name, seed, str(model_dir))
             for seed, name in enumerate(("a", "b", "c"), start=1)}
    launched = [
        launch(python, model_dir, tmp_path_factory, MAX_NUM_SEQS,
               (*LORA_FLAGS, "--lora-modules", f"{name}={paths[name]}"), extra_env=RUNTIME_ENV)
        for name in ("a", "b")]
    try:
        for server in launched:
            wait_healthy(server)
        yield LoraFleet([s.server for s in launched], paths)
    finally:
        for server in launched:
            _stop(server.proc)


async def vllm_view(http: httpx.AsyncClient, server: VllmServer) -> dict[str, object]:
    """What vLLM shows: its adapters (/v1/models), its LoRA gauge's newest series (labels),
    its finished requests and the adapters it logged a load of, with their count."""
    models = (await http.get(server.api + "/models", timeout=30)).json()["data"]
    text = (await http.get(server.url + "/metrics", timeout=30)).text
    gauge: dict[str, str] | None = None  # the newest series' labels (its value: a time)
    newest = float("-inf")
    finished = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == LORA_INFO and s.value >= newest:
                newest, gauge = s.value, dict(s.labels)
            elif s.name == "vllm:request_success_total":
                finished += s.value
    loads: dict[str, int] = {}
    for name in LOADED.findall(server.log.read_text(errors="replace")):
        loads[name] = loads.get(name, 0) + 1
    return {"adapters": set(adapters_in_cards(models, server.model)), "gauge": gauge,
            "finished": finished, "loads": loads}


def gauge_sets(labels: object) -> tuple[str | None, set[str], set[str]]:
    """(max_lora, running, waiting) of a gauge series' labels (None: no series)."""
    if not isinstance(labels, dict):
        return None, set(), set()

    def names(key: str) -> set[str]:
        return set(str(labels.get(key, "")).split(",")) - {""}

    return (labels.get("max_lora"), names("running_lora_adapters"),
            names("waiting_lora_adapters"))


async def gateway_view(http: httpx.AsyncClient, gw: GatewayServer
                       ) -> dict[str, dict[str, object]]:
    """What the gateway believes, by its /metrics: per backend, the adapters loaded and
    active there and its slots."""
    text = (await http.get(gw.url + "/metrics", timeout=30)).text
    view: dict[str, dict[str, object]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            backend = s.labels.get("backend")
            if backend is None:
                continue
            entry = view.setdefault(backend, {"loaded": set(), "active": set(), "slots": None})
            if s.name == "fairgate_backend_adapter_loaded" and s.value == 1:
                entry["loaded"].add(s.labels["adapter"])  # type: ignore[attr-defined]
            elif s.name == "fairgate_backend_adapter_active" and s.value == 1:
                entry["active"].add(s.labels["adapter"])  # type: ignore[attr-defined]
            elif s.name == "fairgate_backend_lora_slots":
                entry["slots"] = int(s.value)
            elif s.name == "fairgate_adapter_loads_total":
                view.setdefault("loads", {})[  # type: ignore[index]
                    (backend, s.labels["adapter"], s.labels["outcome"])] = s.value
    return view


async def eventually(check: object, what: str, describe: object) -> None:
    """Await ``check()`` (an async predicate) within WAIT_S; fail with ``describe()``."""
    deadline = time.monotonic() + WAIT_S
    while not await check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen within {WAIT_S:.0f} s: "
                                 f"{await describe()}")  # type: ignore[operator]
        await asyncio.sleep(0.05)


async def test_adapters_run_where_resident_a_cold_one_is_loaded_once_and_the_gauge_agrees(
        lora_fleet: LoraFleet, redis: aioredis.Redis, redis_url: str) -> None:
    servers = lora_fleet.servers
    names = ["cpu0", "cpu1"]
    settings = load_settings(
        None, redis_url=redis_url, listen={"host": "127.0.0.1", "port": 0}, api_keys=KEYS,
        scrape_interval_s=0.05, scrape_timeout_s=5.0, snapshot_stale_s=10.0,
        unhealthy_after_failures=20, replica_heartbeat_s=0.2, adapter_refresh_s=0.5,
        backends=[{"name": n, "url": s.url, "model": SERVED_MODEL}
                  for n, s in zip(names, servers, strict=True)],
        adapters=[{"name": n, "base_model": SERVED_MODEL, "path": str(p), "runtime": True}
                  for n, p in lora_fleet.paths.items()])
    async with httpx.AsyncClient() as http:
        start = [await vllm_view(http, s) for s in servers]
        assert [v["adapters"] for v in start] == [{"a"}, {"b"}], start
        assert [v["loads"] for v in start] == [{"a": 1}, {"b": 1}], start  # --lora-modules
        gw = GatewayServer(settings)
        await gw.start()
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-alice",
                                    max_retries=0)
        try:
            for handle in gw.services.pool.handles.values():
                await asyncio.wait_for(handle.scraped.wait(), 30)

            async def ask(model: str, max_tokens: int = 4) -> str:
                answer = await client.completions.create(
                    model=model, prompt=f"the fair queue of {model}", max_tokens=max_tokens,
                    extra_body={"ignore_eos": True})
                return answer.model

            # 1. resident adapters: each request runs on the server that has its adapter
            answered = await asyncio.gather(*(ask(m) for m in ("a", "a", "a", "b", "b")))
            assert answered == ["a", "a", "a", "b", "b"], answered
            after = [await vllm_view(http, s) for s in servers]
            ran = [a["finished"] - b["finished"]  # type: ignore[operator]
                   for a, b in zip(after, start, strict=True)]
            print(f"resident: requests finished per server {ran}; loads {after[0]['loads']}, "
                  f"{after[1]['loads']}")
            assert ran == [3, 2], (ran, after)
            assert [v["loads"] for v in after] == [{"a": 1}, {"b": 1}], after  # no new load

            # 2. a cold adapter: three concurrent requests, one load on one server
            answered = await asyncio.gather(*(ask("c") for _ in range(3)))
            assert answered == ["c"] * 3, answered
            cold = [await vllm_view(http, s) for s in servers]
            loads = [v["loads"] for v in cold]
            ran = [a["finished"] - b["finished"]  # type: ignore[operator]
                   for a, b in zip(cold, after, strict=True)]
            print(f"cold: vLLM load calls {loads}; requests finished per server {ran}; "
                  f"adapters {[v['adapters'] for v in cold]}")
            home = 0 if "c" in loads[0] else 1
            assert loads[home] == {("a", "b")[home]: 1, "c": 1}, loads
            assert loads[1 - home] == {("a", "b")[1 - home]: 1}, loads
            assert cold[home]["adapters"] == {("a", "b")[home], "c"}, cold
            assert cold[1 - home]["adapters"] == {("a", "b")[1 - home]}, cold
            assert ran[home] == 3 and ran[1 - home] == 0, ran
            belief = await gateway_view(http, gw)
            assert belief.get("loads") == {(names[home], "c", "loaded"): 1.0}, belief

            # 3. the gateway's view is vLLM's while every adapter runs (streams held open
            # until compared, then closed: vLLM aborts them), and once idle
            expected = [{"a"}, {"b"}]
            expected[home].add("c")
            streams = []

            async def describe() -> str:
                return (f"gateway {await gateway_view(http, gw)}; vLLM "
                        f"{[await vllm_view(http, s) for s in servers]}")

            async def gateway_sees(active: list[set[str]]) -> bool:
                view = await gateway_view(http, gw)
                return [view.get(n, {}).get("active") for n in names] == active

            try:
                for m in ("a", "b", "c"):
                    stream = await client.completions.create(
                        model=m, prompt=f"the long queue of {m}", max_tokens=LONG_TOKENS,
                        stream=True, extra_body={"ignore_eos": True})
                    streams.append(stream)
                    first = await stream.__anext__()  # it runs
                    assert first.model == m, first
                await eventually(lambda: gateway_sees(expected), "every adapter active",
                                 describe)
                belief = await gateway_view(http, gw)
                truth = [await vllm_view(http, s) for s in servers]
            finally:
                for stream in streams:
                    await stream.close()
            print(f"busy: gateway {belief}; vLLM gauges {[t['gauge'] for t in truth]}")
            for name, t, active in zip(names, truth, expected, strict=True):
                max_lora, run, wait = gauge_sets(t["gauge"])
                seen = belief[name]
                assert (max_lora, run, wait) == ("2", active, active), (name, t)
                assert seen["active"] == run and seen["slots"] == 2, (name, seen, t)
                assert seen["loaded"] == t["adapters"], (name, seen, t)

            await eventually(lambda: gateway_sees([set(), set()]), "no adapter active",
                             describe)
            idle = [await vllm_view(http, s) for s in servers]
            print(f"idle: vLLM gauges {[t['gauge'] for t in idle]}")
            for t in idle:
                assert gauge_sets(t["gauge"])[:2] == ("2", set()), t
            assert [v["loads"] for v in idle] == loads, idle  # still the one load
        finally:
            await client.close()
            await gw.stop()
