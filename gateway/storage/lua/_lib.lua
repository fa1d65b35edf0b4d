-- Shared helpers, prepended to every script after the generated key functions.

-- "unseen" (a field of a backend's snapshot hash): requests dispatched before the
-- snapshot and not yet registered by the server (running + waiting). snapshot.lua sets
-- it; a request sent before the snapshot that settles (or leaves its backend) without
-- having started takes one out (a start does not: start_inflight in lib/inflight.lua).
-- Returns 1 when one was taken.
local function take_unseen(snapshot)
  local unseen = tonumber(redis.call('HGET', snapshot, 'unseen')) or 0
  if unseen > 0 then
    redis.call('HSET', snapshot, 'unseen', unseen - 1)
    return 1
  end
  return 0
end

-- Request `id` leaves `backend`'s sent set (zset: id -> when it was sent: the requests
-- dispatched there that have not streamed a first token yet). Returns 1 when it was sent
-- after the stored snapshot, taken at `taken_at` (unix s): the snapshot did not see it;
-- 2 when it was sent before (it may have been one of the snapshot's "unseen": gate_counts);
-- 0 when it was not in the set.
local function leave_sent(prefix, backend, id, taken_at)
  local sent = key_backend_sent(prefix, backend)
  local at = tonumber(redis.call('ZSCORE', sent, id))
  if not at then return 0 end
  redis.call('ZREM', sent, id)
  if at > taken_at then return 1 end
  return 2
end

-- What counts against `backend`'s gates (policies/gates.py Gate.used) for a decision made
-- by the snapshot taken at `seen` (unix s; nil: by the stored one): the requests on their
-- way (sent since that snapshot, plus those its scrape had not seen, its "unseen", no more
-- than those sent before it that have not streamed a first token yet: policies/gates.py
-- still_unseen) and those started since it. The snapshot store keeps the counts of the
-- stored snapshot and of the one before (snapshot.lua): a process may decide by a
-- snapshot that another stored a newer one after (read before that store, or its store
-- still on the way back to it), and its gate's burst then counts what was sent since the
-- snapshot it came from. Counted since the newer one, a burst computed from an older
-- queue would be spent again (vLLM's queue then grew past the gate). A decision by an
-- older snapshot returns nil: nothing Redis keeps matches its gates. Also returns the
-- stored snapshot's taken_at (0 without one): a grant is sent after it.
local function gate_counts(prefix, backend, seen)
  local stored_at, stored_unseen, prev_at, prev_unseen = unpack(redis.call('HMGET',
    key_backend_snapshot(prefix, backend), 'taken_at', 'unseen', 'prev_at', 'prev_unseen'))
  local taken_at = tonumber(stored_at) or 0
  local since, unseen = stored_at, stored_unseen
  if seen and seen < taken_at then
    if not (prev_at and prev_at ~= '' and seen >= tonumber(prev_at)) then
      return nil, nil, taken_at
    end
    since, unseen = prev_at, prev_unseen
  end
  local from = since and ('(' .. since) or '-inf'
  local sent_key = key_backend_sent(prefix, backend)
  local sent = redis.call('ZCOUNT', sent_key, from, '+inf')
  unseen = tonumber(unseen) or 0
  if unseen > 0 then
    sent = sent + math.min(unseen, redis.call('ZCOUNT', sent_key, '-inf', since))
  end
  return sent, redis.call('ZCOUNT', key_backend_started(prefix, backend), from, '+inf'),
    taken_at
end

-- A backend's pending prefill (hash id -> gateway/storage/values.py PREFILL entry): the sum of
-- its tokens (policies/prefill.py).
local function pending_prefill(hash)
  local total = 0
  for _, v in ipairs(redis.call('HVALS', hash)) do
    total = total + (tonumber(prefill_tokens(v)) or 0)
  end
  return total
end

-- Fair share at two levels (policies/fairness.py): tenants in a class's active zset by
-- tenant score, each tenant's users in its users zset by user score. A member that
-- becomes active starts at its saved score lifted to the smallest active score of its
-- level (for a user of a tenant with no active user: the score its last user left at,
-- the tenant's user-level virtual time), so it cannot bank credit while idle.
local function join(zset, saved, member, floor, field)
  if redis.call('ZSCORE', zset, member) then return end
  local score = tonumber(redis.call('HGET', saved, member)) or 0
  local first = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
  local lift = tonumber(first[2])
  if not lift and floor then lift = tonumber(redis.call('HGET', floor, field)) end
  if lift and lift > score then score = lift end
  redis.call('ZADD', zset, score, member)
end

-- Set an active member's score, or (idle: `keep` false) take it out and save the score.
local function place(zset, saved, member, score, keep)
  if keep then
    redis.call('ZADD', zset, score, member)
  else
    redis.call('ZREM', zset, member)
    redis.call('HSET', saved, member, score)
  end
end

-- Add a charge to a member's score, active or saved.
local function charge(zset, saved, member, amount)
  if amount == 0 then return end
  if redis.call('ZSCORE', zset, member) then
    redis.call('ZINCRBY', zset, amount, member)
  else
    redis.call('HINCRBYFLOAT', saved, member, amount)
  end
end

-- Fair share across models (fairness_scope fleet, policies/fairness.py Fleet): a charge
-- on one model counts on the fleet's other models too (`prefixes`, their key prefixes:
-- nil per model), on the user's and the tenant's scores there, active or saved, where
-- the model knows them (a member never seen there is lifted at its first enqueue, so it
-- gets no field). Each model keeps its own virtual time: joins and their lift stay per
-- model. The amounts carry the cost factor of the model that served (the caller's).
local function known_charge(zset, saved, member, amount)
  if redis.call('ZSCORE', zset, member) then
    redis.call('ZINCRBY', zset, amount, member)
  elseif redis.call('HEXISTS', saved, member) == 1 then
    redis.call('HINCRBYFLOAT', saved, member, amount)
  end
end

local function spread(prefixes, class, tenant, user, cost, tcost)
  if not prefixes then return end
  for _, p in ipairs(prefixes) do
    if cost ~= 0 then
      known_charge(key_users(p, class, tenant), key_user_saved(p, class, tenant), user, cost)
    end
    if tcost ~= 0 then
      known_charge(key_active(p, class), key_saved(p, class), tenant, tcost)
    end
  end
end

-- A user whose queue emptied leaves its tenant's active users, keeping its score; a
-- tenant left without users leaves the class's tenants, keeping its score (its last
-- user's score is the floor its next user starts from).
local function leave(prefix, class, tenant, user)
  local users = key_users(prefix, class, tenant)
  local score = redis.call('ZSCORE', users, user)
  if not score then return end
  place(users, key_user_saved(prefix, class, tenant), user, score, false)
  if redis.call('ZCARD', users) == 0 then
    redis.call('HSET', key_user_floor(prefix, class), tenant, score)
    local active = key_active(prefix, class)
    local tscore = redis.call('ZSCORE', active, tenant)
    if tscore then place(active, key_saved(prefix, class), tenant, tscore, false) end
  end
end

-- A trusted key's end user was active at `at` (its enqueue or settle): its last-seen
-- time in the model's `seen` zset, by which forget.lua forgets the idle ones.
local function seen_at(prefix, tenant, user, at)
  redis.call('ZADD', key_seen(prefix), 'GT', at, seen_entry(tenant, user))
end

-- Sessions, the optional third level (policies/fairness.py TwoLevel, `sessions`): each
-- user's sessions with a queued request in its sessions zset by session score, charged
-- the user-level cost; each session its own queue, the default session ("", requests
-- without a session key) the user's own queue. `session` nil: sessions off, one queue.
local function queue_of(prefix, class, tenant, user, session)
  if session and session ~= '' then
    return key_session_queue(prefix, class, tenant, user, session)
  end
  return key_queue(prefix, class, tenant, user)
end

-- A request of `session` left its `queue`: one less queued for the user; the session,
-- with nothing more queued, leaves the user's sessions, its score (`score`, default the
-- one it has) saved. Returns whether the user has a request queued still. A user with
-- none forgets its session scores: they are compared only among its own sessions, and
-- start again, equal, with its next request.
local function session_left(prefix, class, tenant, user, session, queue, score)
  local sessions = key_sessions(prefix, class, tenant, user)
  local saved = key_session_saved(prefix, class, tenant, user)
  local count = key_user_queued(prefix, class, tenant, user)
  if redis.call('DECR', count) <= 0 then redis.call('DEL', count) end
  score = score or tonumber(redis.call('ZSCORE', sessions, session))
  if score then place(sessions, saved, session, score, redis.call('LLEN', queue) > 0) end
  if redis.call('ZCARD', sessions) > 0
      or redis.call('LLEN', key_queue(prefix, class, tenant, user)) > 0 then
    return true
  end
  redis.call('DEL', saved, count)
  return false
end

-- The dispatch cost charged for a request stored with `cost` (its whole estimate of
-- `ptok` prompt tokens uncached) and `credit` (taken off per prompt token predicted
-- cached) when the backend's prefix index predicts `uncached` of them to compute
-- (policies/fairness.py predicted_cost).
local function predicted_cost(cost, credit, ptok, uncached)
  return cost - credit * math.max(0, ptok - uncached)
end
