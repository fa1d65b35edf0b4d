"""Locality on two real vLLM servers (CPU, the tiny model; automatic prefix caching on,
V1's default): chat sessions with distinct long system prompts and several turns each
compute clearly fewer prompt tokens through fairgate with a default config (no
``routing:`` line: two backends route by locality) than the same workload from a client
alternating between the two servers, by vLLM's own counters
(``vllm:prefix_cache_queries_total`` − ``vllm:prefix_cache_hits_total``).

The second server (the package's 4-slot one, ``four_slots`` in conftest.py, which
test_gateway_vllm's pacing tests use before) runs with ``--enable-prompt-tokens-details``:
the cached prompt tokens the gateway's usage records hold are those vLLM counts
(``vllm:prompt_tokens_cached_total``). Every check here is a before/after difference of
vLLM's counters or on this module's own requests: what ran on the servers before does not
count.

The same two servers as a short pool and a ``long_context`` pool of one model: each
prompt reaches only the server whose range holds it, by vLLM's own prompt-length
histogram."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from openai.types.chat import ChatCompletionMessageParam

from gateway.core.settings import Backend
from gateway.http.server import GatewayServer
from tests.e2e_vllm.conftest import SharedServer, VllmServer
from tests.gateway.conftest import gateway_settings
from tests.ops.conftest import ADMIN

pytestmark = pytest.mark.vllm

SESSIONS = 6
TURNS = 3
QUERIES = "vllm:prefix_cache_queries_total"
CACHED = "vllm:prompt_tokens_cached_total"
HITS = "vllm:prefix_cache_hits_total"
WORDS = ("the", "answer", "should", "follow", "house", "style", "and", "cite", "sources",
         "when", "asked", "about", "policy", "travel", "budget", "rules", "for", "team")


@pytest.fixture(scope="module")
def two_servers(request: pytest.FixtureRequest,
                four_slots: SharedServer) -> Iterator[list[VllmServer]]:
    """The session's server and the package's 4-slot one (2 cores: the second server
    small), started while the first starts when neither runs yet; the second is stopped
    after the module unless a later test uses it."""
    four_slots.start()
    try:
        first: VllmServer = request.getfixturevalue("vllm_server")
        yield [first, four_slots.get()]
    finally:
        four_slots.release(request)


def system_prompt(tag: str, session: int) -> str:
    # distinct from the first characters on; ≈ 1,000 tokens of the tiny tokenizer
    words = " ".join(WORDS[(session * 7 + i) % len(WORDS)] for i in range(330))
    return f"{tag} desk {session:02d}. You are assistant {session} of {tag}. {words}"


async def computed(servers: list[VllmServer]) -> float:
    """Prompt tokens computed so far (queries − hits), summed over the servers."""
    total = 0.0
    async with httpx.AsyncClient() as http:
        for s in servers:
            text = (await http.get(s.url + "/metrics", timeout=30)).text
            for line in text.splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name in (QUERIES, HITS):
                    value = float(line.rsplit(" ", 1)[1])
                    total += value if name == QUERIES else -value
    return total


async def run_sessions(tag: str, clients: list[openai.AsyncOpenAI], model: str) -> None:
    """SESSIONS concurrent chats of TURNS turns; turn t of session i goes through
    ``clients[(i + t) % len(clients)]``."""

    async def session(i: int) -> None:
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": system_prompt(tag, i)}]
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"Question {turn} of {i}: why?"})
            client = clients[(i + turn) % len(clients)]
            answer = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=16, user=f"u{i}",
                extra_body={"ignore_eos": True})
            messages.append({"role": "assistant",
                             "content": answer.choices[0].message.content or ""})

    await asyncio.gather(*(session(i) for i in range(SESSIONS)))


async def test_locality_computes_fewer_prompt_tokens_than_alternating_servers(
        two_servers: list[VllmServer], redis: aioredis.Redis, redis_url: str) -> None:
    model = two_servers[0].model
    async with httpx.AsyncClient() as http:
        tokens = (await http.post(two_servers[0].url + "/tokenize", json={
            "model": model, "prompt": system_prompt("ALT", 0)})).json()["count"]
    assert 512 <= tokens <= 1400, tokens  # several 128-token blocks, turns fit in 2,048

    # a client alternating between the two servers
    direct = [openai.AsyncOpenAI(base_url=s.api, api_key="none", max_retries=0)
              for s in two_servers]
    before = await computed(two_servers)
    await run_sessions("ALT", direct, model)
    alternating = await computed(two_servers) - before
    for c in direct:
        await c.close()

    # the same workload (other prompts of the same length) through fairgate, with the
    # default routing (auto: locality, the model has two backends)
    settings = gateway_settings(
        redis_url, two_servers, scrape_interval_s=0.05, scrape_timeout_s=5.0,
        snapshot_stale_s=10.0, unhealthy_after_failures=20)
    assert settings.routing.mode == "auto", settings.routing.mode
    backends = [Backend(name=f"cpu{i}", url=s.url, model=model)
                for i, s in enumerate(two_servers)]
    gw = GatewayServer(settings.model_copy(update={"backends": backends}))
    await gw.start()
    try:
        for handle in gw.services.pool.handles.values():
            await asyncio.wait_for(handle.scraped.wait(), 30)
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-app", max_retries=0)
        before = await computed(two_servers)
        await run_sessions("LOC", [client], model)
        through_fairgate = await computed(two_servers) - before
        await client.close()
    finally:
        await gw.stop()
    ratio = through_fairgate / alternating
    print(f"prompt tokens computed: alternating {alternating:.0f}, "
          f"fairgate default config {through_fairgate:.0f}, ratio {ratio:.2f}")
    assert alternating > 0 and through_fairgate > 0
    assert ratio < 0.8


SPLIT = 300  # estimated prompt tokens: cpu0 takes up to this, cpu1 the longer ones


async def prompt_histogram(server: VllmServer) -> tuple[float, float]:
    """(requests, requests of at most 500 prompt tokens) by vLLM's own
    ``vllm:request_prompt_tokens`` histogram, over its engines."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(server.url + "/metrics", timeout=30)).text
    count = small = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:request_prompt_tokens_count"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:request_prompt_tokens_bucket") and 'le="500.0"' in line:
            small += float(line.rsplit(" ", 1)[1])
    return count, small


async def test_length_aware_pools_send_each_prompt_to_its_server(
        two_servers: list[VllmServer], redis: aioredis.Redis, redis_url: str) -> None:
    model = two_servers[0].model
    short = [f"Short question {i}: which desk handles travel?" for i in range(6)]
    long = [system_prompt("POOL", i) for i in range(4)]
    async with httpx.AsyncClient() as http:
        counts = [(await http.post(two_servers[0].url + "/tokenize", json={
            "model": model, "prompt": p})).json()["count"] for p in (short[0], long[0])]
    assert counts[0] < 100 and counts[1] > 500, counts  # vLLM's histogram tells them apart
    settings = gateway_settings(
        redis_url, two_servers, scrape_interval_s=0.05, scrape_timeout_s=5.0,
        snapshot_stale_s=10.0, unhealthy_after_failures=20)
    backends = [Backend(name="cpu0", url=two_servers[0].url, model=model,
                        max_prompt_tokens=SPLIT),
                Backend(name="cpu1", url=two_servers[1].url, model=model,
                        min_prompt_tokens=SPLIT + 1, pool="long_context")]
    gw = GatewayServer(settings.model_copy(update={"backends": backends}))
    await gw.start()
    before = [await prompt_histogram(s) for s in two_servers]
    try:
        for handle in gw.services.pool.handles.values():
            await asyncio.wait_for(handle.scraped.wait(), 30)
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-app", max_retries=0)
        try:
            await asyncio.gather(*(client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": p}], max_tokens=8,
                user=f"u{i}", extra_body={"ignore_eos": True})
                for i, p in enumerate(short + long)))
        finally:
            await client.close()
    finally:
        await gw.stop()
    after = [await prompt_histogram(s) for s in two_servers]
    (n0, small0), (n1, small1) = ((a[0] - b[0], a[1] - b[1])
                                  for a, b in zip(after, before, strict=True))
    print(f"pools: cpu0 {n0:.0f} requests ({small0:.0f} ≤ 500 tokens), "
          f"cpu1 {n1:.0f} requests ({small1:.0f} ≤ 500 tokens)")
    assert (n0, small0) == (len(short), len(short))  # only the short prompts
    assert (n1, small1) == (len(long), 0)  # only the long ones


async def vllm_counter(server: VllmServer, name: str) -> float:
    """A counter of vLLM's /metrics, summed over its label sets."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(server.url + "/metrics", timeout=30)).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{", 1)[0].split(" ", 1)[0] == name)


async def test_usage_records_the_cached_tokens_vllm_counts(
        two_servers: list[VllmServer], redis: aioredis.Redis, redis_url: str) -> None:
    """Through the server started with ``--enable-prompt-tokens-details``: the cached
    prompt tokens of the usage records (``/admin/usage``) are vLLM's own count of them,
    and there are some (the sessions' later turns)."""
    server = two_servers[1]
    settings = gateway_settings(
        redis_url, [server], scrape_interval_s=0.05, scrape_timeout_s=5.0,
        snapshot_stale_s=10.0, unhealthy_after_failures=20, admin_keys=[ADMIN])
    gw = GatewayServer(settings.model_copy(update={"backends": [
        Backend(name="cpu1", url=server.url, model=server.model)]}))
    await gw.start()
    try:
        await asyncio.wait_for(gw.services.pool.handles["cpu1"].scraped.wait(), 30)
        before = await vllm_counter(server, CACHED)
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-app", max_retries=0)
        try:
            await run_sessions("USE", [client], server.model)
        finally:
            await client.close()
        counted = await vllm_counter(server, CACHED) - before

        async def recorded() -> float:
            async with httpx.AsyncClient() as http:
                rows = (await http.get(gw.url + "/admin/usage?group_by=user",
                                       headers={"Authorization": f"Bearer {ADMIN}"},
                                       timeout=30)).json()["data"]
            return float(sum(r["cached_prompt_tokens"] for r in rows))

        deadline = asyncio.get_running_loop().time() + 30
        usage = await recorded()
        while usage != counted and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.2)  # the last settles may still be on their way
            usage = await recorded()
    finally:
        await gw.stop()
    print(f"cached prompt tokens: usage records {usage:.0f}, vLLM {counted:.0f}")
    assert counted > 0 and usage == counted, (usage, counted)
