-- In-flight state of one backend: a granted request becomes dispatched there.
-- inflight_for(prefix, backend, replica, k, recent_kept, now, stamp), k = the key names
-- {user_inflight, sent, backend_inflight, recent, prefill}.
local function inflight_for(prefix, backend, replica, k, recent_kept, now, stamp)
  local I = {}

  -- grant request `id` (hash `req`) of `user` in `class`, whose client `owner` holds,
  -- with `tokens` uncached prompt tokens: its vLLM priority rank (the user's requests
  -- already in flight), the per-user and per-backend counts, the sent-since-snapshot set,
  -- the owner's running set (or its grant list when another replica holds the client),
  -- the recent classes and the pending prefill. Returns the rank and the backend's
  -- requests in flight.
  function I.grant(id, req, class, user, owner, tokens)
    local rank = redis.call('HINCRBY', k.user_inflight, user, 1) - 1
    redis.call('ZADD', k.sent, now, id)
    local inflight = redis.call('INCR', k.backend_inflight)
    redis.call('HSET', req, 'state', 'dispatched', 'backend', backend, 'rank', rank,
      'dispatched_at', now)
    redis.call('SADD', key_running(prefix, owner), id)
    redis.call('LPUSH', k.recent, class)
    redis.call('LTRIM', k.recent, 0, recent_kept - 1)
    if owner ~= replica then
      redis.call('RPUSH', key_grants(prefix, owner), grant_entry(id, backend, rank, stamp))
    end
    if tokens > 0 then redis.call('HSET', k.prefill, id, prefill_entry(tokens, stamp)) end
    return rank, inflight
  end

  return I
end

-- Release request `id` of `user`, dispatched to `backend`, whose client `owner` held
-- (settle.lua, reap.lua): out of the backend's in-flight count, pending prefill, started
-- and sent-since-snapshot sets, the user's in-flight count and the owner's running set.
-- True when it was still in the sent-since-snapshot set.
local function release_inflight(prefix, id, user, backend, owner)
  redis.call('HDEL', key_backend_prefill(prefix, backend), id)
  redis.call('ZREM', key_backend_started(prefix, backend), id)
  if owner then redis.call('SREM', key_running(prefix, owner), id) end
  local users = key_user_inflight(prefix)
  if redis.call('HINCRBY', users, user, -1) <= 0 then redis.call('HDEL', users, user) end
  local inflight = key_backend_inflight(prefix, backend)
  if redis.call('DECR', inflight) <= 0 then redis.call('DEL', inflight) end
  return redis.call('ZREM', key_backend_sent(prefix, backend), id) == 1
end
