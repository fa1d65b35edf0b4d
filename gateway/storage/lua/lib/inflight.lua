-- In-flight state of a backend's requests: grant (a queued request becomes dispatched
-- there), start (its first token streamed) and the one release every path that frees a
-- request takes (settle.lua, reap.lua, cancel.lua).

-- inflight_for(prefix, backend, replica, k, recent_kept, now, stamp, sent_at), k = the key
-- names {user_inflight, sent, backend_inflight, recent, prefill}; `sent_at` the score of a
-- grant in the sent set (after the stored snapshot: gate_counts).
local function inflight_for(prefix, backend, replica, k, recent_kept, now, stamp, sent_at)
  local I = {}

  -- grant request `id` (hash `req`) of `user` in `class`, whose client `owner` holds,
  -- with `tokens` uncached prompt tokens (those its dispatch cost charged, kept as
  -- `ctok`): its vLLM priority rank (the user's requests
  -- already in flight), the per-user and per-backend counts, the sent-since-snapshot set,
  -- the owner's running set (or its grant list when another replica holds the client),
  -- the backend's dispatch counter, the recent classes and the pending prefill. Returns the rank and the backend's
  -- requests in flight.
  function I.grant(id, req, class, user, owner, tokens)
    local rank = redis.call('HINCRBY', k.user_inflight, user, 1) - 1
    redis.call('ZADD', k.sent, sent_at, id)
    local inflight = redis.call('INCR', k.backend_inflight)
    -- the backend's scraper reads it to see work came (a short request can end between
    -- two of its looks and leave no other trace)
    redis.call('INCR', key_backend_dispatches(prefix, backend))
    redis.call('HSET', req, 'state', 'dispatched', 'backend', backend, 'rank', rank,
      'dispatched_at', now, 'ctok', tokens)
    redis.call('SADD', key_running(prefix, owner), id)
    redis.call('LPUSH', k.recent, class)
    redis.call('LTRIM', k.recent, 0, recent_kept - 1)
    if owner ~= replica then
      redis.call('RPUSH', key_grants(prefix, owner), grant_entry(id, backend, rank, stamp,
        tokens))
    end
    if tokens > 0 then redis.call('HSET', k.prefill, id, prefill_entry(tokens, stamp)) end
    return rank, inflight
  end

  return I
end

-- Request `id` streams its first token on `backend` since `at`: it runs there, so it no
-- longer counts against the gate as dispatched since the snapshot; its prefill is done;
-- it took a batch slot the snapshot may have seen free, so it joins the
-- started-since-snapshot set (policies/gates.py Gate.used). One sent before the stored
-- snapshot counts on as that snapshot counted it (running, waiting or "unseen") until
-- the next: the gateway sees a first token after vLLM scheduled it, often after a scrape
-- that showed it running, so its start says nothing of what that snapshot saw (taking
-- one "unseen" for it let one more request wait: tests/test_pacing.py). A start the
-- stored snapshot already shows (its scrape began after `at`: a start sent late, see
-- start_each) does not join the started set of a decision by it. It no longer counts
-- among the requests sent before the stored snapshot that have not started, which bound
-- its "unseen" (gate_counts in _lib.lua): once they are fewer, the others it counted have
-- started, and a start frees a place there too. Returns 1 when a gate slot was freed (it
-- was sent since the stored snapshot, or that bound took one), 0 otherwise.
local function start_inflight(prefix, backend, id, at)
  local req = key_request(prefix, id)
  if redis.call('EXISTS', req) == 0 then return 0 end  -- settled (or reaped) already
  if redis.call('HEXISTS', req, 'left') == 1 then return 0 end  -- it left the backend
  if redis.call('HSETNX', req, 'started', 1) == 0 then return 0 end
  redis.call('HDEL', key_backend_prefill(prefix, backend), id)
  local snapshot = key_backend_snapshot(prefix, backend)
  local stored_at, prev_at, unseen = unpack(redis.call('HMGET', snapshot, 'taken_at',
    'prev_at', 'unseen'))
  local taken_at = tonumber(stored_at) or 0
  local sent = leave_sent(prefix, backend, id, taken_at)
  -- a decision still made by the snapshot before the stored one counts it too (gate_counts)
  if at > (tonumber(prev_at) or taken_at) then
    redis.call('ZADD', key_backend_started(prefix, backend), at, id)
  end
  if sent == 2 then  -- sent before the snapshot: did the bound on its "unseen" move?
    local before = redis.call('ZCOUNT', key_backend_sent(prefix, backend), '-inf',
      stored_at or '+inf')
    return (tonumber(unseen) or 0) > before and 1 or 0
  end
  return sent
end

-- The starts a call carries (started.lua, and those a replica held back while nothing
-- was queued, sent with its next enqueue or settle: gateway/scheduling/held_starts.py): a list of
-- {id, backend, at}. Returns the number of gate slots freed.
local function start_each(prefix, starts)
  local freed = 0
  for _, s in ipairs(starts or {}) do
    freed = freed + start_inflight(prefix, s.backend, s.id, s.at)
  end
  return freed
end

-- Take request `id` out of its user's `queue` in `class` (`head`: it is the queue's
-- first) and out of the class's depth; a class left with nothing queued is no longer
-- backlogged. False when it was not queued.
local function unqueue(prefix, class, queue, id, head)
  if head then
    redis.call('LPOP', queue)
  elseif redis.call('LREM', queue, 1, id) == 0 then
    return false
  end
  if redis.call('HINCRBY', key_depth(prefix), class, -1) <= 0 then
    redis.call('HDEL', key_backlogged_since(prefix), class)
  end
  return true
end

-- Out of `backend`'s in-flight state: its in-flight count, pending prefill, started and
-- sent sets, the user's in-flight count and the owner's running set. True when it was
-- sent after the stored snapshot (so not among its "unseen").
local function release_inflight(prefix, id, user, backend, owner)
  redis.call('HDEL', key_backend_prefill(prefix, backend), id)
  redis.call('ZREM', key_backend_started(prefix, backend), id)
  if owner then redis.call('SREM', key_running(prefix, owner), id) end
  local users = key_user_inflight(prefix)
  if redis.call('HINCRBY', users, user, -1) <= 0 then redis.call('HDEL', users, user) end
  local inflight = key_backend_inflight(prefix, backend)
  if redis.call('DECR', inflight) <= 0 then redis.call('DEL', inflight) end
  local taken_at = redis.call('HGET', key_backend_snapshot(prefix, backend), 'taken_at')
  return leave_sent(prefix, backend, id, tonumber(taken_at) or 0) == 1
end

-- The one release: request `id` leaves wherever it is. `f`: its {state, user, class,
-- tenant, session, owner, backend, started}. Queued (cancel.lua): out of its user's
-- queue (its session's: session_left in _lib.lua), and a user (tenant) left with
-- nothing queued leaves its tenant's users (the class's tenants), keeping its score.
-- Dispatched (settle.lua, reap.lua): out of its backend's in-flight state; one it was
-- dispatched before the snapshot and never seen starting may be among the snapshot's
-- "unseen", and is gone now. Its hash goes. False when there was
-- nothing to release (no longer queued; released already).
local function release_request(prefix, id, f)
  local req = key_request(prefix, id)
  if f.state == 'queued' then
    local queue = queue_of(prefix, f.class, f.tenant, f.user, f.session)
    if not unqueue(prefix, f.class, queue, id, false) then return false end
    redis.call('DEL', req)
    local queued
    if f.session then
      queued = session_left(prefix, f.class, f.tenant, f.user, f.session, queue)
    else
      queued = redis.call('LLEN', queue) > 0
    end
    if not queued then leave(prefix, f.class, f.tenant, f.user) end
    return true
  end
  -- a segment that left its backend (leave_inflight) was released there already
  local left = redis.call('HGET', req, 'left') == '1'
  if redis.call('DEL', req) == 0 then return false end
  if left then
    if f.owner then redis.call('SREM', key_running(prefix, f.owner), id) end
    return true
  end
  if not (f.user and f.backend) then return false end
  if not release_inflight(prefix, id, f.user, f.backend, f.owner) and not f.started then
    take_unseen(key_backend_snapshot(prefix, f.backend))
  end
  return true
end

-- A segment of an answer that continues elsewhere (moved on purpose, or its backend
-- failed: gateway/scheduling/admission.py) leaves `backend` when its continuation is
-- queued: out of the backend's in-flight state and its user's count, as a release, so
-- the slot vLLM freed counts as free at once (else it would read as "unseen" in every
-- snapshot until the whole answer ends, and hold the gates closed). Its hash stays,
-- marked `left`, until the answer settles: it keeps the answer's preemption count, and
-- its owner's running set still names it (release_request then only forgets it).
local function leave_inflight(prefix, id, backend)
  local req = key_request(prefix, id)
  local f = request_get(req, 'state', 'user', 'backend', 'started', 'left')
  if f.state ~= 'dispatched' or f.left or f.backend ~= backend or not f.user then return end
  redis.call('HSET', req, 'left', 1)
  if not release_inflight(prefix, id, f.user, backend, nil) and not f.started then
    take_unseen(key_backend_snapshot(prefix, backend))
  end
end
