-- The dispatch decision for one backend: dispatch.lua runs it on a wake-up (an enqueue,
-- a snapshot), enqueue.lua after a tick's requests joined, and started.lua and settle.lua
-- fold it in (the slot they free grants the next request in the same call).
-- dispatch_for(a) picks up to `a.max_grants` requests: the highest class whose gate has room,
-- then the tenant with the smallest tenant score, then its user with the smallest user
-- score, then that user's oldest request (with a locality slack at both levels: the best
-- cached request of the users within it, fairness.lua pick()). The served user's score
-- grows by the request's user-level dispatch cost, its tenant's by the tenant-level one
-- (both stored at enqueue for the whole prompt estimate, less, for the prompt tokens this
-- backend's prefix index predicts cached, the credit stored with them: predicted_cost in
-- _lib.lua). With no tenants configured every user is its own tenant.
-- With sessions on (`a.sessions`), the user's request comes from its least-served
-- session's queue, and that session's score grows by the user-level cost too.
-- `a`, one JSON object (gateway/storage/dispatch_call.py dispatch_args, the same names):
--   now (s), replica_ttl_s, prefix (the model's key prefix), replica (this one),
--   sessions (optional: true with sessions on, the third level),
--   seen (optional: taken_at of the snapshot the gates come from; gate_counts in _lib.lua),
--   backend (its name), recent_window (recent-list length), max_grants (most grants to
--   return), grant_pickup_s (grant pickup limit: see replica_alive in replicas.lua),
--   classes: in service order, each {name, limit (the snapshot's burst: max allowed in
--     sent-since), prefill_limit (0: none; policies/prefill.py prefill_fits), free_slots
--     (the part of the limit that is free batch slots), max_inflight (occupancy: requests
--     in flight at the backend below which one more may go; 0: none; policies/gates.py
--     Gate.admits)},
--   locality: {slack (score units; 0: strict fairness order), candidates (users compared
--     within it), index_size (hashes; 0: no index), index_ttl_s, max_imbalance,
--     lookahead (requests looked at in each user's queue), others (the model's other
--     backends), fits (optional: what each of them takes, {min, max, adapters} as
--     `range` and `adapters` below: a request is never left to one that does not take
--     it)},
--   range: {min, max}: the estimated prompt tokens this backend takes (0: no bound),
--   block_tokens (estimated tokens of one prefix block), backfill_s (how long smaller
--   requests may pass one the prefill gate holds; policies/prefill.py may_backfill),
--   adapters (optional: the LoRA adapters the backend has; a request naming another
--   waits for a backend that has it),
--   fleet (optional, fairness_scope fleet: the other models' key prefixes, where each
--   dispatch cost counts too: spread in _lib.lua).
-- Returns a named map {grants, depth, backlogged, recent, stale} (dispatched_from in
-- gateway/storage/dispatch_call.py reads it): grants a list of {id, class, user, rank,
-- owner, enqueued_at, charged (the prompt tokens its dispatch cost charged: those
-- predicted uncached here), held, blocks, reason (locality.lua record: leading blocks its
-- index held, blocks of the chain, why it went here)} (a grant for a request another
-- replica holds is also pushed to its grant list), depth the requests still queued for
-- the model (all classes), backlogged {class: backlogged since}, recent the classes of the
-- latest dispatches, newest first (policies/starvation.py reads both), stale true when the
-- gates came from a snapshot older than the one before the stored one (nothing admitted).
local function dispatch_for(a)
  local now, prefix, backend, want = a.now, a.prefix, a.backend, a.max_grants
  local stamp = string.format('%.6f', now)  -- as written into grant and prefill entries
  local replicas, depth_key = key_replicas(prefix), key_depth(prefix)
  -- the dispatching replica is alive: a Redis restarted empty learns it at once
  redis.call('ZADD', replicas, 'GT', now, a.replica)
  if redis.call('SISMEMBER', key_drained(prefix), backend) == 1 then want = 0 end

  -- what counts against the gates (policies/gates.py Gate.admits): dispatched since the
  -- snapshot they come from + still on the way at it; started since it (in a slot it may
  -- have counted free); all requests in flight at the backend (occupancy). Gates from a
  -- snapshot older than the one before the stored one admit nothing.
  local sent, started, taken_at = gate_counts(prefix, backend, a.seen)
  local stale = not sent
  if stale then sent, started, want = 0, 0, 0 end
  local inflight = tonumber(redis.call('GET', key_backend_inflight(prefix, backend))) or 0
  -- uncached prompt tokens dispatched and maybe not yet scheduled (policies/prefill.py)
  local pending = pending_prefill(key_backend_prefill(prefix, backend))

  local pools = pools_for(prefix, a.range, a.block_tokens, a.adapters)
  local locality = locality_for(prefix, backend, a.locality, inflight, now)
  local fairness = fairness_for(prefix, pools, locality, a.sessions)
  local granted = inflight_for(prefix, backend, a.replica,
    {user_inflight = key_user_inflight(prefix), sent = key_backend_sent(prefix, backend),
     backend_inflight = key_backend_inflight(prefix, backend), recent = key_recent(prefix),
     prefill = key_backend_prefill(prefix, backend)}, a.recent_window, now, stamp,
    math.max(now, taken_at + 1e-6))

  -- a candidate (request nil: the head of the user's queue): its queue, id, hash, fields
  -- (by name: request_get),
  -- whether its owner lives, and its uncached prompt tokens on this backend
  -- (policies/prefill.py uncached_tokens; `held`: its leading blocks in the index, if known).
  -- An id whose request is no longer queued (queued twice: a call retried after its reply
  -- was lost, or a failover) names no request: that entry only leaves the queue.
  local function inspect(class, tenant, user, session, chosen, held)
    local queue = queue_of(prefix, class, tenant, user, session)
    local id = chosen or redis.call('LINDEX', queue, 0)
    local req = id and key_request(prefix, id)
    local fields = req and request_get(req, 'owner', 'cost', 'enqueued_at', 'prefix',
      'tcost', 'ptok', 'state', 'hit', 'thit', 'adapter')
    if fields and fields.state and fields.state ~= 'queued' then req, fields = nil, nil end
    local valid = fields and fields.owner
      and replica_alive(replicas, prefix, fields.owner, now, a.replica_ttl_s, a.grant_pickup_s)
    local tokens = valid and (tonumber(fields.ptok) or 0) or 0
    if tokens > 0 and locality.index_size > 0 then
      tokens = math.max(0, tokens - (held or locality.held_blocks(fields.prefix))
        * a.block_tokens)
    end
    return queue, id, req, fields, valid, tokens
  end

  local grants = {}
  for _, gate in ipairs(a.classes) do
    local class = gate.name
    local active, saved = key_active(prefix, class), key_saved(prefix, class)
    local function admits()
      return sent + math.min(started, gate.free_slots) < gate.limit
        or inflight < gate.max_inflight
    end
    local attempts = 0
    while admits() and #grants < want and attempts < 64 do
      attempts = attempts + 1
      local tenant, user, chosen, held = fairness.pick(active, class)
      if not tenant then break end
      local session = fairness.session(class, tenant, user)
      local queue, id, req, fields, valid, tokens = inspect(class, tenant, user, session,
        chosen, held)
      -- (a request nobody holds any more is never held: it is dropped below)
      local room = nil
      if valid then
        room = pools.hold(req, tokens, pending, gate.prefill_limit, now, stamp, a.backfill_s)
      end
      if room == false then break end
      if room then
        tenant, user, chosen, held = fairness.pick(active, class, room)
        if not tenant then break end
        session = fairness.session(class, tenant, user)
        queue, id, req, fields, valid, tokens = inspect(class, tenant, user, session, chosen,
          held)
      end
      if id then unqueue(prefix, class, queue, id, not chosen) end
      if valid then
        -- the dispatch cost of the tokens predicted uncached here (the settle corrects it
        -- to what the backend reports)
        local ptok = tonumber(fields.ptok) or 0
        local cost = tonumber(fields.cost) or 0
        local tcost = tonumber(fields.tcost) or cost
        cost = predicted_cost(cost, tonumber(fields.hit) or 0, ptok, tokens)
        tcost = predicted_cost(tcost, tonumber(fields.thit) or 0, ptok, tokens)
        fairness.charge(class, tenant, user, session, queue, active, saved, cost, tcost)
        spread(a.fleet, class, tenant, user, cost, tcost)
        local rank
        rank, inflight = granted.grant(id, req, class, user, fields.owner, tokens)
        sent = sent + 1
        pending = pending + tokens
        local decided = locality.record(fields.prefix, fields.ptok, fields.adapter)
        grants[#grants + 1] = {id = id, class = class, user = user, rank = rank,
          owner = fields.owner, enqueued_at = fields.enqueued_at, charged = tokens,
          held = decided.held, blocks = decided.blocks, reason = decided.reason}
      else
        if req then redis.call('DEL', req) end  -- expired, or its replica died
        fairness.charge(class, tenant, user, session, queue, active, saved, 0, 0)
      end
    end
  end
  if #grants > 0 then locality.trim() end
  local depth = 0
  for _, queued in ipairs(redis.call('HVALS', depth_key)) do depth = depth + tonumber(queued) end
  local backlogged, since = {}, redis.call('HGETALL', key_backlogged_since(prefix))
  for i = 1, #since, 2 do backlogged[since[i]] = since[i + 1] end
  return {grants = grants, depth = depth, backlogged = backlogged,
          recent = redis.call('LRANGE', key_recent(prefix), 0, -1), stale = stale}
end
