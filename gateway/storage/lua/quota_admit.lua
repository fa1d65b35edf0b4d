-- Check a request against the limits of its key and its tenant, and charge it: all or
-- nothing, atomically (policies/limits.py states the rules; bucket() mirrors bucket_level).
-- KEYS: every scope's keys, declared for Redis Cluster (one hash tag, {q:<tenant>})
-- ARGV[1]: one JSON object {now (s), id (the request's), reserve (tokens), lease (s),
-- day_ttl, month_ttl (s), scopes}; a scope (gateway/scheduling/quotas.py ScopeKeys):
-- {name ("t" or "k:<key id>"), keys: {rpm, tpm (bucket hashes), concurrent (zset),
-- daily, monthly (budget strings)}, limits: {rpm, tpm, max_concurrent, daily_tokens,
-- monthly_tokens} (0: none)}
-- Returns {admitted, refused (when not admitted: {scope (its name), limit (the kind),
-- retry_ms}), states: scope name -> {rpm_level, tpm_level (milli-units), concurrent,
-- daily_spent, monthly_spent}, each only for the limits the scope has}.
local a = cjson.decode(ARGV[1])
local now, reserve, lease = a.now, a.reserve, a.lease
local stamp = string.format('%.17g', now)

local function bucket(key, cap)
  local v = redis.call('HMGET', key, 'level', 'ts')
  local level, ts = tonumber(v[1]), tonumber(v[2])
  if not level or not ts then return cap end
  level = level + math.max(0, now - ts) * cap / 60
  if level > cap then level = cap end
  return level
end

-- a scope's levels now, and the first limit that refuses the request (kind, wait in ms)
local function check(scope)
  local lim, keys = scope.limits, scope.keys
  local st = {}
  local fail, wait = nil, 0
  if lim.rpm > 0 then
    st.rpm = bucket(keys.rpm, lim.rpm)
    if st.rpm < 1 then fail, wait = 'rpm', (1 - st.rpm) * 60000 / lim.rpm end
  end
  if lim.tpm > 0 then
    st.tpm = bucket(keys.tpm, lim.tpm)
    local need = math.max(1, math.min(reserve, lim.tpm))
    if not fail and st.tpm < need then fail, wait = 'tpm', (need - st.tpm) * 60000 / lim.tpm end
  end
  if lim.max_concurrent > 0 then
    redis.call('ZREMRANGEBYSCORE', keys.concurrent, '-inf', now)
    st.concurrent = redis.call('ZCARD', keys.concurrent)
    if not fail and st.concurrent >= lim.max_concurrent then
      fail, wait = 'max_concurrent', 1000
    end
  end
  if lim.daily_tokens > 0 then
    st.daily = tonumber(redis.call('GET', keys.daily) or '0')
    if not fail and (st.daily >= lim.daily_tokens or st.daily + reserve > lim.daily_tokens) then
      fail = 'daily_tokens'
    end
  end
  if lim.monthly_tokens > 0 then
    st.monthly = tonumber(redis.call('GET', keys.monthly) or '0')
    if not fail and (st.monthly >= lim.monthly_tokens
                     or st.monthly + reserve > lim.monthly_tokens) then
      fail = 'monthly_tokens'
    end
  end
  return st, fail, wait
end

-- the request charged to a scope that admitted it
local function charge(scope, st)
  local lim, keys = scope.limits, scope.keys
  if lim.rpm > 0 then
    st.rpm = st.rpm - 1
    redis.call('HSET', keys.rpm, 'level', tostring(st.rpm), 'ts', stamp)
    redis.call('PEXPIRE', keys.rpm, 120000)
  end
  if lim.tpm > 0 then
    st.tpm = st.tpm - reserve
    redis.call('HSET', keys.tpm, 'level', tostring(st.tpm), 'ts', stamp)
    redis.call('PEXPIRE', keys.tpm, 120000)
  end
  if lim.max_concurrent > 0 then
    redis.call('ZADD', keys.concurrent, now + lease, a.id)
    redis.call('PEXPIRE', keys.concurrent, math.floor((lease + 60) * 1000))
    st.concurrent = st.concurrent + 1
  end
  if lim.daily_tokens > 0 then
    st.daily = redis.call('INCRBY', keys.daily, reserve)
    redis.call('EXPIRE', keys.daily, a.day_ttl)
  end
  if lim.monthly_tokens > 0 then
    st.monthly = redis.call('INCRBY', keys.monthly, reserve)
    redis.call('EXPIRE', keys.monthly, a.month_ttl)
  end
end

local states, refused = {}, nil
for i, scope in ipairs(a.scopes) do
  local st, fail, wait = check(scope)
  if fail and not refused then
    refused = {scope = scope.name, limit = fail, retry_ms = math.ceil(wait)}
  end
  states[i] = st
end
if not refused then
  for i, scope in ipairs(a.scopes) do charge(scope, states[i]) end
end

local out = {}
for i, scope in ipairs(a.scopes) do
  local st = states[i]
  out[scope.name] = {
    rpm_level = st.rpm and math.floor(st.rpm * 1000),
    tpm_level = st.tpm and math.floor(st.tpm * 1000), concurrent = st.concurrent, daily_spent = st.daily, monthly_spent = st.monthly}
end
return cjson.encode({admitted = not refused, refused = refused, states = out})
