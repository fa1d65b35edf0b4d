-- Queue one tick's requests, each under (model, class, tenant, user), making the user and
-- its tenant active (see join in _lib.lua), and with sessions on in its session's queue,
-- making the session active among the user's (queue_of in _lib.lua); then, when asked,
-- dispatch to the backend most likely to take them (dispatch_for in lib/dispatch.lua):
-- the tick's requests and their dispatch are one call. Starts its replica held back go
-- first (start_each in lib/inflight.lua), so the decision sees the slots they freed.
-- Within a user's queue, earliest deadline first: a request with a deadline goes ahead
-- of the user's own requests with a later deadline or none (those keep their order), so
-- the queue is its deadline requests by deadline, then the rest in arrival order.
-- KEYS: the keys touched, declared for Redis Cluster (gateway/storage/queue_store.py)
-- ARGV[1]: one JSON object {prefix (the model's key prefix), max_queued (per user), ttl
-- (a request hash's, s), requests, starts (optional: a list of {id, backend, at}),
-- dispatch (optional: dispatch_for's arguments)};
-- a request: {id, user, class, tenant, owner, cost and tcost (user- and tenant-level
-- dispatch costs, added to the scores at dispatch), now (s), chain (the prompt's
-- block-hash chain, space-separated, "" when not hashed), deadline (first-token
-- deadline, unix s, "" for none), ptok (estimated prompt tokens: where it fits, the
-- prefill gate), hit and thit (optional, with a chain: what each prompt token a
-- backend's prefix index predicts cached takes off cost and tcost at dispatch), whole (optional: true for a whole answer, never streamed), adapter
-- (optional: the LoRA adapter it names; only a backend having it takes it), requeue
-- (optional: true for a request its replica queues again after a failover: not held to
-- the cap), seen (optional: true for a trusted key's end user: its last-seen time
-- becomes `now`, see seen_at in _lib.lua), session (optional, sessions on: its session
-- key, "" for the user's default session), leaves (optional, a continuation: {id,
-- backend} of the segment it continues, which leaves that backend: leave_inflight in
-- lib/inflight.lua)}
-- Returns a named map {positions, dispatched (dispatch_for's map, when it ran)}: positions
-- per request its user's queue length (with sessions: its requests queued in all its
-- sessions), -1 when the per-user cap is reached, 0 when the request was known already
-- (its hash exists: skipped).
local a = cjson.decode(ARGV[1])
local prefix = a.prefix

local function enqueue(r)
  if r.leaves then leave_inflight(prefix, r.leaves.id, r.leaves.backend) end
  local queue = queue_of(prefix, r.class, r.tenant, r.user, r.session)
  local req = key_request(prefix, r.id)
  -- a request goes in once: one the store knows already is a call retried after its
  -- reply was lost, or a request queued again after a failover (its replica still holds
  -- the client) that the store did not forget; a requeued one is within the cap it was
  -- admitted under already
  if redis.call('EXISTS', req) == 1 then return 0 end
  -- the cap counts the user's requests, over all its sessions
  local count = r.session and key_user_queued(prefix, r.class, r.tenant, r.user)
  local queued = count and (tonumber(redis.call('GET', count)) or 0)
    or redis.call('LLEN', queue)
  if queued >= a.max_queued and not r.requeue then return -1 end
  -- the owner is alive (it is enqueueing): a Redis restarted empty learns it at once
  redis.call('ZADD', key_replicas(prefix), 'GT', r.now, r.owner)
  redis.call('HSET', req, 'user', r.user, 'class', r.class, 'owner', r.owner,
    'cost', r.cost, 'enqueued_at', r.now, 'state', 'queued', 'tenant', r.tenant,
    'tcost', r.tcost, 'ptok', r.ptok)
  if r.chain ~= '' then
    redis.call('HSET', req, 'prefix', r.chain)
    -- taken off the costs per prompt token a backend's index predicts cached
    if r.hit then redis.call('HSET', req, 'hit', r.hit, 'thit', r.thit) end
  end
  if r.whole then redis.call('HSET', req, 'whole', 1) end
  if r.adapter then redis.call('HSET', req, 'adapter', r.adapter) end
  redis.call('EXPIRE', req, a.ttl)
  local deadline = tonumber(r.deadline)
  local pivot = nil
  if deadline then
    redis.call('HSET', req, 'deadline', r.deadline)
    local ids = redis.call('LRANGE', queue, 0, -1)
    for i = #ids, 1, -1 do
      local d = tonumber(redis.call('HGET', key_request(prefix, ids[i]), 'deadline'))
      if d and d <= deadline then break end
      pivot = ids[i]
    end
  end
  if pivot then
    redis.call('LINSERT', queue, 'BEFORE', pivot, r.id)
  else
    redis.call('RPUSH', queue, r.id)
  end
  if redis.call('HINCRBY', key_depth(prefix), r.class, 1) == 1 then
    redis.call('HSET', key_backlogged_since(prefix), r.class, r.now)
  end
  if r.session then
    redis.call('HSET', req, 'session', r.session)
    redis.call('INCR', count)
    join(key_sessions(prefix, r.class, r.tenant, r.user),
      key_session_saved(prefix, r.class, r.tenant, r.user), r.session, nil, nil)
  end
  join(key_users(prefix, r.class, r.tenant), key_user_saved(prefix, r.class, r.tenant),
    r.user, key_user_floor(prefix, r.class), r.tenant)
  join(key_active(prefix, r.class), key_saved(prefix, r.class), r.tenant, nil, nil)
  if r.seen then seen_at(prefix, r.tenant, r.user, r.now) end
  return queued + 1
end

start_each(prefix, a.starts)
local positions = {}
for i, r in ipairs(a.requests) do positions[i] = enqueue(r) end
return cjson.encode({positions = positions,
                     dispatched = a.dispatch and dispatch_for(a.dispatch) or nil})
