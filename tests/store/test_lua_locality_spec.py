"""Differential spec of ``gateway/storage/lua/lib/locality.lua`` against its plain-data twin,
``policies/locality.py`` (PrefixIndex, LocalityView): hypothesis draws a backend's prefix
index, the other backends' indexes and loads, and a sequence of reads (held blocks, a
queued request's match and affinity), records and trims; the Lua module runs them on a
real Redis in one EVAL, the twin in Python, and every answer and the index left behind
must agree."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.storage.keys import ModelKeys
from gateway.storage.scripts import load_library
from policies.locality import LocalityView, PrefixIndex, matched
from policies.prefill import PromptRange

HARNESS = """
local a = cjson.decode(ARGV[1])
local prefix, backend = a.prefix, a.backend
for i, other in ipairs(a.loc.others) do
  for h, t in pairs(a.other_indexes[i]) do
    redis.call('ZADD', key_backend_prefixes(prefix, other), t, h)
  end
  redis.call('SET', key_backend_inflight(prefix, other), a.other_loads[i])
end
for h, t in pairs(a.index) do redis.call('ZADD', key_backend_prefixes(prefix, backend), t, h) end
local out = {}
for i, op in ipairs(a.ops) do
  local L = locality_for(prefix, backend, a.loc, a.load, op.now)
  if op.op == 'held' then
    out[i] = {L.held_blocks(op.chain)}
  elseif op.op == 'matched' then
    local req = key_request(prefix, 'q')
    redis.call('HSET', req, 'ptok', op.tokens)
    if op.chain then redis.call('HSET', req, 'prefix', op.chain) end
    local length, elsewhere = L.matched('q')
    out[i] = {length, elsewhere and 1 or 0}
    redis.call('DEL', req)
  elseif op.op == 'record' then
    local d = L.record(op.chain, op.tokens)
    out[i] = {d.held, d.blocks, d.reason}
  else
    L.trim()
    out[i] = {}
  end
end
local index = redis.call('ZRANGE', key_backend_prefixes(prefix, backend), 0, -1, 'WITHSCORES')
redis.call('DEL', key_backend_prefixes(prefix, backend))
for _, other in ipairs(a.loc.others) do
  redis.call('DEL', key_backend_prefixes(prefix, other), key_backend_inflight(prefix, other))
end
return {out, index}
"""

HASHES = ["h1", "h2", "h3", "h4", "h5"]
indexes = st.dictionaries(st.sampled_from(HASHES), st.integers(980, 1000))
chains = st.one_of(st.none(), st.lists(st.sampled_from(HASHES), min_size=1, max_size=4,
                                       unique=True))
OPS = st.tuples(st.sampled_from(["held", "matched", "matched", "record", "record", "trim"]),
                chains, st.integers(0, 5), st.integers(0, 10))  # (op, chain, dt, its ptok)
EXAMPLES = st.fixed_dictionaries({
    "slack": st.sampled_from([0.0, 1.0]), "size": st.integers(0, 5),
    "ttl": st.integers(1, 20), "index": indexes,
    # each other backend: its index, its load, the longest prompt it takes (None: any)
    "others": st.lists(st.tuples(indexes, st.integers(0, 5),
                                 st.one_of(st.none(), st.integers(1, 8))), max_size=2),
    "load": st.integers(0, 5), "max_imbalance": st.integers(0, 3),
    "ops": st.lists(OPS, min_size=1, max_size=30),
})
examples = itertools.count()


@pytest.fixture(scope="module")
def sync_redis(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def times(ex: dict[str, Any]) -> list[int]:
    """Each op's clock: 1000 plus the steps drawn so far."""
    return list(itertools.accumulate((dt for _, _, dt, _ in ex["ops"]), initial=1000))[1:]


def twin(ex: dict[str, Any]) -> tuple[list[list[Any]], dict[str, float]]:
    index = PrefixIndex(ex["size"], ex["ttl"], {h: float(t) for h, t in ex["index"].items()})
    others = [(set(o), load) for o, load, _ in ex["others"]]
    ranges = [PromptRange(0, most) for _, _, most in ex["others"]]
    out: list[list[Any]] = []
    for (op, chain, _, tokens), now in zip(ex["ops"], times(ex), strict=True):
        view = LocalityView(ex["slack"], 8, 4, index.used, {"q": chain} if chain else {},
                            others, ex["load"], ex["max_imbalance"],
                            lambda i, _, tokens=tokens: ranges[i].admits(tokens))
        if op == "held":
            out.append([matched(chain or (), index.used)])
        elif op == "matched":
            length, elsewhere = view.matched("q")
            out.append([length, int(elsewhere)])
        elif op == "record":
            taking = [o for (o, _), span in zip(others, ranges, strict=True)
                      if span.admits(tokens)]
            out.append(list(index.record(chain, now, ex["slack"], taking)))
        else:
            index.trim(now)
            out.append([])
    return out, index.used


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(EXAMPLES)
@example({"slack": 0.0, "size": 5, "ttl": 10, "index": {"h1": 990, "h2": 991}, "others": [],
          "load": 0, "max_imbalance": 0, "ops": [("trim", None, 0, 0)]})  # used exactly ttl ago
@example({"slack": 1.0, "size": 5, "ttl": 10, "index": {}, "others": [({"h1": 1000}, 0, 3)],
          "load": 0, "max_imbalance": 0,  # the other holds it but takes prompts up to 3
          "ops": [("matched", ["h1"], 0, 9), ("record", ["h1"], 0, 9)]})
def test_locality_lua_decides_as_policies_locality(sync_redis: redis.Redis,
                                                   ex: dict[str, Any]) -> None:
    prefix = ModelKeys(f"loc{next(examples)}").prefix
    others = [f"o{i}" for i in range(len(ex["others"]))]
    ops = [{"op": op, "now": now, "tokens": tokens,
            **({"chain": " ".join(chain)} if chain else {})}
           for (op, chain, _, tokens), now in zip(ex["ops"], times(ex), strict=True)]
    fits = {name: {"min": 0, "max": most} for name, (_, _, most)
            in zip(others, ex["others"], strict=True) if most is not None}
    args = {"prefix": prefix, "backend": "b1", "load": ex["load"], "index": ex["index"],
            "loc": {"slack": ex["slack"], "candidates": 8, "lookahead": 4,
                    "index_size": ex["size"], "index_ttl_s": ex["ttl"],
                    "max_imbalance": ex["max_imbalance"], "others": others, "fits": fits},
            "other_indexes": [o for o, _, _ in ex["others"]],
            "other_loads": [load for _, load, _ in ex["others"]], "ops": ops}
    got_out, flat = sync_redis.eval(load_library() + HARNESS, 0, json.dumps(args))
    got_index = {h: float(t) for h, t in zip(flat[::2], flat[1::2], strict=True)}
    want_out, want_index = twin(ex)
    for i, (g, w) in enumerate(zip(got_out, want_out, strict=True)):
        assert g == w, f"op {i} {ops[i]} of {ex}: lua {g}, policies {w}"
    assert got_index == want_index, f"{ex}: lua left the index {got_index}, policies {want_index}"
