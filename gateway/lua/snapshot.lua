-- Store a backend's /metrics snapshot if it is newer than the stored one, forget the
-- dispatches it reflects, and estimate the requests still on their way to the backend.
-- KEYS[1] snapshot hash  KEYS[2] backend sent-since-snapshot zset  KEYS[3] backend in-flight
-- KEYS[4] drained backends (set)
-- ARGV[1] taken_at (s)  ARGV[2] waiting  ARGV[3] running  ARGV[4] kv usage
-- ARGV[5] tpot seconds or ""  ARGV[6] backend name
-- "unseen" = dispatched and unsettled, minus what the backend showed (running + waiting),
-- minus what was dispatched after the scrape began: requests a slow server has not
-- registered yet. They count against the gate like waiting ones, with no time guesswork.
-- Returns {stored, drained}: stored 1 unless an equal or newer snapshot was already there;
-- drained 1 when an operator drained this backend (so every replica learns it).
local drained = redis.call('SISMEMBER', KEYS[4], ARGV[6])
local stored = tonumber(redis.call('HGET', KEYS[1], 'taken_at'))
if stored and stored >= tonumber(ARGV[1]) then
  return {0, drained}
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
local unseen = (tonumber(redis.call('GET', KEYS[3])) or 0) - redis.call('ZCARD', KEYS[2])
  - tonumber(ARGV[2]) - tonumber(ARGV[3])
if unseen < 0 then unseen = 0 end
redis.call('HSET', KEYS[1], 'taken_at', ARGV[1], 'waiting', ARGV[2], 'running', ARGV[3],
  'kv', ARGV[4], 'tpot', ARGV[5], 'unseen', unseen)
return {1, drained}
