-- A runtime API key by the HMAC digest of its secret, and its last use recorded.
-- KEYS[1] digest key (fg:{keys}:hash:<digest>)   KEYS[2] the store's pepper (fg:{keys}:pepper)
-- ARGV[1] keyring prefix   ARGV[2] now (s)
-- ARGV[3] the pepper the digest was made with, when it is the store's (none configured):
--   kept as the store's pepper when it has none (SET NX), so a Redis that restarted empty
--   gets it back before any replica draws a new one.
-- Returns the key's record as a flat field/value list, nil (unknown or revoked), or
-- {'pepper', <the store's pepper>} when it differs from ARGV[3] (digest again with it).
if ARGV[3] and ARGV[3] ~= '' then
  redis.call('SET', KEYS[2], ARGV[3], 'NX')
  local pepper = redis.call('GET', KEYS[2])
  if pepper ~= ARGV[3] then return {'pepper', pepper} end
end
local id = redis.call('GET', KEYS[1])
if not id then return nil end
local record = ARGV[1] .. 'id:' .. id
local fields = redis.call('HGETALL', record)
if #fields == 0 then return nil end
redis.call('HSET', record, 'last_used', ARGV[2])
return fields
