-- Forget trusted keys' end users idle for `idle` seconds (run by every replica's
-- heartbeat, gateway/scheduling/replicas.py): their saved scores (the user's in its
-- tenant, and with a tenant of its own the tenant's score and user-level floor), their
-- service-share entries and their last-seen entry. An end user that returns is a new
-- user (join in _lib.lua lifts it to the smallest active score of each level). At most
-- `limit` end users per call, the longest idle first, so a million idle ones never hold
-- Redis for long. One with a request queued or in flight is never forgotten: it is
-- active now, so its last-seen time becomes `now` (a batch request may queue for a day).
-- KEYS: the last-seen zset, per-user in-flight, service shares, their who hash, then
-- per class its saved tenant scores and user-level floors (declared for Redis Cluster;
-- the users and saved user scores of a tenant are derived from the prefix)
-- ARGV[1]: one JSON object {prefix, now (s), idle (s), limit, classes}
-- Returns a named map {forgotten, kept (queued or in flight)}.
local a = cjson.decode(ARGV[1])
local prefix = a.prefix
local seen = key_seen(prefix)
local inflight = key_user_inflight(prefix)

local function busy(tenant, user)
  if redis.call('HEXISTS', inflight, user) == 1 then return true end
  for _, class in ipairs(a.classes) do
    if redis.call('ZSCORE', key_users(prefix, class, tenant), user)
        or redis.call('EXISTS', key_queue(prefix, class, tenant, user)) == 1 then
      return true
    end
  end
  return false
end

local function forget(tenant, user)
  for _, class in ipairs(a.classes) do
    redis.call('HDEL', key_user_saved(prefix, class, tenant), user)
    if tenant == user then  -- its own tenant (a key naming none): nobody else's state
      redis.call('HDEL', key_saved(prefix, class), tenant)
      redis.call('HDEL', key_user_floor(prefix, class), tenant)
    end
  end
  redis.call('ZREM', key_service(prefix), user)
  redis.call('HDEL', key_service_who(prefix), user)
end

local forgotten, kept = 0, 0
for _, entry in ipairs(redis.call('ZRANGEBYSCORE', seen, '-inf', a.now - a.idle,
                                  'LIMIT', 0, a.limit)) do
  local tenant, user = seen_tenant(entry), seen_user(entry)
  if busy(tenant, user) then
    redis.call('ZADD', seen, a.now, entry)
    kept = kept + 1
  else
    forget(tenant, user)
    redis.call('ZREM', seen, entry)
    forgotten = forgotten + 1
  end
end
return cjson.encode({forgotten = forgotten, kept = kept})
