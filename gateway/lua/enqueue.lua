-- Queue a request under (model, class, tenant, user) and make the user and its tenant
-- active (see join in _lib.lua).
-- KEYS[1] user queue (list)      KEYS[2] active tenants (zset)  KEYS[3] saved tenant scores
-- KEYS[4] request (hash)         KEYS[5] queue depth (hash class -> n)
-- KEYS[6] backlogged-since (hash class -> t)  KEYS[7] replica heartbeats (zset)
-- KEYS[8] the tenant's active users (zset)    KEYS[9] its saved user scores (hash)
-- KEYS[10] user-level floors (hash tenant -> score)
-- ARGV[1] request id  ARGV[2] user  ARGV[3] class  ARGV[4] owner replica
-- ARGV[5] user-level dispatch cost (the fairness policy's, added to the user's score at
-- dispatch)  ARGV[6] now (s)  ARGV[7] max queued per user  ARGV[8] request ttl (s)
-- ARGV[9] the prompt's block-hash chain, space-separated ("" when not hashed)
-- ARGV[10] tenant  ARGV[11] tenant-level dispatch cost (added to the tenant's score)
-- ARGV[12] first-token deadline (unix s, "" for none)  ARGV[13] model key prefix
-- ARGV[14] estimated prompt tokens (policies/prefill.py: where it fits, the prefill gate)
-- Within the user's queue, earliest deadline first: a request with a deadline goes ahead
-- of the user's own requests with a later deadline or none (those keep their order), so
-- the queue is its deadline requests by deadline, then the rest in arrival order.
-- Returns the user's queue length, or -1 when the per-user cap is reached.
local queued = redis.call('LLEN', KEYS[1])
if queued >= tonumber(ARGV[7]) then
  return -1
end
-- the owner is alive (it is enqueueing): a Redis restarted empty learns it at once
redis.call('ZADD', KEYS[7], 'GT', ARGV[6], ARGV[4])
redis.call('HSET', KEYS[4], 'user', ARGV[2], 'class', ARGV[3], 'owner', ARGV[4],
  'cost', ARGV[5], 'enqueued_at', ARGV[6], 'state', 'queued', 'tenant', ARGV[10],
  'tcost', ARGV[11], 'ptok', ARGV[14] or 0)
if ARGV[9] and ARGV[9] ~= '' then redis.call('HSET', KEYS[4], 'prefix', ARGV[9]) end
redis.call('EXPIRE', KEYS[4], tonumber(ARGV[8]))
local deadline = tonumber(ARGV[12])
local pivot = nil
if deadline then
  redis.call('HSET', KEYS[4], 'deadline', ARGV[12])
  local ids = redis.call('LRANGE', KEYS[1], 0, -1)
  for i = #ids, 1, -1 do
    local d = tonumber(redis.call('HGET', key_request(ARGV[13], ids[i]), 'deadline'))
    if d and d <= deadline then break end
    pivot = ids[i]
  end
end
if pivot then
  redis.call('LINSERT', KEYS[1], 'BEFORE', pivot, ARGV[1])
else
  redis.call('RPUSH', KEYS[1], ARGV[1])
end
if redis.call('HINCRBY', KEYS[5], ARGV[3], 1) == 1 then
  redis.call('HSET', KEYS[6], ARGV[3], ARGV[6])
end
join(KEYS[8], KEYS[9], ARGV[2], KEYS[10], ARGV[10])
join(KEYS[2], KEYS[3], ARGV[10], nil, nil)
return queued + 1
