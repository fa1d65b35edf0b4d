-- Release what dead replicas held (reap_dead in lib/replicas.lua).
-- KEYS: the replica heartbeats (zset) and per-user in-flight (hash), declared for Redis
-- Cluster (the release derives the keys from the prefix)
-- ARGV[1]: one JSON object {prefix (the model's key prefix), now (s), replica_ttl_s,
-- grant_pickup_s (a grant unread this long means its replica died)}
-- Returns a named map {released}: the number of requests released.
local a = cjson.decode(ARGV[1])
return cjson.encode({released = reap_dead(a.prefix, a.now, a.replica_ttl_s, a.grant_pickup_s)})
