-- The end of a request admitted by quota_admit.lua: its concurrency slots free, its
-- reservation corrected to the tokens vLLM reported (delta may be negative).
-- KEYS: every scope's keys, declared for Redis Cluster (those of the admission's periods)
-- ARGV[1]: one JSON object {now (s), id (the request's), delta (tokens), scopes}; a scope
-- as quota_admit.lua takes it: {name, keys: {rpm, tpm, concurrent, daily, monthly},
-- limits: {rpm, tpm, max_concurrent, daily_tokens, monthly_tokens} (0: none)}
-- Returns {settled: the number of scopes}.
local a = cjson.decode(ARGV[1])
local now, delta = a.now, a.delta
local stamp = string.format('%.17g', now)
for _, scope in ipairs(a.scopes) do
  local lim, keys = scope.limits, scope.keys
  if lim.max_concurrent > 0 then redis.call('ZREM', keys.concurrent, a.id) end
  if delta ~= 0 then
    if lim.tpm > 0 then
      local v = redis.call('HMGET', keys.tpm, 'level', 'ts')
      local level, ts = tonumber(v[1]), tonumber(v[2])
      if not level or not ts then level, ts = lim.tpm, now end
      level = math.min(lim.tpm, level + math.max(0, now - ts) * lim.tpm / 60) - delta
      redis.call('HSET', keys.tpm, 'level', tostring(level), 'ts', stamp)
      redis.call('PEXPIRE', keys.tpm, 120000)
    end
    for _, budget in ipairs({{limit = lim.daily_tokens, key = keys.daily},
                             {limit = lim.monthly_tokens, key = keys.monthly}}) do
      if budget.limit > 0 and redis.call('EXISTS', budget.key) == 1 then
        if redis.call('INCRBY', budget.key, delta) < 0 then
          redis.call('SET', budget.key, 0, 'KEEPTTL')
        end
      end
    end
  end
end
return cjson.encode({settled = #a.scopes})
