-- A backend streams a request's first token: it runs there, so it no longer counts
-- against the gate as dispatched-since-snapshot or as on its way ("unseen"); it took a
-- batch slot the snapshot may have seen free, so it joins the backend's started-since-
-- snapshot set (policies/gates.py Gate.used: those use up the gate's free slots first).
-- KEYS[1] backend sent-since-snapshot zset  KEYS[2] backend snapshot (hash)
-- KEYS[3] request (hash)  KEYS[4] backend pending prefill (hash): its prefill is done
-- KEYS[5] backend started-since-snapshot zset
-- ARGV[1] request id  ARGV[2] now (s)
-- Returns 1 when a gate slot was freed, 0 otherwise.
if redis.call('HSETNX', KEYS[3], 'started', 1) == 0 then
  return 0  -- already marked
end
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('ZADD', KEYS[5], ARGV[2], ARGV[1])
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  return 1
end
return take_unseen(KEYS[2])
