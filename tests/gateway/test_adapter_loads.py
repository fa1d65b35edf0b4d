"""Runtime LoRA loads end to end: the official ``openai`` SDK through gateways to simulated
vLLM backends that allow runtime loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), on a
real Redis (``docs/adapters.md``).

A request naming a runtime adapter resident nowhere has it loaded once, however many
requests and replicas ask at the same time; with no slot free the least recently used
idle adapter makes room; a cold adapter is served within the bound while popular ones
keep every slot busy; an adapter stays its minimum residency (nine times its measured
load by default, or the setting), then makes room; a freed slot goes to the waiting
adapter with the most requests; a load the backend refuses is a clear error, not
retried; loads, unloads and per-adapter waits are on /metrics.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.http.server import GatewayServer
from gateway.storage.keys import ModelKeys
from tests.gateway.conftest import MODEL, GatewayFactory, SimFactory, store_is_idle, until
from tests.gateway.test_adapters import client, ran

RUNTIME: dict[str, Any] = {"enable_lora": True, "allow_runtime_lora_updating": True,
                           "lora_load_s": 0.05}


def runtime(*names: str) -> list[dict[str, Any]]:
    return [{"name": n, "base_model": MODEL, "path": f"/adapters/{n}", "runtime": True}
            for n in names]


async def samples(gw: GatewayServer, prefix: str) -> dict[tuple[str, tuple[Any, ...]], float]:
    async with aiohttp.ClientSession() as http, http.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith(prefix)}


def counted(found: dict[tuple[str, tuple[Any, ...]], float], name: str
            ) -> dict[tuple[str, str, str], float]:
    """A counter's samples by (backend, adapter, outcome)."""
    out = {}
    for (sample, labels), value in found.items():
        if sample == name:
            d = dict(labels)
            out[(d["backend"], d["adapter"], d["outcome"])] = value
    return out


async def test_a_cold_adapter_is_loaded_once_for_concurrent_requests_of_two_replicas(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    b0 = await sim(max_loras=2, **{**RUNTIME, "lora_load_s": 0.3})
    b1 = await sim(max_loras=2, **{**RUNTIME, "lora_load_s": 0.3})
    one = await gateway([b0, b1], adapters=runtime("cold"))
    two = await gateway([b0, b1], adapters=runtime("cold"))
    async with client(one) as alice, client(two, "sk-bob") as bob:
        answers = await asyncio.gather(*(
            c.completions.create(model="cold", prompt=f"p{i}", max_tokens=2)
            for i in range(4) for c in (alice, bob)))
    assert [a.model for a in answers] == ["cold"] * 8, [a.model for a in answers]
    assert b0.loras.loads + b1.loras.loads == 1, (b0.loras.loads, b1.loras.loads)
    home = b0 if b0.loras.loads else b1
    assert ran(home) == {"cold": 8}, (ran(b0), ran(b1))
    name = "b0" if home is b0 else "b1"
    loads = [counted(await samples(gw, "fairgate_adapter_loads"),
                     "fairgate_adapter_loads_total") for gw in (one, two)]
    assert sorted(loads, key=len) == [{}, {(name, "cold", "loaded"): 1}], loads
    await store_is_idle(one)


async def test_with_no_slot_free_the_least_recently_used_idle_adapter_makes_room(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    b0 = await sim(max_loras=2, **RUNTIME)
    gw = await gateway([b0], adapters=runtime("a", "b", "c"), adapter_min_residency_s=0)
    async with client(gw) as alice:
        for name in ("a", "b", "a", "c"):  # b is the least recently used when c comes
            answer = await alice.completions.create(model=name, prompt="x", max_tokens=2)
            assert answer.model == name, answer
    assert set(b0.loras.adapters) == {"a", "c"}, b0.loras.adapters
    found = await samples(gw, "fairgate_adapter")
    assert counted(found, "fairgate_adapter_loads_total") == {
        ("b0", "a", "loaded"): 1, ("b0", "b", "loaded"): 1, ("b0", "c", "loaded"): 1}, found
    assert counted(found, "fairgate_adapter_unloads_total") == {
        ("b0", "b", "unloaded"): 1}, found
    waits = {dict(labels)["adapter"]: value for (name, labels), value in found.items()
             if name == "fairgate_adapter_wait_seconds_count"}
    assert waits == {"a": 2, "b": 1, "c": 1}, found
    held = {labels: value for (name, labels), value in found.items()
            if name == "fairgate_adapter_requests"}
    assert held and all(v == 0 for v in held.values()), held  # none held once answered
    handle = gw.services.pool.handles["b0"]
    assert gw.services.pool.adapters_on(handle) == {"a", "c"}, handle.card.adapters
    lora = (await gw.services.inspector.backend("b0"))["lora"]  # the dashboard's row
    assert (lora["resident"], lora["slots"]) == (["a", "c"], 2), lora
    await store_is_idle(gw)


async def test_a_cold_adapter_is_served_while_popular_ones_keep_every_slot_busy(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """Two popular adapters keep both slots busy (a user each, sending back to back); a
    cold adapter's request is still served, within adapter_load_wait_s: once a popular
    one is past its minimum residency it makes room (its running request ends as on
    vLLM, then the cold one runs). The popular ones lose no request meanwhile."""
    b0 = await sim(max_loras=2, profile="cpu-tiny", **RUNTIME)
    residency_s, bound_s = 1.0, 30.0
    gw = await gateway([b0], adapters=runtime("hot1", "hot2", "cold"),
                       adapter_min_residency_s=residency_s, adapter_load_wait_s=bound_s)
    handle = gw.services.pool.handles["b0"]
    stop = asyncio.Event()
    served: dict[str, int] = {"hot1": 0, "hot2": 0}
    errors: list[str] = []

    async def popular(c: openai.AsyncOpenAI, name: str) -> None:
        while not stop.is_set():
            try:
                await c.completions.create(model=name, prompt="p", max_tokens=8,
                                           extra_body={"ignore_eos": True})
                served[name] += 1
            except openai.APIError as exc:
                errors.append(f"{name}: {exc}")

    async with client(gw, "sk-bob") as bob, client(gw, "sk-carol") as carol, \
            client(gw) as alice:
        loops = [asyncio.create_task(popular(bob, "hot1")),
                 asyncio.create_task(popular(carol, "hot2"))]
        try:
            await until(lambda: handle.card.lora is not None
                        and set(handle.card.lora.active) == {"hot1", "hot2"}, "both slots busy")
            asked = time.monotonic()
            answer = await alice.completions.create(model="cold", prompt="c", max_tokens=2)
            waited = time.monotonic() - asked
        finally:
            stop.set()
            await asyncio.gather(*loops)
    assert answer.model == "cold" and waited < bound_s, (answer.model, waited)
    assert errors == [] and min(served.values()) > 0, (errors, served)
    assert ran(b0).get("cold") == 1, ran(b0)
    await store_is_idle(gw)


async def test_an_adapter_stays_its_minimum_residency(sim: SimFactory,
                                                      gateway: GatewayFactory) -> None:
    b0 = await sim(max_loras=1, **RUNTIME)
    gw = await gateway([b0], adapters=runtime("a", "b"), adapter_min_residency_s=60,
                       adapter_load_wait_s=0.5)
    async with client(gw) as alice:
        await alice.completions.create(model="a", prompt="x", max_tokens=2)
        with pytest.raises(openai.InternalServerError) as refused:
            await alice.completions.create(model="b", prompt="x", max_tokens=2)
    assert refused.value.status_code == 503, refused.value
    assert refused.value.body == {
        "message": f"the LoRA adapter 'b' is resident on no backend of {MODEL!r} and none "
                   "had a slot for it within adapter_load_wait_s (0.5 s)",
        "type": "server_error", "param": None, "code": "adapter_not_loaded"}, refused.value.body
    assert (b0.loras.loads, set(b0.loras.adapters)) == (1, {"a"}), b0.loras.adapters
    await store_is_idle(gw)


async def test_by_default_an_adapter_stays_nine_times_its_measured_load_then_makes_room(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """No adapter_min_residency_s: the residency follows the load time (0.3 s here, so
    2.7 s), not a fixed 30 s."""
    load_s = 0.3
    b0 = await sim(max_loras=1, **{**RUNTIME, "lora_load_s": load_s})
    gw = await gateway([b0], adapters=runtime("a", "b"))
    async with client(gw) as alice:
        asked = time.monotonic()
        await alice.completions.create(model="a", prompt="x", max_tokens=2)
        answer = await alice.completions.create(model="b", prompt="x", max_tokens=2)
        took = time.monotonic() - asked
    # a's load, its residency of 9 loads, b's load: at least 10 loads' time
    assert answer.model == "b" and 10 * load_s <= took < 20.0, (answer.model, took)
    assert (b0.loras.loads, b0.loras.unloads, set(b0.loras.adapters)) == (2, 1, {"b"}), (
        b0.loras.loads, b0.loras.unloads, b0.loras.adapters)
    await store_is_idle(gw)


async def test_a_freed_slot_goes_to_the_waiting_adapter_with_the_most_requests(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """One slot, held by ``a``; three cold adapters ask first (a request each), then
    ``hot`` (three). When ``a`` may go (its residency is set past), ``hot`` is loaded
    first; the cold ones follow, one slot each in turn."""
    b0 = await sim(max_loras=1, **RUNTIME)
    colds = ("c1", "c2", "c3")
    gw = await gateway([b0], adapters=runtime("a", "hot", *colds),
                       adapter_min_residency_s=3600)
    store, key = gw.services.store, ModelKeys(MODEL).backend_lora("b0")

    async def age_all() -> None:  # every resident adapter past its residency
        for name in list(b0.loras.adapters):
            await store.client.hset(key, name, "0.0")

    async def loading() -> dict[str, float]:
        found = await samples(gw, "fairgate_adapter_requests")
        return {dict(labels)["adapter"]: v for (name, labels), v in found.items()
                if dict(labels)["state"] == "loading" and v}

    async def waiting(expected: dict[str, float]) -> bool:
        return await loading() == expected

    async with client(gw) as alice, client(gw, "sk-bob") as bob:
        await alice.completions.create(model="a", prompt="x", max_tokens=2)
        cold = [asyncio.create_task(alice.completions.create(model=c, prompt="x", max_tokens=2))
                for c in colds]
        await until(lambda: waiting(dict.fromkeys(colds, 1.0)), "the cold ones wait")
        hot = [asyncio.create_task(bob.completions.create(model="hot", prompt="x", max_tokens=2))
               for _ in range(3)]
        await until(lambda: waiting({**dict.fromkeys(colds, 1.0), "hot": 3.0}),
                    "all wait for a load")
        await age_all()
        await until(lambda: b0.loras.loads == 2, "the second load")
        first = set(b0.loras.adapters)
        hot_answers = await asyncio.gather(*hot)

        async def aged_and_served() -> bool:
            await age_all()
            return all(t.done() for t in cold)

        await until(aged_and_served, "the cold ones served in turn")
        cold_answers = [t.result() for t in cold]
    assert first == {"hot"}, (first, b0.loras.adapters)
    assert [a.model for a in hot_answers] == ["hot"] * 3, hot_answers
    assert [a.model for a in cold_answers] == list(colds), cold_answers
    assert b0.loras.loads == 5, b0.loras.loads
    await store_is_idle(gw)


async def test_a_failed_load_is_a_clear_error_and_is_not_retried(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    b0 = await sim(max_loras=2, **{**RUNTIME, "allow_runtime_lora_updating": False})
    gw = await gateway([b0], adapters=runtime("x"), adapter_load_retry_s=60)
    errors = []
    async with client(gw) as alice:
        for _ in range(3):
            with pytest.raises(openai.APIStatusError) as failed:
                await alice.completions.create(model="x", prompt="x", max_tokens=2)
            errors.append((failed.value.status_code, failed.value.body))
    status, body = errors[0]
    assert status == 502 and body["code"] == "adapter_load_failed", errors
    assert body["message"].startswith(
        "backend b0 could not load the LoRA adapter 'x' from '/adapters/x': 404 "), body
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in body["message"], body
    assert errors == [errors[0]] * 3, errors  # the same error, without a new load
    loads = counted(await samples(gw, "fairgate_adapter_loads"),
                    "fairgate_adapter_loads_total")
    assert loads == {("b0", "x", "failed"): 1}, loads
    assert ran(b0) == {}, ran(b0)
    await store_is_idle(gw)


async def test_a_request_reaching_a_backend_just_after_its_adapter_left_is_queued_again(
        sim: SimFactory, gateway: GatewayFactory) -> None:
    """An adapter unloaded while a request for it is on its way (to make room for a cold
    one, by another replica, or by hand): vLLM answers that request 404. Nothing ran, so
    the gateway queues it again and loads the adapter again for it: the client is served.
    Here the unload is made on the backend behind the gateway's back, its listing read
    never again, so the gateway sends each request where it believes the adapter is."""
    b0 = await sim(max_loras=2, **RUNTIME)
    gw = await gateway([b0], adapters=runtime("a"), adapter_refresh_s=3600)
    handle = gw.services.pool.handles["b0"]
    answers = []
    async with client(gw) as alice, aiohttp.ClientSession() as http:
        first = await alice.completions.create(model="a", prompt="x", max_tokens=2)
        assert (first.model, b0.loras.loads) == ("a", 1), (first.model, b0.loras.loads)
        for stream in (False, True, False):
            async with http.post(b0.url + "/v1/unload_lora_adapter",
                                 json={"lora_name": "a"}) as resp:
                assert resp.status == 200, (resp.status, await resp.text())
            if stream:
                chunks = await alice.completions.create(model="a", prompt="x", max_tokens=2,
                                                        stream=True)
                answers.append("".join([c.model async for c in chunks][:1]))
            else:
                answer = await alice.completions.create(model="a", prompt="x", max_tokens=2)
                answers.append(answer.model)
            assert "a" in gw.services.pool.adapters_on(handle), handle.card.adapters
    assert answers == ["a", "a", "a"], answers
    # each request's first try met the unload: loaded again for it, 1 + 3 loads in all
    assert b0.loras.loads == 4, b0.loras.loads
    assert ran(b0) == {"a": 4}, ran(b0)
    await store_is_idle(gw)
