-- Release a dispatched request (release_request in lib/inflight.lua), add the fairness
-- policy's settle charges to its user's score in its tenant (and with sessions on to its
-- session's, while the user has a request queued) and to the tenant's score
-- (each to the saved score when idle, see charge in _lib.lua; the tenant and class are
-- the request's, kept in its hash), record its usage, and let the slot it frees grant
-- the backend's next requests in the same call. Starts its replica held back (its own
-- among them: start_each in lib/inflight.lua) are marked first, as if sent at once.
-- KEYS: the keys touched, declared for Redis Cluster (gateway/storage/queue_store.py)
-- ARGV[1]: one JSON object {prefix, id, user, backend, charge (user level), tcharge
-- (tenant level), usage (optional: {key, ttl, counts: {row field -> amount}}, the day's
-- usage hash, gateway/scheduling/usage.py), seen (optional, a trusted key's end user:
-- now, its last-seen time, see seen_at in _lib.lua), starts (optional: a list of {id,
-- backend, at}), dispatch (optional: the backend's dispatch arguments, see dispatch_for
-- in lib/dispatch.lua), fleet (optional, fairness_scope fleet: the other models' key
-- prefixes, where the charges count too: spread in _lib.lua)}
-- Returns a named map {released (false when it had been released already), dispatched
-- (dispatch_for's map, when it ran)}.
local a = cjson.decode(ARGV[1])
local prefix = a.prefix
start_each(prefix, a.starts)
local info = request_get(key_request(prefix, a.id), 'owner', 'started', 'tenant', 'class',
  'state', 'backend', 'session')
local session = info.session or nil  -- sessions on: its session ("" the default one)
local released
if info.state == 'queued' then
  -- it ran here, but a store that failed over lost its dispatch and still queues it:
  -- it leaves the queue (never dispatched again), charged as it ran
  released = release_request(prefix, a.id, {state = 'queued', user = a.user,
    class = info.class, tenant = info.tenant or a.user, session = session})
else
  -- the backend its hash names: after a failover the store may have dispatched it
  -- again elsewhere (that grant's in-flight state is the one to release)
  released = release_request(prefix, a.id, {state = 'dispatched', user = a.user,
    backend = info.backend or a.backend, owner = info.owner, started = info.started})
end
if released then
  local tenant = info.tenant or a.user
  if info.class then
    charge(key_users(prefix, info.class, tenant), key_user_saved(prefix, info.class, tenant),
      a.user, a.charge)
    charge(key_active(prefix, info.class), key_saved(prefix, info.class), tenant, a.tcharge)
    spread(a.fleet, info.class, tenant, a.user, a.charge, a.tcharge)
    -- its session's score, while its user has sessions to compare (else forgotten)
    if session and redis.call('ZSCORE', key_users(prefix, info.class, tenant), a.user) then
      charge(key_sessions(prefix, info.class, tenant, a.user),
        key_session_saved(prefix, info.class, tenant, a.user), session, a.charge)
    end
  end
  if a.seen then seen_at(prefix, tenant, a.user, a.seen) end
end
if a.usage then
  for field, amount in pairs(a.usage.counts) do
    redis.call('HINCRBY', a.usage.key, field, amount)
  end
  redis.call('EXPIRE', a.usage.key, a.usage.ttl)
end
return cjson.encode({released = released and true or false,
                     dispatched = a.dispatch and dispatch_for(a.dispatch) or nil})
