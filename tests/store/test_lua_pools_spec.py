"""Differential spec of ``gateway/storage/lua/lib/pools.lua`` against its plain-data twin,
``policies/prefill.py``: hypothesis draws prompt ranges, requests and prefill states; the
Lua module decides them on a real Redis, the twin in Python, and the two must agree."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.storage.keys import ModelKeys
from gateway.storage.scripts import load_library
from policies.prefill import PromptRange, may_backfill, prefill_fits

K = ModelKeys("spec")
# one EVAL decides every case of an example: ARGV[1] the cases as JSON
HARNESS = """
local out = {}
for i, c in ipairs(cjson.decode(ARGV[1])) do
  local id = 'c' .. i
  local req = key_request(ARGV[2], id)
  redis.call('DEL', req)
  redis.call('HSET', req, 'ptok', c.tokens)
  if c.held_for >= 0 then redis.call('HSET', req, 'held_at', c.now - c.held_for) end
  local pools = pools_for(ARGV[2], {min = c.min, max = c.max}, 16)
  local room = c.room >= 0 and c.room or nil
  local hold = pools.hold(req, c.tokens - c.cached, c.pending, c.limit, c.now,
    tostring(c.now), c.backfill_s)
  out[i] = {pools.fits(id) and 1 or 0, pools.fits(id, room, c.cached) and 1 or 0,
            hold == nil and 'fits' or (hold == false and 'stop' or tostring(hold))}
  redis.call('DEL', req)
end
return out
"""

CASES = st.fixed_dictionaries({
    "min": st.integers(0, 600), "max": st.integers(0, 1200), "tokens": st.integers(0, 1500),
    "cached": st.integers(0, 400), "room": st.integers(-1, 1500),
    "pending": st.integers(0, 1000), "limit": st.integers(0, 1000),
    "now": st.integers(1_000, 1_010), "held_for": st.integers(-1, 6),  # -1: never held
    "backfill_s": st.integers(0, 5),
}).filter(lambda c: c["cached"] <= c["tokens"])


@pytest.fixture(scope="module")
def sync_redis(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def twin(c: dict[str, int]) -> list[object]:
    span = PromptRange(c["min"], c["max"] or None)
    ranged = span.bounded
    fits = not ranged or span.admits(c["tokens"])
    room = c["room"] if c["room"] >= 0 else None
    uncached = c["tokens"] - c["cached"]
    fits_room = (not ranged and room is None) or (
        (room is None or uncached <= room) and span.admits(c["tokens"]))
    if prefill_fits(c["pending"], uncached, c["limit"]):
        hold = "fits"
    else:
        held_for = max(c["held_for"], 0)  # first held now when it never was
        room_left = c["limit"] - c["pending"]
        # may a backfill be tried at all (the held request still in its window)? Each
        # candidate's own size is then the fits-with-room check above
        hold = str(room_left) if may_backfill(held_for, c["backfill_s"], room_left,
                                              room_left) else "stop"
    return [int(fits), int(fits_room), hold]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(CASES, min_size=1, max_size=40))
def test_pools_lua_decides_as_policies_prefill(sync_redis: redis.Redis,
                                               cases: list[dict[str, int]]) -> None:
    got = sync_redis.eval(load_library() + HARNESS, 0, json.dumps(cases), K.prefix)
    want = [twin(c) for c in cases]
    for c, g, w in zip(cases, got, want, strict=True):
        assert [int(g[0]), int(g[1]), str(g[2])] == w, f"case {c}: lua {g}, policies {w}"
