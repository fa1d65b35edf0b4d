-- Order one preemption (gateway/scheduling/preemption.py): the running segment `id` of
-- the answer `original` on `backend` gives its slot back. Refused while the backend's
-- previous preemption is not yet behind a snapshot taken `settle_s` after it (its slot
-- may not be free, or not yet taken, in what the deciders see), when the segment does
-- not stream there (or, a whole answer, run there), when its replica refused to move it,
-- or when the answer was preempted `max` times already. Else: the answer's count + 1, the
-- backend's hold set, and the order pushed to the replica that holds the stream.
-- KEYS: the segment's and the original's request hashes (the same for an answer not
--   continued), the backend's hold and its snapshot hash, declared for Redis Cluster
--   (gateway/storage/preempt_store.py)
-- ARGV[1]: one JSON object {prefix, id, original, backend, now, max, settle_s, hold_ms},
--   or {prefix, id, original, backend, refused = true, grace} for the replica's answer
--   that it could not move the segment: marked unmovable (not with `grace`: it streamed
--   fewer tokens than its class's grace, and may be preempted later), the answer's count
--   and the backend's hold taken back.
-- Returns a named map {ordered}: true when ordered (or the refusal recorded), false when
-- refused.
local p = cjson.decode(ARGV[1])
local segment, original = key_request(p.prefix, p.id), key_request(p.prefix, p.original)
local hold = key_backend_preempt(p.prefix, p.backend)
if p.refused then
  if not p.grace and redis.call('EXISTS', segment) == 1 then
    redis.call('HSET', segment, 'unmovable', 1)
  end
  if redis.call('EXISTS', original) == 1 then
    redis.call('HINCRBY', original, 'preempted', -1)
  end
  redis.call('DEL', hold)
  return cjson.encode({ordered = true})
end
local refused = cjson.encode({ordered = false})
local held = tonumber(redis.call('GET', hold))
local taken_at = redis.call('HGET', key_backend_snapshot(p.prefix, p.backend), 'taken_at')
if held and (tonumber(taken_at) or 0) < held + p.settle_s then return refused end
local f = request_get(segment, 'state', 'started', 'backend', 'owner', 'unmovable', 'whole')
if f.state ~= 'dispatched' or (f.started ~= '1' and f.whole ~= '1') or f.backend ~= p.backend
    or f.unmovable or not f.owner then
  return refused
end
if (tonumber(redis.call('HGET', original, 'preempted')) or 0) >= p.max then return refused end
redis.call('HINCRBY', original, 'preempted', 1)
redis.call('SET', hold, tostring(p.now), 'PX', p.hold_ms)
local orders = key_preempts(p.prefix, f.owner)
redis.call('RPUSH', orders, preempt_entry(p.id, p.original, p.backend))
redis.call('PEXPIRE', orders, p.hold_ms)
return cjson.encode({ordered = true})
