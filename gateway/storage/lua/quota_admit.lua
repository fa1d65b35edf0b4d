-- Check a request against the limits of its key and its tenant, and charge it: all or
-- nothing, atomically (policies/limits.py states the rules; bucket() mirrors bucket_level).
-- KEYS: per scope, 5 keys: rpm bucket, tpm bucket, concurrency zset, day budget, month budget
-- ARGV[1] now (s)  ARGV[2] request id  ARGV[3] reservation (tokens)  ARGV[4] lease (s)
-- ARGV[5] number of scopes n; then per scope 5 limits (0: none): rpm, tpm, max_concurrent,
-- daily_tokens, monthly_tokens; then day TTL (s), month TTL (s)
-- Returns {admitted 1/0, refusing scope (1-based, 0), refusing limit, retry (ms),
--          then per scope: rpm level (milli-units, nil: no limit), tpm level (nil),
--          concurrent requests (-1: no limit), day spent (-1), month spent (-1)}.
local now = tonumber(ARGV[1])
local id = ARGV[2]
local reserve = tonumber(ARGV[3])
local lease = tonumber(ARGV[4])
local n = tonumber(ARGV[5])
local day_ttl = tonumber(ARGV[6 + 5 * n])
local month_ttl = tonumber(ARGV[7 + 5 * n])
local names = {'rpm', 'tpm', 'max_concurrent', 'daily_tokens', 'monthly_tokens'}

local function bucket(key, cap)
  local v = redis.call('HMGET', key, 'level', 'ts')
  local level, ts = tonumber(v[1]), tonumber(v[2])
  if not level or not ts then return cap end
  level = level + math.max(0, now - ts) * cap / 60
  if level > cap then level = cap end
  return level
end

local states = {}
local refused, refused_kind, retry = 0, '', 0
for i = 1, n do
  local k, a = (i - 1) * 5, 5 + (i - 1) * 5
  local lim = {}
  for j = 1, 5 do lim[j] = tonumber(ARGV[a + j]) end
  local st = {lim = lim, r = -1, t = -1, c = -1, d = -1, m = -1}
  local fail, wait = nil, 0
  if lim[1] > 0 then
    st.r = bucket(KEYS[k + 1], lim[1])
    if st.r < 1 then fail, wait = 1, (1 - st.r) * 60000 / lim[1] end
  end
  if lim[2] > 0 then
    st.t = bucket(KEYS[k + 2], lim[2])
    local need = math.max(1, math.min(reserve, lim[2]))
    if not fail and st.t < need then fail, wait = 2, (need - st.t) * 60000 / lim[2] end
  end
  if lim[3] > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[k + 3], '-inf', now)
    st.c = redis.call('ZCARD', KEYS[k + 3])
    if not fail and st.c >= lim[3] then fail, wait = 3, 1000 end
  end
  if lim[4] > 0 then
    st.d = tonumber(redis.call('GET', KEYS[k + 4]) or '0')
    if not fail and (st.d >= lim[4] or st.d + reserve > lim[4]) then fail = 4 end
  end
  if lim[5] > 0 then
    st.m = tonumber(redis.call('GET', KEYS[k + 5]) or '0')
    if not fail and (st.m >= lim[5] or st.m + reserve > lim[5]) then fail = 5 end
  end
  if fail and refused == 0 then refused, refused_kind, retry = i, names[fail], wait end
  states[i] = st
end

if refused == 0 then
  for i = 1, n do
    local k, st = (i - 1) * 5, states[i]
    if st.lim[1] > 0 then
      st.r = st.r - 1
      redis.call('HSET', KEYS[k + 1], 'level', tostring(st.r), 'ts', ARGV[1])
      redis.call('PEXPIRE', KEYS[k + 1], 120000)
    end
    if st.lim[2] > 0 then
      st.t = st.t - reserve
      redis.call('HSET', KEYS[k + 2], 'level', tostring(st.t), 'ts', ARGV[1])
      redis.call('PEXPIRE', KEYS[k + 2], 120000)
    end
    if st.lim[3] > 0 then
      redis.call('ZADD', KEYS[k + 3], now + lease, id)
      redis.call('PEXPIRE', KEYS[k + 3], math.floor((lease + 60) * 1000))
      st.c = st.c + 1
    end
    if st.lim[4] > 0 then
      st.d = redis.call('INCRBY', KEYS[k + 4], reserve)
      redis.call('EXPIRE', KEYS[k + 4], day_ttl)
    end
    if st.lim[5] > 0 then
      st.m = redis.call('INCRBY', KEYS[k + 5], reserve)
      redis.call('EXPIRE', KEYS[k + 5], month_ttl)
    end
  end
end

local out = {refused == 0 and 1 or 0, refused, refused_kind, math.ceil(retry)}
for i = 1, n do
  local st = states[i]
  local r, t = false, false  -- false: no such limit (a nil reply)
  if st.lim[1] > 0 then r = math.floor(st.r * 1000) end
  if st.lim[2] > 0 then t = math.floor(st.t * 1000) end
  table.insert(out, r)
  table.insert(out, t)
  table.insert(out, st.c)
  table.insert(out, st.d)
  table.insert(out, st.m)
end
return out
