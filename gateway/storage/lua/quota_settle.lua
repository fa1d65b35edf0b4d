-- The end of a request admitted by quota_admit.lua: its concurrency slots free, its
-- reservation corrected to the tokens vLLM reported (delta may be negative).
-- KEYS: per scope, the 5 keys of quota_admit.lua (the periods of the admission)
-- ARGV[1] now (s)  ARGV[2] request id  ARGV[3] delta (tokens)  ARGV[4] n; then per
-- scope the 5 limits (0: none)
local now = tonumber(ARGV[1])
local id = ARGV[2]
local delta = tonumber(ARGV[3])
local n = tonumber(ARGV[4])
for i = 1, n do
  local k, a = (i - 1) * 5, 4 + (i - 1) * 5
  local tpm = tonumber(ARGV[a + 2])
  if tonumber(ARGV[a + 3]) > 0 then redis.call('ZREM', KEYS[k + 3], id) end
  if delta ~= 0 then
    if tpm > 0 then
      local v = redis.call('HMGET', KEYS[k + 2], 'level', 'ts')
      local level, ts = tonumber(v[1]), tonumber(v[2])
      if not level or not ts then level, ts = tpm, now end
      level = math.min(tpm, level + math.max(0, now - ts) * tpm / 60) - delta
      redis.call('HSET', KEYS[k + 2], 'level', tostring(level), 'ts', ARGV[1])
      redis.call('PEXPIRE', KEYS[k + 2], 120000)
    end
    for j = 4, 5 do
      if tonumber(ARGV[a + j]) > 0 and redis.call('EXISTS', KEYS[k + j]) == 1 then
        if redis.call('INCRBY', KEYS[k + j], delta) < 0 then
          redis.call('SET', KEYS[k + j], 0, 'KEEPTTL')
        end
      end
    end
  end
end
return 1
