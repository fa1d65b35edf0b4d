-- Take or renew a lease: succeed when the key is free or already ours.
-- KEYS[1] lease key   ARGV[1] holder id   ARGV[2] lease length (ms)
-- Returns 1 when the caller holds the lease afterwards, 0 otherwise.
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
return 1
