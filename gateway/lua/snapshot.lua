-- Store a backend's /metrics snapshot if it is newer than the stored one, and forget the
-- dispatches it already reflects.
-- KEYS[1] snapshot hash  KEYS[2] backend sent-since-snapshot zset
-- ARGV[1] taken_at (s)  ARGV[2] waiting  ARGV[3] running  ARGV[4] kv usage
-- ARGV[5] tpot seconds or ""  ARGV[6] arrival margin (s): dispatches younger than
-- taken_at - margin may not have reached the backend yet and stay counted.
-- Returns 1 when stored, 0 when an equal or newer snapshot was already there.
local stored = tonumber(redis.call('HGET', KEYS[1], 'taken_at'))
if stored and stored >= tonumber(ARGV[1]) then
  return 0
end
redis.call('HSET', KEYS[1], 'taken_at', ARGV[1], 'waiting', ARGV[2], 'running', ARGV[3],
  'kv', ARGV[4], 'tpot', ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', tonumber(ARGV[1]) - tonumber(ARGV[6]))
return 1
