-- A backend streams a request's first token: it runs there, so it no longer counts
-- against the gate as dispatched-since-snapshot or as on its way ("unseen").
-- KEYS[1] backend sent-since-snapshot zset  KEYS[2] backend snapshot (hash)
-- KEYS[3] request (hash)  KEYS[4] backend pending prefill (hash): its prefill is done
-- ARGV[1] request id
-- Returns 1 when a gate slot was freed, 0 otherwise.
if redis.call('HSETNX', KEYS[3], 'started', 1) == 0 then
  return 0  -- already marked
end
redis.call('HDEL', KEYS[4], ARGV[1])
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  return 1
end
return take_unseen(KEYS[2])
