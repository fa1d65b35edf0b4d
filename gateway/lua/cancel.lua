-- Remove a still-queued request (its client went away or it timed out).
-- KEYS[1] user queue  KEYS[2] active zset  KEYS[3] saved-score hash  KEYS[4] request hash
-- KEYS[5] queue depth hash  KEYS[6] backlogged-since hash
-- ARGV[1] request id  ARGV[2] user  ARGV[3] class
-- Returns 1 when removed, 0 when it was no longer queued (already dispatched).
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then
  return 0
end
if redis.call('HINCRBY', KEYS[5], ARGV[3], -1) <= 0 then
  redis.call('HDEL', KEYS[6], ARGV[3])
end
redis.call('DEL', KEYS[4])
if redis.call('LLEN', KEYS[1]) == 0 then
  local score = redis.call('ZSCORE', KEYS[2], ARGV[2])
  redis.call('ZREM', KEYS[2], ARGV[2])
  if score then redis.call('HSET', KEYS[3], ARGV[2], score) end
end
return 1
