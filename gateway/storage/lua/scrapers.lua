-- One process's scrape leases for one model's backends, taken, renewed or given up, and
-- what each backend's scraper published since this process last read it: one call per
-- model and tick (gateway/backends/scrape.py). A lease is a string naming the process
-- that scrapes the backend, with a PX expiry; only its holder renews it.
-- KEYS, per backend i (from 1) of `backends`: [5i-4] its lease, [5i-3] its snapshot hash,
--   [5i-2] its in-flight count, [5i-1] its pending prefill hash, [5i] its dispatch
--   counter; then the model's depth hash and its drained set (the last two)
-- ARGV[1] JSON {holder (this process), ttl_ms, backends: [{name, want (false: give the
--   lease up if this process holds it), seen (the snapshot hash's "v" this process
--   read last; "": none)}]}
-- Returns {queued, rows}: queued the requests queued for the model (all classes); per
-- backend {held (1: by this process now), drained (1/0), in flight, pending prefill
-- tokens, the snapshot hash (flat) when its "v" is not `seen`, else 0, the requests
-- ever dispatched to it (by any replica: a change tells its scraper that work came)}.
local p = cjson.decode(ARGV[1])
local n = #p.backends
local queued = 0
for _, v in ipairs(redis.call('HVALS', KEYS[5 * n + 1])) do
  queued = queued + (tonumber(v) or 0)
end
local rows = {}
for i, b in ipairs(p.backends) do
  local lease, snapshot = KEYS[5 * i - 4], KEYS[5 * i - 3]
  local holder = redis.call('GET', lease)
  local held = 0
  if b.want then
    if not holder or holder == p.holder then
      redis.call('SET', lease, p.holder, 'PX', math.floor(p.ttl_ms))
      held = 1
    end
  elseif holder == p.holder then
    redis.call('DEL', lease)
  end
  local version = redis.call('HGET', snapshot, 'v')
  local published = 0
  if version and version ~= b.seen then published = redis.call('HGETALL', snapshot) end
  rows[i] = {held, redis.call('SISMEMBER', KEYS[5 * n + 2], b.name),
    tonumber(redis.call('GET', KEYS[5 * i - 2])) or 0, pending_prefill(KEYS[5 * i - 1]),
    published, tonumber(redis.call('GET', KEYS[5 * i])) or 0}
end
return {queued, rows}
