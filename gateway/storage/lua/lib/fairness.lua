-- Two-level fair share within a class (policies/fairness.py): the tenant with the
-- smallest tenant score, then its user with the smallest user score, then that user's
-- oldest request; with a locality slack, the best cached request of the users within it
-- at both levels. With sessions on (`sessions` true), a user's queue is that of its
-- least-served session (sessions zset; none: the default session, its own queue), and a
-- dispatch charges the session too. fairness_for(prefix, pools, locality, sessions) over
-- pools_for and locality_for.
local RANGE_SCAN = 64  -- users looked at (fairness order) for a request a backend takes

-- the smallest score of a zset: member, score (nil when empty)
local function least(zset)
  local top = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
  if not top[1] then return nil end
  return top[1], tonumber(top[2])
end

local function fairness_for(prefix, pools, locality, sessions)
  local F = {}
  local slack, compared, lookahead = locality.slack, locality.candidates, locality.lookahead

  -- the session a user's next request comes from (nil: sessions off)
  function F.session(class, tenant, user)
    if not sessions then return nil end
    return least(key_sessions(prefix, class, tenant, user)) or ''
  end

  local function head(class, tenant, user)
    return redis.call('LRANGE', queue_of(prefix, class, tenant, user,
      F.session(class, tenant, user)), 0, lookahead - 1)
  end

  -- the first request, in fairness order (tenants, their users, each user's first
  -- `lookahead`), that the backend's prompt range takes, of at most `room` estimated
  -- prompt tokens when given: (tenant, user, request) or nil
  local function first_fitting(active, class, room)
    local left = RANGE_SCAN
    for _, tenant in ipairs(redis.call('ZRANGE', active, 0, RANGE_SCAN - 1)) do
      local users = redis.call('ZRANGE', key_users(prefix, class, tenant), 0, left - 1)
      for _, user in ipairs(users) do
        for _, id in ipairs(head(class, tenant, user)) do
          if pools.fits(id, room) then return tenant, user, id end
        end
      end
      left = left - #users
      if left <= 0 then break end
    end
    return nil
  end

  -- (tenant, user, request, its held blocks) to serve: the least-served user of the
  -- least-served tenant, or, with a slack, among the users within it of their tenant's
  -- least-served user, of the tenants within it of the least-served tenant (at most
  -- `compared` users in all, in fairness order), the one with the best cached request
  -- among the first `lookahead` of its queue (request nil: the queue's head); nil when
  -- none (every such request is left to its own backend). Only requests the backend's
  -- prompt range takes are considered, and with `room` (a backfill past a request the
  -- prefill gate holds) only those whose uncached tokens fit in it. An active tenant
  -- without users (never left by the scripts) is dropped.
  function F.pick(active, class, room)
    if slack <= 0 then
      if pools.ranged or room then return first_fitting(active, class, room) end
      while true do
        local tenant = least(active)
        if not tenant then return nil end
        local user = least(key_users(prefix, class, tenant))
        if user then return tenant, user, nil end
        redis.call('ZREM', active, tenant)
      end
    end
    local _, top_score = least(active)
    if not top_score then return nil end
    local tenants = redis.call('ZRANGEBYSCORE', active, top_score, top_score + slack,
      'LIMIT', 0, compared)
    local best_tenant, best, best_id, best_len = nil, nil, nil, -1
    local left = compared
    for _, tenant in ipairs(tenants) do
      local users = key_users(prefix, class, tenant)
      local _, floor = least(users)
      if floor then
        local near = redis.call('ZRANGEBYSCORE', users, floor, floor + slack, 'LIMIT', 0, left)
        for _, user in ipairs(near) do
          for _, id in ipairs(head(class, tenant, user)) do
            if pools.fits(id) then
              local length, elsewhere = locality.matched(id)
              if not elsewhere and length > best_len
                  and (not room or pools.fits(id, room, length * pools.block_tokens)) then
                best_tenant, best, best_id, best_len = tenant, user, id, length
              end
            end
          end
        end
        left = left - #near
        if left <= 0 then break end
      end
    end
    return best_tenant, best, best_id, best_id and best_len or nil
  end

  -- after `user` of `tenant` was served (its request taken out of `queue`, its
  -- `session`'s): each score grows by the request's cost at its level (`cost`, `tcost`: 0
  -- for a dropped request; a session's by the user-level cost), and a session, user or
  -- tenant left with nothing queued leaves its active set, its score saved (a tenant's
  -- last user's score is the floor its next user starts from)
  function F.charge(class, tenant, user, session, queue, active, saved, cost, tcost)
    local users = key_users(prefix, class, tenant)
    local score = (tonumber(redis.call('ZSCORE', users, user)) or 0) + cost
    local tscore = (tonumber(redis.call('ZSCORE', active, tenant)) or 0) + tcost
    local queued
    if session then
      local sscore = redis.call('ZSCORE', key_sessions(prefix, class, tenant, user), session)
      queued = session_left(prefix, class, tenant, user, session, queue,
        sscore and tonumber(sscore) + cost)
    else
      queued = redis.call('LLEN', queue) > 0
    end
    place(users, key_user_saved(prefix, class, tenant), user, score, queued)
    local tenant_active = redis.call('ZCARD', users) > 0
    if not tenant_active then redis.call('HSET', key_user_floor(prefix, class), tenant, score) end
    place(active, saved, tenant, tscore, tenant_active)
  end

  return F
end
