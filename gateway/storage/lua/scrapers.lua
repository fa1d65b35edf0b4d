-- One process's scrape leases for one model's backends, taken, renewed or given up, and
-- what each backend's scraper published since this process last read it: one call per
-- model and tick (gateway/backends/scrape.py). A lease is a string naming the process
-- that scrapes the backend, with a PX expiry; only its holder renews it.
-- The leases are spread over the processes that scrape the model. Each call registers its
-- process (a zset of processes by their last call; a process gone for a lease length
-- leaves it, and so does one that gives every lease up), and a process holds at most its
-- share, ceil(backends / processes): it takes a free lease only below its share and gives
-- up what it holds above it, which a process below its share takes at its next call. A
-- process that starts takes its share within a few calls; the leases of one that died go
-- to the others once its leases and its entry expire. The shares add up to at least the
-- backends, so every backend keeps a scraper.
-- KEYS, per backend i (from 1) of `backends`: [5i-4] its lease, [5i-3] its snapshot hash,
--   [5i-2] its in-flight count, [5i-1] its pending prefill hash, [5i] its dispatch
--   counter; then the model's depth hash, its drained set and its scraping processes'
--   zset (the last three)
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
local scrapers = KEYS[5 * n + 3]
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local wants = false
for _, b in ipairs(p.backends) do wants = wants or b.want end
if wants then
  redis.call('ZADD', scrapers, now_ms, p.holder)
else  -- giving every lease up (its shutdown): no longer one of the processes sharing
  redis.call('ZREM', scrapers, p.holder)
end
redis.call('ZREMRANGEBYSCORE', scrapers, '-inf', now_ms - p.ttl_ms)
redis.call('PEXPIRE', scrapers, math.floor(4 * p.ttl_ms))
local share = math.ceil(n / math.max(1, redis.call('ZCARD', scrapers)))
local holders, mine = {}, 0
for i = 1, n do
  holders[i] = redis.call('GET', KEYS[5 * i - 4])
  if holders[i] == p.holder then mine = mine + 1 end
end
local rows = {}
for i, b in ipairs(p.backends) do
  local lease, snapshot = KEYS[5 * i - 4], KEYS[5 * i - 3]
  local holder = holders[i]
  local held = 0
  if b.want and holder == p.holder and mine <= share then
    redis.call('SET', lease, p.holder, 'PX', math.floor(p.ttl_ms))
    held = 1
  elseif b.want and not holder and mine < share then
    redis.call('SET', lease, p.holder, 'PX', math.floor(p.ttl_ms))
    held, mine = 1, mine + 1
  elseif holder == p.holder then  -- not wanted, or above the share: given up
    redis.call('DEL', lease)
    mine = mine - 1
  end
  local version = redis.call('HGET', snapshot, 'v')
  local published = 0
  if version and version ~= b.seen then published = redis.call('HGETALL', snapshot) end
  rows[i] = {held, redis.call('SISMEMBER', KEYS[5 * n + 2], b.name),
    tonumber(redis.call('GET', KEYS[5 * i - 2])) or 0, pending_prefill(KEYS[5 * i - 1]),
    published, tonumber(redis.call('GET', KEYS[5 * i])) or 0}
end
return {queued, rows}
