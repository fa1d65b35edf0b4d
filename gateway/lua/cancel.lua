-- Remove a still-queued request (its client went away or it timed out); a user left
-- without requests leaves its tenant's users, a tenant left without users the class's
-- tenants, each keeping its score.
-- KEYS[1] user queue  KEYS[2] active tenants  KEYS[3] saved tenant scores
-- KEYS[4] request hash  KEYS[5] queue depth hash  KEYS[6] backlogged-since hash
-- KEYS[7] the tenant's active users  KEYS[8] its saved user scores
-- KEYS[9] user-level floors (hash tenant -> score)
-- ARGV[1] request id  ARGV[2] user  ARGV[3] class  ARGV[4] tenant
-- Returns 1 when removed, 0 when it was no longer queued (already dispatched).
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then
  return 0
end
if redis.call('HINCRBY', KEYS[5], ARGV[3], -1) <= 0 then
  redis.call('HDEL', KEYS[6], ARGV[3])
end
redis.call('DEL', KEYS[4])
if redis.call('LLEN', KEYS[1]) == 0 then
  local score = redis.call('ZSCORE', KEYS[7], ARGV[2])
  if score then
    place(KEYS[7], KEYS[8], ARGV[2], score, false)
    if redis.call('ZCARD', KEYS[7]) == 0 then
      redis.call('HSET', KEYS[9], ARGV[4], score)
      local tscore = redis.call('ZSCORE', KEYS[2], ARGV[4])
      if tscore then place(KEYS[2], KEYS[3], ARGV[4], tscore, false) end
    end
  end
end
return 1
