-- Release what dead replicas held: requests dispatched to them (granted, maybe never
-- forwarded) and their undelivered grants. Queued requests of a dead replica are dropped
-- lazily by dispatch.lua. Dead: see replica_alive in _lib.lua.
-- KEYS[1] replica heartbeats (zset)  KEYS[2] per-user in-flight (hash; declared for Redis
-- Cluster: release_inflight in lib/inflight.lua derives the in-flight keys)
-- ARGV[1] now (s)  ARGV[2] replica ttl (s)  ARGV[3] model key prefix
-- ARGV[4] grant pickup limit (s)
-- Returns the number of requests released.
local prefix = ARGV[3]
local now, ttl, pickup = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
local dead = {}
for _, replica in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if not replica_alive(KEYS[1], prefix, replica, now, ttl, pickup) then
    dead[#dead + 1] = replica
  end
end
local released = 0
for _, replica in ipairs(dead) do
  local running = key_running(prefix, replica)
  for _, id in ipairs(redis.call('SMEMBERS', running)) do
    local req = key_request(prefix, id)
    local f = redis.call('HMGET', req, 'user', 'backend')
    if f[1] and f[2] then
      release_inflight(prefix, id, f[1], f[2], replica)
      released = released + 1
    end
    redis.call('DEL', req)
  end
  redis.call('DEL', running, key_grants(prefix, replica))
  redis.call('HDEL', key_listened(prefix), replica)
  redis.call('ZREM', KEYS[1], replica)
end
return released
