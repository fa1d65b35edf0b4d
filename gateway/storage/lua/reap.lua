-- Release what dead replicas held (reap_dead in lib/replicas.lua).
-- KEYS[1] replica heartbeats (zset)  KEYS[2] per-user in-flight (hash; declared for Redis
-- Cluster: the release derives the in-flight keys from the prefix)
-- ARGV[1] now (s)  ARGV[2] replica ttl (s)  ARGV[3] model key prefix
-- ARGV[4] grant pickup limit (s)
-- Returns the number of requests released.
return reap_dead(ARGV[3], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4]))
