-- Pick the next requests for one backend (up to ARGV[7]): highest class whose gate has
-- room, then the user with the smallest fairness score, then that user's oldest request.
-- The served user's score grows by the request's dispatch cost (stored at enqueue).
-- KEYS[1] backend sent-since-snapshot (zset id -> t)  KEYS[2] replica heartbeats (zset)
-- KEYS[3] per-user in-flight (hash)  KEYS[4] queue depth (hash)  KEYS[5] backend in-flight
-- KEYS[6] backlogged-since (hash class -> t)  KEYS[7] recent dispatched classes (list)
-- KEYS[8] backend snapshot (hash; its "unseen" requests count against every gate)
-- KEYS[9] drained backends (set): a drained backend gets nothing, whatever a replica thinks
-- KEYS[10..9+n] active zset per class, in service order
-- KEYS[10+n..9+2n] saved-score hash per class, same order
-- ARGV[1] now (s)  ARGV[2] replica ttl (s)  ARGV[3] model key prefix  ARGV[4] this replica
-- ARGV[5] backend name  ARGV[6] recent-list length kept  ARGV[7] most grants to return
-- ARGV[8] grant pickup limit (s): see replica_alive in _lib.lua
-- ARGV[9..8+n] class names   ARGV[9+n..8+2n] gate limits (max allowed in sent-since)
-- Returns {grants, depth}: grants a list of {id, class, user, rank, owner, enqueued_at},
-- depth the number of requests still queued for the model (all classes).
local n = (#KEYS - 9) / 2
local want = tonumber(ARGV[7])
local grants = {}
local now = tonumber(ARGV[1])
local prefix = ARGV[3]
-- counted against the gates: dispatched since the snapshot + still on the way at it
local sent = redis.call('ZCARD', KEYS[1])
  + (tonumber(redis.call('HGET', KEYS[8], 'unseen')) or 0)

-- the dispatching replica is alive: a Redis restarted empty learns it at once
redis.call('ZADD', KEYS[2], 'GT', now, ARGV[4])

if redis.call('SISMEMBER', KEYS[9], ARGV[5]) == 1 then
  want = 0
end

local function alive(owner)
  return replica_alive(KEYS[2], prefix, owner, now, tonumber(ARGV[2]), tonumber(ARGV[8]))
end

for i = 1, n do
  local class = ARGV[8 + i]
  local limit = tonumber(ARGV[8 + n + i])
  local active, saved = KEYS[9 + i], KEYS[9 + n + i]
  local attempts = 0
  while sent < limit and #grants < want and attempts < 64 do
    attempts = attempts + 1
    local top = redis.call('ZRANGE', active, 0, 0, 'WITHSCORES')
    if not top[1] then break end
    local user, score = top[1], tonumber(top[2])
    local queue = key_queue(prefix, class, user)
    local id = redis.call('LPOP', queue)
    if id and redis.call('HINCRBY', KEYS[4], class, -1) <= 0 then
      redis.call('HDEL', KEYS[6], class)  -- the class is no longer backlogged
    end
    local req = id and key_request(prefix, id)
    local fields = req and redis.call('HMGET', req, 'owner', 'cost', 'enqueued_at')
    local valid = fields and fields[1] and alive(fields[1])
    if valid then
      score = score + (tonumber(fields[2]) or 0)
    elseif req then
      redis.call('DEL', req)  -- expired, or its replica died: nobody holds the client
    end
    if redis.call('LLEN', queue) > 0 then
      redis.call('ZADD', active, score, user)
    else
      redis.call('ZREM', active, user)
      redis.call('HSET', saved, user, score)
    end
    if valid then
      local rank = redis.call('HINCRBY', KEYS[3], user, 1) - 1
      redis.call('ZADD', KEYS[1], now, id)
      sent = sent + 1
      redis.call('INCR', KEYS[5])
      redis.call('HSET', req, 'state', 'dispatched', 'backend', ARGV[5], 'rank', rank,
        'dispatched_at', now)
      redis.call('SADD', key_running(prefix, fields[1]), id)
      redis.call('LPUSH', KEYS[7], class)
      redis.call('LTRIM', KEYS[7], 0, tonumber(ARGV[6]) - 1)
      if fields[1] ~= ARGV[4] then
        redis.call('RPUSH', key_grants(prefix, fields[1]),
          id .. '\t' .. ARGV[5] .. '\t' .. rank .. '\t' .. ARGV[1])
      end
      grants[#grants + 1] = {id, class, user, rank, fields[1], fields[3]}
    end
  end
end
local depth = 0
for _, queued in ipairs(redis.call('HVALS', KEYS[4])) do depth = depth + tonumber(queued) end
return {grants, depth}
