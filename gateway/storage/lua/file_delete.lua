-- Delete a file's record, take it out of its owner's index and give its bytes back to
-- the owner's stored-bytes counter (file_bytes.lua), at most once however many deletes
-- of it race.
-- KEYS[1] the file's metadata (JSON with `bytes`)   KEYS[2] the owner's file index
-- KEYS[3] the owner's stored-bytes counter   ARGV[1] the file's id
-- Returns 1 when this call deleted it, 0 when it was gone already.
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('EXISTS', KEYS[3]) == 1 then
  local bytes = tonumber(cjson.decode(raw).bytes) or 0
  if redis.call('DECRBY', KEYS[3], bytes) <= 0 then redis.call('DEL', KEYS[3]) end
end
return 1
