"""The simulator's automatic prefix caching: block hashing, hits, LRU eviction, counters.

The pool test walks a hand-computed example (4 blocks of 4 tokens); the HTTP tests send
real requests to a running simulator and read vLLM's counters from ``/metrics``.
"""

from __future__ import annotations

import hashlib
import pickle

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families

from loadtest.cli import build_parser
from loadtest.sim.cli import config_from_args
from loadtest.sim.prefix_cache import NONE_HASH, BlockPool, BlockTable, hash_blocks
from loadtest.sim.protocol import parse_request
from loadtest.sim.scheduler import Scheduler, SchedulerLimits
from loadtest.sim.sequence import Sequence
from tests.sim.conftest import MODEL, ServerFactory


def h(parent: bytes, ids: list[int]) -> bytes:
    # vLLM's sha256 block hash (policies/kv_blocks.py, checked against a real server)
    return hashlib.sha256(pickle.dumps((parent, tuple(ids), None), protocol=5)).digest()


def test_blocks_hash_as_a_chain_and_equal_prefixes_share_them() -> None:
    a0 = h(NONE_HASH, [1, 2, 3, 4])
    a1 = h(a0, [5, 6, 7, 8])
    assert hash_blocks(list(range(1, 10)), 4) == [a0, a1]  # the partial tail has no hash
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 99], 4) == [a0, a1]
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 9], 4) == [a0, h(a0, [5, 6, 7, 9])]
    assert hash_blocks([5, 6, 7, 8], 4) != [a1]  # the same block under another parent
    assert hash_blocks([1, 2, 3], 4) == []
    # Stable across processes (no salted hash()): a recorded value.
    assert a0.hex() == "52a7f141c60918f65779927090482b5a24adbe68c8613a211a1eb4e3edd9361a"


def test_hits_pins_and_lru_eviction_hand_computed() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    ids_a = list(range(1, 10))  # 9 tokens: blocks [1-4] [5-8] full, [9] partial
    a0, a1 = hash_blocks(ids_a, 4)

    # A: empty cache, no hit; takes the never used blocks 0, 1, 2, caches 0 and 1.
    a = BlockTable(hash_blocks(ids_a, 4))
    assert pool.find_hit(a.hashes, 9) == []
    assert pool.allocate(a, 9)
    pool.record(9, 0)
    assert a.blocks == [0, 1, 2] and pool.num_free_blocks == 1
    pool.free(a)  # in reverse: the tail is evicted first
    assert pool.free_queue() == [2, 1, 0] and pool.num_free_blocks == 4
    assert pool.usage == 0.0 and pool.is_cached(a0) and pool.is_cached(a1)

    # B shares A's 8-token prefix: 2 blocks hit (8 tokens), one new block for its tail.
    ids_b = [*range(1, 9), 20, 21, 22]
    b = BlockTable(hash_blocks(ids_b, 4))
    hit = pool.find_hit(b.hashes, 11)
    assert hit == [0, 1]
    assert pool.allocate(b, 11, hit)
    pool.record(11, 8)
    assert b.blocks == [0, 1, 3] and pool.free_queue() == [2]

    # C is exactly A's cached 8 tokens: the last token must be computed, and a hit ends
    # on a block boundary, so only 1 block (4 tokens) hits and the last block is redone.
    c = BlockTable(hash_blocks(list(range(1, 9)), 4))
    hit = pool.find_hit(c.hashes, 8)
    assert hit == [0]
    assert pool.allocate(c, 8, hit)
    pool.record(8, 4)
    assert c.blocks == [0, 2] and pool.num_free_blocks == 0

    # Nothing free: a new request does not fit and nothing changes.
    d = BlockTable(hash_blocks(list(range(50, 59)), 4))
    assert not pool.allocate(d, 9)
    assert d.blocks == [] and pool.num_free_blocks == 0

    pool.free(b)  # block 0 stays pinned by C
    assert pool.free_queue() == [3, 1]
    pool.free(c)
    assert pool.free_queue() == [3, 1, 2, 0]

    # D needs 3 blocks: taken from the head of the free queue (3: B's uncached tail,
    # then 1 and 2, both holding a1): a1 is evicted, a0 (block 0, freed last) survives.
    assert pool.find_hit(d.hashes, 9) == []
    assert pool.allocate(d, 9)
    pool.record(9, 0)
    assert d.blocks == [3, 1, 2]
    assert pool.is_cached(a0) and not pool.is_cached(a1)
    assert pool.free_queue() == [0]

    # A again: only its first block is still cached.
    e = BlockTable(hash_blocks(ids_a, 4))
    assert pool.find_hit(e.hashes, 9) == [0]
    assert pool.allocate(e, 9, [0]) is False  # needs 2 more blocks, only block 0 is free
    assert pool.free_queue() == [0]  # the failed allocation pinned nothing

    assert (pool.queries, pool.hits) == (9 + 11 + 8 + 9, 0 + 8 + 4 + 0)


def test_disabled_pool_never_hits() -> None:
    pool = BlockPool(num_blocks=4, block_size=4, enable_caching=False)
    ids = list(range(1, 10))
    first = BlockTable(hash_blocks(ids, 4))
    assert pool.allocate(first, 9)
    pool.free(first)
    assert pool.find_hit(hash_blocks(ids, 4), 9) == []
    pool.record(9, 0)
    assert (pool.queries, pool.hits, pool.num_cached_blocks) == (0, 0, 0)


def test_scheduler_prefills_only_the_uncached_tail() -> None:
    limits = SchedulerLimits(max_num_batched_tokens=4096, kv_blocks=64, block_size=16)
    sched = Scheduler(limits)
    shared = list(range(1000, 1100))  # 100 tokens: 6 full blocks (96 tokens)

    def seq(rid: str, ids: list[int]) -> Sequence:
        return Sequence(rid, 0, 0.0, len(ids), 1, table=BlockTable(hash_blocks(ids, 16)))

    sched.add(seq("a", [*shared, 1, 2, 3]))
    plan = sched.schedule()
    assert plan.batch_tokens == 103
    sched.update(plan)  # a finishes (one output token) and frees its blocks
    assert sched.running == [] and sched.free_blocks == 64

    b = seq("b", [*shared, 7, 8, 9, 10])
    sched.add(b)
    plan = sched.schedule()
    assert plan.batch_tokens == 104 - 96  # the cached prefix is not computed
    assert plan.context_tokens == 104  # but attention reads it
    assert b.num_cached_tokens == 96
    assert (sched.pool.queries, sched.pool.hits) == (103 + 104, 96)


async def scrape_cache(server_url: str) -> tuple[float, float]:
    async with aiohttp.ClientSession() as http, http.get(server_url + "/metrics") as resp:
        text = await resp.text()
    values = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
            (sample,) = [s for s in family.samples if s.name.endswith("_total")]
            assert sample.labels == {"model_name": MODEL, "engine": "0"}
            values[family.name] = sample.value
    return values["vllm:prefix_cache_queries"], values["vllm:prefix_cache_hits"]


SYSTEM = "You answer questions about the fair queue. " * 40  # 1,760 bytes


async def chat_turn(client: openai.AsyncOpenAI, question: str) -> int:
    answer = await client.chat.completions.create(
        model=MODEL, max_tokens=2,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    )  # fmt: skip
    assert answer.usage is not None
    return answer.usage.prompt_tokens


async def test_shared_prefix_hits_over_http(make_server: ServerFactory) -> None:
    server = await make_server()
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    first = await chat_turn(client, "Who goes next?")
    queries, hits = await scrape_cache(server.url)
    assert (queries, hits) == (first, 0)

    second = await chat_turn(client, "And after that, who?")
    queries2, hits2 = await scrape_cache(server.url)
    # Shared: <|start|> system <|sep|> (3 tokens) + 440 system tokens + <|end|>
    # + <|start|> user <|sep|> = 447 tokens: 27 full blocks of 16 (432 tokens).
    assert queries2 - queries == second
    assert hits2 - hits == 432
    assert sorted(r.cached_tokens for r in server.engine.records.values()) == [0, 432]
    await client.close()


async def test_no_hits_with_prefix_caching_off(make_server: ServerFactory) -> None:
    args = build_parser().parse_args(["sim", "--model", MODEL, "--no-enable-prefix-caching"])
    assert config_from_args(args).enable_prefix_caching is False
    server = await make_server(enable_prefix_caching=False)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    await chat_turn(client, "Who goes next?")
    await chat_turn(client, "And after that, who?")
    # vLLM counts no lookups when prefix caching is off: both counters stay 0.
    assert await scrape_cache(server.url) == (0, 0)
    records = list(server.engine.records.values())
    assert len(records) == 2 and all(r.cached_tokens == 0 for r in records)
    await client.close()


def test_prompt_ids_match_the_token_count() -> None:
    for body, chat in (
        ({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]},
         True),
        ({"prompt": "the fair queue é"}, False),
        ({"prompt": [5, 6, 7]}, False),
    ):  # fmt: skip
        req = parse_request(body, chat=chat, headers_priority=None, model_len=4096, seed=0)
        assert len(req.prompt_ids()) == req.prompt_tokens


async def test_usage_reports_the_cached_prompt_tokens_when_asked(
        make_server: ServerFactory) -> None:
    """``--enable-prompt-tokens-details``: usage.prompt_tokens_details.cached_tokens, whole
    and streamed, as vLLM reports it; without the flag the details stay null."""
    args = build_parser().parse_args(["sim", "--model", MODEL, "--enable-prompt-tokens-details"])
    assert config_from_args(args).enable_prompt_tokens_details is True
    plain = await make_server()
    server = await make_server(enable_prompt_tokens_details=True)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first"}]
    first = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert first.usage and first.usage.prompt_tokens_details, first.usage
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages[1]["content"] = "second"
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, stream=True,
        stream_options={"include_usage": True})
    usages = [c.usage async for c in stream if c.usage is not None]
    assert len(usages) == 1 and usages[0].prompt_tokens_details, usages
    assert usages[0].prompt_tokens_details.cached_tokens == 432  # the shared system blocks
    await client.close()
    off = openai.AsyncOpenAI(base_url=plain.url + "/v1", api_key="unused", max_retries=0)
    answer = await off.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert answer.usage and answer.usage.prompt_tokens_details is None, answer.usage
    await off.close()
