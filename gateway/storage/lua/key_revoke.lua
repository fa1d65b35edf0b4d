-- Revoke a runtime key: its record and every digest of its secrets go at once.
-- KEYS: the key's record and the zset of key ids, declared for Redis Cluster (one hash
-- tag, {keys}: the digests' keys, named by the record, are derived in it)
-- ARGV[1]: one JSON object {prefix (the keyring's), record (the key's record), ids (the
-- zset of key ids), id (the key's)}
-- The record's old_digest: the digests still in grace, space-separated.
-- Returns {revoked: false when there was no such key}.
local a = cjson.decode(ARGV[1])
if redis.call('EXISTS', a.record) == 0 then return cjson.encode({revoked = false}) end
local digests = redis.call('HMGET', a.record, 'digest', 'old_digest')
for _, list in ipairs(digests) do
  for d in string.gmatch(list or '', '%S+') do
    redis.call('DEL', key_keyring_digest(a.prefix, d))
  end
end
redis.call('DEL', a.record)
redis.call('ZREM', a.ids, a.id)
return cjson.encode({revoked = true})
