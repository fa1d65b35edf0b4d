-- What a preemption decision reads (policies/preemption.py, gateway/scheduling/
-- preemption.py), in one call: for each class with requests queued, the next request of
-- each of its first `tenants` tenants in fair order (the queue head of the tenant's
-- least-scored user, with sessions on of its default session or else its least-scored
-- one; the first is the one its next dispatch takes) with its user's score; and every
-- dispatched, unsettled request the live
-- replicas hold, with its user's score in its class (a whole answer, never streamed,
-- counts as started once dispatched: it reports no first token; a segment that left its
-- backend, its answer continuing elsewhere, is marked `left`).
-- KEYS: the replicas zset and the queue depth hash, declared for Redis Cluster
-- ARGV[1]: one JSON object {prefix, classes (service order), alive_after (unix s: the
--   oldest live heartbeat), tenants (how many of each class's tenants)}
-- Returns a named map {queued = [{class, user, tenant, enqueued_at, score}], inflight =
--   [{id, class, user, tenant, backend, started, enqueued_at, dispatched_at, preempted,
--   unmovable, left, ptok (its estimated prompt tokens), score}]}.
local p = cjson.decode(ARGV[1])
local prefix = p.prefix

local function score(class, tenant, user)
  local s = redis.call('ZSCORE', key_users(prefix, class, tenant), user)
  if not s then s = redis.call('HGET', key_user_saved(prefix, class, tenant), user) end
  return tonumber(s) or 0
end

-- the enqueued_at of the request a user's next dispatch takes (its queue head; with
-- sessions on, of its default session or else its least-scored one), nil when none
local function head_at(class, tenant, user)
  local head = redis.call('LINDEX', key_queue(prefix, class, tenant, user), 0)
  if not head then  -- sessions on, its default session empty: its first session's
    local session = redis.call('ZRANGE', key_sessions(prefix, class, tenant, user), 0, 0)[1]
    head = session and redis.call('LINDEX', queue_of(prefix, class, tenant, user, session), 0)
  end
  return head and tonumber(redis.call('HGET', key_request(prefix, head), 'enqueued_at'))
end

local queued = {}
for _, class in ipairs(p.classes) do
  if (tonumber(redis.call('HGET', key_depth(prefix), class)) or 0) > 0 then
    -- the least-scored user of each of the class's first tenants (fair order)
    for _, tenant in ipairs(redis.call('ZRANGE', key_active(prefix, class), 0, p.tenants - 1)) do
      local first = redis.call('ZRANGE', key_users(prefix, class, tenant), 0, 0, 'WITHSCORES')
      local at = first[1] and head_at(class, tenant, first[1])
      if at then
        queued[#queued + 1] = {class = class, user = first[1], tenant = tenant,
          enqueued_at = at, score = tonumber(first[2])}
      end
    end
  end
end

local inflight = {}
local live = redis.call('ZRANGEBYSCORE', key_replicas(prefix), p.alive_after, '+inf')
for _, replica in ipairs(live) do
  for _, id in ipairs(redis.call('SMEMBERS', key_running(prefix, replica))) do
    local f = request_get(key_request(prefix, id), 'state', 'class', 'user', 'tenant',
      'backend', 'started', 'enqueued_at', 'dispatched_at', 'preempted', 'unmovable', 'whole',
      'left', 'ptok')
    if f.state == 'dispatched' and f.backend then
      inflight[#inflight + 1] = {id = id, class = f.class, user = f.user, backend = f.backend,
        started = f.started == '1' or f.whole == '1', enqueued_at = tonumber(f.enqueued_at) or 0,
        dispatched_at = tonumber(f.dispatched_at) or 0, preempted = tonumber(f.preempted) or 0,
        unmovable = f.unmovable == '1', left = f.left == '1', tenant = f.tenant or f.user,
        ptok = tonumber(f.ptok) or 0, score = score(f.class, f.tenant or f.user, f.user)}
    end
  end
end
return cjson.encode({queued = queued, inflight = inflight})
