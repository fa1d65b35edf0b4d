-- Store a backend's /metrics snapshot if it is newer than the stored one, forget the
-- dispatches it reflects, and estimate the requests still on their way to the backend.
-- KEYS: the backend's snapshot hash, sent-since-snapshot zset, in-flight count, pending
-- prefill hash and started-since-snapshot zset (the snapshot shows what started before
-- it), and the drained set: declared for Redis Cluster (gateway/storage/fleet_store.py)
-- ARGV[1]: one JSON object {prefix (the model's key prefix), backend, taken_at (s, as
-- text: stored as given), waiting, running, kv (kv usage, as text), tpot (seconds as text,
-- or ""), shared (what the scraper publishes with it, gateway/backends/published.py, JSON:
-- every process reads the snapshot, its gates and pacing from here, scrapers.lua)}
-- "unseen" = dispatched and unsettled, minus what the backend showed (running + waiting),
-- minus what was dispatched after the scrape began: requests a slow server has not
-- registered yet. They count against the gate like waiting ones, with no time guesswork,
-- but never more of them than were sent before the scrape and have not streamed a first
-- token (gate_counts in _lib.lua): the count also takes in requests vLLM has finished
-- whose answers the gateway still relays.
-- The snapshot it replaces stays as "prev_at" and "prev_unseen", and the started set keeps
-- what came since it: a decision by it still counts what it must (gate_counts). The sent
-- set keeps every request not started yet (each leaves it at its first token or its
-- release); one whose request is gone leaves it here.
-- The pending prefill keeps what the snapshot may not have scheduled (policies/prefill.py
-- still_pending): what was sent after the scrape began, and of the earlier ones the
-- newest waiting + unseen; an entry whose request is gone leaves too.
-- A stored snapshot clears the published failures and moves the hash's version "v" on.
-- Returns a named map {stored, drained, pending, version}: stored false when an equal or
-- newer snapshot was already there; drained true when an operator drained this backend
-- (so every replica learns it); pending the backend's pending prefill tokens after the
-- trim; version the hash's "v" after it (0 when not stored).
local a = cjson.decode(ARGV[1])
local prefix, backend, taken = a.prefix, a.backend, a.taken_at
local snapshot, sent = key_backend_snapshot(prefix, backend), key_backend_sent(prefix, backend)
local prefill = key_backend_prefill(prefix, backend)
local drained = redis.call('SISMEMBER', key_drained(prefix), backend) == 1
local stored_at, stored_unseen = unpack(redis.call('HMGET', snapshot, 'taken_at', 'unseen'))
local stored = tonumber(stored_at)
if stored and stored >= tonumber(taken) then
  return cjson.encode({stored = false, drained = drained, pending = 0, version = 0})
end
-- (the stored time as stored: a number printed back by Lua loses its microseconds)
local prev_at = stored_at or taken
for _, id in ipairs(redis.call('ZRANGEBYSCORE', sent, '-inf', prev_at)) do
  if redis.call('EXISTS', key_request(prefix, id)) == 0 then redis.call('ZREM', sent, id) end
end
redis.call('ZREMRANGEBYSCORE', key_backend_started(prefix, backend), '-inf', prev_at)
local unseen = (tonumber(redis.call('GET', key_backend_inflight(prefix, backend))) or 0)
  - redis.call('ZCOUNT', sent, '(' .. taken, '+inf') - tonumber(a.waiting) - tonumber(a.running)
if unseen < 0 then unseen = 0 end
local entries = redis.call('HGETALL', prefill)
local before = {}
for i = 1, #entries, 2 do
  local id = entries[i]
  local at = tonumber(prefill_dispatched_at(entries[i + 1])) or 0
  if redis.call('EXISTS', key_request(prefix, id)) == 0 then
    redis.call('HDEL', prefill, id)
  elseif at < tonumber(taken) then
    before[#before + 1] = {at, id}
  end
end
table.sort(before, function(x, y) return x[1] > y[1] end)  -- newest first
for i = tonumber(a.waiting) + unseen + 1, #before do
  redis.call('HDEL', prefill, before[i][2])
end
redis.call('HSET', snapshot, 'taken_at', taken, 'waiting', a.waiting, 'running', a.running,
  'kv', a.kv, 'tpot', a.tpot, 'unseen', unseen, 'shared', a.shared, 'failures', 0,
  'prev_at', stored_at or '', 'prev_unseen', stored_unseen or 0)
local version = redis.call('HINCRBY', snapshot, 'v', 1)
return cjson.encode({stored = true, drained = drained, pending = pending_prefill(prefill),
                     version = version})
