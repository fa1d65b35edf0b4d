-- Change an owner's stored-bytes counter by `delta`: an upload reserves each chunk
-- before writing it, within the owner's quota, and gives back what it reserved when it
-- fails; a file the gateway writes is counted without a quota; a deleted file's bytes
-- are given back (file_delete.lua). Check and reserve are one step, so uploads in
-- parallel never store more than the quota between them.
-- KEYS: the counter, declared for Redis Cluster
-- ARGV[1]: one JSON object {counter (the owner's stored-bytes counter), delta (bytes,
-- negative to give back), quota (optional: bytes; absent: none), on_record (optional: the
-- owner's bytes on record, to start a missing counter from; absent: leave it missing, a
-- counter that is missing is started from the records when next reserved)}
-- Returns {reserved, counted (bytes counted after; when the quota refused it, before)}.
local a = cjson.decode(ARGV[1])
local counter, delta = a.counter, a.delta
if redis.call('EXISTS', counter) == 0 then
  if not a.on_record then return cjson.encode({reserved = true, counted = 0}) end
  redis.call('SET', counter, a.on_record)
end
local after = redis.call('INCRBY', counter, delta)
if delta >= 0 and a.quota and after > a.quota then
  redis.call('DECRBY', counter, delta)
  return cjson.encode({reserved = false, counted = after - delta})
end
if after <= 0 then
  redis.call('DEL', counter)
  return cjson.encode({reserved = true, counted = 0})
end
return cjson.encode({reserved = true, counted = after})
