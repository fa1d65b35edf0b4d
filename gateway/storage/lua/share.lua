-- Add service to users' decayed service shares of a model, one zset every replica feeds
-- (the dashboard's cross-replica shares and fairgate_share_ratio), and record who each
-- user is (its tenant and weights) for the share ratio.
-- Forward decay: a score is the sum of amount × 2^((t − epoch) / half_life) over what the
-- user was served, so score / total is its exponentially decayed share without rewriting
-- every score as time passes. Once the epoch is 20 half-lives old the scores are scaled
-- to now (at most `cap` of them; one too small to matter reads 0) and the epoch moves.
-- A user with a `who` entry and no service yet joins at 0 (a backlogged user not served
-- is owed a share too). Past `cap` users the smallest scores are dropped with their
-- entries; the keys expire when nobody is served for `ttl` seconds.
-- KEYS: the service zset, its epoch (string) and who hash, declared for Redis Cluster
-- (gateway/storage/share_store.py)
-- ARGV[1]: one JSON object {prefix (the model's key prefix), now, half_life, cap, ttl,
-- amounts: {user: amount}, who: {user: its entry (JSON [tenant, weight, tenant weight],
-- written as given)}}
-- Returns a named map {kept}: the number of users kept.
local a = cjson.decode(ARGV[1])
local now, half, cap, ttl = a.now, a.half_life, a.cap, a.ttl
local service, epoch_key, who = key_service(a.prefix), key_service_epoch(a.prefix),
  key_service_who(a.prefix)
local epoch = tonumber(redis.call('GET', epoch_key))
if not epoch or now - epoch > 20 * half then
  if epoch then
    local factor = 2 ^ (-(now - epoch) / half)
    local members = redis.call('ZRANGE', service, 0, -1, 'WITHSCORES')
    for i = 1, #members, 2 do
      local v = tonumber(members[i + 1]) * factor
      if v < 1e-9 then v = 0 end
      redis.call('ZADD', service, v, members[i])
    end
  else
    redis.call('DEL', service)  -- scores without their epoch mean nothing
  end
  epoch = now
  redis.call('SET', epoch_key, tostring(epoch))
end
local scale = 2 ^ ((now - epoch) / half)
for user, amount in pairs(a.amounts) do
  if amount > 0 then
    redis.call('ZINCRBY', service, amount * scale, user)
  end
end
for user, entry in pairs(a.who) do
  redis.call('HSET', who, user, entry)
  redis.call('ZADD', service, 'NX', 0, user)
end
local extra = redis.call('ZCARD', service) - cap
if extra > 0 then
  local gone = redis.call('ZRANGE', service, 0, extra - 1)
  redis.call('ZREMRANGEBYRANK', service, 0, extra - 1)
  for i = 1, #gone, 500 do
    redis.call('HDEL', who, unpack(gone, i, math.min(i + 499, #gone)))
  end
end
redis.call('EXPIRE', service, ttl)
redis.call('EXPIRE', epoch_key, ttl)
redis.call('EXPIRE', who, ttl)
return cjson.encode({kept = redis.call('ZCARD', service)})
