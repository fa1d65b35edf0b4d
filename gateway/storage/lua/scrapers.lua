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
-- KEYS: per backend its lease, snapshot hash, in-flight count, pending prefill hash and
--   dispatch counter, then the model's depth hash, drained set and scraping processes'
--   zset, declared for Redis Cluster (gateway/storage/fleet_store.py)
-- ARGV[1]: one JSON object {prefix (the model's key prefix), holder (this process),
--   ttl_ms, backends: [{name, want (false: give the lease up if this process holds it),
--   seen (the snapshot hash's "v" this process read last; "": none)}]}
-- Returns a named map {queued, backends}: queued the requests queued for the model (all
-- classes); backends one map per backend, in order: {held (by this process now),
-- drained, inflight, pending (prefill tokens), published (the snapshot hash, when its "v"
-- is not `seen`; absent otherwise), dispatches (the requests ever dispatched to it, by
-- any replica: a change tells its scraper that work came)}.
local p = cjson.decode(ARGV[1])
local prefix, n = p.prefix, #p.backends
local queued = 0
for _, v in ipairs(redis.call('HVALS', key_depth(prefix))) do
  queued = queued + (tonumber(v) or 0)
end
local scrapers = key_scrapers(prefix)
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
for i, b in ipairs(p.backends) do
  holders[i] = redis.call('GET', key_backend_scraper(prefix, b.name))
  if holders[i] == p.holder then mine = mine + 1 end
end
local rows = {}
for i, b in ipairs(p.backends) do
  local lease = key_backend_scraper(prefix, b.name)
  local snapshot = key_backend_snapshot(prefix, b.name)
  local holder = holders[i]
  local held = false
  if b.want and holder == p.holder and mine <= share then
    redis.call('SET', lease, p.holder, 'PX', math.floor(p.ttl_ms))
    held = true
  elseif b.want and not holder and mine < share then
    redis.call('SET', lease, p.holder, 'PX', math.floor(p.ttl_ms))
    held, mine = true, mine + 1
  elseif holder == p.holder then  -- not wanted, or above the share: given up
    redis.call('DEL', lease)
    mine = mine - 1
  end
  local version = redis.call('HGET', snapshot, 'v')
  local published = nil
  if version and version ~= b.seen then
    published = {}
    local flat = redis.call('HGETALL', snapshot)
    for j = 1, #flat, 2 do published[flat[j]] = flat[j + 1] end
  end
  rows[i] = {held = held,
    drained = redis.call('SISMEMBER', key_drained(prefix), b.name) == 1,
    inflight = tonumber(redis.call('GET', key_backend_inflight(prefix, b.name))) or 0,
    pending = pending_prefill(key_backend_prefill(prefix, b.name)), published = published,
    dispatches = tonumber(redis.call('GET', key_backend_dispatches(prefix, b.name))) or 0}
end
return cjson.encode({queued = queued, backends = rows})
