-- Change an owner's stored-bytes counter by `delta`: an upload reserves each chunk
-- before writing it, within the owner's quota, and gives back what it reserved when it
-- fails; a file the gateway writes is counted without a quota; a deleted file's bytes
-- are given back (file_delete.lua). Check and reserve are one step, so uploads in
-- parallel never store more than the quota between them.
-- KEYS[1] the owner's stored-bytes counter
-- ARGV[1] delta (bytes, negative to give back)   ARGV[2] quota in bytes ("": none)
-- ARGV[3] the owner's bytes on record, to start a missing counter from ("": leave it
--         missing; a counter that is missing is started from the records when next
--         reserved)
-- Returns {1, bytes counted after} or {0, bytes counted} when the quota refused it.
local counter = KEYS[1]
local delta = tonumber(ARGV[1])
if redis.call('EXISTS', counter) == 0 then
  if ARGV[3] == '' then return {1, 0} end
  redis.call('SET', counter, ARGV[3])
end
local after = redis.call('INCRBY', counter, delta)
if delta >= 0 and ARGV[2] ~= '' and after > tonumber(ARGV[2]) then
  redis.call('DECRBY', counter, delta)
  return {0, after - delta}
end
if after <= 0 then redis.call('DEL', counter) ; return {1, 0} end
return {1, after}
