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
