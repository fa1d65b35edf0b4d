-- A runtime API key by the HMAC digest of its secret, and its last use recorded.
-- KEYS[1] digest key (fg:{keys}:hash:<digest>)   ARGV[1] keyring prefix   ARGV[2] now (s)
-- Returns the key's record as a flat field/value list, or nil (unknown or revoked).
local id = redis.call('GET', KEYS[1])
if not id then return nil end
local record = ARGV[1] .. 'id:' .. id
local fields = redis.call('HGETALL', record)
if #fields == 0 then return nil end
redis.call('HSET', record, 'last_used', ARGV[2])
return fields
