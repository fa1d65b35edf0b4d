-- Queue a request under (model, class, user) and make the user active.
-- KEYS[1] user queue (list)      KEYS[2] active users (zset)   KEYS[3] saved scores (hash)
-- KEYS[4] request (hash)         KEYS[5] queue depth (hash class -> n)
-- KEYS[6] backlogged-since (hash class -> t)  KEYS[7] replica heartbeats (zset)
-- ARGV[1] request id  ARGV[2] user  ARGV[3] class  ARGV[4] owner replica
-- ARGV[5] dispatch cost (the fairness policy's, added to the user's score at dispatch)
-- ARGV[6] now (s)  ARGV[7] max queued per user  ARGV[8] request ttl (s)
-- ARGV[9] the prompt's block-hash chain, space-separated ("" when not hashed)
-- Returns the user's queue length, or -1 when the per-user cap is reached.
local queued = redis.call('LLEN', KEYS[1])
if queued >= tonumber(ARGV[7]) then
  return -1
end
-- the owner is alive (it is enqueueing): a Redis restarted empty learns it at once
redis.call('ZADD', KEYS[7], 'GT', ARGV[6], ARGV[4])
redis.call('HSET', KEYS[4], 'user', ARGV[2], 'class', ARGV[3], 'owner', ARGV[4],
  'cost', ARGV[5], 'enqueued_at', ARGV[6], 'state', 'queued')
if ARGV[9] and ARGV[9] ~= '' then redis.call('HSET', KEYS[4], 'prefix', ARGV[9]) end
redis.call('EXPIRE', KEYS[4], tonumber(ARGV[8]))
redis.call('RPUSH', KEYS[1], ARGV[1])
if redis.call('HINCRBY', KEYS[5], ARGV[3], 1) == 1 then
  redis.call('HSET', KEYS[6], ARGV[3], ARGV[6])
end
if not redis.call('ZSCORE', KEYS[2], ARGV[2]) then
  -- Joining: a returning user starts no lower than the least-served active user, so
  -- it cannot bank credit while idle.
  local score = tonumber(redis.call('HGET', KEYS[3], ARGV[2])) or 0
  local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  if first[2] and tonumber(first[2]) > score then
    score = tonumber(first[2])
  end
  redis.call('ZADD', KEYS[2], score, ARGV[2])
end
return queued + 1
