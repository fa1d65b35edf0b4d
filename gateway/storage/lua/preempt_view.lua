-- What a preemption decision reads (policies/preemption.py, gateway/scheduling/
-- preemption.py), in one call: for each class with requests queued, the request its next
-- dispatch takes first (the queue head of the least-scored user of the least-scored
-- tenant, with sessions on of its default session or else its least-scored one) with its
-- user's score; and every dispatched, unsettled request the live
-- replicas hold, with its user's score in its class (a whole answer, never streamed,
-- counts as started once dispatched: it reports no first token; a segment that left its
-- backend, its answer continuing elsewhere, is marked `left`).
-- KEYS: the replicas zset and the queue depth hash, declared for Redis Cluster
-- ARGV[1]: one JSON object {prefix, classes (service order), alive_after (unix s: the
--   oldest live heartbeat)}
-- Returns a named map {queued = [{class, user, enqueued_at, score}], inflight = [{id, class,
--   user, backend, started, enqueued_at, dispatched_at, preempted, unmovable, left,
--   score}]}.
local p = cjson.decode(ARGV[1])
local prefix = p.prefix

local function score(class, tenant, user)
  local s = redis.call('ZSCORE', key_users(prefix, class, tenant), user)
  if not s then s = redis.call('HGET', key_user_saved(prefix, class, tenant), user) end
  return tonumber(s) or 0
end

local queued = {}
for _, class in ipairs(p.classes) do
  if (tonumber(redis.call('HGET', key_depth(prefix), class)) or 0) > 0 then
    local tenant = redis.call('ZRANGE', key_active(prefix, class), 0, 0)[1]
    local first = tenant and redis.call('ZRANGE', key_users(prefix, class, tenant), 0, 0,
      'WITHSCORES')
    if first and first[1] then
      local head = redis.call('LINDEX', key_queue(prefix, class, tenant, first[1]), 0)
      if not head then  -- sessions on, its default session empty: its first session's
        local session = redis.call('ZRANGE', key_sessions(prefix, class, tenant, first[1]),
          0, 0)[1]
        head = session and redis.call('LINDEX',
          queue_of(prefix, class, tenant, first[1], session), 0)
      end
      local at = head and redis.call('HGET', key_request(prefix, head), 'enqueued_at')
      if at then
        queued[#queued + 1] = {class = class, user = first[1], enqueued_at = tonumber(at),
          score = tonumber(first[2])}
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
      'left')
    if f.state == 'dispatched' and f.backend then
      inflight[#inflight + 1] = {id = id, class = f.class, user = f.user, backend = f.backend,
        started = f.started == '1' or f.whole == '1', enqueued_at = tonumber(f.enqueued_at) or 0,
        dispatched_at = tonumber(f.dispatched_at) or 0, preempted = tonumber(f.preempted) or 0,
        unmovable = f.unmovable == '1', left = f.left == '1',
        score = score(f.class, f.tenant or f.user, f.user)}
    end
  end
end
return cjson.encode({queued = queued, inflight = inflight})
