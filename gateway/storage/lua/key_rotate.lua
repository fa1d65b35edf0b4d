-- A new secret for a runtime key; the current one, and every older one still in its
-- grace period, stays valid for at most the new grace period (never longer than it had).
-- KEYS: the key's record and the new digest key, declared for Redis Cluster (one hash
-- tag, {keys}: the older digests' keys, named by the record, are derived in it)
-- ARGV[1]: one JSON object {prefix (the keyring's), record (the key's record), digest_key
-- (the new secret's digest key), id (the key's), digest (new, hex), shown (the new
-- secret's first characters, the record's prefix field), grace_ms (0: the older secrets
-- stop at once), now (s)}
-- The record's old_digest: the digests still in grace, space-separated.
-- Returns {rotated: false when the key does not exist (revoked)}.
local a = cjson.decode(ARGV[1])
if redis.call('EXISTS', a.record) == 0 then return cjson.encode({rotated = false}) end
local grace = a.grace_ms
local older = redis.call('HMGET', a.record, 'digest', 'old_digest')
local graced = {}
for _, list in ipairs(older) do
  for d in string.gmatch(list or '', '%S+') do
    local key = key_keyring_digest(a.prefix, d)
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
redis.call('SET', a.digest_key, a.id)
redis.call('HSET', a.record, 'digest', a.digest, 'old_digest', table.concat(graced, ' '),
           'prefix', a.shown, 'rotated', a.now)
return cjson.encode({rotated = true})
