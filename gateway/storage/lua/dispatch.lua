-- Pick the next requests for the model's open backends in one call: one decision per
-- backend in the order given (least loaded first; dispatch_for in lib/dispatch.lua: the
-- decision and its arguments), until nothing is queued for the model or, with
-- `until_grant`, after the first backend that granted (a starved class is served one
-- request at a time: its replica decides again who is owed). Run on a wake-up that no
-- other script served: a new snapshot, an enqueue another backend could take, the
-- heartbeat's safety net.
-- KEYS: the model's keys the decisions touch, declared for Redis Cluster (one hash
-- slot; the script derives them from the prefix, gateway/storage/dispatch_call.py
-- dispatch_keys)
-- ARGV[1]: one JSON object: prefix (the model's key prefix), each (a list of decisions'
-- arguments, gateway/storage/dispatch_call.py dispatch_args), until_grant (optional), and
-- starts (optional: a list of {id, backend, at} its replica held back, marked first:
-- start_each in lib/inflight.lua)
-- Returns a named map {decided, depth, backlogged, recent}: decided one {grants, stale} per
-- backend tried, in order; depth, backlogged and recent as the last decision returned
-- them (see dispatch_for).
local a = cjson.decode(ARGV[1])
start_each(a.prefix, a.starts)
local decided, last = {}, nil
for _, args in ipairs(a.each) do
  last = dispatch_for(args)
  decided[#decided + 1] = {grants = last.grants, stale = last.stale}
  if last.depth == 0 or (a.until_grant and #last.grants > 0) then break end
end
return cjson.encode({decided = decided, depth = last.depth, backlogged = last.backlogged,
                     recent = last.recent})
