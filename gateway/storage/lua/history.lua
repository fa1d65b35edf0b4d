-- One process's part of one dashboard history bucket (gateway/ops/history.py): every
-- process of every replica adds its counts for the same wall-clock interval into the
-- same hash, so the dashboard shows one picture whichever process draws it.
-- KEYS[1] the bucket's hash (fg:{history}:<unix ms of its start>), KEYS[2] the index of
--   buckets (zset: hash name -> its start)
-- ARGV[1] JSON {start (unix ms), ttl (s), sum: {field: amount added}, max: {field: value
--   kept if larger}}
local p = cjson.decode(ARGV[1])
for field, amount in pairs(p.sum) do
  redis.call('HINCRBYFLOAT', KEYS[1], field, amount)
end
for field, value in pairs(p.max) do
  local current = tonumber(redis.call('HGET', KEYS[1], field))
  if not current or value > current then
    redis.call('HSET', KEYS[1], field, value)
  end
end
redis.call('EXPIRE', KEYS[1], math.ceil(p.ttl))
redis.call('ZADD', KEYS[2], p.start, KEYS[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', p.start - p.ttl * 1000)
redis.call('EXPIRE', KEYS[2], math.ceil(p.ttl))
return 1
