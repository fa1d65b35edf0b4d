-- Remove a still-queued request (its client went away or it timed out): release_request
-- in lib/inflight.lua (a user left without requests leaves its tenant's users, a tenant
-- left without users the class's tenants, each keeping its score).
-- KEYS: the keys touched, declared for Redis Cluster (gateway/storage/queue_store.py
-- cancel; the release derives them from the prefix)
-- ARGV[1]: one JSON object {prefix (the model's key prefix), id, user, class, tenant,
-- session (optional, sessions on: its session, "" for the default one)}
-- Returns a named map {released}: false when it was no longer queued (already dispatched).
local a = cjson.decode(ARGV[1])
local released = release_request(a.prefix, a.id, {state = 'queued', user = a.user,
  class = a.class, tenant = a.tenant, session = a.session})
return cjson.encode({released = released and true or false})
