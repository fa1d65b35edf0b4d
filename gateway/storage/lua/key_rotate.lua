-- A new secret for a runtime key; the current one, and every older one still in its
-- grace period, stays valid for at most the new grace period (never longer than it had).
-- KEYS[1] the key's record   KEYS[2] digest key of the new secret
-- ARGV[1] keyring prefix   ARGV[2] key id   ARGV[3] new digest (hex)   ARGV[4] new prefix
-- ARGV[5] grace (ms, 0: the older secrets stop at once)   ARGV[6] now (s)
-- The record's old_digest: the digests still in grace, space-separated.
-- Returns 1, or 0 when the key does not exist (revoked).
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local grace = tonumber(ARGV[5])
local older = redis.call('HMGET', KEYS[1], 'digest', 'old_digest')
local graced = {}
for _, list in ipairs(older) do
  for d in string.gmatch(list or '', '%S+') do
    local key = ARGV[1] .. 'hash:' .. d
    if grace <= 0 then
      redis.call('DEL', key)
    else
      local ttl = redis.call('PTTL', key)
      if ttl == -1 or ttl > grace then
        redis.call('PEXPIRE', key, grace)
        ttl = grace
      end
      if ttl > 0 then graced[#graced + 1] = d end
    end
  end
end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'digest', ARGV[3], 'old_digest', table.concat(graced, ' '),
           'prefix', ARGV[4], 'rotated', ARGV[6])
return 1
