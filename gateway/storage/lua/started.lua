-- Requests stream their first tokens (start_each in lib/inflight.lua): the request whose
-- first token came now and the starts its replica held back; a slot that frees grants the
-- backend's next requests in the same call.
-- KEYS: the keys touched, declared for Redis Cluster (gateway/storage/store.py)
-- ARGV[1]: one JSON object {prefix, starts (a list of {id, backend, at}), dispatch
-- (optional: the backend's dispatch arguments, see dispatch_for in lib/dispatch.lua)}
-- Returns {freed (gate slots freed), dispatch_for's result when it ran}.
local a = cjson.decode(ARGV[1])
local freed = start_each(a.prefix, a.starts)
if freed > 0 and a.dispatch then return {freed, dispatch_for(a.dispatch)} end
return {freed}
