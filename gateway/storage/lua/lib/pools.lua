-- Length-aware pools, LoRA adapters and the prefill-token gate on one backend
-- (policies/prefill.py, docs/adapters.md).
-- pools_for(prefix, range, block_tokens, adapters): range = {min, max} estimated prompt
-- tokens the backend takes (0: no bound); adapters = the LoRA adapters it has (nil: its
-- model has none, no request names one).
-- the set of a backend's adapter names (nil: its model has none)
local function adapter_set(adapters)
  if not adapters then return nil end
  local has = {}
  for _, name in ipairs(adapters) do has[name] = true end
  return has
end

-- whether a backend of prompt range `range` having the adapters `has` (adapter_set)
-- takes a request of `tokens` estimated prompt tokens naming `adapter` (nil: none)
-- (PromptRange.admits)
local function range_takes(range, has, tokens, adapter)
  if adapter and has and not has[adapter] then return false end
  return tokens >= range.min and (range.max <= 0 or tokens <= range.max)
end

local function pools_for(prefix, range, block_tokens, adapters)
  local has = adapter_set(adapters)
  local P = {ranged = range.min > 0 or range.max > 0 or has ~= nil, block_tokens = block_tokens}

  -- whether the backend's prompt range takes a queued request (PromptRange.admits) and
  -- has the adapter it names (if any) and, with `room` (nil: any), whether its estimated
  -- prompt tokens less `cached` tokens (default none) fit in it; a request whose hash is
  -- gone fits anywhere, to be dropped
  function P.fits(id, room, cached)
    if not P.ranged and not room then return true end
    local fields = request_get(key_request(prefix, id), 'ptok', 'adapter')
    local tokens = tonumber(fields.ptok)
    if not tokens then return true end
    if room and math.max(0, tokens - (cached or 0)) > room then return false end
    return range_takes(range, has, tokens, fields.adapter)
  end

  -- over the class's prefill-token limit (prefill_fits) the fair choice waits for a
  -- backend with room; for backfill_s after it was first held a smaller request that fits
  -- the room may pass it here (may_backfill), then the backend drains. Returns the room a
  -- backfill may use, nil when the request fits, false when the class stops here.
  function P.hold(req, tokens, pending, limit, now, stamp, backfill_s)
    if limit <= 0 or pending <= 0 or pending + tokens <= limit then return nil end
    local since = tonumber(redis.call('HGET', req, 'held_at'))
    if not since then
      redis.call('HSET', req, 'held_at', stamp)
      since = now
    end
    if now - since >= backfill_s then return false end
    return limit - pending
  end

  return P
end
