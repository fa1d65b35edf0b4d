"""Differential spec of ``gateway/storage/lua/lib/inflight.lua`` (a grant's vLLM priority rank,
the in-flight counts, the sent set, the recent classes the starvation floor reads, and
the one release) against its plain-data twins, ``policies/priority.py`` InFlight and
``policies/starvation.py`` remember: hypothesis draws grants and releases; the Lua runs
them on a real Redis in one EVAL, the twins in Python, and the answers must agree."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.storage.keys import ModelKeys
from gateway.storage.scripts import load_library
from policies.classes import CLASS_ORDER
from policies.priority import InFlight, vllm_priority
from policies.starvation import FloorPolicy, owed_class, remember

HARNESS = """
local a = cjson.decode(ARGV[1])
local prefix, backend = a.prefix, a.backend
local k = {user_inflight = key_user_inflight(prefix), sent = key_backend_sent(prefix, backend),
  backend_inflight = key_backend_inflight(prefix, backend), recent = key_recent(prefix),
  prefill = key_backend_prefill(prefix, backend)}
local I = inflight_for(prefix, backend, 'r1', k, a.kept, 1000, '1000.000000', 1000)
local out = {}
for i, op in ipairs(a.ops) do
  if op.op == 'grant' then
    local rank, inflight = I.grant(op.id, key_request(prefix, op.id), op.class, op.user, 'r1',
      op.tokens)
    out[i] = {rank, inflight}
  else
    out[i] = {release_inflight(prefix, op.id, op.user, backend, 'r1') and 1 or 0}
  end
end
local recent = redis.call('LRANGE', k.recent, 0, -1)
local users = redis.call('HGETALL', k.user_inflight)
for _, key in pairs(k) do redis.call('DEL', key) end
redis.call('DEL', key_running(prefix, 'r1'), key_backend_started(prefix, backend))
for _, op in ipairs(a.ops) do redis.call('DEL', key_request(prefix, op.id)) end
return {out, recent, users}
"""

OPS = st.tuples(st.sampled_from(["grant", "grant", "release"]), st.integers(0, 6),
                st.sampled_from(["u1", "u2", "u3"]), st.sampled_from(CLASS_ORDER),
                st.integers(0, 300))
examples = itertools.count()


@pytest.fixture(scope="module")
def sync_redis(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(OPS, min_size=1, max_size=30), st.integers(1, 5))
def test_inflight_lua_ranks_as_policies_priority(sync_redis: redis.Redis,
                                                 ops: list[tuple[Any, ...]], kept: int) -> None:
    prefix = ModelKeys(f"inflight{next(examples)}").prefix
    calls = [{"op": op, "id": f"q{n}", "user": user, "class": klass, "tokens": tokens}
             for op, n, user, klass, tokens in ops]
    args = {"prefix": prefix, "backend": "b1", "kept": kept, "ops": calls}
    got, recent, flat = sync_redis.eval(load_library() + HARNESS, 0, json.dumps(args))
    model, want_recent = InFlight(), []
    for i, (op, n, user, klass, _) in enumerate(ops):
        if op == "grant":
            want = list(model.grant(f"q{n}", user))
            want_recent = remember(want_recent, klass, kept)
            # the priority vLLM receives follows the rank alone within a class
            assert vllm_priority(0, int(got[i][0])) == vllm_priority(0, want[0])
        else:
            want = [int(model.release(f"q{n}", user))]
        assert [int(v) for v in got[i]] == want, (
            f"op {i} {calls[i]} of {ops}: lua {got[i]}, policies {want}")
    users = {u: int(c) for u, c in zip(flat[::2], flat[1::2], strict=True)}
    assert users == model.per_user, f"{ops}: lua per-user {users}, policies {model.per_user}"
    assert recent == want_recent, f"{ops}: lua recent {recent}, policies {want_recent}"
    floors = FloorPolicy(after_s=0.0, window=kept)
    backlogged = dict.fromkeys(CLASS_ORDER, 0.0)
    assert owed_class(floors, backlogged, recent, 1.0) == owed_class(floors, backlogged,
                                                                    want_recent, 1.0)
