"""Differential spec of ``gateway/storage/lua/lib/replicas.lua`` (a replica's liveness,
the reap of what dead ones held) against its plain-data rule, ``policies/replicas.py``:
hypothesis draws replicas (a heartbeat or none, a grant waiting at the head of the grant
list or none, the listener's last turn or none) with requests in their running sets;
one EVAL asks the Lua who is alive and reaps, the rule answers in Python, and the live
replicas, the replicas forgotten and the requests released must agree."""

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
from policies.replicas import ReplicaSeen, alive, dead

NOW, TTL, PICKUP = 1000.0, 3.0, 2.0
HARNESS = """
local a = cjson.decode(ARGV[1])
local prefix, now = a.prefix, a.now
local replicas = key_replicas(prefix)
for _, r in ipairs(a.replicas) do
  if r.beat then redis.call('ZADD', replicas, r.beat, r.name) end
  if r.grant then
    redis.call('RPUSH', key_grants(prefix, r.name),
      grant_entry('g-' .. r.name, 'b1', 0, string.format('%.6f', r.grant), 0))
  end
  if r.listened then redis.call('HSET', key_listened(prefix), r.name, r.listened) end
  for _, id in ipairs(r.running) do
    redis.call('SADD', key_running(prefix, r.name), id)
    redis.call('HSET', key_request(prefix, id), 'state', 'dispatched', 'user', 'u',
      'backend', 'b1')
    redis.call('HINCRBY', key_user_inflight(prefix), 'u', 1)
    redis.call('INCR', key_backend_inflight(prefix, 'b1'))
  end
end
local lives = {}
for _, r in ipairs(a.replicas) do
  lives[r.name] = replica_alive(replicas, prefix, r.name, now, a.ttl, a.pickup)
end
local released = reap_dead(prefix, now, a.ttl, a.pickup)
local left, kept = {}, {}
for _, name in ipairs(redis.call('ZRANGE', replicas, 0, -1)) do left[name] = true end
for _, r in ipairs(a.replicas) do
  kept[r.name] = {
    running = redis.call('SCARD', key_running(prefix, r.name)),
    grants = redis.call('LLEN', key_grants(prefix, r.name)),
    listened = redis.call('HEXISTS', key_listened(prefix), r.name) == 1}
end
return cjson.encode({alive = lives, released = released, left = left, kept = kept,
  inflight = tonumber(redis.call('GET', key_backend_inflight(prefix, 'b1'))) or 0})
"""

# a moment before now in quarter seconds (exact in Redis and Python alike), or none
moments = st.one_of(st.none(), st.integers(0, 24).map(lambda n: NOW - n / 4))
REPLICAS = st.lists(st.fixed_dictionaries({
    "beat": moments, "grant": moments, "listened": moments,
    "running": st.integers(0, 3)}), min_size=1, max_size=4)
examples = itertools.count()


@pytest.fixture(scope="module")
def sync_redis(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def reaped(sync_redis: redis.Redis, drawn: list[dict[str, Any]]) -> dict[str, Any]:
    """What the Lua decided for the drawn replicas (each named r<i>) on a fresh model."""
    prefix = ModelKeys(f"replicas{next(examples)}").prefix
    replicas = [{"name": f"r{i}", "running": [f"q{i}-{j}" for j in range(r["running"])],
                 **{k: r[k] for k in ("beat", "grant", "listened") if r[k] is not None}}
                for i, r in enumerate(drawn)]
    out: dict[str, Any] = json.loads(sync_redis.eval(load_library() + HARNESS, 0, json.dumps(
        {"prefix": prefix, "now": NOW, "ttl": TTL, "pickup": PICKUP, "replicas": replicas})))
    return out


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(REPLICAS)
@example(drawn=[  # the bounds: a heartbeat ttl old lives, a grant pickup old waits
    {"beat": NOW - TTL, "grant": NOW - PICKUP, "listened": None, "running": 1},
    {"beat": NOW, "grant": NOW - PICKUP - 0.25, "listened": NOW - TTL, "running": 1},
    {"beat": NOW, "grant": NOW - 5.0, "listened": NOW - TTL - 0.25, "running": 2},
    {"beat": None, "grant": NOW - 5.0, "listened": None, "running": 1}])
def test_replicas_lua_decides_as_policies_replicas(sync_redis: redis.Redis,
                                                   drawn: list[dict[str, Any]]) -> None:
    got = reaped(sync_redis, drawn)
    seen = {f"r{i}": ReplicaSeen(r["beat"], r["grant"], r["listened"])
            for i, r in enumerate(drawn)}
    want_alive = {name: alive(s, NOW, TTL, PICKUP) for name, s in seen.items()}
    assert got["alive"] == want_alive, (
        f"{drawn}: lua alive {got['alive']}, policies {want_alive}")
    gone = dead(seen, NOW, TTL, PICKUP)
    registered = {name for name, s in seen.items() if s.beat is not None}
    assert sorted(got["left"]) == sorted(registered - set(gone)), (
        f"{drawn}: lua kept {sorted(got['left'])}, policies reap {gone} of {registered}")
    running = {f"r{i}": r["running"] for i, r in enumerate(drawn)}
    want_released = sum(running[name] for name in gone)
    assert got["released"] == want_released, (
        f"{drawn}: lua released {got['released']}, policies {want_released} (dead {gone})")
    assert got["inflight"] == sum(running.values()) - want_released, (
        f"{drawn}: the backend counts {got['inflight']} in flight after the reap")
    for name, kept in got["kept"].items():
        forgotten = name in gone
        want_kept = {"running": 0 if forgotten else running[name],
                     "grants": 0 if forgotten or seen[name].oldest_grant is None else 1,
                     "listened": not forgotten and seen[name].listened is not None}
        assert kept == want_kept, f"{drawn}: lua left {name} with {kept}, want {want_kept}"
