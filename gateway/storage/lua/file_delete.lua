-- Delete a file's record, take it out of its owner's index and give its bytes back to
-- the owner's stored-bytes counter (file_bytes.lua), at most once however many deletes
-- of it race.
-- KEYS: the three keys below, declared for Redis Cluster (one hash tag, {files})
-- ARGV[1]: one JSON object {meta (the file's metadata: JSON with `bytes`), index (the
-- owner's file index), counter (the owner's stored-bytes counter), id (the file's)}
-- Returns {deleted: false when it was gone already}.
local a = cjson.decode(ARGV[1])
local raw = redis.call('GET', a.meta)
if not raw then return cjson.encode({deleted = false}) end
redis.call('DEL', a.meta)
redis.call('ZREM', a.index, a.id)
if redis.call('EXISTS', a.counter) == 1 then
  local bytes = tonumber(cjson.decode(raw).bytes) or 0
  if redis.call('DECRBY', a.counter, bytes) <= 0 then redis.call('DEL', a.counter) end
end
return cjson.encode({deleted = true})
