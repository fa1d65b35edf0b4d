-- One process's part of one dashboard history bucket (gateway/ops/history.py): every
-- process of every replica adds its counts for the same wall-clock interval into the
-- same hash, so the dashboard shows one picture whichever process draws it.
-- KEYS: the bucket's hash and the index of buckets, declared for Redis Cluster
-- ARGV[1]: one JSON object {bucket (its hash: fg:{history}:<unix ms of its start>), index
--   (the index of buckets, zset: hash name -> its start), start (unix ms), ttl (s), sum:
--   {field: amount added}, max: {field: value kept if larger}}
-- Returns a named map {added = true}.
local p = cjson.decode(ARGV[1])
for field, amount in pairs(p.sum) do
  redis.call('HINCRBYFLOAT', p.bucket, field, amount)
end
for field, value in pairs(p.max) do
  local current = tonumber(redis.call('HGET', p.bucket, field))
  if not current or value > current then
    redis.call('HSET', p.bucket, field, value)
  end
end
redis.call('EXPIRE', p.bucket, math.ceil(p.ttl))
redis.call('ZADD', p.index, p.start, p.bucket)
redis.call('ZREMRANGEBYSCORE', p.index, '-inf', p.start - p.ttl * 1000)
redis.call('EXPIRE', p.index, math.ceil(p.ttl))
return cjson.encode({added = true})
