-- Revoke a runtime key: its record and every digest of its secrets go at once.
-- KEYS[1] the key's record   KEYS[2] the zset of key ids
-- ARGV[1] keyring prefix   ARGV[2] key id
-- The record's old_digest: the digests still in grace, space-separated.
-- Returns 1, or 0 when there was no such key.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local digests = redis.call('HMGET', KEYS[1], 'digest', 'old_digest')
for _, list in ipairs(digests) do
  for d in string.gmatch(list or '', '%S+') do
    redis.call('DEL', ARGV[1] .. 'hash:' .. d)
  end
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
