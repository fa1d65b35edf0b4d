-- Pick the next requests for one backend (up to `want`): highest class whose gate has
-- room, then the tenant with the smallest tenant score, then its user with the smallest
-- user score, then that user's oldest request (with a locality slack at both levels:
-- the best cached request of the users within it, see pick()). The served user's score
-- grows by the request's user-level dispatch cost, its tenant's by the tenant-level one
-- (both stored at enqueue). With no tenants configured every user is its own tenant:
-- the tenant level is the old user order and each tenant has one user.
-- KEYS[1] backend sent-since-snapshot (zset id -> t)  KEYS[2] replica heartbeats (zset)
-- KEYS[3] per-user in-flight (hash)  KEYS[4] queue depth (hash)  KEYS[5] backend in-flight
-- KEYS[6] backlogged-since (hash class -> t)  KEYS[7] recent dispatched classes (list)
-- KEYS[8] backend snapshot (hash; its "unseen" requests count against every gate)
-- KEYS[9] drained backends (set): a drained backend gets nothing, whatever a replica thinks
-- KEYS[10] backend pending prefill (hash id -> "uncached prompt tokens, dispatched at")
-- KEYS[11] backend started-since-snapshot (zset id -> first token): they use up the free
-- slots of a gate first (policies/gates.py Gate.admits)
-- KEYS[12..11+n] active tenants zset per class, in service order
-- KEYS[12+n..11+2n] saved tenant-score hash per class, same order
-- (a tenant's users zset, saved user scores and the class's user-level floors are derived
-- from the model prefix: key_users, key_user_saved, key_user_floor)
-- ARGV[1]: the call's arguments, one JSON object (gateway/store.py Store.dispatch):
--   now (s), replica_ttl (s), prefix (the model's key prefix), replica (this one),
--   backend (its name), recent_kept (recent-list length), want (most grants to return),
--   pickup (grant pickup limit, s: see replica_alive in _lib.lua),
--   classes: in service order, each {name, limit (the snapshot's burst: max allowed in
--     sent-since), prefill_limit (0: none; policies/prefill.py prefill_fits), free_slots
--     (the part of the limit that is free batch slots), max_inflight (occupancy: requests
--     in flight at the backend, KEYS[5], below which one more may go; 0: none;
--     policies/gates.py Gate.admits)},
--   locality: {slack (score units; 0: strict fairness order), compared (users compared
--     within it), index_size (hashes; 0: no index), index_ttl (s), max_imbalance,
--     lookahead (requests looked at in each user's queue), others (the model's other
--     backends)},
--   range: {min, max}: the estimated prompt tokens this backend takes (0: no bound; a
--     request outside is left to the backends it fits),
--   block_tokens (estimated tokens of one prefix block), backfill_s (how long smaller
--   requests may pass one the prefill gate holds; policies/prefill.py may_backfill).
-- The decision's parts are library modules (gateway/lua/lib/): fairness.lua (pick and
-- charge), locality.lua (the prefix index), pools.lua (prompt ranges, the prefill gate),
-- inflight.lua (what a grant writes).
-- Returns {grants, depth, decisions}: grants a list of {id, class, user, rank, owner,
-- enqueued_at}, depth the number of requests still queued for the model (all classes),
-- decisions one {held blocks, chain blocks, reason} per grant (index_decision). A
-- request's tenant stays in its hash (settle.lua reads it there).
local args = cjson.decode(ARGV[1])
local n = #args.classes
local now = args.now
local stamp = string.format('%.6f', now)  -- as written into grant and prefill entries
local prefix, backend = args.prefix, args.backend
local want = args.want
-- the dispatching replica is alive: a Redis restarted empty learns it at once
redis.call('ZADD', KEYS[2], 'GT', now, args.replica)
if redis.call('SISMEMBER', KEYS[9], backend) == 1 then want = 0 end

-- what counts against the gates (policies/gates.py Gate.admits): dispatched since the
-- snapshot + still on the way at it; started since it (in a slot it may have counted
-- free); all requests in flight at the backend (occupancy)
local sent = redis.call('ZCARD', KEYS[1])
  + (tonumber(redis.call('HGET', KEYS[8], 'unseen')) or 0)
local started = redis.call('ZCARD', KEYS[11])
local inflight = tonumber(redis.call('GET', KEYS[5])) or 0
-- uncached prompt tokens dispatched and maybe not yet scheduled (policies/prefill.py;
-- snapshot.lua, started.lua and settle.lua take requests out)
local pending = pending_prefill(KEYS[10])

local pools = pools_for(prefix, args.range, args.block_tokens)
local locality = locality_for(prefix, backend, args.locality, inflight, now)
local fairness = fairness_for(prefix, pools, locality)
local granted = inflight_for(prefix, backend, args.replica,
  {user_inflight = KEYS[3], sent = KEYS[1], backend_inflight = KEYS[5], recent = KEYS[7],
   prefill = KEYS[10]}, args.recent_kept, now, stamp)

-- a candidate (request nil: the head of the user's queue): its queue, id, hash, fields,
-- whether its owner lives, and its uncached prompt tokens on this backend
-- (policies/prefill.py uncached_tokens; `held`: its leading blocks in the index, if known)
local function inspect(class, tenant, user, chosen, held)
  local queue = key_queue(prefix, class, tenant, user)
  local id = chosen or redis.call('LINDEX', queue, 0)
  local req = id and key_request(prefix, id)
  local fields = req and redis.call('HMGET', req, 'owner', 'cost', 'enqueued_at', 'prefix',
    'tcost', 'ptok')
  local valid = fields and fields[1]
    and replica_alive(KEYS[2], prefix, fields[1], now, args.replica_ttl, args.pickup)
  local tokens = valid and (tonumber(fields[6]) or 0) or 0
  if tokens > 0 and locality.index_size > 0 then
    tokens = math.max(0, tokens - (held or locality.held_blocks(fields[4]))
      * args.block_tokens)
  end
  return queue, id, req, fields, valid, tokens
end

local grants, decisions = {}, {}
for i, gate in ipairs(args.classes) do
  local class = gate.name
  local active, saved = KEYS[11 + i], KEYS[11 + n + i]
  local function admits()
    return sent + math.min(started, gate.free_slots) < gate.limit
      or inflight < gate.max_inflight
  end
  local attempts = 0
  while admits() and #grants < want and attempts < 64 do
    attempts = attempts + 1
    local tenant, user, chosen, held = fairness.pick(active, class)
    if not tenant then break end
    local queue, id, req, fields, valid, tokens = inspect(class, tenant, user, chosen, held)
    -- (a request nobody holds any more is never held: it is dropped below)
    local room = nil
    if valid then
      room = pools.hold(req, tokens, pending, gate.prefill_limit, now, stamp, args.backfill_s)
    end
    if room == false then break end
    if room then
      tenant, user, chosen, held = fairness.pick(active, class, room)
      if not tenant then break end
      queue, id, req, fields, valid, tokens = inspect(class, tenant, user, chosen, held)
    end
    if id then
      if chosen then redis.call('LREM', queue, 1, id) else redis.call('LPOP', queue) end
      if redis.call('HINCRBY', KEYS[4], class, -1) <= 0 then
        redis.call('HDEL', KEYS[6], class)  -- the class is no longer backlogged
      end
    end
    if valid then
      local cost = tonumber(fields[2]) or 0
      fairness.charge(class, tenant, user, queue, active, saved, cost,
        tonumber(fields[5]) or cost)
      local rank
      rank, inflight = granted.grant(id, req, class, user, fields[1], tokens)
      sent = sent + 1
      pending = pending + tokens
      decisions[#decisions + 1] = locality.record(fields[4])
      grants[#grants + 1] = {id, class, user, rank, fields[1], fields[3]}
    else
      if req then redis.call('DEL', req) end  -- expired, or its replica died
      fairness.charge(class, tenant, user, queue, active, saved, 0, 0)
    end
  end
end
if #grants > 0 then locality.trim() end
local depth = 0
for _, queued in ipairs(redis.call('HVALS', KEYS[4])) do depth = depth + tonumber(queued) end
return {grants, depth, decisions}
