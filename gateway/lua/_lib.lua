-- Shared helpers, prepended to every script after the generated key functions.

-- "unseen" (a field of a backend's snapshot hash): requests dispatched before the
-- snapshot and not yet registered by the server (running + waiting). snapshot.lua sets
-- it; a request seen starting (started.lua) or settled first (settle.lua) takes itself
-- out once. Returns 1 when one was taken.
local function take_unseen(snapshot)
  local unseen = tonumber(redis.call('HGET', snapshot, 'unseen')) or 0
  if unseen > 0 then
    redis.call('HSET', snapshot, 'unseen', unseen - 1)
    return 1
  end
  return 0
end

-- A replica is alive while its heartbeat is fresher than `ttl` seconds and it picks up
-- the grants other replicas push to it (its listener waits on that list all the time):
-- a grant left unread for `pickup` seconds means the replica died, whatever its last
-- heartbeat says. A grant entry is "id\tbackend\trank\tpushed_at".
local function replica_alive(replicas, prefix, replica, now, ttl, pickup)
  local beat = redis.call('ZSCORE', replicas, replica)
  if not beat or tonumber(beat) < now - ttl then return false end
  local head = redis.call('LINDEX', key_grants(prefix, replica), 0)
  if head then
    local pushed_at = tonumber(string.match(head, '([^\t]+)$'))
    if pushed_at and pushed_at < now - pickup then return false end
  end
  return true
end
