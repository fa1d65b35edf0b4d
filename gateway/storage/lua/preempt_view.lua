-- What a preemption decision reads (policies/preemption.py, gateway/scheduling/
-- preemption.py), in one call: for each class with requests queued, the request its next
-- dispatch takes first (the queue head of the least-scored user of the least-scored
-- tenant, with sessions on of its default session or else its least-scored one) with its
-- user's score; and every dispatched, unsettled request the live
-- replicas hold, with its user's score in its class (a whole answer, never streamed,
-- counts as started once dispatched: it reports no first token; a segment that left its
-- backend, its answer continuing elsewhere, is marked `left`).
-- KEYS[1] replicas zset  KEYS[2] queue depth hash
-- ARGV[1] JSON {prefix, classes (service order), alive_after (unix s: the oldest live
--   heartbeat)}
-- Returns JSON {queued = [{class, user, enqueued_at, score}], inflight = [{id, class,
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
  if (tonumber(redis.call('HGET', KEYS[2], class)) or 0) > 0 then
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
for _, replica in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], p.alive_after, '+inf')) do
  for _, id in ipairs(redis.call('SMEMBERS', key_running(prefix, replica))) do
    local f = redis.call('HMGET', key_request(prefix, id), 'state', 'class', 'user', 'tenant',
      'backend', 'started', 'enqueued_at', 'dispatched_at', 'preempted', 'unmovable', 'whole',
      'left')
    if f[1] == 'dispatched' and f[5] then
      inflight[#inflight + 1] = {id = id, class = f[2], user = f[3], backend = f[5],
        started = f[6] == '1' or f[11] == '1', enqueued_at = tonumber(f[7]) or 0,
        dispatched_at = tonumber(f[8]) or 0, preempted = tonumber(f[9]) or 0,
        unmovable = f[10] == '1', left = f[12] == '1', score = score(f[2], f[4] or f[3], f[3])}
    end
  end
end
return cjson.encode({queued = queued, inflight = inflight})
