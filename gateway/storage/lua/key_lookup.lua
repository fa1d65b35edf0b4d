-- A runtime API key by the HMAC digest of its secret, and its last use recorded.
-- KEYS: the digest key and the store's pepper, declared for Redis Cluster (one hash tag,
-- {keys}: the key's record, named by the id the digest holds, is derived in it)
-- ARGV[1]: one JSON object {prefix (the keyring's), digest (the digest key), pepper_key
-- (the store's pepper, fg:{keys}:pepper), now (s), pepper (optional: the pepper the
-- digest was made with, when it is the store's, none configured: kept as the store's
-- pepper when it has none (SET NX), so a Redis that restarted empty gets it back before
-- any replica draws a new one)}
-- Returns {record (the key's hash as a field -> value map; absent: unknown or revoked)}
-- or {pepper (the store's pepper)} when it differs from the one given (digest again
-- with it).
local a = cjson.decode(ARGV[1])
if a.pepper and a.pepper ~= '' then
  redis.call('SET', a.pepper_key, a.pepper, 'NX')
  local pepper = redis.call('GET', a.pepper_key)
  if pepper ~= a.pepper then return cjson.encode({pepper = pepper}) end
end
local id = redis.call('GET', a.digest)
if not id then return cjson.encode({}) end
local record = key_keyring_record(a.prefix, id)
local fields = redis.call('HGETALL', record)
if #fields == 0 then return cjson.encode({}) end
redis.call('HSET', record, 'last_used', a.now)
local found = {}
for i = 1, #fields, 2 do found[fields[i]] = fields[i + 1] end
return cjson.encode({record = found})
