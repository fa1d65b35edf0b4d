-- Pick the next requests for one backend (up to ARGV[7]): highest class whose gate has
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
-- ARGV[1] now (s)  ARGV[2] replica ttl (s)  ARGV[3] model key prefix  ARGV[4] this replica
-- ARGV[5] backend name  ARGV[6] recent-list length kept  ARGV[7] most grants to return
-- ARGV[8] grant pickup limit (s): see replica_alive in _lib.lua
-- ARGV[9..8+n] class names   ARGV[9+n..8+2n] gate limits (max allowed in sent-since)
-- ARGV[9+2n..8+3n] prefill-token limits (0: none; policies/prefill.py prefill_fits)
-- ARGV[9+3n..8+4n] the part of each gate limit that is free batch slots
-- ARGV[9+4n..8+5n] each gate's occupancy bound: requests in flight at the backend (KEYS[5])
-- below which one more may go whatever the limit says (0: none; policies/gates.py)
-- with a = 8+5n: ARGV[a+1] locality slack (score units; 0: strict fairness order)
-- ARGV[a+2] users compared within it  ARGV[a+3] prefix index size (hashes; 0: no index)
-- ARGV[a+4] its TTL (s)  ARGV[a+5] max in-flight imbalance  ARGV[a+6] requests looked at
-- in each user's queue  ARGV[a+7], ARGV[a+8] the estimated prompt tokens this backend
-- takes, least and most (0: no bound; a request outside is left to the backends it fits)
-- ARGV[a+9] estimated tokens of one prefix block  ARGV[a+10] how long smaller requests may
-- pass one the prefill gate holds (s; policies/prefill.py may_backfill)
-- ARGV[a+11..] the model's other backends.
-- The index (key_backend_prefixes) holds the block hashes of the prompts sent to a backend,
-- scored by last use; the choice mirrors policies/locality.py choose() and held_elsewhere()
-- over the candidates of policies/locality.py within_slack().
-- Returns {grants, depth, decisions}: grants a list of {id, class, user, rank, owner,
-- enqueued_at}, depth the number of requests still queued for the model (all classes),
-- decisions one {held blocks, chain blocks, reason} per grant (index_decision). A
-- request's tenant stays in its hash (settle.lua reads it there).
local n = (#KEYS - 11) / 2
local a = 8 + 5 * n
local want = tonumber(ARGV[7])
local grants = {}
local now = tonumber(ARGV[1])
local prefix = ARGV[3]
-- counted against the gates: dispatched since the snapshot + still on the way at it
local sent = redis.call('ZCARD', KEYS[1])
  + (tonumber(redis.call('HGET', KEYS[8], 'unseen')) or 0)
-- started since the snapshot: in a slot the snapshot may have counted free
local started = redis.call('ZCARD', KEYS[11])
local inflight = tonumber(redis.call('GET', KEYS[5])) or 0

-- the dispatching replica is alive: a Redis restarted empty learns it at once
redis.call('ZADD', KEYS[2], 'GT', now, ARGV[4])

if redis.call('SISMEMBER', KEYS[9], ARGV[5]) == 1 then
  want = 0
end

local slack = tonumber(ARGV[a + 1]) or 0
local compared = tonumber(ARGV[a + 2]) or 0
local index_size = tonumber(ARGV[a + 3]) or 0
local index_ttl = tonumber(ARGV[a + 4]) or 0
local max_imbalance = tonumber(ARGV[a + 5]) or 0
local lookahead = tonumber(ARGV[a + 6]) or 1
local min_tokens = tonumber(ARGV[a + 7]) or 0
local max_tokens = tonumber(ARGV[a + 8]) or 0
local block_tokens = tonumber(ARGV[a + 9]) or 0
local backfill_s = tonumber(ARGV[a + 10]) or 0
local index = key_backend_prefixes(prefix, ARGV[5])
local load = inflight
local ranged = min_tokens > 0 or max_tokens > 0
local RANGE_SCAN = 64  -- users looked at (fairness order) for a request this backend takes

-- the backend's pending prefill: uncached prompt tokens dispatched and maybe not yet
-- scheduled (snapshot.lua, started.lua and settle.lua take requests out)
local pending = pending_prefill(KEYS[10])

-- whether this backend's prompt range takes a queued request (policies/prefill.py
-- PromptRange.admits) and, with `room` (nil: any), whether its estimated prompt tokens
-- less `cached` tokens (default none) fit in it; a request whose hash is gone fits
-- anywhere, to be dropped
local function fits(id, room, cached)
  if not ranged and not room then return true end
  local tokens = tonumber(redis.call('HGET', key_request(prefix, id), 'ptok'))
  if not tokens then return true end
  if room and tokens - (cached or 0) > room then return false end
  return tokens >= min_tokens and (max_tokens <= 0 or tokens <= max_tokens)
end

-- how many leading block hashes of a chain this backend's index holds
local function held_blocks(chain)
  local m = 0
  if not chain then return m end
  for h in string.gmatch(chain, '%S+') do
    if not redis.call('ZSCORE', index, h) then break end
    m = m + 1
  end
  return m
end

-- leading block hashes of a queued request's prompt found in this backend's index, and
-- whether another backend, not busier than this one by more than max_imbalance, holds
-- its first block (then it is left for that one)
local function matched(id)
  local chain = redis.call('HGET', key_request(prefix, id), 'prefix')
  local m = held_blocks(chain)
  if m > 0 or not chain then return m, false end
  local first = string.match(chain, '%S+')
  if not first then return m, false end
  for j = a + 11, #ARGV do
    if redis.call('ZSCORE', key_backend_prefixes(prefix, ARGV[j]), first) then
      local other = tonumber(redis.call('GET', key_backend_inflight(prefix, ARGV[j]))) or 0
      if other <= load + max_imbalance then return 0, true end
    end
  end
  return 0, false
end

-- the smallest score of a zset: {member, score} or nil
local function least(zset)
  local top = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
  if not top[1] then return nil end
  return top[1], tonumber(top[2])
end

-- the first request, in fairness order (tenants, their users, each user's first
-- `lookahead`), that this backend's prompt range takes, of at most `room` estimated
-- prompt tokens when given: (tenant, user, request) or nil
local function first_fitting(active, class, room)
  local left = RANGE_SCAN
  for _, tenant in ipairs(redis.call('ZRANGE', active, 0, RANGE_SCAN - 1)) do
    local users = redis.call('ZRANGE', key_users(prefix, class, tenant), 0, left - 1)
    for _, user in ipairs(users) do
      local ids = redis.call('LRANGE', key_queue(prefix, class, tenant, user), 0,
        lookahead - 1)
      for _, id in ipairs(ids) do
        if fits(id, room) then return tenant, user, id end
      end
    end
    left = left - #users
    if left <= 0 then break end
  end
  return nil
end

-- (tenant, user, request, its held blocks) to serve: the least-served user of the
-- least-served tenant, or, with a slack, among the users within it of their tenant's
-- least-served user, of the tenants within it of the least-served tenant (at most
-- `compared` users in all, in fairness order), the one with the best cached request among
-- the first `lookahead` of its queue (request nil: the queue's head); nil when none (every
-- such request is left to its own backend). Only requests this backend's prompt range
-- takes are considered, and with `room` (a backfill past a request the prefill gate
-- holds) only those whose uncached tokens fit in it. An active tenant without users
-- (never left by the scripts) is dropped.
local function pick(active, class, room)
  if slack <= 0 then
    if ranged or room then return first_fitting(active, class, room) end
    while true do
      local tenant = least(active)
      if not tenant then return nil end
      local user = least(key_users(prefix, class, tenant))
      if user then return tenant, user, nil end
      redis.call('ZREM', active, tenant)
    end
  end
  local top, top_score = least(active)
  if not top then return nil end
  local tenants = redis.call('ZRANGEBYSCORE', active, top_score, top_score + slack,
    'LIMIT', 0, compared)
  local best_tenant, best, best_id, best_len = nil, nil, nil, -1
  local left = compared
  for _, tenant in ipairs(tenants) do
    local users = key_users(prefix, class, tenant)
    local _, floor = least(users)
    if floor then
      local near = redis.call('ZRANGEBYSCORE', users, floor, floor + slack, 'LIMIT', 0, left)
      for _, user in ipairs(near) do
        local ids = redis.call('LRANGE', key_queue(prefix, class, tenant, user), 0,
          lookahead - 1)
        for _, id in ipairs(ids) do
          if fits(id) then
            local length, elsewhere = matched(id)
            if not elsewhere and length > best_len
                and (not room or fits(id, room, length * block_tokens)) then
              best_tenant, best, best_id, best_len = tenant, user, id, length
            end
          end
        end
      end
      left = left - #near
      if left <= 0 then break end
    end
  end
  return best_tenant, best, best_id, best_id and best_len or nil
end

-- the prefix index records a granted prompt's chain; returns what it held before, for
-- fairgate_dispatch_decisions_total and the predicted hit rate: {leading blocks it held,
-- blocks of the chain, reason} (reason: cache_hit; load under least_loaded or when a busier
-- backend holds the first block; fairness_order when none holds it)
local decisions = {}
local function index_decision(chain)
  if index_size <= 0 or not chain then return {0, 0, 'load'} end
  local held, blocks, first = 0, 0, nil
  for h in string.gmatch(chain, '%S+') do
    first = first or h
    if redis.call('ZADD', index, now, h) == 0 and held == blocks then held = held + 1 end
    blocks = blocks + 1
  end
  if held > 0 then return {held, blocks, 'cache_hit'} end
  if slack > 0 and first then
    for j = a + 11, #ARGV do
      if redis.call('ZSCORE', key_backend_prefixes(prefix, ARGV[j]), first) then
        return {0, blocks, 'load'}
      end
    end
  end
  return {0, blocks, slack > 0 and 'fairness_order' or 'load'}
end

local function alive(owner)
  return replica_alive(KEYS[2], prefix, owner, now, tonumber(ARGV[2]), tonumber(ARGV[8]))
end

-- a candidate (request nil: the head of the user's queue): its queue, id, hash, fields,
-- whether its owner lives, and its uncached prompt tokens on this backend
-- (policies/prefill.py uncached_tokens; `held`: its leading blocks in the index, if known)
local function inspect(class, tenant, user, chosen, held)
  local queue = key_queue(prefix, class, tenant, user)
  local id = chosen or redis.call('LINDEX', queue, 0)
  local req = id and key_request(prefix, id)
  local fields = req and redis.call('HMGET', req, 'owner', 'cost', 'enqueued_at', 'prefix',
    'tcost', 'ptok')
  local valid = fields and fields[1] and alive(fields[1])
  local tokens = valid and (tonumber(fields[6]) or 0) or 0
  if tokens > 0 and index_size > 0 then
    tokens = math.max(0, tokens - (held or held_blocks(fields[4])) * block_tokens)
  end
  return queue, id, req, fields, valid, tokens
end

for i = 1, n do
  local class = ARGV[8 + i]
  local limit = tonumber(ARGV[8 + n + i])
  local prefill_limit = tonumber(ARGV[8 + 2 * n + i]) or 0
  local free_slots = tonumber(ARGV[8 + 3 * n + i]) or 0
  local max_inflight = tonumber(ARGV[8 + 4 * n + i]) or 0
  -- policies/gates.py Gate.admits
  local function admits()
    return sent + math.min(started, free_slots) < limit or inflight < max_inflight
  end
  local active, saved = KEYS[11 + i], KEYS[11 + n + i]
  local floors = key_user_floor(prefix, class)
  local attempts = 0
  while admits() and #grants < want and attempts < 64 do
    attempts = attempts + 1
    local tenant, user, chosen, held = pick(active, class)
    if not tenant then break end
    local queue, id, req, fields, valid, tokens = inspect(class, tenant, user, chosen, held)
    -- over the class's prefill-token gate (policies/prefill.py prefill_fits) the fair
    -- choice waits for a backend with room; for backfill_s after it was first held a
    -- smaller request that fits the room may pass it here, then the backend drains.
    -- (A request nobody holds any more is never held: it is dropped below.)
    if valid and prefill_limit > 0 and pending > 0 and pending + tokens > prefill_limit then
      local since = tonumber(redis.call('HGET', req, 'held_at'))
      if not since then
        redis.call('HSET', req, 'held_at', ARGV[1])
        since = now
      end
      if now - since >= backfill_s then break end
      tenant, user, chosen, held = pick(active, class, prefill_limit - pending)
      if not tenant then break end
      queue, id, req, fields, valid, tokens = inspect(class, tenant, user, chosen, held)
    end
    local users = key_users(prefix, class, tenant)
    local users_saved = key_user_saved(prefix, class, tenant)
    if id then
      if chosen then redis.call('LREM', queue, 1, id) else redis.call('LPOP', queue) end
      if redis.call('HINCRBY', KEYS[4], class, -1) <= 0 then
        redis.call('HDEL', KEYS[6], class)  -- the class is no longer backlogged
      end
    end
    local score = tonumber(redis.call('ZSCORE', users, user)) or 0
    local tscore = tonumber(redis.call('ZSCORE', active, tenant)) or 0
    if valid then
      score = score + (tonumber(fields[2]) or 0)
      tscore = tscore + (tonumber(fields[5]) or tonumber(fields[2]) or 0)
    elseif req then
      redis.call('DEL', req)  -- expired, or its replica died: nobody holds the client
    end
    place(users, users_saved, user, score, redis.call('LLEN', queue) > 0)
    local tenant_active = redis.call('ZCARD', users) > 0
    if not tenant_active then redis.call('HSET', floors, tenant, score) end
    place(active, saved, tenant, tscore, tenant_active)
    if valid then
      local rank = redis.call('HINCRBY', KEYS[3], user, 1) - 1
      redis.call('ZADD', KEYS[1], now, id)
      sent = sent + 1
      inflight = redis.call('INCR', KEYS[5])
      redis.call('HSET', req, 'state', 'dispatched', 'backend', ARGV[5], 'rank', rank,
        'dispatched_at', now)
      redis.call('SADD', key_running(prefix, fields[1]), id)
      redis.call('LPUSH', KEYS[7], class)
      redis.call('LTRIM', KEYS[7], 0, tonumber(ARGV[6]) - 1)
      if fields[1] ~= ARGV[4] then
        redis.call('RPUSH', key_grants(prefix, fields[1]),
          id .. '\t' .. ARGV[5] .. '\t' .. rank .. '\t' .. ARGV[1])
      end
      if tokens > 0 then
        redis.call('HSET', KEYS[10], id, tokens .. ' ' .. ARGV[1])
        pending = pending + tokens
      end
      decisions[#decisions + 1] = index_decision(fields[4])
      grants[#grants + 1] = {id, class, user, rank, fields[1], fields[3]}
    end
  end
end
if index_size > 0 and #grants > 0 then  -- LRU-trimmed and expiring, like a cache
  redis.call('ZREMRANGEBYSCORE', index, '-inf', now - index_ttl)
  redis.call('ZREMRANGEBYRANK', index, 0, -index_size - 1)
  redis.call('EXPIRE', index, index_ttl)
end
local depth = 0
for _, queued in ipairs(redis.call('HVALS', KEYS[4])) do depth = depth + tonumber(queued) end
return {grants, depth, decisions}
