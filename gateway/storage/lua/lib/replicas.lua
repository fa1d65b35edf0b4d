-- Replicas: liveness, and the reaping of what dead ones held.

-- A replica is alive while its heartbeat is fresher than `ttl` seconds and it picks up
-- the grants other replicas push to it (its listener waits on that list all the time):
-- a grant left unread for `pickup` seconds means the replica died, whatever its last
-- heartbeat says. A grant entry: gateway/storage/values.py GRANT.
local function replica_alive(replicas, prefix, replica, now, ttl, pickup)
  local beat = redis.call('ZSCORE', replicas, replica)
  if not beat or tonumber(beat) < now - ttl then return false end
  local head = redis.call('LINDEX', key_grants(prefix, replica), 0)
  if head then
    local pushed_at = tonumber(grant_pushed_at(head))
    if pushed_at and pushed_at < now - pickup then
      -- a grant waits unread: dead only if its listener also made no turn for `ttl`
      -- (wedged); one that turns, late under load, is working through its grants
      local listened = tonumber(redis.call('HGET', key_listened(prefix), replica))
      if not listened or listened < now - ttl then return false end
    end
  end
  return true
end

-- Release what dead replicas held (reap.lua): the requests dispatched to them (granted,
-- maybe never forwarded; release_request in inflight.lua) and their undelivered grants,
-- and forget them. Queued requests of a dead replica are dropped lazily by dispatch.
-- Returns the number of requests released.
local function reap_dead(prefix, now, ttl, pickup)
  local replicas = key_replicas(prefix)
  local dead = {}
  for _, replica in ipairs(redis.call('ZRANGE', replicas, 0, -1)) do
    if not replica_alive(replicas, prefix, replica, now, ttl, pickup) then
      dead[#dead + 1] = replica
    end
  end
  local released = 0
  for _, replica in ipairs(dead) do
    local running = key_running(prefix, replica)
    for _, id in ipairs(redis.call('SMEMBERS', running)) do
      local f = request_get(key_request(prefix, id), 'user', 'backend', 'started')
      if release_request(prefix, id, {state = 'dispatched', user = f.user, backend = f.backend,
                                      started = f.started, owner = replica}) then
        released = released + 1
      end
    end
    redis.call('DEL', running, key_grants(prefix, replica))
    redis.call('HDEL', key_listened(prefix), replica)
    redis.call('ZREM', replicas, replica)
  end
  return released
end
