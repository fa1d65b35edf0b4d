-- Change one runtime backend's entry only if it is still what the caller read: add a
-- new one, mark one removing, or forget one, without undoing another process's change.
-- KEYS[1] the runtime backends hash (fg:{backends}:runtime)
-- ARGV[1] backend name   ARGV[2] the entry expected now ("" : none)
-- ARGV[3] the entry to write ("" : delete it)
-- Returns 1 when swapped, else 0 and the entry found (false: none).
local name, expected, wanted = ARGV[1], ARGV[2], ARGV[3]
local found = redis.call('HGET', KEYS[1], name)
if (found or '') ~= expected then
  return {0, found}
end
if wanted == '' then
  redis.call('HDEL', KEYS[1], name)
else
  redis.call('HSET', KEYS[1], name, wanted)
end
return {1, false}
