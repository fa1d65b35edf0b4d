-- Order one preemption (gateway/scheduling/preemption.py): the running segment `id` of
-- the answer `original` on `backend` gives its slot back. Refused while the backend's
-- previous preemption is not yet behind a snapshot taken `settle_s` after it (its slot
-- may not be free, or not yet taken, in what the deciders see), when the segment does
-- not stream there (or, a whole answer, run there), when its replica refused to move it, or when the answer was
-- preempted `max` times already. Else: the answer's count + 1, the backend's hold set,
-- and the order pushed to the replica that holds the stream.
-- KEYS[1] the segment's request hash  KEYS[2] the original's request hash (the same for
--   an answer not continued)  KEYS[3] the backend's hold  KEYS[4] its snapshot hash
-- ARGV[1] JSON {prefix, id, original, backend, now, max, settle_s, hold_ms}, or {refused =
--   true} for the replica's answer that it could not move the segment: marked unmovable,
--   the answer's count and the backend's hold taken back.
-- Returns 1 when ordered (or the refusal recorded), 0 when refused.
local p = cjson.decode(ARGV[1])
if p.refused then
  if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'unmovable', 1) end
  if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('HINCRBY', KEYS[2], 'preempted', -1) end
  redis.call('DEL', KEYS[3])
  return 1
end
local held = tonumber(redis.call('GET', KEYS[3]))
if held and (tonumber(redis.call('HGET', KEYS[4], 'taken_at')) or 0) < held + p.settle_s then
  return 0
end
local f = redis.call('HMGET', KEYS[1], 'state', 'started', 'backend', 'owner', 'unmovable',
  'whole')
if f[1] ~= 'dispatched' or (f[2] ~= '1' and f[6] ~= '1') or f[3] ~= p.backend or f[5]
    or not f[4] then
  return 0
end
if (tonumber(redis.call('HGET', KEYS[2], 'preempted')) or 0) >= p.max then return 0 end
redis.call('HINCRBY', KEYS[2], 'preempted', 1)
redis.call('SET', KEYS[3], tostring(p.now), 'PX', p.hold_ms)
local orders = key_preempts(p.prefix, f[4])
redis.call('RPUSH', orders, preempt_entry(p.id, p.original, p.backend))
redis.call('PEXPIRE', orders, p.hold_ms)
return 1
