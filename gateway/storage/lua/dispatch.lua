-- Pick the next requests for one backend (dispatch_for in lib/dispatch.lua: the decision
-- and its arguments). Run on a wake-up that no other script served: a new snapshot, an
-- enqueue another backend could take, the heartbeat's safety net.
-- KEYS: the model's keys the decision touches, declared for Redis Cluster (one hash
-- slot; the script derives them from the prefix, gateway/storage/store.py dispatch_keys)
-- ARGV[1]: the decision's arguments, one JSON object (gateway/storage/store.py dispatch_args),
-- and starts (optional: a list of {id, backend, at} its replica held back, marked first:
-- start_each in lib/inflight.lua)
-- Returns {grants, depth, decisions, backlogged, recent} (see dispatch_for).
local a = cjson.decode(ARGV[1])
start_each(a.prefix, a.starts)
return dispatch_for(a)
