-- Release a dispatched request and add the fairness policy's settle charge to its user's
-- score (to the saved score when the user is idle).
-- KEYS[1] per-user in-flight (hash)  KEYS[2] backend in-flight  KEYS[3] active zset (class)
-- KEYS[4] saved-score hash (class)   KEYS[5] request (hash)     KEYS[6] backend sent zset
-- KEYS[7] backend snapshot (hash)
-- ARGV[1] user  ARGV[2] charge  ARGV[3] request id  ARGV[4] model key prefix
-- Returns 1 when released, 0 when it had been released already.
local info = redis.call('HMGET', KEYS[5], 'owner', 'started')
if redis.call('DEL', KEYS[5]) == 0 then
  return 0
end
local owner = info[1]
if owner then redis.call('SREM', key_running(ARGV[4], owner), ARGV[3]) end
local left = redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
if left <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
if redis.call('DECR', KEYS[2]) <= 0 then redis.call('DEL', KEYS[2]) end
if redis.call('ZREM', KEYS[6], ARGV[3]) == 0 and not info[2] then
  -- dispatched before the snapshot and never seen starting: it may be among the
  -- snapshot's "unseen", and is gone now
  take_unseen(KEYS[7])
end
local charge = tonumber(ARGV[2])
if charge ~= 0 then
  if redis.call('ZSCORE', KEYS[3], ARGV[1]) then
    redis.call('ZINCRBY', KEYS[3], charge, ARGV[1])
  else
    redis.call('HINCRBYFLOAT', KEYS[4], ARGV[1], charge)
  end
end
return 1
