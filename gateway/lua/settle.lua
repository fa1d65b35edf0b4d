-- Release a dispatched request and add the fairness policy's settle charges to its
-- user's score in its tenant and to the tenant's score (each to the saved score when
-- idle, see charge in _lib.lua). The tenant is the request's (its hash, set at enqueue).
-- KEYS[1] per-user in-flight (hash)  KEYS[2] backend in-flight  KEYS[3] active tenants
-- KEYS[4] saved tenant scores        KEYS[5] request (hash)     KEYS[6] backend sent zset
-- KEYS[7] backend snapshot (hash)  KEYS[8] backend pending prefill (hash)
-- KEYS[9] backend started-since-snapshot zset (a request that ends frees its slot)
-- (the in-flight keys are declared for Redis Cluster; release_inflight in lib/inflight.lua
-- derives them from the prefix and the backend)
-- ARGV[1] user  ARGV[2] user-level charge  ARGV[3] request id  ARGV[4] model key prefix
-- ARGV[5] tenant-level charge  ARGV[6] the backend it was dispatched to
-- Returns 1 when released, 0 when it had been released already.
local info = redis.call('HMGET', KEYS[5], 'owner', 'started', 'tenant', 'class')
if redis.call('DEL', KEYS[5]) == 0 then
  return 0
end
if not release_inflight(ARGV[4], ARGV[3], ARGV[1], ARGV[6], info[1]) and not info[2] then
  -- dispatched before the snapshot and never seen starting: it may be among the
  -- snapshot's "unseen", and is gone now
  take_unseen(KEYS[7])
end
local tenant = info[3] or ARGV[1]
if info[4] then
  charge(key_users(ARGV[4], info[4], tenant), key_user_saved(ARGV[4], info[4], tenant),
    ARGV[1], tonumber(ARGV[2]))
end
charge(KEYS[3], KEYS[4], tenant, tonumber(ARGV[5]))
return 1
