-- Move a batch to a new status only from one of the expected ones (compare-and-set).
-- KEYS: the batch hash, declared for Redis Cluster
-- ARGV[1]: one JSON object {batch (its hash), allowed (the statuses it may move from), status
-- (the new one), stamp (optional: the timestamp field to set to now), now (s)}
-- Returns {moved: false when the batch was in another status (or does not exist)}.
local a = cjson.decode(ARGV[1])
local current = redis.call('HGET', a.batch, 'status')
if not current then return cjson.encode({moved = false}) end
local allowed = false
for _, status in ipairs(a.allowed) do
  if status == current then allowed = true end
end
if not allowed then return cjson.encode({moved = false}) end
redis.call('HSET', a.batch, 'status', a.status)
if a.stamp then redis.call('HSET', a.batch, a.stamp, a.now) end
return cjson.encode({moved = true})
