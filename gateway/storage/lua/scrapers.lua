-- One process's scrape leases for one model's backends, taken, renewed or given up, and
-- what each backend's scraper published since this process last read it: one call per
-- model and tick (gateway/backends/scrape.py). A lease is a string naming the process
-- that scrapes the backend, with a PX expiry; only its holder renews it.
-- KEYS, per backend i (from 1) of `backends`: [4i-3] its lease, [4i-2] its snapshot hash,
--   [4i-1] its in-flight count, [4i] its pending prefill hash; then the model's depth
--   hash and its drained set (the last two)
-- ARGV[1] JSON {holder (this process), ttl_ms, backends: [{name, want (false: give the
--   lease up if this process holds it), seen (the snapshot hash's "v" this process
--   read last; "": none)}]}
-- Returns {queued, rows}: queued the requests queued for the model (all classes); per
-- backend {held (1: by this process now), drained (1/0), in flight, pending prefill
-- tokens, the snapshot hash (flat) when its "v" is not `seen`, else 0}.
local p = cjson.decode(ARGV[1])
local n = #p.backends
local queued = 0
for _, v in ipairs(redis.call('HVALS', KEYS[4 * n + 1])) do
  queued = queued + (tonumber(v) or 0)
end
local rows = {}
for i, b in ipairs(p.backends) do
  local lease, snapshot = KEYS[4 * i - 3], KEYS[4 * i - 2]
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
  rows[i] = {held, redis.call('SISMEMBER', KEYS[4 * n + 2], b.name),
    tonumber(redis.call('GET', KEYS[4 * i - 1])) or 0, pending_prefill(KEYS[4 * i]),
    published}
end
return {queued, rows}
