-- Requests stream their first tokens (start_each in lib/inflight.lua): the request whose
-- first token came now and the starts its replica held back; a slot that frees grants the
-- backend's next requests in the same call.
-- KEYS: the keys touched, declared for Redis Cluster (gateway/storage/queue_store.py)
-- ARGV[1]: one JSON object {prefix, starts (a list of {id, backend, at}), dispatch
-- (optional: the backend's dispatch arguments, see dispatch_for in lib/dispatch.lua)}
-- Returns a named map {freed (gate slots freed), dispatched (dispatch_for's map, when it
-- ran)}.
local a = cjson.decode(ARGV[1])
local freed = start_each(a.prefix, a.starts)
return cjson.encode({freed = freed,
                     dispatched = freed > 0 and a.dispatch and dispatch_for(a.dispatch) or nil})
