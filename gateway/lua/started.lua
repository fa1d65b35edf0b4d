-- A backend streams a request's first token (start_inflight in lib/inflight.lua); the
-- slot that frees grants the backend's next requests in the same call.
-- KEYS: the keys touched, declared for Redis Cluster (gateway/store.py)
-- ARGV[1]: one JSON object {prefix, backend, id, now, dispatch (optional: the
-- backend's dispatch arguments, see dispatch_for in lib/dispatch.lua)}
-- Returns {freed (1 when a gate slot was freed), dispatch_for's result when it ran}.
local a = cjson.decode(ARGV[1])
local freed = start_inflight(a.prefix, a.backend, a.id, a.now)
if freed == 1 and a.dispatch then return {freed, dispatch_for(a.dispatch)} end
return {freed}
