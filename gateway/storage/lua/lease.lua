-- Take or renew a lease: succeed when the key is free or already ours.
-- KEYS: the lease key, declared for Redis Cluster
-- ARGV[1]: one JSON object {lease (the lease key), holder (its id), ms (lease length)}
-- Returns {held: true when the caller holds the lease afterwards}.
local a = cjson.decode(ARGV[1])
local holder = redis.call('GET', a.lease)
if holder and holder ~= a.holder then return cjson.encode({held = false}) end
redis.call('SET', a.lease, a.holder, 'PX', a.ms)
return cjson.encode({held = true})
