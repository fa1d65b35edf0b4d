-- Store a backend's /metrics snapshot if it is newer than the stored one, forget the
-- dispatches it reflects, and estimate the requests still on their way to the backend.
-- KEYS[1] snapshot hash  KEYS[2] backend sent-since-snapshot zset  KEYS[3] backend in-flight
-- KEYS[4] drained backends (set)  KEYS[5] backend pending prefill (hash)
-- KEYS[6] backend started-since-snapshot zset: the snapshot shows what started before it
-- ARGV[1] taken_at (s)  ARGV[2] waiting  ARGV[3] running  ARGV[4] kv usage
-- ARGV[5] tpot seconds or ""  ARGV[6] backend name  ARGV[7] model key prefix
-- ARGV[8] what the scraper publishes with it (gateway/backends/published.py, JSON): every
-- process reads the snapshot, its gates and pacing from here (scrapers.lua)
-- "unseen" = dispatched and unsettled, minus what the backend showed (running + waiting),
-- minus what was dispatched after the scrape began: requests a slow server has not
-- registered yet. They count against the gate like waiting ones, with no time guesswork.
-- The snapshot it replaces stays as "prev_at" and "prev_unseen", and the sent and started
-- sets keep what came since it: a decision by it still counts what it must (gate_counts
-- in _lib.lua).
-- The pending prefill keeps what the snapshot may not have scheduled (policies/prefill.py
-- still_pending): what was sent after the scrape began, and of the earlier ones the
-- newest waiting + unseen; an entry whose request is gone leaves too.
-- A stored snapshot clears the published failures and moves the hash's version "v" on.
-- Returns {stored, drained, pending, version}: stored 1 unless an equal or newer snapshot
-- was already there; drained 1 when an operator drained this backend (so every replica
-- learns it); pending the backend's pending prefill tokens after the trim; version the
-- hash's "v" after it (0 when not stored).
local drained = redis.call('SISMEMBER', KEYS[4], ARGV[6])
local prev = redis.call('HMGET', KEYS[1], 'taken_at', 'unseen')
local stored = tonumber(prev[1])
if stored and stored >= tonumber(ARGV[1]) then
  return {0, drained, 0, 0}
end
-- (the stored time as stored: a number printed back by Lua loses its microseconds)
local prev_at = prev[1] or ARGV[1]
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', prev_at)
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', prev_at)
local unseen = (tonumber(redis.call('GET', KEYS[3])) or 0)
  - redis.call('ZCOUNT', KEYS[2], '(' .. ARGV[1], '+inf') - tonumber(ARGV[2]) - tonumber(ARGV[3])
if unseen < 0 then unseen = 0 end
local entries = redis.call('HGETALL', KEYS[5])
local before = {}
for i = 1, #entries, 2 do
  local id = entries[i]
  local at = tonumber(prefill_dispatched_at(entries[i + 1])) or 0
  if redis.call('EXISTS', key_request(ARGV[7], id)) == 0 then
    redis.call('HDEL', KEYS[5], id)
  elseif at < tonumber(ARGV[1]) then
    before[#before + 1] = {at, id}
  end
end
table.sort(before, function(x, y) return x[1] > y[1] end)  -- newest first
for i = tonumber(ARGV[2]) + unseen + 1, #before do
  redis.call('HDEL', KEYS[5], before[i][2])
end
redis.call('HSET', KEYS[1], 'taken_at', ARGV[1], 'waiting', ARGV[2], 'running', ARGV[3],
  'kv', ARGV[4], 'tpot', ARGV[5], 'unseen', unseen, 'shared', ARGV[8], 'failures', 0,
  'prev_at', prev[1] or '', 'prev_unseen', prev[2] or 0)
local version = redis.call('HINCRBY', KEYS[1], 'v', 1)
return {1, drained, pending_prefill(KEYS[5]), version}
