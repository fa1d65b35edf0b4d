-- The prefix index of one backend: read (how much of a prompt it holds, whether another
-- backend should take it), record what was sent, trim (policies/locality.py).
-- locality_for(prefix, backend, loc, load, now): loc = {slack, candidates, index_size,
-- index_ttl_s, max_imbalance, lookahead, others, fits}; load = the backend's requests in
-- flight; fits (optional) = what each of the others takes, {min, max, adapters} as `range`
-- and `adapters` of dispatch_for (one not listed takes any request).
-- The index (key_backend_prefixes) holds the block hashes of the prompts sent to a
-- backend, scored by last use; the choice mirrors choose() and held_elsewhere() over the
-- candidates of within_slack().
local function locality_for(prefix, backend, loc, load, now)
  local L = {slack = loc.slack, candidates = loc.candidates, lookahead = loc.lookahead,
             index_size = loc.index_size}
  local index = key_backend_prefixes(prefix, backend)
  local fits = {}
  for name, fit in pairs(loc.fits or {}) do
    fits[name] = {range = fit, has = adapter_set(fit.adapters)}
  end

  -- whether another backend takes a request (its prompt range, its adapters): one that
  -- does not is never waited for, it would hold the request forever
  local function other_takes(other, tokens, adapter)
    local fit = fits[other]
    return not fit or not tokens or range_takes(fit.range, fit.has, tokens, adapter)
  end

  local function held_by_other(first, tokens, adapter)
    for _, other in ipairs(loc.others) do
      if other_takes(other, tokens, adapter)
          and redis.call('ZSCORE', key_backend_prefixes(prefix, other), first) then
        return other
      end
    end
    return nil
  end

  -- how many leading block hashes of a chain this backend's index holds
  function L.held_blocks(chain)
    local m = 0
    if not chain then return m end
    for h in string.gmatch(chain, '%S+') do
      if not redis.call('ZSCORE', index, h) then break end
      m = m + 1
    end
    return m
  end

  -- leading block hashes of a queued request's prompt found in this backend's index, and
  -- whether another backend that takes the request, not busier than this one by more
  -- than max_imbalance, holds its first block (then it is left for that one)
  function L.matched(id)
    local fields = request_get(key_request(prefix, id), 'prefix', 'ptok', 'adapter')
    local chain = fields.prefix
    local m = L.held_blocks(chain)
    if m > 0 or not chain then return m, false end
    local first = string.match(chain, '%S+')
    if not first then return m, false end
    local tokens = tonumber(fields.ptok)
    for _, other in ipairs(loc.others) do
      if other_takes(other, tokens, fields.adapter)
          and redis.call('ZSCORE', key_backend_prefixes(prefix, other), first) then
        local busy = tonumber(redis.call('GET', key_backend_inflight(prefix, other))) or 0
        if busy <= load + loc.max_imbalance then return 0, true end
      end
    end
    return 0, false
  end

  -- the index records a granted prompt's chain (`tokens`, `adapter`: the request's);
  -- returns what it held before, for fairgate_dispatch_decisions_total and the predicted
  -- hit rate: {held (leading blocks it held), blocks (of the chain), reason} (cache_hit;
  -- load under least_loaded or when a busier backend that takes it holds the first
  -- block; fairness_order when none holds it)
  function L.record(chain, tokens, adapter)
    if loc.index_size <= 0 or not chain then return {held = 0, blocks = 0, reason = 'load'} end
    local held, blocks, first = 0, 0, nil
    for h in string.gmatch(chain, '%S+') do
      first = first or h
      if redis.call('ZADD', index, now, h) == 0 and held == blocks then held = held + 1 end
      blocks = blocks + 1
    end
    if held > 0 then return {held = held, blocks = blocks, reason = 'cache_hit'} end
    if loc.slack > 0 and first and held_by_other(first, tonumber(tokens), adapter) then
      return {held = 0, blocks = blocks, reason = 'load'}
    end
    return {held = 0, blocks = blocks, reason = loc.slack > 0 and 'fairness_order' or 'load'}
  end

  -- LRU-trimmed and expiring, like a cache
  function L.trim()
    if loc.index_size <= 0 then return end
    redis.call('ZREMRANGEBYSCORE', index, '-inf', now - loc.index_ttl_s)
    redis.call('ZREMRANGEBYRANK', index, 0, -loc.index_size - 1)
    redis.call('EXPIRE', index, loc.index_ttl_s)
  end

  return L
end
