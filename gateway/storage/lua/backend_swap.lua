-- Change one runtime backend's entry only if it is still what the caller read: add a
-- new one, mark one removing, or forget one, without undoing another process's change.
-- KEYS: the runtime backends hash, declared for Redis Cluster
-- ARGV[1]: one JSON object {backends (the runtime backends hash, fg:{backends}:runtime),
-- name (the backend's), expected (optional: the entry expected now; absent: none), wanted
-- (optional: the entry to write; absent: delete it)}
-- Returns {swapped, found (when not swapped: the entry found; absent: none)}.
local a = cjson.decode(ARGV[1])
local found = redis.call('HGET', a.backends, a.name) or nil  -- (a nil reply reads false)
if found ~= a.expected then
  return cjson.encode({swapped = false, found = found})
end
if not a.wanted then
  redis.call('HDEL', a.backends, a.name)
else
  redis.call('HSET', a.backends, a.name, a.wanted)
end
return cjson.encode({swapped = true})
