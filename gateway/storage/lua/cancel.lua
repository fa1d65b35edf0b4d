-- Remove a still-queued request (its client went away or it timed out): release_request
-- in lib/inflight.lua (a user left without requests leaves its tenant's users, a tenant
-- left without users the class's tenants, each keeping its score).
-- KEYS[1] user queue  KEYS[2] active tenants  KEYS[3] saved tenant scores
-- KEYS[4] request hash  KEYS[5] queue depth hash  KEYS[6] backlogged-since hash
-- KEYS[7] the tenant's active users  KEYS[8] its saved user scores
-- KEYS[9] user-level floors (hash tenant -> score) (declared for Redis Cluster; the
-- release derives them from the prefix)
-- KEYS[10..12] with a session: the user's sessions, saved session scores, queued count
-- ARGV[1] request id  ARGV[2] user  ARGV[3] class  ARGV[4] tenant  ARGV[5] model prefix
-- ARGV[6] (sessions on) its session, "" for the default one
-- Returns 1 when removed, 0 when it was no longer queued (already dispatched).
local released = release_request(ARGV[5], ARGV[1], {state = 'queued', user = ARGV[2],
  class = ARGV[3], tenant = ARGV[4], session = ARGV[6]})
return released and 1 or 0
