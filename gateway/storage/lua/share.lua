-- Add service to users' decayed service shares of a model, one zset every replica feeds
-- (the dashboard's cross-replica shares).
-- Forward decay: a score is the sum of amount × 2^((t − epoch) / half_life) over what the
-- user was served, so score / total is its exponentially decayed share without rewriting
-- every score as time passes. Once the epoch is 20 half-lives old the scores are scaled
-- to now (at most `cap` of them) and the epoch moves. Past `cap` users the smallest
-- scores are dropped; both keys expire when nobody is served for `ttl` seconds.
-- KEYS[1] service zset  KEYS[2] service epoch (string)
-- ARGV[1] now  ARGV[2] half-life s  ARGV[3] cap  ARGV[4] ttl s  ARGV[5..] user, amount, …
-- Returns the number of users kept.
local now, half = tonumber(ARGV[1]), tonumber(ARGV[2])
local cap, ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local epoch = tonumber(redis.call('GET', KEYS[2]))
if not epoch or now - epoch > 20 * half then
  if epoch then
    local factor = 2 ^ (-(now - epoch) / half)
    local members = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
    for i = 1, #members, 2 do
      local v = tonumber(members[i + 1]) * factor
      if v < 1e-9 then
        redis.call('ZREM', KEYS[1], members[i])
      else
        redis.call('ZADD', KEYS[1], v, members[i])
      end
    end
  else
    redis.call('DEL', KEYS[1])  -- scores without their epoch mean nothing
  end
  epoch = now
  redis.call('SET', KEYS[2], tostring(epoch))
end
local scale = 2 ^ ((now - epoch) / half)
for i = 5, #ARGV - 1, 2 do
  local amount = tonumber(ARGV[i + 1])
  if amount and amount > 0 then
    redis.call('ZINCRBY', KEYS[1], amount * scale, ARGV[i])
  end
end
local extra = redis.call('ZCARD', KEYS[1]) - cap
if extra > 0 then redis.call('ZREMRANGEBYRANK', KEYS[1], 0, extra - 1) end
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
return redis.call('ZCARD', KEYS[1])
