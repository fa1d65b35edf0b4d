-- A new secret for a runtime key; the current one stays valid for a grace period.
-- KEYS[1] the key's record   KEYS[2] digest key of the new secret
-- ARGV[1] keyring prefix   ARGV[2] key id   ARGV[3] new digest (hex)   ARGV[4] new prefix
-- ARGV[5] grace (ms, 0: the old secret stops at once)   ARGV[6] now (s)
-- Returns 1, or 0 when the key does not exist (revoked).
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local old = redis.call('HGET', KEYS[1], 'digest')
if old then
  local old_key = ARGV[1] .. 'hash:' .. old
  if tonumber(ARGV[5]) > 0 then
    redis.call('PEXPIRE', old_key, ARGV[5])
  else
    redis.call('DEL', old_key)
  end
end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'digest', ARGV[3], 'old_digest', old or '', 'prefix', ARGV[4],
           'rotated', ARGV[6])
return 1
